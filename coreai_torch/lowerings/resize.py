"""Resampling: upsample_* (nearest, nearest-exact, linear, bilinear, trilinear, bicubic,
anti-aliased) and grid_sampler_2d/3d.

Upsampling is separable, so every rule first asks PyTorch itself for the 1-D map of each
spatial dim (the op applied to one-hot probes): a selection table for the nearest modes, a
weight matrix for the others.  Integer nearest upscales become a broadcast, other tables a
slice/gather; linear modes use Core AI's ``interpolate``, the rest a matmul per dim.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import (
    broadcast_to,
    cast,
    constant,
    dtype_of,
    i32,
    rank_of,
    reshape,
    static_shape_of,
    transpose,
)
from coreai_torch.lowerings.helpers.accumulation import accumulation_dtype
from coreai_torch.lowerings.helpers.layout import (
    contract_axis,
    static_out_shape,
    static_shape,
    take,
)
from coreai_torch.lowerings.registry import LoweringContext, lowering

aten = torch.ops.aten

# (op family, spatial rank) -> the overload taking explicit output size and per-dim scales
_DEFAULTS = {
    ("nearest", 1): aten.upsample_nearest1d.default,
    ("nearest", 2): aten.upsample_nearest2d.default,
    ("nearest", 3): aten.upsample_nearest3d.default,
    ("nearest_exact", 1): aten._upsample_nearest_exact1d.default,
    ("nearest_exact", 2): aten._upsample_nearest_exact2d.default,
    ("nearest_exact", 3): aten._upsample_nearest_exact3d.default,
    ("linear", 1): aten.upsample_linear1d.default,
    ("linear", 2): aten.upsample_bilinear2d.default,
    ("linear", 3): aten.upsample_trilinear3d.default,
    ("cubic", 2): aten.upsample_bicubic2d.default,
    ("linear_aa", 2): aten._upsample_bilinear2d_aa.default,
    ("cubic_aa", 2): aten._upsample_bicubic2d_aa.default,
}


def _one_dim_map(
    family: str, k: int, axis: int, n: int, m: int, align: bool | None, scale: float | None
) -> np.ndarray:
    """The (m, n) matrix the op applies along spatial ``axis`` (others are identity).

    The probe holds one-hot rows along ``axis``; the other spatial dims have size 2 (the
    anti-aliased kernels misbehave on size-1 dims) and are resized 2 -> 2 (identity).
    """
    op = _DEFAULTS[(family, k)]
    probe_shape = [1, n] + [1] * k
    probe_shape[2 + axis] = n
    probe = torch.eye(n, dtype=torch.float64).reshape(probe_shape)
    probe = probe.expand([1, n] + [n if a == axis else 2 for a in range(k)])
    out_size = [m if a == axis else 2 for a in range(k)]
    scales = [scale if a == axis else None for a in range(k)]
    args: list = [probe.contiguous(), out_size]
    if align is not None:
        args.append(align)
    out = op(*args, *scales)  # (1, n, ..., m, ...)
    index = tuple([0, slice(None)] + [slice(None) if a == axis else 0 for a in range(k)])
    return out[index].T.numpy()


def _nearest_table(weights: np.ndarray) -> np.ndarray:
    return weights.argmax(axis=1)


def _repeat_factor(table: np.ndarray, n: int) -> int | None:
    """``s`` if the table is every input index repeated ``s`` times in order."""
    if table.size % n:
        return None
    s = table.size // n
    return s if np.array_equal(table, np.repeat(np.arange(n), s)) else None


def _resample_nearest(x: ir.Value, tables: Sequence[np.ndarray]) -> ir.Value:
    shape = static_shape_of(x)
    k = len(tables)
    lead = shape[: len(shape) - k]
    sizes = shape[len(shape) - k :]
    repeats = [_repeat_factor(t, n) for t, n in zip(tables, sizes, strict=True)]
    factors = [f for f in repeats if f is not None]
    if len(factors) == len(repeats) and any(f != 1 for f in factors):
        # Integer upscale: (..., n, 1, ...) broadcast to (..., n, s, ...), then merged.
        split = [d for n, f in zip(sizes, factors, strict=True) for d in (n, 1)]
        wide = [d for n, f in zip(sizes, factors, strict=True) for d in (n, f)]
        y = broadcast_to(reshape(x, [*lead, *split]), [*lead, *wide])
        return reshape(y, [*lead, *[n * f for n, f in zip(sizes, factors, strict=True)]])
    for i, table in enumerate(tables):
        if not np.array_equal(table, np.arange(sizes[i])):
            x = take(x, len(lead) + i, table)
    return x


def _linear_interpolate(
    x: ir.Value, in_sizes: Sequence[int], out_sizes: Sequence[int], align: bool, scales
) -> ir.Value | None:
    """Core AI ``interpolate`` for (bi/tri)linear when its coordinate map matches PyTorch's."""
    k = len(in_sizes)
    rank = rank_of(x)
    scale, offset = [1.0] * (rank - k), [0.0] * (rank - k)
    for n, m, s in zip(in_sizes, out_sizes, scales, strict=True):
        if align:
            if n == 1 or m == 1:
                return None
            r = (m - 1) / (n - 1)
            scale.append(r)
            offset.append(0.5 * (1 - r))
        else:
            scale.append(float(s) if s else m / n)
            offset.append(0.0)
    out_shape = [*static_shape_of(x)[: rank - k], *out_sizes]
    mode = ir.Attribute.parse("#coreai.interpolation_mode<linear>")
    return cai.interpolate(
        x, i32(out_shape), np.array(scale, np.float32), np.array(offset, np.float32), mode
    )


