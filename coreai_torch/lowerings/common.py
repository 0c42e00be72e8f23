"""Helpers shared by the lowering rules: constants, casts, promotion, shapes and axes.

Rules run with the node's location active (the importer enters it), so the ops built here
carry the user's source line without passing ``loc=`` around.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch._prims_common as prims

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


def rank_of(value: ir.Value) -> int:
    return tensor_type(value).rank


def dtype_of(value: ir.Value) -> torch.dtype:
    return dtypes.dtype_of(value)


def is_static(value: ir.Value) -> bool:
    return tensor_type(value).has_static_shape


def numel(value: ir.Value) -> int | None:
    shape = shape_of(value)
    return None if None in shape else int(np.prod(shape, dtype=np.int64))


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
    """``value`` converted to ``dtype`` (no op when it already has it)."""
    if dtype_of(value) == dtype:
        return value
    target = ir.RankedTensorType.get(tensor_type(value).shape, dtypes.to_mlir(dtype))
    return cai.cast(value, target)


def as_value(x: ir.Value | Scalar, dtype: torch.dtype) -> ir.Value:
    """A Python scalar as a 0-d constant of ``dtype``, or a value cast to ``dtype``."""
    if isinstance(x, ir.Value):
        return cast(x, dtype)
    return constant(x, dtype)


def _fake(x: ir.Value | Scalar) -> Any:
    if isinstance(x, ir.Value):
        return torch.empty([1] * rank_of(x), dtype=dtype_of(x), device="meta")
    return x


def result_dtype(
    *operands: ir.Value | Scalar,
    kind: prims.ELEMENTWISE_TYPE_PROMOTION_KIND = prims.ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT,
) -> torch.dtype:
    """PyTorch's type promotion over tensors (Core AI values) and Python scalars."""
    fakes = [_fake(x) for x in operands if x is not None]
    _, dtype = prims.elementwise_dtypes(*fakes, type_promotion_kind=kind)
    return dtype


def promote(*operands: ir.Value | Scalar, dtype: torch.dtype | None = None) -> list[ir.Value]:
    """Operands converted to one dtype (PyTorch's promotion unless ``dtype`` is given)."""
    target = dtype or result_dtype(*operands)
    return [as_value(x, target) for x in operands]


def to_float(value: ir.Value, dtype: torch.dtype | None = None) -> ir.Value:
    """Integer/bool values become float (``dtype`` or float32); floats are left alone."""
    current = dtype_of(value)
    if current.is_floating_point and dtype is None:
        return value
    return cast(value, dtype or torch.float32)


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
