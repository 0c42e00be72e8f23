"""Dequantization ops of quantized PyTorch programs, lowered to Core AI's compressed weights.

* ``torchao::dequantize_affine`` (torchao's ``IntxWeightOnlyConfig`` and friends; kept whole
  by ``get_decomp_table()``),
* ``quant::dequantize_codebook`` (torchao's ``CodebookWeightOnlyConfig``: palettes),
* ``quantized_decomposed::dequantize_per_channel`` / ``_per_channel_group`` /
  ``_per_tensor`` and ``quantize_per_tensor`` (PT2E programs, ``convert_pt2e``).

When the quantized data and its parameters are weights, the rule reads their tensors at
conversion time and emits the native decompression op over bit-packed constants
(:mod:`coreai_torch.ir.compressed`); the constants of the original tensors are then unused and
dropped.  A weight whose every reader transposes it (``nn.Linear``: ``permute`` before the
matmul) is stored transposed, so that after ``optimize()`` the matmul reads the decompressed
weight directly (the transpose pair cancels).  Anything else (quantized activations) is
computed at run time exactly as PyTorch does.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch
import torch.fx

from coreai_torch._mlir import cai, ir
from coreai_torch.frontend.schema import bind_arguments
from coreai_torch.ir import compressed
from coreai_torch.ir.values import cast, constant, known_sizes, reshape, shape_of, static_shape_of
from coreai_torch.lowerings.helpers.arithmetic import clamp_values
from coreai_torch.lowerings.helpers.weights import emit_compressed, weight_tensor
from coreai_torch.lowerings.registry import LoweringContext, lowering

aten = torch.ops.aten

#: float8 torch dtypes -> their numpy (ml_dtypes) equivalent
_FLOAT8 = {
    torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn,
    torch.float8_e5m2: ml_dtypes.float8_e5m2,
}


def _dtype(value: torch.dtype | int) -> torch.dtype:
    """A dtype argument: torchao's ops declare them as ``int`` (ScalarType numbers)."""
    if isinstance(value, torch.dtype):
        return value
    return aten.scalar_tensor.default(0, dtype=value).dtype


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype in _FLOAT8:
        return tensor.contiguous().view(torch.uint8).numpy().view(_FLOAT8[tensor.dtype])
    if tensor.dtype == torch.bfloat16:
        return tensor.float().numpy()
    return tensor.contiguous().numpy()


