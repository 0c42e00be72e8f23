"""Symmetric eigendecomposition, SVD and pseudo-inverse: ``_linalg_eigh``, ``_linalg_svd`` and
``linalg_pinv``, by cyclic Jacobi rotations (one ``coreai.while`` over a fixed number of
sweeps; eigenvalues ascending, singular values descending, like PyTorch)."""

from __future__ import annotations

from collections.abc import Callable

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
from coreai_torch.lowerings.helpers.layout import slice_axis
from coreai_torch.lowerings.helpers.matrices import (
    diagonal_column,
    eye,
    masked,
    matrix_product,
    require_float,
    require_square,
    require_static,
    row_indices,
)
from coreai_torch.lowerings.registry import LoweringContext, lowering

#: Jacobi sweeps: convergence is quadratic, so this is ample for float32 at these sizes.
JACOBI_SWEEPS = 10


def _jacobi_angle(app: ir.Value, aqq: ir.Value, apq: ir.Value) -> tuple[ir.Value, ir.Value]:
    """``c, s`` of the rotation that zeroes ``apq`` of ``[[app, apq], [apq, aqq]]``."""
    dtype = dtype_of(app)
    zero, one, two = constant(0.0, dtype), constant(1.0, dtype), constant(2.0, dtype)
    done = cai.broadcasting_equal(apq, zero)
    safe = cai.broadcasting_where(done, one, apq)
    theta = cai.broadcasting_divide(cai.broadcasting_sub(aqq, app), cai.broadcasting_mul(two, safe))
    root = cai.sqrt(cai.broadcasting_add(cai.broadcasting_mul(theta, theta), one))
    t = cai.broadcasting_divide(one, cai.broadcasting_add(cai.abs_(theta), root))
    negative = cai.broadcasting_greater(zero, theta)
    t = cai.broadcasting_where(negative, cai.broadcasting_sub(zero, t), t)
    t = cai.broadcasting_where(done, zero, t)
    c = cai.broadcasting_divide(
        one, cai.sqrt(cai.broadcasting_add(cai.broadcasting_mul(t, t), one))
    )
    return c, cai.broadcasting_mul(t, c)


def _jacobi_loop(
    n: int, state: list[ir.Value], rotate: Callable[..., list[ir.Value]]
) -> list[ir.Value]:
    """Run ``rotate(e_p, e_q, state) -> state`` over JACOBI_SWEEPS cyclic sweeps of the index
    pairs (p < q) in one Core AI loop; ``e_p``/``e_q`` are one-hot (n, 1) columns."""
    pairs = [(p, q) for p in range(n - 1) for q in range(p + 1, n)]
    if not pairs:
        return state
    dtype = dtype_of(state[0])
    firsts = constant(np.array([p for p, _ in pairs], np.int32).reshape(-1, 1), torch.int32)
    seconds = constant(np.array([q for _, q in pairs], np.int32).reshape(-1, 1), torch.int32)
    iota = constant(row_indices(n), torch.int32)
    total = cai.constant(np.int32(JACOBI_SWEEPS * len(pairs)))
    step0 = cai.constant(np.int32(0))
    loop, (before, after) = cai.while_([step0.type, *(v.type for v in state)], [step0, *state])
    with before:
        cai.condition(cai.greater(total, before.arguments[0]), *before.arguments)
    with after:
        step, *values = after.arguments
        row = cai.reshape(cai.modulo(step, cai.constant(np.int32(len(pairs)))), i32([1]))
        p = cai.gather_nd(firsts, unsqueeze(row, [0]))  # (1, 1)
        q = cai.gather_nd(seconds, unsqueeze(row, [0]))
        e_p = cast(cai.broadcasting_equal(iota, p), dtype)
        e_q = cast(cai.broadcasting_equal(iota, q), dtype)
        # The runtime returns zeros from the second iteration on when a matmul result is
        # yielded as-is (its buffer aliases the loop-carried input); pass it through an add.
        values = [cai.broadcasting_add(v, constant(0.0, dtype)) for v in rotate(e_p, e_q, values)]
        cai.yield_([cai.add(step, cai.constant(np.int32(1))), *values])
    results = list(loop.results) if hasattr(loop, "results") else list(loop)
    return results[1:]


