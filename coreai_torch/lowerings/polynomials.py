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
from coreai_torch.lowerings.common import cast, constant, dtype_of, i32, rank_of, squeeze
from coreai_torch.lowerings.elementwise import (
    Operand,
    const_like,
    floor_values,
    operand,
    opmath,
    trunc_values,
)
from coreai_torch.lowerings.registry import LoweringContext, lowering

Value = ir.Value | float
#: ``step(j, p, q)`` -> the next value from the two previous ones (``j`` = 1, 2, ...)
Step = Callable[[ir.Value, ir.Value, ir.Value], ir.Value]

#: degrees up to this are unrolled when the degree is a scalar
UNROLL_LIMIT = 32
#: the loop gives up after this many steps (ATen would run for hours before that)
STEP_LIMIT = 2**30

# ------------------------------------------------------------------------------ helpers ----


def _v(a: Value, like: ir.Value) -> ir.Value:
    return a if isinstance(a, ir.Value) else const_like(a, like)


def _add(a: ir.Value, b: Value) -> ir.Value:
    return cai.broadcasting_add(a, _v(b, a))


def _sub(a: Value, b: Value) -> ir.Value:
    if not isinstance(a, ir.Value):
        return cai.broadcasting_sub(_v(a, b), b)
    return cai.broadcasting_sub(a, _v(b, a))


def _mul(a: ir.Value, b: Value) -> ir.Value:
    return cai.broadcasting_mul(a, _v(b, a))


def _div(a: ir.Value, b: Value) -> ir.Value:
    return cai.broadcasting_divide(a, _v(b, a))


def _eq(a: ir.Value, b: float) -> ir.Value:
    return cai.broadcasting_equal(a, const_like(b, a))


def _lt(a: ir.Value, b: float) -> ir.Value:
    return cai.broadcasting_greater(const_like(b, a), a)


def _gt(a: ir.Value, b: float) -> ir.Value:
    return cai.broadcasting_greater(a, const_like(b, a))


def _where(cond: ir.Value, a: Value, b: Value, like: ir.Value) -> ir.Value:
    return cai.broadcasting_where(cond, _v(a, like), _v(b, like))


def _and(*conds: ir.Value) -> ir.Value:
    out = conds[0]
    for c in conds[1:]:
        out = cai.broadcasting_and(out, c)
    return out


def _not_nan(a: ir.Value) -> ir.Value:
    return cai.broadcasting_equal(a, a)


def _not(cond: ir.Value) -> ir.Value:
    return cai.not_(cond)


def _even(d: ir.Value) -> ir.Value:
    """Whether the integer-valued ``d`` is even."""
    return cai.broadcasting_equal(_mul(floor_values(_mul(d, 0.5)), 2.0), d)


def _signed(cond: ir.Value, value: ir.Value) -> ir.Value:
    """``value`` where ``cond``, else ``-value``."""
    return cai.broadcasting_where(cond, value, _sub(0.0, value))


def degree_values(n: ir.Value) -> ir.Value:
    """``static_cast<int64_t>(n)`` as a float: truncated, and -1 (any negative) for NaN, ±inf
    and values outside int64 (x86 converts those to INT64_MIN)."""
    d = trunc_values(n)
    return _where(_lt(cai.abs_(d), 2.0**63), d, -1.0, d)


def degree_scalar(n: float) -> int:
    """The degree of a scalar ``n`` (see :func:`degree_values`)."""
    if isinstance(n, float) and not (math.isfinite(n) and abs(math.trunc(n)) < 2.0**63):
        return -1
    return int(n)


# -------------------------------------------------------------------------- recurrence ----


@dataclass
class Polynomial:
    """One family: ``cases(x, d)`` are the ``(condition, value)`` special cases that come
    before the recurrence in ATen (in order), ``first(x)`` the value at ``n == 1``,
    ``step`` the recurrence."""

    cases: Callable[[ir.Value, ir.Value], list[tuple[ir.Value, Value]]]
    first: Callable[[ir.Value], ir.Value]
    step: Callable[[ir.Value], Step]


def _any(mask: ir.Value) -> ir.Value:
    rank = rank_of(mask)
    if rank == 0:
        return mask
    return squeeze(cai.any_(mask, i32(list(range(rank)))), list(range(rank)))


def _looped(step: Step, p: ir.Value, q: ir.Value, needed: ir.Value, steps: ir.Value) -> ir.Value:
    """``q`` after ``steps`` steps where ``needed`` (a ``coreai.while`` over every element)."""
    j0 = cai.constant(np.int32(1))
    limit = cai.constant(np.int32(STEP_LIMIT))

    def active(j: ir.Value, q: ir.Value) -> ir.Value:
        k = cast(j, dtype_of(q))
        return _and(needed, _not(cai.broadcasting_greater(k, steps)), _not_nan(q))

    loop, (before, after) = cai.while_([j0.type, p.type, q.type], [j0, p, q])
    with before:
        j, p_, q_ = before.arguments
        go = cai.broadcasting_and(_any(active(j, q_)), cai.broadcasting_greater(limit, j))
        cai.condition(cai.not_(cai.not_(go)), *before.arguments)
    with after:
        j, p_, q_ = after.arguments
        moving = active(j, q_)
        r = step(cast(j, dtype_of(q_)), p_, q_)
        cai.yield_(
            [
                cai.add(j, cai.constant(np.int32(1))),
                cai.broadcasting_where(moving, q_, p_),
                cai.broadcasting_where(moving, r, q_),
            ]
        )
    return list(loop)[2]


