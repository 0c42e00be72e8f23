"""``linalg_ldl_factor(_ex)`` and ``linalg_ldl_solve``: LAPACK's Bunch-Kaufman ``LDLᵀ``
(``sytf2`` / ``sytrs`` with ``uplo='L'``, the routines PyTorch calls), so the pivots, the
packed factor and ``info`` match PyTorch's (the pivot choices were checked against PyTorch's
LAPACK on random and sparse symmetric matrices up to 100 x 100).

Like the LU factorization in ``lu.py`` the algorithm is unrolled over the (static)
matrix size, one step per column, vectorised over the batch.  Where LAPACK's step size
depends on the data (a 1x1 or a 2x2 pivot), every column position is visited and a batch
element whose previous step took a 2x2 pivot skips it.  Row/column interchanges are
symmetric permutations of the trailing block (gathers by per-matrix indices).  Only the
lower triangle of the input is read; the factor's upper triangle is 0, like PyTorch's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import (
    add,
    all_of,
    broadcast_to,
    cast,
    constant,
    div,
    dtype_of,
    equal,
    greater,
    i32,
    less,
    mul,
    not_nan,
    pick,
    rank_of,
    shape_of,
    static_shape_of,
    sub,
    swap_last_axes,
)
from coreai_torch.lowerings.helpers.arithmetic import ge
from coreai_torch.lowerings.helpers.layout import slice_axis
from coreai_torch.lowerings.registry import LoweringContext, lowering

# ------------------------------------------------------------------------------ helpers ---


def _column(a: ir.Value, k: int) -> ir.Value:
    return slice_axis(a, rank_of(a) - 1, k, k + 1)


def _row(a: ir.Value, k: int) -> ir.Value:
    return slice_axis(a, rank_of(a) - 2, k, k + 1)


def _at(a: ir.Value, i: int, j: int) -> ir.Value:
    return _row(_column(a, j), i)


def _reduce(fn, x: ir.Value, axes: Sequence[int]) -> ir.Value:
    rank = rank_of(x)
    return fn(x, i32([a % rank for a in axes]))


def _iota(n: int, column: bool) -> ir.Value:
    values = np.arange(n, dtype=np.int32)
    return constant(values.reshape(n, 1) if column else values.reshape(1, n), torch.int32)


def _mask(condition: np.ndarray) -> ir.Value:
    return constant(condition, torch.bool)


def _nonzero(x: ir.Value) -> ir.Value:
    return cai.not_(equal(x, 0.0))


def _select_row(a: ir.Value, index: ir.Value) -> ir.Value:
    """``a[..., index, :]`` for a per-matrix (B..., 1, 1) int32 ``index``: (B..., 1, n)."""
    n = static_shape_of(a)[-2]
    hit = cai.broadcasting_equal(_iota(n, column=True), index)
    return _reduce(cai.reduce_sum, pick(hit, a, 0.0, a), [-2])


def _select_column(a: ir.Value, index: ir.Value) -> ir.Value:
    n = static_shape_of(a)[-1]
    hit = cai.broadcasting_equal(_iota(n, column=False), index)
    return _reduce(cai.reduce_sum, pick(hit, a, 0.0, a), [-1])


def _swap_symmetric(a: ir.Value, i: ir.Value, j: ir.Value, region: np.ndarray) -> ir.Value:
    """The lower-triangle matrix ``a`` with rows and columns ``i`` and ``j`` (per matrix)
    of its symmetric completion swapped, written where the static ``region`` is true."""
    n = static_shape_of(a)[-1]
    rows, cols = np.indices((n, n))
    full = cai.broadcasting_where(_mask(rows >= cols), a, swap_last_axes(a))
    iota = _iota(n, column=True)
    perm = cai.broadcasting_where(
        cai.broadcasting_equal(iota, i),
        j,
        cai.broadcasting_where(cai.broadcasting_equal(iota, j), i, iota),
    )  # (B..., n, 1)
    shape = static_shape_of(a)
    full = cai.gather_along_axis(full, broadcast_to(perm, shape), i32(-2))
    full = cai.gather_along_axis(full, broadcast_to(swap_last_axes(perm), shape), i32(-1))
    return cai.broadcasting_where(_mask(region & (rows >= cols)), full, a)


# -------------------------------------------------------------------------- factorization ---


def ldl_factor(a: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value]:
    """``(LD, pivots, info)`` of the lower triangles of the (B..., n, n) matrices ``a``."""
    shape = static_shape_of(a)
    n = shape[-1]
    batch = shape[:-2]
    dtype = dtype_of(a)
    np_dtype = np.float64 if dtype == torch.float64 else np.float32
    alpha = float((np_dtype(1) + np.sqrt(np_dtype(17))) / np_dtype(8))
    rows, cols = np.indices((n, n))
    a = cai.broadcasting_where(_mask(rows >= cols), a, constant(0.0, dtype))
    int_shape = [*batch, 1, 1]
    info = constant(np.zeros(int_shape, np.int32), torch.int32)
    skip = constant(np.zeros(int_shape, bool), torch.bool)
    forced: ir.Value | None = None  # the pivot a 2x2 step wrote for the next position
    pivots: list[ir.Value] = []
    for k in range(n):
        active = cai.not_(skip)
        column = _column(a, k)
        absakk = cai.abs_(_at(a, k, k))
        if k < n - 1:
            below = cai.abs_(slice_axis(column, rank_of(a) - 2, k + 1, n))
            colmax = _reduce(cai.reduce_max, below, [-2])
            positions = constant(np.arange(k + 1, n, dtype=np.int32).reshape(-1, 1), torch.int32)
            first = pick(equal(below, colmax), positions, n - 1, positions)
            imax = _reduce(cai.reduce_min, first, [-2])  # first largest, like i?amax
        else:
            colmax = constant(np.zeros(int_shape), dtype)
            imax = constant(np.full(int_shape, k, np.int32), torch.int32)
        k_index = constant(np.int32(k), torch.int32)
        row_imax = _select_row(a, imax)  # a[imax, :] (left of the diagonal)
        col_imax = _select_column(a, imax)  # a[:, imax] (below the diagonal)
        j = _iota(n, column=False)
        left = all_of(cai.not_(less(j, k_index)), less(j, imax))
        rowmax = _reduce(cai.reduce_max, pick(left, cai.abs_(row_imax), 0.0, a), [-1])
        under = greater(_iota(n, column=True), imax)
        rowmax = cai.broadcasting_maximum(
            rowmax, _reduce(cai.reduce_max, pick(under, cai.abs_(col_imax), 0.0, a), [-2])
        )
        diagonal_imax = _reduce(
            cai.reduce_sum, pick(cai.broadcasting_equal(j, imax), row_imax, 0.0, a), [-1]
        )
        zero = cai.broadcasting_or(
            equal(cai.broadcasting_maximum(absakk, colmax), 0.0), cai.not_(not_nan(absakk))
        )
        # LAPACK's tests, false for NaN like Fortran's .GE.
        keep = cai.broadcasting_or(
            cai.broadcasting_or(zero, ge(absakk, mul(colmax, alpha))),
            ge(absakk, mul(mul(colmax, alpha), div(colmax, rowmax))),
        )
        one_by_one = cai.broadcasting_or(keep, ge(cai.abs_(diagonal_imax), mul(rowmax, alpha)))
        two = all_of(cai.not_(one_by_one), active) if k < n - 1 else None
        kp = pick(keep, k_index, imax, imax)
        kk = k_index if two is None else pick(two, k + 1, k, k_index)
        region = (rows >= k) & (cols >= k)
        swapped = _swap_symmetric(a, kk, kp, region)
        updated = _one_by_one_update(swapped, k) if k < n - 1 else swapped
        if two is not None:  # a 2x2 pivot in the last two columns leaves nothing to update
            pair = _two_by_two_update(swapped, k) if k < n - 2 else swapped
            updated = cai.broadcasting_where(two, pair, updated)
        updated = cai.broadcasting_where(zero, a, updated)
        a = cai.broadcasting_where(active, updated, a)
        own = cast(add(kp, 1), torch.int32)
        if two is not None:
            own = cai.broadcasting_where(two, sub(0, own), own)
        pivot = own if forced is None else cai.broadcasting_where(skip, forced, own)
        pivots.append(pivot)
        info = pick(all_of(active, zero, equal(info, 0)), k + 1, info, info)
        forced = own
        skip = two if two is not None else skip
    piv = cai.concat(i32(len(batch)), [_reshape_pivot(p) for p in pivots])
    return a, piv, _squeeze_matrix(info)


def _reshape_pivot(p: ir.Value) -> ir.Value:
    """(B..., 1, 1) -> (B..., 1)."""
    return cai.shrink_dims(p, i32([rank_of(p) - 1]))


def _squeeze_matrix(x: ir.Value) -> ir.Value:
    rank = rank_of(x)
    return cai.shrink_dims(x, i32([rank - 2, rank - 1]))


def _one_by_one_update(a: ir.Value, k: int) -> ir.Value:
    """``dsyr`` of the trailing block with column ``k`` scaled by ``1 / a[k, k]``."""
    n = static_shape_of(a)[-1]
    rows, cols = np.indices((n, n))
    d11 = div(1.0, _at(a, k, k))
    x = pick(_mask(np.arange(n).reshape(n, 1) > k), _column(a, k), 0.0, a)  # (B..., n, 1)
    temp = mul(swap_last_axes(x), sub(0.0, d11))  # (B..., 1, n)
    trailing = add(a, mul(x, temp))
    # dsyr leaves a column alone where x[j] == 0 (so -0.0 stays -0.0, inf * 0 adds no NaN)
    touched = cai.broadcasting_and(_mask((rows >= cols) & (cols > k)), _nonzero(swap_last_axes(x)))
    a = cai.broadcasting_where(touched, trailing, a)
    return cai.broadcasting_where(_mask((rows > k) & (cols == k)), mul(x, d11), a)


def _two_by_two_update(a: ir.Value, k: int) -> ir.Value:
    """The trailing update of a 2x2 pivot in columns ``k`` and ``k + 1``."""
    n = static_shape_of(a)[-1]
    rows, cols = np.indices((n, n))
    d21 = _at(a, k + 1, k)
    d11 = div(_at(a, k + 1, k + 1), d21)
    d22 = div(_at(a, k, k), d21)
    t = div(1.0, sub(mul(d11, d22), 1.0))
    d21 = div(t, d21)
    below = _mask(np.arange(n).reshape(n, 1) > k + 1)
    ck = pick(below, _column(a, k), 0.0, a)
    ck1 = pick(below, _column(a, k + 1), 0.0, a)
    wk = mul(d21, sub(mul(d11, ck), ck1))  # (B..., n, 1)
    wkp1 = mul(d21, sub(mul(d22, ck1), ck))
    trailing = sub(sub(a, mul(ck, swap_last_axes(wk))), mul(ck1, swap_last_axes(wkp1)))
    a = cai.broadcasting_where(_mask((rows >= cols) & (cols > k + 1)), trailing, a)
    a = cai.broadcasting_where(_mask((rows > k + 1) & (cols == k)), wk, a)
    return cai.broadcasting_where(_mask((rows > k + 1) & (cols == k + 1)), wkp1, a)


# --------------------------------------------------------------------------------- solve ---


def _eliminate(b: ir.Value, column: ir.Value, pivot_row: ir.Value, below: int) -> ir.Value:
    """``b[i] - column[i] b[pivot]`` for the rows ``i > below`` (``dger``); other rows, and
    columns where ``b[pivot]`` is 0, are not touched, like the reference BLAS."""
    n = static_shape_of(b)[-2]
    rows = cai.broadcasting_and(_mask(np.arange(n).reshape(n, 1) > below), _nonzero(pivot_row))
    return cai.broadcasting_where(rows, add(b, mul(column, sub(0.0, pivot_row))), b)


def _dot_below(column: ir.Value, b: ir.Value, below: int) -> ir.Value:
    """``Σ_{i > below} column[i] b[i]`` (``dgemv``), (B..., 1, columns)."""
    n = static_shape_of(b)[-2]
    rows = _mask(np.arange(n).reshape(n, 1) > below)
    return _reduce(cai.reduce_sum, pick(rows, mul(column, b), 0.0, b), [-2])


def _swap_rows(b: ir.Value, i: int, j: ir.Value) -> ir.Value:
    """Rows ``i`` (static) and ``j`` (per matrix, (B..., 1, 1)) of ``b`` swapped; an index
    out of range (from the pivot of the other block kind) swaps nothing."""
    n = static_shape_of(b)[-2]
    iota = _iota(n, column=True)
    index = constant(np.int32(i), torch.int32)
    inside = all_of(cai.not_(less(j, 0)), less(j, n))
    j = cai.broadcasting_where(inside, j, index)
    perm = cai.broadcasting_where(
        cai.broadcasting_equal(iota, index),
        j,
        cai.broadcasting_where(cai.broadcasting_equal(iota, j), index, iota),
    )
    return cai.gather_along_axis(b, broadcast_to(perm, static_shape_of(b)), i32(-2))


def ldl_solve(ld: ir.Value, pivots: ir.Value, b: ir.Value) -> ir.Value:
    """``dsytrs`` (lower): ``X`` with ``A X = B`` for ``A = P L D Lᵀ Pᵀ`` packed in ``ld``."""
    n = static_shape_of(ld)[-1]
    dtype = dtype_of(b)
    ld = cast(ld, dtype)
    pivots = cast(pivots, torch.int32)
    piv = [cai.expand_dims(slice_axis(pivots, rank_of(pivots) - 1, k, k + 1), i32([-1]))
           for k in range(n)]  # fmt: skip
    rows = np.arange(n).reshape(n, 1)
    # which positions start a 1x1 / 2x2 block, and which are the second row of a 2x2
    second: list[ir.Value | bool] = [False]
    for k in range(n - 1):
        starts = cai.not_(second[k]) if isinstance(second[k], ir.Value) else True
        negative = less(piv[k], constant(np.int32(0), torch.int32))
        second.append(negative if starts is True else all_of(starts, negative))
    zero_i = constant(np.int32(0), torch.int32)
    # L D y = b
    for k in range(n):
        skip = second[k]
        single = cai.not_(less(piv[k], zero_i))
        kp_single = sub(piv[k], 1)
        one = _swap_rows(b, k, kp_single)
        one = _eliminate(one, _column(ld, k), _row(one, k), k)
        scaled = mul(_row(one, k), div(1.0, _at(ld, k, k)))
        one = cai.broadcasting_where(_mask(rows == k), scaled, one)
        out = one
        if k < n - 1:
            out = cai.broadcasting_where(single, one, _forward_pair(ld, b, piv[k], k))
        if isinstance(skip, ir.Value):
            out = cai.broadcasting_where(skip, b, out)
        b = out
    # Lᵀ x = y, from the last row up; a 2x2 block is handled at its second row
    for k in reversed(range(n)):
        single = cai.not_(less(piv[k], zero_i))
        kp = pick(single, sub(piv[k], 1), sub(sub(0, piv[k]), 1), piv[k])
        step = b
        if k < n - 1:
            dot = _dot_below(_column(ld, k), b, k)
            step = cai.broadcasting_where(_mask(rows == k), sub(b, dot), b)
            if k > 0 and isinstance(second[k], ir.Value):
                dot = _dot_below(_column(ld, k - 1), b, k)
                pair = cai.broadcasting_where(_mask(rows == k - 1), sub(b, dot), step)
                step = cai.broadcasting_where(second[k], pair, step)
        out = _swap_rows(step, k, kp)
        first_of_pair = second[k + 1] if k + 1 < n else False
        if isinstance(first_of_pair, ir.Value):
            out = cai.broadcasting_where(first_of_pair, b, out)
        b = out
    return b


def _forward_pair(ld: ir.Value, b: ir.Value, pivot: ir.Value, k: int) -> ir.Value:
    """The forward step of a 2x2 block in rows ``k`` and ``k + 1``."""
    n = static_shape_of(ld)[-1]
    rows = np.arange(n).reshape(n, 1)
    kp = sub(sub(0, pivot), 1)
    b = _swap_rows(b, k + 1, kp)
    if k < n - 2:
        b = _eliminate(b, _column(ld, k), _row(b, k), k + 1)
        b = _eliminate(b, _column(ld, k + 1), _row(b, k + 1), k + 1)
    akm1k = _at(ld, k + 1, k)
    akm1 = div(_at(ld, k, k), akm1k)
    ak = div(_at(ld, k + 1, k + 1), akm1k)
    denominator = sub(mul(akm1, ak), 1.0)
    bkm1 = div(_row(b, k), akm1k)
    bk = div(_row(b, k + 1), akm1k)
    new_k = div(sub(mul(ak, bkm1), bk), denominator)
    new_k1 = div(sub(mul(akm1, bk), bkm1), denominator)
    b = cai.broadcasting_where(_mask(rows == k), new_k, b)
    return cai.broadcasting_where(_mask(rows == k + 1), new_k1, b)


# -------------------------------------------------------------------------------- rules ---


def _check(cx: LoweringContext, *values: ir.Value) -> None:
    for v in values:
        if None in shape_of(v):
            raise cx.unsupported("LDLᵀ needs static shapes")
    dtype = dtype_of(values[0])
    if dtype not in (torch.float32, torch.float64):
        raise cx.unsupported(f"LDLᵀ of {dtype} matrices (float32/float64 only)")


@lowering("aten::linalg_ldl_factor_ex.default", "aten::linalg_ldl_factor.default")
def linalg_ldl_factor(
    cx: LoweringContext, self: ir.Value, hermitian: bool = False, check_errors: bool = False
) -> list[ir.Value]:
    """Real matrices: ``hermitian`` makes no difference (LAPACK's ``hetrf`` is ``sytrf``)."""
    _check(cx, self)
    if check_errors:
        raise cx.unsupported("check_errors=True (Core AI programs cannot raise)")
    ld, pivots, info = ldl_factor(self)
    results = cx.out if isinstance(cx.out, (list, tuple)) else [cx.out]
    return [ld, pivots, info][: len(results)]


@lowering("aten::linalg_ldl_solve.default")
def linalg_ldl_solve(
    cx: LoweringContext, LD: ir.Value, pivots: ir.Value, B: ir.Value, hermitian: bool = False
) -> ir.Value:
    _check(cx, LD, B)
    batch = list(
        torch.broadcast_shapes(tuple(static_shape_of(LD)[:-2]), tuple(static_shape_of(B)[:-2]))
    )
    n, columns = static_shape_of(B)[-2:]
    ld = broadcast_to(LD, [*batch, n, n])
    piv = broadcast_to(pivots, [*batch, n])
    b = broadcast_to(B, [*batch, n, columns])
    return ldl_solve(ld, piv, b)
