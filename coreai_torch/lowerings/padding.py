"""Padding: constant_pad_nd (negative pads crop), reflection_pad{1,2,3}d and
replication_pad{1,2,3}d (Core AI ``pad`` modes)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import Scalar, constant, dtype_of, rank_of, shape_of, slice_dynamic
from coreai_torch.lowerings.helpers.layout import (
    slice_axis,
    static_shape,
)
from coreai_torch.lowerings.registry import LoweringContext, lowering


def pad_amounts(rank: int, pad: Sequence[int]) -> list[tuple[int, int]]:
    """PyTorch's last-dim-first ``pad`` list as (before, after) per dim, dim 0 first."""
    pairs = [(0, 0)] * rank
    for i in range(len(pad) // 2):
        pairs[rank - 1 - i] = (int(pad[2 * i]), int(pad[2 * i + 1]))
    return pairs


def pad_dims(
    x: ir.Value, pairs: Sequence[tuple[int, int]], value: Scalar = 0, mode: str = "constant"
) -> ir.Value:
    """Pad (or crop, for negative amounts) every dim by its (before, after) pair."""
    shape = shape_of(x)
    for axis, (before, after) in enumerate(pairs):  # crop first
        if before >= 0 and after >= 0:
            continue
        size = shape[axis]
        if size is None:  # dynamic dim: Python bounds
            x = slice_dynamic(x, axis, max(0, -before), after if after < 0 else None)
        else:
            start, end = max(0, -before), size - max(0, -after)
            x = slice_axis(x, axis, start, end)
            shape[axis] = end - start
    flat = [max(0, a) for pair in pairs for a in pair]
    if not any(flat):
        return x
    fill = constant(value, dtype_of(x))
    return cai.pad(x, np.array(flat, np.uint32), fill, padding_mode=mode)


@lowering("aten::constant_pad_nd.default")
def constant_pad_nd(
    cx: LoweringContext, self: ir.Value, pad: Sequence[int], value: Scalar = 0
) -> ir.Value:
    return pad_dims(self, pad_amounts(rank_of(self), pad), value)


def _mode_pad(cx: LoweringContext, self: ir.Value, padding: Sequence[int], mode: str):
    """Reflect/replicate/circular padding; negative amounts crop after padding (PyTorch
    reflects and replicates relative to the original input)."""
    shape = static_shape(cx, self)
    pairs = pad_amounts(len(shape), padding)
    if mode == "reflect":
        for (b, a), n in zip(pairs, shape, strict=True):
            if max(b, a) >= n:
                raise cx.unsupported("reflection padding must be smaller than the input size")
    grown = pad_dims(self, [(max(b, 0), max(a, 0)) for b, a in pairs], 0, mode)
    return pad_dims(grown, [(min(b, 0), min(a, 0)) for b, a in pairs])


@lowering(
    "aten::reflection_pad1d.default",
    "aten::reflection_pad2d.default",
    "aten::reflection_pad3d.default",
)
def reflection_pad(cx: LoweringContext, self: ir.Value, padding: Sequence[int]) -> ir.Value:
    return _mode_pad(cx, self, padding, "reflect")


@lowering(
    "aten::replication_pad1d.default",
    "aten::replication_pad2d.default",
    "aten::replication_pad3d.default",
)
def replication_pad(cx: LoweringContext, self: ir.Value, padding: Sequence[int]) -> ir.Value:
    return _mode_pad(cx, self, padding, "replicate")


@lowering("aten::_pad_circular.default")
def pad_circular(cx: LoweringContext, self: ir.Value, pad: Sequence[int]) -> ir.Value:
    return _mode_pad(cx, self, pad, "circular")
