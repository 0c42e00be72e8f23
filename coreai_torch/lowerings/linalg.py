"""Matrix products (mm, bmm, addmm, baddbmm, addmv, addbmm, matmul, linear, bilinear) and
matrix factorizations and solvers (Cholesky, LU, triangular and general solves, inverses,
determinants).

Core AI has no linear-algebra kernels, so the factorizations are unrolled over the (static)
matrix size: one step per column or row, each step vectorised over the batch and the remaining
rows.  The algorithms are LAPACK's unblocked ones (``potf2``, ``getf2`` with partial pivoting,
``trsm``), so pivots, signs and the factors themselves match PyTorch's.  Core AI programs cannot
raise errors: a singular or non-positive-definite input gives the ``info`` PyTorch's ``_ex``
variants report, and inf/NaN in the results where PyTorch would raise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import (
    INT32_MAX,
    broadcast_to,
    cast,
    constant,
    dtype_of,
    i32,
    rank_of,
    shape_of,
    squeeze,
    swap_last_axes,
    transpose,
    unsqueeze,
)
from coreai_torch.lowerings.accumulation import accumulating, accumulation_dtype
from coreai_torch.lowerings.registry import LoweringContext, lowering


def matmul_values(cx: LoweringContext, a: ir.Value, b: ir.Value) -> ir.Value:
    """``torch.matmul`` semantics (vector promotion, batch broadcasting); 16-bit operands
    accumulate in float32 (:mod:`coreai_torch.lowerings.accumulation`)."""
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
    shape = shape_of(value)
    return None if any(not isinstance(d, int) or d < 0 for d in shape) else tuple(shape[:-2])


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


def _scaled(x: ir.Value, factor: float, dtype: torch.dtype) -> ir.Value:
    return x if factor == 1 else cai.broadcasting_mul(x, constant(factor, dtype))


@lowering("aten::mm.default", "aten::bmm.default", "aten::matmul.default")
def mm(
    cx: LoweringContext, self: ir.Value, mat2: ir.Value | None = None, other: ir.Value | None = None
) -> ir.Value:
    dtype = cx.out_dtype
    b = mat2 if mat2 is not None else other
    return matmul_values(cx, cast(self, dtype), cast(b, dtype))


@lowering("aten::addmm.default", "aten::baddbmm.default")
def addmm(
    cx: LoweringContext,
    self: ir.Value,
    mat1: ir.Value | None = None,
    mat2: ir.Value | None = None,
    batch1: ir.Value | None = None,
    batch2: ir.Value | None = None,
    beta: float = 1,
    alpha: float = 1,
) -> ir.Value:
    a = mat1 if mat1 is not None else batch1
    b = mat2 if mat2 is not None else batch2
    return _accumulate(
        cx, self, lambda dtype: batched_matmul(cast(a, dtype), cast(b, dtype)), beta, alpha
    )


def _accumulate(
    cx: LoweringContext,
    self: ir.Value,
    product: Callable[[torch.dtype], ir.Value],
    beta: float,
    alpha: float,
) -> ir.Value:
    """``beta * self + alpha * product(dtype)``, computed in float32 for 16-bit results
    (rounded once, like ATen); ``self`` is ignored when ``beta`` is 0 (so NaN in it does not
    propagate), as in PyTorch."""
    dtype = cx.out_dtype
    compute = accumulation_dtype(cx, dtype)
    product = _scaled(product(compute), alpha, compute)
    if beta == 0:
        return cast(broadcast_to(product, cx.out_shape), dtype)
    return cast(cai.broadcasting_add(product, _scaled(cast(self, compute), beta, compute)), dtype)


@lowering("aten::addmv.default")
def addmv(
    cx: LoweringContext,
    self: ir.Value,
    mat: ir.Value,
    vec: ir.Value,
    beta: float = 1,
    alpha: float = 1,
) -> ir.Value:
    return _accumulate(
        cx, self, lambda dtype: batched_matmul(cast(mat, dtype), cast(vec, dtype)), beta, alpha
    )


@lowering("aten::addbmm.default")
def addbmm(
    cx: LoweringContext,
    self: ir.Value,
    batch1: ir.Value,
    batch2: ir.Value,
    beta: float = 1,
    alpha: float = 1,
) -> ir.Value:
    def product(dtype: torch.dtype) -> ir.Value:
        products = cai.batch_matmul(cast(batch1, dtype), cast(batch2, dtype))
        return squeeze(cai.reduce_sum(products, i32([0])), [0])

    return _accumulate(cx, self, product, beta, alpha)


@lowering("aten::_trilinear.default")
def trilinear(
    cx: LoweringContext,
    i1: ir.Value,
    i2: ir.Value,
    i3: ir.Value,
    expand1: list[int],
    expand2: list[int],
    expand3: list[int],
    sumdim: list[int],
    unroll_dim: int = 1,
) -> ir.Value:
    """``sum(i1' * i2' * i3', sumdim)`` with each input unsqueezed at its ``expand`` dims
    (``unroll_dim`` only chooses how PyTorch loops)."""
    dtype = cx.out_dtype
    product = None
    for value, expand in ((i1, expand1), (i2, expand2), (i3, expand3)):
        term = unsqueeze(cast(value, dtype), sorted(expand))
        product = term if product is None else cai.broadcasting_mul(product, term)
    assert product is not None
    if not sumdim:
        return product
    return squeeze(cai.reduce_sum(product, i32(sorted(sumdim))), sorted(sumdim))


@lowering("aten::linear.default")
def linear(
    cx: LoweringContext, input: ir.Value, weight: ir.Value, bias: ir.Value | None = None
) -> ir.Value:
    out = matmul_values(cx, input, transpose(weight, [1, 0]) if rank_of(weight) == 2 else weight)
    return out if bias is None else cai.broadcasting_add(out, bias)


# ---------------------------------------------------------------------------- helpers ----


def _slice(x: ir.Value, axis: int, start: int, end: int) -> ir.Value:
    shape = shape_of(x)
    rank = len(shape)
    axis %= rank
    starts = [0] * rank
    ends = [INT32_MAX] * rank
    starts[axis], ends[axis] = start, end
    return cai.slice_(x, i32(starts), i32(ends), i32([1] * rank))


def _rows(x: ir.Value, start: int, end: int) -> ir.Value:
    return _slice(x, -2, start, end)


def _cols(x: ir.Value, start: int, end: int) -> ir.Value:
    return _slice(x, -1, start, end)


def _elem(x: ir.Value, i: int, j: int) -> ir.Value:
    return _cols(_rows(x, i, i + 1), j, j + 1)


def _mm(a: ir.Value, b: ir.Value) -> ir.Value:
    return cai.broadcasting_batch_matmul(a, b)


def _cat(axis: int, parts: Sequence[ir.Value]) -> ir.Value:
    parts = list(parts)
    return parts[0] if len(parts) == 1 else cai.concat(axis, parts)


def _where(mask: np.ndarray, x: ir.Value, other: float = 0.0) -> ir.Value:
    """``x`` where the static ``mask`` is true, else ``other`` (NaN-safe, unlike a product)."""
    dtype = _dtype(x)
    return cai.broadcasting_where(constant(mask, torch.bool), x, constant(other, dtype))


def _dtype(x: ir.Value) -> torch.dtype:
    return dtype_of(x)


def _batch(*shapes: Sequence[int | None]) -> list[int]:
    return list(torch.broadcast_shapes(*(tuple(s) for s in shapes)))


def _static(cx: LoweringContext, *values: ir.Value) -> None:
    for v in values:
        if None in shape_of(v):
            raise cx.unsupported("matrix factorizations need static shapes")


def _float(cx: LoweringContext, x: ir.Value) -> torch.dtype:
    dtype = _dtype(x)
    if dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        raise cx.unsupported(f"{dtype} matrices are not supported (floating point only)")
    return dtype


def _eye(rows: int, cols: int, dtype: torch.dtype) -> ir.Value:
    return constant(np.eye(rows, cols), dtype)


def _iota(m: int) -> np.ndarray:
    return np.arange(m, dtype=np.int32).reshape(m, 1)


def _first_set(info: ir.Value, bad: ir.Value, step: int) -> ir.Value:
    """``info`` (int32, 0 = fine) becomes ``step`` where ``bad`` and it is still 0."""
    unset = cai.broadcasting_equal(info, constant(0, torch.int32))
    hit = cai.broadcasting_and(unset, bad)
    return cai.broadcasting_where(hit, constant(step, torch.int32), info)


def _info_zeros(batch: Sequence[int]) -> ir.Value:
    return constant(np.zeros([*batch, 1, 1], np.int32), torch.int32)


def _squeeze_mat(x: ir.Value) -> ir.Value:
    rank = rank_of(x)
    return squeeze(x, [rank - 2, rank - 1])


# ----------------------------------------------------------------------------- kernels ----


def cholesky_lower(a: ir.Value) -> tuple[ir.Value, ir.Value]:
    """``L`` with ``A = L Lᵀ`` from the lower triangle of ``a``, and LAPACK's ``info``."""
    shape = shape_of(a)
    n, dtype = shape[-1], _dtype(a)
    cols: list[ir.Value] = []
    info = _info_zeros(shape[:-2])
    for j in range(n):
        v = _cols(a, j, j + 1)
        if j:
            prev = _cat(-1, cols)
            v = cai.broadcasting_sub(v, _mm(prev, swap_last_axes(_rows(prev, j, j + 1))))
        d = _rows(v, j, j + 1)
        bad = cai.not_(cai.broadcasting_greater(d, constant(0.0, dtype)))
        info = _first_set(info, bad, j + 1)
        cols.append(_where(_iota(n) >= j, cai.broadcasting_divide(v, cai.sqrt(d))))
    return _cat(-1, cols), _squeeze_mat(info)


def triangular_solve(a: ir.Value, b: ir.Value, *, upper: bool, unit: bool) -> ir.Value:
    """``X`` with ``A X = B``, reading only the triangle of ``a`` (same batch shapes)."""
    n = shape_of(a)[-1]
    rows: dict[int, ir.Value] = {}
    for i in range(n - 1, -1, -1) if upper else range(n):
        r = _rows(b, i, i + 1)
        lo, hi = (i + 1, n) if upper else (0, i)
        if hi > lo:
            coeff = _cols(_rows(a, i, i + 1), lo, hi)
            done = _cat(-2, [rows[j] for j in range(lo, hi)])
            r = cai.broadcasting_sub(r, _mm(coeff, done))
        if not unit:
            r = cai.broadcasting_divide(r, _elem(a, i, i))
        rows[i] = r
    return _cat(-2, [rows[i] for i in range(n)])


def _swap_rows(iota: ir.Value, m: int, s: int, p: ir.Value) -> ir.Value:
    """Row indices (..., m, 1) that exchange row ``s`` with the runtime row ``p`` (..., 1, 1)."""
    offset = cai.broadcasting_mul(
        constant((_iota(m) == s).astype(np.int32), torch.int32),
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
    shape = shape_of(a)
    m, n = shape[-2:]
    batch = shape[:-2]
    dtype = _dtype(a)
    iota = constant(_iota(m), torch.int32)
    perm = broadcast_to(iota, [*batch, m, 1])
    info = _info_zeros(batch)
    pivots = []
    w = a
    for s in range(min(m, n)):
        column = cai.abs_(_cols(w, s, s + 1))
        score = _where(_iota(m) >= s, column, -1.0)
        p = cast(cai.argmax(score, i32(-2)), torch.int32)  # (..., 1, 1)
        swap = _swap_rows(iota, m, s, p)
        w = cai.gather_along_axis(w, broadcast_to(swap, [*batch, m, n]), i32(-2))
        perm = cai.gather_along_axis(perm, swap, i32(-2))
        pivots.append(cai.broadcasting_add(p, constant(1, torch.int32)))
        pivot = _elem(w, s, s)
        zero = cai.broadcasting_equal(pivot, constant(0.0, dtype))
        info = _first_set(info, zero, s + 1)
        if s + 1 == m:
            continue
        below = _rows(_cols(w, s, s + 1), s + 1, m)
        below = cai.broadcasting_where(zero, below, cai.broadcasting_divide(below, pivot))
        parts = [_cols(_rows(w, s + 1, m), 0, s)] if s else []
        parts.append(below)
        if s + 1 < n:
            right = _cols(w, s + 1, n)
            trail = cai.broadcasting_sub(_rows(right, s + 1, m), _mm(below, _rows(right, s, s + 1)))
            parts.append(trail)
        w = _cat(-2, [_rows(w, 0, s + 1), _cat(-1, parts)])
    piv = squeeze(_cat(-1, pivots), [len(batch)])  # (..., k)
    return w, piv, _squeeze_mat(info), perm


def permutation_from_pivots(pivots: ir.Value, m: int) -> ir.Value:
    """Row order (..., m, 1) produced by applying LAPACK's 1-based ``pivots`` (..., k)."""
    shape = shape_of(pivots)
    batch, k = shape[:-1], shape[-1]
    iota = constant(_iota(m), torch.int32)
    perm = broadcast_to(iota, [*batch, m, 1])
    piv = cast(pivots, torch.int32)
    for s in range(k):
        p = cai.broadcasting_sub(
            unsqueeze(_slice(piv, -1, s, s + 1), [len(batch) + 1]), constant(1, torch.int32)
        )
        swap = _swap_rows(iota, m, s, p)
        perm = cai.gather_along_axis(perm, swap, i32(-2))
    return perm


def permutation_matrix(perm: ir.Value, dtype: torch.dtype) -> ir.Value:
    """``P`` with ``P[perm[i], i] = 1``, so that ``A = P L U`` when ``A[perm] = L U``."""
    m = shape_of(perm)[-2]
    return cast(
        cai.broadcasting_equal(constant(_iota(m), torch.int32), swap_last_axes(perm)), dtype
    )


def permute_rows(b: ir.Value, perm: ir.Value) -> ir.Value:
    """``b[..., perm, :]`` for a row order ``perm`` (..., m, 1) of the same batch."""
    return cai.gather_along_axis(b, broadcast_to(perm, shape_of(b)), i32(-2))


def lu_solve(lu: ir.Value, perm: ir.Value, b: ir.Value) -> ir.Value:
    """``X`` with ``A X = B`` from ``A[perm] = L U`` (same batch shapes)."""
    y = triangular_solve(lu, permute_rows(b, perm), upper=False, unit=True)
    return triangular_solve(lu, y, upper=True, unit=False)


def diagonal(x: ir.Value) -> ir.Value:
    """The diagonal of square matrices as (..., n, 1)."""
    n = shape_of(x)[-1]
    masked = _where(np.eye(n, dtype=bool), x)
    return cai.reduce_sum(masked, i32([-1]))


def swap_parity(pivots: ir.Value) -> ir.Value:
    """-1/+1 (int32, (..., 1, 1)) for an odd/even number of row swaps."""
    k = shape_of(pivots)[-1]
    steps = constant(np.arange(1, k + 1, dtype=np.int32), torch.int32)
    swapped = cast(cai.broadcasting_not_equal(pivots, steps), torch.int32)
    count = unsqueeze(cai.reduce_sum(swapped, i32([-1])), [rank_of(pivots)])
    odd = cai.broadcasting_modulo(count, constant(2, torch.int32))
    return cai.broadcasting_sub(
        constant(1, torch.int32), cai.broadcasting_mul(odd, constant(2, torch.int32))
    )


def _sign(x: ir.Value) -> ir.Value:
    dtype = _dtype(x)
    zero = constant(0.0, dtype)
    pos = cast(cai.broadcasting_greater(x, zero), dtype)
    neg = cast(cai.broadcasting_greater(zero, x), dtype)
    return cai.broadcasting_sub(pos, neg)


def householder_qr(a: ir.Value) -> tuple[ir.Value, ir.Value]:
    """LAPACK's ``geqrf`` (unblocked ``geqr2`` with ``larfg``'s reflectors) of (..., m, n).

    Returns ``(a, tau)``: ``R`` in the upper triangle, the Householder vectors (with an
    implicit leading 1) below the diagonal, and ``tau`` (..., k).
    """
    shape = shape_of(a)
    m, n = shape[-2:]
    dtype = _dtype(a)
    zero, one = constant(0.0, dtype), constant(1.0, dtype)
    taus = []
    w = a
    for j in range(min(m, n)):
        alpha = _elem(w, j, j)
        if j + 1 == m:  # nothing below the diagonal: H = I
            taus.append(cai.broadcasting_mul(alpha, zero))
            continue
        below = _rows(_cols(w, j, j + 1), j + 1, m)
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
        column = _cat(-2, [diag, v_below])
        parts = [_cols(_rows(w, j, m), 0, j)] if j else []
        parts.append(column)
        if j + 1 < n:
            ones = cai.broadcasting_add(cai.broadcasting_mul(alpha, zero), one)
            v = _cat(-2, [ones, v_below])  # (..., m - j, 1)
            trailing = _cols(_rows(w, j, m), j + 1, n)
            update = _mm(cai.broadcasting_mul(v, tau), _mm(swap_last_axes(v), trailing))
            parts.append(cai.broadcasting_sub(trailing, update))
        w = _cat(-2, [_rows(w, 0, j), _cat(-1, parts)]) if j else _cat(-1, parts)
    tau = squeeze(_cat(-1, taus), [len(shape) - 2])
    return w, tau


def householder_q(reflectors: ir.Value, tau: ir.Value, columns: int) -> ir.Value:
    """``Q = H_0 H_1 ... H_{k-1}`` (LAPACK ``orgqr``), its first ``columns`` columns."""
    shape = shape_of(reflectors)
    m = shape[-2]
    k = shape_of(tau)[-1]
    dtype = _dtype(reflectors)
    batch = shape[:-2]
    q = broadcast_to(_eye(m, columns, dtype), [*batch, m, columns])
    for j in range(k - 1, -1, -1):
        tau_j = unsqueeze(_slice(tau, -1, j, j + 1), [len(batch) + 1])  # (..., 1, 1)
        v = constant(np.ones([*batch, 1, 1]), dtype)
        if j + 1 < m:
            v = _cat(-2, [v, _rows(_cols(reflectors, j, j + 1), j + 1, m)])
        rows = _rows(q, j, m)
        rows = cai.broadcasting_sub(
            rows, _mm(cai.broadcasting_mul(v, tau_j), _mm(swap_last_axes(v), rows))
        )
        q = _cat(-2, [_rows(q, 0, j), rows]) if j else rows
    return q


#: Jacobi sweeps: convergence is quadratic, so this is ample for float32 at these sizes.
JACOBI_SWEEPS = 10


def _jacobi_angle(app: ir.Value, aqq: ir.Value, apq: ir.Value) -> tuple[ir.Value, ir.Value]:
    """``c, s`` of the rotation that zeroes ``apq`` of ``[[app, apq], [apq, aqq]]``."""
    dtype = _dtype(app)
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
    dtype = _dtype(state[0])
    firsts = constant(np.array([p for p, _ in pairs], np.int32).reshape(-1, 1), torch.int32)
    seconds = constant(np.array([q for _, q in pairs], np.int32).reshape(-1, 1), torch.int32)
    iota = constant(_iota(n), torch.int32)
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
    n = shape_of(e_p)[-2]
    dtype = _dtype(c)
    one = constant(1.0, dtype)
    diag = cai.broadcasting_add(_mm(e_p, swap_last_axes(e_p)), _mm(e_q, swap_last_axes(e_q)))
    anti = cai.broadcasting_sub(_mm(e_p, swap_last_axes(e_q)), _mm(e_q, swap_last_axes(e_p)))
    j = cai.broadcasting_add(
        cai.broadcasting_mul(cai.broadcasting_sub(c, one), diag), cai.broadcasting_mul(s, anti)
    )
    return cai.broadcasting_add(j, _eye(n, n, dtype))


def _quadratic(e_a: ir.Value, m: ir.Value, e_b: ir.Value) -> ir.Value:
    """``e_aᵀ M e_b`` as (..., 1, 1)."""
    return _mm(_mm(swap_last_axes(e_a), m), e_b)


def jacobi_eigh(a: ir.Value) -> tuple[ir.Value, ir.Value]:
    """Eigenvalues (ascending, (..., n)) and eigenvectors (columns) of symmetric ``a``."""
    shape = shape_of(a)
    n, batch = shape[-1], shape[:-2]
    dtype = _dtype(a)

    def rotate(e_p: ir.Value, e_q: ir.Value, state: list[ir.Value]) -> list[ir.Value]:
        m, v = state
        c, s = _jacobi_angle(
            _quadratic(e_p, m, e_p), _quadratic(e_q, m, e_q), _quadratic(e_p, m, e_q)
        )
        j = _rotation(e_p, e_q, c, s)
        return [_mm(swap_last_axes(j), _mm(m, j)), _mm(v, j)]

    a, v = _jacobi_loop(n, [a, broadcast_to(_eye(n, n, dtype), shape)], rotate)
    values = squeeze(diagonal(a), [len(batch) + 1])  # (..., n)
    order = cai.argsort(values, i32(-1), False, True)
    values = cai.gather_along_axis(values, order, i32(-1))
    index = broadcast_to(unsqueeze(order, [len(batch)]), shape)
    return values, cai.gather_along_axis(v, index, i32(-1))


def jacobi_svd(a: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value]:
    """One-sided Jacobi SVD of (..., m, n): ``U`` (..., m, k), ``S`` (..., k) descending,
    ``V`` (..., n, k) with ``A = U diag(S) Vᵀ``."""
    shape = shape_of(a)
    m, n = shape[-2:]
    if m < n:
        v, s, u = jacobi_svd(swap_last_axes(a))
        return u, s, v
    batch = shape[:-2]
    dtype = _dtype(a)

    def rotate(e_p: ir.Value, e_q: ir.Value, state: list[ir.Value]) -> list[ir.Value]:
        u, v = state
        up, uq = _mm(u, e_p), _mm(u, e_q)
        c, s = _jacobi_angle(
            _mm(swap_last_axes(up), up), _mm(swap_last_axes(uq), uq), _mm(swap_last_axes(up), uq)
        )
        j = _rotation(e_p, e_q, c, s)
        return [_mm(u, j), _mm(v, j)]

    u, v = _jacobi_loop(n, [a, broadcast_to(_eye(n, n, dtype), [*batch, n, n])], rotate)
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


# --------------------------------------------------------------------------- operands ----


def _square(cx: LoweringContext, a: ir.Value) -> None:
    shape = shape_of(a)
    if len(shape) < 2 or shape[-1] != shape[-2]:
        raise cx.unsupported(f"expected square matrices, got shape {shape}")


def _broadcast_pair(a: ir.Value, b: ir.Value) -> tuple[ir.Value, ir.Value]:
    sa, sb = shape_of(a), shape_of(b)
    batch = _batch(sa[:-2], sb[:-2])
    return broadcast_to(a, [*batch, *sa[-2:]]), broadcast_to(b, [*batch, *sb[-2:]])


def _vector_case(a: ir.Value, b: ir.Value) -> bool:
    sa, sb = shape_of(a), shape_of(b)
    return len(sb) == 1 or (len(sb) == len(sa) - 1 and sb == sa[:-1])


def _solve_general(cx: LoweringContext, a: ir.Value, b: ir.Value, left: bool) -> ir.Value:
    """``linalg.solve``: returns X (and leaves the vector case to the caller)."""
    if not left:
        return swap_last_axes(_solve_general(cx, swap_last_axes(a), swap_last_axes(b), True))
    a, b = _broadcast_pair(a, b)
    lu, _, _, perm = lu_factor(a)
    return lu_solve(lu, perm, b)


# ---------------------------------------------------------------------------- lowerings ----


@lowering("aten::linalg_cholesky_ex.default", "aten::linalg_cholesky.default")
def linalg_cholesky(
    cx: LoweringContext, self: ir.Value, upper: bool = False, check_errors: bool = False
) -> ir.Value | list[ir.Value]:
    _static(cx, self)
    _float(cx, self)
    _square(cx, self)
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
    _static(cx, self, input2)
    _float(cx, self)
    factor, b = _broadcast_pair(input2, self)
    return _cholesky_solve(b, factor, upper)


@lowering("aten::cholesky_inverse.default")
def cholesky_inverse(cx: LoweringContext, self: ir.Value, upper: bool = False) -> ir.Value:
    _static(cx, self)
    dtype = _float(cx, self)
    _square(cx, self)
    shape = shape_of(self)
    eye = broadcast_to(_eye(shape[-1], shape[-1], dtype), shape)
    return _cholesky_solve(eye, self, upper)


def _triangular(a: ir.Value, b: ir.Value, *, upper: bool, left: bool, unit: bool) -> ir.Value:
    a, b = _broadcast_pair(a, b)
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
    _static(cx, self, B)
    _float(cx, self)
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
    _static(cx, self, A)
    _float(cx, self)
    coeff, b = _broadcast_pair(A, self)
    if transpose:
        x = triangular_solve(swap_last_axes(coeff), b, upper=not upper, unit=unitriangular)
    else:
        x = triangular_solve(coeff, b, upper=upper, unit=unitriangular)
    return [x, coeff]


@lowering("aten::linalg_lu_factor_ex.default", "aten::linalg_lu_factor.default")
def linalg_lu_factor(
    cx: LoweringContext, A: ir.Value, pivot: bool = True, check_errors: bool = False
) -> list[ir.Value]:
    _static(cx, A)
    _float(cx, A)
    if not pivot:
        raise cx.unsupported("LU without pivoting is not supported")
    lu, pivots, info, _ = lu_factor(A)
    return [lu, pivots, info] if len(cx.out) == 3 else [lu, pivots]


def _unpack(lu: ir.Value, perm: ir.Value, dtype: torch.dtype) -> list[ir.Value]:
    m, n = shape_of(lu)[-2:]
    k = min(m, n)
    lower = cai.broadcasting_add(
        _where(np.tril(np.ones((m, k), bool), -1), _cols(lu, 0, k)), _eye(m, k, dtype)
    )
    upper = _where(np.triu(np.ones((k, n), bool)), _rows(lu, 0, k))
    return [permutation_matrix(perm, dtype), lower, upper]


@lowering("aten::linalg_lu.default")
def linalg_lu(cx: LoweringContext, A: ir.Value, pivot: bool = True) -> list[ir.Value]:
    _static(cx, A)
    dtype = _float(cx, A)
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
    _static(cx, LU_data, LU_pivots)
    dtype = _float(cx, LU_data)
    if not (unpack_data and unpack_pivots):
        raise cx.unsupported("lu_unpack returns empty tensors unless it unpacks everything")
    m = shape_of(LU_data)[-2]
    lu, pivots = LU_data, LU_pivots
    batch = _batch(shape_of(lu)[:-2], shape_of(pivots)[:-1])
    lu = broadcast_to(lu, [*batch, *shape_of(lu)[-2:]])
    pivots = broadcast_to(pivots, [*batch, shape_of(pivots)[-1]])
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
    _static(cx, LU, pivots, B)
    dtype = _float(cx, LU)
    n = shape_of(LU)[-1]
    if not left:  # X A = B  <=>  Aᴴ Xᴴ = Bᴴ
        return swap_last_axes(linalg_lu_solve(cx, LU, pivots, swap_last_axes(B), True, not adjoint))
    batch = _batch(shape_of(LU)[:-2], shape_of(pivots)[:-1], shape_of(B)[:-2])
    lu = broadcast_to(LU, [*batch, n, n])
    b = broadcast_to(B, [*batch, *shape_of(B)[-2:]])
    perm = permutation_from_pivots(broadcast_to(pivots, [*batch, n]), n)
    if not adjoint:
        return lu_solve(lu, perm, b)
    # A = P L U  =>  Aᵀ X = B  <=>  Uᵀ Lᵀ (Pᵀ X) = B
    lut = swap_last_axes(lu)
    z = triangular_solve(lut, b, upper=False, unit=False)
    y = triangular_solve(lut, z, upper=True, unit=True)
    return _mm(permutation_matrix(perm, dtype), y)


@lowering("aten::_linalg_solve_ex.default", "aten::linalg_solve.default")
def linalg_solve(
    cx: LoweringContext,
    A: ir.Value,
    B: ir.Value,
    left: bool = True,
    check_errors: bool = False,
) -> ir.Value | list[ir.Value]:
    _static(cx, A, B)
    _float(cx, A)
    _square(cx, A)
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
    _static(cx, A)
    dtype = _float(cx, A)
    _square(cx, A)
    shape = shape_of(A)
    lu, _, info, perm = lu_factor(A)
    inverse = lu_solve(lu, perm, broadcast_to(_eye(shape[-1], shape[-1], dtype), shape))
    return [inverse, info] if isinstance(cx.out, (list, tuple)) else inverse


@lowering("aten::linalg_tensorinv.default")
def linalg_tensorinv(cx: LoweringContext, self: ir.Value, ind: int = 2) -> ir.Value:
    _static(cx, self)
    shape = shape_of(self)
    rows = int(np.prod(shape[:ind]))
    square = cai.reshape(self, i32([rows, -1]))
    if shape_of(square) != [rows, rows]:
        raise cx.unsupported(f"tensorinv needs prod(shape[:ind]) == prod(shape[ind:]), got {shape}")
    inverse = linalg_inv(cx, square)
    return cai.reshape(inverse, i32([*shape[ind:], *shape[:ind]]))


@lowering("aten::_linalg_det.default")
def linalg_det(cx: LoweringContext, A: ir.Value) -> list[ir.Value]:
    _static(cx, A)
    dtype = _float(cx, A)
    _square(cx, A)
    lu, pivots, _, _ = lu_factor(A)
    product = cai.reduce_product(diagonal(lu), i32([-2]))
    det = cai.broadcasting_mul(product, cast(swap_parity(pivots), dtype))
    return [_squeeze_mat(det), lu, pivots]


@lowering("aten::_linalg_slogdet.default")
def linalg_slogdet(cx: LoweringContext, A: ir.Value) -> list[ir.Value]:
    _static(cx, A)
    dtype = _float(cx, A)
    _square(cx, A)
    lu, pivots, _, _ = lu_factor(A)
    diag = diagonal(lu)
    sign = cai.reduce_product(_sign(diag), i32([-2]))
    sign = cai.broadcasting_mul(sign, cast(swap_parity(pivots), dtype))
    logabs = cai.reduce_sum(cai.log(cai.abs_(diag)), i32([-2]))
    return [_squeeze_mat(sign), _squeeze_mat(logabs), lu, pivots]


@lowering("aten::geqrf.default")
def geqrf(cx: LoweringContext, self: ir.Value) -> list[ir.Value]:
    _static(cx, self)
    _float(cx, self)
    return list(householder_qr(self))


@lowering("aten::linalg_householder_product.default")
def householder_product(cx: LoweringContext, input: ir.Value, tau: ir.Value) -> ir.Value:
    _static(cx, input, tau)
    _float(cx, input)
    return householder_q(input, tau, shape_of(input)[-1])


@lowering("aten::ormqr.default")
def ormqr(
    cx: LoweringContext,
    self: ir.Value,
    input2: ir.Value,
    input3: ir.Value,
    left: bool = True,
    transpose: bool = False,
) -> ir.Value:
    _static(cx, self, input2, input3)
    _float(cx, self)
    m = shape_of(self)[-2]
    q = householder_q(self, input2, m)
    if transpose:
        q = swap_last_axes(q)
    return _mm(q, input3) if left else _mm(input3, q)


@lowering("aten::linalg_qr.default")
def linalg_qr(cx: LoweringContext, A: ir.Value, mode: str = "reduced") -> list[ir.Value]:
    _static(cx, A)
    _float(cx, A)
    if mode not in ("reduced", "complete"):
        raise cx.unsupported(f"mode={mode!r} (its Q is an empty tensor)")
    m, n = shape_of(A)[-2:]
    k = min(m, n)
    reflectors, tau = householder_qr(A)
    columns = m if mode == "complete" else k
    r_rows = m if mode == "complete" else k
    q = householder_q(reflectors, tau, columns)
    r = _where(np.triu(np.ones((r_rows, n), bool)), _rows(reflectors, 0, r_rows))
    return [q, r]


def _symmetric(a: ir.Value, uplo: str) -> ir.Value:
    """The symmetric matrix PyTorch reads from the ``uplo`` triangle of ``a``."""
    n = shape_of(a)[-1]
    lower = np.tril(np.ones((n, n), bool), -1)
    strict = _where(lower, a) if uplo.upper() == "L" else _where(lower, swap_last_axes(a))
    return cai.broadcasting_add(
        cai.broadcasting_add(strict, swap_last_axes(strict)), _where(np.eye(n, dtype=bool), a)
    )


@lowering("aten::_linalg_eigh.default")
def linalg_eigh(
    cx: LoweringContext, A: ir.Value, UPLO: str = "L", compute_v: bool = True
) -> list[ir.Value | None]:
    _static(cx, A)
    _float(cx, A)
    _square(cx, A)
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
    _static(cx, A)
    _float(cx, A)
    m, n = shape_of(A)[-2:]
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
    dtype = _dtype(reference)
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
    _static(cx, self)
    dtype = _float(cx, self)
    m, n = shape_of(self)[-2:]
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
        largest = _slice(values, -1, 0, 1)
        tol = _tolerance(cx, largest, atol, rtol, max(m, n))
        inverse = cai.broadcasting_where(
            cai.broadcasting_greater(values, tol),
            cai.broadcasting_divide(constant(1.0, dtype), values),
            zero,
        )
        left, right = v, swap_last_axes(u)
    scaled = cai.broadcasting_mul(left, unsqueeze(inverse, [rank - 2]))
    return _mm(scaled, right)
