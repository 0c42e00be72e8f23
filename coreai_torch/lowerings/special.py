"""Special functions: gamma family (lgamma, digamma, polygamma, zeta), Bessel I0/I1 (and their
exponentially scaled forms), erfcx, ndtri, angle, ldexp, frexp.

Core AI has none of these; they are series and rational approximations evaluated in float32
(float16/bfloat16 inputs are computed in float32 and rounded once) with relative errors of a
few 1e-7 — well inside float32 comparisons with PyTorch — and PyTorch's values at poles,
infinities and NaN.
"""

from __future__ import annotations

import math

import torch

from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import (
    add,
    cast,
    div,
    dtype_of,
    equal,
    i32,
    less,
    mul,
    pick,
    rank_of,
    squeeze,
    sub,
)
from coreai_torch.lowerings.helpers.arithmetic import (
    floor_values,
    isinf_values,
    isnan_values,
    neg_values,
    signbit_values,
)
from coreai_torch.lowerings.helpers.float_math import (
    ERFC_COEFFICIENTS,
    frexp_parts,
    is_nonpositive_integer,
    lgamma_values,
    polynomial,
    reduced,
)
from coreai_torch.lowerings.helpers.operands import (
    Operand,
    const_like,
    operand,
    opmath,
)
from coreai_torch.lowerings.registry import LoweringContext, lowering

# -------------------------------------------------------------------------------- helpers ---


def _int_power(x: ir.Value, n: int) -> ir.Value:
    """``x ** n`` for a static ``n >= 1`` by repeated squaring (exact sign for x < 0)."""
    result = None
    base = x
    while n:
        if n & 1:
            result = base if result is None else cai.broadcasting_mul(result, base)
        n >>= 1
        if n:
            base = cai.broadcasting_mul(base, base)
    assert result is not None
    return result


def _float_rule(cx: LoweringContext, fn, *operands: Operand) -> ir.Value:
    """``fn`` over the operands in PyTorch's compute dtype (float32 for 16-bit floats)."""
    dtype = cx.out_dtype
    compute = opmath(dtype)
    return cast(fn(*(operand(x, compute) for x in operands)), dtype)


# ------------------------------------------------------------------------ gamma family ---

# ψ(y) ~ ln y - 1/2y - Σ B_2k / (2k y^2k) for y >= 6
_DIGAMMA_ASYMPTOTIC = [1.0 / 132, -1.0 / 240, 1.0 / 252, -1.0 / 120, 1.0 / 12]


def _digamma_positive(x: ir.Value) -> ir.Value:
    """ψ(x) for x > 0: recurrence up to x + 6, then the asymptotic series."""
    shift = const_like(0.0, x)
    for k in range(6):
        shift = cai.broadcasting_add(shift, div(1.0, add(x, float(k))))
    y = add(x, 6.0)
    inv2 = div(1.0, cai.broadcasting_mul(y, y))
    series = cai.broadcasting_mul(polynomial(inv2, _DIGAMMA_ASYMPTOTIC), inv2)
    psi = cai.broadcasting_sub(cai.broadcasting_sub(cai.log(y), div(0.5, y)), series)
    return cai.broadcasting_sub(psi, shift)


def digamma_values(x: ir.Value) -> ir.Value:
    """ψ(x); reflection for x < 0, -inf at 0, NaN at negative integers (like PyTorch)."""
    negative = less(x, 0.0)
    positive = _digamma_positive(pick(negative, sub(const_like(1.0, x), x), x, x))
    frac, _ = reduced(x)
    cot = div(math.pi, cai.tan(mul(frac, math.pi)))
    out = pick(negative, cai.broadcasting_sub(positive, cot), positive, x)
    out = pick(is_nonpositive_integer(x), math.nan, out, x)
    out = pick(equal(x, 0.0), pick(signbit_values(x), math.inf, -math.inf, x), out, x)
    out = pick(equal(x, math.inf), math.inf, out, x)
    return pick(equal(x, -math.inf), math.nan, out, x)


# Euler–Maclaurin terms B_2j / (2j)!
_BERNOULLI_OVER_FACTORIAL = [
    1.0 / 12,
    -1.0 / 720,
    1.0 / 30240,
    -1.0 / 1209600,
    1.0 / 47900160,
    -691.0 / 1307674368000,
]
_ZETA_TERMS = 9
#: polygamma sums more terms directly so that arguments down to -16 stay accurate
_POLYGAMMA_TERMS = 25


