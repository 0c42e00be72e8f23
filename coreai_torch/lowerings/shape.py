"""View and layout ops: reshape, permute, expand, squeeze, cat, slice, select, split, flip,
roll, repeat, unfold, diagonal, as_strided and the copies."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import (
    Size,
    broadcast_dynamic,
    broadcast_to,
    cast,
    dim_size,
    dtype_of,
    i32,
    index_value,
    is_symbolic,
    known_sizes,
    normalize_dim,
    rank_of,
    refine,
    reshape,
    reshape_dynamic,
    shape_of,
    slice_dynamic,
    squeeze,
    static_shape_of,
    transpose,
    unsqueeze,
)
from coreai_torch.lowerings.helpers.layout import (
    diagonal_table,
    slice_axis,
    static_out_shape,
    static_shape,
    strided_table,
    take,
    take_values,
)
from coreai_torch.lowerings.helpers.operands import wrap_integer
from coreai_torch.lowerings.registry import (
    EMPTY_INPUT_OPS,
    EmptyTensor,
    LoweringContext,
    lowering,
)

# ------------------------------------------------------------------------------- views ------


@lowering(
    "aten::view.default",
    "aten::reshape.default",
    "aten::_unsafe_view.default",
    "aten::view_copy.default",
    "aten::_reshape_alias.default",
)
def view(
    cx: LoweringContext,
    self: ir.Value,
    size: Sequence[Size] | None = None,
    shape: Sequence[Size] | None = None,
    **_: object,
) -> ir.Value:
    if None in cx.out_shape:
        sizes = size if size is not None else shape
        assert sizes is not None
        return reshape_dynamic(self, sizes, cx.out_shape)
    return reshape(self, static_out_shape(cx))


@lowering("aten::flatten.using_ints", "aten::unflatten.int")
def flatten(cx: LoweringContext, self: ir.Value, **_: object) -> ir.Value:
    if cx.out_shape.count(None) == 1:
        return reshape_dynamic(self, [], cx.out_shape)
    return reshape(self, static_out_shape(cx))


@lowering("aten::permute.default", "aten::permute_copy.default")
def permute(cx: LoweringContext, self: ir.Value, dims: Sequence[int]) -> ir.Value:
    rank = rank_of(self)
    return transpose(self, [normalize_dim(d, rank) for d in dims])


@lowering("aten::transpose.int", "aten::transpose_copy.int", "aten::swapaxes.default")
def transpose_int(cx: LoweringContext, self: ir.Value, **dims: int) -> ir.Value:
    rank = rank_of(self)
    a, b = (normalize_dim(d, rank) for d in dims.values())
    perm = list(range(rank))
    if rank:
        perm[a], perm[b] = perm[b], perm[a]
    return transpose(self, perm)


@lowering("aten::t.default", "aten::t_copy.default", "aten::numpy_T.default")
def t(cx: LoweringContext, self: ir.Value) -> ir.Value:
    return transpose(self, list(reversed(range(rank_of(self)))))


@lowering("aten::expand.default", "aten::expand_copy.default")
def expand(
    cx: LoweringContext, self: ir.Value, size: Sequence[Size], implicit: bool = False
) -> ir.Value:
    if None in cx.out_shape:
        return broadcast_dynamic(self, size, cx.out_shape)
    return broadcast_to(self, static_out_shape(cx))


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


# ----------------------------------------------------------------------- concatenation ------


def _present(tensors: Sequence[ir.Value | EmptyTensor]) -> list[ir.Value]:
    """The inputs that have elements (empty ones are dropped at conversion time)."""
    return [t for t in tensors if isinstance(t, ir.Value) and 0 not in shape_of(t)]


@lowering("aten::cat.default", "aten::concat.default", "aten::concatenate.default")
def cat(cx: LoweringContext, tensors: Sequence[ir.Value | EmptyTensor], dim: int = 0) -> ir.Value:
    dtype = cx.out_dtype
    rank = len(cx.out_shape)
    # PyTorch skips empty inputs (including legacy 1-D empty tensors of any rank).
    parts = [cast(t, dtype) for t in _present(tensors)]
    if not parts:
        raise cx.unsupported("every input of cat is empty")
    if len(parts) == 1:
        return parts[0]
    return cai.concat(i32(normalize_dim(dim, rank)), parts)


for _name in ("aten::cat.default", "aten::concat.default", "aten::concatenate.default"):
    EMPTY_INPUT_OPS[_name] = (0,)


@lowering("aten::stack.default")
def stack(cx: LoweringContext, tensors: Sequence[ir.Value], dim: int = 0) -> ir.Value:
    rank = len(cx.out_shape)
    d = normalize_dim(dim, rank)
    parts = [unsqueeze(cast(t, cx.out_dtype), [d]) for t in tensors]
    return parts[0] if len(parts) == 1 else cai.concat(i32(d), parts)


# ------------------------------------------------------------------------------ slicing -----


@lowering("aten::slice.Tensor", "aten::slice_copy.Tensor")
def slice_(
    cx: LoweringContext,
    self: ir.Value,
    dim: int = 0,
    start: Size | None = None,
    end: Size | None = None,
    step: int = 1,
) -> ir.Value:
    shape = shape_of(self)
    d = normalize_dim(dim, len(shape))
    if step <= 0:
        raise cx.unsupported(f"slice step must be positive, got {step}")
    sizes = known_sizes(shape)
    if sizes is None or is_symbolic([start, end]):
        return refine(slice_dynamic(self, d, start, end, step), cx.out_shape)
    lo, hi, stride = slice(start, end, step).indices(sizes[d])
    return slice_axis(self, d, lo, max(hi, lo), stride)


@lowering("aten::narrow.default", "aten::narrow_copy.default")
def narrow(cx: LoweringContext, self: ir.Value, dim: int, start: int, length: int) -> ir.Value:
    shape = static_shape(cx, self)
    d = normalize_dim(dim, len(shape))
    lo = start % shape[d] if start < 0 else start
    return slice_axis(self, d, lo, lo + length)


@lowering("aten::select.int", "aten::select_copy.int")
def select(cx: LoweringContext, self: ir.Value, dim: int, index: Size) -> ir.Value:
    shape = shape_of(self)
    d = normalize_dim(dim, len(shape))
    sizes = known_sizes(shape)
    if sizes is None or isinstance(index, ir.Value):
        return select_dynamic(self, d, index, cx.out_shape)
    i = index % sizes[d]
    return squeeze(slice_axis(self, d, i, i + 1), [d])


@lowering(
    "aten::split_with_sizes.default",
    "aten::split_with_sizes_copy.default",
    "aten::split.Tensor",
    "aten::split_copy.Tensor",
    "aten::split.sizes",
    "aten::unsafe_split.Tensor",
    "aten::unsafe_split_with_sizes.default",
)
def split_with_sizes(cx: LoweringContext, self: ir.Value, dim: int = 0, **_: object) -> list:
    shape = shape_of(self)
    d = normalize_dim(dim, len(shape))
    if None in shape:
        return _split_dynamic(cx, self, d, _)
    results: list[ir.Value | None] = []
    offset = 0
    for val in cx.out:
        size = int(val.shape[d])
        # Empty chunks are never materialised (nothing can consume them on the runtime).
        results.append(slice_axis(self, d, offset, offset + size) if size else None)
        offset += size
    return results


def _split_dynamic(cx: LoweringContext, x: ir.Value, d: int, args: dict) -> list:
    """Split with dynamic dims: chunk sizes from PyTorch's results where they are static,
    else from the (symbolic) split sizes; the last chunk runs to the end."""
    sizes = args.get("split_sizes") or args.get("split_size")
    offset: Size = 0
    results: list[ir.Value | None] = []
    for k, val in enumerate(cx.out):
        last = k == len(cx.out) - 1
        size = val.shape[d]
        if not isinstance(size, int):
            if last:
                size = None
            elif isinstance(sizes, (list, tuple)):
                size = sizes[k]
            else:
                raise cx.unsupported("splitting a dynamic dimension into equal chunks")
        if size == 0:
            results.append(None)
            continue
        end = None if last else _add(offset, size)
        shape = [s if isinstance(s, int) else None for s in val.shape]
        results.append(refine(slice_dynamic(x, d, offset, end), shape))
        offset = end if end is not None else offset
    return results


def _add(a: Size, b: Size) -> Size:
    if isinstance(a, int) and isinstance(b, int):
        return a + b
    return cai.add(index_value(a), index_value(b))


def select_dynamic(x: ir.Value, d: int, index: Size, out_shape: Sequence[int | None]) -> ir.Value:
    """``x.select(d, index)`` for a dynamic dim or a runtime index (negative ones wrap)."""
    if isinstance(index, int):
        start, end = index, (index + 1 if index != -1 else None)
    else:
        i = index_value(index)
        size = index_value(dim_size(x, d))
        zero = cai.constant(np.int32(0))
        start = cai.where(cai.greater(zero, i), cai.add(i, size), i)
        end = cai.add(start, cai.constant(np.int32(1)))
    sliced = slice_dynamic(x, d, start, end)
    one = list(out_shape)
    one.insert(d, 1)
    return squeeze(refine(sliced, one), [d])


@lowering("aten::unbind.int", "aten::unbind_copy.int")
def unbind(cx: LoweringContext, self: ir.Value, dim: int = 0) -> list[ir.Value]:
    shape = static_shape(cx, self)
    d = normalize_dim(dim, len(shape))
    return [squeeze(slice_axis(self, d, i, i + 1), [d]) for i in range(shape[d])]


# ---------------------------------------------------------------------- reorder / repeat ----


@lowering("aten::flip.default")
def flip(cx: LoweringContext, self: ir.Value, dims: Sequence[int]) -> ir.Value:
    rank = rank_of(self)
    axes = sorted({normalize_dim(d, rank) for d in dims})
    axes = [a for a in axes if rank and shape_of(self)[a] != 1]
    if not axes:
        return self
    return cai.reverse(self, i32(axes))


def _roll_axis(x: ir.Value, shift: int, axis: int) -> ir.Value:
    size = static_shape_of(x)[axis]
    shift %= size
    if shift == 0:
        return x
    tail = slice_axis(x, axis, size - shift, size)
    head = slice_axis(x, axis, 0, size - shift)
    return cai.concat(i32(axis), [tail, head])


@lowering("aten::roll.default")
def roll(
    cx: LoweringContext, self: ir.Value, shifts: Sequence[int], dims: Sequence[int] = ()
) -> ir.Value:
    if None in shape_of(self):
        return _roll_dynamic(cx, self, shifts, dims)
    shape = static_shape(cx, self)
    if not dims:  # roll the flattened tensor
        flat = reshape(self, [int(np.prod(shape))])
        return reshape(_roll_axis(flat, shifts[0], 0), shape)
    x = self
    for shift, dim in zip(shifts, dims, strict=True):
        x = _roll_axis(x, shift, normalize_dim(dim, len(shape)))
    return x


def _roll_dynamic(
    cx: LoweringContext, x: ir.Value, shifts: Sequence[int], dims: Sequence[int]
) -> ir.Value:
    """Roll along dynamic dims: gather with indices ``(arange(n) - shift) mod n`` (a slice
    and concat could produce an empty slice at run time)."""
    if not dims:
        raise cx.unsupported("rolling the flattened tensor needs a static shape")
    for shift, dim in zip(shifts, dims, strict=True):
        axis = normalize_dim(dim, rank_of(x))
        n = index_value(dim_size(x, axis))
        positions = cai.range_(cai.constant(np.int32(0)), n, cai.constant(np.int32(1)))
        moved = cai.broadcasting_sub(positions, index_value(shift))
        index = cai.broadcasting_modulo(moved, n)
        index = cai.broadcasting_modulo(cai.broadcasting_add(index, n), n)  # C modulo
        x = refine(take_values(x, axis, index), shape_of(x))
    return x


@lowering("aten::repeat.default")
def repeat(cx: LoweringContext, self: ir.Value, repeats: Sequence[int]) -> ir.Value:
    rank = rank_of(self)
    x = unsqueeze(self, list(range(len(repeats) - rank)))
    if all(r == 1 for r in repeats):
        return x
    return cai.tile(x, np.array(list(repeats), np.uint32))


@lowering("aten::tile.default")
def tile(cx: LoweringContext, self: ir.Value, dims: Sequence[int]) -> ir.Value:
    reps = [1] * (rank_of(self) - len(dims)) + list(dims)
    return repeat(cx, self, reps)


# ---------------------------------------------------------------- windows and diagonals -----


@lowering("aten::unfold.default", "aten::unfold_copy.default")
def unfold(cx: LoweringContext, self: ir.Value, dimension: int, size: int, step: int) -> ir.Value:
    """Sliding windows along one dim; the window becomes a new last dim."""
    shape = static_shape(cx, self)
    if not shape:  # 0-d: a single window of size 1
        return reshape(self, [1])
    d = normalize_dim(dimension, len(shape))
    count = (shape[d] - size) // step + 1
    table = np.arange(count)[:, None] * step + np.arange(size)[None, :]
    windows = take(self, d, table)  # (..., count, size, ...)
    rank = len(shape) + 1
    return transpose(windows, [a for a in range(rank) if a != d + 1] + [d + 1])


@lowering("aten::diagonal.default", "aten::diagonal_copy.default")
def diagonal(
    cx: LoweringContext, self: ir.Value, offset: int = 0, dim1: int = 0, dim2: int = 1
) -> ir.Value:
    shape = static_shape(cx, self)
    rank = len(shape)
    a, b = normalize_dim(dim1, rank), normalize_dim(dim2, rank)
    rest = [d for d in range(rank) if d not in (a, b)]
    x = transpose(self, [*rest, a, b])
    flat = reshape(x, [shape[d] for d in rest] + [shape[a] * shape[b]])
    return take(flat, len(rest), diagonal_table(shape[a], shape[b], offset))


@lowering("aten::as_strided.default", "aten::as_strided_copy.default")
def as_strided(
    cx: LoweringContext,
    self: ir.Value,
    size: Sequence[int],
    stride: Sequence[int],
    storage_offset: int | None = None,
) -> ir.Value:
    """A strided view of the input's storage, gathered through a constant index table."""
    total = int(np.prod(static_shape(cx, self), dtype=np.int64))
    try:
        table = strided_table(cx.input_example(0), size, stride, storage_offset)
    except ValueError as error:
        raise cx.unsupported(f"as_strided: {error}") from None
    flat = reshape(self, [total])
    return take(flat, 0, table) if table.ndim else squeeze(take(flat, 0, table[None]), [0])


