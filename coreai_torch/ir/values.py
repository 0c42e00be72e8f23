"""Building and reading Core AI values: types, constants, casts, shapes and axes, dynamic
sizes, arithmetic on values and Python numbers.

Shared by the lowerings (which build values with the node's location active, so the ops
carry the user's source line without ``loc=``) and the passes that rewrite a program.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np
import torch

from coreai_torch import dtypes
from coreai_torch._mlir import cai, ir

Scalar = bool | int | float


# ---------------------------------------------------------------------------------- types ---


def tensor_type(value: ir.Value) -> ir.RankedTensorType:
    return ir.RankedTensorType(value.type)


def shape_of(value: ir.Value) -> list[int | None]:
    """Static shape with ``None`` for dynamic dimensions."""
    t = tensor_type(value)
    return [None if t.is_dynamic_dim(i) else t.shape[i] for i in range(t.rank)]


def static_shape_of(value: ir.Value) -> list[int]:
    """The shape of a value whose shape is static (a weight, a constant); a ``ValueError``
    for a dynamic one."""
    shape = known_sizes(shape_of(value))
    if shape is None:
        raise ValueError(f"{value.type} has a dynamic shape where a static one is needed")
    return shape


def static_dim(value: ir.Value, axis: int) -> int:
    """Dimension ``axis`` of ``value`` (negative counts from the end), which must be static
    here (the others may be dynamic); a ``ValueError`` for a dynamic one."""
    size = shape_of(value)[axis]
    if size is None:
        raise ValueError(
            f"dimension {axis} of {value.type} is dynamic where a static one is needed"
        )
    return size


def static_sizes(shape: Sequence[int | None]) -> list[int]:
    """``shape`` (from :func:`shape_of`), whose dimensions must all be known here; a
    ``ValueError`` for a dynamic one."""
    sizes = known_sizes(shape)
    if sizes is None:
        raise ValueError(f"shape {list(shape)} has dynamic dimensions where static ones are needed")
    return sizes


def known_sizes(shape: Sequence[int | None]) -> list[int] | None:
    """``shape`` when every dimension is known, else None."""
    sizes = [d for d in shape if d is not None]
    return sizes if len(sizes) == len(shape) else None


def rank_of(value: ir.Value) -> int:
    return tensor_type(value).rank


def dtype_of(value: ir.Value) -> torch.dtype:
    return dtypes.dtype_of(value)


def is_static(value: ir.Value) -> bool:
    return tensor_type(value).has_static_shape


def numel(value: ir.Value) -> int | None:
    shape = known_sizes(shape_of(value))
    return None if shape is None else int(np.prod(shape, dtype=np.int64))


# ------------------------------------------------------------------------------ constants ---


def constant(value: Any, dtype: torch.dtype) -> ir.Value:
    """A constant tensor of a torch dtype from a Python scalar / list / numpy array."""
    array = np.asarray(value)
    if dtype == torch.bfloat16:
        return cai.constant(array.astype(np.float32), dtype=ir.BF16Type.get())
    return cai.constant(np.array(array, dtype=dtypes.to_numpy(dtype)))


def index_constant(values: Sequence[int] | int, *, unsigned: bool = False) -> ir.Value:
    """A 32-bit index constant (``si32``, or ``ui32`` for permutations, pads, tiles...)."""
    return cai.constant(np.array(values, dtype=np.uint32 if unsigned else np.int32))


def u32(values: Sequence[int] | int) -> np.ndarray:
    return np.array(values, dtype=np.uint32)


def i32(values: Sequence[int] | int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


# ---------------------------------------------------------------------------------- casts ---


def cast(value: ir.Value, dtype: torch.dtype) -> ir.Value:
    """``value`` converted to ``dtype`` (no op when it already has it).  A small float16
    constant is converted now: Core AI folds ``cast`` of float16 constants into wrong values
    for subnormal float16 numbers (2.056e-5 becomes 2.39e-7)."""
    if dtype_of(value) == dtype:
        return value
    target = ir.RankedTensorType.get(tensor_type(value).shape, dtypes.to_mlir(dtype))
    if dtype.is_floating_point:
        values = _inline_float16(value)
        if values is not None and dtype in (torch.float32, torch.float16, torch.float64):
            return cai.constant(values.astype(dtypes.to_numpy(dtype)), dtype=target.element_type)
    return cai.cast(value, target)


def _inline_float16(value: ir.Value) -> np.ndarray | None:
    """The values of an inline (not resource) float16 constant, else None."""
    owner = value.owner
    if isinstance(owner, ir.Block) or not ir.RankedTensorType.isinstance(value.type):
        return None
    op = owner.operation if isinstance(owner, ir.OpView) else owner
    if op.name != "coreai.constant" or "value" not in op.attributes:
        return None
    attr = op.attributes["value"]
    ttype = ir.RankedTensorType(value.type)
    if not isinstance(ttype.element_type, ir.F16Type) or not ir.DenseFPElementsAttr.isinstance(
        attr
    ):
        return None
    dense = ir.DenseFPElementsAttr(attr)
    if dense.is_splat:
        return np.full(ttype.shape, dense.get_splat_value().value, np.float16)
    return np.array(dense, dtype=np.float16).reshape(ttype.shape)


# ----------------------------------------------------------------------------------- axes ---


def normalize_dim(dim: int, rank: int) -> int:
    """A non-negative axis; rank-0 tensors accept dims 0 and -1 like PyTorch."""
    r = max(rank, 1)
    if not -r <= dim < r:
        raise IndexError(f"dimension {dim} is out of range for a tensor of rank {rank}")
    return dim % r


def normalize_dims(dims: Sequence[int] | int | None, rank: int) -> list[int]:
    """Sorted unique non-negative axes; ``None``/empty means every axis."""
    if dims is None:
        return list(range(rank))
    if isinstance(dims, int):
        dims = [dims]
    if len(dims) == 0:
        return list(range(rank))
    return sorted({normalize_dim(d, rank) for d in dims})


# ---------------------------------------------------------------------------------- shape ---


def reshape(value: ir.Value, shape: Sequence[int]) -> ir.Value:
    """Reshape to a static shape (no op when the shape is already right)."""
    shape = [int(d) for d in shape]
    if shape_of(value) == shape:
        return value
    return cai.reshape(value, i32(shape))


def transpose(value: ir.Value, perm: Sequence[int]) -> ir.Value:
    if list(perm) == list(range(len(perm))):
        return value
    return cai.transpose(value, u32(perm))


def swap_last_axes(value: ir.Value) -> ir.Value:
    """The matrix transpose of a (..., m, n) value: its last two axes swapped."""
    rank = rank_of(value)
    return transpose(value, [*range(rank - 2), rank - 1, rank - 2])


def squeeze(value: ir.Value, axes: Sequence[int]) -> ir.Value:
    if not axes:
        return value
    return cai.shrink_dims(value, i32(list(axes)))


def unsqueeze(value: ir.Value, axes: Sequence[int]) -> ir.Value:
    if not axes:
        return value
    return cai.expand_dims(value, i32(list(axes)))


def broadcast_to(value: ir.Value, shape: Sequence[int]) -> ir.Value:
    if shape_of(value) == list(shape):
        return value
    return cai.broadcast_to(value, u32(list(shape)))


def move_axis(value: ir.Value, source: int, destination: int) -> ir.Value:
    rank = rank_of(value)
    perm = [d for d in range(rank) if d != source]
    perm.insert(destination, source)
    return transpose(value, perm)


# ------------------------------------------------------------------------- dynamic shapes ---
#
# With ``torch.export.Dim`` a size can be a runtime value.  Symbolic sizes (SymInt nodes such
# as ``aten.sym_size.int`` and the arithmetic on them) are 0-d ``si32`` values; size lists
# of tensor ops then mix Python ints with such values.

#: Slice bound meaning "to the end" (Core AI clamps slice bounds like Python does).
INT32_MAX = 2**31 - 1

Size: TypeAlias = int | ir.Value


def is_symbolic(sizes: Sequence[Any] | Any) -> bool:
    """Whether a size (or a list of sizes) contains a runtime value."""
    if isinstance(sizes, (list, tuple)):
        return any(isinstance(s, ir.Value) for s in sizes)
    return isinstance(sizes, ir.Value)


def index_value(size: Size) -> ir.Value:
    """A size or index as a 0-d ``si32`` value (int constants, or a value cast to si32)."""
    if isinstance(size, ir.Value):
        value = cast(size, torch.int32)
        return squeeze(value, list(range(rank_of(value))))
    return cai.constant(np.int32(clamp_int32(size)))


def clamp_int32(v: int) -> int:
    """An int bound clamped to the si32 range (``sys.maxsize`` ends become INT32_MAX)."""
    return max(-(2**31), min(INT32_MAX, int(v)))


def dim_size(value: ir.Value, axis: int) -> Size:
    """Size of ``value`` along ``axis``: an int when static, else a 0-d ``si32`` value."""
    shape = shape_of(value)
    axis = normalize_dim(axis, len(shape))
    if shape[axis] is not None:
        return shape[axis]
    sizes = cai.cast(cai.get_shape(value), np.int32)
    one = cai.slice_(sizes, i32([axis]), i32([axis + 1]), i32([1]))
    return cai.shrink_dims(one, i32([0]))


def shape_vector(sizes: Sequence[Size]) -> ir.Value | np.ndarray:
    """A 1-D ``si32`` shape operand from ints and 0-d values (a numpy array when all static).

    Consecutive ints are grouped into one constant; values are reshaped to one element.
    """
    if not is_symbolic(sizes):
        return i32([clamp_int32(s) for s in sizes])
    pieces: list[ir.Value] = []
    run: list[int] = []
    for s in sizes:
        if isinstance(s, ir.Value):
            if run:
                pieces.append(index_constant(run))
                run = []
            pieces.append(cai.reshape(index_value(s), i32([1])))
        else:
            run.append(clamp_int32(s))
    if run:
        pieces.append(index_constant(run))
    return pieces[0] if len(pieces) == 1 else cai.concat(i32(0), pieces)


def shape_value(value: ir.Value) -> ir.Value | np.ndarray:
    """The shape of ``value`` as a shape operand (static dims stay constants)."""
    return shape_vector([dim_size(value, d) for d in range(rank_of(value))])


def refine(value: ir.Value, shape: Sequence[int | None]) -> ir.Value:
    """``value`` with the static dims of ``shape`` put back into its type (after an op whose
    runtime shape operands made every dim dynamic)."""
    current = shape_of(value)
    if len(current) != len(shape):
        return value
    merged = [c if c is not None else s for c, s in zip(current, shape, strict=True)]
    if merged == current:
        return value
    target = dtypes.tensor_type(merged, dtype_of(value))
    return cai.cast(value, target)


def reshape_dynamic(
    value: ir.Value, sizes: Sequence[Size], out_shape: Sequence[int | None]
) -> ir.Value:
    """Reshape to ``sizes`` (ints, ``-1`` and runtime values) whose result is ``out_shape``.

    With at most one unknown dim the static ``out_shape`` with ``-1`` is enough; otherwise the
    shape operand is built from ``sizes``.
    """
    static = known_sizes(out_shape)
    if static is not None:
        return reshape(value, static)
    if list(out_shape).count(None) == 1:
        target = cai.reshape(value, i32([-1 if d is None else d for d in out_shape]))
    else:
        target = cai.reshape(value, shape_vector(sizes))
    return refine(target, out_shape)


def broadcast_dynamic(
    value: ir.Value, sizes: Sequence[Size], out_shape: Sequence[int | None]
) -> ir.Value:
    """``value`` broadcast to ``sizes`` (ints, ``-1`` = keep the input dim, runtime values)."""
    static = known_sizes(out_shape)
    if static is not None:
        return broadcast_to(value, static)
    lead = len(sizes) - rank_of(value)
    dims: list[Size] = []
    for i, s in enumerate(sizes):
        if isinstance(s, int) and s == -1:
            s = dim_size(value, i - lead)
        elif out_shape[i] is not None:
            s = out_shape[i]
        dims.append(s)
    target = shape_vector(dims)
    if isinstance(target, np.ndarray):
        target = index_constant(target.tolist())
    return refine(cai.broadcast_to(value, cai.cast(target, np.uint32)), out_shape)


def filled_dynamic(sizes: Sequence[Size], fill: Scalar | ir.Value, dtype: torch.dtype) -> ir.Value:
    """A tensor of runtime shape ``sizes`` filled with ``fill``."""
    scalar = as_value(fill, dtype)
    scalar = squeeze(scalar, list(range(rank_of(scalar))))
    target = shape_vector(sizes)
    if isinstance(target, np.ndarray):
        return broadcast_to(scalar, target.tolist())
    out = cai.broadcast_to(scalar, cai.cast(target, np.uint32))
    return refine(out, [s if isinstance(s, int) else None for s in sizes])


def size_product(sizes: Sequence[Size]) -> Size:
    """The product of sizes (an int when all are static, else a 0-d ``si32`` value)."""
    static = 1
    for s in sizes:
        if isinstance(s, int):
            static *= s
    dynamic = [s for s in sizes if isinstance(s, ir.Value)]
    if not dynamic:
        return static
    result = index_value(dynamic[0])
    for s in dynamic[1:]:
        result = cai.mul(result, index_value(s))
    return result if static == 1 else cai.mul(result, index_value(static))


def slice_dynamic(
    value: ir.Value, axis: int, start: Size | None, end: Size | None, step: int = 1
) -> ir.Value:
    """``value[..., start:end:step, ...]`` with Python semantics (negative / clamped bounds),
    for dynamic dims and runtime bounds.  The result dims are refined where they stay static."""
    shape = shape_of(value)
    rank = len(shape)
    starts: list[Size] = [0] * rank
    ends: list[Size] = [INT32_MAX if d is None else d for d in shape]
    starts[axis] = 0 if start is None else start
    ends[axis] = INT32_MAX if end is None else end
    strides = [step if a == axis else 1 for a in range(rank)]
    out = cai.slice_(value, shape_vector(starts), shape_vector(ends), i32(strides))
    out_shape: list[int | None] = list(shape)
    out_shape[axis] = None
    return refine(out, out_shape)


# ------------------------------------------------- arithmetic on values and Python numbers ---
#
# For multi-step float formulas (special functions, series): operands are Core AI values or
# Python numbers; a number becomes a 0-d constant of the other operand's element type.

Number: TypeAlias = ir.Value | float


def like(a: Number, other: Number) -> ir.Value:
    """``a`` as a value: itself, or a 0-d constant of ``other``'s dtype."""
    if isinstance(a, ir.Value):
        return a
    assert isinstance(other, ir.Value), "one operand must be a value"
    return constant(a, dtype_of(other))