def _zeta_tail(s: ir.Value | int, q: ir.Value, inverse_powers, terms: int) -> ir.Value:
    """Σ_{k>=0} (q + k)^-s by ``terms`` direct terms and the Euler–Maclaurin tail (accurate
    while ``q + terms >= 9``, like Cephes' zeta).

    ``inverse_powers(base, e)`` gives ``base ** -(s + e)`` (integer or real ``s``).
    """
    total = const_like(0.0, q)
    for k in range(terms):
        total = cai.broadcasting_add(total, inverse_powers(add(q, float(k)), 0))
    a = add(q, float(terms))
    s_minus_1 = sub(s, 1.0) if isinstance(s, ir.Value) else const_like(float(s - 1), q)
    total = cai.broadcasting_add(
        total, cai.broadcasting_divide(cai.broadcasting_mul(inverse_powers(a, 0), a), s_minus_1)
    )
    total = cai.broadcasting_add(total, mul(inverse_powers(a, 0), 0.5))
    rising = s if isinstance(s, ir.Value) else const_like(float(s), q)  # s (s+1) ... (s+2j-2)
    for j, coefficient in enumerate(_BERNOULLI_OVER_FACTORIAL, start=1):
        term = mul(cai.broadcasting_mul(rising, inverse_powers(a, 2 * j - 1)), coefficient)
        total = cai.broadcasting_add(total, term)
        step = s if isinstance(s, ir.Value) else const_like(float(s), q)
        rising = cai.broadcasting_mul(
            rising,
            cai.broadcasting_mul(add(step, float(2 * j - 1)), add(step, float(2 * j))),
        )
    return total


def polygamma_values(n: int, x: ir.Value) -> ir.Value:
    """ψ⁽ⁿ⁾(x) = (-1)^(n+1) n! ζ(n + 1, x) for n >= 1."""
    s = n + 1

    def inverse_powers(base: ir.Value, extra: int) -> ir.Value:
        return _int_power(div(1.0, base), s + extra)

    zeta = _zeta_tail(s, x, inverse_powers, _POLYGAMMA_TERMS)
    out = mul(zeta, (-1.0) ** (n + 1) * math.factorial(n))
    pole = is_nonpositive_integer(x)
    out = pick(pole, math.inf if n % 2 else -math.inf, out, x)
    return pick(equal(x, math.inf), 0.0, out, x)


def zeta_values(s: ir.Value, q: ir.Value) -> ir.Value:
    """Hurwitz ζ(s, q) for s > 1, q > 0 (NaN for s < 1, inf for s == 1, like PyTorch)."""

    def inverse_powers(base: ir.Value, extra: int) -> ir.Value:
        exponent = neg_values(add(s, float(extra))) if extra else neg_values(s)
        return cai.broadcasting_pow(base, exponent)

    out = _zeta_tail(s, q, inverse_powers, _ZETA_TERMS)
    # Cephes' order of precedence: s == 1, s < 1, q a pole, q < 0 with non-integer s
    fractional_s = cai.broadcasting_not_equal(floor_values(s), s)
    out = pick(cai.broadcasting_and(less(q, 0.0), fractional_s), math.nan, out, out)
    out = pick(is_nonpositive_integer(q), math.inf, out, out)
    out = pick(less(s, 1.0), math.nan, out, out)
    return pick(equal(s, 1.0), math.inf, out, out)


@lowering("aten::lgamma.default")
def lgamma(cx: LoweringContext, self: ir.Value) -> ir.Value:
    return _float_rule(cx, lgamma_values, self)


@lowering("aten::digamma.default", "aten::special_psi.default", "aten::special_digamma.default")
def digamma(cx: LoweringContext, self: ir.Value) -> ir.Value:
    return _float_rule(cx, digamma_values, self)


@lowering("aten::polygamma.default", "aten::special_polygamma.default")
def polygamma(cx: LoweringContext, n: int, self: ir.Value) -> ir.Value:
    if n == 0:
        return _float_rule(cx, digamma_values, self)
    return _float_rule(cx, lambda x: polygamma_values(n, x), self)


