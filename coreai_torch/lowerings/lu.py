"""LU factorization and what is built on it: ``linalg_lu_factor(_ex)``, ``linalg_lu``,
``lu_unpack``, ``linalg_lu_solve``, ``linalg_solve``, ``linalg_inv``, ``linalg_tensorinv`` and
the determinants (``_linalg_det``, ``_linalg_slogdet``).

The factorization is LAPACK's ``getf2`` with partial pivoting, unrolled over the (static)
matrix size one column at a time, so pivots, signs and factors match PyTorch's.  Core AI
programs cannot raise errors: a singular input gives the ``info`` PyTorch's ``_ex`` variants
report, and inf/NaN in the results where PyTorch would raise.
"""

from __future__ import annotations

import numpy as np
import torch

from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import (
    broadcast_to,
    cast,
    constant,
    dtype_of,
    i32,
    rank_of,
    squeeze,
    static_shape_of,
    swap_last_axes,
    unsqueeze,
)
from coreai_torch.lowerings.helpers.arithmetic import sign_values
from coreai_torch.lowerings.helpers.layout import slice_axis
from coreai_torch.lowerings.helpers.matrices import (
    broadcast_batch,
    broadcast_pair,
    column_slice,
    concat,
    diagonal_column,
    element,
    eye,
    first_set,
    info_zeros,
    masked,
    matrix_product,
    require_float,
    require_square,
    require_static,
    row_indices,
    row_slice,
    squeeze_matrix,
    triangular_solve,
)
from coreai_torch.lowerings.registry import LoweringContext, lowering


def _swap_rows(iota: ir.Value, m: int, s: int, p: ir.Value) -> ir.Value:
    """Row indices (..., m, 1) that exchange row ``s`` with the runtime row ``p`` (..., 1, 1)."""
    offset = cai.broadcasting_mul(
        constant((row_indices(m) == s).astype(np.int32), torch.int32),
        cai.broadcasting_sub(p, constant(s, torch.int32)),
    )
    back = cai.broadcasting_mul(
        cast(cai.broadcasting_equal(iota, p), torch.int32),
        cai.broadcasting_sub(constant(s, torch.int32), p),
    )
    return cai.broadcasting_add(cai.broadcasting_add(iota, offset), back)


def lu_factor(a: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value, ir.Value]:
    """LU with partial pivoting (LAPACK ``getf2``) of ``a`` (..., m, n).

    Returns ``(LU, pivots, info, perm)``: ``LU`` packs unit-lower ``L`` and ``U``; ``pivots``
    (..., k) are LAPACK's 1-based row swaps (int32); ``perm`` (..., m, 1) is the resulting row
    order, ``A[perm] = L U``.
    """
    shape = static_shape_of(a)
    m, n = shape[-2:]
    batch = shape[:-2]
    dtype = dtype_of(a)
    iota = constant(row_indices(m), torch.int32)
    perm = broadcast_to(iota, [*batch, m, 1])
    info = info_zeros(batch)
    pivots = []
    w = a
    for s in range(min(m, n)):
        column = cai.abs_(column_slice(w, s, s + 1))
        score = masked(row_indices(m) >= s, column, -1.0)
        p = cast(cai.argmax(score, i32(-2)), torch.int32)  # (..., 1, 1)
        swap = _swap_rows(iota, m, s, p)
        w = cai.gather_along_axis(w, broadcast_to(swap, [*batch, m, n]), i32(-2))
        perm = cai.gather_along_axis(perm, swap, i32(-2))
        pivots.append(cai.broadcasting_add(p, constant(1, torch.int32)))
        pivot = element(w, s, s)
        zero = cai.broadcasting_equal(pivot, constant(0.0, dtype))
        info = first_set(info, zero, s + 1)
        if s + 1 == m:
            continue
        below = row_slice(column_slice(w, s, s + 1), s + 1, m)
        below = cai.broadcasting_where(zero, below, cai.broadcasting_divide(below, pivot))
        parts = [column_slice(row_slice(w, s + 1, m), 0, s)] if s else []
        parts.append(below)
        if s + 1 < n:
            right = column_slice(w, s + 1, n)
            trail = cai.broadcasting_sub(
                row_slice(right, s + 1, m), matrix_product(below, row_slice(right, s, s + 1))
            )
            parts.append(trail)
        w = concat(-2, [row_slice(w, 0, s + 1), concat(-1, parts)])
    piv = squeeze(concat(-1, pivots), [len(batch)])  # (..., k)
    return w, piv, squeeze_matrix(info), perm


def permutation_from_pivots(pivots: ir.Value, m: int) -> ir.Value:
    """Row order (..., m, 1) produced by applying LAPACK's 1-based ``pivots`` (..., k)."""
    shape = static_shape_of(pivots)
    batch, k = shape[:-1], shape[-1]
    iota = constant(row_indices(m), torch.int32)
    perm = broadcast_to(iota, [*batch, m, 1])
    piv = cast(pivots, torch.int32)
    for s in range(k):
        p = cai.broadcasting_sub(
            unsqueeze(slice_axis(piv, -1, s, s + 1), [len(batch) + 1]), constant(1, torch.int32)
        )
        swap = _swap_rows(iota, m, s, p)
        perm = cai.gather_along_axis(perm, swap, i32(-2))
    return perm


