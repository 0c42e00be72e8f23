"""Matrix products, factorizations and solvers, run on the Core AI runtime against PyTorch.

Each test batches related checks into one program (one conversion).  The OpInfo sweep covers
the same ops over PyTorch's own samples; these pin down the variants (upper/lower, left/right,
batched, singular) in the fast suite.
"""

from __future__ import annotations

import torch

from tests.lowerings.support import check_fn


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
    singular = torch.tensor([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [1.0, 0.0, 1.0]])

    def fn(a: torch.Tensor, b: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, ...]:
        p, lower, upper = torch.linalg.lu(a)
        lu, pivots = torch.linalg.lu_factor(a)
        sign, logabs = torch.linalg.slogdet(s)
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
            torch.linalg.det(s),
            sign,
            logabs,
        )

    check_fn(fn, torch.randn(2, 4, 4), torch.randn(2, 4, 2), singular, atol=1e-3, rtol=1e-3)


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