@lowering(
    "aten::special_zeta.default",
    "aten::special_zeta.self_scalar",
    "aten::special_zeta.other_scalar",
)
def zeta(cx: LoweringContext, self: Operand, other: Operand) -> ir.Value:
    return _float_rule(cx, zeta_values, self, other)


@lowering("aten::mvlgamma.default", "aten::special_multigammaln.default")
def mvlgamma(cx: LoweringContext, self: ir.Value, p: int) -> ir.Value:
    """``p (p-1)/4 log π + Σ_{j<p} lgamma(x - j/2)``."""

    def fn(x: ir.Value) -> ir.Value:
        total = const_like(p * (p - 1) / 4 * math.log(math.pi), x)
        for j in range(p):
            total = cai.broadcasting_add(total, lgamma_values(sub(x, j / 2)))
        return total

    return _float_rule(cx, fn, self)


# ------------------------------------------------------------------ Bessel I0, I1 (A&S) ---

# Abramowitz & Stegun 9.8.1-9.8.4 (relative errors below 2e-7).
_I0_SMALL = [0.0045813, 0.0360768, 0.2659732, 1.2067492, 3.0899424, 3.5156229, 1.0]
_I0_LARGE = [
    0.00392377,
    -0.01647633,
    0.02635537,
    -0.02057706,
    0.00916281,
    -0.00157565,
    0.00225319,
    0.01328592,
    0.39894228,
]
_I1_SMALL = [0.00032411, 0.00301532, 0.02658733, 0.15084934, 0.51498869, 0.87890594, 0.5]
_I1_LARGE = [
    -0.00420059,
    0.01787654,
    -0.02895312,
    0.02282967,
    -0.01031555,
    0.00163801,
    -0.00362018,
    -0.03988024,
    0.39894228,
]


def bessel_i(x: ir.Value, order: int, scaled: bool) -> ir.Value:
    """Modified Bessel function I0 or I1 of ``x`` (times ``exp(-|x|)`` if ``scaled``)."""
    a = cai.abs_(x)
    small_arg = div(a, const_like(3.75, a))
    t_small = cai.broadcasting_mul(small_arg, small_arg)
    t_large = div(3.75, a)
    small = polynomial(t_small, _I0_SMALL if order == 0 else _I1_SMALL)
    if order == 1:
        small = cai.broadcasting_mul(small, a)
    large = div(polynomial(t_large, _I0_LARGE if order == 0 else _I1_LARGE), cai.sqrt(a))
    if scaled:
        small = cai.broadcasting_mul(small, cai.exp(neg_values(a)))
    else:
        # exp(a) / sqrt(a) overflows only where I(x) itself does
        large = cai.broadcasting_mul(large, cai.exp(a))
    out = pick(less(a, 3.75), small, large, x)
    if order == 1:
        out = pick(signbit_values(x), neg_values(out), out, x)
    return out


def _bessel_rule(order: int, scaled: bool):
    def rule(cx: LoweringContext, self: ir.Value) -> ir.Value:
        return _float_rule(cx, lambda x: bessel_i(x, order, scaled), self)

    return rule


for _names, _order, _scaled in (
    (("i0", "special_i0"), 0, False),
    (("special_i0e",), 0, True),
    (("special_i1",), 1, False),
    (("special_i1e",), 1, True),
):
    lowering(*(f"aten::{n}.default" for n in _names))(_bessel_rule(_order, _scaled))


def _modified_bessel_i(order: int):
    """``special.modified_bessel_i0/i1``: like ``i0``/``i1`` but NaN at ±inf (PyTorch)."""

    def rule(cx: LoweringContext, self: ir.Value) -> ir.Value:
        def fn(x: ir.Value) -> ir.Value:
            return pick(isinf_values(x), math.nan, bessel_i(x, order, False), x)

        return _float_rule(cx, fn, self)

    return rule


lowering("aten::special_modified_bessel_i0.default")(_modified_bessel_i(0))
lowering("aten::special_modified_bessel_i1.default")(_modified_bessel_i(1))


# ------------------------------------------------------------------------- erfcx, ndtri ---


