"""Matrix products, factorizations and solvers, run on the Core AI runtime against PyTorch.

Each test batches related checks into one program (one conversion).  The OpInfo sweep covers
the same ops over PyTorch's own samples; these pin down the variants (upper/lower, left/right,
batched, singular) in the fast suite.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tests.lowerings.support import check_fn, runtime_outputs


def _spd(*batch: int, n: int = 4) -> torch.Tensor:
    x = torch.randn(*batch, n, n)
    return x @ x.mT + n * torch.eye(n)


def test_products() -> None:
    check_fn(
        lambda s, m, v, b1, b2, x1, x2, w, bias: (
            torch.addmv(s, m, v, beta=0.5, alpha=2.0),
            torch.addbmm(m, b1, b2, beta=0.0),
            torch.nn.functional.bilinear(x1, x2, w, bias),
        ),
        torch.randn(3),
        torch.randn(3, 4),
        torch.randn(4),
        torch.randn(2, 3, 5),
        torch.randn(2, 5, 4),
        torch.randn(2, 3),
        torch.randn(2, 5),
        torch.randn(4, 3, 5),
        torch.randn(4),
    )


def test_cholesky_and_triangular_solves() -> None:
    def fn(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        lower = torch.linalg.cholesky(a)
        upper, info = torch.linalg.cholesky_ex(a, upper=True)
        return (
            lower,
            upper,
            info,
            torch.cholesky_solve(b, lower),
            torch.cholesky_inverse(upper, upper=True),
            torch.linalg.solve_triangular(lower, b, upper=False),
            torch.linalg.solve_triangular(upper, b.mT, upper=True, left=False, unitriangular=True),
            torch.triangular_solve(b, upper, upper=True, transpose=True)[0],
        )

    check_fn(fn, _spd(2), torch.randn(2, 4, 3), atol=1e-3, rtol=1e-3)


def test_lu_solve_inverse_determinants() -> None:
    def fn(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        p, lower, upper = torch.linalg.lu(a)
        lu, pivots = torch.linalg.lu_factor(a)
        sign, logabs = torch.linalg.slogdet(a)
        return (
            p,
            lower,
            upper,
            pivots,
            torch.linalg.lu_solve(lu, pivots, b),
            torch.linalg.lu_solve(lu, pivots, b, adjoint=True),
            torch.linalg.solve(a, b),
            torch.linalg.solve(a, b[..., 0]),
            torch.linalg.solve(a, b.mT, left=False),
            torch.linalg.inv(a),
            torch.linalg.det(a),
            sign,
            logabs,
        )

    check_fn(fn, torch.randn(2, 4, 4), torch.randn(2, 4, 2), atol=1e-3, rtol=1e-3)


def _singular_determinants(det: Any, sign: Any, logabs: Any) -> None:
    """What is defined for an exactly singular matrix in float32: |det| at rounding level,
    log|det| very negative (or -inf), and sign * exp(log|det|) == det."""
    det, sign, logabs = (np.asarray(v, dtype=np.float64) for v in (det, sign, logabs))
    assert (np.abs(det) < 1e-5).all(), det
    assert (logabs < -10).all(), logabs  # -inf where the pivot is exactly 0
    assert np.isin(np.abs(sign), (0.0, 1.0)).all(), sign
    np.testing.assert_allclose(sign * np.exp(logabs), det, rtol=0, atol=1e-6)


def test_determinants_of_singular_matrices() -> None:
    """LAPACK's answer for an exactly singular matrix depends on the processor (the rounding
    of its kernels): eager PyTorch gives det 0 and sign 0 on some x86 machines, det 3.6e-7 and
    sign 1 on others (MKL's AVX2 kernels).  Both the runtime and eager are held to what is
    defined rather than to each other."""
    singular = torch.tensor(
        [
            [[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [1.0, 0.0, 1.0]],  # rows 1 and 2 proportional
            [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]],  # rank 2, no zero pivot
        ]
    )

    def fn(s: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (torch.linalg.det(s), *torch.linalg.slogdet(s))

    _singular_determinants(*fn(singular))
    _singular_determinants(*runtime_outputs(fn, singular))


def test_qr_eigenvalues_singular_values() -> None:
    def fn(a: torch.Tensor, wide: torch.Tensor, sym: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, r = torch.linalg.qr(a)
        qc, rc = torch.linalg.qr(wide, mode="complete")
        return (
            q,
            r,
            qc,
            rc,
            torch.linalg.eigvalsh(sym),
            torch.linalg.svdvals(a),
            torch.linalg.svdvals(wide),
            torch.linalg.pinv(a),
            torch.linalg.matrix_rank(a),
        )

    check_fn(fn, torch.randn(2, 5, 3), torch.randn(3, 5), _spd(n=5), atol=1e-3, rtol=1e-3)


def _matrix_exp_cases() -> list[torch.Tensor]:
    """One matrix per Taylor degree ATen picks by the 1-norm (1, 2, 4, 8, 12, then 18 with 0,
    1 and several squarings), a skew-symmetric one with a large norm (bounded result)."""
    torch.manual_seed(0)
    base = torch.randn(4, 4)
    base = base / torch.linalg.matrix_norm(base, 1)
    cases = [base * norm for norm in (1e-8, 3e-4, 0.03, 0.4, 1.2, 2.5, 5.0, 40.0)]
    skew = torch.randn(4, 4)
    return [*cases, (skew - skew.T) * 5]


def test_matrix_exp() -> None:
    """Single matrices (degree chosen by norm), batches (always degree 18 with per-matrix
    squarings), 1x1 matrices, NaN and float64."""
    cases = _matrix_exp_cases()
    batch = torch.stack([cases[0], cases[3], cases[6], cases[7]]).reshape(2, 2, 4, 4)
    nan = torch.randn(2, 3, 3)
    nan[1, 0, 0] = float("nan")
    E = torch.linalg.matrix_exp

    def fn(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        *singles, batch, ones, nan, double = args
        return (*(E(a) for a in singles), E(batch), E(ones), E(nan), E(double))

    args = [*cases, batch, torch.randn(3, 1, 1), nan, cases[5].double()]
    check_fn(fn, *args, atol=1e-4, rtol=1e-4)


def test_matrix_exp_low_precision() -> None:
    """float16 computes in float32 and rounds once (PyTorch's CPU kernel overflows in
    float16, so compare with float32 rounded)."""
    from coreai_torch.runtime import run_program
    from tests.lowerings.support import convert_fn

    a = torch.randn(2, 3, 3) * 0.5
    program = convert_fn(torch.linalg.matrix_exp, a.half())
    (got,) = run_program(program, {"args_0": a.half().numpy()}).values()
    expected = torch.linalg.matrix_exp(a.half().float()).half()
    torch.testing.assert_close(torch.from_numpy(got), expected, atol=2e-3, rtol=2e-3)


def test_linear_cross_entropy_chunked() -> None:
    """``F.linear_cross_entropy`` with ``options`` exports PyTorch's chunked custom ops: mean,
    sum and per-sample losses, bias, class weights, ignore_index, an unbatched input."""
    import torch.nn.functional as F
    from torch.nn import LinearCrossEntropyOptions

    options = LinearCrossEntropyOptions(batch_chunk_size=3, allow_retain_graph=True)

    def loss(*args: torch.Tensor, **kwargs: object) -> torch.Tensor:
        return F.linear_cross_entropy(*args, options=options, **kwargs)  # type: ignore[arg-type]

    def fn(x, w, t, b, cw, x1, t1):
        return (
            loss(x, w, t),
            loss(x, w, t, linear_bias=b, weight=cw, reduction="none", ignore_index=1),
            loss(x, w, t, linear_bias=b, weight=cw, ignore_index=2),
            loss(x, w, t, reduction="sum", weight=cw),
            loss(x1, w, t1),
        )

    args = (torch.randn(8, 3), torch.randn(5, 3), torch.randint(0, 5, (8,)), torch.randn(5))
    check_fn(fn, *args, torch.rand(5), torch.randn(3), torch.tensor(2), atol=1e-5, rtol=1e-5)


def _symmetric(*shape: int, zeros: float = 0.0) -> torch.Tensor:
    """Random symmetric matrices; ``zeros`` of the entries dropped (singular / 2x2 pivots)."""
    m = torch.randn(*shape)
    m = m * (torch.rand(*shape) >= zeros)
    return m + m.mT


def _ldl(*mats: torch.Tensor) -> tuple[torch.Tensor, ...]:
    outs = []
    for m in mats:
        ld, pivots, info = torch.linalg.ldl_factor_ex(m)
        rhs = (torch.arange(m.shape[-1] * 2.0).reshape(-1, 2) % 3) - 1
        outs += [ld, pivots, info, torch.linalg.ldl_solve(ld, pivots, rhs)]
    outs += list(torch.linalg.ldl_factor(mats[-1]))  # raises on singular matrices
    return tuple(outs)


def test_ldl_factor_and_solve() -> None:
    """Bunch-Kaufman pivots (1x1 and 2x2, with and without interchanges) equal LAPACK's,
    singular matrices give the same info and the same inf/NaN in the solution (the reference
    BLAS skips zero columns), batches, 1x1 matrices."""
    torch.manual_seed(0)
    integers = torch.randint(-2, 3, (24, 4, 4)).float()
    mats = (
        _symmetric(24, 5, 5, zeros=0.6),
        _symmetric(24, 3, 3, zeros=0.8),
        integers + integers.mT,
        _symmetric(3, 1, 1),
        _symmetric(12, 7, 7),
    )
    check_fn(_ldl, *mats, atol=1e-3, rtol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("n", [16, 32])
def test_ldl_factor_large(n: int) -> None:
    torch.manual_seed(n)
    check_fn(_ldl, _symmetric(4, n, n, zeros=0.5), _symmetric(4, n, n), atol=1e-3, rtol=1e-3)
