"""Bitwise ops on integer and bool tensors: and/or/xor/not and shifts.

Shifts follow PyTorch: a shift by a negative amount or by at least the bit width gives 0 for
``<<`` and the sign fill for ``>>`` (``-5 >> 40 == -1``); ``>>`` is arithmetic for signed
types.  Core AI has no shift op, so shifts are multiplications / floor divisions by powers
of two (integer multiplication wraps like a shift).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from coreai_torch._mlir import cai, ir
from coreai_torch.lowerings.common import dtype_of
from coreai_torch.lowerings.elementwise import Operand, const_like, gt, operand
from coreai_torch.lowerings.registry import LoweringContext, lowering


def _operands(cx: LoweringContext, a: Operand, b: Operand) -> tuple[ir.Value, ir.Value]:
    dtype = cx.out_dtype
    if dtype.is_floating_point:
        raise cx.unsupported(f"bitwise ops are not defined for {dtype}")
    return operand(a, dtype), operand(b, dtype)


def _bitwise(fn: Callable[[ir.Value, ir.Value], ir.Value]) -> Callable:
    def rule(cx: LoweringContext, self: Operand, other: Operand) -> ir.Value:
        return fn(*_operands(cx, self, other))

    return rule


for _name, _fn in {
    "and": cai.broadcasting_bitwise_and,
    "or": cai.broadcasting_bitwise_or,
    "xor": cai.broadcasting_bitwise_xor,
}.items():
    lowering(
        f"aten::bitwise_{_name}.Tensor",
        f"aten::bitwise_{_name}.Scalar",
        f"aten::bitwise_{_name}.Scalar_Tensor",
        f"aten::__{_name}__.Tensor",
        f"aten::__{_name}__.Scalar",
    )(_bitwise(_fn))


@lowering("aten::bitwise_not.default")
def bitwise_not(cx: LoweringContext, self: ir.Value) -> ir.Value:
    dtype = dtype_of(self)
    if dtype == torch.bool:
        return cai.not_(self)
    if dtype.is_floating_point:
        raise cx.unsupported(f"bitwise_not is not defined for {dtype}")
    all_ones = -1 if dtype.is_signed else torch.iinfo(dtype).max
    return cai.broadcasting_bitwise_xor(self, const_like(all_ones, self))


def _bits(dtype: torch.dtype) -> int:
    return torch.iinfo(dtype).bits


def _power_of_two(shift: ir.Value, limit: int) -> ir.Value:
    """``2 ** min(max(shift, 0), limit)`` in ``shift``'s dtype."""
    clamped = cai.broadcasting_minimum(
        cai.broadcasting_maximum(shift, const_like(0, shift)), const_like(limit, shift)
    )
    return cai.broadcasting_pow(const_like(2, shift), clamped)


def _out_of_range(shift: ir.Value, bits: int) -> ir.Value:
    return cai.broadcasting_or(
        gt(const_like(0, shift), shift), gt(shift, const_like(bits - 1, shift))
    )


def left_shift_values(x: ir.Value, shift: ir.Value) -> ir.Value:
    bits = _bits(dtype_of(x))
    shifted = cai.broadcasting_mul(x, _power_of_two(shift, bits - 1))
    return cai.broadcasting_where(_out_of_range(shift, bits), const_like(0, x), shifted)


def right_shift_values(x: ir.Value, shift: ir.Value) -> ir.Value:
    """Arithmetic shift = floor division by ``2**shift``, done in two steps so that the
    divisor stays positive (``2**(bits-1)`` overflows a signed type)."""
    dtype = dtype_of(x)
    bits = _bits(dtype)
    limit = bits - 1 if dtype.is_signed else bits
    clamped = cai.broadcasting_where(_out_of_range(shift, bits), const_like(limit, shift), shift)
    first = cai.broadcasting_minimum(clamped, const_like(bits - 2, shift))
    second = cai.broadcasting_sub(clamped, first)
    out = cai.broadcasting_floor_divide(x, _power_of_two(first, bits - 2))
    return cai.broadcasting_floor_divide(out, _power_of_two(second, 2))


def _shift_operands(cx: LoweringContext, a: Operand, b: Operand) -> tuple[ir.Value, ir.Value]:
    x, s = _operands(cx, a, b)
    if dtype_of(x) == torch.bool:
        raise cx.unsupported("shifts are not defined for bool tensors")
    return x, s


@lowering(
    "aten::bitwise_left_shift.Tensor",
    "aten::bitwise_left_shift.Tensor_Scalar",
    "aten::bitwise_left_shift.Scalar_Tensor",
    "aten::__lshift__.Tensor",
    "aten::__lshift__.Scalar",
)
def left_shift(cx: LoweringContext, self: Operand, other: Operand) -> ir.Value:
    return left_shift_values(*_shift_operands(cx, self, other))


@lowering(
    "aten::bitwise_right_shift.Tensor",
    "aten::bitwise_right_shift.Tensor_Scalar",
    "aten::bitwise_right_shift.Scalar_Tensor",
    "aten::__rshift__.Tensor",
    "aten::__rshift__.Scalar",
)
def right_shift(cx: LoweringContext, self: Operand, other: Operand) -> ir.Value:
    return right_shift_values(*_shift_operands(cx, self, other))