def erfcx_values(x: ir.Value) -> ir.Value:
    """``exp(x²) erfc(x)``: erfc(x) = t exp(-x² + P(t)) with t = 1 / (1 + x/2), so for
    x >= 0 it is t exp(P(t)) and never overflows."""
    a = cai.abs_(x)
    t = div(1.0, add(mul(a, 0.5), 1.0))
    tail = cai.broadcasting_mul(t, cai.exp(polynomial(t, ERFC_COEFFICIENTS)))
    squared = cai.exp(cai.broadcasting_mul(x, x))
    near = cai.broadcasting_mul(squared, cai.broadcasting_sub(const_like(1.0, x), cai.erf(x)))
    negative = cai.broadcasting_sub(mul(squared, 2.0), tail)
    out = pick(signbit_values(x), negative, tail, x)
    out = pick(less(a, 0.5), near, out, x)
    return pick(equal(x, math.inf), 0.0, out, x)


# P. J. Acklam's rational approximation of the normal quantile (relative error < 1.2e-9).
_ACKLAM_A = [-39.69683028665376, 220.9460984245205, -275.9285104469687, 138.3577518672690,
             -30.66479806614716, 2.506628274631000]  # fmt: skip
_ACKLAM_B = [-54.47609879822406, 161.5858368580409, -155.6989798598866, 66.80131188771972,
             -13.28068155288572, 1.0]  # fmt: skip
_ACKLAM_C = [-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838,
             -2.549732539343734, 4.374664141464968, 2.938163982698783]  # fmt: skip
_ACKLAM_D = [7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996,
             3.754408661907416, 1.0]  # fmt: skip


def ndtri_values(p: ir.Value) -> ir.Value:
    """Φ⁻¹(p): a central rational function, and tail ones in ``sqrt(-2 log p)`` that keep
    tiny probabilities (``ndtri(1e-30) = -11.46``) precise."""
    q = sub(p, 0.5)
    r = cai.broadcasting_mul(q, q)
    central = div(cai.broadcasting_mul(polynomial(r, _ACKLAM_A), q), polynomial(r, _ACKLAM_B))
    tail_p = cai.broadcasting_minimum(p, cai.broadcasting_sub(const_like(1.0, p), p))
    t = cai.sqrt(mul(cai.log(tail_p), -2.0))
    tail = div(polynomial(t, _ACKLAM_C), polynomial(t, _ACKLAM_D))
    tail = pick(cai.broadcasting_greater(p, const_like(0.5, p)), neg_values(tail), tail, p)
    out = pick(less(cai.abs_(q), 0.47575), central, tail, p)
    out = pick(equal(p, 0.0), -math.inf, out, p)
    out = pick(equal(p, 1.0), math.inf, out, p)
    outside = cai.broadcasting_or(less(p, 0.0), cai.broadcasting_greater(p, const_like(1.0, p)))
    return pick(outside, math.nan, out, p)


@lowering("aten::special_erfcx.default")
def erfcx(cx: LoweringContext, self: ir.Value) -> ir.Value:
    return _float_rule(cx, erfcx_values, self)


@lowering("aten::special_ndtri.default")
def ndtri(cx: LoweringContext, self: ir.Value) -> ir.Value:
    return _float_rule(cx, ndtri_values, self)


@lowering("aten::special_ndtr.default")
def ndtr(cx: LoweringContext, self: ir.Value) -> ir.Value:
    """``(1 + erf(x / √2)) / 2``."""
    return _float_rule(cx, lambda x: mul(add(cai.erf(mul(x, 1 / math.sqrt(2.0))), 1.0), 0.5), self)


# ------------------------------------------------------------------- angle, ldexp, frexp ---


@lowering("aten::angle.default")
def angle(cx: LoweringContext, self: ir.Value) -> ir.Value:
    """π for negative reals, 0 otherwise (NaN stays NaN)."""
    x = cast(self, cx.out_dtype)
    out = pick(less(x, 0.0), math.pi, 0.0, x)
    return pick(isnan_values(x), x, out, x)


@lowering("aten::ldexp.Tensor")
def ldexp(cx: LoweringContext, self: ir.Value, other: ir.Value) -> ir.Value:
    """``self * 2 ** other``."""

    def fn(x: ir.Value, e: ir.Value) -> ir.Value:
        return cai.broadcasting_mul(x, cai.broadcasting_pow(const_like(2.0, e), e))

    return _float_rule(cx, fn, self, other)