def _upsample(
    cx: LoweringContext,
    family: str,
    x: ir.Value,
    align_corners: bool | None,
    scales: Sequence[float | None],
) -> ir.Value:
    out_shape = static_out_shape(cx)
    in_shape = static_shape(cx, x)
    k = len(scales)
    in_sizes, out_sizes = in_shape[-k:], out_shape[-k:]
    if not dtype_of(x).is_floating_point and family not in ("nearest", "nearest_exact"):
        raise cx.unsupported("interpolating integer tensors")
    maps = [
        _one_dim_map(family, k, a, n, m, align_corners, s)
        for a, (n, m, s) in enumerate(zip(in_sizes, out_sizes, scales, strict=True))
    ]
    if family in ("nearest", "nearest_exact"):
        return _resample_nearest(x, [_nearest_table(w) for w in maps])
    if family == "linear":
        y = _linear_interpolate(x, in_sizes, out_sizes, bool(align_corners), scales)
        if y is not None:
            return y
    rank = len(in_shape)
    dtype = dtype_of(x)
    x = cast(x, accumulation_dtype(cx, dtype))  # 16-bit inputs: float32 inside, rounded once
    for a, w in enumerate(maps):
        if w.shape[0] != w.shape[1] or not np.array_equal(w, np.eye(w.shape[0])):
            x = contract_axis(x, rank - k + a, w, compute=dtype_of(x))
    return cast(x, dtype)


def _scales(
    k: int, scale_factors: Sequence[float] | None, explicit: Sequence
) -> list[float | None]:
    if scale_factors is not None:
        return [float(s) for s in scale_factors]
    return [None if s is None else float(s) for s in explicit] if explicit else [None] * k


def _register(family: str, k: int, op: str, align: bool) -> None:
    """Register the .vec and .default overloads of one upsample op."""
    vec, default = f"aten::{op}.vec", f"aten::{op}.default"
    names = {1: ["scales"], 2: ["scales_h", "scales_w"], 3: ["scales_d", "scales_h", "scales_w"]}

    @lowering(vec)
    def upsample_vec(cx: LoweringContext, input: ir.Value, **args: Any) -> ir.Value:
        align_corners = args.get("align_corners") if align else None
        scales = _scales(k, args["scale_factors"], ())
        return _upsample(cx, family, input, align_corners, scales)

    @lowering(default)
    def upsample_default(cx: LoweringContext, self: ir.Value, **args: Any) -> ir.Value:
        align_corners = args.get("align_corners") if align else None
        scales = _scales(k, None, [args.get(n) for n in names[k]])
        return _upsample(cx, family, self, align_corners, scales)


