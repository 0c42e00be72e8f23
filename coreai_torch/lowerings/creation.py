"""Tensor creation: full/zeros/ones/empty (and their *_like / new_* forms), fill, arange,
linspace/logspace, eye and scalar_tensor.  Every result is a constant built at conversion
time from PyTorch's own values, so it matches eager bit for bit."""

from __future__ import annotations

import torch

from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import (
    Scalar,
    Size,
    as_value,
    broadcast_to,
    cast,
    dim_size,
    filled_dynamic,
    is_symbolic,
    rank_of,
    refine,
    reshape,
)
from coreai_torch.lowerings.helpers.layout import filled, static_out_shape, tensor_constant
from coreai_torch.lowerings.registry import LoweringContext, lowering


@lowering(
    "aten::full.default",
    "aten::full_like.default",
    "aten::new_full.default",
)
def full(cx: LoweringContext, fill_value: Scalar | ir.Value, **_: object) -> ir.Value:
    if None in cx.out_shape or isinstance(fill_value, ir.Value):
        return filled_like(cx, _, fill_value)
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
    if None in cx.out_shape:
        return filled_like(cx, _, 0)
    return filled(static_out_shape(cx), 0, cx.out_dtype)


@lowering("aten::ones.default", "aten::ones_like.default", "aten::new_ones.default")
def ones(cx: LoweringContext, **_: object) -> ir.Value:
    if None in cx.out_shape:
        return filled_like(cx, _, 1)
    return filled(static_out_shape(cx), 1, cx.out_dtype)


@lowering("aten::fill.Scalar", "aten::fill.Tensor")
def fill(cx: LoweringContext, self: ir.Value, value: Scalar | ir.Value) -> ir.Value:
    if None in cx.out_shape:
        return filled_like(cx, {"self": self}, value)
    shape = static_out_shape(cx)
    if isinstance(value, ir.Value):
        return broadcast_to(reshape(cast(value, cx.out_dtype), []), shape)
    return filled(shape, value, cx.out_dtype)


@lowering("aten::scalar_tensor.default")
def scalar_tensor(cx: LoweringContext, s: Scalar | ir.Value, **_: object) -> ir.Value:
    if isinstance(s, ir.Value):
        return reshape(cast(s, cx.out_dtype), [])
    return filled([], s, cx.out_dtype)


def _constant_result(cx: LoweringContext) -> ir.Value:
    """The node's result computed by PyTorch at conversion time (its inputs are scalars)."""
    kwargs = {k: v for k, v in cx.node.kwargs.items() if k not in ("device", "pin_memory")}
    target = cx.node.target
    if not callable(target):
        raise cx.unsupported(f"{target!r} is not a function PyTorch can run")
    values = target(*cx.node.args, **kwargs)
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
    if cx.node.target in _ARANGES and is_symbolic([_.get("start"), _.get("end"), _.get("step")]):
        return arange_dynamic(cx, _.get("start", 0), _["end"], _.get("step", 1))
    static_out_shape(cx)
    for arg in [*cx.node.args, *cx.node.kwargs.values()]:
        if isinstance(arg, torch.fx.Node):
            raise cx.unsupported("creating a tensor from runtime (symbolic) sizes is not supported")
    return _constant_result(cx)


# ------------------------------------------------------------------------- dynamic shapes ---

_ARANGES = (
    torch.ops.aten.arange.start_step,
    torch.ops.aten.arange.default,
    torch.ops.aten.arange.start,
)


def filled_like(cx: LoweringContext, args: dict, value: Scalar | ir.Value) -> ir.Value:
    """A tensor filled with ``value`` whose size is symbolic: the op's ``size`` argument, or
    the shape of its ``self`` (``*_like``)."""
    size = args.get("size")
    if size is None:
        size = [dim_size(args["self"], d) for d in range(rank_of(args["self"]))]
    return refine(filled_dynamic(size, value, cx.out_dtype), cx.out_shape)


def arange_dynamic(cx: LoweringContext, start: Size, end: Size, step: Size) -> ir.Value:
    """``arange`` with runtime bounds (``coreai.range`` in the result dtype)."""
    dtype = cx.out_dtype
    if dtype not in (torch.int64, torch.int32, torch.float32):
        raise cx.unsupported(f"arange with runtime bounds in {dtype}")
    bounds = [reshape(as_value(v, dtype), []) for v in (start, end, step)]
    return cai.range_(*bounds)
