"""Sorting and selection on the Core AI runtime vs eager PyTorch: sort/argsort (stable,
descending, NaN as the largest value), topk, kthvalue, median/nanmedian, mode, histc,
bucketize and searchsorted."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.lowerings.support import check_fn
from tests.lowerings.values import NAN, Case, bools, check_cases, grouped, ints


def _distinct(*shape: int) -> torch.Tensor:
    """Values without ties (sort indices are then unique)."""
    n = 1
    for s in shape:
        n *= s
    return (torch.randperm(n).float() - n / 2).reshape(shape)


SORTING: dict[str, Callable[..., Any]] = {
    "sort": lambda x, t, i, b: (x.sort(1), t.sort(-1), i.sort(0), b.sort(1)),
    "sort_descending": lambda x, t, i, b: (
        x.sort(0, descending=True),
        t.sort(1, descending=True),
        i.sort(-1, descending=True),
        b.sort(0, descending=True),
    ),
    "sort_stable": lambda x, t, i, b: (
        torch.sort(t, dim=1, stable=True),
        torch.sort(i, stable=True),
    ),
    "argsort": lambda x, t, i, b: (x.argsort(1), t.argsort(-1, descending=True), i.argsort(0)),
    "msort": lambda x, t, i, b: (torch.msort(x), torch.msort(i)),
    "topk": lambda x, t, i, b: (x.topk(2, 1), x.topk(3, 0, largest=False), x.topk(1)),
    "kthvalue": lambda x, t, i, b: (torch.kthvalue(x, 2, 1), torch.kthvalue(x, 1, 0, True)),
    "median": lambda x, t, i, b: (x.median(), x.median(1), i.median(-1), i.median()),
    "nanmedian": lambda x, t, i, b: (torch.nanmedian(x), torch.nanmedian(x, 1, keepdim=True)),
}


@pytest.mark.parametrize("names", grouped(list(SORTING), 3))
def test_sorting(names: list[str]) -> None:
    def case(name: str) -> Case:
        ties = torch.randint(0, 3, (4, 6)).float()
        return SORTING[name], [_distinct(3, 5, 4), ties, ints(3, 5, 4), bools(3, 6)]

    check_cases([case(n) for n in names])


def test_sorting_with_nans() -> None:
    """NaN sorts as the largest value: last ascending, first descending; median is NaN."""
    x = torch.tensor(
        [[1.0, NAN, 3.0, -1.0, NAN, 0.0], [2.0, 1.0, -float("inf"), float("inf"), 0.5, NAN]]
    )

    def f(x):
        return (
            x.sort(1),
            x.sort(1, descending=True),
            x.topk(2, 1, largest=False),
            x.median(1),
            torch.nanmedian(x, 1),
            torch.kthvalue(x, 2, 1),
        )

    check_fn(f, x)


def test_bucketize_and_searchsorted() -> None:
    boundaries = torch.tensor([-1.0, 0.0, 0.5, 2.0])
    rows = torch.tensor([[-1.0, 0.0, 1.0], [0.0, 2.0, 4.0]])

    def f(x, i, v, q):
        return (
            torch.bucketize(x, boundaries),
            torch.bucketize(x, boundaries, right=True),
            torch.bucketize(i, boundaries, out_int32=True),
            torch.searchsorted(boundaries, x),
            torch.searchsorted(boundaries, x, side="right"),
            torch.searchsorted(rows, v),
            torch.searchsorted(rows, q, right=True),
        )

    x = torch.tensor([[-2.0, -1.0, 0.0, 0.25], [0.5, 1.0, 2.0, NAN]])
    v = torch.tensor([[-5.0, 0.0, 0.5], [1.0, 3.0, 5.0]])
    check_fn(f, x, ints(3, 4), v, torch.tensor([[0.0], [2.0]]))


def test_histc_and_mode() -> None:
    x = torch.tensor([0.0, 1.0, 1.5, 2.0, 3.0, NAN, -1.0, 2.9999, 0.75])
    m = torch.tensor([[3.0, 1.0, 3.0, 1.0, 2.0], [5.0, 5.0, 4.0, 4.0, 4.0], [1.0, 2, 3, 4, 5]])

    def f(x, m, i):
        return (
            torch.histc(x, 4, 0, 3), torch.histc(m, 5), torch.histc(m[0], 3, 2, 2),
            torch.mode(m, 1), torch.mode(m, 0, keepdim=True), torch.mode(i, -1),
            torch.mode(i > 2, 1),
        )  # fmt: skip

    check_fn(f, x, m, ints(3, 6, low=0, high=4))
