"""Sorting and selection: sort, topk, kthvalue, median/nanmedian, bucketize, searchsorted.

Sorts are stable (ties keep their input order, which is what PyTorch's CPU sort returns).
NaN sorts as the largest value like in PyTorch: last ascending, *first* descending — Core AI
puts NaN last in both directions, so descending float sorts move NaNs to the front with a
second (stable) sort on ``isnan``.  ``topk(sorted=False)`` returns sorted results (PyTorch
leaves that order unspecified).
"""

from __future__ import annotations

import numpy as np
import torch

from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import (
    Scalar,
    Size,
    cast,
    constant,
    dim_size,
    dtype_of,
    i32,
    normalize_dim,
    rank_of,
    squeeze,
    unsqueeze,
)
from coreai_torch.lowerings.helpers.arithmetic import (
    floor_values,
    ge,
    gt,
    isnan_values,
    le,
)
from coreai_torch.lowerings.helpers.layout import slice_axis
from coreai_torch.lowerings.helpers.operands import (
    Operand,
    const_like,
    operand,
    opmath,
    result_dtype,
)
from coreai_torch.lowerings.helpers.reductions import (
    arg_extreme,
    check_size,
    positions,
)
from coreai_torch.lowerings.registry import LoweringContext, lowering


def sort_indices(x: ir.Value, axis: int, descending: bool) -> ir.Value:
    """Stable sorting permutation along ``axis`` (``si32``), NaN as the largest value."""
    key = cast(x, torch.uint8) if dtype_of(x) == torch.bool else x
    order = cai.argsort(key, i32(axis), descending, True)
    if descending and dtype_of(x).is_floating_point:
        nan = cast(isnan_values(cai.gather_along_axis(x, order, i32(axis))), torch.uint8)
        nan_first = cai.argsort(nan, i32(axis), True, True)
        order = cai.gather_along_axis(order, nan_first, i32(axis))
    return order


def take(x: ir.Value, order: ir.Value, axis: int) -> ir.Value:
    return cai.gather_along_axis(x, order, i32(axis))


def _sorted(x: ir.Value, dim: int, descending: bool) -> list[ir.Value]:
    if rank_of(x) == 0:
        return [x, constant(0, torch.int64)]
    axis = normalize_dim(dim, rank_of(x))
    order = sort_indices(x, axis, descending)
    return [take(x, order, axis), cast(order, torch.int64)]


@lowering("aten::sort.default")
def sort(cx: LoweringContext, self: ir.Value, dim: int = -1, descending: bool = False):
    return _sorted(self, dim, descending)


@lowering("aten::sort.stable")
def sort_stable(
    cx: LoweringContext,
    self: ir.Value,
    stable: bool | None = None,
    dim: int = -1,
    descending: bool = False,
):
    return _sorted(self, dim, descending)


@lowering("aten::argsort.default", "aten::argsort.stable")
def argsort(
    cx: LoweringContext,
    self: ir.Value,
    dim: int = -1,
    descending: bool = False,
    stable: bool = False,
) -> ir.Value:
    return _sorted(self, dim, descending)[1]


@lowering("aten::topk.default")
def topk(
    cx: LoweringContext,
    self: ir.Value,
    k: int,
    dim: int = -1,
    largest: bool = True,
    sorted: bool = True,
) -> list[ir.Value]:
    if not isinstance(k, int):
        raise cx.unsupported("topk with a runtime k")
    x = self
    if rank_of(x) == 0:
        return [x, constant(0, torch.int64)]
    axis = normalize_dim(dim, rank_of(x))
    order = slice_axis(sort_indices(x, axis, largest), axis, 0, k, size=k)
    return [take(x, order, axis), cast(order, torch.int64)]


def _select_sorted(x: ir.Value, axis: int, index: ir.Value | int, keepdim: bool) -> list[ir.Value]:
    """Value and input index of the ``index``-th smallest element along ``axis``."""
    order = sort_indices(x, axis, False)
    if isinstance(index, int) or rank_of(index) == 0:
        stop = index + 1 if isinstance(index, int) else cai.add(index, const_like(1, index))
        picked = slice_axis(order, axis, index, stop, size=1)
    else:
        picked = take(order, index, axis)
    values, indices = take(x, picked, axis), cast(picked, torch.int64)
    if not keepdim:
        values, indices = squeeze(values, [axis]), squeeze(indices, [axis])
    return [values, indices]


