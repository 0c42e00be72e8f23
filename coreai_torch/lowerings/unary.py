"""Float math functions: exp/log families, trigonometry, erf family, atan2, hypot.

Integer and bool inputs compute in the result's float dtype (``exp(int_tensor)`` is float32),
like PyTorch.  Functions Core AI lacks are composed so that they keep their precision where
the naive formula loses it (``log1p``/``expm1`` near 0, ``erfc`` in the tail); polynomial
approximations run in float32 for float16/bfloat16 inputs and round once at the end.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import add, cast, dtype_of, less, mul, sub
from coreai_torch.lowerings.helpers.arithmetic import (
    isinf_values,
    neg_values,
    signbit_values,
)
from coreai_torch.lowerings.helpers.float_math import (
    erfc_values,
    expm1_values,
    log1p_values,
    polynomial,
)
from coreai_torch.lowerings.helpers.operands import (
    Operand,
    const_like,
    operand,
)
from coreai_torch.lowerings.registry import LoweringContext, lowering

Unary = Callable[[ir.Value], ir.Value]


def _rule(fn: Unary, *, f32: bool = False) -> Callable:
    """A rule applying ``fn`` in the result dtype (in float32 for 16-bit floats if ``f32``)."""

    def rule(cx: LoweringContext, self: ir.Value) -> ir.Value:
        return in_dtype(fn, cast(self, cx.out_dtype), f32=f32)

    rule.__name__ = fn.__name__
    return rule


def in_dtype(fn: Unary, x: ir.Value, *, f32: bool) -> ir.Value:
    """``fn(x)``, computed in float32 when ``f32`` and ``x`` is float16/bfloat16."""
    dtype = dtype_of(x)
    if f32 and dtype in (torch.float16, torch.bfloat16):
        return cast(fn(cast(x, torch.float32)), dtype)
    return fn(x)


# ------------------------------------------------------------------------------ composites --


def exp2_values(x: ir.Value) -> ir.Value:
    return cai.broadcasting_pow(const_like(2.0, x), x)


def log2_values(x: ir.Value) -> ir.Value:
    return mul(cai.log(x), 1.0 / math.log(2.0))


def log10_values(x: ir.Value) -> ir.Value:
    return mul(cai.log(x), 1.0 / math.log(10.0))


# M. Giles, "Approximating the erfinv function" (single precision).
_ERFINV_CENTRAL = [
    2.81022636e-08,
    3.43273939e-07,
    -3.5233877e-06,
    -4.39150654e-06,
    0.00021858087,
    -0.00125372503,
    -0.00417768164,
    0.246640727,
    1.50140941,
]
_ERFINV_TAIL = [
    -0.000200214257,
    0.000100950558,
    0.00134934322,
    -0.00367342844,
    0.00573950773,
    -0.0076224613,
    0.00943887047,
    1.00167406,
    2.83297682,
]


def erfinv_values(x: ir.Value) -> ir.Value:
    one = const_like(1.0, x)
    w = neg_values(cai.log(cai.broadcasting_mul(sub(one, x), add(x, 1.0))))
    central = polynomial(sub(w, 2.5), _ERFINV_CENTRAL)
    tail = polynomial(sub(cai.sqrt(w), 3.0), _ERFINV_TAIL)
    p = cai.broadcasting_where(less(w, 5.0), central, tail)
    edge = cai.broadcasting_equal(cai.abs_(x), one)
    return cai.broadcasting_where(edge, mul(x, float("inf")), cai.broadcasting_mul(p, x))


def atan2_values(y: ir.Value, x: ir.Value) -> ir.Value:
    """Quadrant-correct ``atan(y / x)`` including signed zeros and infinities."""
    pi = math.pi
    y_negative = signbit_values(y)
    x_negative = signbit_values(x)
    half_turn = cai.broadcasting_where(y_negative, const_like(-pi, y), const_like(pi, y))
    r = cai.atan(cai.broadcasting_divide(y, x))
    r = cai.broadcasting_where(x_negative, cai.broadcasting_add(r, half_turn), r)
    zero = const_like(0.0, x)
    both_zero = cai.broadcasting_and(
        cai.broadcasting_equal(y, zero), cai.broadcasting_equal(x, zero)
    )
    r = cai.broadcasting_where(both_zero, cai.broadcasting_where(x_negative, half_turn, y), r)
    both_inf = cai.broadcasting_and(isinf_values(y), isinf_values(x))
    quarter = cai.broadcasting_where(x_negative, const_like(3 * pi / 4, y), const_like(pi / 4, y))
    quarter = cai.broadcasting_where(y_negative, neg_values(quarter), quarter)
    return cai.broadcasting_where(both_inf, quarter, r)


def hypot_values(a: ir.Value, b: ir.Value) -> ir.Value:
    """``sqrt(a² + b²)`` without overflow; infinite if either is (even with NaN)."""
    a, b = cai.abs_(a), cai.abs_(b)
    big = cai.broadcasting_maximum(a, b)
    small = cai.broadcasting_minimum(a, b)
    ratio = cai.broadcasting_divide(small, big)
    h = cai.broadcasting_mul(big, cai.sqrt(add(cai.broadcasting_mul(ratio, ratio), 1.0)))
    zero = const_like(0.0, a)
    h = cai.broadcasting_where(cai.broadcasting_equal(big, zero), zero, h)
    inf = cai.broadcasting_or(isinf_values(a), isinf_values(b))
    return cai.broadcasting_where(inf, const_like(float("inf"), a), h)


# --------------------------------------------------------------------------------- rules ---

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
    "exp2": exp2_values,
    "log2": log2_values,
    "log10": log10_values,
    "log1p": log1p_values,
    "expm1": expm1_values,
}.items():
    lowering(f"aten::{_name}.default")(_rule(_fn))

lowering("aten::erfc.default")(_rule(erfc_values, f32=True))
lowering("aten::erfinv.default")(_rule(erfinv_values, f32=True))


def _float_operands(cx: LoweringContext, *operands: Operand) -> list[ir.Value]:
    """Operands in the result dtype, float32 for 16-bit floats (composites lose precision)."""
    dtype = cx.out_dtype
    compute = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    return [operand(v, compute) for v in operands]


@lowering("aten::atan2.default", "aten::atan2.out", "aten::arctan2.default")
def atan2(cx: LoweringContext, self: ir.Value, other: ir.Value, out: ir.Value | None = None):
    y, x = _float_operands(cx, self, other)
    return cast(atan2_values(y, x), cx.out_dtype)


@lowering("aten::hypot.default")
def hypot(cx: LoweringContext, self: ir.Value, other: ir.Value) -> ir.Value:
    a, b = _float_operands(cx, self, other)
    return cast(hypot_values(a, b), cx.out_dtype)