def permutation_matrix(perm: ir.Value, dtype: torch.dtype) -> ir.Value:
    """``P`` with ``P[perm[i], i] = 1``, so that ``A = P L U`` when ``A[perm] = L U``."""
    m = static_shape_of(perm)[-2]
    return cast(
        cai.broadcasting_equal(constant(row_indices(m), torch.int32), swap_last_axes(perm)), dtype
    )


def permute_rows(b: ir.Value, perm: ir.Value) -> ir.Value:
    """``b[..., perm, :]`` for a row order ``perm`` (..., m, 1) of the same batch."""
    return cai.gather_along_axis(b, broadcast_to(perm, static_shape_of(b)), i32(-2))


def lu_solve(lu: ir.Value, perm: ir.Value, b: ir.Value) -> ir.Value:
    """``X`` with ``A X = B`` from ``A[perm] = L U`` (same batch shapes)."""
    y = triangular_solve(lu, permute_rows(b, perm), upper=False, unit=True)
    return triangular_solve(lu, y, upper=True, unit=False)


def swap_parity(pivots: ir.Value) -> ir.Value:
    """-1/+1 (int32, (..., 1, 1)) for an odd/even number of row swaps."""
    k = static_shape_of(pivots)[-1]
    steps = constant(np.arange(1, k + 1, dtype=np.int32), torch.int32)
    swapped = cast(cai.broadcasting_not_equal(pivots, steps), torch.int32)
    count = unsqueeze(cai.reduce_sum(swapped, i32([-1])), [rank_of(pivots)])
    odd = cai.broadcasting_modulo(count, constant(2, torch.int32))
    return cai.broadcasting_sub(
        constant(1, torch.int32), cai.broadcasting_mul(odd, constant(2, torch.int32))
    )


def _vector_case(a: ir.Value, b: ir.Value) -> bool:
    sa, sb = static_shape_of(a), static_shape_of(b)
    return len(sb) == 1 or (len(sb) == len(sa) - 1 and sb == sa[:-1])


def _solve_general(cx: LoweringContext, a: ir.Value, b: ir.Value, left: bool) -> ir.Value:
    """``linalg.solve``: returns X (and leaves the vector case to the caller)."""
    if not left:
        return swap_last_axes(_solve_general(cx, swap_last_axes(a), swap_last_axes(b), True))
    a, b = broadcast_pair(a, b)
    lu, _, _, perm = lu_factor(a)
    return lu_solve(lu, perm, b)


@lowering("aten::linalg_lu_factor_ex.default", "aten::linalg_lu_factor.default")
def linalg_lu_factor(
    cx: LoweringContext, A: ir.Value, pivot: bool = True, check_errors: bool = False
) -> list[ir.Value]:
    require_static(cx, A)
    require_float(cx, A)
    if not pivot:
        raise cx.unsupported("LU without pivoting is not supported")
    lu, pivots, info, _ = lu_factor(A)
    return [lu, pivots, info] if len(cx.out) == 3 else [lu, pivots]


def _unpack(lu: ir.Value, perm: ir.Value, dtype: torch.dtype) -> list[ir.Value]:
    m, n = static_shape_of(lu)[-2:]
    k = min(m, n)
    lower = cai.broadcasting_add(
        masked(np.tril(np.ones((m, k), bool), -1), column_slice(lu, 0, k)), eye(m, k, dtype)
    )
    upper = masked(np.triu(np.ones((k, n), bool)), row_slice(lu, 0, k))
    return [permutation_matrix(perm, dtype), lower, upper]


@lowering("aten::linalg_lu.default")
def linalg_lu(cx: LoweringContext, A: ir.Value, pivot: bool = True) -> list[ir.Value]:
    require_static(cx, A)
    dtype = require_float(cx, A)
    if not pivot:
        raise cx.unsupported("LU without pivoting is not supported")
    lu, _, _, perm = lu_factor(A)
    return _unpack(lu, perm, dtype)


@lowering("aten::lu_unpack.default")
def lu_unpack(
    cx: LoweringContext,
    LU_data: ir.Value,
    LU_pivots: ir.Value,
    unpack_data: bool = True,
    unpack_pivots: bool = True,
) -> list[ir.Value]:
    require_static(cx, LU_data, LU_pivots)
    dtype = require_float(cx, LU_data)
    if not (unpack_data and unpack_pivots):
        raise cx.unsupported("lu_unpack returns empty tensors unless it unpacks everything")
    m = static_shape_of(LU_data)[-2]
    lu, pivots = LU_data, LU_pivots
    batch = broadcast_batch(static_shape_of(lu)[:-2], static_shape_of(pivots)[:-1])
    lu = broadcast_to(lu, [*batch, *static_shape_of(lu)[-2:]])
    pivots = broadcast_to(pivots, [*batch, static_shape_of(pivots)[-1]])
    return _unpack(lu, permutation_from_pivots(pivots, m), dtype)