def add(a: Number, b: Number) -> ir.Value:
    return cai.broadcasting_add(like(a, b), like(b, a))


def sub(a: Number, b: Number) -> ir.Value:
    return cai.broadcasting_sub(like(a, b), like(b, a))


def mul(a: Number, b: Number) -> ir.Value:
    return cai.broadcasting_mul(like(a, b), like(b, a))


def div(a: Number, b: Number) -> ir.Value:
    return cai.broadcasting_divide(like(a, b), like(b, a))


def less(a: Number, b: Number) -> ir.Value:
    return cai.broadcasting_greater(like(b, a), like(a, b))


def greater(a: Number, b: Number) -> ir.Value:
    return cai.broadcasting_greater(like(a, b), like(b, a))


def equal(a: Number, b: Number) -> ir.Value:
    return cai.broadcasting_equal(like(a, b), like(b, a))


def not_nan(a: ir.Value) -> ir.Value:
    return cai.broadcasting_equal(a, a)


def all_of(*conditions: ir.Value) -> ir.Value:
    out = conditions[0]
    for c in conditions[1:]:
        out = cai.broadcasting_and(out, c)
    return out


def pick(condition: ir.Value, a: Number, b: Number, dtype_from: ir.Value) -> ir.Value:
    """``where(condition, a, b)``; numbers take ``dtype_from``'s dtype."""
    return cai.broadcasting_where(condition, like(a, dtype_from), like(b, dtype_from))


