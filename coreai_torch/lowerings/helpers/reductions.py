"""Reductions, arg-max/min and scans along axes, and the size limit of the pairwise
formulations (mode, histc, bucketize, searchsorted, cdist).

Core AI reductions keep the reduced dimensions; PyTorch's ``keepdim=False`` is a squeeze
afterwards.  Core AI has no argmin: it is ``argmax`` of an order-reversed copy (``-x`` for
floats, ``~x`` for integers, which cannot overflow), and the index of the first NaN wins like
in PyTorch (Core AI's ``argmax`` ignores NaN).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import (
    cast,
    dim_size,
    dtype_of,
    i32,
    normalize_dims,
    numel,
    rank_of,
    squeeze,
)
from coreai_torch.lowerings.helpers.arithmetic import isnan_values, neg_values
from coreai_torch.lowerings.helpers.operands import const_like
from coreai_torch.lowerings.registry import LoweringContext

Dims = Sequence[int] | int | None

#: Largest intermediate (in elements) that the pairwise formulations (mode, histc, bucketize,
#: searchsorted, cdist) may build; beyond it they are rejected instead of exhausting memory.
PAIRWISE_LIMIT = 2**26


def check_size(cx: LoweringContext, value: ir.Value, what: str) -> ir.Value:
    """``value``, after checking that its static size is within :data:`PAIRWISE_LIMIT`."""
    size = numel(value)
    if size is not None and size > PAIRWISE_LIMIT:
        raise cx.unsupported(
            f"{what} would build an intermediate of {size} elements (limit {PAIRWISE_LIMIT})"
        )
    return value


def reduce(fn: Callable[..., ir.Value], x: ir.Value, dims: Dims, keepdim: bool) -> ir.Value:
    """Apply a keep-dims Core AI reduction over ``dims`` and drop them unless ``keepdim``.

    ``None`` or an empty list means every dimension (PyTorch's convention for sum/amax).
    """
    rank = rank_of(x)
    if rank == 0:
        return x
    axes = normalize_dims(dims, rank)
    out = fn(x, i32(axes))
    return out if keepdim else squeeze(out, axes)


def _order_reversed(x: ir.Value) -> ir.Value:
    """A copy of ``x`` whose order is reversed, without overflow (for argmin)."""
    dtype = dtype_of(x)
    if dtype.is_floating_point:
        return neg_values(x)
    if dtype == torch.bool:
        return cast(cai.not_(x), torch.uint8)
    all_ones = -1 if dtype.is_signed else torch.iinfo(dtype).max
    return cai.broadcasting_bitwise_xor(x, const_like(all_ones, x))


def arg_extreme(x: ir.Value, axis: int, largest: bool) -> ir.Value:
    """First index of the max (min) along ``axis`` (kept as size 1), first NaN if any; int64."""
    key = x if largest else _order_reversed(x)
    if dtype_of(key) == torch.bool:
        key = cast(key, torch.uint8)
    index = cai.argmax(key, i32(axis))
    if dtype_of(x).is_floating_point:
        nan = cast(isnan_values(x), torch.uint8)
        has_nan = cai.any_(isnan_values(x), i32([axis]))
        index = cai.broadcasting_where(has_nan, cai.argmax(nan, i32(axis)), index)
    return cast(index, torch.int64)


def scan(x: ir.Value, axis: int, combiner: str, *, reverse: bool = False) -> ir.Value:
    """Inclusive scan of ``x`` along ``axis`` with ``combiner`` (sum/product/min/max)."""
    return cai.scan(x, np.uint32(axis), reverse, combiner)


def positions(x: ir.Value, axis: int) -> ir.Value:
    """0, 1, ... along ``axis`` as int64, shaped to broadcast against ``x``."""
    rank = rank_of(x)
    size = dim_size(x, axis)
    if isinstance(size, int):
        iota = cai.constant(np.arange(size, dtype=np.int64))
    else:
        stop = cast(size, torch.int64)
        iota = cai.range_(cai.constant(np.int64(0)), stop, cai.constant(np.int64(1)))
    trailing = rank - 1 - axis
    if trailing == 0:
        return iota
    return cai.reshape(iota, i32([-1] + [1] * trailing))
