"""``linalg.ldl_factor(_ex)`` and ``ldl_solve`` (Bunch-Kaufman) on the Core AI runtime vs eager
PyTorch: 1x1 and 2x2 pivots, singular matrices, batches and 1x1 matrices."""

from __future__ import annotations

import pytest
import torch

from tests.lowerings.support import check_fn


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