for _k in (1, 2, 3):
    _register("nearest", _k, f"upsample_nearest{_k}d", align=False)
    _register("nearest_exact", _k, f"_upsample_nearest_exact{_k}d", align=False)
    _register(
        "linear",
        _k,
        ("upsample_linear1d", "upsample_bilinear2d", "upsample_trilinear3d")[_k - 1],
        True,
    )
_register("cubic", 2, "upsample_bicubic2d", align=True)
_register("linear_aa", 2, "_upsample_bilinear2d_aa", align=True)
_register("cubic_aa", 2, "_upsample_bicubic2d_aa", align=True)


# ----------------------------------------------------------------------------- grid_sample --


def _floor(v: ir.Value) -> ir.Value:
    return cai.broadcasting_floor_divide(v, constant(1.0, dtype_of(v)))


def _unnormalize(g: ir.Value, size: int, align: bool) -> ir.Value:
    dtype = dtype_of(g)
    if align:  # ((g + 1) / 2) * (size - 1)
        return cai.broadcasting_mul(
            cai.broadcasting_add(g, constant(1.0, dtype)), constant((size - 1) / 2, dtype)
        )
    # ((g + 1) * size - 1) / 2
    scaled = cai.broadcasting_mul(
        cai.broadcasting_add(g, constant(1.0, dtype)), constant(size / 2, dtype)
    )
    return cai.broadcasting_sub(scaled, constant(0.5, dtype))


def _clip(v: ir.Value, size: int) -> ir.Value:
    dtype = dtype_of(v)
    return cai.broadcasting_minimum(
        cai.broadcasting_maximum(v, constant(0.0, dtype)), constant(float(size - 1), dtype)
    )


def _reflect(v: ir.Value, size: int, align: bool) -> ir.Value:
    """PyTorch's reflect_coordinates followed by clipping."""
    dtype = dtype_of(v)
    low2, high2 = (0, 2 * (size - 1)) if align else (-1, 2 * size - 1)
    if low2 == high2:
        return cai.broadcasting_mul(v, constant(0.0, dtype))
    lo, span = low2 / 2, (high2 - low2) / 2
    d = cai.abs_(cai.broadcasting_sub(v, constant(lo, dtype)))
    extra = cai.broadcasting_modulo(d, constant(span, dtype))
    flips = _floor(cai.broadcasting_divide(d, constant(span, dtype)))
    even = cai.broadcasting_equal(
        cai.broadcasting_modulo(flips, constant(2.0, dtype)), constant(0.0, dtype)
    )
    out = cai.broadcasting_where(
        even,
        cai.broadcasting_add(extra, constant(lo, dtype)),
        cai.broadcasting_sub(constant(span + lo, dtype), extra),
    )
    return _clip(out, size)


def _cubic_weights(t: ir.Value) -> list[ir.Value]:
    """PyTorch's cubic convolution coefficients (A = -0.75) for taps -1, 0, 1, 2."""
    dtype = dtype_of(t)
    a = -0.75

    def c(v: float) -> ir.Value:
        return constant(v, dtype)

    def near(x: ir.Value) -> ir.Value:  # ((A + 2) x - (A + 3)) x^2 + 1
        inner = cai.broadcasting_sub(cai.broadcasting_mul(x, c(a + 2)), c(a + 3))
        return cai.broadcasting_add(cai.broadcasting_mul(inner, cai.broadcasting_mul(x, x)), c(1))

    def far(x: ir.Value) -> ir.Value:  # ((A x - 5A) x + 8A) x - 4A
        inner = cai.broadcasting_sub(cai.broadcasting_mul(x, c(a)), c(5 * a))
        inner = cai.broadcasting_add(cai.broadcasting_mul(inner, x), c(8 * a))
        return cai.broadcasting_sub(cai.broadcasting_mul(inner, x), c(4 * a))

    one_minus = cai.broadcasting_sub(c(1), t)
    return [
        far(cai.broadcasting_add(t, c(1))),
        near(t),
        near(one_minus),
        far(cai.broadcasting_add(one_minus, c(1))),
    ]


