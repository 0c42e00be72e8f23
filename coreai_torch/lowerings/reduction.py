"""Reductions: sum, mean, prod, amax/amin, argmax/argmin, var/std, any/all.

Core AI reductions keep the reduced dimensions; PyTorch's ``keepdim=False`` is a
``shrink_dims`` afterwards.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from coreai_torch._mlir import cai, ir
from coreai_torch.lowerings.common import (
    cast,
    constant,
    dtype_of,
    i32,
    normalize_dim,
    normalize_dims,
    rank_of,
    reshape,
    shape_of,
    squeeze,
)
from coreai_torch.lowerings.registry import LoweringContext, lowering


def reduce(
    fn: Callable[..., ir.Value], x: ir.Value, dims: Sequence[int] | int | None, keepdim: bool
) -> ir.Value:
    """Apply a keep-dims Core AI reduction over ``dims`` and drop them unless ``keepdim``."""
    rank = rank_of(x)
    if rank == 0:
        return x
    axes = normalize_dims(dims, rank)
    out = fn(x, i32(axes))
    return out if keepdim else squeeze(out, axes)


@lowering("aten::sum.dim_IntList", "aten::sum.default")
def sum_(
    cx: LoweringContext,
    self: ir.Value,
    dim: Sequence[int] | None = None,
    keepdim: bool = False,
    dtype: torch.dtype | None = None,
) -> ir.Value:
    x = cast(self, cx.out_dtype)
    return reduce(cai.reduce_sum, x, dim, keepdim)


@lowering("aten::mean.dim", "aten::mean.default")
def mean(
    cx: LoweringContext,
    self: ir.Value,
    dim: Sequence[int] | None = None,
    keepdim: bool = False,
    dtype: torch.dtype | None = None,
) -> ir.Value:
    x = cast(self, cx.out_dtype)
    return reduce(cai.reduce_mean, x, dim, keepdim)


@lowering("aten::prod.dim_int", "aten::prod.default")
def prod(
    cx: LoweringContext,
    self: ir.Value,
    dim: int | None = None,
    keepdim: bool = False,
    dtype: torch.dtype | None = None,
) -> ir.Value:
    x = cast(self, cx.out_dtype)
    return reduce(cai.reduce_product, x, dim, keepdim)


@lowering("aten::amax.default", "aten::max.default")
def amax(
    cx: LoweringContext, self: ir.Value, dim: Sequence[int] | None = None, keepdim: bool = False
) -> ir.Value:
    return reduce(cai.reduce_max, self, dim, keepdim)


@lowering("aten::amin.default", "aten::min.default")
def amin(
    cx: LoweringContext, self: ir.Value, dim: Sequence[int] | None = None, keepdim: bool = False
) -> ir.Value:
    return reduce(cai.reduce_min, self, dim, keepdim)


@lowering("aten::argmax.default")
def argmax(
    cx: LoweringContext, self: ir.Value, dim: int | None = None, keepdim: bool = False
) -> ir.Value:
    x = self
    if dim is None:
        x = reshape(x, [math.prod(shape_of(x))])
        d = 0
    else:
        d = normalize_dim(dim, rank_of(x))
    if rank_of(x) == 0:
        return constant(0, torch.int64)
    out = cai.argmax(x, i32(d))
    out = cast(out, torch.int64)
    if dim is None:
        return reshape(out, cx.out_shape)
    return out if keepdim else squeeze(out, [d])


@lowering("aten::var.correction")
def var(
    cx: LoweringContext,
    self: ir.Value,
    dim: Sequence[int] | None = None,
    correction: float | None = None,
    keepdim: bool = False,
) -> ir.Value:
    x = cast(self, cx.out_dtype)
    rank = rank_of(x)
    axes = normalize_dims(dim, rank)
    shape = shape_of(x)
    count = 1
    for a in axes:
        count *= shape[a]
    mu = cai.reduce_mean(x, i32(axes))
    centered = cai.broadcasting_sub(x, mu)
    sq = cai.reduce_sum(cai.broadcasting_mul(centered, centered), i32(axes))
    c = 1.0 if correction is None else correction
    denom = max(count - c, 0)
    out = cai.broadcasting_divide(sq, constant(float(denom), dtype_of(x)))
    return out if keepdim else squeeze(out, axes)