@lowering("aten::frexp.Tensor")
def frexp(cx: LoweringContext, self: ir.Value) -> list[ir.Value]:
    """Mantissa in [0.5, 1) and int32 exponent; (0, 0) for 0, (x, 0) for inf/NaN."""
    x = self
    mantissa, exponent, finite_nonzero = frexp_parts(cast(cai.abs_(x), torch.float32))
    mantissa = cast(mantissa, dtype_of(x))
    mantissa = cai.broadcasting_where(signbit_values(x), neg_values(mantissa), mantissa)
    mantissa = cai.broadcasting_where(finite_nonzero, mantissa, x)
    exponent = pick(finite_nonzero, exponent, 0.0, exponent)
    return [mantissa, cast(exponent, torch.int32)]


@lowering("aten::nextafter.default")
def nextafter(cx: LoweringContext, self: ir.Value, other: ir.Value) -> ir.Value:
    """The next representable value after ``self`` toward ``other``: ``self`` ± one unit in
    the last place, the spacing found from the binary exponent (half of it when stepping
    down from a power of two), subnormal spacing near 0."""
    dtype = cx.out_dtype
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise cx.unsupported(f"nextafter for {dtype}")
    info = torch.finfo(dtype)
    digits = round(1 - math.log2(info.eps))  # significand bits incl. the implicit one
    smallest = info.tiny * info.eps  # subnormal spacing
    x, y = operand(self, torch.float32), operand(other, torch.float32)
    mantissa, exponent, _ = frexp_parts(cai.abs_(x))
    two = const_like(2.0, x)
    above = cai.broadcasting_pow(two, sub(exponent, float(digits)))
    below = pick(equal(mantissa, 0.5), mul(above, 0.5), above, x)
    above = cai.broadcasting_maximum(above, const_like(smallest, x))
    below = cai.broadcasting_maximum(below, const_like(smallest, x))
    up = cai.broadcasting_greater(y, x)
    away_from_zero = cai.broadcasting_equal(up, cai.broadcasting_greater(x, const_like(0.0, x)))
    step = cai.broadcasting_where(away_from_zero, above, below)
    out = cai.broadcasting_add(x, cai.broadcasting_where(up, step, neg_values(step)))
    from_zero = pick(up, smallest, -smallest, x)
    out = cai.broadcasting_where(equal(x, 0.0), from_zero, out)
    largest = pick(signbit_values(x), -info.max, info.max, x)
    out = cai.broadcasting_where(isinf_values(x), largest, out)
    out = cai.broadcasting_where(cai.broadcasting_equal(x, y), y, out)
    nan = cai.broadcasting_or(isnan_values(x), isnan_values(y))
    return cast(pick(nan, math.nan, out, x), dtype)


# ------------------------------------------------------------------------------- gcd, lcm ---


def _any_nonzero(x: ir.Value) -> ir.Value:
    """0-d bool: does ``x`` have a nonzero element."""
    nonzero = cai.broadcasting_not_equal(x, const_like(0, x))
    rank = rank_of(x)
    if rank == 0:
        return nonzero
    return squeeze(cai.any_(nonzero, i32(list(range(rank)))), list(range(rank)))


def gcd_values(a: ir.Value, b: ir.Value) -> ir.Value:
    """Euclid's algorithm in a ``coreai.while`` loop until every remainder is 0 (never
    dividing by zero: finished lanes divide by 1)."""
    zero = const_like(0, a)
    a, b = cai.abs_(a), cai.abs_(b)
    a, b = (
        cai.broadcasting_add(a, cai.broadcasting_mul(b, zero)),
        cai.broadcasting_add(b, cai.broadcasting_mul(a, zero)),
    )
    loop, (before, after) = cai.while_([a.type, b.type], [a, b])
    with before:
        x, y = before.arguments
        cai.condition(_any_nonzero(y), x, y)
    with after:
        x, y = after.arguments
        done = cai.broadcasting_equal(y, zero)
        remainder = cai.broadcasting_modulo(x, cai.broadcasting_where(done, const_like(1, y), y))
        cai.yield_(
            [cai.broadcasting_where(done, x, y), cai.broadcasting_where(done, zero, remainder)]
        )
    return next(iter(loop))


@lowering("aten::gcd.default")
def gcd(cx: LoweringContext, self: ir.Value, other: ir.Value) -> ir.Value:
    dtype = cx.out_dtype
    return gcd_values(operand(self, dtype), operand(other, dtype))


