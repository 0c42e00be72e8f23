"""``pixel_shuffle`` (kept whole by ``get_decomp_table()``), emitted as a composite op."""

from __future__ import annotations

import math

from coreai_torch._mlir import ir
from coreai_torch.ir.values import (
    known_sizes,
    rank_of,
    reshape,
    shape_of,
    static_shape_of,
    transpose,
)
from coreai_torch.lowerings.helpers.composite import aten_composite
from coreai_torch.lowerings.registry import LoweringContext, lowering


def _pixel_shuffle(input: ir.Value, factor: int) -> ir.Value:
    """(*, C*r*r, H, W) -> (*, C, H*r, W*r)."""
    *batch, channels, h, w = static_shape_of(input)
    n = math.prod(batch)
    c = channels // (factor * factor)
    x = reshape(input, [n, c, factor, factor, h, w])
    x = transpose(x, [0, 1, 4, 2, 5, 3])  # n, c, h, r, w, r
    return reshape(x, [*batch, c, h * factor, w * factor])


@lowering("aten::pixel_shuffle.default")
def pixel_shuffle(cx: LoweringContext, self: ir.Value, upscale_factor: int) -> ir.Value:
    """The ``pixel_shuffle`` composite op (attribute ``upscale_factor``)."""
    rank = rank_of(self)
    if rank < 3:
        raise cx.unsupported(f"pixel_shuffle needs a tensor of rank >= 3, got rank {rank}")
    shape = known_sizes(shape_of(self))
    if shape is None:
        raise cx.unsupported("pixel_shuffle with dynamic shapes is not supported yet")
    factor = int(upscale_factor)
    if factor <= 0 or shape[-3] % (factor * factor):
        raise cx.unsupported(
            f"pixel_shuffle: {shape[-3]} channels are not divisible by upscale_factor**2 = "
            f"{factor * factor}"
        )
    return aten_composite(
        cx,
        "pixel_shuffle",
        {"input": self},
        {"upscale_factor": factor},
        lambda input: _pixel_shuffle(input, factor),
    )
