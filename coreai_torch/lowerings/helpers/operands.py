"""Operands converted like PyTorch converts them: type promotion over tensors and Python
scalars, integer conversions that wrap around (Core AI's cast saturates), the dtype multi-step
float formulas compute in (``opmath``), and symbolic scalars as 0-d values.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import numpy as np
import torch
import torch._prims_common as prims

from coreai_torch import dtypes
from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import (
    Scalar,
    cast,
    constant,
    dtype_of,
    index_value,
    rank_of,
    squeeze,
)

#: A tensor (as a Core AI value) or a Python scalar.
Operand: TypeAlias = ir.Value | Scalar
#: A symbolic (SymInt/SymFloat/SymBool) operand: a value or a Python number.
SymOperand: TypeAlias = ir.Value | bool | int | float


def is_value(x: object) -> bool:
    return isinstance(x, ir.Value)


def is_float_value(x: ir.Value) -> bool:
    return dtype_of(x).is_floating_point


def const_like(value: Scalar, like: ir.Value) -> ir.Value:
    """A 0-d constant with the element type of ``like``."""
    return constant(value, dtype_of(like))


def numeric(x: ir.Value) -> ir.Value:
    """Bool values as uint8 (Core AI's numeric ops reject ``i1``); others unchanged."""
    return cast(x, torch.uint8) if dtype_of(x) == torch.bool else x


def opmath(dtype: torch.dtype) -> torch.dtype:
    """The dtype PyTorch computes multi-step float formulas in (float32 for 16-bit floats)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _fake(x: ir.Value | Scalar) -> Any:
    if isinstance(x, ir.Value):
        return torch.empty([1] * rank_of(x), dtype=dtype_of(x), device="meta")
    return x


def result_dtype(
    *operands: ir.Value | Scalar,
    kind: prims.ELEMENTWISE_TYPE_PROMOTION_KIND = prims.ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT,
) -> torch.dtype:
    """PyTorch's type promotion over tensors (Core AI values) and Python scalars."""
    fakes = [_fake(x) for x in operands if x is not None]
    _, dtype = prims.elementwise_dtypes(*fakes, type_promotion_kind=kind)
    return dtype


def uint64_bits(x: ir.Value) -> ir.Value:
    """An int64 value as the uint64 with the same bits (``-1`` -> ``2**64 - 1``), as PyTorch
    converts; Core AI's cast saturates negative values to 0."""
    negative = cai.broadcasting_greater(constant(0, torch.int64), x)
    shifted = cai.broadcasting_where(
        negative, cai.broadcasting_sub(x, constant(-(2**63), torch.int64)), x
    )
    u = cast(shifted, torch.uint64)
    return cai.broadcasting_where(
        negative, cai.broadcasting_add(u, constant(2**63, torch.uint64)), u
    )


def wrap_integer(value: ir.Value, dtype: torch.dtype) -> ir.Value:
    """Integer conversion that wraps around like PyTorch (Core AI's cast saturates)."""
    src = dtype_of(value)
    if src.is_floating_point or src == torch.bool or dtype.is_floating_point:
        return value
    if dtype == torch.uint64 and src.is_signed:
        return uint64_bits(cast(value, torch.int64))
    if dtype == torch.bool or src in (torch.uint64,) or dtype in (torch.uint64, torch.int64):
        return value
    s, d = torch.iinfo(src), torch.iinfo(dtype)
    if d.min <= s.min and s.max <= d.max:
        return value
    # ((x - min) mod span + span) mod span + min, in int64 (C-style modulo keeps the sign).
    wide = cast(value, torch.int64)
    span = constant(d.max - d.min + 1, torch.int64)
    shifted = cai.broadcasting_sub(wide, constant(d.min, torch.int64))
    wrapped = cai.broadcasting_modulo(
        cai.broadcasting_add(cai.broadcasting_modulo(shifted, span), span), span
    )
    return cai.broadcasting_add(wrapped, constant(d.min, torch.int64))


def operand(x: Operand, dtype: torch.dtype) -> ir.Value:
    """``x`` converted to ``dtype`` like PyTorch converts operands: integers wrap around
    (``uint8_tensor + (-3)`` adds 253), where Core AI's cast would saturate."""
    if isinstance(x, ir.Value):
        return cast(wrap_integer(x, dtype), dtype)
    if isinstance(x, int) and not isinstance(x, bool) and dtypes.is_integer(dtype):
        info = torch.iinfo(dtype)
        x = (x - info.min) % (info.max - info.min + 1) + info.min
    return constant(x, dtype)


def sym_scalar(x: SymOperand) -> ir.Value:
    """A symbolic operand as a 0-d value: ints si32, floats f32, bools i1."""
    if isinstance(x, ir.Value):
        return squeeze(x, list(range(rank_of(x))))
    if isinstance(x, bool):
        return cai.constant(np.bool_(x))
    if isinstance(x, int):
        return index_value(x)
    return cai.constant(np.float32(x))
