"""Normalisations and softmax: batch/layer/RMS/group/instance norm, softmax, log_softmax.

``layer_norm``, ``rms_norm``, ``group_norm`` and ``instance_norm`` (kept whole by
``get_decomp_table()``) are emitted as composite ops named after the ATen op: a private graph
holding the reference implementation, marked with a composite declaration and invoked from the
caller.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.fx

from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import (
    cast,
    constant,
    dim_size,
    dtype_of,
    i32,
    known_sizes,
    normalize_dim,
    rank_of,
    reshape,
    reshape_dynamic,
    shape_of,
    static_dim,
)
from coreai_torch.lowerings.helpers.composite import aten_composite
from coreai_torch.lowerings.helpers.operands import opmath
from coreai_torch.lowerings.registry import LoweringContext, lowering


def _channel_shaped(v: ir.Value, rank: int) -> ir.Value:
    """A per-channel (C,) vector reshaped to broadcast over N, C, *spatial."""
    return reshape(v, [1, static_dim(v, 0)] + [1] * (rank - 2)) if rank >= 2 else v


def _channel_affine(
    y: ir.Value, weight: ir.Value | None, bias: ir.Value | None, rank: int
) -> ir.Value:
    """``y * weight + bias`` with per-channel (C,) weight and bias."""
    return _affine(
        y,
        _channel_shaped(weight, rank) if weight is not None else None,
        _channel_shaped(bias, rank) if bias is not None else None,
    )


def moments(x: ir.Value, axes: list[int], eps: float) -> tuple[ir.Value, ir.Value, ir.Value]:
    """``(normalized, mean, rstd)`` over ``axes`` (biased variance; reduced dims kept)."""
    return _moments_and_variance(x, axes, eps)[:3]


def _moments_and_variance(
    x: ir.Value, axes: list[int], eps: float
) -> tuple[ir.Value, ir.Value, ir.Value, ir.Value]:
    """:func:`moments` plus the biased variance (reduced dims kept)."""
    dtype = dtype_of(x)
    mean = cai.reduce_mean(x, i32(axes))
    centered = cai.broadcasting_sub(x, mean)
    var = cai.reduce_mean(cai.broadcasting_mul(centered, centered), i32(axes))
    rstd = cai.rsqrt(cai.broadcasting_add(var, constant(eps, dtype)))
    return cai.broadcasting_mul(centered, rstd), mean, rstd, var


def normalize(x: ir.Value, axes: list[int], eps: float) -> ir.Value:
    """``(x - mean) / sqrt(var + eps)`` over ``axes`` (biased variance)."""
    return moments(x, axes, eps)[0]


def _in_opmath(body: Callable[..., ir.Value]) -> Callable[..., ir.Value]:
    """``body(input, ...)`` computed in float32 for a 16-bit ``input`` and rounded back once,
    like ATen's CPU norms (the squares of the variance overflow float16 from 256 up)."""

    @functools.wraps(body)
    def wrapper(input: ir.Value, *args: Any) -> ir.Value:
        dtype = dtype_of(input)
        compute = opmath(dtype)
        if compute == dtype:
            return body(input, *args)
        return cast(body(cast(input, compute), *args), dtype)

    return wrapper


def _affine(y: ir.Value, weight: ir.Value | None, bias: ir.Value | None) -> ir.Value:
    if weight is not None:
        y = cai.broadcasting_mul(y, cast(weight, dtype_of(y)))
    if bias is not None:
        y = cai.broadcasting_add(y, cast(bias, dtype_of(y)))
    return y


@lowering("aten::_native_batch_norm_legit_no_training.default")
def batch_norm_inference(
    cx: LoweringContext,
    input: ir.Value,
    weight: ir.Value | None,
    bias: ir.Value | None,
    running_mean: ir.Value,
    running_var: ir.Value,
    momentum: float,
    eps: float,
) -> list[ir.Value | None]:
    return [_batch_norm(input, weight, bias, running_mean, running_var, eps), None, None]


