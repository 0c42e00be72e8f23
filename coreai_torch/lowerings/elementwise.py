"""Elementwise ops: arithmetic, comparisons, logic, activations and math functions.

Binary ops follow PyTorch's type promotion (the node's output dtype, or the promoted input
dtype for comparisons) and broadcast like numpy, which Core AI's ``broadcasting_*`` ops do.
Float functions of integer tensors (``exp(int_tensor)``) compute in the output float dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from coreai_torch._mlir import cai, ir
from coreai_torch.lowerings.common import (
    Scalar,
    as_value,
    cast,
    constant,
    dtype_of,
    promote,
)
from coreai_torch.lowerings.registry import LoweringContext, lowering

Operand = ir.Value | Scalar


def _binary_operands(cx: LoweringContext, a: Operand, b: Operand) -> tuple[ir.Value, ir.Value]:
    dtype = cx.out_dtype
    return as_value(a, dtype), as_value(b, dtype)


# ------------------------------------------------------------------------------ arithmetic --


@lowering("aten::add.Tensor", "aten::add.Scalar")
def add(cx: LoweringContext, self: Operand, other: Operand, alpha: Scalar = 1) -> ir.Value:
    a, b = _binary_operands(cx, self, other)
    if alpha != 1:
        b = cai.broadcasting_mul(b, constant(alpha, cx.out_dtype))
    if cx.out_dtype == torch.bool:
        return cai.broadcasting_or(a, b)
    return cai.broadcasting_add(a, b)


@lowering("aten::sub.Tensor", "aten::sub.Scalar")
def sub(cx: LoweringContext, self: Operand, other: Operand, alpha: Scalar = 1) -> ir.Value:
    a, b = _binary_operands(cx, self, other)
    if alpha != 1:
        b = cai.broadcasting_mul(b, constant(alpha, cx.out_dtype))
    return cai.broadcasting_sub(a, b)


@lowering("aten::rsub.Tensor", "aten::rsub.Scalar")
def rsub(cx: LoweringContext, self: Operand, other: Operand, alpha: Scalar = 1) -> ir.Value:
    """``other - alpha * self``."""
    return (
        sub(cx, other, self, alpha)
        if alpha == 1
        else sub(cx, other, cai.broadcasting_mul(*_binary_operands(cx, self, alpha)))
    )


@lowering("aten::mul.Tensor", "aten::mul.Scalar")
def mul(cx: LoweringContext, self: Operand, other: Operand) -> ir.Value:
    a, b = _binary_operands(cx, self, other)
    if cx.out_dtype == torch.bool:
        return cai.broadcasting_and(a, b)
    return cai.broadcasting_mul(a, b)


@lowering("aten::div.Tensor", "aten::div.Scalar")
def div(cx: LoweringContext, self: Operand, other: Operand) -> ir.Value:
    a, b = _binary_operands(cx, self, other)
    return cai.broadcasting_divide(a, b)


@lowering("aten::div.Tensor_mode", "aten::div.Scalar_mode")
def div_mode(
    cx: LoweringContext, self: Operand, other: Operand, rounding_mode: str | None = None
) -> ir.Value:
    dtype = cx.out_dtype
    a, b = as_value(self, dtype), as_value(other, dtype)
    if rounding_mode is None:
        return cai.broadcasting_divide(a, b)
    if rounding_mode == "floor":
        return floor_divide_values(a, b)
    return trunc_divide_values(a, b)


def floor_divide_values(a: ir.Value, b: ir.Value) -> ir.Value:
    """Python/PyTorch floor division for ints and floats."""
    return cai.broadcasting_floor_divide(a, b)


def trunc_divide_values(a: ir.Value, b: ir.Value) -> ir.Value:
    """Division rounding toward zero."""
    dtype = dtype_of(a)
    if dtype.is_floating_point:
        q = cai.broadcasting_divide(a, b)
        return trunc_values(q)
    # Integers: floor division, then add one where the signs differ and there is a remainder.
    q = cai.broadcasting_floor_divide(a, b)
    r = cai.broadcasting_sub(a, cai.broadcasting_mul(q, b))
    zero = constant(0, dtype)
    has_rem = cai.broadcasting_not_equal(r, zero)
    neg = cai.broadcasting_xor(cai.broadcasting_greater(zero, a), cai.broadcasting_greater(zero, b))
    fix = cai.broadcasting_and(has_rem, neg)
    return cai.broadcasting_add(q, cast(fix, dtype))


def trunc_values(x: ir.Value) -> ir.Value:
    """Round toward zero, for floats."""
    dtype = dtype_of(x)
    floor = cai.broadcasting_floor_divide(x, constant(1.0, dtype))
    ceil = cai.broadcasting_sub(
        constant(0.0, dtype),
        cai.broadcasting_floor_divide(
            cai.broadcasting_sub(constant(0.0, dtype), x), constant(1.0, dtype)
        ),
    )
    return cai.broadcasting_where(cai.broadcasting_greater(constant(0.0, dtype), x), ceil, floor)


@lowering("aten::neg.default")
def neg(cx: LoweringContext, self: ir.Value) -> ir.Value:
    return cai.broadcasting_sub(constant(0, cx.out_dtype), self)


@lowering("aten::pow.Tensor_Tensor", "aten::pow.Tensor_Scalar", "aten::pow.Scalar")
def pow_(cx: LoweringContext, self: Operand, exponent: Operand) -> ir.Value:
    dtype = cx.out_dtype
    base = as_value(self, dtype)
    if isinstance(exponent, (int, float)) and not isinstance(exponent, bool):
        if exponent == 1:
            return base
        if exponent == 2:
            return cai.broadcasting_mul(base, base)
        if exponent == 0.5 and dtype.is_floating_point:
            return cai.sqrt(base)
    return cai.broadcasting_pow(base, as_value(exponent, dtype))


def _minmax(fn: Callable) -> Callable:
    def rule(cx: LoweringContext, self: ir.Value, other: ir.Value) -> ir.Value:
        a, b = _binary_operands(cx, self, other)
        return fn(a, b)

    return rule


lowering("aten::maximum.default")(_minmax(cai.broadcasting_maximum))
lowering("aten::minimum.default")(_minmax(cai.broadcasting_minimum))


@lowering("aten::clamp.default", "aten::clamp.Tensor")
def clamp(
    cx: LoweringContext, self: ir.Value, min: Operand | None = None, max: Operand | None = None
) -> ir.Value:
    dtype = cx.out_dtype
    x = cast(self, dtype)
    if min is not None:
        x = cai.broadcasting_maximum(x, as_value(min, dtype))
    if max is not None:
        x = cai.broadcasting_minimum(x, as_value(max, dtype))
    return x


# ------------------------------------------------------------------------------ comparison --


def _compare(a: Operand, b: Operand) -> tuple[ir.Value, ir.Value]:
    x, y = promote(a, b)
    return x, y


@lowering("aten::eq.Tensor", "aten::eq.Scalar")
def eq(cx: LoweringContext, self: Operand, other: Operand) -> ir.Value:
    return cai.broadcasting_equal(*_compare(self, other))


@lowering("aten::ne.Tensor", "aten::ne.Scalar")
def ne(cx: LoweringContext, self: Operand, other: Operand) -> ir.Value:
    return cai.broadcasting_not_equal(*_compare(self, other))


@lowering("aten::gt.Tensor", "aten::gt.Scalar")
def gt(cx: LoweringContext, self: Operand, other: Operand) -> ir.Value:
    return cai.broadcasting_greater(*_compare(self, other))


@lowering("aten::lt.Tensor", "aten::lt.Scalar")
def lt(cx: LoweringContext, self: Operand, other: Operand) -> ir.Value:
    a, b = _compare(self, other)
    return cai.broadcasting_greater(b, a)


@lowering("aten::ge.Tensor", "aten::ge.Scalar")
def ge(cx: LoweringContext, self: Operand, other: Operand) -> ir.Value:
    a, b = _compare(self, other)
    return cai.broadcasting_or(cai.broadcasting_greater(a, b), cai.broadcasting_equal(a, b))


@lowering("aten::le.Tensor", "aten::le.Scalar")
def le(cx: LoweringContext, self: Operand, other: Operand) -> ir.Value:
    a, b = _compare(self, other)
    return cai.broadcasting_or(cai.broadcasting_greater(b, a), cai.broadcasting_equal(a, b))


# -------------------------------------------------------------------------------- logical --


def _to_bool(x: Operand) -> ir.Value:
    if isinstance(x, ir.Value):
        if dtype_of(x) == torch.bool:
            return x
        return cai.broadcasting_not_equal(x, constant(0, dtype_of(x)))
    return constant(bool(x), torch.bool)


@lowering("aten::logical_not.default")
def logical_not(cx: LoweringContext, self: ir.Value) -> ir.Value:
    return cast(cai.not_(_to_bool(self)), cx.out_dtype)


@lowering("aten::logical_and.default")
def logical_and(cx: LoweringContext, self: ir.Value, other: ir.Value) -> ir.Value:
    return cast(cai.broadcasting_and(_to_bool(self), _to_bool(other)), cx.out_dtype)


@lowering("aten::logical_or.default")
def logical_or(cx: LoweringContext, self: ir.Value, other: ir.Value) -> ir.Value:
    return cast(cai.broadcasting_or(_to_bool(self), _to_bool(other)), cx.out_dtype)


@lowering("aten::logical_xor.default")
def logical_xor(cx: LoweringContext, self: ir.Value, other: ir.Value) -> ir.Value:
    return cast(cai.broadcasting_xor(_to_bool(self), _to_bool(other)), cx.out_dtype)


@lowering(
    "aten::where.self", "aten::where.ScalarSelf", "aten::where.ScalarOther", "aten::where.Scalar"
)
def where(cx: LoweringContext, condition: ir.Value, self: Operand, other: Operand) -> ir.Value:
    dtype = cx.out_dtype
    return cai.broadcasting_where(
        _to_bool(condition), as_value(self, dtype), as_value(other, dtype)
    )


# ----------------------------------------------------------------------------- activations --


@lowering("aten::relu.default")
def relu(cx: LoweringContext, self: ir.Value) -> ir.Value:
    if dtype_of(self) == torch.bool:
        return self
    return cai.relu(self)


@lowering("aten::gelu.default")
def gelu(cx: LoweringContext, self: ir.Value, approximate: str = "none") -> ir.Value:
    return cai.gelu(self, approximate=approximate)


@lowering("aten::silu.default")
def silu(cx: LoweringContext, self: ir.Value) -> ir.Value:
    return cai.silu(self)


@lowering("aten::hardtanh.default")
def hardtanh(
    cx: LoweringContext, self: ir.Value, min_val: Scalar = -1.0, max_val: Scalar = 1.0
) -> ir.Value:
    dtype = cx.out_dtype
    x = cai.broadcasting_maximum(self, constant(min_val, dtype))
    return cai.broadcasting_minimum(x, constant(max_val, dtype))


@lowering("aten::leaky_relu.default")
def leaky_relu(cx: LoweringContext, self: ir.Value, negative_slope: Scalar = 0.01) -> ir.Value:
    dtype = cx.out_dtype
    zero = constant(0, dtype)
    scaled = cai.broadcasting_mul(self, constant(negative_slope, dtype))
    return cai.broadcasting_where(cai.broadcasting_greater(self, zero), self, scaled)


# ------------------------------------------------------------------------- math functions --


def _float_unary(fn: Callable[[ir.Value], ir.Value]) -> Callable:
    def rule(cx: LoweringContext, self: ir.Value) -> ir.Value:
        return fn(cast(self, cx.out_dtype))

    return rule


for _name, _fn in {
    "exp": cai.exp,
    "log": cai.log,
    "sqrt": cai.sqrt,
    "rsqrt": cai.rsqrt,
    "sin": cai.sin,
    "cos": cai.cos,
    "tan": cai.tan,
    "tanh": cai.tanh,
    "sigmoid": cai.sigmoid,
    "erf": cai.erf,
    "asin": cai.asin,
    "acos": cai.acos,
    "atan": cai.atan,
    "sinh": cai.sinh,
    "cosh": cai.cosh,
    "asinh": cai.asinh,
    "acosh": cai.acosh,
    "atanh": cai.atanh,
}.items():
    lowering(f"aten::{_name}.default")(_float_unary(_fn))


@lowering("aten::abs.default")
def abs_(cx: LoweringContext, self: ir.Value) -> ir.Value:
    if dtype_of(self) == torch.bool:
        return self
    return cai.abs_(self)


@lowering("aten::reciprocal.default")
def reciprocal(cx: LoweringContext, self: ir.Value) -> ir.Value:
    dtype = cx.out_dtype
    return cai.broadcasting_divide(constant(1.0, dtype), cast(self, dtype))
