"""The orthogonal polynomials of ``torch.special`` on the Core AI runtime vs eager PyTorch:
tensor degrees (the recurrence loop), scalar degrees (unrolled, or looped when large), scalar
``x``, ATen's special cases (``|x| == 1``, ``x == 0``, negative / fractional / NaN / huge
degrees, Hermite's degree limit), the closed forms for large degrees, int and float64 inputs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.lowerings.support import check_fn
from tests.lowerings.values import INF, NAN, Case, check_cases, grouped

S = torch.special

NAMES = [
    "chebyshev_polynomial_t",
    "chebyshev_polynomial_u",
    "chebyshev_polynomial_v",
    "chebyshev_polynomial_w",
    "shifted_chebyshev_polynomial_t",
    "shifted_chebyshev_polynomial_u",
    "shifted_chebyshev_polynomial_v",
    "shifted_chebyshev_polynomial_w",
    "hermite_polynomial_h",
    "hermite_polynomial_he",
    "laguerre_polynomial_l",
    "legendre_polynomial_p",
]

#: x: both sides of ±1 and 0 (the shifted forms' special points), tiny, large, ±inf
_X = [1.0, -1.0, 0.0, 1e-30, 0.5, -0.5, 0.999, -0.9, 0.3, 1.2, -1.7, 2.0, 4.0, 9.0, INF, -INF]
#: n: every small degree (both sides of the closed-form thresholds), fractional, negative,
#: NaN, ±inf, beyond int64, and degrees past Hermite's limit of 128
_N = [float(k) for k in range(-2, 13)] + [2.7, -0.5, 31.0, 130.0, NAN, INF, -INF, 1e20]


def _case(name: str) -> Case:
    """One polynomial: a grid of x and n, scalar degrees (unrolled, looped), scalar x."""
    fn = getattr(S, name)
    x = torch.tensor(_X)[:, None] * torch.ones(1, len(_N))
    n = torch.tensor(_N)[None, :] * torch.ones(len(_X), 1)
    inner = torch.rand(4, 3) * 1.98 - 0.99

    def f(x: torch.Tensor, n: torch.Tensor, inner: torch.Tensor) -> tuple[Any, ...]:
        return (
            fn(x, n),
            fn(inner, 3),  # unrolled
            fn(inner, 40),  # scalar degree past the unroll limit: a fixed loop
            fn(inner, -1),
            fn(0.25, n),
            fn(inner.double()[..., None], n[0, 4:12]),
        )

    return f, [x, n, inner]


@pytest.mark.parametrize("names", grouped(NAMES, 4))
def test_polynomials(names: list[str]) -> None:
    check_cases([_case(n) for n in names], atol=1e-4, rtol=1e-4)


def test_polynomials_int_inputs() -> None:
    """Int and bool operands compute in float32, like PyTorch."""
    x = torch.randint(-3, 4, (3, 4))
    n = torch.randint(-1, 8, (4,), dtype=torch.int32)
    fns = [getattr(S, name) for name in NAMES]
    check_fn(lambda x, n, b: tuple(f(x, n) for f in fns) + (fns[0](b, b),), x, n, x > 0)


@pytest.mark.slow
def test_polynomials_large_degrees() -> None:
    """Degrees in the thousands: closed forms inside (-1, 1); outside, the recurrence
    overflows and turns NaN, which ends the loop early (like ATen)."""
    x = torch.tensor([1.0001, -1.0001, 3.0, 0.999, -0.999, 0.3, -INF])
    n = torch.tensor([1e6, 1e6, 1e5, 1000.0, 1001.0, 77.0, 5.0])
    fns = [getattr(S, name) for name in NAMES if not name.startswith(("laguerre", "legendre"))]
    check_fn(lambda x, n: tuple(f(x, n) for f in fns), x, n, atol=1e-4, rtol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_polynomial_random(name: str) -> None:
    fn = getattr(S, name)
    x = torch.randn(5, 6) * 2
    n = torch.randint(0, 20, (5, 6)).float()
    check_fn(fn, x, n, atol=1e-4, rtol=1e-3)
