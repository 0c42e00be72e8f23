"""Data movement shared by the view, indexing, scatter, padding, pooling, resampling and
factorization rules: slices along an axis, gathers by constant index tables, contractions
along an axis, filled constants, strided views, and the layout of advanced indexing
(``index`` / ``index_put``).

Most helpers work on static sizes read with ``values.shape_of``; a helper that needs a
static size raises ``ValueError`` when it meets a dynamic one, and the rules turn that into
``cx.unsupported``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import (
    INT32_MAX,
    Scalar,
    Size,
    broadcast_dynamic,
    cast,
    constant,
    dtype_of,
    i32,
    index_value,
    is_symbolic,
    known_sizes,
    normalize_dim,
    rank_of,
    refine,
    reshape,
    shape_of,
    shape_vector,
    squeeze,
    static_shape_of,
    transpose,
    unsqueeze,
)
from coreai_torch.lowerings.registry import LoweringContext


def static_out_shape(cx: LoweringContext) -> list[int]:
    """The node's output shape, which this rule needs to be static."""
    shape = known_sizes(cx.out_shape)
    if shape is None:
        raise cx.unsupported("dynamic output shapes are not supported by this op yet")
    return shape


def static_shape(cx: LoweringContext, value: ir.Value, what: str = "input") -> list[int]:
    """The static shape of an operand (``cx.unsupported`` for dynamic dims)."""
    shape = known_sizes(shape_of(value))
    if shape is None:
        raise cx.unsupported(f"the {what} has dynamic dimensions, which this op does not support")
    return shape


def slice_axis(
    x: ir.Value, axis: int, start: Size, end: Size, step: int = 1, *, size: int | None = None
) -> ir.Value:
    """``x[..., start:end:step, ...]`` along ``axis`` (negative axes count from the end).

    The bounds are in range (no Python clamping: ``values.slice_dynamic`` does that) and may
    be 0-d runtime values; the other dimensions may be dynamic.  ``size``, the result's length
    along the axis, is put back into the result type when given (a slice with runtime bounds
    or of an input with dynamic dimensions has a dynamic type otherwise).
    """
    shape = shape_of(x)
    rank = len(shape)
    axis = normalize_dim(axis, rank)
    runtime = is_symbolic([start, end])
    if not runtime and (start, end, step) == (0, shape[axis], 1):
        return x
    starts: list[Size] = [0] * rank
    ends: list[Size] = [INT32_MAX if d is None else d for d in shape]
    strides = [1] * rank
    starts[axis], ends[axis], strides[axis] = start, end, step
    if runtime:
        out = cai.slice_(x, shape_vector(starts), shape_vector(ends), i32(strides))
    else:
        out = cai.slice_(x, i32(starts), i32(ends), i32(strides))
    if not runtime and size is None:
        return out
    return refine(out, [*shape[:axis], size, *shape[axis + 1 :]])


def slice_bound(bound: Size | None, size: Size, default: Size) -> Size:
    """A bound of ``x[start:end]`` along a dim of ``size`` elements with Python's rules
    (``None`` is ``default``, negative counts from the end, clamped to ``[0, size]``): an int
    when it is known at conversion time, else a runtime si32 value of one element
    (:func:`bound_vector`)."""
    if bound is None:
        return default
    if isinstance(bound, int) and isinstance(size, int):
        return slice(bound, None).indices(size)[0]
    if isinstance(bound, int) and bound >= INT32_MAX:
        return size  # "to the end"
    if bound == 0:
        return 0
    i, n = bound_vector(bound), bound_vector(size)
    if isinstance(bound, int) and bound > 0:
        return cai.minimum(i, n)
    zero = cai.constant(np.zeros(1, np.int32))
    wrapped = cai.where(cai.greater(zero, i), cai.add(i, n), i)
    return cai.minimum(cai.maximum(wrapped, zero), n)


