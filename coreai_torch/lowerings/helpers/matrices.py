"""Matrix products and the building blocks of the unrolled matrix factorizations.

Products: ``torch.matmul`` semantics (vector promotion, batch broadcasting) in the operands'
dtype (:func:`batched_matmul`) or with 16-bit operands accumulating in float32
(:func:`matmul_values`, :mod:`~coreai_torch.lowerings.helpers.accumulation`), and the plain
batched product of the factorization kernels (:func:`matrix_product`).

Factorizations: Core AI has no linear-algebra kernels, so the factorizations are unrolled over
the (static) matrix size: one step per column or row, each step vectorised over the batch and
the remaining rows.  The helpers here slice rows, columns and elements out of (..., m, n)
matrices, mask them by static patterns, track LAPACK's ``info`` and solve triangular systems
(LAPACK's unblocked ``trsm``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import (
    broadcast_to,
    constant,
    dtype_of,
    i32,
    known_sizes,
    rank_of,
    shape_of,
    squeeze,
    static_shape_of,
    unsqueeze,
)
from coreai_torch.lowerings.helpers.accumulation import accumulating
from coreai_torch.lowerings.helpers.layout import slice_axis
from coreai_torch.lowerings.registry import LoweringContext

# ------------------------------------------------------------------------------ products ---


def matmul_values(cx: LoweringContext, a: ir.Value, b: ir.Value) -> ir.Value:
    """``torch.matmul`` semantics (vector promotion, batch broadcasting); 16-bit operands
    accumulate in float32 (:mod:`coreai_torch.lowerings.helpers.accumulation`)."""
    return accumulating(cx, batched_matmul, a, b)


def batched_matmul(a: ir.Value, b: ir.Value) -> ir.Value:
    """``torch.matmul`` semantics (vector promotion, batch broadcasting) in the operands'
    dtype."""
    ra, rb = rank_of(a), rank_of(b)
    if ra == 1 and rb == 1:
        return squeeze(cai.batch_matmul(unsqueeze(a, [0]), unsqueeze(b, [1])), [0, 1])
    if ra == 1:
        out = cai.broadcasting_batch_matmul(unsqueeze(a, [0]), b)
        return squeeze(out, [rank_of(out) - 2])
    if rb == 1:
        out = cai.broadcasting_batch_matmul(a, unsqueeze(b, [1]))
        return squeeze(out, [rank_of(out) - 1])
    a, b = _unbroadcast_batch(a, b), _unbroadcast_batch(b, a)
    if rank_of(a) == rank_of(b) == 2:
        return cai.batch_matmul(a, b)
    return cai.broadcasting_batch_matmul(a, b)


def _static_batch(value: ir.Value) -> tuple[int, ...] | None:
    shape = known_sizes(shape_of(value))
    return None if shape is None or any(d < 0 for d in shape) else tuple(shape[:-2])


def _unbroadcast_batch(value: ir.Value, other: ir.Value) -> ir.Value:
    """The source of ``value`` when ``value`` only broadcasts it along batch dimensions that
    the matmul broadcasts anyway (``torch.matmul`` of a 3-D by a 2-D operand expands the
    weight to a batch of copies for ``bmm``): the batch matmul broadcasts the source itself,
    and no batch of copies is made (or folded into the asset by Core AI's rewrite)."""
    owner = value.owner
    if isinstance(owner, ir.Block) or owner.operation.name != "coreai.broadcast_to":
        return value
    source = owner.operation.operands[0]
    if rank_of(source) < 2 or shape_of(source)[-2:] != shape_of(value)[-2:]:
        return value
    ours, theirs, original = _static_batch(source), _static_batch(other), _static_batch(value)
    if ours is None or theirs is None or original is None:
        return value
    try:
        same = np.broadcast_shapes(ours, theirs) == np.broadcast_shapes(original, theirs)
    except ValueError:
        return value
    return source if same else value


def matrix_product(a: ir.Value, b: ir.Value) -> ir.Value:
    """``a @ b`` for (..., m, k) and (..., k, n) operands whose batch dims broadcast."""
    return cai.broadcasting_batch_matmul(a, b)


# -------------------------------------------------------------------- unrolled matrices ---


def row_slice(x: ir.Value, start: int, end: int) -> ir.Value:
    """Rows ``start:end`` of the matrices ``x`` (..., m, n)."""
    return slice_axis(x, -2, start, end)


def column_slice(x: ir.Value, start: int, end: int) -> ir.Value:
    """Columns ``start:end`` of the matrices ``x`` (..., m, n)."""
    return slice_axis(x, -1, start, end)


def element(x: ir.Value, i: int, j: int) -> ir.Value:
    """``x[..., i:i+1, j:j+1]``."""
    return column_slice(row_slice(x, i, i + 1), j, j + 1)


def concat(axis: int, parts: Sequence[ir.Value]) -> ir.Value:
    """``parts`` concatenated along ``axis`` (a single part as it is)."""
    parts = list(parts)
    return parts[0] if len(parts) == 1 else cai.concat(axis, parts)


def masked(mask: np.ndarray, x: ir.Value, other: float = 0.0) -> ir.Value:
    """``x`` where the static ``mask`` is true, else ``other`` (NaN-safe, unlike a product)."""
    return cai.broadcasting_where(constant(mask, torch.bool), x, constant(other, dtype_of(x)))


def eye(rows: int, cols: int, dtype: torch.dtype) -> ir.Value:
    return constant(np.eye(rows, cols), dtype)


def row_indices(m: int) -> np.ndarray:
    """0 .. m-1 as an int32 column (m, 1)."""
    return np.arange(m, dtype=np.int32).reshape(m, 1)


def broadcast_batch(*shapes: Sequence[int]) -> list[int]:
    """The broadcast of (static) batch shapes."""
    return list(torch.broadcast_shapes(*(tuple(s) for s in shapes)))


def broadcast_pair(a: ir.Value, b: ir.Value) -> tuple[ir.Value, ir.Value]:
    """The matrices ``a`` and ``b`` broadcast to their common batch shape."""
    sa, sb = static_shape_of(a), static_shape_of(b)
    batch = broadcast_batch(sa[:-2], sb[:-2])
    return broadcast_to(a, [*batch, *sa[-2:]]), broadcast_to(b, [*batch, *sb[-2:]])


def squeeze_matrix(x: ir.Value) -> ir.Value:
    """(..., 1, 1) -> (...)."""
    rank = rank_of(x)
    return squeeze(x, [rank - 2, rank - 1])


def info_zeros(batch: Sequence[int]) -> ir.Value:
    """LAPACK's ``info`` (int32, 0 = fine) for every matrix of ``batch``, as (..., 1, 1)."""
    return constant(np.zeros([*batch, 1, 1], np.int32), torch.int32)


def first_set(info: ir.Value, bad: ir.Value, step: int) -> ir.Value:
    """``info`` (int32, 0 = fine) becomes ``step`` where ``bad`` and it is still 0."""
    unset = cai.broadcasting_equal(info, constant(0, torch.int32))
    hit = cai.broadcasting_and(unset, bad)
    return cai.broadcasting_where(hit, constant(step, torch.int32), info)


def require_static(cx: LoweringContext, *values: ir.Value) -> None:
    for v in values:
        if None in shape_of(v):
            raise cx.unsupported("matrix factorizations need static shapes")


def require_float(cx: LoweringContext, x: ir.Value) -> torch.dtype:
    """The dtype of the matrices ``x``, which must be floating point."""
    dtype = dtype_of(x)
    if dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        raise cx.unsupported(f"{dtype} matrices are not supported (floating point only)")
    return dtype


def require_square(cx: LoweringContext, a: ir.Value) -> None:
    shape = shape_of(a)
    if len(shape) < 2 or shape[-1] != shape[-2]:
        raise cx.unsupported(f"expected square matrices, got shape {shape}")


def triangular_solve(a: ir.Value, b: ir.Value, *, upper: bool, unit: bool) -> ir.Value:
    """``X`` with ``A X = B``, reading only the triangle of ``a`` (same batch shapes)."""
    n = static_shape_of(a)[-1]
    rows: dict[int, ir.Value] = {}
    for i in range(n - 1, -1, -1) if upper else range(n):
        r = row_slice(b, i, i + 1)
        lo, hi = (i + 1, n) if upper else (0, i)
        if hi > lo:
            coeff = column_slice(row_slice(a, i, i + 1), lo, hi)
            done = concat(-2, [rows[j] for j in range(lo, hi)])
            r = cai.broadcasting_sub(r, matrix_product(coeff, done))
        if not unit:
            r = cai.broadcasting_divide(r, element(a, i, i))
        rows[i] = r
    return concat(-2, [rows[i] for i in range(n)])


def diagonal_column(x: ir.Value) -> ir.Value:
    """The diagonal of square matrices as (..., n, 1)."""
    n = static_shape_of(x)[-1]
    return cai.reduce_sum(masked(np.eye(n, dtype=bool), x), i32([-1]))