def linear_codes(
    data: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    blocks: list[int],
    quant_min: int | None = None,
    quant_max: int | None = None,
) -> compressed.LinearCodes | None:
    """``data`` quantized with one ``scale`` / ``zero_point`` per block of shape ``blocks``
    as :class:`~coreai_torch.ir.compressed.LinearCodes` (None when the parameters do not fit
    that form: a zero point that is not an integer, a block that does not divide the data)."""
    shape = list(data.shape)
    if len(blocks) != len(shape) or any(
        b <= 0 or s % b for s, b in zip(shape, blocks, strict=True)
    ):
        return None
    params = [s // b for s, b in zip(shape, blocks, strict=True)]
    if scale.numel() != int(np.prod(params)):
        return None
    scale_np = scale.detach().float().reshape(params).numpy()
    zp_np = None
    if zero_point is not None:
        if zero_point.numel() != scale.numel():
            return None
        zp = zero_point.detach().reshape(params)
        if zp.is_floating_point() and not torch.equal(zp, zp.round()):
            return None
        zp_np = zp.to(torch.int32).numpy()
    if data.dtype in _FLOAT8:
        if zp_np is not None and zp_np.any():
            return None
        return compressed.LinearCodes(_numpy(data), 8, scale_np)
    if data.is_floating_point() or data.dtype == torch.bool:
        return None
    low = int(data.min()) if data.numel() else 0
    high = int(data.max()) if data.numel() else 0
    low = min(low, quant_min if quant_min is not None else low)
    high = max(high, quant_max if quant_max is not None else high)
    signed = low < 0
    fitting = [b for b in range(1, 9) if _fits(compressed.code_range(b, signed), low, high)]
    bits = fitting[0] if fitting else None
    if bits is None:
        return None
    codes = data.to(torch.int8 if signed else torch.uint8).numpy()
    return compressed.LinearCodes(codes, bits, scale_np, zp_np, signed=signed)


def _fits(bounds: tuple[int, int], low: int, high: int) -> bool:
    return bounds[0] <= low and high <= bounds[1]


# ----------------------------------------------------------- run-time (activation) forms ---


def _affine_values(
    x: ir.Value,
    blocks: list[int],
    scale: ir.Value,
    zero_point: ir.Value | None,
    dtype: torch.dtype,
) -> ir.Value:
    """``(x - zero_point) * scale`` per block of shape ``blocks``, computed at run time in
    float32 (as PyTorch's reference implementations do) and converted to ``dtype``."""
    shape = static_shape_of(x)
    split: list[int] = []
    param_shape: list[int] = []
    for size, block in zip(shape, blocks, strict=True):
        split += [size // block, block]
        param_shape += [size // block, 1]
    values = reshape(cast(x, torch.float32), split)
    if zero_point is not None:
        values = cai.broadcasting_sub(values, reshape(cast(zero_point, torch.float32), param_shape))
    values = cai.broadcasting_mul(values, reshape(cast(scale, torch.float32), param_shape))
    return cast(reshape(values, shape), dtype)


def _static_shape(cx: LoweringContext, x: ir.Value) -> list[int]:
    shape = known_sizes(shape_of(x))
    if shape is None:
        raise cx.unsupported("dequantization of a value with a dynamic shape is not supported")
    return shape


# ------------------------------------------------------------------------------- torchao ---


@lowering("torchao::dequantize_affine.default")
def dequantize_affine(
    cx: LoweringContext,
    input: ir.Value,
    block_size: list[int],
    scale: ir.Value,
    zero_point: ir.Value | None,
    input_dtype: torch.dtype,
    quant_min: int | None = None,
    quant_max: int | None = None,
    output_dtype: torch.dtype = torch.float32,
) -> ir.Value:
    """``(input - zero_point) * scale`` per block: a compressed weight when ``input`` is one."""
    args = bind_arguments(cx.node)
    input_dtype, output_dtype = _dtype(input_dtype), _dtype(output_dtype)
    shape = _static_shape(cx, input)
    blocks = [shape[i] if b == -1 else b for i, b in enumerate(block_size)]
    data = weight_tensor(cx, args["input"])
    scale_t = weight_tensor(cx, args["scale"])
    zp_t = weight_tensor(cx, args["zero_point"]) if zero_point is not None else None
    bounds = compressed.integer_bounds(input_dtype) or (None, None)
    low = quant_min if quant_min is not None else bounds[0]
    high = quant_max if quant_max is not None else bounds[1]
    if data is not None and scale_t is not None and (zero_point is None or zp_t is not None):
        codes = linear_codes(data, scale_t, zp_t, blocks, low, high)
        if codes is not None:
            return emit_compressed(cx, args["input"], codes, output_dtype)
    return _affine_values(input, blocks, scale, zero_point, output_dtype)


@lowering("quant::dequantize_codebook.default")
def dequantize_codebook(
    cx: LoweringContext,
    codes: ir.Value,
    codebook: ir.Value,
    nbits: int,
    block_size: list[int],
    output_dtype: torch.dtype = torch.float32,
) -> ir.Value:
    """``codebook[block, codes]``: a palettized weight (``lut_to_dense``)."""
    args = bind_arguments(cx.node)
    output_dtype = _dtype(output_dtype)
    indices = weight_tensor(cx, args["codes"])
    book = weight_tensor(cx, args["codebook"])
    if indices is None or book is None:
        raise cx.unsupported(
            "the codes and the codebook must be weights of the program (palettes are "
            "decompressed from constants)"
        )
    if book.dim() != indices.dim() + 2 or book.shape[-1] != 1:
        raise cx.unsupported(
            f"only scalar palettes are supported (codebook [..., {2**nbits}, 1]), got "
            f"{tuple(book.shape)}"
        )
    lut = book.detach().numpy() if book.dtype != torch.bfloat16 else book.float().numpy()
    palette = compressed.PaletteCodes(indices.to(torch.uint8).numpy(), nbits, lut)
    return emit_compressed(cx, args["codes"], palette, output_dtype)


# ---------------------------------------------------------------------------------- PT2E ---


def _dequantize_weight(
    cx: LoweringContext,
    blocks: list[int],
    quant_min: int,
    quant_max: int,
    dtype: torch.dtype,
    params: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> ir.Value | None:
    """The compressed-weight form of a ``quantized_decomposed`` dequantization, or None
    when its input is not a weight.  ``params``: the (scale, zero point) when they are
    numbers, not weights."""
    args = bind_arguments(cx.node)
    data = weight_tensor(cx, args["input"])
    scale: torch.Tensor | None
    zero_point: torch.Tensor | None
    if params is not None:
        scale, zero_point = params
        zp_arg = None
    else:
        scale = weight_tensor(cx, args["scales"])
        zp_arg = args["zero_points"]
        zero_point = weight_tensor(cx, zp_arg) if zp_arg is not None else None
    if data is None or scale is None or (zp_arg is not None and zero_point is None):
        return None
    codes = linear_codes(data, scale, zero_point, blocks, quant_min, quant_max)
    if codes is None:
        return None
    return emit_compressed(cx, args["input"], codes, dtype)


@lowering("quantized_decomposed::dequantize_per_channel.default")
def dequantize_per_channel(
    cx: LoweringContext,
    input: ir.Value,
    scales: ir.Value,
    zero_points: ir.Value | None,
    axis: int,
    quant_min: int,
    quant_max: int,
    dtype: torch.dtype,
    out_dtype: torch.dtype | None = None,
) -> ir.Value:
    shape = _static_shape(cx, input)
    axis %= len(shape)
    blocks = [1 if a == axis else s for a, s in enumerate(shape)]
    out = out_dtype or torch.float32
    weight = _dequantize_weight(cx, blocks, quant_min, quant_max, out)
    if weight is not None:
        return weight
    return _affine_values(input, blocks, scales, zero_points, out)


@lowering("quantized_decomposed::dequantize_per_channel_group.default")
def dequantize_per_channel_group(
    cx: LoweringContext,
    input: ir.Value,
    scales: ir.Value,
    zero_points: ir.Value | None,
    quant_min: int,
    quant_max: int,
    dtype: torch.dtype,
    group_size: int,
    output_dtype: torch.dtype,
) -> ir.Value:
    shape = _static_shape(cx, input)
    if len(shape) != 2:
        raise cx.unsupported("dequantize_per_channel_group takes a 2-D weight")
    group = shape[1] if group_size > shape[1] else group_size
    blocks = [1, group]
    weight = _dequantize_weight(cx, blocks, quant_min, quant_max, output_dtype)
    if weight is not None:
        return weight
    return _affine_values(input, blocks, scales, zero_points, output_dtype)


def _scalar(value: ir.Value | float | int, dtype: torch.dtype) -> ir.Value:
    if isinstance(value, ir.Value):
        return reshape(cast(value, dtype), [])
    return constant(value, dtype)


@lowering(
    "quantized_decomposed::dequantize_per_tensor.default",
    "quantized_decomposed::dequantize_per_tensor.tensor",
)
def dequantize_per_tensor(
    cx: LoweringContext,
    input: ir.Value,
    scale: ir.Value | float,
    zero_point: ir.Value | int,
    quant_min: int,
    quant_max: int,
    dtype: torch.dtype,
    out_dtype: torch.dtype | None = None,
) -> ir.Value:
    """``(input - zero_point) * scale`` with one scale (weights are stored compressed)."""
    shape = _static_shape(cx, input)
    out = out_dtype or torch.float32
    if not isinstance(scale, ir.Value) and not isinstance(zero_point, ir.Value):
        ones = [1] * len(shape)
        params = torch.tensor(float(scale)).reshape(ones), torch.tensor(zero_point).reshape(ones)
        weight = _dequantize_weight(cx, list(shape), quant_min, quant_max, out, params)
        if weight is not None:
            return weight
    values = cai.broadcasting_sub(cast(input, out), _scalar(zero_point, out))
    return cai.broadcasting_mul(values, _scalar(scale, out))


@lowering(
    "quantized_decomposed::quantize_per_tensor.default",
    "quantized_decomposed::quantize_per_tensor.tensor",
)
def quantize_per_tensor(
    cx: LoweringContext,
    input: ir.Value,
    scale: ir.Value | float,
    zero_point: ir.Value | int,
    quant_min: int,
    quant_max: int,
    dtype: torch.dtype,
) -> ir.Value:
    """``clamp(round(input * (1 / scale)) + zero_point, quant_min, quant_max)`` (fake
    quantization of activations, as PyTorch computes it)."""
    x = cast(input, torch.float32)
    if isinstance(scale, ir.Value):
        inverse = cai.broadcasting_divide(
            constant(1.0, torch.float32), _scalar(scale, torch.float32)
        )
    else:
        inverse = constant(1.0 / scale, torch.float32)
    rounded = cai.round_(cai.broadcasting_mul(x, inverse))
    shifted = cai.broadcasting_add(rounded, _scalar(zero_point, torch.float32))
    return cast(clamp_values(shifted, float(quant_min), float(quant_max)), dtype)