# ------------------------------------------------------------------------------- copies -----


@lowering(
    "aten::clone.default",
    "aten::alias.default",
    "aten::alias_copy.default",
    "aten::lift_fresh_copy.default",
    "aten::lift_fresh.default",
    "aten::detach.default",
    "aten::detach_copy.default",
    "aten::contiguous.default",
)
def identity(cx: LoweringContext, self: ir.Value, **_: object) -> ir.Value:
    return self


@lowering("aten::_assert_tensor_metadata.default")
def assert_tensor_metadata(cx: LoweringContext, **_: object) -> None:
    """A check PyTorch already made at export time; nothing to emit."""
    return None


@lowering(
    "aten::_to_copy.default",
    "aten::to.dtype",
    "aten::_to_dim_order_copy.default",
    "aten::to.dtype_layout",
)
def to_copy(cx: LoweringContext, self: ir.Value, **_: object) -> ir.Value:
    dtype = cx.out_dtype
    return cast(wrap_integer(self, dtype), dtype)


@lowering("aten::copy.default", "aten::copy_.default")
def copy(cx: LoweringContext, self: ir.Value, src: ir.Value, non_blocking: bool = False):
    """``self`` overwritten with ``src`` (broadcast and converted to ``self``'s dtype)."""
    dtype = dtype_of(self)
    value = cast(wrap_integer(src, dtype), dtype)
    if None in shape_of(self):
        if _same_shapes(cx.node.args[0], cx.node.args[1]):
            return refine(value, shape_of(self))  # no broadcast (its shape would be read)
        sizes = [dim_size(self, d) for d in range(rank_of(self))]
        return broadcast_dynamic(value, sizes, shape_of(self))
    return broadcast_to(value, static_shape(cx, self))


def _same_shapes(a: object, b: object) -> bool:
    """Whether the FX values ``a`` and ``b`` are known (from the export's symbolic shapes) to
    have the same shape, runtime sizes included."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    left = getattr(a, "meta", {}).get("val")
    right = getattr(b, "meta", {}).get("val")
    if not isinstance(left, torch.Tensor) or not isinstance(right, torch.Tensor):
        return False
    return left.dim() == right.dim() and all(
        statically_known_true(x == y) for x, y in zip(left.shape, right.shape, strict=True)
    )