def _batch_norm(
    input: ir.Value,
    weight: ir.Value | None,
    bias: ir.Value | None,
    running_mean: ir.Value,
    running_var: ir.Value,
    eps: float,
) -> ir.Value:
    """Batch norm with running statistics: ``x * scale + shift``, the per-channel ``scale``
    and ``shift`` computed in float32 for a 16-bit input (a variance of 1e5 overflows float16)
    and applied in the input's dtype, so the rewrite can still fold them into a convolution."""
    rank = rank_of(input)
    dtype = opmath(dtype_of(input))
    mean = _channel_shaped(cast(running_mean, dtype), rank)
    var = _channel_shaped(cast(running_var, dtype), rank)
    scale = cai.rsqrt(cai.broadcasting_add(var, constant(eps, dtype)))
    if weight is not None:
        scale = cai.broadcasting_mul(scale, _channel_shaped(cast(weight, dtype), rank))
    # x * scale + (bias - mean * scale): Core AI's pre-compilation rewrite folds this form into
    # a preceding convolution correctly, while it mis-folds `(conv(x) - mean) * scale`.
    shift = cai.broadcasting_sub(constant(0.0, dtype), cai.broadcasting_mul(mean, scale))
    if bias is not None:
        shift = cai.broadcasting_add(shift, _channel_shaped(cast(bias, dtype), rank))
    out = dtype_of(input)
    return cai.broadcasting_add(cai.broadcasting_mul(input, cast(scale, out)), cast(shift, out))


def _batch_statistics(x: ir.Value, eps: float) -> tuple[ir.Value, ir.Value, ir.Value, ir.Value]:
    """``(normalized, mean, rstd, biased var)`` over every dim but the channel dim 1; the
    statistics are (C,) vectors."""
    axes = [0, *range(2, rank_of(x))]
    y, *statistics = _moments_and_variance(x, axes, eps)
    channels = [static_dim(x, 1)]
    mean, rstd, var = (reshape(v, channels) for v in statistics)
    return y, mean, rstd, var


def _updated_running_stats(
    cx: LoweringContext,
    x: ir.Value,
    mean: ir.Value,
    var: ir.Value,
    running_mean: ir.Value,
    running_var: ir.Value,
    momentum: float,
) -> tuple[ir.Value, ir.Value]:
    """PyTorch's running-stat update: ``(1 - m) * running + m * batch`` with the unbiased
    batch variance."""
    shape = known_sizes(shape_of(x))
    if shape is None:
        raise cx.unsupported("updating running statistics of an input with dynamic shape")
    count = math.prod(shape) // shape[1]
    correction = count / (count - 1) if count > 1 else math.inf

    def blend(running: ir.Value, batch: ir.Value, scale: float) -> ir.Value:
        dtype = dtype_of(running)
        keep = cai.broadcasting_mul(running, constant(1.0 - momentum, dtype))
        new = cai.broadcasting_mul(cast(batch, dtype), constant(momentum * scale, dtype))
        return cai.broadcasting_add(keep, new)

    return blend(running_mean, mean, 1.0), blend(running_var, var, correction)


@lowering("aten::_native_batch_norm_legit.no_stats")
def batch_norm_batch_stats(
    cx: LoweringContext,
    input: ir.Value,
    weight: ir.Value | None,
    bias: ir.Value | None,
    training: bool,
    momentum: float,
    eps: float,
) -> list[ir.Value | None]:
    """Batch norm with the batch's own statistics (``track_running_stats=False``, also in
    eval mode)."""
    if not training:
        raise cx.unsupported("batch norm without running statistics needs training=True")
    y, mean, rstd, _ = _batch_statistics(input, eps)
    _, mean_val, rstd_val = cx.out
    out = _channel_affine(y, weight, bias, rank_of(input))
    return [out, cast(mean, mean_val.dtype), cast(rstd, rstd_val.dtype)]


