"""Cholesky factorizations and solves on the Core AI runtime vs eager PyTorch: lower and upper
factors, ``info`` of non-positive-definite inputs, ``cholesky_solve`` and ``cholesky_inverse``,
batches."""

from __future__ import annotations

import pytest
import torch

from tests.lowerings.support import check_fn
from tests.lowerings.values import spd


@pytest.mark.parametrize("batch", [(2,), (), (2, 3)], ids=["batch", "single", "batch-2d"])
def test_cholesky(batch: tuple[int, ...]) -> None:
    def fn(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        lower = torch.linalg.cholesky(a)
        upper, info = torch.linalg.cholesky_ex(a, upper=True)
        return (
            lower,
            upper,
            info,
            torch.cholesky_solve(b, lower),
            torch.cholesky_solve(b, upper, upper=True),
            torch.cholesky_inverse(upper, upper=True),
            torch.cholesky_inverse(lower),
        )

    check_fn(fn, spd(*batch), torch.randn(*batch, 4, 3), atol=1e-3, rtol=1e-3)


def test_info_of_matrices_that_are_not_positive_definite() -> None:
    """``info`` is the order of the first leading minor that is not positive definite."""
    a = spd(3)
    a[1, 2, 2] = -100.0
    a[2] = -a[2]
    check_fn(lambda a: torch.linalg.cholesky_ex(a)[1], a)
