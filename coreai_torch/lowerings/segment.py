"""``segment_reduce``: sum / mean / max / min / prod over consecutive segments of one axis,
given by ``lengths`` or ``offsets`` (runtime values; their static shape fixes the number of
segments, so the result shape is static).

As ATen's CPU kernel: a segment's reduction starts from ``initial`` (else 0 for sum and
mean, 1 for prod, ∓inf for max/min), NaN propagates through max/min, the mean divides by
the length (an empty segment's mean is NaN without ``initial``, ``initial`` with it).
Elements after the last segment are ignored.  Every segment is compared with every position
of the axis (an intermediate of segments x positions x the rest, limited like ``histc``).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import (
    Scalar,
    add,
    cast,
    constant,
    div,
    equal,
    i32,
    known_sizes,
    normalize_dim,
    not_nan,
    pick,
    rank_of,
    reshape,
    shape_of,
    squeeze,
    static_dim,
    unsqueeze,
)
from coreai_torch.lowerings.helpers.arithmetic import ge
from coreai_torch.lowerings.helpers.layout import slice_axis
from coreai_torch.lowerings.helpers.reductions import (
    PAIRWISE_LIMIT,
    scan,
)
from coreai_torch.lowerings.registry import LoweringContext, lowering

_START = {"sum": 0.0, "mean": 0.0, "prod": 1.0, "max": -math.inf, "min": math.inf}
_REDUCE = {
    "sum": cai.reduce_sum,
    "mean": cai.reduce_sum,
    "prod": cai.reduce_product,
    "max": cai.reduce_max,
    "min": cai.reduce_min,
}


def _bounds(lengths: ir.Value | None, offsets: ir.Value | None) -> tuple[ir.Value, ir.Value]:
    """(starts, ends) of the segments, int64 (..., S)."""
    if lengths is not None:
        lengths = cast(lengths, torch.int64)
        ends = scan(lengths, rank_of(lengths) - 1, "sum")
        return cai.broadcasting_sub(ends, lengths), ends
    assert offsets is not None
    offsets = cast(offsets, torch.int64)
    count = static_dim(offsets, -1) - 1
    last = rank_of(offsets) - 1
    return slice_axis(offsets, last, 0, count), slice_axis(offsets, last, 1, count + 1)


@lowering("aten::segment_reduce.default")
def segment_reduce(
    cx: LoweringContext,
    data: ir.Value,
    reduce: str,
    lengths: ir.Value | None = None,
    offsets: ir.Value | None = None,
    axis: int = 0,
    unsafe: bool = False,
    initial: Scalar | None = None,
) -> ir.Value:
    shape = known_sizes(shape_of(data))
    if shape is None:
        raise cx.unsupported("segment_reduce needs static shapes")
    if reduce not in _START:
        raise cx.unsupported(f"reduce={reduce!r}")
    if lengths is None and offsets is None:
        raise cx.unsupported("segment_reduce needs lengths or offsets")
    dtype = cx.out_dtype
    axis = normalize_dim(axis, len(shape))
    starts, ends = _bounds(lengths, offsets)  # (*shape[:axis], S)
    segments, positions, inner = static_dim(starts, -1), shape[axis], shape[axis + 1 :]
    size = int(np.prod([*shape, segments], dtype=np.int64))
    if size > PAIRWISE_LIMIT:
        raise cx.unsupported(
            f"segment_reduce would build an intermediate of {size} elements "
            f"(limit {PAIRWISE_LIMIT})"
        )
    # (..., S, L) membership, then shaped to broadcast against (..., 1, L, *inner)
    where = constant(np.arange(positions), torch.int64)
    member = cai.broadcasting_and(
        ge(where, unsqueeze(starts, [axis + 1])),
        cai.broadcasting_greater(unsqueeze(ends, [axis + 1]), where),
    )
    member = reshape(member, [*shape[:axis], segments, positions] + [1] * len(inner))
    x = unsqueeze(cast(data, dtype), [axis])
    start = _START[reduce] if initial is None else float(initial)
    identity = 1.0 if reduce == "prod" else 0.0 if reduce in ("sum", "mean") else _START[reduce]
    values = pick(member, x, identity, x)
    out = squeeze(_REDUCE[reduce](values, i32([axis + 1])), [axis + 1])
    if reduce in ("max", "min"):
        if initial is not None:
            extreme = cai.broadcasting_maximum if reduce == "max" else cai.broadcasting_minimum
            out = extreme(out, constant(start, dtype))
        has_nan = cai.any_(cai.broadcasting_and(member, cai.not_(not_nan(x))), i32([axis + 1]))
        out = pick(squeeze(has_nan, [axis + 1]), math.nan, out, out)
    elif reduce == "prod":
        out = cai.broadcasting_mul(out, constant(start, dtype))
    else:
        out = add(out, start) if initial is not None else out
    if reduce == "mean":
        counts = cast(cai.broadcasting_sub(ends, starts), dtype)
        counts = reshape(counts, [*shape[:axis], segments] + [1] * len(inner))
        empty = equal(counts, 0.0)
        fallback = math.nan if initial is None else float(initial)
        out = pick(empty, fallback, div(out, counts), out)
    return out
