"""histogram / histogramdd on the Core AI runtime vs eager PyTorch: bin counts from the data's
range, given ranges, bin tensors, weights, density, 0-d inputs and float64."""

from __future__ import annotations

import torch

from tests.lowerings.support import check_fn
from tests.lowerings.values import floats


def test_histogram() -> None:
    """Bin counts from the data's range (edges rounded like ATen's linspace: integer data on
    the edges of 20 and 40 bins), a given range, bin tensors, weights, density, a 0-d input,
    histogramdd with counts, ranges and tensors per dimension, float64."""
    H, HDD = torch.histogram, torch.histogramdd

    def f(x, k, b, w, c, d):
        return (
            H(x, 4), H(k, 20), H(k, 40), H(k, 7, range=(1.0, 3.0)), H(x, b),
            H(x, b, weight=w, density=True), H(x, 5, weight=w), H(x, 3, density=True),
            H(c, 3), H(c, 2, weight=c, density=True),
            HDD(x.reshape(-1, 2), [2, 3]), HDD(k.reshape(-1, 3), [4, 2, 5]),
            HDD(x.reshape(-1, 2), [b, b], weight=w[:6], density=True),
            HDD(x.reshape(-1, 3), [2, 1, 3], range=[-1.0, 1.0, 0.0, 0.0, -2.0, 2.0]),
            H(d, 6), H(d, 3, range=(-1.0, 1.0), density=True),
        )  # fmt: skip

    x = floats(12)
    k = torch.randint(0, 5, (45,)).float()
    b = torch.tensor([-1.0, 0.0, 0.5, 2.0])
    check_fn(f, x, k, b, torch.rand(12), torch.tensor(1.5), floats(10).double())
