"""Composed float functions that several families evaluate: Horner polynomials,
``log1p``/``expm1`` and ``erfc`` kept accurate where the naive formula loses precision,
``log|Γ(x)|`` and the split of floats into mantissa and exponent (``frexp``).

Core AI has none of these; they compute in their operand's dtype (callers pass float32 for
16-bit inputs, like ATen's ``opmath``).
"""

from __future__ import annotations

import math

from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import add, div, equal, less, mul, pick, sub
from coreai_torch.lowerings.helpers.arithmetic import (
    floor_values,
    isinf_values,
    neg_values,
    signbit_values,
)
from coreai_torch.lowerings.helpers.operands import const_like


def polynomial(x: ir.Value, coefficients: list[float]) -> ir.Value:
    """Horner evaluation; coefficients from the highest power down."""
    p = const_like(coefficients[0], x)
    for c in coefficients[1:]:
        p = add(cai.broadcasting_mul(p, x), c)
    return p


def log1p_values(x: ir.Value) -> ir.Value:
    """``log(1 + x)``; ``2 atanh(x / (2 + x))`` near 0 where ``1 + x`` would round."""
    small = less(cai.abs_(x), 0.5)
    near = mul(cai.atanh(cai.broadcasting_divide(x, add(x, 2.0))), 2.0)
    return cai.broadcasting_where(small, near, cai.log(add(x, 1.0)))


def expm1_values(x: ir.Value) -> ir.Value:
    """``exp(x) - 1``; ``2t / (1 - t)`` with ``t = tanh(x / 2)`` near 0."""
    small = less(cai.abs_(x), 0.5)
    t = cai.tanh(mul(x, 0.5))
    near = cai.broadcasting_divide(mul(t, 2.0), cai.broadcasting_sub(const_like(1.0, t), t))
    return cai.broadcasting_where(small, near, sub(cai.exp(x), 1.0))


# Numerical Recipes' erfc approximation (relative error < 1.2e-7 everywhere).
ERFC_COEFFICIENTS = [
    0.17087277,
    -0.82215223,
    1.48851587,
    -1.13520398,
    0.27886807,
    -0.18628806,
    0.09678418,
    0.37409196,
    1.00002368,
    -1.26551223,
]


def erfc_values(x: ir.Value) -> ir.Value:
    """``1 - erf(x)``, accurate in the tail (``erfc(10) == 2.1e-45``)."""
    z = cai.abs_(x)
    t = div(1.0, add(mul(z, 0.5), 1.0))
    exponent = cai.broadcasting_sub(polynomial(t, ERFC_COEFFICIENTS), cai.broadcasting_mul(z, z))
    tail = cai.broadcasting_mul(t, cai.exp(exponent))
    tail = cai.broadcasting_where(
        signbit_values(x), cai.broadcasting_sub(const_like(2.0, x), tail), tail
    )
    near = cai.broadcasting_sub(const_like(1.0, x), cai.erf(x))
    return cai.broadcasting_where(less(z, 0.5), near, tail)


def reduced(x: ir.Value) -> tuple[ir.Value, ir.Value]:
    """``(x - round(x), round(x))``: the exact argument reduction for ``sin(pi x)``."""
    r = cai.round_(x)
    return cai.broadcasting_sub(x, r), r


def is_nonpositive_integer(x: ir.Value) -> ir.Value:
    """Whether ``x`` is 0, -1, -2, ... (the poles of the gamma family)."""
    return cai.broadcasting_and(
        cai.broadcasting_greater(const_like(0.5, x), x), cai.broadcasting_equal(floor_values(x), x)
    )


_LANCZOS_G = 7.0
_LANCZOS = [
    0.99999999999980993,
    676.5203681218851,
    -1259.1392167224028,
    771.32342877765313,
    -176.61503916999185,
    12.507343278686905,
    -0.13857109526572012,
    9.9843695780195716e-6,
    1.5056327351493116e-7,
]


def _lgamma_positive(x: ir.Value) -> ir.Value:
    """Lanczos approximation for ``x >= 0.5``."""
    z = sub(x, 1.0)
    a = const_like(_LANCZOS[0], x)
    for k, coefficient in enumerate(_LANCZOS[1:], start=1):
        a = cai.broadcasting_add(a, div(coefficient, add(z, float(k))))
    t = add(z, _LANCZOS_G + 0.5)
    return add(
        cai.broadcasting_sub(
            cai.broadcasting_mul(add(z, 0.5), cai.log(t)), cai.broadcasting_sub(t, cai.log(a))
        ),
        0.5 * math.log(2 * math.pi),
    )


def lgamma_values(x: ir.Value) -> ir.Value:
    """``log|Γ(x)|``; reflection below 0.5, +inf at the poles (non-positive integers)."""
    small = less(x, 0.5)
    reflected_arg = pick(small, sub(const_like(1.0, x), x), x, x)
    positive = _lgamma_positive(reflected_arg)
    frac, _ = reduced(x)
    sin_pi = cai.abs_(cai.sin(mul(frac, math.pi)))
    reflected = cai.broadcasting_sub(cai.log(div(math.pi, sin_pi)), positive)
    out = pick(small, reflected, positive, x)
    out = pick(is_nonpositive_integer(x), math.inf, out, x)
    return pick(isinf_values(x), math.inf, out, x)


def frexp_parts(a: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value]:
    """``(m, e, finite_nonzero)`` with ``a = m 2^e``, ``m`` in [0.5, 1), for float32 ``a >= 0``
    (``m = 1, e = 0`` where ``a`` is 0, inf or NaN)."""
    finite_nonzero = cai.broadcasting_and(
        equal(cai.broadcasting_sub(a, a), 0.0),
        cai.broadcasting_not_equal(a, const_like(0.0, a)),
    )
    safe = pick(finite_nonzero, a, 1.0, a)
    exponent = add(floor_values(mul(cai.log(safe), 1 / math.log(2.0))), 1.0)
    # 2^-e in two halves so that subnormal inputs do not overflow the scale factor
    half = floor_values(mul(exponent, 0.5))
    two = const_like(2.0, a)
    mantissa = cai.broadcasting_mul(
        cai.broadcasting_mul(safe, cai.broadcasting_pow(two, neg_values(half))),
        cai.broadcasting_pow(two, neg_values(cai.broadcasting_sub(exponent, half))),
    )
    # log2 is off by one next to powers of two: fix the exponent both ways
    too_big = cai.broadcasting_not_equal(less(mantissa, 1.0), const_like(True, finite_nonzero))
    mantissa = pick(too_big, mul(mantissa, 0.5), mantissa, a)
    exponent = pick(too_big, add(exponent, 1.0), exponent, a)
    too_small = less(mantissa, 0.5)
    mantissa = pick(too_small, mul(mantissa, 2.0), mantissa, a)
    exponent = pick(too_small, sub(exponent, 1.0), exponent, a)
    return mantissa, exponent, finite_nonzero
