"""Compression element types by name (``"int4"``, ``"uint8"``, ``"fp8_e4m3fn"``, ...), as
coreai-opt's IR passes name them."""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

__all__ = ["builtin_to_string", "is_int", "nptype_from_builtin", "string_to_builtin"]


@dataclass(frozen=True)
class CompressionType:
    """An element type of compressed data: integers of 1 to 8 bits, or a small float."""

    name: str
    bits: int
    integer: bool
    unsigned: bool = False

    def get_bitwidth(self) -> int:
        return self.bits

    def is_unsigned(self) -> bool:
        return self.unsigned

    def __str__(self) -> str:
        return self.name


_FLOATS = {
    "fp4_e2m1": (4, ml_dtypes.float4_e2m1fn),
    "fp4_e2m1fn": (4, ml_dtypes.float4_e2m1fn),
    "fp8_e4m3fn": (8, ml_dtypes.float8_e4m3fn),
    "fp8_e5m2": (8, ml_dtypes.float8_e5m2),
    "fp8_e8m0fnu": (8, ml_dtypes.float8_e8m0fnu),
}
_TYPES = {
    **{f"int{b}": CompressionType(f"int{b}", b, True) for b in range(1, 9)},
    **{f"uint{b}": CompressionType(f"uint{b}", b, True, True) for b in range(1, 9)},
    **{name: CompressionType(name, bits, False) for name, (bits, _) in _FLOATS.items()},
}


def string_to_builtin(name: str) -> CompressionType:
    """The type named ``name`` (a string, or a str enum such as coreai-opt's ``DType``)."""
    key = str(getattr(name, "value", name)).lower()
    try:
        return _TYPES[key]
    except KeyError:
        raise ValueError(
            f"unknown compression type {name!r} (known: {', '.join(sorted(_TYPES))})"
        ) from None


def builtin_to_string(dtype: CompressionType) -> str:
    return dtype.name


def is_int(dtype: object) -> bool:
    return isinstance(dtype, CompressionType) and dtype.integer


def nptype_from_builtin(dtype: CompressionType) -> type[np.generic]:
    """The numpy type holding one code (8-bit integers for sub-byte codes)."""
    if dtype.integer:
        return np.uint8 if dtype.unsigned else np.int8
    return _FLOATS[dtype.name][1]