def bound_vector(size: Size) -> ir.Value:
    """A size or index as a 1-D si32 value of one element (the pieces shape operands are
    concatenated from; runtime bound arithmetic stays in this form)."""
    if isinstance(size, ir.Value) and shape_of(size) == [1]:
        return cast(size, torch.int32)
    return cai.reshape(index_value(size), i32([1]))


def slice_region(x: ir.Value, sizes: Sequence[Size]) -> ir.Value:
    """The leading ``sizes`` corner of ``x`` (``x[:s0, :s1, ...]``); sizes may be runtime
    values (0-d si32)."""
    shape = shape_of(x)
    if not is_symbolic(sizes) and list(sizes) == shape:
        return x
    rank = len(shape)
    out = cai.slice_(x, i32([0] * rank), shape_vector(sizes), i32([1] * rank))
    return refine(out, [s if isinstance(s, int) else None for s in sizes])


def _arithmetic(indices: np.ndarray) -> tuple[int, int] | None:
    """(start, step) if the flat index list is an arithmetic progression with step > 0."""
    flat = indices.reshape(-1)
    if flat.size == 0:
        return None
    if flat.size == 1:
        return int(flat[0]), 1
    steps = np.diff(flat)
    if steps[0] > 0 and np.all(steps == steps[0]):
        return int(flat[0]), int(steps[0])
    return None


def take(x: ir.Value, axis: int, indices: np.ndarray | Sequence[int]) -> ir.Value:
    """Entries of ``x`` along ``axis`` picked by constant ``indices`` (any shape, >= 0).

    The axis is replaced by the dims of ``indices``.  Ranges become a ``slice``; anything
    else a ``gather_nd`` on the axis moved to the front.
    """
    idx = np.asarray(indices, dtype=np.int64)
    shape = shape_of(x)
    rank = len(shape)
    axis = normalize_dim(axis, rank)
    prog = _arithmetic(idx)
    if prog is not None and idx.ndim == 1:
        start, step = prog
        return slice_axis(x, axis, start, start + step * (idx.size - 1) + 1, step)
    moved = transpose(x, [axis] + [d for d in range(rank) if d != axis])
    gathered = cai.gather_nd(moved, cai.constant(idx.astype(np.int32)[..., None]))
    k = idx.ndim
    # gathered: idx dims, then the other dims of x in order; put idx dims back at ``axis``.
    perm = list(range(k, k + axis)) + list(range(k)) + list(range(k + axis, k + rank - 1))
    return transpose(gathered, perm)


def take_values(x: ir.Value, axis: int, indices: ir.Value) -> ir.Value:
    """``index_select`` with runtime indices (any shape): the axis is replaced by their dims."""
    rank = rank_of(x)
    axis = normalize_dim(axis, rank)
    idx = cast(indices, torch.int32)
    k = rank_of(idx)
    moved = transpose(x, [axis] + [d for d in range(rank) if d != axis])
    gathered = cai.gather_nd(moved, unsqueeze(idx, [k]))
    perm = list(range(k, k + axis)) + list(range(k)) + list(range(k + axis, k + rank - 1))
    return transpose(gathered, perm)


def flatten_window_gather(x: ir.Value, spatial: int, table: np.ndarray, fill: float) -> ir.Value:
    """Gather windows of the trailing ``spatial`` dims through a constant index table.

    ``x`` is ``(*lead, *sizes)``; ``table`` holds flat spatial indices (``-1`` = padding,
    read as ``fill``) of shape ``(positions, window)``.  Returns ``(*lead, positions, window)``.
    """
    shape = static_shape_of(x)
    lead, sizes = shape[: len(shape) - spatial], shape[len(shape) - spatial :]
    flat_size = int(np.prod(sizes))
    flat = reshape(x, [*lead, flat_size])
    index = np.where(table < 0, flat_size, table)
    if (table < 0).any():
        pad = [0, 0] * len(lead) + [0, 1]
        flat = cai.pad(flat, np.array(pad, np.uint32), constant(fill, dtype_of(x)))
    return take(flat, len(lead), index)


