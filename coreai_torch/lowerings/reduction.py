"""Reductions: sum, mean, prod, amax/amin, max/min (with indices), argmax/argmin, var/std,
any/all, logsumexp and vector norms.

Core AI reductions keep the reduced dimensions; PyTorch's ``keepdim=False`` is a
``shrink_dims`` afterwards.  Dtypes follow PyTorch: integer and bool ``sum``/``prod`` give
int64; ``any``/``all`` give bool (uint8 for uint8 inputs); float16/bfloat16 sums, means and
variances accumulate in float32 and round once, like ATen's CPU kernels (Core AI's own
``reduce_sum``/``reduce_mean`` already do).

NaN: ``amax``/``max`` propagate NaN, and ``argmax``/``argmin``/``max.dim`` return the index of
the first NaN like PyTorch (Core AI's ``argmax`` ignores NaN, so the index is fixed up).
Core AI has no argmin; it is ``argmax`` of an order-reversed copy (``-x`` for floats,
``~x`` for integers, which cannot overflow).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import (
    Scalar,
    cast,
    constant,
    dim_size,
    dtype_of,
    i32,
    known_sizes,
    normalize_dim,
    normalize_dims,
    rank_of,
    shape_of,
    squeeze,
    unsqueeze,
)
from coreai_torch.lowerings.helpers.arithmetic import (
    isinf_values,
    to_bool,
)
from coreai_torch.lowerings.helpers.layout import filled
from coreai_torch.lowerings.helpers.operands import (
    const_like,
    opmath,
)
from coreai_torch.lowerings.helpers.reductions import Dims, arg_extreme, check_size, reduce
from coreai_torch.lowerings.registry import (
    EMPTY_INPUT_OPS,
    EmptyTensor,
    LoweringContext,
    lowering,
)


def reduction(*names: str, empty: Scalar | tuple[Scalar, ...]) -> Callable[[Callable], Callable]:
    """``lowering(*names)`` for a rule whose ``self`` may be a zero-element tensor.

    Such inputs never reach the runtime (it aborts on them): the result of reducing nothing
    is the constant ``empty`` (0 for sums, NaN for means, ...; a tuple for several results).
    """

    def decorate(rule: Callable) -> Callable:
        @functools.wraps(rule)
        def checked(cx: LoweringContext, self: Any, *args: Any, **kwargs: Any) -> Any:
            if not isinstance(self, EmptyTensor):
                return rule(cx, self, *args, **kwargs)
            results = cx.out if isinstance(cx.out, (list, tuple)) else [cx.out]
            values = empty if isinstance(empty, tuple) else (empty,)
            return [filled(list(r.shape), v, r.dtype) for r, v in zip(results, values, strict=True)]

        for name in names:
            EMPTY_INPUT_OPS[name] = (0,)
        lowering(*names)(checked)
        return rule

    return decorate


def _accumulating(
    fn: Callable[..., ir.Value], cx: LoweringContext, x: ir.Value, dims: Dims, keepdim: bool
) -> ir.Value:
    """``reduce`` in the result dtype.  Core AI's ``reduce_sum``/``reduce_mean`` already
    accumulate 16-bit floats in higher precision (bit-identical to PyTorch); other
    reductions run in float32 for them."""
    dtype = cx.out_dtype
    native = fn in (cai.reduce_sum, cai.reduce_mean)
    out = reduce(fn, cast(x, dtype if native else opmath(dtype)), dims, keepdim)
    return cast(out, dtype)


@reduction("aten::sum.dim_IntList", "aten::sum.default", empty=0)
def sum_(
    cx: LoweringContext,
    self: ir.Value,
    dim: Sequence[int] | None = None,
    keepdim: bool = False,
    dtype: torch.dtype | None = None,
) -> ir.Value:
    return _accumulating(cai.reduce_sum, cx, self, dim, keepdim)


@reduction("aten::mean.dim", "aten::mean.default", empty=math.nan)
def mean(
    cx: LoweringContext,
    self: ir.Value,
    dim: Sequence[int] | None = None,
    keepdim: bool = False,
    dtype: torch.dtype | None = None,
) -> ir.Value:
    return _accumulating(cai.reduce_mean, cx, self, dim, keepdim)


@reduction("aten::prod.dim_int", "aten::prod.default", empty=1)
def prod(
    cx: LoweringContext,
    self: ir.Value,
    dim: int | None = None,
    keepdim: bool = False,
    dtype: torch.dtype | None = None,
) -> ir.Value:
    return _accumulating(cai.reduce_product, cx, self, dim, keepdim)


def _extreme(x: ir.Value, dims: Dims, keepdim: bool, largest: bool) -> ir.Value:
    if dtype_of(x) == torch.bool:
        return reduce(cai.any_ if largest else cai.all_, x, dims, keepdim)
    return reduce(cai.reduce_max if largest else cai.reduce_min, x, dims, keepdim)


@lowering("aten::amax.default")
def amax(
    cx: LoweringContext, self: ir.Value, dim: Sequence[int] = (), keepdim: bool = False
) -> ir.Value:
    return _extreme(self, dim, keepdim, True)


@lowering("aten::amin.default")
def amin(
    cx: LoweringContext, self: ir.Value, dim: Sequence[int] = (), keepdim: bool = False
) -> ir.Value:
    return _extreme(self, dim, keepdim, False)


@lowering("aten::max.default")
def max_(cx: LoweringContext, self: ir.Value) -> ir.Value:
    return _extreme(self, None, False, True)


@lowering("aten::min.default")
def min_(cx: LoweringContext, self: ir.Value) -> ir.Value:
    return _extreme(self, None, False, False)


# ----------------------------------------------------------------------- argmax / argmin ---


def _arg_rule(largest: bool) -> Callable:
    def rule(
        cx: LoweringContext, self: ir.Value, dim: int | None = None, keepdim: bool = False
    ) -> ir.Value:
        x = self
        if rank_of(x) == 0:
            return constant(0, torch.int64)
        if dim is None:
            x = cai.reshape(x, i32([-1]))
            axis = 0
        else:
            axis = normalize_dim(dim, rank_of(x))
        out = arg_extreme(x, axis, largest)
        if dim is None:
            return cai.reshape(out, i32([1] * len(cx.out_shape))) if keepdim else squeeze(out, [0])
        return out if keepdim else squeeze(out, [axis])

    rule.__name__ = "argmax" if largest else "argmin"
    return rule


lowering("aten::argmax.default")(_arg_rule(True))
lowering("aten::argmin.default")(_arg_rule(False))


def _extreme_with_index(
    cx: LoweringContext, x: ir.Value, dim: int, keepdim: bool, largest: bool
) -> list[ir.Value]:
    if rank_of(x) == 0:
        return [x, constant(0, torch.int64)]
    axis = normalize_dim(dim, rank_of(x))
    values = _extreme(x, [axis], True, largest)
    index = arg_extreme(x, axis, largest)
    if not keepdim:
        values, index = squeeze(values, [axis]), squeeze(index, [axis])
    return [values, index]


@lowering("aten::max.dim")
def max_dim(cx: LoweringContext, self: ir.Value, dim: int, keepdim: bool = False):
    return _extreme_with_index(cx, self, dim, keepdim, True)


@lowering("aten::min.dim")
def min_dim(cx: LoweringContext, self: ir.Value, dim: int, keepdim: bool = False):
    return _extreme_with_index(cx, self, dim, keepdim, False)


# ------------------------------------------------------------------------------ variance ---


def _count(x: ir.Value, axes: Sequence[int]) -> float | ir.Value:
    """Number of elements reduced over ``axes`` (a 0-d value of ``x``'s dtype if dynamic)."""
    static, dynamic = 1, []
    for axis in axes:
        size = dim_size(x, axis)
        if isinstance(size, int):
            static *= size
        else:
            dynamic.append(size)
    if not dynamic:
        return float(static)
    count = const_like(float(static), x)
    for size in dynamic:
        count = cai.broadcasting_mul(count, cast(size, dtype_of(x)))
    return count


def variance(
    x: ir.Value, dims: Dims, correction: float, keepdim: bool
) -> tuple[ir.Value, ir.Value]:
    """(variance, mean) over ``dims`` with ``correction`` (Bessel for 1), two-pass."""
    rank = rank_of(x)
    if rank == 0:
        x = cai.reshape(x, i32([1]))
        rank = 1
    axes = normalize_dims(dims, rank)
    mu = cai.reduce_mean(x, i32(axes))
    centered = cai.broadcasting_sub(x, mu)
    squares = cai.reduce_sum(cai.broadcasting_mul(centered, centered), i32(axes))
    count = _count(x, axes)
    if isinstance(count, float):
        denominator = const_like(max(count - correction, 0.0), x)
    else:
        denominator = cai.broadcasting_maximum(
            cai.broadcasting_sub(count, const_like(correction, x)), const_like(0.0, x)
        )
    var = cai.broadcasting_divide(squares, denominator)
    if not keepdim:
        var, mu = squeeze(var, axes), squeeze(mu, axes)
    return var, mu


def _correction(correction: float | None, unbiased: bool = True) -> float:
    if correction is not None:
        return float(correction)
    return 1.0 if unbiased else 0.0


def _shaped(cx: LoweringContext, value: ir.Value) -> ir.Value:
    """``value`` reshaped to the node's (static) result shape when ranks differ (0-d input)."""
    sizes = known_sizes(cx.out_shape)
    if rank_of(value) != len(cx.out_shape) and sizes is not None:
        return cai.reshape(value, i32(sizes)) if sizes else squeeze(value, [0])
    return value


def _variance_outputs(
    cx: LoweringContext, x: ir.Value, dims: Dims, correction: float, keepdim: bool, what: str
) -> list[ir.Value]:
    """``what`` is ``var``, ``std``, ``var_mean`` or ``std_mean``."""
    dtype = cx.out_dtype
    var, mu = variance(cast(x, opmath(dtype)), dims, correction, keepdim)
    if what.startswith("std"):
        var = cai.sqrt(var)
    var, mu = cast(_shaped(cx, var), dtype), cast(_shaped(cx, mu), dtype)
    return [var, mu] if what.endswith("_mean") else [var]


def _variance_rule(what: str) -> Callable:
    def rule(
        cx: LoweringContext,
        self: ir.Value,
        dim: Sequence[int] | None = None,
        correction: float | None = None,
        keepdim: bool = False,
    ) -> list[ir.Value]:
        return _variance_outputs(cx, self, dim, _correction(correction), keepdim, what)

    rule.__name__ = what
    return rule


for _what in ("var", "std", "var_mean", "std_mean"):
    _nan = (math.nan, math.nan) if _what.endswith("_mean") else math.nan
    reduction(f"aten::{_what}.correction", empty=_nan)(_variance_rule(_what))


@reduction("aten::var.dim", "aten::std.dim", empty=math.nan)
def var_dim(
    cx: LoweringContext,
    self: ir.Value,
    dim: Sequence[int] | None = None,
    unbiased: bool = True,
    keepdim: bool = False,
) -> list[ir.Value]:
    what = "std" if getattr(cx.node.target, "__name__", "").startswith("std") else "var"
    return _variance_outputs(cx, self, dim, _correction(None, unbiased), keepdim, what)


# ------------------------------------------------------------------------------ any / all ---


def _logical_reduce(
    cx: LoweringContext, fn: Callable, x: ir.Value, dims: Dims, keepdim: bool
) -> ir.Value:
    b = to_bool(x)
    if isinstance(dims, (list, tuple)) and len(dims) == 0:
        return cast(b, cx.out_dtype)  # any(x, dim=()) reduces nothing
    return cast(reduce(fn, b, dims, keepdim), cx.out_dtype)


@reduction("aten::any.default", "aten::any.dim", "aten::any.dims", empty=False)
def any_(
    cx: LoweringContext, self: ir.Value, dim: int | Sequence[int] | None = None, keepdim=False
) -> ir.Value:
    return _logical_reduce(cx, cai.any_, self, dim, keepdim)


@reduction("aten::all.default", "aten::all.dim", "aten::all.dims", empty=True)
def all_(
    cx: LoweringContext, self: ir.Value, dim: int | Sequence[int] | None = None, keepdim=False
) -> ir.Value:
    return _logical_reduce(cx, cai.all_, self, dim, keepdim)


# ---------------------------------------------------------------------- logsumexp, norms ---


@reduction("aten::logsumexp.default", empty=-math.inf)
def logsumexp(
    cx: LoweringContext, self: ir.Value, dim: Sequence[int] = (), keepdim: bool = False
) -> ir.Value:
    """``m + log(sum(exp(x - m)))`` with ``m = amax(x)`` (0 where ``m`` is infinite)."""
    dtype = cx.out_dtype
    x = cast(self, opmath(dtype))
    m = reduce(cai.reduce_max, x, dim, True)
    m = cai.broadcasting_where(isinf_values(m), const_like(0.0, m), m)
    total = reduce(cai.reduce_sum, cai.exp(cai.broadcasting_sub(x, m)), dim, True)
    out = cai.broadcasting_add(cai.log(total), m)
    if not keepdim and rank_of(x):
        out = squeeze(out, normalize_dims(dim, rank_of(x)))
    return cast(out, dtype)


def vector_norm(x: ir.Value, ord: float, dims: Dims, keepdim: bool) -> ir.Value:
    """``sum(|x| ** ord) ** (1 / ord)`` with PyTorch's special orders 0, 1, 2, ±inf."""
    a = cai.abs_(x)
    if ord == math.inf:
        return reduce(cai.reduce_max, a, dims, keepdim)
    if ord == -math.inf:
        return reduce(cai.reduce_min, a, dims, keepdim)
    if ord == 0:
        nonzero = cast(cai.broadcasting_not_equal(x, const_like(0, x)), dtype_of(x))
        return reduce(cai.reduce_sum, nonzero, dims, keepdim)
    if ord == 1:
        return reduce(cai.reduce_sum, a, dims, keepdim)
    if ord == 2:
        return cai.sqrt(reduce(cai.reduce_sum, cai.broadcasting_mul(x, x), dims, keepdim))
    powered = cai.broadcasting_pow(a, const_like(ord, x))
    total = reduce(cai.reduce_sum, powered, dims, keepdim)
    return cai.broadcasting_pow(total, const_like(1.0 / ord, x))


@reduction("aten::linalg_vector_norm.default", empty=0.0)
def linalg_vector_norm(
    cx: LoweringContext,
    self: ir.Value,
    ord: float = 2,
    dim: Sequence[int] | None = None,
    keepdim: bool = False,
    dtype: torch.dtype | None = None,
) -> ir.Value:
    out_dtype = cx.out_dtype
    x = cast(self, opmath(out_dtype))
    return cast(vector_norm(x, float(ord), dim, keepdim), out_dtype)


@lowering("aten::dist.default")
def dist(cx: LoweringContext, self: ir.Value, other: ir.Value, p: float = 2) -> ir.Value:
    dtype = cx.out_dtype
    a, b = cast(self, opmath(dtype)), cast(other, opmath(dtype))
    return cast(vector_norm(cai.broadcasting_sub(a, b), float(p), None, False), dtype)


@lowering("aten::_cdist_forward.default")
def cdist(
    cx: LoweringContext,
    x1: ir.Value,
    x2: ir.Value,
    p: float,
    compute_mode: int | None = None,
) -> ir.Value:
    """p-norm distances between the rows of ``x1`` (..., P, M) and ``x2`` (..., R, M), from
    the broadcast differences (exact, unlike ATen's matmul shortcut for large inputs)."""
    dtype = cx.out_dtype
    a, b = cast(x1, opmath(dtype)), cast(x2, opmath(dtype))
    diff = cai.broadcasting_sub(unsqueeze(a, [rank_of(a) - 1]), unsqueeze(b, [rank_of(b) - 2]))
    check_size(cx, diff, "the differences of every pair of rows")
    return cast(vector_norm(diff, float(p), [-1], False), dtype)


@lowering("aten::_pdist_forward.default")
def pdist(cx: LoweringContext, self: ir.Value, p: float = 2) -> ir.Value:
    """Distances between all pairs of rows i < j of ``self`` (N, M), in row-major order."""
    n = shape_of(self)[0]
    if n is None:
        raise cx.unsupported("pdist over a dynamic number of rows")
    dtype = cx.out_dtype
    x = cast(self, opmath(dtype))
    diff = cai.broadcasting_sub(unsqueeze(x, [1]), unsqueeze(x, [0]))
    check_size(cx, diff, "the differences of every pair of rows")
    full = cai.reshape(vector_norm(diff, float(p), [-1], False), i32([n * n]))
    pairs = [i * n + j for i in range(n) for j in range(i + 1, n)]
    return cast(cai.gather_along_axis(full, i32(pairs), i32(0)), dtype)
