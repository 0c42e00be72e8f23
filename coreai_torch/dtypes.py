"""Element types: torch dtypes <-> MLIR element types <-> numpy dtypes.

Dtype policy
------------
* Model inputs, outputs and states keep the dtype the PyTorch program declares — the Core AI
  runtime accepts float64/32/16, bfloat16, int64/32/16/8, uint8 and bool tensors at its I/O,
  so users feed ``int64`` token ids exactly as they do in PyTorch.
* Inside the graph every value keeps its PyTorch dtype too (``int64`` is ``si64``), so results
  match PyTorch bit for bit where the op allows it.  Only *index-like* operands that Core AI
  requires to be 32-bit (gather indices, axes, shapes, permutations, slice bounds) are cast to
  ``si32``/``ui32`` inside the graph by the lowerings.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

from coreai_torch._mlir import ir

_TORCH_TO_MLIR = {
    torch.float32: lambda: ir.F32Type.get(),
    torch.float16: lambda: ir.F16Type.get(),
    torch.bfloat16: lambda: ir.BF16Type.get(),
    torch.float64: lambda: ir.F64Type.get(),
    torch.int64: lambda: ir.IntegerType.get_signed(64),
    torch.int32: lambda: ir.IntegerType.get_signed(32),
    torch.int16: lambda: ir.IntegerType.get_signed(16),
    torch.int8: lambda: ir.IntegerType.get_signed(8),
    torch.uint8: lambda: ir.IntegerType.get_unsigned(8),
    torch.uint16: lambda: ir.IntegerType.get_unsigned(16),
    torch.uint32: lambda: ir.IntegerType.get_unsigned(32),
    torch.uint64: lambda: ir.IntegerType.get_unsigned(64),
    torch.bool: lambda: ir.IntegerType.get_signless(1),
    torch.complex64: lambda: ir.ComplexType.get(ir.F32Type.get()),
    torch.float8_e4m3fn: lambda: ir.Float8E4M3FNType.get(),
    torch.float8_e5m2: lambda: ir.Float8E5M2Type.get(),
    torch.float8_e8m0fnu: lambda: ir.Float8E8M0FNUType.get(),
}

_MLIR_NAME_TO_TORCH = {
    "f32": torch.float32,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "f64": torch.float64,
    "si64": torch.int64,
    "si32": torch.int32,
    "si16": torch.int16,
    "si8": torch.int8,
    "ui8": torch.uint8,
    "ui16": torch.uint16,
    "ui32": torch.uint32,
    "ui64": torch.uint64,
    "i1": torch.bool,
    "complex<f32>": torch.complex64,
    "f8E4M3FN": torch.float8_e4m3fn,
    "f8E5M2": torch.float8_e5m2,
    "f8E8M0FNU": torch.float8_e8m0fnu,
}

_TORCH_TO_NUMPY = {
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.bfloat16: ml_dtypes.bfloat16,
    torch.float64: np.float64,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.int16: np.int16,
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.uint16: np.uint16,
    torch.uint32: np.uint32,
    torch.uint64: np.uint64,
    torch.bool: np.bool_,
    torch.complex64: np.complex64,
    torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn,
    torch.float8_e5m2: ml_dtypes.float8_e5m2,
    torch.float8_e8m0fnu: ml_dtypes.float8_e8m0fnu,
}


def is_supported(dtype: torch.dtype) -> bool:
    """Whether values of ``dtype`` can appear in a Core AI program."""
    return dtype in _TORCH_TO_MLIR


def to_mlir(dtype: torch.dtype) -> ir.Type:
    """The MLIR element type for a torch dtype (needs an active MLIR context)."""
    try:
        return _TORCH_TO_MLIR[dtype]()
    except KeyError:
        supported = ", ".join(str(d).removeprefix("torch.") for d in _TORCH_TO_MLIR)
        raise TypeError(
            f"dtype {dtype} has no Core AI equivalent (supported: {supported})"
        ) from None


def to_torch(element_type: ir.Type) -> torch.dtype:
    """The torch dtype of an MLIR element type."""
    try:
        return _MLIR_NAME_TO_TORCH[str(element_type)]
    except KeyError:
        raise TypeError(f"MLIR element type {element_type} has no torch equivalent") from None


def to_numpy(dtype: torch.dtype) -> type[np.generic]:
    """The numpy scalar type used to build constants of a torch dtype."""
    return _TORCH_TO_NUMPY[dtype]


def tensor_type(shape: list[int | None] | tuple[int | None, ...], dtype: torch.dtype) -> ir.Type:
    """A ranked tensor type; ``None`` dims are dynamic."""
    dims = [ir.ShapedType.get_dynamic_size() if d is None else int(d) for d in shape]
    return ir.RankedTensorType.get(dims, to_mlir(dtype))


def dtype_of(value: ir.Value) -> torch.dtype:
    """The torch dtype of a tensor-typed MLIR value."""
    return to_torch(ir.RankedTensorType(value.type).element_type)


def is_float(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point


def is_integer(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool
