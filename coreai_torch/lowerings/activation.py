"""Activation functions: relu, gelu, silu, elu, leaky_relu, hardtanh and friends.

``get_decomp_table()`` keeps ``gelu``, ``elu``, ``hardtanh`` and ``leaky_relu``; the others
normally decompose but are lowered too for programs decomposed with a different table.
NaN propagates through every activation like in PyTorch.
"""

from __future__ import annotations

import torch

from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import Scalar, cast, dtype_of
from coreai_torch.lowerings.helpers.arithmetic import (
    clamp_values,
    gt,
    le,
    neg_values,
)
from coreai_torch.lowerings.helpers.float_math import (
    expm1_values,
    log1p_values,
)
from coreai_torch.lowerings.helpers.operands import const_like
from coreai_torch.lowerings.registry import LoweringContext, lowering


def _where_positive(x: ir.Value, positive: ir.Value, other: ir.Value) -> ir.Value:
    """``positive`` where ``x > 0`` else ``other`` (NaN inputs take ``other``)."""
    return cai.broadcasting_where(gt(x, const_like(0, x)), positive, other)


@lowering("aten::relu.default")
def relu(cx: LoweringContext, self: ir.Value) -> ir.Value:
    if dtype_of(self) == torch.bool:
        return self
    return cai.relu(self)


@lowering("aten::relu6.default")
def relu6(cx: LoweringContext, self: ir.Value) -> ir.Value:
    return clamp_values(self, 0, 6)


@lowering("aten::gelu.default")
def gelu(cx: LoweringContext, self: ir.Value, approximate: str = "none") -> ir.Value:
    if approximate not in ("none", "tanh"):
        raise cx.unsupported(f"approximate={approximate!r}")
    return cai.gelu(self, approximate=approximate)


@lowering("aten::silu.default")
def silu(cx: LoweringContext, self: ir.Value) -> ir.Value:
    return cai.silu(self)


@lowering("aten::mish.default")
def mish(cx: LoweringContext, self: ir.Value) -> ir.Value:
    return cai.broadcasting_mul(self, cai.tanh(softplus_values(self, 1.0, 20.0)))


def softplus_values(x: ir.Value, beta: Scalar, threshold: Scalar) -> ir.Value:
    """``log1p(exp(beta x)) / beta``, linear where ``beta x > threshold`` (like PyTorch)."""
    bx = cai.broadcasting_mul(x, const_like(beta, x)) if beta != 1 else x
    soft = log1p_values(cai.exp(bx))
    if beta != 1:
        soft = cai.broadcasting_divide(soft, const_like(beta, x))
    return cai.broadcasting_where(gt(bx, const_like(threshold, x)), x, soft)


@lowering("aten::softplus.default")
def softplus(
    cx: LoweringContext, self: ir.Value, beta: Scalar = 1, threshold: Scalar = 20
) -> ir.Value:
    return softplus_values(self, beta, threshold)


@lowering("aten::elu.default")
def elu(
    cx: LoweringContext,
    self: ir.Value,
    alpha: Scalar = 1,
    scale: Scalar = 1,
    input_scale: Scalar = 1,
) -> ir.Value:
    """``scale * x`` for ``x > 0``, else ``scale * alpha * expm1(input_scale * x)``."""
    x = self
    scaled_in = cai.broadcasting_mul(x, const_like(input_scale, x)) if input_scale != 1 else x
    negative = cai.broadcasting_mul(expm1_values(scaled_in), const_like(alpha * scale, x))
    positive = cai.broadcasting_mul(x, const_like(scale, x)) if scale != 1 else x
    return _where_positive(x, positive, negative)


@lowering("aten::celu.default")
def celu(cx: LoweringContext, self: ir.Value, alpha: Scalar = 1.0) -> ir.Value:
    return elu(cx, self, alpha, 1, 1 / alpha)


@lowering("aten::selu.default")
def selu(cx: LoweringContext, self: ir.Value) -> ir.Value:
    return elu(cx, self, 1.6732632423543772848170429916717, 1.0507009873554804934193349852946)


@lowering("aten::leaky_relu.default")
def leaky_relu(cx: LoweringContext, self: ir.Value, negative_slope: Scalar = 0.01) -> ir.Value:
    x = self
    return _where_positive(x, x, cai.broadcasting_mul(x, const_like(negative_slope, x)))


@lowering("aten::rrelu_with_noise_functional.default")
def rrelu_with_noise(
    cx: LoweringContext,
    self: ir.Value,
    noise: ir.Value,
    lower: Scalar = 0.125,
    upper: Scalar = 1.0 / 3.0,
    training: bool = False,
    generator: object = None,
) -> list[ir.Value]:
    """Inference ``rrelu``: leaky_relu with the mean slope (training mode is random)."""
    if training:
        raise cx.unsupported("rrelu in training mode draws random slopes")
    return [leaky_relu(cx, self, (lower + upper) / 2), noise]


@lowering("aten::hardtanh.default")
def hardtanh(
    cx: LoweringContext, self: ir.Value, min_val: Scalar = -1.0, max_val: Scalar = 1.0
) -> ir.Value:
    return clamp_values(self, min_val, max_val)


@lowering("aten::hardsigmoid.default")
def hardsigmoid(cx: LoweringContext, self: ir.Value) -> ir.Value:
    """``relu6(x + 3) / 6``."""
    x = self
    return cai.broadcasting_divide(
        clamp_values(cai.broadcasting_add(x, const_like(3.0, x)), 0.0, 6.0), const_like(6.0, x)
    )


@lowering("aten::hardswish.default")
def hardswish(cx: LoweringContext, self: ir.Value) -> ir.Value:
    """``x * relu6(x + 3) / 6``."""
    return cai.broadcasting_mul(self, hardsigmoid(cx, self))


@lowering("aten::threshold.default")
def threshold(cx: LoweringContext, self: ir.Value, threshold: Scalar, value: Scalar) -> ir.Value:
    """``x`` where ``x > threshold`` else ``value`` (NaN stays NaN)."""
    x = self
    return cai.broadcasting_where(le(x, const_like(threshold, x)), const_like(value, x), x)


@lowering("aten::hardshrink.default")
def hardshrink(cx: LoweringContext, self: ir.Value, lambd: Scalar = 0.5) -> ir.Value:
    x = self
    inside = le(cai.abs_(x), const_like(lambd, x))
    return cai.broadcasting_where(inside, const_like(0, x), x)


@lowering("aten::softshrink.default")
def softshrink(cx: LoweringContext, self: ir.Value, lambd: Scalar = 0.5) -> ir.Value:
    x = self
    lam = const_like(lambd, x)
    shrunk = cai.broadcasting_where(
        gt(x, lam), cai.broadcasting_sub(x, lam), cai.broadcasting_add(x, lam)
    )
    return cai.broadcasting_where(le(cai.abs_(x), lam), const_like(0, x), shrunk)


@lowering("aten::log_sigmoid_forward.default")
def log_sigmoid_forward(cx: LoweringContext, self: ir.Value) -> list[ir.Value]:
    """``min(x, 0) - log1p(exp(-|x|))``; the buffer output only serves backward."""
    x = self
    value = cai.broadcasting_sub(
        cai.broadcasting_minimum(x, const_like(0, x)),
        log1p_values(cai.exp(neg_values(cai.abs_(x)))),
    )
    return [value, None]


@lowering("aten::_prelu_kernel.default")
def prelu(cx: LoweringContext, self: ir.Value, weight: ir.Value) -> ir.Value:
    x = self
    w = cast(weight, dtype_of(x))
    return _where_positive(x, x, cai.broadcasting_mul(x, w))
