"""Triangular solves: ``linalg_solve_triangular`` and ``triangular_solve`` (LAPACK's unblocked
``trsm``, unrolled over the static matrix size; only the triangle of the coefficients is
read)."""

from __future__ import annotations

from coreai_torch._mlir import ir
from coreai_torch.ir.values import (
    swap_last_axes,
)
from coreai_torch.lowerings.helpers.matrices import (
    broadcast_pair,
    require_float,
    require_static,
    triangular_solve,
)
from coreai_torch.lowerings.registry import LoweringContext, lowering


def _triangular(a: ir.Value, b: ir.Value, *, upper: bool, left: bool, unit: bool) -> ir.Value:
    a, b = broadcast_pair(a, b)
    if left:
        return triangular_solve(a, b, upper=upper, unit=unit)
    return swap_last_axes(
        triangular_solve(swap_last_axes(a), swap_last_axes(b), upper=not upper, unit=unit)
    )


@lowering("aten::linalg_solve_triangular.default")
def linalg_solve_triangular(
    cx: LoweringContext,
    self: ir.Value,
    B: ir.Value,
    upper: bool,
    left: bool = True,
    unitriangular: bool = False,
) -> ir.Value:
    require_static(cx, self, B)
    require_float(cx, self)
    return _triangular(self, B, upper=upper, left=left, unit=unitriangular)


@lowering("aten::triangular_solve.default")
def triangular_solve_op(
    cx: LoweringContext,
    self: ir.Value,
    A: ir.Value,
    upper: bool = True,
    transpose: bool = False,
    unitriangular: bool = False,
) -> list[ir.Value]:
    require_static(cx, self, A)
    require_float(cx, self)
    coeff, b = broadcast_pair(A, self)
    if transpose:
        x = triangular_solve(swap_last_axes(coeff), b, upper=not upper, unit=unitriangular)
    else:
        x = triangular_solve(coeff, b, upper=upper, unit=unitriangular)
    return [x, coeff]