@lowering("aten::kthvalue.default")
def kthvalue(
    cx: LoweringContext, self: ir.Value, k: int, dim: int = -1, keepdim: bool = False
) -> list[ir.Value]:
    if rank_of(self) == 0:
        return [self, constant(0, torch.int64)]
    axis = normalize_dim(dim, rank_of(self))
    return _select_sorted(self, axis, k - 1, keepdim)


def _median(x: ir.Value, axis: int, keepdim: bool, ignore_nan: bool) -> list[ir.Value]:
    """Lower median along ``axis``; NaN wins unless ``ignore_nan``."""
    size = dim_size(x, axis)
    if isinstance(size, int):
        half: Size = (size - 1) // 2
    else:
        one = const_like(1, size)
        half = cai.floor_divide(cai.sub(size, one), cai.add(one, one))
    if not dtype_of(x).is_floating_point:
        return _select_sorted(x, axis, half, keepdim)
    nan = isnan_values(x)
    if ignore_nan:
        count = cai.reduce_sum(cast(cai.not_(nan), torch.int32), i32([axis]))
        middle = cai.broadcasting_floor_divide(
            cai.broadcasting_sub(count, const_like(1, count)), const_like(2, count)
        )
        # All NaN: PyTorch picks the middle of the whole (NaN) slice.
        middle = cai.broadcasting_where(
            cai.broadcasting_equal(count, const_like(0, count)), operand(half, torch.int32), middle
        )
        return _select_sorted(x, axis, middle, keepdim)
    values, indices = _select_sorted(x, axis, half, True)
    has_nan = cai.any_(nan, i32([axis]))
    values = cai.broadcasting_where(has_nan, const_like(float("nan"), x), values)
    indices = cai.broadcasting_where(has_nan, arg_extreme(x, axis, True), indices)
    if not keepdim:
        values, indices = squeeze(values, [axis]), squeeze(indices, [axis])
    return [values, indices]


def _median_rule(ignore_nan: bool):
    def whole(cx: LoweringContext, self: ir.Value) -> ir.Value:
        x = cai.reshape(self, i32([-1])) if rank_of(self) != 1 else self
        return squeeze(_median(x, 0, True, ignore_nan)[0], [0])

    def along(cx: LoweringContext, self: ir.Value, dim: int, keepdim: bool = False):
        if rank_of(self) == 0:
            return [self, constant(0, torch.int64)]
        return _median(self, normalize_dim(dim, rank_of(self)), keepdim, ignore_nan)

    return whole, along


for _name, _ignore in (("median", False), ("nanmedian", True)):
    _whole, _along = _median_rule(_ignore)
    lowering(f"aten::{_name}.default")(_whole)
    lowering(f"aten::{_name}.dim")(_along)


# ------------------------------------------------------------------- bucketize / search ---


def _count_below(
    cx: LoweringContext, sequence: ir.Value, values: ir.Value, right: bool, out_int32: bool
) -> ir.Value:
    """For each value, how many sequence entries (last axis) are ``<`` it (``<=`` if
    ``right``); NaN values count every entry.  ``sequence`` is 1-D or matches ``values``'
    leading dimensions."""
    below = ge if right else gt
    dtype = result_dtype(sequence, values)
    sequence, values = cast(sequence, dtype), cast(values, dtype)
    expanded = unsqueeze(values, [rank_of(values)])
    if rank_of(sequence) > 1:
        sequence = unsqueeze(sequence, [rank_of(sequence) - 1])
    hits = check_size(cx, below(expanded, sequence), "comparing every value with every boundary")
    hits = cai.broadcasting_or(hits, isnan_values(expanded))
    dtype = torch.int32 if out_int32 else torch.int64
    return squeeze(cai.reduce_sum(cast(hits, dtype), i32([-1])), [rank_of(values)])


def _as_tensor(x: Operand, like: ir.Value) -> ir.Value:
    return x if isinstance(x, ir.Value) else const_like(x, like)


@lowering("aten::bucketize.Tensor", "aten::bucketize.Scalar")
def bucketize(
    cx: LoweringContext,
    self: Operand,
    boundaries: ir.Value,
    out_int32: bool = False,
    right: bool = False,
) -> ir.Value:
    values = _as_tensor(self, boundaries)
    return _count_below(cx, boundaries, values, right, out_int32)


