"""LU factorizations and what is built on them on the Core AI runtime vs eager PyTorch:
``linalg.lu`` / ``lu_factor`` / ``lu_solve`` (adjoint), ``linalg.solve`` (vector and left=False
cases), inverses and determinants."""

from __future__ import annotations

import torch

from tests.lowerings.support import check_fn


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


def test_unpack_tensorinv_and_non_square_factors() -> None:
    def fn(a: torch.Tensor, wide: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        lu, pivots = torch.linalg.lu_factor(a)
        return (
            *torch.lu_unpack(lu, pivots),
            *torch.linalg.lu(wide),
            *torch.linalg.lu(wide.mT),
            torch.linalg.tensorinv(t, ind=2),
            torch.linalg.inv_ex(a)[1],
        )

    args = (torch.randn(3, 4, 4), torch.randn(3, 5), torch.randn(2, 3, 6))
    check_fn(fn, *args, atol=1e-3, rtol=1e-3)
