"""Elementwise building blocks with PyTorch's semantics: truthiness, filled tensors, ``where``
with scalars, comparisons (bool operands compare as uint8), NaN/inf tests, sign, negation,
rounding toward -inf/+inf/0 and clamping.

Core AI has round-half-even but no floor/ceil; they are derived from ``round`` so that
infinities, NaN, -0.0 and values beyond 2**23 come out exactly like PyTorch's.
"""

from __future__ import annotations

import torch

from coreai_torch import dtypes
from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import Scalar, cast, constant, dtype_of
from coreai_torch.lowerings.helpers.operands import (
    Operand,
    const_like,
    is_float_value,
    is_value,
    numeric,
    operand,
)


def to_bool(x: Operand) -> ir.Value:
    """PyTorch's truthiness: nonzero (NaN included) is true."""
    if is_value(x):
        if dtype_of(x) == torch.bool:
            return x
        return cai.broadcasting_not_equal(x, const_like(0, x))
    return constant(bool(x), torch.bool)


def all_false(x: ir.Value) -> ir.Value:
    """A bool tensor of ``x``'s shape (static or dynamic) filled with ``False``."""
    if is_float_value(x):
        return cai.broadcasting_greater(x, x)  # false even for NaN, unlike x != x
    return cai.broadcasting_not_equal(x, x)


def full_like(x: ir.Value, value: Scalar, dtype: torch.dtype | None = None) -> ir.Value:
    """A tensor of ``x``'s shape (static or dynamic) filled with ``value``."""
    fill = constant(value, dtype or dtype_of(x))
    return cai.broadcasting_where(all_false(x), fill, fill)


def select(cond: ir.Value, a: Operand, b: Operand, like: ir.Value) -> ir.Value:
    """``where(cond, a, b)`` with scalars converted to ``like``'s dtype."""
    dtype = dtype_of(like)
    return cai.broadcasting_where(cond, operand(a, dtype), operand(b, dtype))


def gt(a: ir.Value, b: ir.Value) -> ir.Value:
    return cai.broadcasting_greater(numeric(a), numeric(b))


def lt(a: ir.Value, b: ir.Value) -> ir.Value:
    return gt(b, a)


def ge(a: ir.Value, b: ir.Value) -> ir.Value:
    return cai.broadcasting_or(gt(a, b), cai.broadcasting_equal(a, b))


def le(a: ir.Value, b: ir.Value) -> ir.Value:
    return ge(b, a)


def isnan_values(x: ir.Value) -> ir.Value:
    if not is_float_value(x):
        return all_false(x)
    return cai.broadcasting_not_equal(x, x)


def isinf_values(x: ir.Value) -> ir.Value:
    if not is_float_value(x):
        return all_false(x)
    return cai.broadcasting_equal(cai.abs_(x), const_like(float("inf"), x))


def signbit_values(x: ir.Value) -> ir.Value:
    """``x < 0``, true for ``-0.0`` too (through ``1 / -0.0 == -inf``)."""
    dtype = dtype_of(x)
    if dtype == torch.bool or (dtypes.is_integer(dtype) and not dtype.is_signed):
        return all_false(x)
    zero = const_like(0, x)
    negative = cai.broadcasting_greater(zero, x)
    if not dtype.is_floating_point:
        return negative
    negative_zero = cai.broadcasting_and(
        cai.broadcasting_equal(x, zero),
        cai.broadcasting_greater(zero, cai.broadcasting_divide(const_like(1.0, x), x)),
    )
    return cai.broadcasting_or(negative, negative_zero)


def sign_values(x: ir.Value) -> ir.Value:
    """-1, 0 or 1 (0 for NaN, like PyTorch)."""
    if dtype_of(x) == torch.bool:
        return x
    zero = const_like(0, x)
    dtype = dtype_of(x)
    pos = cast(cai.broadcasting_greater(x, zero), dtype)
    if dtypes.is_integer(dtype) and not dtype.is_signed:
        return pos
    return cai.broadcasting_sub(pos, cast(cai.broadcasting_greater(zero, x), dtype))


def neg_values(x: ir.Value) -> ir.Value:
    return cai.broadcasting_sub(const_like(0, x), x)


def _round_toward(x: ir.Value, up: bool) -> ir.Value:
    if not is_float_value(x):
        return x
    r = cai.round_(x)
    overshoot = cai.broadcasting_greater(x, r) if up else cai.broadcasting_greater(r, x)
    step = const_like(1.0 if up else -1.0, x)
    return cai.broadcasting_where(overshoot, cai.broadcasting_add(r, step), r)


def floor_values(x: ir.Value) -> ir.Value:
    return _round_toward(x, False)


def ceil_values(x: ir.Value) -> ir.Value:
    return _round_toward(x, True)


def trunc_values(x: ir.Value) -> ir.Value:
    if not is_float_value(x):
        return x
    return cai.broadcasting_where(
        cai.broadcasting_greater(const_like(0.0, x), x), ceil_values(x), floor_values(x)
    )


def clamp_values(x: ir.Value, lo: Operand | None, hi: Operand | None) -> ir.Value:
    """``min(max(x, lo), hi)`` (NaN propagates, ``lo > hi`` gives ``hi``, like PyTorch)."""
    dtype = dtype_of(x)
    if dtype == torch.bool:
        if lo is not None:
            x = cai.broadcasting_or(x, operand(lo, dtype))
        if hi is not None:
            x = cai.broadcasting_and(x, operand(hi, dtype))
        return x
    if lo is not None:
        x = cai.broadcasting_maximum(x, operand(lo, dtype))
    if hi is not None:
        x = cai.broadcasting_minimum(x, operand(hi, dtype))
    return x