@lowering("aten::lcm.default")
def lcm(cx: LoweringContext, self: ir.Value, other: ir.Value) -> ir.Value:
    """``|a / gcd(a, b) * b|``, 0 when both are 0."""
    dtype = cx.out_dtype
    a, b = operand(self, dtype), operand(other, dtype)
    g = gcd_values(a, b)
    zero = const_like(0, g)
    none = cai.broadcasting_equal(g, zero)
    g = cai.broadcasting_where(none, const_like(1, g), g)
    multiple = cai.abs_(cai.broadcasting_mul(cai.broadcasting_divide(a, g), b))
    return cai.broadcasting_where(none, zero, multiple)


# --------------------------------------------------------------- Bessel J, Y, K (NR, A&S) ---

# Numerical Recipes' bessj0/bessj1/bessy0/bessy1 (absolute error ~1e-8): rational functions
# below 8, the asymptotic phase/amplitude form above.
_J0_NUM = [-184.9052456, 77392.33017, -11214424.18, 651619640.7, -13362590354.0, 57568490574.0]
_J0_DEN = [1.0, 267.8532712, 59272.64853, 9494680.718, 1029532985.0, 57568490411.0]
_J1_NUM = [-30.16036606, 15704.48260, -2972611.439, 242396853.1, -7895059235.0, 72362614232.0]
_J1_DEN = [1.0, 376.9991397, 99447.43394, 18583304.74, 2300535178.0, 144725228442.0]
_Y0_NUM = [228.4622733, -86327.92757, 10879881.29, -512359803.6, 7062834065.0, -2957821389.0]
_Y0_DEN = [1.0, 226.1030244, 47447.26470, 7189466.438, 745249964.8, 40076544269.0]
_Y1_NUM = [8511.937935, -4237922.726, 734926455.1, -51534381390.0, 1.275274390e12, -4.900604943e12]
_Y1_DEN = [1.0, 354.9632885, 102042.6050, 22459040.02, 3733650367.0, 4.244419664e11, 2.499580570e13]
_P0 = [0.2093887211e-6, -0.2073370639e-5, 0.2734510407e-4, -0.1098628627e-2, 1.0]
_Q0 = [-0.934935152e-7, 0.7621095161e-6, -0.6911147651e-5, 0.1430488765e-3, -0.1562499995e-1]
_P1 = [-0.240337019e-6, 0.2457520174e-5, -0.3516396496e-4, 0.183105e-2, 1.0]
_Q1 = [0.105787412e-6, -0.88228987e-6, 0.8449199096e-5, -0.2002690873e-3, 0.04687499995]
_TWO_OVER_PI = 2 / math.pi


def _bessel_asymptotic(a: ir.Value, order: int, second_kind: bool) -> ir.Value:
    """``sqrt(2/(πa)) (P cos(ξ) - z Q sin(ξ))`` (J) or ``(P sin(ξ) + z Q cos(ξ))`` (Y)."""
    z = div(8.0, a)
    y = cai.broadcasting_mul(z, z)
    p = polynomial(y, _P0 if order == 0 else _P1)
    q = cai.broadcasting_mul(polynomial(y, _Q0 if order == 0 else _Q1), z)
    phase = sub(a, math.pi / 4 * (1 + 2 * order))
    cos, sin = cai.cos(phase), cai.sin(phase)
    if second_kind:
        wave = cai.broadcasting_add(cai.broadcasting_mul(p, sin), cai.broadcasting_mul(q, cos))
    else:
        wave = cai.broadcasting_sub(cai.broadcasting_mul(p, cos), cai.broadcasting_mul(q, sin))
    return cai.broadcasting_mul(cai.sqrt(div(_TWO_OVER_PI, a)), wave)


def bessel_j(x: ir.Value, order: int) -> ir.Value:
    a = cai.abs_(x)
    y = cai.broadcasting_mul(x, x)
    near = div(
        polynomial(y, _J0_NUM if order == 0 else _J1_NUM),
        polynomial(y, _J0_DEN if order == 0 else _J1_DEN),
    )
    if order == 1:
        near = cai.broadcasting_mul(near, x)
    far = _bessel_asymptotic(a, order, False)
    if order == 1:
        far = pick(signbit_values(x), neg_values(far), far, x)
    return pick(less(a, 8.0), near, far, x)  # NaN at ±inf, like PyTorch


