"""The Airy function Ai on the Core AI runtime vs eager PyTorch: each region of ATen's
evaluation, its boundaries, ±inf and NaN, int inputs and float64."""

from __future__ import annotations

import torch

from tests.lowerings.support import check_fn
from tests.lowerings.values import INF, NAN


def test_airy_ai() -> None:
    """Every region of ATen's evaluation (oscillating below -2.09, the series between, the
    decaying form above 2.09, 0 above 103.892, NaN at ±inf), int inputs, float64."""
    x = torch.linspace(-30, 30, 241)
    edges = torch.tensor([-2.09, 2.09, -2.0899, 2.0899, 0.0, 8.32, 8.33, 26.0, 27.0, 103.0])
    edges = torch.cat([edges, torch.tensor([104.0, INF, -INF, NAN, -1e4])])
    A = torch.special.airy_ai
    check_fn(
        lambda x, e, i: (A(x), A(e), A(i), A(x.double())),
        x,
        edges,
        torch.arange(-5, 6),
        atol=1e-5,
        rtol=1e-4,
    )
