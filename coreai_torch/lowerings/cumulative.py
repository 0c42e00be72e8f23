"""Cumulative ops along one dimension: cumsum, cumprod, cummax/cummin (with indices),
logcumsumexp — all on Core AI's ``scan``.

Integer and bool ``cumsum``/``cumprod`` give int64 like PyTorch.  ``scan`` accumulates
float16 in float16, so 16-bit floats are scanned in float32 (PyTorch accumulates in float32).
"""

from __future__ import annotations

import numpy as np
import torch

from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import cast, dtype_of, normalize_dim, rank_of
from coreai_torch.lowerings.helpers.arithmetic import isnan_values
from coreai_torch.lowerings.helpers.operands import (
    const_like,
    opmath,
)
from coreai_torch.lowerings.helpers.reductions import positions, reduce, scan
from coreai_torch.lowerings.registry import LoweringContext, lowering


def _cumulative(cx: LoweringContext, x: ir.Value, dim: int, combiner: str) -> ir.Value:
    dtype = cx.out_dtype
    x = cast(x, opmath(dtype))
    if rank_of(x) == 0:
        return cast(x, dtype)
    return cast(scan(x, normalize_dim(dim, rank_of(x)), combiner), dtype)


@lowering("aten::cumsum.default")
def cumsum(
    cx: LoweringContext, self: ir.Value, dim: int, dtype: torch.dtype | None = None
) -> ir.Value:
    return _cumulative(cx, self, dim, "sum")


@lowering("aten::cumprod.default")
def cumprod(
    cx: LoweringContext, self: ir.Value, dim: int, dtype: torch.dtype | None = None
) -> ir.Value:
    return _cumulative(cx, self, dim, "product")


def _cumulative_extreme(x: ir.Value, dim: int, largest: bool) -> list[ir.Value]:
    """Running max (min) and the index where it was last reached (PyTorch's tie rule).

    ``scan`` skips NaN; PyTorch propagates it: from the first NaN on the value is NaN and the
    index that of the latest NaN.
    """
    dtype = dtype_of(x)
    if rank_of(x) == 0:
        return [x, cast(cai.broadcasting_not_equal(x, x), torch.int64)]
    axis = normalize_dim(dim, rank_of(x))
    key = cast(x, torch.uint8) if dtype == torch.bool else x
    values = scan(key, axis, "max" if largest else "min")
    reached = cai.broadcasting_equal(key, values)
    if dtype.is_floating_point:
        nan = isnan_values(x)
        nan_seen = scan(cast(nan, torch.uint8), axis, "max")
        nan_seen = cai.broadcasting_not_equal(nan_seen, const_like(0, nan_seen))
        values = cai.broadcasting_where(nan_seen, const_like(float("nan"), x), values)
        reached = cai.broadcasting_or(cai.broadcasting_and(reached, cai.not_(nan_seen)), nan)
    marked = cai.broadcasting_where(reached, positions(x, axis), cai.constant(np.int64(0)))
    return [cast(values, dtype), scan(marked, axis, "max")]


@lowering("aten::cummax.default")
def cummax(cx: LoweringContext, self: ir.Value, dim: int) -> list[ir.Value]:
    return _cumulative_extreme(self, dim, True)


@lowering("aten::cummin.default")
def cummin(cx: LoweringContext, self: ir.Value, dim: int) -> list[ir.Value]:
    return _cumulative_extreme(self, dim, False)


@lowering("aten::logcumsumexp.default")
def logcumsumexp(cx: LoweringContext, self: ir.Value, dim: int) -> ir.Value:
    """``m + log(cumsum(exp(x - m)))`` with ``m`` the maximum along ``dim``.

    Exact in float32 unless values along ``dim`` span more than ~87 (``exp`` underflow):
    then early positions come out as ``-inf`` instead of their (tiny) true value.
    """
    dtype = cx.out_dtype
    x = cast(self, opmath(dtype))
    if rank_of(x) == 0:
        return self
    axis = normalize_dim(dim, rank_of(x))
    m = reduce(cai.reduce_max, x, [axis], True)
    finite = cai.broadcasting_equal(cai.broadcasting_sub(m, m), const_like(0.0, m))
    m = cai.broadcasting_where(finite, m, const_like(0.0, m))
    total = scan(cai.exp(cai.broadcasting_sub(x, m)), axis, "sum")
    return cast(cai.broadcasting_add(cai.log(total), m), dtype)
