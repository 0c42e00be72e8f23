"""The regularized incomplete gamma functions (``igamma``, ``igammac``) on the Core AI runtime
vs eager PyTorch: every method ATen picks between, its boundary values, broadcasting, float64
and float16/bfloat16."""

from __future__ import annotations

import pytest
import torch

from tests.lowerings.support import check_fn
from tests.lowerings.values import INF, NAN, check_cases

# (a, x) pairs reaching each of ATen's methods: P's series, Q's series (small x), the
# continued fraction, the asymptotic expansion (20 < a < 200 and a > 200, x close to a),
# and the prefactor's Lanczos branches (|a - x| small, a or x >= 200)
_A = [0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 25.0, 50.0, 150.0, 300.0, 300.0, 1000.0, 0.01, 3.0]
_A += [7.0, 0.3, 1e-3, 40.0, 190.0, 250.0, 0.9, 42.7]
_X = [0.3, 1.05, 2.0, 8.0, 0.7, 24.0, 31.0, 20.0, 160.0, 310.0, 250.0, 1010.0, 5.0, 0.4]
_X += [7.0, 0.8, 2.0, 90.0, 240.0, 210.0, 32.5, 0.16]

#: boundary values: negative, zero, infinite and NaN arguments (a down the rows)
_EDGE_A = [-1.0, 0.0, 0.5, 2.0, INF, NAN, 30.0]
_EDGE_X = [-1.0, 0.0, 0.2, 0.9, 1.05, 3.0, 29.0, INF, NAN]


def _both(a: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.igamma(a, x), torch.igammac(a, x)


def test_incomplete_gamma() -> None:
    pairs = (_both, [torch.tensor(_A), torch.tensor(_X)])
    grid = (_both, [torch.tensor(_EDGE_A)[:, None], torch.tensor(_EDGE_X)])
    # broadcasting, a 0-d operand, float64
    shapes = (
        lambda a, x, s, d: (*_both(a, x), *_both(s, x), *_both(d, d * 1.5)),
        [torch.rand(3, 1, 4) * 6, torch.rand(5, 4) * 6, torch.tensor(2.5), torch.rand(4).double()],
    )
    check_cases([pairs, grid, shapes], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_incomplete_gamma_low_precision(dtype: torch.dtype) -> None:
    """Computed in float32 and rounded once, like ATen."""
    a, x = (torch.rand(4, 5) * 8).to(dtype), (torch.rand(4, 5) * 8).to(dtype)
    tol = 4e-3 if dtype == torch.float16 else 3e-2
    check_fn(_both, a, x, atol=tol, rtol=tol)


@pytest.mark.slow
def test_incomplete_gamma_wide_range() -> None:
    """Log-uniform arguments over 1e-3 .. 1e3, plus a band around a ≈ x."""
    torch.manual_seed(0)
    a = torch.exp(torch.rand(3000) * 14 - 7)
    x = torch.exp(torch.rand(3000) * 14 - 7)
    near = torch.exp(torch.rand(1000) * 7)
    a = torch.cat([a, near])
    x = torch.cat([x, near * (1 + (torch.rand(1000) - 0.5) * 0.8)])
    check_fn(_both, a, x, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_incomplete_gamma_slow_convergence() -> None:
    """a <= 20 with x close to a: the series needs many terms (no asymptotic expansion)."""
    a = torch.tensor([19.9, 20.0, 15.0, 12.0, 8.0, 1.1])
    x = a * torch.tensor([0.99, 1.01, 0.7, 1.3, 1.0, 1.05])
    check_fn(_both, a, x, atol=1e-5, rtol=1e-4)
