"""QR: ``geqrf``, ``linalg_householder_product`` (``orgqr``), ``ormqr`` and ``linalg_qr``, as
LAPACK's unblocked Householder algorithms (``geqr2`` with ``larfg``'s reflectors), unrolled
over the (static) matrix size."""

from __future__ import annotations

import numpy as np

from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import (
    broadcast_to,
    constant,
    dtype_of,
    i32,
    squeeze,
    static_shape_of,
    swap_last_axes,
    unsqueeze,
)
from coreai_torch.lowerings.helpers.layout import slice_axis
from coreai_torch.lowerings.helpers.matrices import (
    column_slice,
    concat,
    element,
    eye,
    masked,
    matrix_product,
    require_float,
    require_static,
    row_slice,
)
from coreai_torch.lowerings.registry import LoweringContext, lowering


def householder_qr(a: ir.Value) -> tuple[ir.Value, ir.Value]:
    """LAPACK's ``geqrf`` (unblocked ``geqr2`` with ``larfg``'s reflectors) of (..., m, n).

    Returns ``(a, tau)``: ``R`` in the upper triangle, the Householder vectors (with an
    implicit leading 1) below the diagonal, and ``tau`` (..., k).
    """
    shape = static_shape_of(a)
    m, n = shape[-2:]
    dtype = dtype_of(a)
    zero, one = constant(0.0, dtype), constant(1.0, dtype)
    taus = []
    w = a
    for j in range(min(m, n)):
        alpha = element(w, j, j)
        if j + 1 == m:  # nothing below the diagonal: H = I
            taus.append(cai.broadcasting_mul(alpha, zero))
            continue
        below = row_slice(column_slice(w, j, j + 1), j + 1, m)
        xnorm2 = cai.reduce_sum(cai.broadcasting_mul(below, below), i32([-2]))
        flat = cai.broadcasting_equal(xnorm2, zero)
        norm = cai.sqrt(cai.broadcasting_add(cai.broadcasting_mul(alpha, alpha), xnorm2))
        negative = cai.broadcasting_greater(zero, alpha)
        beta = cai.broadcasting_where(negative, norm, cai.broadcasting_sub(zero, norm))
        tau = cai.broadcasting_divide(cai.broadcasting_sub(beta, alpha), beta)
        tau = cai.broadcasting_where(flat, zero, tau)
        scale = cai.broadcasting_divide(one, cai.broadcasting_sub(alpha, beta))
        v_below = cai.broadcasting_mul(below, cai.broadcasting_where(flat, zero, scale))
        diag = cai.broadcasting_where(flat, alpha, beta)
        taus.append(tau)
        column = concat(-2, [diag, v_below])
        parts = [column_slice(row_slice(w, j, m), 0, j)] if j else []
        parts.append(column)
        if j + 1 < n:
            ones = cai.broadcasting_add(cai.broadcasting_mul(alpha, zero), one)
            v = concat(-2, [ones, v_below])  # (..., m - j, 1)
            trailing = column_slice(row_slice(w, j, m), j + 1, n)
            update = matrix_product(
                cai.broadcasting_mul(v, tau), matrix_product(swap_last_axes(v), trailing)
            )
            parts.append(cai.broadcasting_sub(trailing, update))
        w = concat(-2, [row_slice(w, 0, j), concat(-1, parts)]) if j else concat(-1, parts)
    tau = squeeze(concat(-1, taus), [len(shape) - 2])
    return w, tau


def householder_q(reflectors: ir.Value, tau: ir.Value, columns: int) -> ir.Value:
    """``Q = H_0 H_1 ... H_{k-1}`` (LAPACK ``orgqr``), its first ``columns`` columns."""
    shape = static_shape_of(reflectors)
    m = shape[-2]
    k = static_shape_of(tau)[-1]
    dtype = dtype_of(reflectors)
    batch = shape[:-2]
    q = broadcast_to(eye(m, columns, dtype), [*batch, m, columns])
    for j in range(k - 1, -1, -1):
        tau_j = unsqueeze(slice_axis(tau, -1, j, j + 1), [len(batch) + 1])  # (..., 1, 1)
        v = constant(np.ones([*batch, 1, 1]), dtype)
        if j + 1 < m:
            v = concat(-2, [v, row_slice(column_slice(reflectors, j, j + 1), j + 1, m)])
        rows = row_slice(q, j, m)
        rows = cai.broadcasting_sub(
            rows,
            matrix_product(cai.broadcasting_mul(v, tau_j), matrix_product(swap_last_axes(v), rows)),
        )
        q = concat(-2, [row_slice(q, 0, j), rows]) if j else rows
    return q


@lowering("aten::geqrf.default")
def geqrf(cx: LoweringContext, self: ir.Value) -> list[ir.Value]:
    require_static(cx, self)
    require_float(cx, self)
    return list(householder_qr(self))


@lowering("aten::linalg_householder_product.default")
def householder_product(cx: LoweringContext, input: ir.Value, tau: ir.Value) -> ir.Value:
    require_static(cx, input, tau)
    require_float(cx, input)
    return householder_q(input, tau, static_shape_of(input)[-1])


@lowering("aten::ormqr.default")
def ormqr(
    cx: LoweringContext,
    self: ir.Value,
    input2: ir.Value,
    input3: ir.Value,
    left: bool = True,
    transpose: bool = False,
) -> ir.Value:
    require_static(cx, self, input2, input3)
    require_float(cx, self)
    m = static_shape_of(self)[-2]
    q = householder_q(self, input2, m)
    if transpose:
        q = swap_last_axes(q)
    return matrix_product(q, input3) if left else matrix_product(input3, q)


@lowering("aten::linalg_qr.default")
def linalg_qr(cx: LoweringContext, A: ir.Value, mode: str = "reduced") -> list[ir.Value]:
    require_static(cx, A)
    require_float(cx, A)
    if mode not in ("reduced", "complete"):
        raise cx.unsupported(f"mode={mode!r} (its Q is an empty tensor)")
    m, n = static_shape_of(A)[-2:]
    k = min(m, n)
    reflectors, tau = householder_qr(A)
    columns = m if mode == "complete" else k
    r_rows = m if mode == "complete" else k
    q = householder_q(reflectors, tau, columns)
    r = masked(np.triu(np.ones((r_rows, n), bool)), row_slice(reflectors, 0, r_rows))
    return [q, r]