@lowering("aten::_native_batch_norm_legit_functional.default")
def batch_norm_functional(
    cx: LoweringContext,
    input: ir.Value,
    weight: ir.Value | None,
    bias: ir.Value | None,
    running_mean: ir.Value,
    running_var: ir.Value,
    training: bool,
    momentum: float,
    eps: float,
) -> list[ir.Value | None]:
    """Training-mode batch norm: normalizes with the batch statistics and returns the updated
    running statistics (which the program stores back into its state)."""
    if not training:
        out = batch_norm_inference(
            cx, input, weight, bias, running_mean, running_var, momentum, eps
        )[0]
        return [out, None, None, running_mean, running_var]
    y, mean, rstd, var = _batch_statistics(input, eps)
    new_mean, new_var = _updated_running_stats(
        cx, input, mean, var, running_mean, running_var, momentum
    )
    _, mean_val, rstd_val, _, _ = cx.out
    out = _channel_affine(y, weight, bias, rank_of(input))
    return [out, cast(mean, mean_val.dtype), cast(rstd, rstd_val.dtype), new_mean, new_var]


@lowering("aten::_batch_norm_with_update_functional.default")
def batch_norm_with_update_functional(
    cx: LoweringContext,
    input: ir.Value,
    weight: ir.Value | None,
    bias: ir.Value | None,
    running_mean: ir.Value,
    running_var: ir.Value,
    momentum: float,
    eps: float,
) -> list[ir.Value | None]:
    """``_batch_norm_with_update`` without mutation: like the training-mode functional op,
    plus an (empty, unused) reserve buffer."""
    out, mean, rstd, new_mean, new_var = batch_norm_functional(
        cx, input, weight, bias, running_mean, running_var, True, momentum, eps
    )
    return [out, mean, rstd, None, new_mean, new_var]


@lowering("aten::_native_batch_norm_legit.default")
def batch_norm_legit(
    cx: LoweringContext,
    input: ir.Value,
    weight: ir.Value | None,
    bias: ir.Value | None,
    running_mean: ir.Value,
    running_var: ir.Value,
    training: bool,
    momentum: float,
    eps: float,
) -> list[ir.Value | None]:
    """The in-place form: with ``training=False`` it is inference batch norm; in training mode
    it updates the running statistics in place, which exported programs express with
    ``_native_batch_norm_legit_functional`` instead."""
    if training:
        raise cx.unsupported(
            "training-mode batch norm updating running statistics in place; export the model "
            "with torch.export (which makes the update functional) or call model.eval()"
        )
    out = batch_norm_inference(cx, input, weight, bias, running_mean, running_var, momentum, eps)
    return [out[0], None, None]


@_in_opmath
def _layer_norm(
    input: ir.Value,
    weight: ir.Value | None,
    bias: ir.Value | None,
    normalized_shape: Sequence[int],
    eps: float,
) -> ir.Value:
    rank = rank_of(input)
    axes = list(range(rank - len(normalized_shape), rank))
    return _affine(normalize(input, axes, eps), weight, bias)


@lowering("aten::layer_norm.default")
def layer_norm(
    cx: LoweringContext,
    input: ir.Value,
    normalized_shape: Sequence[int],
    weight: ir.Value | None = None,
    bias: ir.Value | None = None,
    eps: float = 1e-5,
    cudnn_enable: bool = True,
) -> ir.Value:
    """The ``layer_norm`` composite op (attributes ``normalized_shape``, ``eps``)."""
    normalized_shape = [int(d) for d in normalized_shape]
    return aten_composite(
        cx,
        "layer_norm",
        {"input": input, "weight": weight, "bias": bias},
        {"normalized_shape": normalized_shape, "eps": float(eps)},
        lambda input, weight, bias: _layer_norm(input, weight, bias, normalized_shape, eps),
    )


def _rms_norm(
    input: ir.Value,
    weight: ir.Value | None,
    normalized_shape: Sequence[int],
    eps: float,
    out_dtype: torch.dtype,
) -> ir.Value:
    """ATen's ``rms_norm``: ``x * rsqrt(mean(x², normalized dims) + eps) * weight`` computed
    in float32 for 16-bit inputs, then cast to the result dtype."""
    compute = opmath(dtype_of(input))
    x = cast(input, compute)
    rank = rank_of(x)
    axes = i32(list(range(rank - len(normalized_shape), rank)))
    mean_square = cai.reduce_mean(cai.broadcasting_mul(x, x), axes)
    y = cai.broadcasting_mul(
        x, cai.rsqrt(cai.broadcasting_add(mean_square, constant(eps, compute)))
    )
    if weight is not None:
        y = cai.broadcasting_mul(y, cast(weight, compute))
    return cast(y, out_dtype)


