"""``histogram`` and ``histogramdd`` (``_histogramdd_bin_edges``, ``_histogramdd_from_bin_cts``,
``_histogramdd_from_bin_tensors``) with a static number of bins, as ATen's CPU kernel
(``aten/src/ATen/native/Histogram.cpp``) computes them:

* Without given edges, dimension ``d`` spans ``[min, max]`` of the input's column ``d`` (or
  ``range``); an empty span is widened by 0.5 on both sides.  The edges are ``linspace``'s,
  rounded as ATen's CPU kernel rounds them, so that elements on an edge fall into the same
  bin; constant ranges are evaluated at conversion time with ``torch.linspace`` itself.
* An element falls into bin ``b`` when ``e[b] <= x < e[b+1]`` (the last bin includes its
  right edge); elements outside the edges and NaN are skipped.  Counts (or weights) are
  summed per bin by comparing every element with every bin: one intermediate of
  ``elements x bins`` (limited like ``histc``).
* ``density`` divides by the total and by each bin's width.

Bin tensors are taken to be increasing, as PyTorch requires.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np
import torch

from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import (
    add,
    cast,
    constant,
    div,
    dtype_of,
    equal,
    i32,
    known_sizes,
    less,
    mul,
    pick,
    reshape,
    shape_of,
    squeeze,
    static_shape_of,
    sub,
    unsqueeze,
)
from coreai_torch.lowerings.helpers.arithmetic import (
    ge,
    le,
)
from coreai_torch.lowerings.helpers.layout import slice_axis
from coreai_torch.lowerings.helpers.reductions import PAIRWISE_LIMIT
from coreai_torch.lowerings.registry import LoweringContext, lowering

# ------------------------------------------------------------------------------- edges ----


def _column(x: ir.Value, d: int) -> ir.Value:
    """Column ``d`` of the (M, D) values, as (M,)."""
    return reshape(slice_axis(x, 1, d, d + 1), [static_shape_of(x)[0]])


def _extreme(x: ir.Value, largest: bool) -> ir.Value:
    reduce = cai.reduce_max if largest else cai.reduce_min
    return squeeze(reduce(x, i32([0])), [0])


def linspace_values(lo: ir.Value, hi: ir.Value, steps: int) -> ir.Value:
    """``linspace(lo, hi, steps)`` for 0-d ``lo``/``hi`` as ATen's CPU kernel rounds it:
    ``lo + step i`` before the halfway point, ``hi - step (steps - 1 - i)`` from it on, each
    a fused multiply-add (one rounding) — emulated in float64 for float32 edges."""
    dtype = dtype_of(lo)
    if steps == 1:
        return reshape(lo, [1])
    step = div(sub(hi, lo), float(steps - 1))
    wide = torch.float64
    lo, hi, step = cast(lo, wide), cast(hi, wide), cast(step, wide)
    index = np.arange(steps)
    ahead = add(lo, mul(step, constant(index.astype(np.float64), wide)))
    behind = sub(hi, mul(step, constant((steps - 1 - index).astype(np.float64), wide)))
    edges = cai.broadcasting_where(constant(index < steps // 2, torch.bool), ahead, behind)
    return cast(edges, dtype)


def bin_edges(x: ir.Value, bins: Sequence[int], span: Sequence[float] | None) -> list[ir.Value]:
    """Edges per column of the (M, D) input (``select_outer_bin_edges`` + ``linspace``)."""
    dtype = dtype_of(x)
    edges = []
    for d, count in enumerate(bins):
        if span is not None:
            lo, hi = float(span[2 * d]), float(span[2 * d + 1])
            if lo == hi:
                lo, hi = lo - 0.5, hi + 0.5
            values = torch.linspace(lo, hi, count + 1, dtype=dtype)
            edges.append(constant(values.numpy(), dtype))
            continue
        column = _column(x, d)
        lo, hi = _extreme(column, largest=False), _extreme(column, largest=True)
        same = equal(lo, hi)
        lo, hi = pick(same, sub(lo, 0.5), lo, lo), pick(same, add(hi, 0.5), hi, hi)
        edges.append(linspace_values(lo, hi, count + 1))
    return edges


# ------------------------------------------------------------------------------- counts ---


def _in_bins(column: ir.Value, edges: ir.Value) -> ir.Value:
    """(M, bins) bool: ``edges[b] <= x < edges[b+1]``, ``<=`` for the last bin."""
    n = static_shape_of(edges)[0] - 1
    x = unsqueeze(column, [1])
    lower, upper = slice_axis(edges, 0, 0, n), slice_axis(edges, 0, 1, n + 1)
    last = constant(np.arange(n) == n - 1, torch.bool)
    below_upper = cai.broadcasting_where(last, le(x, upper), less(x, upper))
    return cai.broadcasting_and(ge(x, lower), below_upper)


def histogram_values(
    cx: LoweringContext,
    x: ir.Value,
    edges: Sequence[ir.Value],
    weight: ir.Value | None,
    density: bool,
) -> ir.Value:
    """The D-dimensional histogram of the (M, D) values over ``edges`` (one per column)."""
    m, dims = static_shape_of(x)
    dtype = dtype_of(x)
    counts = [static_shape_of(e)[0] - 1 for e in edges]
    size = m * int(np.prod(counts, dtype=np.int64))
    if size > PAIRWISE_LIMIT:
        raise cx.unsupported(
            f"histogram would compare {m} elements with {size // m} bins "
            f"(an intermediate of {size} elements, limit {PAIRWISE_LIMIT})"
        )
    hit = None
    for d, e in enumerate(edges):
        inside = _in_bins(_column(x, d), cast(e, dtype))  # (M, b_d)
        shape = [m] + [counts[k] if k == d else 1 for k in range(dims)]
        inside = reshape(inside, shape)
        hit = inside if hit is None else cai.broadcasting_and(hit, inside)
    assert hit is not None
    w = constant(1.0, dtype) if weight is None else cast(weight, dtype)
    if weight is not None:
        w = reshape(w, [m] + [1] * dims)
    hist = squeeze(cai.reduce_sum(pick(hit, w, 0.0, x), i32([0])), [0])
    if density:
        total = cai.reduce_sum(hist, i32(list(range(dims))))
        hist = div(hist, total)
        for d, e in enumerate(edges):
            n = counts[d]
            widths = sub(slice_axis(e, 0, 1, n + 1), slice_axis(e, 0, 0, n))
            shape = [n if k == d else 1 for k in range(dims)]
            hist = div(hist, reshape(cast(widths, dtype), shape))
    return hist


# -------------------------------------------------------------------------------- rules ---


def _as_matrix(cx: LoweringContext, self: ir.Value, one_dimensional: bool) -> ir.Value:
    shape = known_sizes(shape_of(self))
    if shape is None:
        raise cx.unsupported("histograms need static shapes")
    dtype = dtype_of(self)
    if dtype not in (torch.float32, torch.float64):
        raise cx.unsupported(f"histograms of {dtype} values (float32/float64 only)")
    if one_dimensional:
        return reshape(self, [int(np.prod(shape, dtype=np.int64)), 1])
    return reshape(self, [int(np.prod(shape[:-1], dtype=np.int64)), shape[-1]])


def _flat_weight(weight: ir.Value | None) -> ir.Value | None:
    if weight is None:
        return None
    return reshape(weight, [int(np.prod(static_shape_of(weight), dtype=np.int64))])


Bins: TypeAlias = int | ir.Value | Sequence[int] | Sequence[ir.Value]


def _histogram(
    cx: LoweringContext,
    self: ir.Value,
    bins: Bins,
    span: Sequence[float] | None,
    weight: ir.Value | None,
    density: bool,
) -> tuple[ir.Value, list[ir.Value]]:
    """(hist, edges) for bin counts or bin tensors, 1-D (``histogram``) or per column."""
    one_dimensional = not isinstance(bins, (list, tuple))
    x = _as_matrix(cx, self, one_dimensional)
    per_column: list[Any] = list(bins) if isinstance(bins, (list, tuple)) else [bins]
    edges = per_column if isinstance(per_column[0], ir.Value) else bin_edges(x, per_column, span)
    return histogram_values(cx, x, edges, _flat_weight(weight), density), edges


@lowering("aten::histogram.bin_ct", "aten::histogram.bins_tensor")
def histogram(
    cx: LoweringContext,
    self: ir.Value,
    bins: int | ir.Value = 100,
    range: Sequence[float] | None = None,
    weight: ir.Value | None = None,
    density: bool = False,
) -> list[ir.Value]:
    hist, (edges,) = _histogram(cx, self, bins, range, weight, density)
    return [hist, edges]


@lowering("aten::_histogramdd_from_bin_cts.default", "aten::_histogramdd_from_bin_tensors.default")
def histogramdd(
    cx: LoweringContext,
    self: ir.Value,
    bins: Sequence[int] | Sequence[ir.Value],
    range: Sequence[float] | None = None,
    weight: ir.Value | None = None,
    density: bool = False,
) -> ir.Value:
    return _histogram(cx, self, bins, range, weight, density)[0]


@lowering("aten::_histogramdd_bin_edges.default")
def histogramdd_bin_edges(
    cx: LoweringContext,
    self: ir.Value,
    bins: Sequence[int],
    range: Sequence[float] | None = None,
    weight: ir.Value | None = None,
    density: bool = False,
) -> list[ir.Value]:
    return bin_edges(_as_matrix(cx, self, one_dimensional=False), bins, range)
