"""Convolutions and pooling (1-D ops run as 2-D ops with a unit height)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from coreai_torch import dtypes
from coreai_torch._mlir import cai, ir
from coreai_torch.lowerings.common import (
    cast,
    constant,
    dtype_of,
    rank_of,
    reshape,
    shape_of,
    squeeze,
    u32,
    unsqueeze,
)
from coreai_torch.lowerings.registry import LoweringContext, lowering


def _pad_spatial(x: ir.Value, pads: Sequence[tuple[int, int]], value: float) -> ir.Value:
    """Pad the trailing spatial dims of an N, C, *spatial tensor by (before, after) pairs."""
    if not any(b or a for b, a in pads):
        return x
    flat = [0, 0, 0, 0] + [p for pair in pads for p in pair]
    return cai.pad(x, u32(flat), constant(value, dtype_of(x)))


def _bias(out: ir.Value, bias: ir.Value | None, spatial: int) -> ir.Value:
    if bias is None:
        return out
    return cai.broadcasting_add(out, reshape(bias, [shape_of(bias)[0]] + [1] * spatial))


@lowering("aten::convolution.default", "aten::conv2d.default", "aten::conv1d.default")
def convolution(
    cx: LoweringContext,
    input: ir.Value,
    weight: ir.Value,
    bias: ir.Value | None = None,
    stride: Sequence[int] = (1,),
    padding: Sequence[int] | str = (0,),
    dilation: Sequence[int] = (1,),
    transposed: bool = False,
    output_padding: Sequence[int] = (0,),
    groups: int = 1,
) -> ir.Value:
    spatial = rank_of(weight) - 2
    if isinstance(padding, str):
        raise cx.unsupported(f"string padding '{padding}' (decompose the program first)")
    expand = lambda v: list(v) * spatial if len(v) == 1 else list(v)  # noqa: E731
    stride, padding, dilation = expand(stride), expand(padding), expand(dilation)
    output_padding = expand(output_padding)
    dtype = cx.out_dtype
    x, w = cast(input, dtype), cast(weight, dtype)
    unbatched = rank_of(x) == spatial + 1
    if unbatched:
        x = unsqueeze(x, [0])
    if spatial == 1:  # run as 2-D with H = 1
        x, w = unsqueeze(x, [2]), unsqueeze(w, [2])
        stride, padding, dilation = [1, *stride], [0, *padding], [1, *dilation]
        output_padding = [0, *output_padding]
    if spatial not in (1, 2, 3):
        raise cx.unsupported(f"{spatial}-D convolution")
    if transposed:
        fn = cai.conv_transpose2d if spatial in (1, 2) else cai.conv_transpose3d
        out = fn(x, w, u32(stride), u32(padding), u32(dilation), u32(output_padding), u32(groups))
    else:
        x = _pad_spatial(x, [(p, p) for p in padding], 0.0)
        fn = cai.conv2d if spatial in (1, 2) else cai.conv3d
        out = fn(x, w, u32(stride), u32(dilation), u32(groups))
    if spatial == 1:
        out = squeeze(out, [2])
    out = _bias(out, cast(bias, dtype) if bias is not None else None, spatial)
    if unbatched:
        out = squeeze(out, [0])
    return out


def _pool_output_size(size: int, k: int, s: int, p: int, d: int, ceil: bool) -> int:
    span = size + 2 * p - d * (k - 1) - 1
    out = (math.ceil(span / s) if ceil else span // s) + 1
    if ceil and (out - 1) * s >= size + p:
        out -= 1
    return out


@lowering("aten::max_pool2d_with_indices.default", "aten::max_pool2d.default")
def max_pool2d(
    cx: LoweringContext,
    self: ir.Value,
    kernel_size: Sequence[int],
    stride: Sequence[int] = (),
    padding: Sequence[int] = (0,),
    dilation: Sequence[int] = (1,),
    ceil_mode: bool = False,
) -> ir.Value | list[ir.Value | None]:
    k = list(kernel_size) * (2 // len(kernel_size))
    s = list(stride) * (2 // len(stride)) if stride else k
    p = list(padding) * (2 // len(padding))
    d = list(dilation) * (2 // len(dilation))
    x = self
    unbatched = rank_of(x) == 3
    if unbatched:
        x = unsqueeze(x, [0])
    shape = shape_of(x)
    out_hw = [_pool_output_size(shape[2 + i], k[i], s[i], p[i], d[i], ceil_mode) for i in range(2)]
    # Pad with -inf (PyTorch ignores padded cells) and add what ceil mode needs at the end.
    extra = [
        max(0, (out_hw[i] - 1) * s[i] + d[i] * (k[i] - 1) + 1 - (shape[2 + i] + 2 * p[i]))
        for i in range(2)
    ]
    dtype = dtype_of(x)
    low = float("-inf") if dtype.is_floating_point else int(torch.iinfo(dtype).min)
    x = _pad_spatial(x, [(p[i], p[i] + extra[i]) for i in range(2)], low)
    out_type = ir.RankedTensorType.get([shape[0], shape[1], *out_hw], dtypes.to_mlir(dtype))
    out = cai.maxpool2d(out_type, x, u32(k), u32(s), u32(d), np.bool_(False))
    if unbatched:
        out = squeeze(out, [0])
    if cx.node.target is torch.ops.aten.max_pool2d_with_indices.default:
        if any(u.args[1] == 1 for u in cx.node.users):
            raise cx.unsupported("max_pool2d indices are not supported")
        return [out, None]
    return out


@lowering("aten::avg_pool2d.default")
def avg_pool2d(
    cx: LoweringContext,
    self: ir.Value,
    kernel_size: Sequence[int],
    stride: Sequence[int] = (),
    padding: Sequence[int] = (0,),
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: int | None = None,
) -> ir.Value:
    k = list(kernel_size) * (2 // len(kernel_size))
    s = list(stride) * (2 // len(stride)) if stride else k
    p = list(padding) * (2 // len(padding))
    x = self
    unbatched = rank_of(x) == 3
    if unbatched:
        x = unsqueeze(x, [0])
    shape = shape_of(x)
    dtype = dtype_of(x)
    out_hw = [_pool_output_size(shape[2 + i], k[i], s[i], p[i], 1, ceil_mode) for i in range(2)]
    extra = [max(0, (out_hw[i] - 1) * s[i] + k[i] - (shape[2 + i] + 2 * p[i])) for i in range(2)]
    padded = _pad_spatial(x, [(p[i], p[i] + extra[i]) for i in range(2)], 0.0)
    total = cai.sumpool2d(padded, u32(k), u32(s), u32([1, 1]))
    if divisor_override:
        out = cai.broadcasting_divide(total, constant(float(divisor_override), dtype))
    elif (count_include_pad and not any(extra)) or (not any(p) and not any(extra)):
        out = cai.broadcasting_divide(total, constant(float(k[0] * k[1]), dtype))
    else:
        # Count the cells each window covers (padding included or not, never the ceil tail).
        ones = np.ones((1, 1, shape[2], shape[3]), dtype=np.float32)
        if count_include_pad:
            ones = np.pad(ones, [(0, 0), (0, 0), (p[0], p[0]), (p[1], p[1])], constant_values=1)
            ones = np.pad(ones, [(0, 0), (0, 0), (0, extra[0]), (0, extra[1])])
        else:
            ones = np.pad(ones, [(0, 0), (0, 0), (p[0], p[0] + extra[0]), (p[1], p[1] + extra[1])])
        counts = np.zeros((1, 1, *out_hw), dtype=np.float32)
        for i in range(out_hw[0]):
            for j in range(out_hw[1]):
                counts[0, 0, i, j] = ones[
                    0, 0, i * s[0] : i * s[0] + k[0], j * s[1] : j * s[1] + k[1]
                ].sum()
        out = cai.broadcasting_divide(total, cast(cai.constant(counts), dtype))
    if unbatched:
        out = squeeze(out, [0])
    return out


@lowering("aten::_adaptive_avg_pool2d.default", "aten::adaptive_avg_pool2d.default")
def adaptive_avg_pool2d(
    cx: LoweringContext, self: ir.Value, output_size: Sequence[int]
) -> ir.Value:
    x = self
    unbatched = rank_of(x) == 3
    if unbatched:
        x = unsqueeze(x, [0])
    shape = shape_of(x)
    h, w = shape[2], shape[3]
    oh, ow = (output_size[0] or h), (output_size[1] or w)
    if (oh, ow) == (1, 1):
        out = cai.reduce_mean(x, np.array([2, 3], np.int32))
    elif h % oh == 0 and w % ow == 0:
        kh, kw = h // oh, w // ow
        total = cai.sumpool2d(x, u32([kh, kw]), u32([kh, kw]), u32([1, 1]))
        out = cai.broadcasting_divide(total, constant(float(kh * kw), dtype_of(x)))
    else:
        # General case: each output cell averages rows [floor(i*h/oh), ceil((i+1)*h/oh)).
        rows = []
        for i in range(oh):
            h0, h1 = (i * h) // oh, -((-(i + 1) * h) // oh)
            cols = []
            for j in range(ow):
                w0, w1 = (j * w) // ow, -((-(j + 1) * w) // ow)
                window = cai.slice_(
                    x,
                    np.array([0, 0, h0, w0], np.int32),
                    np.array([shape[0], shape[1], h1, w1], np.int32),
                    np.array([1, 1, 1, 1], np.int32),
                )
                cols.append(cai.reduce_mean(window, np.array([2, 3], np.int32)))
            rows.append(cai.concat(np.int32(3), cols) if len(cols) > 1 else cols[0])
        out = cai.concat(np.int32(2), rows) if len(rows) > 1 else rows[0]
    if unbatched:
        out = squeeze(out, [0])
    return out