@lowering("aten::rms_norm.default")
def rms_norm(
    cx: LoweringContext,
    input: ir.Value,
    normalized_shape: Sequence[int],
    weight: ir.Value | None = None,
    eps: float | None = None,
) -> ir.Value:
    """The ``rms_norm`` composite op (attributes ``normalized_shape``, ``eps``; an ``eps`` of
    None is resolved to PyTorch's default, the machine epsilon of the compute dtype).  The
    hand-written RMSNorms :func:`~coreai_torch.frontend.fusions.fuse_patterns` finds become
    this op too."""
    if eps is None:
        eps = torch.finfo(opmath(dtype_of(input))).eps
    normalized_shape = [int(d) for d in normalized_shape]
    return aten_composite(
        cx,
        "rms_norm",
        {"input": input, "weight": weight},
        {"normalized_shape": normalized_shape, "eps": float(eps)},
        lambda input, weight: _rms_norm(input, weight, normalized_shape, eps, cx.out_dtype),
    )


@lowering("aten::native_layer_norm.default")
def native_layer_norm(
    cx: LoweringContext,
    input: ir.Value,
    normalized_shape: Sequence[int],
    weight: ir.Value | None,
    bias: ir.Value | None,
    eps: float,
) -> list[ir.Value | None]:
    """``layer_norm`` plus its ``mean`` and ``rstd`` (inline: not a composite op; in float32
    for 16-bit inputs)."""
    rank = rank_of(input)
    axes = list(range(rank - len(normalized_shape), rank))
    y, mean, rstd = moments(cast(input, opmath(dtype_of(input))), axes, eps)
    out_val, mean_val, rstd_val = cx.out
    return [
        cast(_affine(y, weight, bias), out_val.dtype),
        cast(mean, mean_val.dtype),
        cast(rstd, rstd_val.dtype),
    ]