@lowering("aten::searchsorted.Tensor", "aten::searchsorted.Scalar")
def searchsorted(
    cx: LoweringContext,
    sorted_sequence: ir.Value,
    self: Operand,
    out_int32: bool = False,
    right: bool = False,
    side: str | None = None,
    sorter: ir.Value | None = None,
) -> ir.Value:
    sequence = sorted_sequence
    if sorter is not None:
        sequence = take(sequence, cast(sorter, torch.int32), rank_of(sequence) - 1)
    values = _as_tensor(self, sequence)
    return _count_below(cx, sequence, values, right or side == "right", out_int32)


# ------------------------------------------------------------------------ histc, mode ------


@lowering("aten::histc.default")
def histc(
    cx: LoweringContext, self: ir.Value, bins: int = 100, min: Scalar = 0, max: Scalar = 0
) -> ir.Value:
    """Counts of ``bins`` equal-width bins over [min, max] (the data's range when
    min == max), ignoring values outside it and NaN, with ATen's bin arithmetic."""
    x = cai.reshape(cast(self, opmath(cx.out_dtype)), i32([-1]))
    if min == max:
        lo = squeeze(cai.reduce_min(x, i32([0])), [0])
        hi = squeeze(cai.reduce_max(x, i32([0])), [0])
        same = cai.broadcasting_equal(lo, hi)
        lo = cai.broadcasting_where(same, cai.broadcasting_sub(lo, const_like(1.0, lo)), lo)
        hi = cai.broadcasting_where(same, cai.broadcasting_add(hi, const_like(1.0, hi)), hi)
    else:
        lo, hi = const_like(min, x), const_like(max, x)
    inside = cai.broadcasting_and(ge(x, lo), le(x, hi))
    scaled = cai.broadcasting_mul(cai.broadcasting_sub(x, lo), const_like(float(bins), x))
    position = floor_values(cai.broadcasting_divide(scaled, cai.broadcasting_sub(hi, lo)))
    position = cai.broadcasting_minimum(position, const_like(float(bins - 1), x))
    edges = cai.constant(np.arange(bins, dtype=np.float32))
    hits = cai.broadcasting_and(  # (elements, bins)
        cai.broadcasting_equal(unsqueeze(position, [1]), cast(edges, dtype_of(x))),
        unsqueeze(inside, [1]),
    )
    check_size(cx, hits, "counting every element against every bin")
    counts = squeeze(cai.reduce_sum(cast(hits, dtype_of(x)), i32([0])), [0])
    return cast(counts, cx.out_dtype)


@lowering("aten::mode.default")
def mode(
    cx: LoweringContext, self: ir.Value, dim: int = -1, keepdim: bool = False
) -> list[ir.Value]:
    """Most frequent value along ``dim`` (the smallest of equally frequent ones) and the
    index of its last occurrence, by counting pairwise equalities."""
    x = self
    if rank_of(x) == 0:
        return [x, constant(0, torch.int64)]
    axis = normalize_dim(dim, rank_of(x))
    key = cast(x, torch.uint8) if dtype_of(x) == torch.bool else x
    equal = cai.broadcasting_equal(unsqueeze(key, [axis + 1]), unsqueeze(key, [axis]))
    check_size(cx, equal, "comparing every element with every other one")
    counts = squeeze(cai.reduce_sum(cast(equal, torch.int32), i32([axis + 1])), [axis + 1])
    best = cai.broadcasting_equal(counts, cai.reduce_max(counts, i32([axis])))
    dtype = dtype_of(key)
    largest = float("inf") if dtype.is_floating_point else torch.iinfo(dtype).max
    value = cai.reduce_min(cai.broadcasting_where(best, key, const_like(largest, key)), i32([axis]))
    where_value = cai.broadcasting_equal(key, value)
    index = cai.reduce_max(
        cai.broadcasting_where(where_value, positions(key, axis), constant(-1, torch.int64)),
        i32([axis]),
    )
    value = cast(value, dtype_of(x))
    if not keepdim:
        value, index = squeeze(value, [axis]), squeeze(index, [axis])
    return [value, index]
