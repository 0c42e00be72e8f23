"""View and layout ops: reshape, permute, expand, squeeze, cat, slice, select, split, copies."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from coreai_torch._mlir import cai, ir
from coreai_torch.lowerings.common import (
    broadcast_to,
    cast,
    i32,
    normalize_dim,
    rank_of,
    reshape,
    shape_of,
    squeeze,
    transpose,
    unsqueeze,
)
from coreai_torch.lowerings.registry import LoweringContext, lowering


def _static_shape(cx: LoweringContext) -> list[int]:
    shape = cx.out_shape
    if None in shape:
        raise cx.unsupported("dynamic output shapes are not supported by this op yet")
    return [int(d) for d in shape]


@lowering(
    "aten::view.default",
    "aten::reshape.default",
    "aten::_unsafe_view.default",
    "aten::view_copy.default",
)
def view(cx: LoweringContext, self: ir.Value, size: Sequence[int]) -> ir.Value:
    return reshape(self, _static_shape(cx))


@lowering("aten::permute.default", "aten::permute_copy.default")
def permute(cx: LoweringContext, self: ir.Value, dims: Sequence[int]) -> ir.Value:
    rank = rank_of(self)
    return transpose(self, [normalize_dim(d, rank) for d in dims])


@lowering("aten::transpose.int")
def transpose_int(cx: LoweringContext, self: ir.Value, dim0: int, dim1: int) -> ir.Value:
    rank = rank_of(self)
    if rank < 2:
        return self
    perm = list(range(rank))
    a, b = normalize_dim(dim0, rank), normalize_dim(dim1, rank)
    perm[a], perm[b] = perm[b], perm[a]
    return transpose(self, perm)


@lowering("aten::t.default", "aten::numpy_T.default")
def t(cx: LoweringContext, self: ir.Value) -> ir.Value:
    rank = rank_of(self)
    return transpose(self, list(reversed(range(rank))))


@lowering("aten::expand.default", "aten::expand_copy.default")
def expand(
    cx: LoweringContext, self: ir.Value, size: Sequence[int], implicit: bool = False
) -> ir.Value:
    return broadcast_to(self, _static_shape(cx))


@lowering(
    "aten::squeeze.dim",
    "aten::squeeze.dims",
    "aten::squeeze.default",
    "aten::squeeze_copy.dim",
    "aten::squeeze_copy.dims",
    "aten::squeeze_copy.default",
)
def squeeze_(
    cx: LoweringContext, self: ir.Value, dim: int | Sequence[int] | None = None
) -> ir.Value:
    shape = shape_of(self)
    rank = len(shape)
    if rank == 0:
        return self
    if dim is None:
        dims = list(range(rank))
    elif isinstance(dim, int):
        dims = [normalize_dim(dim, rank)]
    else:
        dims = [normalize_dim(d, rank) for d in dim]
    return squeeze(self, sorted({d for d in dims if shape[d] == 1}))


@lowering("aten::unsqueeze.default", "aten::unsqueeze_copy.default")
def unsqueeze_(cx: LoweringContext, self: ir.Value, dim: int) -> ir.Value:
    return unsqueeze(self, [normalize_dim(dim, rank_of(self) + 1)])


@lowering("aten::cat.default", "aten::concat.default")
def cat(cx: LoweringContext, tensors: Sequence[ir.Value], dim: int = 0) -> ir.Value:
    dtype = cx.out_dtype
    rank = len(cx.out_shape)
    parts = [cast(t, dtype) for t in tensors if rank_of(t) == rank and 0 not in shape_of(t)]
    if len(parts) == 1:
        return parts[0]
    return cai.concat(i32(normalize_dim(dim, rank)), parts)


@lowering("aten::slice.Tensor", "aten::slice_copy.Tensor")
def slice_(
    cx: LoweringContext,
    self: ir.Value,
    dim: int = 0,
    start: int | None = None,
    end: int | None = None,
    step: int = 1,
) -> ir.Value:
    shape = shape_of(self)
    rank = len(shape)
    d = normalize_dim(dim, rank)
    size = shape[d]
    if size is None:
        raise cx.unsupported("slicing a dynamic dimension is not supported yet")
    lo, hi, stride = slice(start, end, step).indices(size)
    if (lo, hi, stride) == (0, size, 1):
        return self
    starts, ends, strides = [0] * rank, list(shape), [1] * rank
    starts[d], ends[d], strides[d] = lo, max(hi, lo), stride
    return cai.slice_(self, i32(starts), i32(ends), i32(strides))


@lowering("aten::select.int", "aten::select_copy.int")
def select(cx: LoweringContext, self: ir.Value, dim: int, index: int) -> ir.Value:
    shape = shape_of(self)
    rank = len(shape)
    d = normalize_dim(dim, rank)
    if shape[d] is None:
        raise cx.unsupported("selecting from a dynamic dimension is not supported yet")
    i = index % shape[d]
    starts, ends, strides = [0] * rank, list(shape), [1] * rank
    starts[d], ends[d] = i, i + 1
    return squeeze(cai.slice_(self, i32(starts), i32(ends), i32(strides)), [d])


@lowering(
    "aten::split_with_sizes.default",
    "aten::split_with_sizes_copy.default",
    "aten::split.Tensor",
    "aten::split_copy.Tensor",
)
def split_with_sizes(
    cx: LoweringContext,
    self: ir.Value,
    split_sizes: Sequence[int] | int | None = None,
    dim: int = 0,
    split_size: int | None = None,
) -> list[ir.Value]:
    shape = shape_of(self)
    d = normalize_dim(dim, len(shape))
    sizes = [int(v.shape[d]) for v in cx.out]
    results, offset = [], 0
    for size in sizes:
        starts, ends = [0] * len(shape), list(shape)
        starts[d], ends[d] = offset, offset + size
        results.append(cai.slice_(self, i32(starts), i32(ends), i32([1] * len(shape))))
        offset += size
    return results


@lowering(
    "aten::clone.default",
    "aten::alias.default",
    "aten::alias_copy.default",
    "aten::lift_fresh_copy.default",
    "aten::detach.default",
    "aten::contiguous.default",
    "aten::_assert_tensor_metadata.default",
)
def identity(cx: LoweringContext, self: ir.Value, **_: object) -> ir.Value | None:
    if cx.node.target is torch.ops.aten._assert_tensor_metadata.default:
        return None
    return self


@lowering("aten::_to_copy.default", "aten::to.dtype", "aten::_to_dim_order_copy.default")
def to_copy(cx: LoweringContext, self: ir.Value, **_: object) -> ir.Value:
    return cast(self, cx.out_dtype)


@lowering("aten::flatten.using_ints")
def flatten(cx: LoweringContext, self: ir.Value, start_dim: int = 0, end_dim: int = -1) -> ir.Value:
    return reshape(self, _static_shape(cx))
