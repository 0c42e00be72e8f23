"""Matrix products: mm, bmm, matmul, addmm, baddbmm, addmv, addbmm, ``_trilinear`` (bilinear)
and linear.

16-bit operands accumulate in float32 and round once, like ATen
(:mod:`coreai_torch.lowerings.helpers.accumulation`); ``addmm``-style ops add the scaled
``self`` in the same precision before rounding.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import (
    broadcast_to,
    cast,
    constant,
    i32,
    rank_of,
    shape_of,
    squeeze,
    transpose,
    unsqueeze,
)
from coreai_torch.lowerings.helpers.accumulation import accumulation_dtype
from coreai_torch.lowerings.helpers.layout import static_out_shape
from coreai_torch.lowerings.helpers.matrices import (
    batched_matmul,
    matmul_values,
)
from coreai_torch.lowerings.registry import LoweringContext, lowering


def _scaled(x: ir.Value, factor: float, dtype: torch.dtype) -> ir.Value:
    return x if factor == 1 else cai.broadcasting_mul(x, constant(factor, dtype))


@lowering("aten::mm.default", "aten::bmm.default", "aten::matmul.default")
def mm(
    cx: LoweringContext, self: ir.Value, mat2: ir.Value | None = None, other: ir.Value | None = None
) -> ir.Value:
    dtype = cx.out_dtype
    b = mat2 if mat2 is not None else other
    return matmul_values(cx, cast(self, dtype), cast(b, dtype))


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
    a = mat1 if mat1 is not None else batch1
    b = mat2 if mat2 is not None else batch2
    return _accumulate(
        cx, self, lambda dtype: batched_matmul(cast(a, dtype), cast(b, dtype)), beta, alpha
    )


def _accumulate(
    cx: LoweringContext,
    self: ir.Value,
    product: Callable[[torch.dtype], ir.Value],
    beta: float,
    alpha: float,
) -> ir.Value:
    """``beta * self + alpha * product(dtype)``, computed in float32 for 16-bit results
    (rounded once, like ATen); ``self`` is ignored when ``beta`` is 0 (so NaN in it does not
    propagate), as in PyTorch."""
    dtype = cx.out_dtype
    compute = accumulation_dtype(cx, dtype)
    product = _scaled(product(compute), alpha, compute)
    if beta == 0:
        if shape_of(product) != cx.out_shape:
            product = broadcast_to(product, static_out_shape(cx))
        return cast(product, dtype)
    return cast(cai.broadcasting_add(product, _scaled(cast(self, compute), beta, compute)), dtype)


@lowering("aten::addmv.default")
def addmv(
    cx: LoweringContext,
    self: ir.Value,
    mat: ir.Value,
    vec: ir.Value,
    beta: float = 1,
    alpha: float = 1,
) -> ir.Value:
    return _accumulate(
        cx, self, lambda dtype: batched_matmul(cast(mat, dtype), cast(vec, dtype)), beta, alpha
    )


@lowering("aten::addbmm.default")
def addbmm(
    cx: LoweringContext,
    self: ir.Value,
    batch1: ir.Value,
    batch2: ir.Value,
    beta: float = 1,
    alpha: float = 1,
) -> ir.Value:
    def product(dtype: torch.dtype) -> ir.Value:
        products = cai.batch_matmul(cast(batch1, dtype), cast(batch2, dtype))
        return squeeze(cai.reduce_sum(products, i32([0])), [0])

    return _accumulate(cx, self, product, beta, alpha)


@lowering("aten::_trilinear.default")
def trilinear(
    cx: LoweringContext,
    i1: ir.Value,
    i2: ir.Value,
    i3: ir.Value,
    expand1: list[int],
    expand2: list[int],
    expand3: list[int],
    sumdim: list[int],
    unroll_dim: int = 1,
) -> ir.Value:
    """``sum(i1' * i2' * i3', sumdim)`` with each input unsqueezed at its ``expand`` dims
    (``unroll_dim`` only chooses how PyTorch loops)."""
    dtype = cx.out_dtype
    product = None
    for value, expand in ((i1, expand1), (i2, expand2), (i3, expand3)):
        term = unsqueeze(cast(value, dtype), sorted(expand))
        product = term if product is None else cai.broadcasting_mul(product, term)
    assert product is not None
    if not sumdim:
        return product
    return squeeze(cai.reduce_sum(product, i32(sorted(sumdim))), sorted(sumdim))


@lowering("aten::linear.default")
def linear(
    cx: LoweringContext, input: ir.Value, weight: ir.Value, bias: ir.Value | None = None
) -> ir.Value:
    out = matmul_values(cx, input, transpose(weight, [1, 0]) if rank_of(weight) == 2 else weight)
    return out if bias is None else cai.broadcasting_add(out, bias)