@lowering("aten::native_group_norm.default")
def native_group_norm(
    cx: LoweringContext,
    input: ir.Value,
    weight: ir.Value | None,
    bias: ir.Value | None,
    N: int,
    C: int,
    HxW: int,
    group: int,
    eps: float,
) -> list[ir.Value]:
    """``group_norm`` plus its ``(N, group)`` mean and rstd (inline: not a composite op; in
    float32 for 16-bit inputs)."""
    shape = known_sizes(shape_of(input))
    if shape is None:
        raise cx.unsupported("native_group_norm with dynamic shapes is not supported yet")
    x = cast(input, opmath(dtype_of(input)))
    grouped = reshape(x, [shape[0], group, math.prod(shape[1:]) // group])
    y, mean, rstd = moments(grouped, [2], eps)
    out_val, mean_val, rstd_val = cx.out
    return [
        cast(_channel_affine(reshape(y, shape), weight, bias, len(shape)), out_val.dtype),
        cast(reshape(mean, [shape[0], group]), mean_val.dtype),
        cast(reshape(rstd, [shape[0], group]), rstd_val.dtype),
    ]


@_in_opmath
def _group_norm(
    input: ir.Value,
    weight: ir.Value | None,
    bias: ir.Value | None,
    num_groups: int,
    eps: float,
) -> ir.Value:
    shape = shape_of(input)
    rank = len(shape)
    static = known_sizes(shape)
    if static is None:  # dynamic batch / spatial dims: runtime shape operands
        sizes = [dim_size(input, d) for d in range(rank)]
        features = known_sizes(shape[1:])
        inner = None if features is None else math.prod(features) // num_groups
        grouped = reshape_dynamic(input, [sizes[0], num_groups, -1], [shape[0], num_groups, inner])
        y = reshape_dynamic(normalize(grouped, [2], eps), sizes, shape)
        return _channel_affine(y, weight, bias, rank)
    grouped = reshape(input, [static[0], num_groups, math.prod(static[1:]) // num_groups])
    y = reshape(normalize(grouped, [2], eps), static)
    return _channel_affine(y, weight, bias, rank)


@lowering("aten::group_norm.default")
def group_norm(
    cx: LoweringContext,
    input: ir.Value,
    num_groups: int,
    weight: ir.Value | None = None,
    bias: ir.Value | None = None,
    eps: float = 1e-5,
    cudnn_enabled: bool = True,
) -> ir.Value:
    """The ``group_norm`` composite op (attributes ``num_groups``, ``eps``)."""
    return aten_composite(
        cx,
        "group_norm",
        {"input": input, "weight": weight, "bias": bias},
        {"num_groups": int(num_groups), "eps": float(eps)},
        lambda input, weight, bias: _group_norm(input, weight, bias, num_groups, eps),
    )


@_in_opmath
def _instance_norm(
    input: ir.Value,
    weight: ir.Value | None,
    bias: ir.Value | None,
    running_mean: ir.Value | None,
    running_var: ir.Value | None,
    use_input_stats: bool,
    eps: float,
) -> ir.Value:
    rank = rank_of(input)
    if not use_input_stats:
        dtype = dtype_of(input)
        mean = _channel_shaped(cast(running_mean, dtype), rank)
        var = _channel_shaped(cast(running_var, dtype), rank)
        inv = cai.rsqrt(cai.broadcasting_add(var, constant(eps, dtype)))
        y = cai.broadcasting_mul(cai.broadcasting_sub(input, mean), inv)
    else:
        y = normalize(input, list(range(2, rank)), eps)
    return _channel_affine(y, weight, bias, rank)


@lowering("aten::instance_norm.default")
def instance_norm(
    cx: LoweringContext,
    input: ir.Value,
    weight: ir.Value | None,
    bias: ir.Value | None,
    running_mean: ir.Value | None,
    running_var: ir.Value | None,
    use_input_stats: bool,
    momentum: float,
    eps: float,
    cudnn_enabled: bool,
) -> ir.Value:
    """The ``instance_norm`` composite op (attributes ``use_input_stats``, ``momentum``,
    ``eps``)."""
    if not use_input_stats and (running_mean is None or running_var is None):
        raise cx.unsupported("instance_norm without input stats needs running stats")
    if use_input_stats:  # running stats are only updated in training: not inputs then
        running_mean = running_var = None
    return aten_composite(
        cx,
        "instance_norm",
        {
            "input": input,
            "weight": weight,
            "bias": bias,
            "running_mean": running_mean,
            "running_var": running_var,
        },
        {"use_input_stats": bool(use_input_stats), "momentum": float(momentum), "eps": float(eps)},
        lambda input, weight, bias, running_mean, running_var: _instance_norm(
            input, weight, bias, running_mean, running_var, use_input_stats, eps
        ),
    )


@lowering("aten::_softmax.default", "aten::softmax.int")
def softmax(
    cx: LoweringContext,
    self: ir.Value,
    dim: int,
    half_to_float: bool = False,
    dtype: torch.dtype | None = None,
) -> ir.Value:
    x = cast(self, cx.out_dtype)
    if rank_of(x) == 0:
        return constant(1.0, cx.out_dtype)
    return cai.softmax(x, np.int32(normalize_dim(dim, rank_of(x))))


@lowering("aten::_log_softmax.default", "aten::log_softmax.int")
def log_softmax(
    cx: LoweringContext,
    self: ir.Value,
    dim: int,
    half_to_float: bool = False,
    dtype: torch.dtype | None = None,
) -> ir.Value:
    x = cast(self, cx.out_dtype)
    if rank_of(x) == 0:
        return constant(0.0, cx.out_dtype)
    axis = i32([normalize_dim(dim, rank_of(x))])
    shifted = cai.broadcasting_sub(x, cai.reduce_max(x, axis))
    lse = cai.log(cai.reduce_sum(cai.exp(shifted), axis))
    return cai.broadcasting_sub(shifted, lse)
