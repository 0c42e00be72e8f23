"""Padding ops on the runtime vs eager PyTorch: constant (incl. negative pads), reflect,
replicate and circular, 1-D to 3-D."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.lowerings.support import check_fn, fast_first


@pytest.mark.parametrize("dtype", fast_first(torch.float32, torch.int64, torch.bool, torch.float16))
def test_constant_pad(dtype: torch.dtype) -> None:
    value = True if dtype == torch.bool else 3

    def f(x):
        return (
            F.pad(x, (1, 2)),
            F.pad(x, (1, 0, 0, 2), value=value),
            F.pad(x, (0, 0, 0, 0, 1, 1)),
            F.pad(x, (-1, 2, 1, -1)),  # negative pads crop
            F.pad(x, (-1, -1)),
            F.pad(x[0, 0], (2, 2)),
        )

    x = (torch.randn(2, 3, 4) * 5).to(dtype)
    check_fn(f, x)


def test_mode_pads() -> None:
    def f(x3, x4, x5):
        outs = []
        for mode in ("reflect", "replicate", "circular"):
            outs += [
                F.pad(x3, (2, 1), mode=mode),
                F.pad(x4, (1, 2, 2, 0), mode=mode),
                F.pad(x5, (1, 1, 0, 2, 1, 0), mode=mode),
                F.pad(x4[0], (1, 1, 1, 1), mode=mode),  # unbatched
            ]
            if mode != "circular":  # negative amounts crop after padding
                outs.append(F.pad(x4, (-1, 2, 1, -2), mode=mode))
        return outs

    check_fn(f, torch.randn(1, 2, 5), torch.randn(1, 2, 4, 5), torch.randn(1, 2, 3, 4, 5))
