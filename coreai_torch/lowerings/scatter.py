"""Writing by index: scatter (src/value/reduce), scatter_add, scatter_reduce, index_put,
slice_scatter, select_scatter, diagonal_scatter and masked_scatter.

``index_put`` (hence ``index_copy``, ``x[i] = v`` and the in-place forms), ``slice_scatter``
(``x[a:b] = v``, ``x[a:b].copy_(v)``) and ``select_scatter`` also write into tensors whose
dims have a run-time size, at runtime offsets: a KV cache that grows, written where the new
tokens go."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import (
    Scalar,
    Size,
    as_value,
    broadcast_dynamic,
    broadcast_to,
    cast,
    constant,
    dim_size,
    dtype_of,
    i32,
    is_symbolic,
    known_sizes,
    normalize_dim,
    rank_of,
    refine,
    reshape,
    reshape_dynamic,
    shape_of,
    shape_vector,
    size_product,
    static_shape_of,
    static_sizes,
    transpose,
    unsqueeze,
)
from coreai_torch.lowerings.helpers.layout import (
    bound_vector,
    broadcast_sizes,
    diagonal_table,
    highest,
    index_layout,
    inverse,
    lowest,
    result_permutation,
    slice_bound,
    slice_region,
    stacked_indices,
    static_shape,
    strided_table,
)
from coreai_torch.lowerings.registry import (
    EMPTY_INPUT_OPS,
    EmptyTensor,
    LoweringContext,
    lowering,
)


def _mode(name: str) -> ir.Attribute:
    return ir.Attribute.parse(f"#coreai.scatter_mode<{name}>")


def scatter_along(
    x: ir.Value,
    axis: int,
    index: ir.Value,
    updates: ir.Value,
    mode: str = "update",
    *,
    covers: bool = False,
) -> ir.Value:
    """``scatter_along_axis`` where ``index``/``updates`` may be smaller than ``x`` in the
    other dims (PyTorch's rule): only that leading corner of ``x`` is scattered into.
    ``covers``: the caller knows ``index`` spans ``x`` in every other dim (their sizes may be
    runtime values)."""
    xshape, ishape = shape_of(x), shape_of(index)
    rank = len(xshape)
    if covers:
        region: list[Size] = _sizes(x)
        updates_region: list[Size] = [dim_size(index, d) for d in range(rank)]
    else:
        region = [dim_size(index if d != axis else x, d) for d in range(rank)]
        updates_region = [dim_size(index, d) for d in range(rank)]
    whole = covers or (None not in xshape + ishape and region == xshape)
    base = x if whole else slice_region(x, region)
    out = cai.scatter_along_axis(
        base.type,
        base,
        cast(index, torch.int32),
        slice_region(updates, updates_region),
        i32(axis),
        _mode(mode),
    )
    if whole:
        return out
    return cai.slice_update(x, i32([0] * rank), shape_vector(region), i32([1] * rank), out)


def _prepare(
    cx: LoweringContext, self: ir.Value, dim: int, index: ir.Value, src: ir.Value | Scalar
) -> tuple[ir.Value, int, ir.Value, ir.Value]:
    """(self, axis, index, src) with 0-d operands as 1-d and ``src`` in ``self``'s dtype."""
    dtype = dtype_of(self)
    scalar_input = rank_of(self) == 0
    x = reshape(self, [1]) if scalar_input else self
    idx = reshape(index, [1]) if rank_of(index) == 0 else index
    ishape = static_shape(cx, idx, "index")
    if isinstance(src, ir.Value) and rank_of(src) > 0:
        updates = cast(src, dtype)
    else:
        value = src if not isinstance(src, ir.Value) else reshape(src, [1] * len(ishape))
        updates = broadcast_to(as_value(value, dtype), ishape)
    return x, normalize_dim(dim, rank_of(x)), idx, updates


def _finish(self: ir.Value, out: ir.Value) -> ir.Value:
    return reshape(out, []) if rank_of(self) == 0 else out


@lowering("aten::scatter.src", "aten::scatter.value")
def scatter(
    cx: LoweringContext,
    self: ir.Value,
    dim: int,
    index: ir.Value,
    src: ir.Value | None = None,
    value: Scalar | None = None,
) -> ir.Value:
    x, axis, idx, updates = _prepare(cx, self, dim, index, src if src is not None else value)
    return _finish(self, scatter_along(x, axis, idx, updates))


_REDUCE_MODES = {"add": "add", "sum": "add", "multiply": "mul", "prod": "mul"}
_REDUCE_MODES.update({"amax": "max", "amin": "min"})


@lowering("aten::scatter.reduce", "aten::scatter.value_reduce")
def scatter_reduce_legacy(
    cx: LoweringContext,
    self: ir.Value,
    dim: int,
    index: ir.Value,
    reduce: str,
    src: ir.Value | None = None,
    value: Scalar | None = None,
) -> ir.Value:
    x, axis, idx, updates = _prepare(cx, self, dim, index, src if src is not None else value)
    return _finish(self, scatter_along(x, axis, idx, updates, _REDUCE_MODES[reduce]))


@lowering("aten::scatter_add.default")
def scatter_add(
    cx: LoweringContext, self: ir.Value, dim: int, index: ir.Value, src: ir.Value
) -> ir.Value:
    x, axis, idx, updates = _prepare(cx, self, dim, index, src)
    return _finish(self, scatter_along(x, axis, idx, updates, "add"))


def _identity(reduce: str, dtype: torch.dtype) -> Scalar:
    if reduce in ("sum", "mean"):
        return False if dtype == torch.bool else 0
    if reduce == "prod":
        return True if dtype == torch.bool else 1
    return lowest(dtype) if reduce == "amax" else highest(dtype)


def reduce_into(
    x: ir.Value, axis: int, idx: ir.Value, updates: ir.Value, reduce: str, include_self: bool
) -> ir.Value:
    """``scatter_reduce`` semantics (sum/prod/mean/amax/amin, with or without ``x``)."""
    dtype = dtype_of(x)
    base = x
    if not include_self:  # scattered positions start from the reduction's identity
        fill = broadcast_to(constant(_identity(reduce, dtype), dtype), static_shape_of(idx))
        base = scatter_along(x, axis, idx, fill)
    if reduce != "mean":
        return scatter_along(base, axis, idx, updates, _REDUCE_MODES[reduce])
    total = scatter_along(base, axis, idx, updates, "add")
    count_dtype = dtype if dtype.is_floating_point else torch.int32
    ishape = static_shape_of(idx)
    ones = broadcast_to(constant(1, count_dtype), static_shape_of(x))
    if not include_self:
        ones = scatter_along(ones, axis, idx, broadcast_to(constant(0, count_dtype), ishape))
    counts = scatter_along(ones, axis, idx, broadcast_to(constant(1, count_dtype), ishape), "add")
    if dtype.is_floating_point:
        return cai.broadcasting_divide(total, counts)
    return cai.broadcasting_floor_divide(total, cast(counts, dtype))


@lowering("aten::scatter_reduce.two")
def scatter_reduce(
    cx: LoweringContext,
    self: ir.Value,
    dim: int,
    index: ir.Value,
    src: ir.Value,
    reduce: str,
    include_self: bool = True,
) -> ir.Value:
    x, axis, idx, updates = _prepare(cx, self, dim, index, src)
    return _finish(self, reduce_into(x, axis, idx, updates, reduce, include_self))


@lowering("aten::index_reduce.default")
def index_reduce(
    cx: LoweringContext,
    self: ir.Value,
    dim: int,
    index: ir.Value,
    source: ir.Value,
    reduce: str,
    include_self: bool = True,
) -> ir.Value:
    """Rows ``index[i]`` of ``self`` along ``dim`` reduced with slice ``i`` of ``source``."""
    x = reshape(self, [1]) if rank_of(self) == 0 else self
    rank = rank_of(x)
    d = normalize_dim(dim, rank)
    src_shape = static_shape(cx, source, "source") or [1]
    idx = reshape(index, [1] * d + [-1] + [1] * (rank - d - 1))
    idx = broadcast_to(idx, src_shape)
    updates = reshape(cast(source, dtype_of(x)), src_shape)
    return _finish(self, reduce_into(x, d, idx, updates, reduce, include_self))


# ---------------------------------------------------------------------------- index_put -----


def _mask_put(
    cx: LoweringContext,
    self: ir.Value,
    indices: Sequence[ir.Value | None],
    values: ir.Value,
    accumulate: bool,
) -> ir.Value:
    """``x[mask] = v``: values that broadcast over the selected rows are an elementwise
    select (``x`` and the mask may have dims of run-time size); one row per selected position
    (``v.shape[0] > 1``) fills them in order."""
    shape = shape_of(self)
    (pos,) = [i for i, ix in enumerate(indices) if ix is not None]
    mask = cast(indices[pos], torch.bool)
    mrank = rank_of(mask)
    rest = shape[pos + mrank :]
    lead, trail = list(range(pos)), list(range(pos + mrank, len(shape)))
    mask = unsqueeze(mask, lead + trail) if lead or trail else mask
    mask = broadcast_dynamic(mask, _sizes(self), shape)
    dtype = dtype_of(self)
    vshape = static_shape(cx, values, "values")
    v = cast(values, dtype)
    if len(vshape) <= len(rest) or (len(vshape) == len(rest) + 1 and vshape[0] == 1):
        v = reshape(v, vshape[len(vshape) - len(rest) :] if len(vshape) > len(rest) else vshape)
        v = reshape(v, [1] * (len(shape) - rank_of(v)) + static_shape_of(v))
        new = broadcast_dynamic(v, _sizes(self), shape)
    elif None in shape:
        raise cx.unsupported(
            "x[mask] = values with one row per masked position, where x has dynamic dimensions"
        )
    elif pos == 0 and mrank == len(shape) - len(rest):
        new = masked_values(mask, broadcast_to(v, [vshape[0], *static_sizes(rest)]), shape)
    else:
        raise cx.unsupported("x[..., mask] = values with one row per masked position")
    if accumulate:
        new = cai.or_(self, new) if dtype == torch.bool else cai.broadcasting_add(self, new)
    return cai.broadcasting_where(mask, new, self)


def masked_values(mask: ir.Value, source: ir.Value, shape: Sequence[int | None]) -> ir.Value:
    """A tensor of ``shape`` whose i-th masked position (row-major) holds ``source``'s i-th
    element (unmasked positions hold anything).  Dims of ``shape`` may be dynamic (``None``):
    the result then takes ``mask``'s runtime shape."""
    flat_mask = _flatten(mask)
    # Position of each element among the masked ones: inclusive cumsum - 1 (clamped at 0).
    running = cai.scan(cast(flat_mask, torch.int32), np.uint32(0), False, "sum")
    position = cai.broadcasting_maximum(
        cai.broadcasting_sub(running, constant(1, torch.int32)), constant(0, torch.int32)
    )
    picked = cai.gather_nd(_flatten(source), unsqueeze(position, [1]))
    sizes = known_sizes(shape)
    if sizes is None:
        return refine(cai.reshape(picked, cai.get_shape(mask)), shape)
    return reshape(picked, sizes)


def _flatten(value: ir.Value) -> ir.Value:
    """``value`` as a 1-D tensor (its length dynamic when a dim is)."""
    sizes = known_sizes(shape_of(value))
    if sizes is None:
        return cai.reshape(value, i32([-1]))
    return reshape(value, [int(np.prod(sizes))])


@lowering("aten::index_put.default", "aten::_unsafe_index_put.default")
def index_put(
    cx: LoweringContext,
    self: ir.Value,
    indices: Sequence[ir.Value | None],
    values: ir.Value,
    accumulate: bool = False,
) -> ir.Value:
    """``self[indices] = values`` (or ``+=``); any dim of ``self``, ``values`` and the index
    tensors may have a run-time size (a scatter with runtime indices and shapes)."""
    present = [ix for ix in indices if ix is not None]
    if isinstance(values, EmptyTensor) or any(isinstance(ix, EmptyTensor) for ix in present):
        return self  # no positions to write
    if any(dtype_of(ix) in (torch.bool, torch.uint8) for ix in present):
        if len(present) == 1:
            return _mask_put(cx, self, indices, values, accumulate)
        raise cx.unsupported("index_put mixing a boolean mask with other indices")
    shape = shape_of(self)
    rank = len(shape)
    dtype = dtype_of(self)
    positions, bshape, perm = index_layout(cx, self, indices)
    if not positions:
        return broadcast_dynamic(cast(values, dtype), _sizes(self), shape)
    rest = [shape[d] for d in perm[len(positions) :]]
    rest_sizes = [dim_size(self, d) for d in perm[len(positions) :]]
    sizes = broadcast_sizes(indices, positions, bshape)
    # Values broadcast to the shape `self[indices]` has, then to (broadcast dims, rest).
    to_torch = result_permutation(positions, len(bshape), rank)
    gathered_sizes: list[Size] = [*sizes, *rest_sizes]
    gathered_shape = [*bshape, *rest]
    torch_sizes = [gathered_sizes[p] for p in to_torch]
    torch_shape = [gathered_shape[p] for p in to_torch]
    updates = broadcast_dynamic(cast(values, dtype), torch_sizes, torch_shape)
    updates = transpose(updates, inverse(to_torch))
    xt = transpose(self, perm)
    if not accumulate:
        out = cai.scatter_nd(xt, stacked_indices(indices, positions, sizes, bshape), updates)
        return transpose(out, inverse(perm))
    # Accumulate: flatten the indexed dims into one axis and scatter-add along it.
    indexed = [dim_size(self, p) for p in positions]
    flat_index = None
    stride: Size = 1
    for p, size in reversed(list(zip(positions, indexed, strict=True))):
        ix = broadcast_dynamic(cast(indices[p], torch.int32), sizes, bshape)
        bound = size if isinstance(size, ir.Value) else constant(size, torch.int32)
        negative = cai.broadcasting_greater(constant(0, torch.int32), ix)
        ix = cai.broadcasting_where(negative, cai.broadcasting_add(ix, bound), ix)
        if stride != 1:
            scale = stride if isinstance(stride, ir.Value) else constant(stride, torch.int32)
            ix = cai.broadcasting_mul(ix, scale)
        flat_index = ix if flat_index is None else cai.broadcasting_add(flat_index, ix)
        stride = size_product([stride, size])
    count = size_product(sizes)
    ones = [1] * len(rest)
    flat_index = reshape_dynamic(flat_index, [count, *ones], _static([count, *ones]))
    flat_index = broadcast_dynamic(flat_index, [count, *rest_sizes], _static([count, *rest]))
    flat = reshape_dynamic(xt, [stride, *rest_sizes], _static([stride, *rest]))
    flat_updates = reshape_dynamic(updates, [count, *rest_sizes], _static([count, *rest]))
    mode = "max" if dtype == torch.bool else "add"  # bool "sum" is a logical or
    out = scatter_along(flat, 0, flat_index, flat_updates, mode, covers=True)
    unflat = reshape_dynamic(out, [*indexed, *rest_sizes], [shape[p] for p in perm])
    return transpose(unflat, inverse(perm))


def _sizes(value: ir.Value) -> list[Size]:
    return [dim_size(value, d) for d in range(rank_of(value))]


def _static(sizes: Sequence[Size | None]) -> list[int | None]:
    """The static shape of a list of sizes (``None`` where a size is a runtime value)."""
    return [s if isinstance(s, int) else None for s in sizes]


EMPTY_INPUT_OPS["aten::index_put.default"] = (1, 2)


# ------------------------------------------------------------------------ slice updates -----


@lowering("aten::slice_scatter.default")
def slice_scatter(
    cx: LoweringContext,
    self: ir.Value,
    src: ir.Value | EmptyTensor,
    dim: int = 0,
    start: Size | None = None,
    end: Size | None = None,
    step: int = 1,
) -> ir.Value:
    if isinstance(src, EmptyTensor):  # writing nothing
        return self
    shape = shape_of(self)
    rank = len(shape)
    d = normalize_dim(dim, rank)
    if None in shape or is_symbolic([start, end]):
        # dims or bounds known at run time (a KV cache written at a runtime offset)
        size = dim_size(self, d)
        begin = slice_bound(start, size, 0)
        stop = slice_bound(end, size, size)
        return update_region(self, d, begin, stop, step, cast(src, dtype_of(self)))
    sizes = static_sizes(shape)
    lo, hi, stride = slice(start, end, step).indices(sizes[d])
    starts, ends, strides = [0] * rank, list(sizes), [1] * rank
    starts[d], ends[d], strides[d] = lo, max(hi, lo), stride
    update = broadcast_to(cast(src, dtype_of(self)), _slice_shape(sizes, d, lo, hi, stride))
    if shape_of(update) == shape:
        return update
    return cai.slice_update(self, i32(starts), i32(ends), i32(strides), update)


def update_region(
    x: ir.Value, axis: int, begin: Size, end: Size, step: int, update: ir.Value
) -> ir.Value:
    """``x`` with ``update`` written along ``axis`` at ``begin:end:step`` (whole extent in
    the other dims), for dims and bounds known only at run time (``slice_update`` with
    runtime bounds).  The bounds are in range and ``update`` has as many positions as they
    select: no size of ``update`` is read (bounds computed from the runtime shape of a
    broadcast source made the runtime fail once ``optimize()`` had run, docs/errors.md)."""
    rank = rank_of(x)
    starts = [0] * axis + [begin] + [0] * (rank - axis - 1)
    ends = [dim_size(x, a) if a != axis else end for a in range(rank)]
    strides = [step if a == axis else 1 for a in range(rank)]
    out = cai.slice_update(x, shape_vector(starts), shape_vector(ends), i32(strides), update)
    return refine(out, shape_of(x))


EMPTY_INPUT_OPS["aten::slice_scatter.default"] = (1,)


def _slice_shape(shape: Sequence[int], d: int, lo: int, hi: int, step: int) -> list[int]:
    out = list(shape)
    out[d] = len(range(lo, hi, step))
    return out


@lowering("aten::select_scatter.default")
def select_scatter(
    cx: LoweringContext, self: ir.Value, src: ir.Value, dim: int, index: Size
) -> ir.Value:
    shape = shape_of(self)
    rank = len(shape)
    d = normalize_dim(dim, rank)
    update = unsqueeze(cast(src, dtype_of(self)), [d])
    if None in shape or isinstance(index, ir.Value):
        begin = slice_bound(index, dim_size(self, d), 0)  # negative indices wrap
        if isinstance(begin, int):
            return update_region(self, d, begin, begin + 1, 1, update)
        return update_region(self, d, begin, cai.add(begin, bound_vector(1)), 1, update)
    sizes = static_sizes(shape)
    i = index % sizes[d]
    starts, ends = [0] * rank, list(sizes)
    starts[d], ends[d] = i, i + 1
    update = broadcast_to(update, _slice_shape(sizes, d, i, i + 1, 1))
    return cai.slice_update(self, i32(starts), i32(ends), i32([1] * rank), update)


@lowering("aten::diagonal_scatter.default")
def diagonal_scatter(
    cx: LoweringContext,
    self: ir.Value,
    src: ir.Value,
    offset: int = 0,
    dim1: int = 0,
    dim2: int = 1,
) -> ir.Value:
    shape = static_shape(cx, self)
    rank = len(shape)
    a, b = normalize_dim(dim1, rank), normalize_dim(dim2, rank)
    rest = [d for d in range(rank) if d not in (a, b)]
    perm = [*rest, a, b]
    lead = [shape[d] for d in rest]
    flat = reshape(transpose(self, perm), [*lead, shape[a] * shape[b]])
    table = diagonal_table(shape[a], shape[b], offset)
    if table.size == 0:
        return self
    index = broadcast_to(cai.constant(table.astype(np.int32)), [*lead, table.size])
    out = scatter_along(flat, len(lead), index, cast(src, dtype_of(self)))
    return transpose(reshape(out, [*lead, shape[a], shape[b]]), inverse(perm))


@lowering("aten::masked_scatter.default")
def masked_scatter(
    cx: LoweringContext, self: ir.Value, mask: ir.Value, source: ir.Value
) -> ir.Value:
    """Masked positions take consecutive elements of ``source`` (row-major order)."""
    shape = list(cx.out_shape)
    sizes = known_sizes(shape)
    if sizes is None:  # broadcast on the runtime to the shape self and mask broadcast to
        target = cai.broadcast_shapes(cai.get_shape(self), cai.get_shape(mask))
        m = refine(cai.broadcast_to(cast(mask, torch.bool), target), shape)
        self = refine(cai.broadcast_to(self, target), shape)
    else:
        m = broadcast_to(cast(mask, torch.bool), sizes)
        self = broadcast_to(self, sizes)
    picked = masked_values(m, cast(source, dtype_of(self)), shape)
    return cai.broadcasting_where(m, picked, self)


@lowering("aten::put.default")
def put(
    cx: LoweringContext, self: ir.Value, index: ir.Value, source: ir.Value, accumulate: bool = False
) -> ir.Value:
    """``self`` as a flat tensor with ``source`` written (or added) at ``index``."""
    shape = static_shape(cx, self)
    total = int(np.prod(shape))
    flat = reshape(self, [total])
    count = int(np.prod(static_shape(cx, index, "index")))
    idx, values = reshape(index, [count]), reshape(source, [count])
    return reshape(index_put(cx, flat, [idx], values, accumulate), shape)


@lowering("aten::as_strided_scatter.default")
def as_strided_scatter(
    cx: LoweringContext,
    self: ir.Value,
    src: ir.Value,
    size: Sequence[int],
    stride: Sequence[int],
    storage_offset: int | None = None,
) -> ir.Value:
    """``self`` with the strided view ``as_strided(self, size, stride, offset)`` set to
    ``src`` (written through a constant index table)."""
    shape = static_shape(cx, self)
    try:
        table = strided_table(cx.input_example(0), size, stride, storage_offset)
    except ValueError as error:
        raise cx.unsupported(f"as_strided_scatter: {error}") from None
    total = int(np.prod(shape))
    count = int(table.size)
    flat = reshape(self, [total])
    index = cai.constant(table.reshape(count, 1).astype(np.int32))
    updates = reshape(cast(src, dtype_of(self)), [count])
    return reshape(cai.scatter_nd(flat, index, updates), shape)


@lowering("aten::nonzero_static.default")
def nonzero_static(cx: LoweringContext, self: ir.Value, size: int, fill_value: int = -1):
    """The first ``size`` non-zero positions, padded with ``fill_value`` (a static shape).

    Each non-zero element scatters its coordinates to its rank among the non-zeros; the
    others (and ranks past ``size``) go to a spare row that is sliced off."""
    shape = static_shape(cx, self)
    rank = len(shape)
    total = int(np.prod(shape))
    if size == 0 or rank == 0:
        raise cx.unsupported("nonzero_static with an empty result")
    mask = reshape(
        self
        if dtype_of(self) == torch.bool
        else cai.broadcasting_not_equal(self, constant(0, dtype_of(self))),
        [total],
    )
    running = cai.scan(cast(mask, torch.int32), np.uint32(0), False, "sum")
    rank_of_element = cai.broadcasting_sub(running, constant(1, torch.int32))
    keep = cai.and_(mask, cai.broadcasting_greater(constant(size, torch.int32), rank_of_element))
    target = cai.broadcasting_where(keep, rank_of_element, constant(size, torch.int32))
    coords = np.stack(np.unravel_index(np.arange(total), shape), axis=1).astype(np.int64)
    buffer = constant(np.full((size + 1, rank), fill_value), torch.int64)
    out = cai.scatter_nd(buffer, unsqueeze(target, [1]), cai.constant(coords))
    return cai.slice_(out, i32([0, 0]), i32([size, rank]), i32([1, 1]))