def bessel_y(x: ir.Value, order: int) -> ir.Value:
    y = cai.broadcasting_mul(x, x)
    ratio = div(
        polynomial(y, _Y0_NUM if order == 0 else _Y1_NUM),
        polynomial(y, _Y0_DEN if order == 0 else _Y1_DEN),
    )
    log_term = cai.broadcasting_mul(bessel_j(x, order), cai.log(x))
    if order == 1:
        ratio = cai.broadcasting_mul(ratio, x)
        log_term = cai.broadcasting_sub(log_term, div(1.0, x))
    near = cai.broadcasting_add(ratio, mul(log_term, _TWO_OVER_PI))
    far = _bessel_asymptotic(x, order, True)
    out = pick(less(x, 8.0), near, far, x)  # NaN at +inf, like PyTorch
    out = pick(equal(x, 0.0), -math.inf, out, x)
    return pick(less(x, 0.0), math.nan, out, x)


# Abramowitz & Stegun 9.8.5-9.8.8
_K0_SMALL = [0.00000740, 0.00010750, 0.00262698, 0.03488590, 0.23069756, 0.42278420, -0.57721566]
_K0_LARGE = [0.00053208, -0.00251540, 0.00587872, -0.01062446, 0.02189568, -0.07832358, 1.25331414]
_K1_SMALL = [-0.00004686, -0.00110404, -0.01919402, -0.18156897, -0.67278579, 0.15443144, 1.0]
_K1_LARGE = [-0.00068245, 0.00325614, -0.00780353, 0.01504268, -0.03655620, 0.23498619, 1.25331414]


def bessel_k(x: ir.Value, order: int, scaled: bool) -> ir.Value:
    """Modified Bessel function K0/K1 (times ``exp(x)`` if ``scaled``)."""
    half = mul(x, 0.5)
    t = cai.broadcasting_mul(half, half)
    log_half = cai.log(half)
    series = polynomial(t, _K0_SMALL if order == 0 else _K1_SMALL)
    if order == 0:
        near = cai.broadcasting_sub(series, cai.broadcasting_mul(log_half, bessel_i(x, 0, False)))
    else:
        near = cai.broadcasting_add(
            cai.broadcasting_mul(cai.broadcasting_mul(x, log_half), bessel_i(x, 1, False)), series
        )
        near = div(near, x)
    if scaled:
        near = cai.broadcasting_mul(near, cai.exp(x))
    far = div(polynomial(div(2.0, x), _K0_LARGE if order == 0 else _K1_LARGE), cai.sqrt(x))
    if not scaled:
        far = cai.broadcasting_mul(far, cai.exp(neg_values(x)))
    out = pick(less(x, 2.0), near, far, x)
    out = pick(equal(x, 0.0), math.inf, out, x)
    out = pick(equal(x, math.inf), 0.0, out, x)
    return pick(less(x, 0.0), math.nan, out, x)


def spherical_bessel_j0(x: ir.Value) -> ir.Value:
    """``sin(x) / x`` (a series near 0, 0 at ±inf)."""
    y = cai.broadcasting_mul(x, x)
    near = polynomial(y, [1.0 / 120, -1.0 / 6, 1.0])
    out = pick(less(cai.abs_(x), 0.01), near, div(cai.sin(x), x), x)
    return pick(isinf_values(x), 0.0, out, x)


for _name, _fn in {
    "special_bessel_j0": lambda x: bessel_j(x, 0),
    "special_bessel_j1": lambda x: bessel_j(x, 1),
    "special_bessel_y0": lambda x: bessel_y(x, 0),
    "special_bessel_y1": lambda x: bessel_y(x, 1),
    "special_modified_bessel_k0": lambda x: bessel_k(x, 0, False),
    "special_modified_bessel_k1": lambda x: bessel_k(x, 1, False),
    "special_scaled_modified_bessel_k0": lambda x: bessel_k(x, 0, True),
    "special_scaled_modified_bessel_k1": lambda x: bessel_k(x, 1, True),
    "special_spherical_bessel_j0": spherical_bessel_j0,
}.items():

    def _rule(cx: LoweringContext, _fn=_fn, **arguments: ir.Value) -> ir.Value:
        (x,) = arguments.values()  # the schemas call it ``self`` or ``x``
        return _float_rule(cx, _fn, x)

    lowering(f"aten::{_name}.default")(_rule)
