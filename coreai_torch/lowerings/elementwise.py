"""Elementwise arithmetic, rounding, comparisons, logic, ``where`` and min/max/clamp.

Dtype semantics follow PyTorch:

* Binary ops compute in the node's result dtype, which already carries PyTorch's type
  promotion between tensors, 0-d tensors and Python scalars (``int_tensor + 1.5`` is float32,
  ``int32_tensor + int64_0d`` is int32).  Comparisons compute in the promoted input dtype.
* Core AI has no implicit promotion and rejects ``bool`` in numeric ops, so operands are cast
  explicitly; bool arithmetic uses the logical ops (``add`` = or, ``mul`` = and) and bool
  comparisons run on ``uint8``.
* float16/bfloat16: single ops compute natively (correctly rounded, like PyTorch up to a
  double rounding); multi-step formulas (floor division, remainder, rounding to decimals and
  the composed math functions) compute in float32 and round once, like ATen's ``opmath``.

Runtime hazards: integer division or modulo by zero, and ``INT_MIN / -1``, abort the Core AI
runtime process.  PyTorch raises ``ZeroDivisionError`` for the first and wraps for the
second.  Divisors that are Python scalars are checked at conversion time (zero raises an
error); tensor divisors are made safe in the graph: zero and -1 divisors are replaced by 1,
the ``-1`` results are computed separately (``x // -1 == -x`` wrapping like PyTorch,
``x % -1 == 0``), and an integer division by zero yields the dividend (``x // 0 == x``,
``x % 0 == 0``) instead of an error.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from coreai_torch import dtypes
from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import Scalar, cast, constant, dtype_of
from coreai_torch.lowerings.helpers.arithmetic import (
    all_false,
    ceil_values,
    clamp_values,
    floor_values,
    full_like,
    ge,
    gt,
    isinf_values,
    isnan_values,
    le,
    lt,
    neg_values,
    select,
    sign_values,
    signbit_values,
    to_bool,
    trunc_values,
)
from coreai_torch.lowerings.helpers.operands import (
    Operand,
    const_like,
    is_float_value,
    is_value,
    operand,
    opmath,
    result_dtype,
)
from coreai_torch.lowerings.registry import LoweringContext, lowering

# ------------------------------------------------------------------------------- division --


def _scalar_divisor(cx: LoweringContext, divisor: Operand, dtype: torch.dtype) -> Scalar | None:
    """The divisor as a Python number when it is one; rejects integer division by zero."""
    if is_value(divisor):
        return None
    if not dtype.is_floating_point and divisor == 0:
        raise cx.unsupported(
            "integer division by zero (PyTorch raises ZeroDivisionError; the Core AI runtime "
            "would abort): divide by a non-zero constant or remove the division"
        )
    return divisor


def _safe_int_divisor(b: ir.Value) -> tuple[ir.Value, ir.Value | None]:
    """``b`` with 0 and -1 replaced by 1, and the mask of -1 divisors (signed types only).

    Integer division by 0 and ``INT_MIN / -1`` abort the runtime process, and a tensor
    divisor's values are unknown at conversion time.
    """
    one = const_like(1, b)
    bad = cai.broadcasting_equal(b, const_like(0, b))
    minus_one = None
    if dtype_of(b).is_signed:
        minus_one = cai.broadcasting_equal(b, const_like(-1, b))
        bad = cai.broadcasting_or(bad, minus_one)
    return cai.broadcasting_where(bad, one, b), minus_one


def fmod_values(a: ir.Value, b: ir.Value) -> ir.Value:
    """C ``fmod`` (result has the dividend's sign); safe for integer tensor divisors."""
    if not is_float_value(a) and is_value(b) and not _is_constant_nonzero(b):
        b, _ = _safe_int_divisor(b)  # x % -1 == 0 == x % 1
    return cai.broadcasting_modulo(a, b)


def remainder_values(a: ir.Value, b: ir.Value) -> ir.Value:
    """Python's modulo (result has the divisor's sign)."""
    r = fmod_values(a, b)
    zero = const_like(0, r)
    fix = cai.broadcasting_and(
        cai.broadcasting_not_equal(r, zero),
        cai.broadcasting_not_equal(
            cai.broadcasting_greater(zero, r), cai.broadcasting_greater(zero, b)
        ),
    )
    return cai.broadcasting_where(fix, cai.broadcasting_add(r, b), r)


def _int_quotient(a: ir.Value, b: ir.Value, op: Callable[..., ir.Value]) -> ir.Value:
    """``op(a, b)`` for integer tensors, safe against zero and -1 divisors."""
    if _is_constant_nonzero(b):
        return op(a, b)
    safe, minus_one = _safe_int_divisor(b)
    q = op(a, safe)
    if minus_one is not None:
        q = cai.broadcasting_where(minus_one, neg_values(a), q)
    return q


def _is_constant_nonzero(b: ir.Value) -> bool:
    """Whether ``b`` is a constant with no 0 or -1 element (a safe integer divisor)."""
    owner = b.owner
    if not isinstance(owner, ir.Operation) and hasattr(owner, "operation"):
        owner = owner.operation
    if getattr(owner, "name", None) != "coreai.constant":
        return False
    try:
        attr = ir.DenseElementsAttr(owner.attributes["value"])
    except (ValueError, TypeError, KeyError):
        return False
    if not attr.is_splat:
        return False
    try:
        value = int(ir.IntegerAttr(attr.get_splat_value()).value)
    except (ValueError, TypeError):
        return False
    return value not in (0, -1)


def floor_divide_values(a: ir.Value, b: ir.Value) -> ir.Value:
    """PyTorch's ``div(rounding_mode='floor')``.

    Floats follow ATen's algorithm (``(a - fmod(a, b)) / b`` corrected to the floor), which is
    not ``floor(a / b)``: ``1 // 0.1 == 9``.
    """
    if not is_float_value(a):
        return _int_quotient(a, b, cai.broadcasting_floor_divide)
    zero = const_like(0.0, a)
    one = const_like(1.0, a)
    mod = cai.broadcasting_modulo(a, b)
    div = cai.broadcasting_divide(cai.broadcasting_sub(a, mod), b)
    fix = cai.broadcasting_and(
        cai.broadcasting_not_equal(mod, zero),
        cai.broadcasting_not_equal(
            cai.broadcasting_greater(zero, b), cai.broadcasting_greater(zero, mod)
        ),
    )
    div = cai.broadcasting_where(fix, cai.broadcasting_sub(div, one), div)
    fl = floor_values(div)
    half = const_like(0.5, a)
    fl = cai.broadcasting_where(
        cai.broadcasting_greater(cai.broadcasting_sub(div, fl), half),
        cai.broadcasting_add(fl, one),
        fl,
    )
    by_zero = cai.broadcasting_equal(b, zero)
    return cai.broadcasting_where(by_zero, cai.broadcasting_divide(a, b), fl)


def trunc_divide_values(a: ir.Value, b: ir.Value) -> ir.Value:
    """Division rounding toward zero (Core AI's integer ``divide`` truncates)."""
    if is_float_value(a):
        return trunc_values(cai.broadcasting_divide(a, b))
    return _int_quotient(a, b, cai.broadcasting_divide)


# ------------------------------------------------------------------------------ arithmetic --


def _operands(
    cx: LoweringContext, a: Operand, b: Operand, dtype: torch.dtype | None = None
) -> tuple[ir.Value, ir.Value]:
    dtype = dtype or cx.out_dtype
    return operand(a, dtype), operand(b, dtype)


def _scaled(cx: LoweringContext, other: Operand, alpha: Scalar) -> Operand:
    if alpha == 1:
        return other
    if not is_value(other):
        return other * alpha
    return cai.broadcasting_mul(operand(other, cx.out_dtype), constant(alpha, cx.out_dtype))


@lowering("aten::add.Tensor", "aten::add.Scalar")
def add(cx: LoweringContext, self: Operand, other: Operand, alpha: Scalar = 1) -> ir.Value:
    if cx.out_dtype == torch.bool:
        a, b = _operands(cx, self, other)
        return cai.broadcasting_or(a, b) if alpha else a
    a, b = _operands(cx, self, _scaled(cx, other, alpha))
    return cai.broadcasting_add(a, b)


@lowering("aten::sub.Tensor", "aten::sub.Scalar")
def sub(cx: LoweringContext, self: Operand, other: Operand, alpha: Scalar = 1) -> ir.Value:
    a, b = _operands(cx, self, _scaled(cx, other, alpha))
    return cai.broadcasting_sub(a, b)


@lowering("aten::rsub.Tensor", "aten::rsub.Scalar")
def rsub(cx: LoweringContext, self: Operand, other: Operand, alpha: Scalar = 1) -> ir.Value:
    """``other - alpha * self``."""
    a, b = _operands(cx, other, _scaled(cx, self, alpha))
    return cai.broadcasting_sub(a, b)


@lowering("aten::mul.Tensor", "aten::mul.Scalar")
def mul(cx: LoweringContext, self: Operand, other: Operand) -> ir.Value:
    a, b = _operands(cx, self, other)
    if cx.out_dtype == torch.bool:
        return cai.broadcasting_and(a, b)
    return cai.broadcasting_mul(a, b)


@lowering("aten::div.Tensor", "aten::div.Scalar")
def div(cx: LoweringContext, self: Operand, other: Operand) -> ir.Value:
    a, b = _operands(cx, self, other)
    return cai.broadcasting_divide(a, b)


@lowering("aten::div.Tensor_mode", "aten::div.Scalar_mode")
def div_mode(
    cx: LoweringContext, self: Operand, other: Operand, rounding_mode: str | None = None
) -> ir.Value:
    dtype = cx.out_dtype
    if rounding_mode is None:
        return div(cx, self, other)
    scalar = _scalar_divisor(cx, other, dtype)
    a, b = _operands(cx, self, other, opmath(dtype))
    if scalar == -1 and not dtype.is_floating_point:
        return neg_values(a)
    if rounding_mode == "floor":
        return cast(floor_divide_values(a, b), dtype)
    if rounding_mode == "trunc":
        return cast(trunc_divide_values(a, b), dtype)
    raise cx.unsupported(f"rounding_mode={rounding_mode!r}")


@lowering("aten::floor_divide.default", "aten::floor_divide.Scalar")
def floor_divide(cx: LoweringContext, self: Operand, other: Operand) -> ir.Value:
    return div_mode(cx, self, other, "floor")


@lowering("aten::remainder.Tensor", "aten::remainder.Scalar", "aten::remainder.Scalar_Tensor")
def remainder(cx: LoweringContext, self: Operand, other: Operand) -> ir.Value:
    scalar = _scalar_divisor(cx, other, cx.out_dtype)
    a, b = _operands(cx, self, other, opmath(cx.out_dtype))
    if scalar == -1 and not cx.out_dtype.is_floating_point:
        return full_like(a, 0)
    return cast(remainder_values(a, b), cx.out_dtype)


@lowering("aten::fmod.Tensor", "aten::fmod.Scalar")
def fmod(cx: LoweringContext, self: Operand, other: Operand) -> ir.Value:
    scalar = _scalar_divisor(cx, other, cx.out_dtype)
    a, b = _operands(cx, self, other)
    if scalar == -1 and not cx.out_dtype.is_floating_point:
        return full_like(a, 0)
    return fmod_values(a, b)


@lowering("aten::neg.default")
def neg(cx: LoweringContext, self: ir.Value) -> ir.Value:
    return neg_values(cast(self, cx.out_dtype))


@lowering("aten::abs.default")
def abs_(cx: LoweringContext, self: ir.Value) -> ir.Value:
    dtype = dtype_of(self)
    if dtype == torch.bool or (dtypes.is_integer(dtype) and not dtype.is_signed):
        return self
    return cai.abs_(self)


@lowering("aten::reciprocal.default")
def reciprocal(cx: LoweringContext, self: ir.Value) -> ir.Value:
    x = cast(self, cx.out_dtype)
    return cai.broadcasting_divide(const_like(1.0, x), x)


@lowering("aten::copysign.Tensor", "aten::copysign.Scalar")
def copysign(cx: LoweringContext, self: Operand, other: Operand) -> ir.Value:
    a, b = _operands(cx, self, other)
    magnitude = cai.abs_(a)
    return cai.broadcasting_where(signbit_values(b), neg_values(magnitude), magnitude)


def _pow_tensor_scalar(x: ir.Value, exponent: Scalar) -> ir.Value | None:
    """The special exponents ATen computes without ``pow`` (same results bit for bit)."""
    if exponent == 1:
        return x
    if exponent == 2:
        return cai.broadcasting_mul(x, x)
    if exponent == 3:
        return cai.broadcasting_mul(cai.broadcasting_mul(x, x), x)
    if not is_float_value(x):
        return None
    if exponent == 0.5:
        return cai.sqrt(x)
    if exponent == -0.5:
        return cai.rsqrt(x)
    if exponent == -1:
        return cai.broadcasting_divide(const_like(1.0, x), x)
    if exponent == -2:
        return cai.broadcasting_divide(const_like(1.0, x), cai.broadcasting_mul(x, x))
    return None


def _int_pow(base: ir.Value, exponent: ir.Value) -> ir.Value:
    """Integer power; negative exponents give 0 except for bases 1 and -1 (like ATen).

    Core AI's integer pow aborts the runtime for ``0 ** -n`` (an infinite intermediate), so
    it only ever sees non-negative exponents.
    """
    if not dtype_of(exponent).is_signed:
        return cai.broadcasting_pow(base, exponent)
    zero = const_like(0, exponent)
    powered = cai.broadcasting_pow(base, cai.broadcasting_maximum(exponent, zero))
    one = const_like(1, base)
    odd = cai.broadcasting_not_equal(
        cai.broadcasting_modulo(exponent, const_like(2, exponent)), const_like(0, exponent)
    )
    minus_one_result = cai.broadcasting_where(odd, const_like(-1, base), one)
    negative_result = cai.broadcasting_where(
        cai.broadcasting_equal(base, one),
        one,
        cai.broadcasting_where(
            cai.broadcasting_equal(base, const_like(-1, base)),
            minus_one_result,
            const_like(0, base),
        ),
    )
    return cai.broadcasting_where(
        cai.broadcasting_greater(zero, exponent), negative_result, powered
    )


@lowering("aten::pow.Tensor_Tensor", "aten::pow.Tensor_Scalar", "aten::pow.Scalar")
def pow_(cx: LoweringContext, self: Operand, exponent: Operand) -> ir.Value:
    dtype = cx.out_dtype
    if dtype == torch.bool:
        a, b = _operands(cx, self, exponent)
        return cai.broadcasting_or(a, cai.not_(b))  # x ** False == 1, x ** True == x
    base = operand(self, dtype)
    if not is_value(exponent):
        if exponent == 0:
            return full_like(base, 1)
        special = _pow_tensor_scalar(base, exponent)
        if special is not None:
            return special
        if not dtype.is_floating_point and exponent < 0:
            raise cx.unsupported("integers to negative integer powers are not allowed")
    exp = operand(exponent, dtype)
    if not dtype.is_floating_point:
        return _int_pow(base, exp)
    return cai.broadcasting_pow(base, exp)


@lowering("aten::float_power.Tensor_Tensor", "aten::float_power.Tensor_Scalar")
def float_power(cx: LoweringContext, self: Operand, exponent: Operand) -> ir.Value:
    return pow_(cx, self, exponent)


# ------------------------------------------------------------------------------- rounding --


@lowering("aten::frac.default")
def frac(cx: LoweringContext, self: ir.Value) -> ir.Value:
    return cai.broadcasting_sub(self, trunc_values(self))


@lowering("aten::round.default", "aten::round.decimals")
def round_(cx: LoweringContext, self: ir.Value, decimals: int = 0) -> ir.Value:
    """Half-to-even, with ATen's scaling for ``decimals`` (``round(x * 10**d) / 10**d``)."""
    if not is_float_value(self) or decimals == 0:
        return cai.round_(self) if is_float_value(self) else self
    x = cast(self, opmath(cx.out_dtype))
    scale = const_like(10.0 ** abs(decimals), x)
    if decimals > 0:
        out = cai.broadcasting_divide(cai.round_(cai.broadcasting_mul(x, scale)), scale)
    else:
        out = cai.broadcasting_mul(cai.round_(cai.broadcasting_divide(x, scale)), scale)
    return cast(out, cx.out_dtype)


# ------------------------------------------------------------------------ min, max, clamp --


def _bool_minmax(a: ir.Value, b: ir.Value, maximum: bool) -> ir.Value:
    return cai.broadcasting_or(a, b) if maximum else cai.broadcasting_and(a, b)


@lowering("aten::maximum.default", "aten::max.other")
def maximum(cx: LoweringContext, self: ir.Value, other: ir.Value) -> ir.Value:
    a, b = _operands(cx, self, other)
    if cx.out_dtype == torch.bool:
        return _bool_minmax(a, b, True)
    return cai.broadcasting_maximum(a, b)


@lowering("aten::minimum.default", "aten::min.other")
def minimum(cx: LoweringContext, self: ir.Value, other: ir.Value) -> ir.Value:
    a, b = _operands(cx, self, other)
    if cx.out_dtype == torch.bool:
        return _bool_minmax(a, b, False)
    return cai.broadcasting_minimum(a, b)


def _nan_ignoring(cx: LoweringContext, self: ir.Value, other: ir.Value, maximum: bool):
    a, b = _operands(cx, self, other)
    if cx.out_dtype == torch.bool:
        return _bool_minmax(a, b, maximum)
    m = cai.broadcasting_maximum(a, b) if maximum else cai.broadcasting_minimum(a, b)
    if not cx.out_dtype.is_floating_point:
        return m
    m = cai.broadcasting_where(isnan_values(a), b, m)
    return cai.broadcasting_where(isnan_values(b), a, m)


@lowering("aten::fmax.default")
def fmax(cx: LoweringContext, self: ir.Value, other: ir.Value) -> ir.Value:
    """Maximum ignoring NaN (NaN only when both are NaN)."""
    return _nan_ignoring(cx, self, other, True)


@lowering("aten::fmin.default")
def fmin(cx: LoweringContext, self: ir.Value, other: ir.Value) -> ir.Value:
    return _nan_ignoring(cx, self, other, False)


@lowering("aten::clamp.default", "aten::clamp.Tensor", "aten::clip.default", "aten::clip.Tensor")
def clamp(
    cx: LoweringContext, self: ir.Value, min: Operand | None = None, max: Operand | None = None
) -> ir.Value:
    return clamp_values(cast(self, cx.out_dtype), min, max)


@lowering("aten::clamp_min.default", "aten::clamp_min.Tensor")
def clamp_min(cx: LoweringContext, self: ir.Value, min: Operand) -> ir.Value:
    return clamp_values(cast(self, cx.out_dtype), min, None)


@lowering("aten::clamp_max.default", "aten::clamp_max.Tensor")
def clamp_max(cx: LoweringContext, self: ir.Value, max: Operand) -> ir.Value:
    return clamp_values(cast(self, cx.out_dtype), None, max)


# ------------------------------------------------------------------------------ comparison --


def _compared(a: Operand, b: Operand) -> tuple[ir.Value, ir.Value]:
    """Both operands in PyTorch's promoted dtype."""
    dtype = result_dtype(a, b)
    return operand(a, dtype), operand(b, dtype)


def _comparison(fn: Callable[[ir.Value, ir.Value], ir.Value]) -> Callable:
    def rule(cx: LoweringContext, self: Operand, other: Operand) -> ir.Value:
        return fn(*_compared(self, other))

    rule.__name__ = fn.__name__
    return rule


for _name, _fn in {
    "eq": cai.broadcasting_equal,
    "ne": cai.broadcasting_not_equal,
    "gt": gt,
    "lt": lt,
    "ge": ge,
    "le": le,
}.items():
    lowering(f"aten::{_name}.Tensor", f"aten::{_name}.Scalar")(_comparison(_fn))


def _equals(x: ir.Value, value: float) -> ir.Value:
    if not is_float_value(x):
        return all_false(x)
    return cai.broadcasting_equal(x, const_like(value, x))


def _same_dtype_rule(fn: Callable[[ir.Value], ir.Value]) -> Callable:
    def rule(cx: LoweringContext, self: ir.Value) -> ir.Value:
        return fn(self)

    return rule


for _names, _fn in {
    ("sign", "sgn"): sign_values,
    ("signbit",): signbit_values,
    ("floor",): floor_values,
    ("ceil",): ceil_values,
    ("trunc", "fix"): trunc_values,
    ("isnan",): isnan_values,
    ("isinf",): isinf_values,
    ("isposinf",): lambda x: _equals(x, float("inf")),
    ("isneginf",): lambda x: _equals(x, float("-inf")),
}.items():
    lowering(*(f"aten::{n}.default" for n in _names))(_same_dtype_rule(_fn))


@lowering("aten::isfinite.default")
def isfinite(cx: LoweringContext, self: ir.Value) -> ir.Value:
    if not is_float_value(self):
        return cai.not_(all_false(self))
    # x - x is 0 for finite x and NaN for inf and NaN.
    return cai.broadcasting_equal(cai.broadcasting_sub(self, self), const_like(0, self))


@lowering("aten::nan_to_num.default")
def nan_to_num(
    cx: LoweringContext,
    self: ir.Value,
    nan: float | None = None,
    posinf: float | None = None,
    neginf: float | None = None,
) -> ir.Value:
    if not is_float_value(self):
        return self
    info = torch.finfo(dtype_of(self))
    x = select(isnan_values(self), 0.0 if nan is None else nan, self, self)
    x = select(
        cai.broadcasting_equal(x, const_like(float("inf"), x)),
        info.max if posinf is None else posinf,
        x,
        x,
    )
    return select(
        cai.broadcasting_equal(x, const_like(float("-inf"), x)),
        info.min if neginf is None else neginf,
        x,
        x,
    )


# -------------------------------------------------------------------------------- logical --


@lowering("aten::logical_not.default")
def logical_not(cx: LoweringContext, self: ir.Value) -> ir.Value:
    return cast(cai.not_(to_bool(self)), cx.out_dtype)


def _logical(fn: Callable[[ir.Value, ir.Value], ir.Value]) -> Callable:
    def rule(cx: LoweringContext, self: ir.Value, other: ir.Value) -> ir.Value:
        return cast(fn(to_bool(self), to_bool(other)), cx.out_dtype)

    return rule


lowering("aten::logical_and.default")(_logical(cai.broadcasting_and))
lowering("aten::logical_or.default")(_logical(cai.broadcasting_or))
lowering("aten::logical_xor.default")(_logical(cai.broadcasting_xor))


@lowering(
    "aten::where.self", "aten::where.ScalarSelf", "aten::where.ScalarOther", "aten::where.Scalar"
)
def where(cx: LoweringContext, condition: ir.Value, self: Operand, other: Operand) -> ir.Value:
    dtype = cx.out_dtype
    return cai.broadcasting_where(to_bool(condition), operand(self, dtype), operand(other, dtype))