@lowering("aten::linalg_lu_solve.default")
def linalg_lu_solve(
    cx: LoweringContext,
    LU: ir.Value,
    pivots: ir.Value,
    B: ir.Value,
    left: bool = True,
    adjoint: bool = False,
) -> ir.Value:
    require_static(cx, LU, pivots, B)
    dtype = require_float(cx, LU)
    n = static_shape_of(LU)[-1]
    if not left:  # X A = B  <=>  Aᴴ Xᴴ = Bᴴ
        return swap_last_axes(linalg_lu_solve(cx, LU, pivots, swap_last_axes(B), True, not adjoint))
    batch = broadcast_batch(
        static_shape_of(LU)[:-2], static_shape_of(pivots)[:-1], static_shape_of(B)[:-2]
    )
    lu = broadcast_to(LU, [*batch, n, n])
    b = broadcast_to(B, [*batch, *static_shape_of(B)[-2:]])
    perm = permutation_from_pivots(broadcast_to(pivots, [*batch, n]), n)
    if not adjoint:
        return lu_solve(lu, perm, b)
    # A = P L U  =>  Aᵀ X = B  <=>  Uᵀ Lᵀ (Pᵀ X) = B
    lut = swap_last_axes(lu)
    z = triangular_solve(lut, b, upper=False, unit=False)
    y = triangular_solve(lut, z, upper=True, unit=True)
    return matrix_product(permutation_matrix(perm, dtype), y)


@lowering("aten::_linalg_solve_ex.default", "aten::linalg_solve.default")
def linalg_solve(
    cx: LoweringContext,
    A: ir.Value,
    B: ir.Value,
    left: bool = True,
    check_errors: bool = False,
) -> ir.Value | list[ir.Value]:
    require_static(cx, A, B)
    require_float(cx, A)
    require_square(cx, A)
    vector = _vector_case(A, B)
    b = unsqueeze(B, [rank_of(B)]) if vector else B
    x = _solve_general(cx, A, b, left)
    if vector:
        x = squeeze(x, [rank_of(x) - 1])
    if not isinstance(cx.out, (list, tuple)):
        return x
    lu, pivots, info, _ = lu_factor(A)
    return [x, lu, pivots, info]


@lowering("aten::linalg_inv_ex.default", "aten::linalg_inv.default")
def linalg_inv(
    cx: LoweringContext, A: ir.Value, check_errors: bool = False
) -> ir.Value | list[ir.Value]:
    require_static(cx, A)
    dtype = require_float(cx, A)
    require_square(cx, A)
    shape = static_shape_of(A)
    lu, _, info, perm = lu_factor(A)
    inverse = lu_solve(lu, perm, broadcast_to(eye(shape[-1], shape[-1], dtype), shape))
    return [inverse, info] if isinstance(cx.out, (list, tuple)) else inverse


@lowering("aten::linalg_tensorinv.default")
def linalg_tensorinv(cx: LoweringContext, self: ir.Value, ind: int = 2) -> ir.Value:
    require_static(cx, self)
    shape = static_shape_of(self)
    rows = int(np.prod(shape[:ind]))
    square = cai.reshape(self, i32([rows, -1]))
    if static_shape_of(square) != [rows, rows]:
        raise cx.unsupported(f"tensorinv needs prod(shape[:ind]) == prod(shape[ind:]), got {shape}")
    inverse = linalg_inv(cx, square)
    return cai.reshape(inverse, i32([*shape[ind:], *shape[:ind]]))


@lowering("aten::_linalg_det.default")
def linalg_det(cx: LoweringContext, A: ir.Value) -> list[ir.Value]:
    require_static(cx, A)
    dtype = require_float(cx, A)
    require_square(cx, A)
    lu, pivots, _, _ = lu_factor(A)
    product = cai.reduce_product(diagonal_column(lu), i32([-2]))
    det = cai.broadcasting_mul(product, cast(swap_parity(pivots), dtype))
    return [squeeze_matrix(det), lu, pivots]


@lowering("aten::_linalg_slogdet.default")
def linalg_slogdet(cx: LoweringContext, A: ir.Value) -> list[ir.Value]:
    require_static(cx, A)
    dtype = require_float(cx, A)
    require_square(cx, A)
    lu, pivots, _, _ = lu_factor(A)
    diag = diagonal_column(lu)
    sign = cai.reduce_product(sign_values(diag), i32([-2]))
    sign = cai.broadcasting_mul(sign, cast(swap_parity(pivots), dtype))
    logabs = cai.reduce_sum(cai.log(cai.abs_(diag)), i32([-2]))
    return [squeeze_matrix(sign), squeeze_matrix(logabs), lu, pivots]
