"""Triangular solves on the Core AI runtime vs eager PyTorch: ``linalg.solve_triangular``
(upper/lower, left/right, unit diagonal) and ``triangular_solve`` (transposed), batched and
broadcast against the right-hand sides."""

from __future__ import annotations

import torch

from tests.lowerings.support import check_fn
from tests.lowerings.values import spd


def test_triangular_solves() -> None:
    def fn(a: torch.Tensor, b: torch.Tensor, single: torch.Tensor) -> tuple[torch.Tensor, ...]:
        lower, upper = a.tril(), a.triu()
        return (
            torch.linalg.solve_triangular(lower, b, upper=False),
            torch.linalg.solve_triangular(upper, b.mT, upper=True, left=False, unitriangular=True),
            torch.linalg.solve_triangular(single.triu(), b, upper=True),  # broadcast batch
            torch.triangular_solve(b, upper, upper=True, transpose=True)[0],
            torch.triangular_solve(b, lower, upper=False, unitriangular=True)[0],
        )

    check_fn(fn, spd(2), torch.randn(2, 4, 3), spd(), atol=1e-3, rtol=1e-3)