def evaluate(poly: Polynomial, x: ir.Value, d: ir.Value, static: int | None) -> ir.Value:
    """The polynomial of degree ``d`` (integer-valued float, see :func:`degree_values`) at
    ``x``; ``static`` is the degree when it is a scalar."""
    first = poly.first(x)
    cases = [(_lt(d, 0.0), 0.0), *poly.cases(x, d), (_eq(d, 0.0), 1.0), (_eq(d, 1.0), first)]
    # every element's shape: x and d broadcast together
    shaped = _where(_not_nan(d), first, first, first)
    if static is not None and static < 2:
        out = shaped
    elif static is not None and static - 1 <= UNROLL_LIMIT:
        p, q = const_like(1.0, x), shaped
        for j in range(1, static):
            p, q = q, poly.step(x)(const_like(float(j), x), p, q)
        out = q
    else:
        needed = _and(*(_not(cond) for cond, _ in cases), _not_nan(shaped))
        ones = _where(_not_nan(shaped), 1.0, 1.0, shaped)
        out = _looped(poly.step(x), ones, shaped, needed, _sub(d, 1.0))
    for cond, value in reversed(cases):
        out = _where(cond, value, out, x)
    return out


# ------------------------------------------------------------------------------ families ---


def _chebyshev(kind: str, shifted: bool) -> Polynomial:
    """Chebyshev polynomials of the first to fourth kind, of ``x`` or of ``2x - 1``."""
    threshold = {"t": 6, "u": 8, "v": 8, "w": 8}[kind]
    if shifted:
        threshold = 4 if kind == "w" else 6

    def arg(x: ir.Value) -> ir.Value:
        return _sub(_add(x, x), 1.0) if shifted else x

    def first(x: ir.Value) -> ir.Value:
        y = arg(x)
        two_y = _add(y, y)
        return {"t": y, "u": two_y, "v": _sub(two_y, 1.0), "w": _add(two_y, 1.0)}[kind]

    def cases(x: ir.Value, d: ir.Value) -> list[tuple[ir.Value, Value]]:
        y = arg(x)
        top, bottom = _eq(x, 1.0), _eq(x, 0.0 if shifted else -1.0)
        even = _even(d)
        n1 = _add(d, 1.0)
        n21 = _add(_add(d, d), 1.0)
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
            closed = _where(
                _eq(s, 0.0),
                _div(cai.broadcasting_mul(n1, cai.cos(cai.broadcasting_mul(n1, theta))), y),
                cai.broadcasting_divide(cai.sin(cai.broadcasting_mul(n1, theta)), s),
                x,
            )
        else:
            half = _mul(theta, 0.5)
            angle = cai.broadcasting_mul(_add(d, 0.5), theta)
            if kind == "v":
                degenerate = _eq(cai.sin(half), 1.0)
                ratio = cai.broadcasting_divide(cai.cos(angle), cai.cos(half))
            else:
                degenerate = _eq(cai.cos(half), 1.0)
                ratio = cai.broadcasting_divide(cai.sin(angle), cai.sin(half))
            fallback = at_top if kind == "w" and not shifted else at_bottom
            closed = _where(degenerate, fallback, ratio, x)
        inside = cai.broadcasting_and(_gt(d, float(threshold)), _lt(cai.abs_(y), 1.0))
        return [(top, at_top), (bottom, at_bottom), (inside, closed)]

    def step(x: ir.Value) -> Step:
        y = arg(x)
        two_y = _add(y, y)
        return lambda j, p, q: cai.broadcasting_sub(cai.broadcasting_mul(two_y, q), p)

    return Polynomial(cases, first, step)


def _hermite_limit(x: ir.Value) -> float:
    return 512.0 if dtype_of(x) == torch.float64 else 128.0


HERMITE_H = Polynomial(
    cases=lambda x, d: [(_gt(d, _hermite_limit(x)), math.nan)],
    first=lambda x: _add(x, x),
    step=lambda x: (
        lambda j, p, q: cai.broadcasting_sub(
            cai.broadcasting_mul(_add(x, x), q), cai.broadcasting_mul(_add(j, j), p)
        )
    ),
)

HERMITE_HE = Polynomial(
    cases=lambda x, d: [(_gt(d, _hermite_limit(x)), math.nan)],
    first=lambda x: x,
    step=lambda x: (
        lambda j, p, q: cai.broadcasting_sub(cai.broadcasting_mul(x, q), cai.broadcasting_mul(j, p))
    ),
)

LAGUERRE_L = Polynomial(
    cases=lambda x, d: [(_eq(cai.abs_(x), 0.0), 1.0)],
    first=lambda x: _sub(1.0, x),
    step=lambda x: (
        lambda j, p, q: cai.broadcasting_divide(
            cai.broadcasting_sub(
                cai.broadcasting_mul(cai.broadcasting_add(_add(j, j), _sub(1.0, x)), q),
                cai.broadcasting_mul(j, p),
            ),
            _add(j, 1.0),
        )
    ),
)


def _legendre_cases(x: ir.Value, d: ir.Value) -> list[tuple[ir.Value, Value]]:
    one = const_like(1.0, x)
    return [(_eq(cai.abs_(x), 1.0), _signed(cai.broadcasting_or(_gt(x, 0.0), _even(d)), one))]


LEGENDRE_P = Polynomial(
    cases=_legendre_cases,
    first=lambda x: x,
    step=lambda x: (
        lambda j, p, q: cai.broadcasting_divide(
            cai.broadcasting_sub(
                cai.broadcasting_mul(cai.broadcasting_mul(_add(_add(j, j), 1.0), x), q),
                cai.broadcasting_mul(j, p),
            ),
            _add(j, 1.0),
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
