"""Tensor creation: full, *_like, arange, scalar_tensor, empty (as zeros)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from coreai_torch._mlir import cai, ir
from coreai_torch.lowerings.common import Scalar, constant
from coreai_torch.lowerings.registry import LoweringContext, lowering


def filled(shape: Sequence[int], value: Scalar, dtype: torch.dtype) -> ir.Value:
    """A constant tensor of ``shape`` filled with ``value`` (stored as a splat)."""
    if dtype == torch.bfloat16:
        return cai.constant(np.full(list(shape), value, np.float32), dtype=ir.BF16Type.get())
    return constant(np.full(list(shape), value), dtype)


def _static(cx: LoweringContext) -> list[int]:
    shape = cx.out_shape
    if None in shape:
        raise cx.unsupported("creating a tensor with a dynamic shape is not supported yet")
    return [int(d) for d in shape]


@lowering("aten::full.default", "aten::full_like.default", "aten::new_full.default")
def full(cx: LoweringContext, fill_value: Scalar, **_: object) -> ir.Value:
    return filled(_static(cx), fill_value, cx.out_dtype)


@lowering(
    "aten::zeros.default",
    "aten::zeros_like.default",
    "aten::new_zeros.default",
    "aten::empty.memory_format",
    "aten::empty_like.default",
    "aten::new_empty.default",
    "aten::empty_strided.default",
    "aten::empty_permuted.default",
)
def zeros(cx: LoweringContext, **_: object) -> ir.Value:
    return filled(_static(cx), 0, cx.out_dtype)


@lowering("aten::ones.default", "aten::ones_like.default", "aten::new_ones.default")
def ones(cx: LoweringContext, **_: object) -> ir.Value:
    return filled(_static(cx), 1, cx.out_dtype)


@lowering("aten::scalar_tensor.default")
def scalar_tensor(cx: LoweringContext, s: Scalar, **_: object) -> ir.Value:
    return filled([], s, cx.out_dtype)


@lowering("aten::arange.start_step", "aten::arange.default", "aten::arange.start")
def arange(
    cx: LoweringContext,
    start: Scalar = 0,
    end: Scalar | None = None,
    step: Scalar = 1,
    **_: object,
) -> ir.Value:
    if end is None:
        start, end = 0, start
    values = torch.arange(start, end, step, dtype=cx.out_dtype)
    if values.dtype == torch.bfloat16:
        return cai.constant(values.float().numpy(), dtype=ir.BF16Type.get())
    return cai.constant(values.numpy())
