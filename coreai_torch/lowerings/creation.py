"""Tensor creation: full/zeros/ones/empty (and their *_like / new_* forms), fill, arange,
linspace/logspace, eye and scalar_tensor.  Every result is a constant built at conversion
time from PyTorch's own values, so it matches eager bit for bit."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from coreai_torch._mlir import cai, ir
from coreai_torch.lowerings.common import Scalar, broadcast_to, cast, constant, reshape
from coreai_torch.lowerings.layout import static_out_shape
from coreai_torch.lowerings.registry import LoweringContext, lowering


def filled(shape: Sequence[int], value: Scalar, dtype: torch.dtype) -> ir.Value:
    """A constant tensor of ``shape`` filled with ``value`` (stored as a splat)."""
    scalar = torch.tensor(value).to(dtype)  # PyTorch's own conversion (wrapping, rounding)
    return tensor_constant(scalar.expand(list(shape)))


def tensor_constant(values: torch.Tensor) -> ir.Value:
    """A constant holding a (small) torch tensor, in its dtype."""
    if values.dtype == torch.bfloat16:
        return cai.constant(np.array(values.float().numpy()), dtype=ir.BF16Type.get())
    return constant(np.array(values.numpy()), values.dtype)


@lowering(
    "aten::full.default",
    "aten::full_like.default",
    "aten::new_full.default",
)
def full(cx: LoweringContext, fill_value: Scalar, **_: object) -> ir.Value:
    return filled(static_out_shape(cx), fill_value, cx.out_dtype)


@lowering(
    "aten::zeros.default",
    "aten::zeros_like.default",
    "aten::new_zeros.default",
    "aten::empty.memory_format",
    "aten::empty.default",
    "aten::empty_like.default",
    "aten::new_empty.default",
    "aten::new_empty_strided.default",
    "aten::empty_strided.default",
    "aten::empty_permuted.default",
)
def zeros(cx: LoweringContext, **_: object) -> ir.Value:
    """Zeros (``empty`` is uninitialised in PyTorch; zeros are one valid content)."""
    return filled(static_out_shape(cx), 0, cx.out_dtype)


@lowering("aten::ones.default", "aten::ones_like.default", "aten::new_ones.default")
def ones(cx: LoweringContext, **_: object) -> ir.Value:
    return filled(static_out_shape(cx), 1, cx.out_dtype)


@lowering("aten::fill.Scalar", "aten::fill.Tensor")
def fill(cx: LoweringContext, self: ir.Value, value: Scalar | ir.Value) -> ir.Value:
    shape = static_out_shape(cx)
    if isinstance(value, ir.Value):
        return broadcast_to(reshape(cast(value, cx.out_dtype), []), shape)
    return filled(shape, value, cx.out_dtype)


@lowering("aten::scalar_tensor.default")
def scalar_tensor(cx: LoweringContext, s: Scalar, **_: object) -> ir.Value:
    return filled([], s, cx.out_dtype)


def _constant_result(cx: LoweringContext) -> ir.Value:
    """The node's result computed by PyTorch at conversion time (its inputs are scalars)."""
    kwargs = {k: v for k, v in cx.node.kwargs.items() if k not in ("device", "pin_memory")}
    values = cx.node.target(*cx.node.args, **kwargs)
    return tensor_constant(values)


@lowering(
    "aten::arange.start_step",
    "aten::arange.default",
    "aten::arange.start",
    "aten::linspace.default",
    "aten::logspace.default",
    "aten::eye.default",
    "aten::eye.m",
    "aten::triu_indices.default",
    "aten::tril_indices.default",
)
def arange(cx: LoweringContext, **_: object) -> ir.Value:
    static_out_shape(cx)
    for arg in [*cx.node.args, *cx.node.kwargs.values()]:
        if isinstance(arg, torch.fx.Node):
            raise cx.unsupported("creating a tensor from runtime (symbolic) sizes is not supported")
    return _constant_result(cx)
