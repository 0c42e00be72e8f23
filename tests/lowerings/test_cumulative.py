"""Cumulative ops on the Core AI runtime vs eager PyTorch: cumsum/cumprod (int and bool
inputs give int64), cummax/cummin (ties, NaN), logcumsumexp, over dims, 0-d and rank 6."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.lowerings.support import check_fn
from tests.lowerings.values import (
    BOOL,
    FLOAT,
    INT32,
    INT64,
    NAN,
    NANS,
    RANK6,
    SCALAR,
    UINT8,
    check_cases,
    grouped,
    over_operands,
)

CUMULATIVE: dict[str, tuple[Callable[[Any], Any], list[int]]] = {
    "cumsum": (lambda x: x.cumsum(1), [FLOAT, INT64, INT32, BOOL, UINT8, RANK6]),
    "cumsum_neg_dim": (lambda x: x.cumsum(-1, dtype=torch.float32), [FLOAT, INT64, SCALAR]),
    "cumprod": (lambda x: x.cumprod(0), [FLOAT, INT64, BOOL, SCALAR]),
    "cummax": (lambda x: torch.cummax(x, -2), [FLOAT, INT64, INT32, BOOL, NANS]),
    "cummin": (lambda x: torch.cummin(x, -1), [FLOAT, INT64, UINT8, NANS, RANK6, SCALAR]),
    "logcumsumexp": (lambda x: torch.logcumsumexp(x, -1), [FLOAT, RANK6, SCALAR]),
}


@pytest.mark.parametrize("names", grouped(list(CUMULATIVE), 3))
def test_cumulative(names: list[str]) -> None:
    check_cases([over_operands(*CUMULATIVE[n]) for n in names])


def test_cummax_ties_and_nans() -> None:
    """Ties move the index to the latest position; after a NaN only later NaNs move it."""
    x = torch.tensor([[1.0, 3.0, 3.0, NAN, 5.0, NAN, 0.0], [2.0, 2.0, 1.0, 2.0, 0.0, 0.0, 4.0]])
    check_fn(lambda x: (torch.cummax(x, 1), torch.cummin(x, 1)), x)
