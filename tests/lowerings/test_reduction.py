"""Reductions, cumulative ops and sorting on the Core AI runtime vs eager PyTorch: dims
(negative, several, all, keepdim), 0-d and rank-6 inputs, int/bool dtypes (int64 results),
NaN propagation and NaN indices, ties, and float16/bfloat16 accumulation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from coreai_torch import TorchConverter
from coreai_torch.errors import ConversionError
from coreai_torch.frontend.export import export_decomposed
from tests.helpers import check_runs
from tests.lowerings.support import Fn, check_fn, convert_fn
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
    floats,
    grouped,
    ints,
    over_operands,
)

# name -> (op, operand indices)
REDUCTIONS: dict[str, tuple[Callable[[Any], Any], list[int]]] = {
    "sum": (lambda x: x.sum(), [FLOAT, INT64, INT32, BOOL, UINT8, RANK6, SCALAR]),
    "sum_dims": (lambda x: x.sum((0, -1)), [FLOAT, INT64, INT32, BOOL, UINT8, RANK6]),
    "sum_keepdim": (lambda x: x.sum(1, keepdim=True), [FLOAT, INT32, BOOL, RANK6]),
    "sum_dtype": (lambda x: x.sum(-1, dtype=torch.float32), [FLOAT, INT64, BOOL]),
    "mean": (lambda x: x.mean(), [FLOAT, RANK6, SCALAR, NANS]),
    "mean_dims": (lambda x: x.mean((-2, 0), keepdim=True), [FLOAT, RANK6, NANS]),
    "mean_int_dtype": (lambda x: x.mean(1, dtype=torch.float32), [INT64, INT32]),
    "prod": (lambda x: x.prod(), [FLOAT, INT32, BOOL, SCALAR]),
    "prod_dim": (lambda x: x.prod(1), [FLOAT, INT64, BOOL, UINT8, RANK6]),
    "amax": (lambda x: x.amax(1), [FLOAT, INT64, INT32, BOOL, UINT8, NANS, RANK6]),
    "amin": (lambda x: x.amin((0, 2), keepdim=True), [FLOAT, INT64, BOOL, UINT8, NANS]),
    "max": (lambda x: x.max(), [FLOAT, INT64, BOOL, NANS, SCALAR]),
    "min": (lambda x: x.min(), [FLOAT, INT32, BOOL, NANS, SCALAR]),
    "max_dim": (lambda x: x.max(1), [FLOAT, INT64, INT32, BOOL, UINT8, NANS, RANK6]),
    "min_dim": (lambda x: x.min(-1, keepdim=True), [FLOAT, INT64, BOOL, NANS, SCALAR]),
    "argmax": (lambda x: x.argmax(1), [FLOAT, INT64, INT32, UINT8, NANS, RANK6]),
    "argmax_all": (lambda x: x.argmax(), [FLOAT, INT64, NANS, SCALAR]),
    "argmax_keepdim": (lambda x: x.argmax(keepdim=True), [FLOAT, INT32]),
    "argmin": (lambda x: x.argmin(-1, keepdim=True), [FLOAT, INT64, INT32, UINT8, NANS]),
    "argmin_all": (lambda x: x.argmin(), [FLOAT, INT64, NANS, SCALAR]),
    "var": (lambda x: x.var(), [FLOAT, RANK6, NANS]),
    "var_dim": (lambda x: x.var(1, keepdim=True), [FLOAT, RANK6]),
    "var_unbiased_false": (lambda x: x.var((0, 2), unbiased=False), [FLOAT]),
    "var_correction": (lambda x: x.var(1, correction=2), [FLOAT]),
    "std": (lambda x: x.std(-1), [FLOAT, RANK6]),
    "std_correction0": (lambda x: x.std(correction=0), [FLOAT, SCALAR]),
    "var_mean": (lambda x: torch.var_mean(x, 1), [FLOAT, RANK6]),
    "std_mean": (lambda x: torch.std_mean(x, (0, 2), keepdim=True), [FLOAT]),
    "any": (lambda x: x.any(), [FLOAT, INT64, BOOL, UINT8, SCALAR]),
    "any_dim": (lambda x: x.any(1), [FLOAT, INT32, BOOL, UINT8, NANS]),
    "all": (lambda x: x.all(), [FLOAT, INT64, BOOL, UINT8]),
    "all_dims": (lambda x: torch.all(x, dim=(0, -1)), [FLOAT, BOOL, UINT8]),
    "count_nonzero": (lambda x: torch.count_nonzero(x, 1), [FLOAT, INT64, BOOL]),
    "logsumexp": (lambda x: torch.logsumexp(x, 1), [FLOAT, RANK6, NANS]),
    "logsumexp_dims": (lambda x: torch.logsumexp(x, (0, 2), keepdim=True), [FLOAT]),
    "norm": (lambda x: x.norm(), [FLOAT, RANK6]),
    "vector_norm_1": (lambda x: torch.linalg.vector_norm(x, 1, 1), [FLOAT]),
    "vector_norm_inf": (lambda x: torch.linalg.vector_norm(x, float("inf"), (0, 1)), [FLOAT]),
    "vector_norm_neg_inf": (lambda x: torch.linalg.vector_norm(x, -float("inf")), [FLOAT]),
    "vector_norm_3": (lambda x: torch.linalg.vector_norm(x, 3, -1, keepdim=True), [FLOAT]),
    "vector_norm_0": (lambda x: torch.linalg.vector_norm(x, 0, 2), [FLOAT]),
    "dist": (lambda x: torch.dist(x, x.flip(0), 3), [FLOAT]),
    "aminmax": (lambda x: torch.aminmax(x, dim=1), [FLOAT, INT64]),
    "nansum": (torch.nansum, [FLOAT, NANS]),
    "nanmean": (lambda x: torch.nanmean(x, 1), [NANS]),
}


@pytest.mark.parametrize("names", grouped(list(REDUCTIONS), 4))
def test_reduction(names: list[str]) -> None:
    check_cases([over_operands(*REDUCTIONS[n]) for n in names])


def test_argmax_ties_and_nan_positions() -> None:
    """Ties give the first index; the first NaN wins over everything (incl. inf)."""
    x = torch.tensor(
        [
            [1.0, 3.0, 3.0, 0.0],
            [NAN, 1.0, NAN, float("inf")],
            [-float("inf"), -float("inf"), 2.0, 2.0],
            [0.0, -0.0, 0.0, -0.0],
        ]
    )
    i = torch.tensor([[2, 7, 7, 1], [-(2**63), 2**63 - 1, 5, -(2**63)]])

    def f(x, i):
        return x.argmax(1), x.argmin(1), x.max(1), x.min(1), i.argmin(1), i.argmax(1), i.min(1)

    check_fn(f, x, i)


# ------------------------------------------------------------------------- cumulative ------


# ---------------------------------------------------------------------------- sorting ------


# -------------------------------------------------------------------- 16-bit accumulation --


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_accumulation(dtype: torch.dtype) -> None:
    """Sums/means/variances/cumsums of 4096 values accumulate in float32 like PyTorch."""
    tol = {torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    x = torch.full((2, 4096), 0.1).to(dtype)
    r = (floats(4, 64) * 3).to(dtype)

    def f(x, r):
        return (
            x.sum(1), x.mean(1), x.cumsum(1), r.var(1), r.std(0), torch.logsumexp(r, 1),
            r.norm(dim=1), r.amax(0), r.argmax(1), r.sort(1)[0], r.cumprod(1), r.prod(0),
        )  # fmt: skip

    check_fn(f, x, r, atol=tol, rtol=tol)


# --------------------------------------------------------------------------- dynamic shapes


def test_dynamic_shapes_three_sizes() -> None:
    """One program with dynamic batch and length, run at three sizes."""

    def f(x, i):
        return (
            x + 1, x * i, i // 2, i % 3, x // 0.7, x.exp(), i.exp(), x.sign(), x.floor(),
            torch.where(x > 0, x, 0.0), x.clamp(-0.5, 0.5), torch.isnan(x), i << 2, i >> 1,
            x.sum(1), x.mean(0), x.var(1), x.std(), x.prod(0), x.amax(), x.any(1), i.sum(),
            x.argmax(1), x.argmin(), x.max(1), torch.logsumexp(x, 1), x.norm(dim=1),
            x.cumsum(1), torch.cummax(x, 1), i.cumsum(0), torch.cummin(i, 1),
            x.sort(1), x.topk(2, 1), x.median(), torch.kthvalue(x, 2, 1), x.median(1),
            torch.nanmedian(x, 0), torch.bucketize(x, torch.tensor([0.0, 1.0])),
        )  # fmt: skip

    model = Fn(f).eval()
    batch = torch.export.Dim("batch", min=2, max=64)
    length = torch.export.Dim("length", min=3, max=64)
    x, i = floats(3, 5), ints(3, 5)
    dims = {0: batch, 1: length}
    ep = export_decomposed(model, (x, i), dynamic_shapes=((dims, dims),))
    program = TorchConverter().add_exported_program(ep).to_coreai()
    program.optimize()
    runs = [(x, i), (floats(2, 7), ints(2, 7)), (floats(6, 3), ints(6, 3))]
    check_runs(model, program, runs)


def test_rank_8() -> None:
    x = floats(2, 1, 2, 1, 2, 1, 2, 3)

    def f(x):
        return (
            x.sum((1, 3, -1)), x.amax(-3), x.argmax(4), x.var(7), x.cumsum(6),
            x.sort(0), x.topk(1, 7), x + x.transpose(0, 2), x.any(2), x.max(4),
        )  # fmt: skip

    check_fn(f, x)


def test_reductions_of_empty_slices() -> None:
    """Reducing zero elements is resolved at conversion time (the runtime aborts on empty
    tensors): 0 for sums, 1 for products, NaN for means/variances, -inf for logsumexp."""

    def f(x, i):
        e = x[:, :0]
        return (
            e.sum(1), e.prod(1), e.mean(1), (e > 0).any(1), (e > 0).all(-1), e.var(1),
            torch.logsumexp(e, 1), e.norm(dim=1), x[:0].sum(0), i[:, 2:2].sum(1), e.sum(),
            torch.var_mean(e, 1), e.std(1), e.sum(1, keepdim=True) + x,
        )  # fmt: skip

    check_fn(f, floats(3, 4), ints(3, 4))


def test_distances() -> None:
    a, b, c = floats(2, 5, 3), floats(2, 4, 3), floats(6, 3)

    def f(a, b, c, d):
        return (
            torch.cdist(a, b), torch.cdist(a, b, p=1), torch.cdist(a, b, p=float("inf")),
            torch.cdist(c, c[:2], p=3), torch.cdist(a, b, p=0), torch.cdist(d, c),
            torch.cdist(a[:, None, :1], c[None, :2]),
            F.pdist(c), F.pdist(c, p=1), F.pairwise_distance(c, c.flip(0)),
            F.cosine_similarity(a, a.flip(1), dim=-1),
        )  # fmt: skip

    check_fn(f, a, b, c, floats(30, 3), atol=1e-4, rtol=1e-4)


def test_pairwise_formulations_reject_huge_intermediates() -> None:
    with pytest.raises(ConversionError, match="intermediate of"):
        convert_fn(lambda x: torch.mode(x), floats(9000))
    with pytest.raises(ConversionError, match="intermediate of"):
        convert_fn(lambda x: torch.histogram(x, 2000), floats(40000))