def _rotation(e_p: ir.Value, e_q: ir.Value, c: ir.Value, s: ir.Value) -> ir.Value:
    """``J`` (..., n, n): the identity with ``[[c, s], [-s, c]]`` in rows/columns p, q."""
    n = static_shape_of(e_p)[-2]
    dtype = dtype_of(c)
    one = constant(1.0, dtype)
    diag = cai.broadcasting_add(
        matrix_product(e_p, swap_last_axes(e_p)), matrix_product(e_q, swap_last_axes(e_q))
    )
    anti = cai.broadcasting_sub(
        matrix_product(e_p, swap_last_axes(e_q)), matrix_product(e_q, swap_last_axes(e_p))
    )
    j = cai.broadcasting_add(
        cai.broadcasting_mul(cai.broadcasting_sub(c, one), diag), cai.broadcasting_mul(s, anti)
    )
    return cai.broadcasting_add(j, eye(n, n, dtype))


def _quadratic(e_a: ir.Value, m: ir.Value, e_b: ir.Value) -> ir.Value:
    """``e_aᵀ M e_b`` as (..., 1, 1)."""
    return matrix_product(matrix_product(swap_last_axes(e_a), m), e_b)


def jacobi_eigh(a: ir.Value) -> tuple[ir.Value, ir.Value]:
    """Eigenvalues (ascending, (..., n)) and eigenvectors (columns) of symmetric ``a``."""
    shape = static_shape_of(a)
    n, batch = shape[-1], shape[:-2]
    dtype = dtype_of(a)

    def rotate(e_p: ir.Value, e_q: ir.Value, state: list[ir.Value]) -> list[ir.Value]:
        m, v = state
        c, s = _jacobi_angle(
            _quadratic(e_p, m, e_p), _quadratic(e_q, m, e_q), _quadratic(e_p, m, e_q)
        )
        j = _rotation(e_p, e_q, c, s)
        return [matrix_product(swap_last_axes(j), matrix_product(m, j)), matrix_product(v, j)]

    a, v = _jacobi_loop(n, [a, broadcast_to(eye(n, n, dtype), shape)], rotate)
    values = squeeze(diagonal_column(a), [len(batch) + 1])  # (..., n)
    order = cai.argsort(values, i32(-1), False, True)
    values = cai.gather_along_axis(values, order, i32(-1))
    index = broadcast_to(unsqueeze(order, [len(batch)]), shape)
    return values, cai.gather_along_axis(v, index, i32(-1))


def jacobi_svd(a: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value]:
    """One-sided Jacobi SVD of (..., m, n): ``U`` (..., m, k), ``S`` (..., k) descending,
    ``V`` (..., n, k) with ``A = U diag(S) Vᵀ``."""
    shape = static_shape_of(a)
    m, n = shape[-2:]
    if m < n:
        v, s, u = jacobi_svd(swap_last_axes(a))
        return u, s, v
    batch = shape[:-2]
    dtype = dtype_of(a)

    def rotate(e_p: ir.Value, e_q: ir.Value, state: list[ir.Value]) -> list[ir.Value]:
        u, v = state
        up, uq = matrix_product(u, e_p), matrix_product(u, e_q)
        c, s = _jacobi_angle(
            matrix_product(swap_last_axes(up), up),
            matrix_product(swap_last_axes(uq), uq),
            matrix_product(swap_last_axes(up), uq),
        )
        j = _rotation(e_p, e_q, c, s)
        return [matrix_product(u, j), matrix_product(v, j)]

    u, v = _jacobi_loop(n, [a, broadcast_to(eye(n, n, dtype), [*batch, n, n])], rotate)
    norms = cai.sqrt(cai.reduce_sum(cai.broadcasting_mul(u, u), i32([-2])))  # (..., 1, n)
    values = squeeze(norms, [len(batch)])
    order = cai.argsort(values, i32(-1), True, True)
    values = cai.gather_along_axis(values, order, i32(-1))
    columns = unsqueeze(order, [len(batch)])
    zero = constant(0.0, dtype)
    inverse = cai.broadcasting_divide(constant(1.0, dtype), norms)
    scale = cai.broadcasting_where(cai.broadcasting_equal(norms, zero), zero, inverse)
    u = cai.broadcasting_mul(u, scale)
    u = cai.gather_along_axis(u, broadcast_to(columns, [*batch, m, n]), i32(-1))
    v = cai.gather_along_axis(v, broadcast_to(columns, [*batch, n, n]), i32(-1))
    return u, values, v


