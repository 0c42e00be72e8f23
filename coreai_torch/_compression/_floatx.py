"""Packed sub-byte float tensors: :class:`Float4Tensor` (FP4 E2M1, two codes per byte).

coreai-opt hands FP4 weights over as ``Float4Tensor(packed)``: a ``uint8`` tensor holding two
E2M1 codes per byte (the even element in the low nibble, the odd one in the high nibble), so
its last dimension is half the weight's.  The subclass shows the weight's full shape (dtype
``uint8``); its packed bytes are ``SubbyteTensor.elem``.  It survives ``register_buffer``,
``state_dict`` / ``load_state_dict(assign=True)``, ``copy.deepcopy`` and ``torch.export``
(it is a traceable wrapper subclass: export keeps it whole, and ``run_decompositions`` turns it
into its packed ``uint8`` buffer).  The only computation it supports is being decompressed by
``torch.ops.coreai.constexpr_blockwise_shift_scale``, which receives the packed bytes with
``input_dtype=torch.float4_e2m1fn_x2``; the packed layout is the one Core AI stores
``f4E2M1FN`` weights in, so the converter keeps the bytes as they are.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

__all__ = ["Float4Tensor", "SubbyteTensor", "unpack_float4"]

#: the 16 E2M1 values by code (bit 3: sign, bits 2-1: exponent, bit 0: mantissa)
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_TABLE = torch.tensor(_E2M1_VALUES + tuple(-v for v in _E2M1_VALUES), dtype=torch.float32)

_aten = torch.ops.aten
#: ops that give the same packed tensor (or a copy of it) back
_PRESERVING = {
    _aten.detach.default,
    _aten.alias.default,
    _aten.clone.default,
    _aten._to_copy.default,
    _aten.lift_fresh.default,
}


def unpack_float4(packed: torch.Tensor) -> torch.Tensor:
    """The float32 values of ``packed`` (uint8, two E2M1 codes per byte, even element in the
    low nibble): the last dimension doubles."""
    data = packed.view(torch.uint8) if packed.dtype != torch.uint8 else packed
    codes = torch.stack([data & 0xF, data >> 4], dim=-1).flatten(-2).long()
    return _E2M1_TABLE.to(data.device)[codes]


class SubbyteTensor(torch.Tensor):
    """A tensor of sub-byte elements packed into the bytes of :attr:`elem` (``uint8``).

    Subclasses set :attr:`PER_BYTE` (elements per byte) and :attr:`PACKED_DTYPE` (the torch
    dtype of the packed bytes as ``constexpr_blockwise_shift_scale`` reads them)."""

    PER_BYTE: ClassVar[int] = 2
    PACKED_DTYPE: ClassVar[torch.dtype] = torch.float4_e2m1fn_x2
    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> SubbyteTensor:
        if not isinstance(elem, torch.Tensor) or elem.dtype != torch.uint8 or elem.dim() == 0:
            raise TypeError(
                f"{cls.__name__} wraps a uint8 tensor of packed codes (at least 1-D), got "
                f"{getattr(elem, 'dtype', type(elem).__name__)}"
            )
        shape = (*elem.shape[:-1], elem.shape[-1] * cls.PER_BYTE)
        return torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=torch.uint8, device=elem.device, requires_grad=False
        )

    def __init__(self, elem: torch.Tensor) -> None:
        self.elem = elem

    def __repr__(self) -> str:  # type: ignore[override]  # torch's takes a keyword-only option
        return f"{type(self).__name__}(shape={list(self.shape)}, packed={list(self.elem.shape)})"

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["elem"], None

    @classmethod
    def __tensor_unflatten__(
        cls, inner: dict[str, torch.Tensor], meta: Any, outer_size: Any, outer_stride: Any
    ) -> SubbyteTensor:
        return cls(inner["elem"])

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch types it as a plain function
        cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _PRESERVING:
            source = args[0]
            if func is _aten._to_copy.default:  # .to(device) keeps the packed dtype
                kwargs = {k: v for k, v in kwargs.items() if k != "dtype"}
            return cls(func(source.elem, *args[1:], **kwargs))
        if func is torch.ops.coreai.constexpr_blockwise_shift_scale.default:
            data, *rest = args
            if isinstance(data, SubbyteTensor):
                return _packed_call(func, data, rest, kwargs)
        if func is _aten.copy_.default and isinstance(args[1], cls):
            args[0].elem.copy_(args[1].elem)
            return args[0]
        raise NotImplementedError(
            f"{cls.__name__} holds packed codes and only decompresses through "
            f"torch.ops.coreai.constexpr_blockwise_shift_scale; {func} is not supported"
        )


def _packed_call(func: Any, data: SubbyteTensor, rest: list, kwargs: dict) -> Any:
    """``constexpr_blockwise_shift_scale`` on the packed bytes of ``data``."""
    names = ["scale", "zero_point", "minval", "input_dtype", "output_dtype"]
    bound = dict(zip(names, rest, strict=False))
    bound.update(kwargs)
    bound["input_dtype"] = data.PACKED_DTYPE
    scale = bound.pop("scale")
    return func(data.elem, scale, **bound)


class Float4Tensor(SubbyteTensor):
    """FP4 (E2M1) codes, two per byte: ``torch.float4_e2m1fn_x2`` weights of coreai-opt."""

    PER_BYTE = 2
    PACKED_DTYPE = torch.float4_e2m1fn_x2
