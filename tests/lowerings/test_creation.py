"""Creation ops on the runtime vs eager PyTorch: full/zeros/ones/empty and their *_like and
new_* forms, fill, arange (all overloads), linspace/logspace, eye, scalar_tensor."""

from __future__ import annotations

import pytest
import torch

from tests.lowerings.support import check_fn, fast_first


@pytest.mark.parametrize("dtype", fast_first(torch.float32, torch.int64, torch.bool, torch.float16))
def test_full_zeros_ones(dtype: torch.dtype) -> None:
    def f(x):
        return (
            torch.full((2, 3), 3, dtype=dtype),
            torch.full_like(x, 7),
            torch.zeros(4, dtype=dtype),
            torch.ones(2, 1, 3, dtype=dtype),
            torch.zeros_like(x),
            torch.ones_like(x),
            x.new_full((2,), 5),
            x.new_zeros((1, 2)),
            x.new_ones(()),
            torch.empty_like(x).fill_(1),
            torch.empty(2, 2, dtype=dtype).zero_(),
            x.clone().fill_(2),
            x.clone().fill_(x[0, 0]),
            torch.scalar_tensor(3, dtype=dtype),
            torch.full((), -1, dtype=dtype) if dtype != torch.bool else torch.full((), True),
        )

    x = (torch.randn(2, 3) * 5).to(dtype)
    check_fn(f, x)


def test_special_fill_values() -> None:
    def f(x):
        return (
            torch.full((2,), float("-inf")),
            torch.full((2,), float("nan")),
            torch.full((2,), 65504.0, dtype=torch.float16),
            torch.full((2,), 2**40, dtype=torch.int64),
            x + torch.full((3,), 0.1, dtype=torch.bfloat16).float(),
        )

    check_fn(f, torch.randn(3))


def test_arange_linspace_eye() -> None:
    def f(x):
        return (
            torch.arange(5),
            torch.arange(2, 9),
            torch.arange(1, 10, 3),
            torch.arange(10, 0, -3),
            torch.arange(0, 1, 0.1),
            torch.arange(-1.5, 2.5, 0.5, dtype=torch.float16),
            torch.arange(5, dtype=torch.float32) + x,
            torch.linspace(0, 1, 7),
            torch.linspace(-3, 3, 5, dtype=torch.float64),
            torch.logspace(0, 2, 4),
            torch.eye(3),
            torch.eye(2, 4, dtype=torch.int64),
            torch.tril(torch.ones(3, 3)),
            torch.triu(x.expand(5, 5), 1),
        )

    check_fn(f, torch.randn(5))
