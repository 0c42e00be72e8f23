"""Cholesky factorization and its solves: ``linalg_cholesky(_ex)``, ``cholesky``,
``cholesky_solve`` and ``cholesky_inverse``.

The factorization is LAPACK's unblocked ``potf2``, unrolled over the (static) matrix size one
column at a time (:mod:`coreai_torch.lowerings.helpers.matrices`); a non-positive-definite
input gives the ``info`` PyTorch's ``_ex`` variant reports, and inf/NaN in the factor where
PyTorch would raise.
"""

from __future__ import annotations

from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import (
    broadcast_to,
    constant,
    dtype_of,
    static_shape_of,
    swap_last_axes,
)
from coreai_torch.lowerings.helpers.matrices import (
    broadcast_pair,
    column_slice,
    concat,
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


def cholesky_lower(a: ir.Value) -> tuple[ir.Value, ir.Value]:
    """``L`` with ``A = L Lᵀ`` from the lower triangle of ``a``, and LAPACK's ``info``."""
    shape = static_shape_of(a)
    n, dtype = shape[-1], dtype_of(a)
    cols: list[ir.Value] = []
    info = info_zeros(shape[:-2])
    for j in range(n):
        v = column_slice(a, j, j + 1)
        if j:
            prev = concat(-1, cols)
            v = cai.broadcasting_sub(
                v, matrix_product(prev, swap_last_axes(row_slice(prev, j, j + 1)))
            )
        d = row_slice(v, j, j + 1)
        bad = cai.not_(cai.broadcasting_greater(d, constant(0.0, dtype)))
        info = first_set(info, bad, j + 1)
        cols.append(masked(row_indices(n) >= j, cai.broadcasting_divide(v, cai.sqrt(d))))
    return concat(-1, cols), squeeze_matrix(info)


@lowering("aten::linalg_cholesky_ex.default", "aten::linalg_cholesky.default")
def linalg_cholesky(
    cx: LoweringContext, self: ir.Value, upper: bool = False, check_errors: bool = False
) -> ir.Value | list[ir.Value]:
    require_static(cx, self)
    require_float(cx, self)
    require_square(cx, self)
    if upper:
        factor, info = cholesky_lower(swap_last_axes(self))
        factor = swap_last_axes(factor)
    else:
        factor, info = cholesky_lower(self)
    if isinstance(cx.out, (list, tuple)):
        return [factor, info]
    return factor


@lowering("aten::cholesky.default")
def cholesky(cx: LoweringContext, self: ir.Value, upper: bool = False) -> ir.Value:
    return linalg_cholesky(cx, self, upper)


def _cholesky_solve(b: ir.Value, factor: ir.Value, upper: bool) -> ir.Value:
    lower = swap_last_axes(factor) if upper else factor
    y = triangular_solve(lower, b, upper=False, unit=False)
    return triangular_solve(swap_last_axes(lower), y, upper=True, unit=False)


@lowering("aten::cholesky_solve.default")
def cholesky_solve(
    cx: LoweringContext, self: ir.Value, input2: ir.Value, upper: bool = False
) -> ir.Value:
    require_static(cx, self, input2)
    require_float(cx, self)
    factor, b = broadcast_pair(input2, self)
    return _cholesky_solve(b, factor, upper)


@lowering("aten::cholesky_inverse.default")
def cholesky_inverse(cx: LoweringContext, self: ir.Value, upper: bool = False) -> ir.Value:
    require_static(cx, self)
    dtype = require_float(cx, self)
    require_square(cx, self)
    shape = static_shape_of(self)
    identity = broadcast_to(eye(shape[-1], shape[-1], dtype), shape)
    return _cholesky_solve(identity, self, upper)
