"""Reading by index: index.Tensor (advanced indexing), index_select, gather, embedding,
embedding_bag, masked_fill and nonzero."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from coreai_torch._mlir import cai, ir
from coreai_torch.frontend.sizes import flows_only_to_outputs
from coreai_torch.ir.values import (
    Scalar,
    as_value,
    broadcast_to,
    cast,
    constant,
    dim_size,
    dtype_of,
    i32,
    normalize_dim,
    rank_of,
    reshape,
    shape_of,
    transpose,
    unsqueeze,
)
from coreai_torch.lowerings.helpers.accumulation import accumulation_dtype
from coreai_torch.lowerings.helpers.layout import (
    broadcast_sizes,
    index_layout,
    result_permutation,
    slice_region,
    stacked_indices,
    static_shape,
    take_values,
)
from coreai_torch.lowerings.registry import LoweringContext, lowering


@lowering("aten::index.Tensor", "aten::_unsafe_index.Tensor")
def index(cx: LoweringContext, self: ir.Value, indices: Sequence[ir.Value | None]) -> ir.Value:
    if len(indices) == 1 and indices[0] is not None and dtype_of(indices[0]) == torch.bool:
        # x[mask]: the selected rows, in row-major order of the mask (data-dependent count).
        _check_only_returned(cx, "indexing with a boolean mask")
        return cai.gather_nd(self, _nonzero(indices[0]))
    positions, bshape, perm = index_layout(cx, self, indices)
    if not positions:
        return self
    x = transpose(self, perm)
    sizes = broadcast_sizes(indices, positions, bshape)
    out = cai.gather_nd(x, stacked_indices(indices, positions, sizes, bshape))  # negatives wrap
    return transpose(out, result_permutation(positions, len(bshape), rank_of(self)))


@lowering("aten::index_select.default")
def index_select(cx: LoweringContext, self: ir.Value, dim: int, index: ir.Value) -> ir.Value:
    if rank_of(self) == 0:
        return reshape(take_values(reshape(self, [1]), 0, index), [])
    return take_values(
        self, normalize_dim(dim, rank_of(self)), reshape(index, [-1]) if rank_of(index) else index
    )


@lowering("aten::gather.default")
def gather(
    cx: LoweringContext, self: ir.Value, dim: int, index: ir.Value, sparse_grad: bool = False
) -> ir.Value:
    rank = rank_of(self)
    if rank == 0:  # every index is 0
        return broadcast_to(self, static_shape(cx, index, "index"))
    d = normalize_dim(dim, rank)
    # PyTorch lets the index be smaller than the input in the other dims.
    sizes = [dim_size(index if a != d else self, a) for a in range(rank)]
    return cai.gather_along_axis(slice_region(self, sizes), cast(index, torch.int32), i32(d))


@lowering("aten::embedding.default")
def embedding(
    cx: LoweringContext,
    weight: ir.Value,
    indices: ir.Value,
    padding_idx: int = -1,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> ir.Value:
    idx = cast(indices, torch.int32)
    return cai.gather_nd(weight, unsqueeze(idx, [rank_of(idx)]))


@lowering("aten::embedding_renorm.default")
def embedding_renorm(
    cx: LoweringContext, self: ir.Value, indices: ir.Value, max_norm: float, norm_type: float
) -> ir.Value:
    """The weight with each row looked up by ``indices`` scaled down to ``max_norm``
    (PyTorch's ``max_norm`` option of ``embedding``)."""
    dtype = dtype_of(self)
    rows = static_shape(cx, self)[0]
    magnitude = cai.abs_(self)
    if norm_type == 1:
        norms = cai.reduce_sum(magnitude, i32([1]))
    elif norm_type == 2:
        norms = cai.sqrt(cai.reduce_sum(cai.broadcasting_mul(magnitude, magnitude), i32([1])))
    else:
        powered = cai.broadcasting_pow(magnitude, constant(float(norm_type), dtype))
        norms = cai.broadcasting_pow(
            cai.reduce_sum(powered, i32([1])), constant(1.0 / norm_type, dtype)
        )
    # Rows that some index refers to.
    count = int(np.prod(static_shape(cx, indices, "indices")))
    idx = reshape(cast(indices, torch.int32), [count, 1])
    used = cai.scatter_nd(
        constant(np.zeros(rows), torch.bool), idx, constant(np.ones(count), torch.bool)
    )
    too_long = cai.and_(
        reshape(used, [rows, 1]), cai.broadcasting_greater(norms, constant(max_norm, dtype))
    )
    scale = cai.broadcasting_divide(
        constant(max_norm, dtype), cai.broadcasting_add(norms, constant(1e-7, dtype))
    )
    return cai.broadcasting_where(too_long, cai.broadcasting_mul(self, scale), self)


@lowering("aten::masked_fill.Scalar", "aten::masked_fill.Tensor")
def masked_fill(
    cx: LoweringContext, self: ir.Value, mask: ir.Value, value: ir.Value | Scalar
) -> ir.Value:
    dtype = cx.out_dtype
    fill = as_value(value, dtype)
    out = cai.broadcasting_where(cast(mask, torch.bool), fill, cast(self, dtype))
    return broadcast_to(out, static_shape(cx, self)) if shape_of(out) != shape_of(self) else out


def _check_only_returned(cx: LoweringContext, what: str) -> None:
    """Data-dependent sizes may be zero at run time, and the runtime aborts when most ops
    consume an empty tensor: such results may only be returned (or have their size read),
    possibly through slices, selects, squeezes, transposes and casts."""
    if not flows_only_to_outputs(cx.node):
        raise cx.unsupported(
            f"{what} has a data-dependent size that can be zero at run time, and the Core AI "
            "runtime aborts when an op consumes an empty tensor; only returning it (possibly "
            "sliced, transposed or cast) is supported. Use torch.where(mask, x, other) or "
            "fixed-size indices (e.g. torch.nonzero_static)"
        )


def _nonzero(x: ir.Value) -> ir.Value:
    """si32 coordinates (rows) of the non-zero / True elements."""
    if dtype_of(x) != torch.bool:
        x = cai.broadcasting_not_equal(x, constant(0, dtype_of(x)))
    return cai.non_zero(x)


@lowering("aten::nonzero.default")
def nonzero(cx: LoweringContext, self: ir.Value) -> ir.Value:
    """Positions of the non-zero elements (a data-dependent number of rows)."""
    _check_only_returned(cx, "nonzero")
    return cast(_nonzero(self), torch.int64)


@lowering("aten::masked_select.default")
def masked_select(cx: LoweringContext, self: ir.Value, mask: ir.Value) -> ir.Value:
    """The elements where ``mask`` is True, in row-major order (a data-dependent length)."""
    _check_only_returned(cx, "masked_select")
    shape = list(
        torch.broadcast_shapes(tuple(static_shape(cx, self)), tuple(static_shape(cx, mask)))
    )
    x = broadcast_to(self, shape)
    return cai.gather_nd(x, _nonzero(broadcast_to(cast(mask, torch.bool), shape)))


# ------------------------------------------------------------------------- embedding_bag ----


@lowering("aten::_embedding_bag.default", "aten::_embedding_bag_forward_only.default")
def embedding_bag(
    cx: LoweringContext,
    weight: ir.Value,
    indices: ir.Value,
    offsets: ir.Value,
    scale_grad_by_freq: bool = False,
    mode: int = 0,
    sparse: bool = False,
    per_sample_weights: ir.Value | None = None,
    include_last_offset: bool = False,
    padding_idx: int = -1,
) -> list[ir.Value | None]:
    """Bags of embeddings reduced by sum (0), mean (1) or max (2).

    Bag membership is computed on the runtime from ``offsets`` (one-hot bag matrix), so the
    offsets may be runtime values; sizes must be static.
    """
    (count,) = static_shape(cx, indices, "indices")
    num_offsets = static_shape(cx, offsets, "offsets")[0]
    bags = num_offsets - 1 if include_last_offset else num_offsets
    dtype = dtype_of(weight)
    dim = static_shape(cx, weight, "weight")[1]
    rows = cai.gather_nd(weight, unsqueeze(cast(indices, torch.int32), [1]))  # (count, dim)
    # member[b, i]: offsets[b] <= i < offsets[b + 1] (the last bag runs to the end).
    pos = cai.constant(np.arange(count, dtype=np.int32)[None, :])
    starts = cast(offsets, torch.int32)
    ends = cai.concat(i32(0), [_slice1(starts, 1, num_offsets), constant([count], torch.int32)])
    if include_last_offset:
        starts, ends = _slice1(starts, 0, bags), _slice1(ends, 0, bags)
    lo = cai.broadcasting_greater(
        pos, cai.broadcasting_sub(unsqueeze(starts, [1]), constant(1, torch.int32))
    )
    hi = cai.broadcasting_greater(unsqueeze(ends, [1]), pos)
    member = cai.and_(lo, hi)  # (bags, count)
    if padding_idx is not None and padding_idx >= 0:
        keep = cai.broadcasting_not_equal(
            cast(indices, torch.int32), constant(padding_idx, torch.int32)
        )
        member = cai.and_(member, broadcast_to(unsqueeze(keep, [0]), [bags, count]))
    if mode == 2:  # max: masked maximum over the bag; empty bags give 0 (no sample weights)
        masked = cai.broadcasting_where(
            unsqueeze(member, [2]), unsqueeze(rows, [0]), constant(float("-inf"), dtype)
        )
        best = reshape(cai.reduce_max(masked, i32([1])), [bags, dim])
        empty = cai.broadcasting_equal(best, constant(float("-inf"), dtype))
        out = cai.broadcasting_where(empty, constant(0.0, dtype), best)
    else:  # sums of 16-bit rows accumulate in float32 and are rounded once, as in ATen
        compute = accumulation_dtype(cx, dtype)
        values = cast(rows, compute)
        if per_sample_weights is not None:
            values = cai.broadcasting_mul(values, unsqueeze(cast(per_sample_weights, compute), [1]))
        weights = cast(member, compute)
        out = cai.broadcasting_batch_matmul(weights, values)  # (bags, dim)
        if mode == 1:
            sizes = cai.reduce_sum(weights, i32([1]))
            sizes = cai.broadcasting_maximum(sizes, constant(1.0, compute))
            out = cai.broadcasting_divide(out, sizes)
        out = cast(out, dtype)
    return [out, None, None, None]


def _slice1(v: ir.Value, start: int, end: int) -> ir.Value:
    return cai.slice_(v, i32([start]), i32([end]), i32([1]))