def contract_axis(x: ir.Value, axis: int, weights: np.ndarray, *, compute: torch.dtype) -> ir.Value:
    """``out[.., i, ..] = sum_j weights[i, j] * x[.., j, ..]`` along ``axis`` (a matmul),
    computed in ``compute`` (the rule's ``accumulation_dtype``: float32 for 16-bit ``x``) and
    rounded once to ``x``'s dtype.

    The axis is brought next to last with a transpose rather than a reshape: Core AI's
    pre-compilation rewrite folds a reshape feeding a matmul wrongly when sizes coincide.
    """
    rank = rank_of(x)
    dtype = dtype_of(x)
    x = cast(x, compute)
    w = cast(cai.constant(np.ascontiguousarray(weights, dtype=np.float32)), compute)
    if axis == rank - 1:
        return cast(cai.broadcasting_batch_matmul(x, transpose(w, [1, 0])), dtype)
    perm = [d for d in range(rank) if d != axis]
    perm.insert(rank - 2, axis)
    out = cai.broadcasting_batch_matmul(w, transpose(x, perm))
    return cast(transpose(out, inverse(perm)), dtype)


def inverse(perm: Sequence[int]) -> list[int]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv


def lowest(dtype: torch.dtype) -> float | int:
    """The identity of ``max`` for ``dtype`` (``-inf`` for floats)."""
    if dtype.is_floating_point:
        return float("-inf")
    if dtype == torch.bool:
        return 0
    return int(torch.iinfo(dtype).min)


def highest(dtype: torch.dtype) -> float | int:
    """The identity of ``min`` for ``dtype`` (``inf`` for floats)."""
    if dtype.is_floating_point:
        return float("inf")
    if dtype == torch.bool:
        return 1
    return int(torch.iinfo(dtype).max)


def strided_table(
    src: torch.Tensor, size: Sequence[int], stride: Sequence[int], storage_offset: int | None
) -> np.ndarray:
    """Row-major positions in ``src`` of the elements of ``as_strided(src, size, stride,
    offset)`` — ``src`` being the example value, whose own strides say where each of its
    elements sits in storage.  Raises ``ValueError`` for non-dense storage or reads outside."""
    shape, strides = list(src.shape), list(src.stride())
    total = int(np.prod(shape, dtype=np.int64))
    order = sorted((s, n) for n, s in zip(shape, strides, strict=True) if n != 1)
    expected = 1
    for s, n in order:
        if s != expected:
            raise ValueError("the input's storage is not dense")
        expected *= n
    if int(src.storage_offset()) != 0:
        raise ValueError("the input is a view with a storage offset")
    # storage position -> row-major position
    offsets = np.zeros(shape, dtype=np.int64)
    for axis, (n, s) in enumerate(zip(shape, strides, strict=True)):
        view = [1] * len(shape)
        view[axis] = n
        offsets = offsets + (np.arange(n, dtype=np.int64) * s).reshape(view)
    storage = np.zeros(total, dtype=np.int64)
    storage[offsets.reshape(-1)] = np.arange(total, dtype=np.int64)
    positions = np.full([int(n) for n in size], int(storage_offset or 0), dtype=np.int64)
    for axis, (n, s) in enumerate(zip(size, stride, strict=True)):
        view = [1] * len(size)
        view[axis] = int(n)
        positions = positions + (np.arange(int(n), dtype=np.int64) * int(s)).reshape(view)
    if positions.size and (positions.max() >= total or positions.min() < 0):
        raise ValueError("the view reads outside the input's storage")
    return storage[positions]


def diagonal_table(rows: int, cols: int, offset: int) -> np.ndarray:
    r = np.arange(rows)
    c = r + offset
    keep = (c >= 0) & (c < cols)
    return (r[keep] * cols + c[keep]).astype(np.int64)


def filled(shape: Sequence[int], value: Scalar, dtype: torch.dtype) -> ir.Value:
    """A constant tensor of ``shape`` filled with ``value`` (stored as a splat)."""
    scalar = torch.tensor(value).to(dtype)  # PyTorch's own conversion (wrapping, rounding)
    return tensor_constant(scalar.expand(list(shape)))