# ------------------------------------------------------------------- elementwise loops ---


def as_value(x: ir.Value | Scalar, dtype: torch.dtype) -> ir.Value:
    """A Python scalar as a 0-d constant of ``dtype``, or a value cast to ``dtype``."""
    if isinstance(x, ir.Value):
        return cast(x, dtype)
    return constant(x, dtype)


def constant_values(value: ir.Value) -> np.ndarray | None:
    """The integers of an integer ``coreai.constant`` (a splat as one element), else None."""
    owner = value.owner
    if isinstance(owner, ir.Block):
        return None
    op = owner.operation if isinstance(owner, ir.OpView) else owner
    if op.name != "coreai.constant" or "value" not in op.attributes:
        return None
    attr = op.attributes["value"]
    if ir.DenseIntElementsAttr.isinstance(attr):
        dense = ir.DenseIntElementsAttr(attr)
        if dense.is_splat:
            return np.array([int(dense.get_splat_value().value)])
        return np.array([int(v) for v in dense])
    return None


def operation(owner: Any) -> ir.Operation:
    """The ``ir.Operation`` behind a value's owner or a use's owner."""
    return owner.operation if isinstance(owner, ir.OpView) else owner


def permutation(op: ir.Operation) -> tuple[int, ...] | None:
    """The constant permutation of a ``coreai.transpose``, else None."""
    perm = constant_values(op.operands[1])
    return None if perm is None else tuple(int(p) for p in perm.tolist())


def splat_value(value: ir.Value) -> ir.Attribute | None:
    """The element of a splat constant (one value repeated), else None."""
    if isinstance(value.owner, ir.Block):
        return None
    op = operation(value.owner)
    attr = op.attributes["value"] if op.name == "coreai.constant" else None
    if attr is None or not ir.DenseElementsAttr.isinstance(attr):
        return None
    dense = ir.DenseElementsAttr(attr)
    return dense.get_splat_value() if dense.is_splat else None
