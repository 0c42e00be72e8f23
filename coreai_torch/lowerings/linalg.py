"""Matrix products: mm, bmm, addmm, baddbmm, matmul, linear."""

from __future__ import annotations

import torch

from coreai_torch._mlir import cai, ir
from coreai_torch.lowerings.common import (
    cast,
    constant,
    rank_of,
    squeeze,
    transpose,
    unsqueeze,
)
from coreai_torch.lowerings.registry import LoweringContext, lowering


def matmul_values(a: ir.Value, b: ir.Value) -> ir.Value:
    """``torch.matmul`` semantics (vector promotion, batch broadcasting)."""
    ra, rb = rank_of(a), rank_of(b)
    if ra == 1 and rb == 1:
        return squeeze(cai.batch_matmul(unsqueeze(a, [0]), unsqueeze(b, [1])), [0, 1])
    if ra == 1:
        out = cai.broadcasting_batch_matmul(unsqueeze(a, [0]), b)
        return squeeze(out, [rank_of(out) - 2])
    if rb == 1:
        out = cai.broadcasting_batch_matmul(a, unsqueeze(b, [1]))
        return squeeze(out, [rank_of(out) - 1])
    if ra == rb == 2:
        return cai.batch_matmul(a, b)
    return cai.broadcasting_batch_matmul(a, b)


def _scaled(x: ir.Value, factor: float, dtype: torch.dtype) -> ir.Value:
    return x if factor == 1 else cai.broadcasting_mul(x, constant(factor, dtype))


@lowering("aten::mm.default", "aten::bmm.default", "aten::matmul.default")
def mm(
    cx: LoweringContext, self: ir.Value, mat2: ir.Value | None = None, other: ir.Value | None = None
) -> ir.Value:
    dtype = cx.out_dtype
    b = mat2 if mat2 is not None else other
    return matmul_values(cast(self, dtype), cast(b, dtype))


@lowering("aten::addmm.default", "aten::baddbmm.default")
def addmm(
    cx: LoweringContext,
    self: ir.Value,
    mat1: ir.Value | None = None,
    mat2: ir.Value | None = None,
    batch1: ir.Value | None = None,
    batch2: ir.Value | None = None,
    beta: float = 1,
    alpha: float = 1,
) -> ir.Value:
    dtype = cx.out_dtype
    a = mat1 if mat1 is not None else batch1
    b = mat2 if mat2 is not None else batch2
    product = _scaled(matmul_values(cast(a, dtype), cast(b, dtype)), alpha, dtype)
    if beta == 0:
        return product
    return cai.broadcasting_add(product, _scaled(cast(self, dtype), beta, dtype))


@lowering("aten::linear.default")
def linear(
    cx: LoweringContext, input: ir.Value, weight: ir.Value, bias: ir.Value | None = None
) -> ir.Value:
    out = matmul_values(input, transpose(weight, [1, 0]) if rank_of(weight) == 2 else weight)
    return out if bias is None else cai.broadcasting_add(out, bias)
