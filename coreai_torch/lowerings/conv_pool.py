"""Convolutions (1/2/3-D, grouped, dilated, transposed) and pooling (max with indices, avg,
adaptive avg/max).  1-D ops run as 2-D ops with a unit height."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from coreai_torch import dtypes
from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import (
    cast,
    constant,
    dtype_of,
    i32,
    rank_of,
    reshape,
    shape_of,
    squeeze,
    static_dim,
    static_shape_of,
    u32,
    unsqueeze,
)
from coreai_torch.lowerings.helpers.accumulation import accumulation_dtype
from coreai_torch.lowerings.helpers.layout import (
    contract_axis,
    flatten_window_gather,
    lowest,
    static_shape,
)
from coreai_torch.lowerings.registry import LoweringContext, lowering


def _per_dim(values: Sequence[int] | int, k: int) -> list[int]:
    """A per-spatial-dim parameter list (PyTorch allows one value for all dims)."""
    if isinstance(values, int):
        return [values] * k
    values = [int(v) for v in values]
    return values * k if len(values) == 1 else values


def _pad_spatial(x: ir.Value, pads: Sequence[tuple[int, int]], value: float | int) -> ir.Value:
    """Pad the trailing spatial dims of an N, C, *spatial tensor by (before, after) pairs."""
    if not any(b or a for b, a in pads):
        return x
    flat = [0] * (2 * (rank_of(x) - len(pads))) + [p for pair in pads for p in pair]
    return cai.pad(x, u32(flat), constant(value, dtype_of(x)))


def _bias(out: ir.Value, bias: ir.Value | None, spatial: int) -> ir.Value:
    if bias is None:
        return out
    return cai.broadcasting_add(out, reshape(bias, [static_dim(bias, 0)] + [1] * spatial))


# --------------------------------------------------------------------------- convolution ----


@lowering("aten::convolution.default", "aten::_convolution.default")
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
    **_: object,
) -> ir.Value:
    spatial = rank_of(weight) - 2
    if isinstance(padding, str):
        raise cx.unsupported(f"string padding '{padding}' (decompose the program first)")
    if spatial not in (1, 2, 3):
        raise cx.unsupported(f"{spatial}-D convolution")
    stride, padding = _per_dim(stride, spatial), _per_dim(padding, spatial)
    dilation, output_padding = _per_dim(dilation, spatial), _per_dim(output_padding, spatial)
    out_dtype = cx.out_dtype
    # Core AI convolutions are float-only: integer ones run exactly in float64 (|x| < 2**53).
    dtype = out_dtype if out_dtype.is_floating_point else torch.float64
    x, w = cast(input, dtype), cast(weight, dtype)
    unbatched = rank_of(x) == spatial + 1
    if unbatched:
        x = unsqueeze(x, [0])
    if spatial == 1:  # run as 2-D with H = 1
        x, w = unsqueeze(x, [2]), unsqueeze(w, [2])
        stride, padding, dilation = [1, *stride], [0, *padding], [1, *dilation]
        output_padding = [0, *output_padding]
    params = [u32(stride), u32(padding), u32(dilation), u32(output_padding), u32(groups)]
    if transposed:
        fn = cai.conv_transpose2d if spatial in (1, 2) else cai.conv_transpose3d
        out = fn(x, w, *params)
    else:
        x = _pad_spatial(x, [(p, p) for p in padding], 0.0)
        fn = cai.conv2d if spatial in (1, 2) else cai.conv3d
        out = fn(x, w, u32(stride), u32(dilation), u32(groups))
    if spatial == 1:
        out = squeeze(out, [2])
    out = _bias(out, cast(bias, dtype) if bias is not None else None, spatial)
    if unbatched:
        out = squeeze(out, [0])
    return cast(out, out_dtype)


# ------------------------------------------------------------------------------- pooling ----


def pool_output_size(size: int, k: int, s: int, p: int, d: int, ceil: bool) -> int:
    """PyTorch's pooling output size (a ceil-mode window must start inside input + left pad)."""
    span = size + 2 * p - d * (k - 1) - 1
    out = (math.ceil(span / s) if ceil else span // s) + 1
    if ceil and (out - 1) * s >= size + p:
        out -= 1
    return out


class _Pool:
    """Normalised parameters of one N-d pooling call on a batched ``(N, C, *spatial)`` input."""

    def __init__(
        self,
        cx: LoweringContext,
        x: ir.Value,
        k: int,
        kernel: Sequence[int],
        stride: Sequence[int],
        padding: Sequence[int],
        dilation: Sequence[int],
        ceil_mode: bool,
    ) -> None:
        self.unbatched = rank_of(x) == k + 1
        self.x = unsqueeze(x, [0]) if self.unbatched else x
        self.shape = static_shape(cx, self.x)
        self.sizes = self.shape[2:]
        self.k = k
        self.kernel = _per_dim(kernel, k)
        self.stride = _per_dim(stride, k) if stride else list(self.kernel)
        self.padding = _per_dim(padding, k)
        self.dilation = _per_dim(dilation, k)
        self.out = [
            pool_output_size(n, kk, s, p, d, ceil_mode)
            for n, kk, s, p, d in zip(
                self.sizes, self.kernel, self.stride, self.padding, self.dilation, strict=True
            )
        ]
        # What ceil mode needs beyond the right padding for the last window.
        self.extra = [
            max(0, (o - 1) * s + d * (kk - 1) + 1 - (n + 2 * p))
            for n, kk, s, p, d, o in zip(
                self.sizes,
                self.kernel,
                self.stride,
                self.padding,
                self.dilation,
                self.out,
                strict=True,
            )
        ]

    def finish(self, out: ir.Value) -> ir.Value:
        return squeeze(out, [0]) if self.unbatched else out

    def windows(self) -> list[list[list[int]]]:
        """Per dim, per output position: the input indices of the window (-1 = padding)."""
        per_dim = []
        for n, kk, s, p, d, o in zip(
            self.sizes, self.kernel, self.stride, self.padding, self.dilation, self.out, strict=True
        ):
            rows = []
            for i in range(o):
                idx = [i * s - p + j * d for j in range(kk)]
                rows.append([v if 0 <= v < n else -1 for v in idx])
            per_dim.append(rows)
        return per_dim


def window_table(sizes: Sequence[int], per_dim: Sequence[Sequence[Sequence[int]]]) -> np.ndarray:
    """(positions, window) flat spatial indices for windows given per dim (-1 = padding).

    Padding entries are moved to the end of each row so that ``argmax`` ties prefer real
    elements in PyTorch's scan order.
    """
    table = np.zeros([1, 1], dtype=np.int64)
    for n, rows in zip(sizes, per_dim, strict=True):
        width = max(len(r) for r in rows)
        dim = np.full((len(rows), width), -1, dtype=np.int64)
        for i, r in enumerate(rows):
            dim[i, : len(r)] = r
        valid = (table[:, None, :, None] >= 0) & (dim[None, :, None, :] >= 0)
        flat = table[:, None, :, None] * n + dim[None, :, None, :]
        table = np.where(valid, flat, -1).reshape(table.shape[0] * len(rows), -1)
    order = np.argsort(table < 0, axis=1, kind="stable")
    return np.take_along_axis(table, order, axis=1)


def max_with_indices(
    x: ir.Value, sizes: Sequence[int], out: Sequence[int], table: np.ndarray
) -> tuple[ir.Value, ir.Value]:
    """Maximum and PyTorch-style flat spatial index of each window of a constant table."""
    k = len(sizes)
    shape = static_shape_of(x)
    lead = shape[: len(shape) - k]
    windows = flatten_window_gather(x, k, table, lowest(dtype_of(x)))  # (*lead, P, W)
    values = cai.reduce_max(windows, i32([-1]))
    best = cast(cai.argmax(windows, i32(len(lead) + 1)), torch.int32)  # (*lead, P, 1)
    positions, width = table.shape
    offsets = cai.constant((np.arange(positions, dtype=np.int32) * width)[:, None])
    flat_best = cai.broadcasting_add(best, offsets)
    picked = cai.gather_nd(
        cai.constant(np.where(table < 0, 0, table).reshape(-1).astype(np.int64)), flat_best
    )
    return reshape(values, [*lead, *out]), reshape(picked, [*lead, *out])


def _indices_used(cx: LoweringContext) -> bool:
    return any(u.args[1] == 1 for u in cx.node.users)


def _max_pool(
    cx: LoweringContext,
    self: ir.Value,
    k: int,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
    ceil_mode: bool,
) -> list[ir.Value | None]:
    pool = _Pool(cx, self, k, kernel_size, stride, padding, dilation, ceil_mode)
    if _indices_used(cx):
        table = window_table(pool.sizes, pool.windows())
        values, idx = max_with_indices(pool.x, pool.sizes, pool.out, table)
        return [pool.finish(values), pool.finish(idx)]
    dtype = dtype_of(pool.x)
    if dtype == torch.bool:
        raise cx.unsupported("max pooling of bool tensors")
    x = _pad_spatial(
        pool.x, [(p, p + e) for p, e in zip(pool.padding, pool.extra, strict=True)], lowest(dtype)
    )
    out_type = ir.RankedTensorType.get([*pool.shape[:2], *pool.out], dtypes.to_mlir(dtype))
    fn = cai.maxpool2d if k == 2 else cai.maxpool3d
    out = fn(out_type, x, u32(pool.kernel), u32(pool.stride), u32(pool.dilation), np.bool_(False))
    return [pool.finish(out), None]


def _spatial_rank(cx: LoweringContext) -> int:
    """2 or 3 from the op name (``*2d`` / ``*3d``); kernel lists may have one entry."""
    return 3 if "3d" in str(cx.node.target) else 2


@lowering("aten::max_pool2d_with_indices.default", "aten::max_pool3d_with_indices.default")
def max_pool_with_indices(
    cx: LoweringContext,
    self: ir.Value,
    kernel_size: Sequence[int],
    stride: Sequence[int] = (),
    padding: Sequence[int] = (0,),
    dilation: Sequence[int] = (1,),
    ceil_mode: bool = False,
) -> list[ir.Value | None]:
    k = _spatial_rank(cx)
    return _max_pool(cx, self, k, kernel_size, stride, padding, dilation, ceil_mode)


@lowering("aten::max_pool2d.default", "aten::max_pool3d.default")
def max_pool(
    cx: LoweringContext,
    self: ir.Value,
    kernel_size: Sequence[int],
    stride: Sequence[int] = (),
    padding: Sequence[int] = (0,),
    dilation: Sequence[int] = (1,),
    ceil_mode: bool = False,
) -> ir.Value:
    k = _spatial_rank(cx)
    values, _ = _max_pool(cx, self, k, kernel_size, stride, padding, dilation, ceil_mode)
    return values


def _avg_divisors(pool: _Pool, count_include_pad: bool) -> np.ndarray:
    """PyTorch's per-window divisor (padding cells count unless count_include_pad=False;
    the ceil-mode overhang never counts)."""
    per_dim = []
    for n, kk, s, p, o in zip(
        pool.sizes, pool.kernel, pool.stride, pool.padding, pool.out, strict=True
    ):
        start = np.arange(o) * s - p
        end = np.minimum(start + kk, n + p)
        if not count_include_pad:
            start, end = np.maximum(start, 0), np.minimum(end, n)
        per_dim.append((end - start).astype(np.float64))
    counts = per_dim[0]
    for d in per_dim[1:]:
        counts = np.multiply.outer(counts, d)
    return counts


def _avg_pool(
    cx: LoweringContext,
    self: ir.Value,
    k: int,
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    ceil_mode: bool,
    count_include_pad: bool,
    divisor_override: int | None,
) -> ir.Value:
    pool = _Pool(cx, self, k, kernel_size, stride, padding, [1], ceil_mode)
    dtype = dtype_of(pool.x)
    if dtype == torch.bool:
        raise cx.unsupported("average pooling of bool tensors")
    pads = [(p, p + e) for p, e in zip(pool.padding, pool.extra, strict=True)]
    padded = _pad_spatial(pool.x, pads, 0.0)
    fn = cai.sumpool2d if k == 2 else cai.sumpool3d
    total = fn(padded, u32(pool.kernel), u32(pool.stride), cai.constant(u32([1] * k)))
    if divisor_override:
        counts = np.array(float(divisor_override))
    else:
        counts = _avg_divisors(pool, count_include_pad)
        if np.all(counts == counts.flat[0]):
            counts = np.array(counts.flat[0])
    divisor = cast(cai.constant(counts.astype(np.float32)), dtype)
    # Integer pooling divides with truncation, like PyTorch (divisors are >= 1).
    return pool.finish(cai.broadcasting_divide(total, divisor))


@lowering("aten::avg_pool2d.default", "aten::avg_pool3d.default")
def avg_pool(
    cx: LoweringContext,
    self: ir.Value,
    kernel_size: Sequence[int],
    stride: Sequence[int] = (),
    padding: Sequence[int] = (0,),
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: int | None = None,
) -> ir.Value:
    k = _spatial_rank(cx)
    return _avg_pool(
        cx, self, k, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override
    )


# ------------------------------------------------------------------------ adaptive pools ----


def adaptive_windows(n: int, o: int) -> list[list[int]]:
    """PyTorch's adaptive pooling windows: [floor(i*n/o), ceil((i+1)*n/o))."""
    return [list(range((i * n) // o, -((-(i + 1) * n) // o))) for i in range(o)]


def _adaptive(
    cx: LoweringContext, self: ir.Value, output_size: Sequence[int | None]
) -> tuple[ir.Value, bool, list[int], list[int]]:
    k = len(output_size)
    unbatched = rank_of(self) == k + 1
    x = unsqueeze(self, [0]) if unbatched else self
    sizes = static_shape(cx, x)[2:]
    out = [int(o) if o is not None else n for o, n in zip(output_size, sizes, strict=True)]
    return x, unbatched, sizes, out


@lowering("aten::_adaptive_avg_pool2d.default", "aten::adaptive_avg_pool2d.default")
@lowering("aten::_adaptive_avg_pool3d.default", "aten::adaptive_avg_pool3d.default")
def adaptive_avg_pool(
    cx: LoweringContext, self: ir.Value, output_size: Sequence[int | None]
) -> ir.Value:
    x, unbatched, sizes, out = _adaptive(cx, self, output_size)
    k = len(out)
    dtype = dtype_of(x)
    if not dtype.is_floating_point:
        raise cx.unsupported(f"average pooling of {dtype} tensors")
    if all(o == 1 for o in out):
        y = cai.reduce_mean(x, i32(list(range(2, 2 + k))))
    elif all(n % o == 0 for n, o in zip(sizes, out, strict=True)) and k in (2, 3):
        kernel = [n // o for n, o in zip(sizes, out, strict=True)]
        fn = cai.sumpool2d if k == 2 else cai.sumpool3d
        total = fn(x, u32(kernel), u32(kernel), cai.constant(u32([1] * k)))
        y = cai.broadcasting_divide(total, constant(float(np.prod(kernel)), dtype))
    else:  # separable: one averaging matrix per dim
        y = cast(x, accumulation_dtype(cx, dtype))  # 16-bit: float32 inside, rounded once
        for a, (n, o) in enumerate(zip(sizes, out, strict=True)):
            if n == o:
                continue
            weights = np.zeros((o, n))
            for i, window in enumerate(adaptive_windows(n, o)):
                weights[i, window] = 1.0 / len(window)
            y = contract_axis(y, 2 + a, weights, compute=dtype_of(y))
        y = cast(y, dtype)
    return squeeze(y, [0]) if unbatched else y


@lowering("aten::adaptive_max_pool2d.default", "aten::adaptive_max_pool3d.default")
def adaptive_max_pool(
    cx: LoweringContext, self: ir.Value, output_size: Sequence[int | None]
) -> list[ir.Value | None]:
    x, unbatched, sizes, out = _adaptive(cx, self, output_size)
    k = len(out)
    dtype = dtype_of(x)
    divisible = all(n % o == 0 for n, o in zip(sizes, out, strict=True))
    if divisible and not _indices_used(cx) and dtype != torch.bool:
        kernel = [n // o for n, o in zip(sizes, out, strict=True)]
        out_type = ir.RankedTensorType.get([*shape_of(x)[:2], *out], dtypes.to_mlir(dtype))
        fn = cai.maxpool2d if k == 2 else cai.maxpool3d
        ones = u32([1] * k)
        values = fn(out_type, x, u32(kernel), u32(kernel), ones, np.bool_(False))
        indices = None
    else:
        per_dim = [adaptive_windows(n, o) for n, o in zip(sizes, out, strict=True)]
        values, indices = max_with_indices(x, sizes, out, window_table(sizes, per_dim))
    if unbatched:
        values = squeeze(values, [0])
        indices = squeeze(indices, [0]) if indices is not None else None
    return [values, indices]