def tensor_constant(values: torch.Tensor) -> ir.Value:
    """A constant holding a (small) torch tensor, in its dtype."""
    if values.dtype == torch.bfloat16:
        return cai.constant(np.array(values.float().numpy()), dtype=ir.BF16Type.get())
    return constant(np.array(values.numpy()), values.dtype)


# ------------------------------------------------------------------ advanced indexing ---


def index_layout(
    cx: LoweringContext, self: ir.Value, indices: Sequence[ir.Value | None]
) -> tuple[list[int], list[int | None], list[int]]:
    """Positions of the index tensors, their broadcast shape (``None`` for dynamic dims) and
    the permutation that moves the indexed dims first (in order) — shared by ``index`` and
    ``index_put``."""
    positions = [i for i, ix in enumerate(indices) if ix is not None]
    for i in positions:
        if dtype_of(indices[i]) in (torch.bool, torch.uint8):
            raise cx.unsupported(
                "indexing with a boolean mask gives a data-dependent shape, which Core AI "
                "programs cannot express; use torch.where(mask, x, other) or a fixed-size "
                "index tensor instead"
            )
    bshape = broadcast_shape([shape_of(indices[i]) for i in positions])
    perm = positions + [d for d in range(rank_of(self)) if d not in positions]
    return positions, bshape, perm


def broadcast_shape(shapes: Sequence[Sequence[int | None]]) -> list[int | None]:
    """NumPy broadcasting of shapes whose dims may be dynamic (``None``): a dim is static when
    some operand has a static size other than 1 there, or when every operand has 1."""
    rank = max((len(s) for s in shapes), default=0)
    out: list[int | None] = []
    for axis in range(rank):
        dims = [s[axis - rank + len(s)] for s in shapes if axis - rank + len(s) >= 0]
        sized = [d for d in dims if d is not None and d != 1]
        out.append(sized[0] if sized else (1 if None not in dims else None))
    return out


def broadcast_sizes(
    indices: Sequence[ir.Value | None], positions: Sequence[int], bshape: Sequence[int | None]
) -> list[Size]:
    """The broadcast shape of the index tensors as sizes: ints, and 0-d si32 values computed
    on the runtime from the index tensors' shapes for dynamic dims."""
    static = known_sizes(bshape)
    if static is not None:
        return list(static)
    target = None
    for p in positions:
        shape = cai.get_shape(indices[p])
        target = shape if target is None else cai.broadcast_shapes(target, shape)
    target = cai.cast(target, np.int32)
    return [
        d if d is not None else squeeze(cai.slice_(target, i32([i]), i32([i + 1]), i32([1])), [0])
        for i, d in enumerate(bshape)
    ]


def stacked_indices(
    indices: Sequence[ir.Value | None],
    positions: Sequence[int],
    sizes: Sequence[Size],
    bshape: Sequence[int | None],
) -> ir.Value:
    """The index tensors broadcast to ``sizes`` (static dims ``bshape``) and stacked on a new
    last dim (si32)."""
    k = len(bshape)
    stacked = [
        unsqueeze(broadcast_dynamic(cast(indices[p], torch.int32), sizes, bshape), [k])
        for p in positions
    ]
    return stacked[0] if len(stacked) == 1 else cai.concat(i32(k), stacked)


def result_permutation(positions: Sequence[int], nb: int, rank: int) -> list[int]:
    """Permutation from the gathered ``(broadcast dims, remaining dims)`` layout to PyTorch's.

    PyTorch puts the broadcast dims where the first indexed dim was when the index tensors
    are adjacent, and first otherwise.
    """
    adjacent = list(positions) == list(range(positions[0], positions[-1] + 1))
    first = positions[0] if adjacent else 0
    rest = rank - len(positions)
    return list(range(nb, nb + first)) + list(range(nb)) + list(range(nb + first, nb + rest))
