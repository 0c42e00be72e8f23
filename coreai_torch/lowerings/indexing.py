"""Indexing: embedding, gather, index.Tensor (advanced indexing)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from coreai_torch._mlir import cai, ir
from coreai_torch.lowerings.common import (
    broadcast_to,
    cast,
    constant,
    dtype_of,
    i32,
    normalize_dim,
    rank_of,
    shape_of,
    transpose,
    unsqueeze,
)
from coreai_torch.lowerings.registry import LoweringContext, lowering


def wrap_indices(indices: ir.Value, size: int | None) -> ir.Value:
    """Indices as si32 with negative values wrapped (PyTorch allows ``-1`` for the last)."""
    idx = cast(indices, torch.int32)
    if size is None:
        return idx
    negative = cai.broadcasting_greater(constant(0, torch.int32), idx)
    return cai.broadcasting_where(
        negative, cai.broadcasting_add(idx, constant(size, torch.int32)), idx
    )


@lowering("aten::embedding.default")
def embedding(
    cx: LoweringContext,
    weight: ir.Value,
    indices: ir.Value,
    padding_idx: int = -1,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> ir.Value:
    idx = wrap_indices(indices, shape_of(weight)[0])
    return cai.gather_nd(weight, unsqueeze(idx, [rank_of(idx)]))


@lowering("aten::index.Tensor")
def index(cx: LoweringContext, self: ir.Value, indices: Sequence[ir.Value | None]) -> ir.Value:
    shape = shape_of(self)
    positions = [i for i, ix in enumerate(indices) if ix is not None]
    if not positions:
        return self
    if positions != list(range(positions[0], positions[-1] + 1)):
        raise cx.unsupported("non-adjacent advanced indices are not supported yet")
    tensors = [indices[i] for i in positions]
    if any(dtype_of(t) == torch.bool for t in tensors):
        raise cx.unsupported("boolean mask indexing has a data-dependent shape")
    first = positions[0]
    # Move the indexed dims to the front, gather with stacked indices, move the result back.
    rank = len(shape)
    perm = positions + [d for d in range(rank) if d not in positions]
    x = transpose(self, perm)
    bshape = list(torch.broadcast_shapes(*[tuple(shape_of(t)) for t in tensors]))
    stacked = [
        unsqueeze(broadcast_to(wrap_indices(t, shape[p]), bshape), [len(bshape)])
        for t, p in zip(tensors, positions, strict=True)
    ]
    gather_idx = stacked[0] if len(stacked) == 1 else cai.concat(i32(len(bshape)), stacked)
    out = cai.gather_nd(x, gather_idx)
    if first == 0:
        return out
    # PyTorch puts the broadcast index dims where the first indexed dim was.
    nb = len(bshape)
    rest = rank - len(positions)
    out_perm = list(range(nb, nb + first)) + list(range(nb)) + list(range(nb + first, nb + rest))
    return transpose(out, out_perm)


@lowering("aten::gather.default")
def gather(
    cx: LoweringContext, self: ir.Value, dim: int, index: ir.Value, sparse_grad: bool = False
) -> ir.Value:
    d = normalize_dim(dim, rank_of(self))
    idx = wrap_indices(index, shape_of(self)[d])
    return cai.gather_along_axis(self, idx, i32(d))