def _symmetric(a: ir.Value, uplo: str) -> ir.Value:
    """The symmetric matrix PyTorch reads from the ``uplo`` triangle of ``a``."""
    n = static_shape_of(a)[-1]
    lower = np.tril(np.ones((n, n), bool), -1)
    strict = masked(lower, a) if uplo.upper() == "L" else masked(lower, swap_last_axes(a))
    return cai.broadcasting_add(
        cai.broadcasting_add(strict, swap_last_axes(strict)), masked(np.eye(n, dtype=bool), a)
    )


@lowering("aten::_linalg_eigh.default")
def linalg_eigh(
    cx: LoweringContext, A: ir.Value, UPLO: str = "L", compute_v: bool = True
) -> list[ir.Value | None]:
    require_static(cx, A)
    require_float(cx, A)
    require_square(cx, A)
    values, vectors = jacobi_eigh(_symmetric(A, UPLO))
    return [values, vectors if compute_v else None]


@lowering("aten::_linalg_svd.default")
def linalg_svd(
    cx: LoweringContext,
    A: ir.Value,
    full_matrices: bool = False,
    compute_uv: bool = True,
    driver: str | None = None,
) -> list[ir.Value | None]:
    require_static(cx, A)
    require_float(cx, A)
    m, n = static_shape_of(A)[-2:]
    if compute_uv and full_matrices and m != n:
        raise cx.unsupported("full_matrices=True for non-square matrices")
    u, s, v = jacobi_svd(A)
    if not compute_uv:
        return [None, s, None]
    return [u, s, swap_last_axes(v)]


def _tolerance(
    cx: LoweringContext,
    reference: ir.Value,
    atol: ir.Value | float | None,
    rtol: ir.Value | float | None,
    size: int,
) -> ir.Value:
    """``max(atol, rtol * reference)`` with PyTorch's defaults (``get_atol_rtol``)."""
    dtype = dtype_of(reference)
    eps = float(torch.finfo(dtype).eps) * size
    zero = constant(0.0, dtype)
    atol_v = (
        zero
        if atol is None
        else cast(
            unsqueeze(atol, [rank_of(atol)])
            if isinstance(atol, ir.Value)
            else constant(atol, dtype),
            dtype,
        )
    )
    if rtol is not None:
        rtol_v = cast(
            unsqueeze(rtol, [rank_of(rtol)])
            if isinstance(rtol, ir.Value)
            else constant(rtol, dtype),
            dtype,
        )
    elif atol is None:
        rtol_v = constant(eps, dtype)
    else:
        rtol_v = cai.broadcasting_where(
            cai.broadcasting_greater(atol_v, zero), zero, constant(eps, dtype)
        )
    return cai.broadcasting_maximum(atol_v, cai.broadcasting_mul(rtol_v, reference))


@lowering("aten::linalg_pinv.atol_rtol_tensor", "aten::linalg_pinv.atol_rtol_float")
def linalg_pinv(
    cx: LoweringContext,
    self: ir.Value,
    atol: ir.Value | float | None = None,
    rtol: ir.Value | float | None = None,
    hermitian: bool = False,
) -> ir.Value:
    require_static(cx, self)
    dtype = require_float(cx, self)
    m, n = static_shape_of(self)[-2:]
    rank = rank_of(self)
    zero = constant(0.0, dtype)
    if hermitian:
        values, vectors = jacobi_eigh(_symmetric(self, "L"))
        magnitude = cai.abs_(values)
        largest = cai.reduce_max(magnitude, i32([-1]))
        tol = _tolerance(cx, largest, atol, rtol, max(m, n))
        inverse = cai.broadcasting_where(
            cai.broadcasting_greater(magnitude, tol),
            cai.broadcasting_divide(constant(1.0, dtype), values),
            zero,
        )
        left, right = vectors, swap_last_axes(vectors)
    else:
        u, values, v = jacobi_svd(self)
        largest = slice_axis(values, -1, 0, 1)
        tol = _tolerance(cx, largest, atol, rtol, max(m, n))
        inverse = cai.broadcasting_where(
            cai.broadcasting_greater(values, tol),
            cai.broadcasting_divide(constant(1.0, dtype), values),
            zero,
        )
        left, right = v, swap_last_axes(u)
    scaled = cai.broadcasting_mul(left, unsqueeze(inverse, [rank - 2]))
    return matrix_product(scaled, right)
