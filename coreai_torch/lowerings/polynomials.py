"""Orthogonal polynomials of ``torch.special``: Chebyshev T/U/V/W and their shifted forms,
Hermite H/He, Laguerre L and Legendre P, of a tensor or scalar degree ``n``.

ATen evaluates them element by element (``aten/src/ATen/native/Math.h``): the degree is
``n`` truncated to an integer (NaN, ±inf and values beyond int64 count as negative), then
special cases (``n < 0`` → 0, ``|x| == 1``, ``x == 0``...), for Chebyshev a closed form
(``cos(n acos x)``...) when ``n`` is large and ``|x| < 1``, and otherwise the three-term
recurrence run ``n - 1`` times.  The same order of cases is reproduced here.

The recurrence is a ``coreai.while`` loop over all elements at once: an element steps while
its step count is not reached and its value is not NaN (ATen stops there too; a NaN stays
NaN), and the loop ends when no element steps.  With a scalar degree it is unrolled (or
looped a fixed number of times for large degrees).  Elements whose value the recurrence
never defines in ATen (``U``, ``V``, ``W``, ``L``, ``P`` of NaN with ``n >= 2`` read an
uninitialised variable there) are NaN.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import (
    Number,
    add,
    all_of,
    cast,
    constant,
    div,
    dtype_of,
    equal,
    greater,
    less,
    mul,
    not_nan,
    pick,
    sub,
)
from coreai_torch.lowerings.helpers.arithmetic import (
    floor_values,
    trunc_values,
)
from coreai_torch.lowerings.helpers.loops import elementwise_loop
from coreai_torch.lowerings.helpers.operands import (
    Operand,
    const_like,
    operand,
    opmath,
)
from coreai_torch.lowerings.registry import LoweringContext, lowering

#: ``step(j, p, q)`` -> the next value from the two previous ones (``j`` = 1, 2, ...)
Step = Callable[[ir.Value, ir.Value, ir.Value], ir.Value]

#: degrees up to this are unrolled when the degree is a scalar
UNROLL_LIMIT = 32
#: the loop gives up after this many steps (ATen would run for hours before that)
STEP_LIMIT = 2**30

# ------------------------------------------------------------------------------ helpers ----


def _not(cond: ir.Value) -> ir.Value:
    return cai.not_(cond)


def _even(d: ir.Value) -> ir.Value:
    """Whether the integer-valued ``d`` is even."""
    return cai.broadcasting_equal(mul(floor_values(mul(d, 0.5)), 2.0), d)


def _signed(cond: ir.Value, value: ir.Value) -> ir.Value:
    """``value`` where ``cond``, else ``-value``."""
    return cai.broadcasting_where(cond, value, sub(0.0, value))


def degree_values(n: ir.Value) -> ir.Value:
    """``static_cast<int64_t>(n)`` as a float: truncated, and -1 (any negative) for NaN, ±inf
    and values outside int64 (x86 converts those to INT64_MIN)."""
    d = trunc_values(n)
    return pick(less(cai.abs_(d), 2.0**63), d, -1.0, d)


def degree_scalar(n: float) -> int:
    """The degree of a scalar ``n`` (see :func:`degree_values`; ``n`` becomes a float
    tensor first, like any scalar operand)."""
    n = float(n)
    if not (math.isfinite(n) and abs(math.trunc(n)) < 2.0**63):
        return -1
    return int(n)


# -------------------------------------------------------------------------- recurrence ----


@dataclass
class Polynomial:
    """One family: ``cases(x, d)`` are the ``(condition, value)`` special cases that come
    before the recurrence in ATen (in order), ``first(x)`` the value at ``n == 1``,
    ``step`` the recurrence."""

    cases: Callable[[ir.Value, ir.Value], list[tuple[ir.Value, Number]]]
    first: Callable[[ir.Value], ir.Value]
    step: Callable[[ir.Value], Step]


def _looped(step: Step, q: ir.Value, needed: ir.Value, steps: ir.Value) -> ir.Value:
    """``q`` after ``steps`` steps where ``needed`` (elements stop early at NaN)."""

    def advance(i: ir.Value, values: list[ir.Value]) -> tuple[list[ir.Value], ir.Value]:
        p, q = values
        j = cast(cai.add(i, cai.constant(np.int32(1))), dtype_of(q))
        r = step(j, p, q)
        return [q, r], cai.broadcasting_and(
            _not(cai.broadcasting_greater(add(j, 1.0), steps)), not_nan(r)
        )

    live = all_of(needed, _not(less(steps, 1.0)), not_nan(q))
    ones = pick(live, 1.0, 1.0, q)
    return elementwise_loop(live, [ones, q], advance, STEP_LIMIT)[1]


def evaluate(poly: Polynomial, x: ir.Value, d: ir.Value, static: int | None) -> ir.Value:
    """The polynomial of degree ``d`` (integer-valued float, see :func:`degree_values`) at
    ``x``; ``static`` is the degree when it is a scalar."""
    first = poly.first(x)
    cases = [(less(d, 0.0), 0.0), *poly.cases(x, d), (equal(d, 0.0), 1.0), (equal(d, 1.0), first)]
    # every element's shape: x and d broadcast together
    shaped = pick(not_nan(d), first, first, first)
    if static is not None and static < 2:
        out = shaped
    elif static is not None and static - 1 <= UNROLL_LIMIT:
        p, q = const_like(1.0, x), shaped
        for j in range(1, static):
            p, q = q, poly.step(x)(const_like(float(j), x), p, q)
        out = q
    else:
        needed = all_of(*(_not(cond) for cond, _ in cases))
        out = _looped(poly.step(x), shaped, needed, sub(d, 1.0))
    for cond, value in reversed(cases):
        out = pick(cond, value, out, x)
    return out


# ------------------------------------------------------------------------------ families ---


def _chebyshev(kind: str, shifted: bool) -> Polynomial:
    """Chebyshev polynomials of the first to fourth kind, of ``x`` or of ``2x - 1``."""
    threshold = {"t": 6, "u": 8, "v": 8, "w": 8}[kind]
    if shifted:
        threshold = 4 if kind == "w" else 6

    def arg(x: ir.Value) -> ir.Value:
        return sub(add(x, x), 1.0) if shifted else x

    def first(x: ir.Value) -> ir.Value:
        y = arg(x)
        two_y = add(y, y)
        return {"t": y, "u": two_y, "v": sub(two_y, 1.0), "w": add(two_y, 1.0)}[kind]

    def cases(x: ir.Value, d: ir.Value) -> list[tuple[ir.Value, Number]]:
        y = arg(x)
        top, bottom = equal(x, 1.0), equal(x, 0.0 if shifted else -1.0)
        even = _even(d)
        n1 = add(d, 1.0)
        n21 = add(add(d, d), 1.0)
        one = const_like(1.0, x)
        at_top = {"t": one, "u": n1, "v": one, "w": n21}[kind]
        at_bottom = {
            "t": _signed(even, one),
            "u": _signed(even, n1),
            "v": _signed(even, n21),
            "w": _signed(even, one),
        }[kind]
        theta = cai.acos(y)
        if kind == "t":
            closed = cai.cos(cai.broadcasting_mul(d, theta))
        elif kind == "u":
            s = cai.sin(theta)
            closed = pick(
                equal(s, 0.0),
                div(cai.broadcasting_mul(n1, cai.cos(cai.broadcasting_mul(n1, theta))), y),
                cai.broadcasting_divide(cai.sin(cai.broadcasting_mul(n1, theta)), s),
                x,
            )
        else:
            half = mul(theta, 0.5)
            angle = cai.broadcasting_mul(add(d, 0.5), theta)
            if kind == "v":
                degenerate = equal(cai.sin(half), 1.0)
                ratio = cai.broadcasting_divide(cai.cos(angle), cai.cos(half))
            else:
                degenerate = equal(cai.cos(half), 1.0)
                ratio = cai.broadcasting_divide(cai.sin(angle), cai.sin(half))
            fallback = at_top if kind == "w" and not shifted else at_bottom
            closed = pick(degenerate, fallback, ratio, x)
        inside = cai.broadcasting_and(greater(d, float(threshold)), less(cai.abs_(y), 1.0))
        return [(top, at_top), (bottom, at_bottom), (inside, closed)]

    def step(x: ir.Value) -> Step:
        y = arg(x)
        two_y = add(y, y)
        return lambda j, p, q: cai.broadcasting_sub(cai.broadcasting_mul(two_y, q), p)

    return Polynomial(cases, first, step)


def _hermite_limit(x: ir.Value) -> float:
    return 512.0 if dtype_of(x) == torch.float64 else 128.0


HERMITE_H = Polynomial(
    cases=lambda x, d: [(greater(d, _hermite_limit(x)), math.nan)],
    first=lambda x: add(x, x),
    step=lambda x: (
        lambda j, p, q: cai.broadcasting_sub(
            cai.broadcasting_mul(add(x, x), q), cai.broadcasting_mul(add(j, j), p)
        )
    ),
)

HERMITE_HE = Polynomial(
    cases=lambda x, d: [(greater(d, _hermite_limit(x)), math.nan)],
    first=lambda x: x,
    step=lambda x: (
        lambda j, p, q: cai.broadcasting_sub(cai.broadcasting_mul(x, q), cai.broadcasting_mul(j, p))
    ),
)

LAGUERRE_L = Polynomial(
    cases=lambda x, d: [(equal(cai.abs_(x), 0.0), 1.0)],
    first=lambda x: sub(1.0, x),
    step=lambda x: (
        lambda j, p, q: cai.broadcasting_divide(
            cai.broadcasting_sub(
                cai.broadcasting_mul(cai.broadcasting_add(add(j, j), sub(1.0, x)), q),
                cai.broadcasting_mul(j, p),
            ),
            add(j, 1.0),
        )
    ),
)


def _legendre_cases(x: ir.Value, d: ir.Value) -> list[tuple[ir.Value, Number]]:
    one = const_like(1.0, x)
    return [(equal(cai.abs_(x), 1.0), _signed(cai.broadcasting_or(greater(x, 0.0), _even(d)), one))]


LEGENDRE_P = Polynomial(
    cases=_legendre_cases,
    first=lambda x: x,
    step=lambda x: (
        lambda j, p, q: cai.broadcasting_divide(
            cai.broadcasting_sub(
                cai.broadcasting_mul(cai.broadcasting_mul(add(add(j, j), 1.0), x), q),
                cai.broadcasting_mul(j, p),
            ),
            add(j, 1.0),
        )
    ),
)

POLYNOMIALS: dict[str, Polynomial] = {
    "hermite_polynomial_h": HERMITE_H,
    "hermite_polynomial_he": HERMITE_HE,
    "laguerre_polynomial_l": LAGUERRE_L,
    "legendre_polynomial_p": LEGENDRE_P,
}
for _kind in "tuvw":
    POLYNOMIALS[f"chebyshev_polynomial_{_kind}"] = _chebyshev(_kind, shifted=False)
    POLYNOMIALS[f"shifted_chebyshev_polynomial_{_kind}"] = _chebyshev(_kind, shifted=True)


def _rule(poly: Polynomial) -> Callable[..., ir.Value]:
    def rule(cx: LoweringContext, x: Operand, n: Operand) -> ir.Value:
        dtype = opmath(cx.out_dtype)
        static = None
        if isinstance(n, ir.Value):
            d = degree_values(operand(n, dtype))
        else:
            static = degree_scalar(n)
            d = constant(float(static), dtype)
        xv = operand(x, dtype)
        return cast(evaluate(poly, xv, d, static), cx.out_dtype)

    return rule


for _name, _poly in POLYNOMIALS.items():
    lowering(
        f"aten::special_{_name}.default",
        f"aten::special_{_name}.x_scalar",
        f"aten::special_{_name}.n_scalar",
    )(_rule(_poly))