@lowering("aten::grid_sampler_2d.default", "aten::grid_sampler_3d.default")
def grid_sampler(
    cx: LoweringContext,
    input: ir.Value,
    grid: ir.Value,
    interpolation_mode: int,
    padding_mode: int,
    align_corners: bool,
) -> ir.Value:
    """``F.grid_sample``: bilinear, nearest or (2-D) bicubic; zeros, border or reflection."""
    if not dtype_of(input).is_floating_point:
        raise cx.unsupported("grid sampling of integer tensors")
    in_shape = static_shape(cx, input)
    g_shape = static_shape(cx, grid, "grid")
    k = len(in_shape) - 2
    n = in_shape[0]
    sizes = in_shape[2:]  # (D,) H, W
    out_sp = g_shape[1:-1]
    if interpolation_mode not in (0, 1, 2):
        raise cx.unsupported(f"grid sampling mode {interpolation_mode}")
    dtype = dtype_of(input)
    g = cast(grid, dtype)

    def pad_coordinate(v: ir.Value, size: int) -> ir.Value:
        if padding_mode == 1:
            return _clip(v, size)
        if padding_mode == 2:
            return _reflect(v, size, align_corners)
        return v

    coords = []  # per spatial dim, in input order (grid's last axis is x, y[, z])
    for a in range(k):
        comp = k - 1 - a
        start, end = [0] * (k + 1) + [comp], [*g_shape[:-1], comp + 1]
        gi = cai.slice_(g, i32(start), i32(end), i32([1] * (k + 2)))
        ci = _unnormalize(reshape(gi, [n, *out_sp]), sizes[a], align_corners)
        # Bicubic pads each tap's coordinate instead of the sampling point.
        coords.append(ci if interpolation_mode == 2 else pad_coordinate(ci, sizes[a]))
    # Channels last so one gather_nd picks a C-vector per (n, *spatial) index.
    x = transpose(input, [0, *range(2, 2 + k), 1])
    batch = broadcast_to(
        reshape(cai.constant(np.arange(n, dtype=np.int32)), [n] + [1] * k), [n, *out_sp]
    )

    def sample(points: Sequence[ir.Value]) -> ir.Value:
        """x at integer float coordinates; zero outside the input."""
        parts, valid = [batch], None
        for p, size in zip(points, sizes, strict=True):
            inside = cai.and_(
                cai.broadcasting_greater(p, constant(-1.0, dtype)),
                cai.broadcasting_greater(constant(float(size), dtype), p),
            )
            valid = inside if valid is None else cai.and_(valid, inside)
            parts.append(cast(_clip(p, size), torch.int32))
        index = cai.concat(i32(k + 1), [reshape(q, [n, *out_sp, 1]) for q in parts])
        picked = cai.gather_nd(x, index)  # (n, *out_sp, c)
        mask = reshape(valid, [n, *out_sp, 1])
        return cai.broadcasting_where(mask, picked, constant(0.0, dtype))

    if interpolation_mode == 1:  # nearest (round half to even, like nearbyint)
        out = sample([cai.round_(p) for p in coords])
        return transpose(out, [0, k + 1, *range(1, k + 1)])
    # Separable taps per dim: (coordinate, weight) pairs.
    taps = []
    offsets: tuple[int, ...]
    for a, p in enumerate(coords):
        low = _floor(p)
        t = cai.broadcasting_sub(p, low)
        if interpolation_mode == 0:
            offsets, weights = (0, 1), [cai.broadcasting_sub(constant(1.0, dtype), t), t]
        else:
            offsets, weights = (-1, 0, 1, 2), _cubic_weights(t)
        points = [
            low if o == 0 else cai.broadcasting_add(low, constant(float(o), dtype)) for o in offsets
        ]
        if interpolation_mode == 2:
            points = [pad_coordinate(q, sizes[a]) for q in points]
        taps.append(list(zip(points, weights, strict=True)))
    out = None
    for combo in itertools.product(*taps):
        weight = combo[0][1]
        for _, w in combo[1:]:
            weight = cai.broadcasting_mul(weight, w)
        term = cai.broadcasting_mul(sample([q for q, _ in combo]), reshape(weight, [n, *out_sp, 1]))
        out = term if out is None else cai.broadcasting_add(out, term)
    return transpose(out, [0, k + 1, *range(1, k + 1)])
