"""The ``torch.ops.coreai`` decompression ops (coreai-opt's finalized models), lowered to Core
AI's native compression ops with the data kept compressed in the asset.

* ``constexpr_blockwise_shift_scale`` of a weight: :class:`~coreai_torch.ir.compressed.LinearCodes`
  (integers of 1 to 8 bits with zero points or min-value offsets, float8, FP4 with e8m0
  scales) -- ``dequantize`` / ``blockwise_shift_scale``;
* ``lut_to_dense`` of a weight: :class:`~coreai_torch.ir.compressed.PaletteCodes` (scalar and
  vector palettes, grouped, float or 8-bit integer palettes); a ``constexpr_blockwise_shift_scale``
  reading it (coreai-opt's ``ScaledPalettizeModule``: quantized palettes, per-channel scales)
  becomes the palette's scale -- ``lut_to_dense`` then ``blockwise_shift_scale``;
* ``sparse_to_dense`` of a weight: :class:`~coreai_torch.ir.compressed.SparseCodes` --
  ``build_sparse_with_bitmask`` + ``sparse_with_bitmask_to_dense``;
* ``quantize`` / ``dequantize`` (activations, per tensor or per channel): Core AI's
  ``quantize`` / ``dequantize``, computed at run time;
* ``aten.quantize_per_tensor`` followed by ``aten.dequantize.self`` (coreai-opt's Core ML
  route): computed at run time as PyTorch does.

Weights are read at conversion time (through casts, so coreai-opt's
``cast_to_16_bit_precision`` is no obstacle) and decompressed by :mod:`coreai_torch.ir.compressed`,
stored transposed when every reader transposes them (``nn.Linear``).  The tensors of the
original buffers are then unused and not saved.
"""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np
import torch
import torch.fx

from coreai_torch import dtypes
from coreai_torch._mlir import cai, ir
from coreai_torch.frontend.schema import bind_arguments
from coreai_torch.ir import compressed
from coreai_torch.ir.values import cast, known_sizes, reshape, shape_of
from coreai_torch.lowerings.helpers.weights import emit_compressed, weight_tensor
from coreai_torch.lowerings.registry import LoweringContext, lowering

_FLOAT4 = torch.float4_e2m1fn_x2
_NUMPY_SPECIAL = {
    torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn,
    torch.float8_e5m2: ml_dtypes.float8_e5m2,
    torch.float8_e8m0fnu: ml_dtypes.float8_e8m0fnu,
}


def _array(tensor: torch.Tensor) -> np.ndarray:
    """A weight as numpy (float8 / e8m0 as ml_dtypes, bfloat16 as float32)."""
    tensor = tensor.detach().contiguous()
    if tensor.dtype in _NUMPY_SPECIAL:
        return tensor.view(torch.uint8).numpy().view(_NUMPY_SPECIAL[tensor.dtype])
    if tensor.dtype == torch.bfloat16:
        return tensor.float().numpy()
    return tensor.numpy()


def _params(tensor: torch.Tensor, rank: int) -> np.ndarray:
    """Per-block parameters as numpy, with the weight's rank (leading ones added)."""
    array = _array(tensor)
    return array.reshape((1,) * (rank - array.ndim) + array.shape)


def _unpack_float4(packed: np.ndarray) -> np.ndarray:
    """FP4 codes packed two per byte (even element low) as one ``float4_e2m1fn`` per byte."""
    data = packed.view(np.uint8)
    codes = np.stack([data & 0xF, data >> 4], axis=-1).reshape(*data.shape[:-1], -1)
    return codes.view(ml_dtypes.float4_e2m1fn)


def _is_op(node: Any, name: str) -> bool:
    return (
        isinstance(node, torch.fx.Node)
        and node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and node.target.namespace == "coreai"
        and node.target._schema.name == f"coreai::{name}"
    )


# ------------------------------------------------------------------------ linear codes ---


def _linear_codes(
    cx: LoweringContext, args: dict[str, Any], input_dtype: torch.dtype | None
) -> compressed.LinearCodes | None:
    """The weight a ``constexpr_blockwise_shift_scale`` node decompresses, as LinearCodes
    (None when its data or parameters are not weights)."""
    data = weight_tensor(cx, args["data"])
    scale = weight_tensor(cx, args["scale"])
    zero_point = weight_tensor(cx, args["zero_point"]) if args["zero_point"] is not None else None
    minval = weight_tensor(cx, args["minval"]) if args["minval"] is not None else None
    if (
        data is None
        or scale is None
        or (args["zero_point"] is not None and zero_point is None)
        or (args["minval"] is not None and minval is None)
    ):
        return None
    if input_dtype == _FLOAT4 or data.dtype == _FLOAT4:
        codes = _unpack_float4(data.view(torch.uint8).contiguous().numpy())
        return compressed.LinearCodes(codes, 4, _params(scale, codes.ndim))
    if data.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        codes = _array(data)
        return compressed.LinearCodes(codes, 8, _params(scale, codes.ndim))
    if data.dtype not in (torch.int8, torch.uint8):
        raise cx.unsupported(
            f"quantized data of dtype {data.dtype} (int8/uint8 codes, float8 or packed FP4 "
            "are supported)"
        )
    bounds = compressed.integer_bounds(input_dtype or data.dtype)
    if bounds is None:
        raise cx.unsupported(f"input_dtype {input_dtype} is not an integer type of 1 to 8 bits")
    signed = bounds[0] < 0
    bits = int(math.log2(bounds[1] - bounds[0] + 1))
    codes = data.numpy().view(np.int8 if signed else np.uint8)
    scale_np = _params(scale, codes.ndim)
    offset = None
    if minval is not None:  # (codes - qmin) * scale + minval
        zp_np = np.full(scale_np.shape, bounds[0], np.int32)
        offset = _params(minval, codes.ndim).astype(np.float32)
    elif zero_point is not None:
        zp_np = _params(zero_point, codes.ndim).astype(np.int32)
    else:
        zp_np = None
    try:
        return compressed.LinearCodes(codes, bits, scale_np, zp_np, signed, offset)
    except ValueError as error:
        raise cx.unsupported(str(error)) from None


def _scaled_palette(cx: LoweringContext, node: torch.fx.Node) -> compressed.PaletteCodes | None:
    """For a ``constexpr_blockwise_shift_scale`` node scaling the only result of a
    ``lut_to_dense`` of weights (coreai-opt's ``ScaledPalettizeModule``), the scaled palette
    both stand for; else None."""
    args = bind_arguments(node)
    source = args["data"]
    if not _is_op(source, "lut_to_dense") or len(source.users) != 1 or args["minval"] is not None:
        return None
    palette = _palette(cx, source)
    scale = weight_tensor(cx, args["scale"])
    zero_point = weight_tensor(cx, args["zero_point"]) if args["zero_point"] is not None else None
    if palette is None or scale is None or (args["zero_point"] is not None and zero_point is None):
        return None
    rank = palette.ndim
    zp = _params(zero_point, rank).astype(np.int32) if zero_point is not None else None
    try:
        return compressed.PaletteCodes(
            palette.indices,
            palette.bits,
            palette.lut,
            palette.vector_axis,
            _params(scale, rank).astype(np.float32),
            zp,
        )
    except ValueError:
        return None


@lowering("coreai::constexpr_blockwise_shift_scale.default")
def constexpr_blockwise_shift_scale(
    cx: LoweringContext,
    data: ir.Value,
    scale: ir.Value,
    zero_point: ir.Value | None = None,
    minval: ir.Value | None = None,
    input_dtype: torch.dtype | None = None,
    output_dtype: torch.dtype | None = None,
) -> ir.Value:
    """``(data - zero_point) * scale`` (or ``(data - qmin) * scale + minval``) per block: a
    compressed weight when ``data`` and the parameters are weights."""
    args = bind_arguments(cx.node)
    out = cx.out_dtype
    palette = _scaled_palette(cx, cx.node)
    if palette is not None:
        return emit_compressed(cx, args["data"].args[0], palette, out)
    codes = _linear_codes(cx, args, input_dtype)
    if codes is not None:
        return emit_compressed(cx, args["data"], codes, out)
    if input_dtype == _FLOAT4:
        raise cx.unsupported("packed FP4 data must be a weight of the program")
    return _affine(cx, data, scale, zero_point, minval, input_dtype, out)


def _affine(
    cx: LoweringContext,
    data: ir.Value,
    scale: ir.Value,
    zero_point: ir.Value | None,
    minval: ir.Value | None,
    input_dtype: torch.dtype | None,
    out: torch.dtype,
) -> ir.Value:
    """The run-time form (data computed by the program): float32 arithmetic per block."""
    shape = known_sizes(shape_of(data))
    if shape is None:
        raise cx.unsupported("blockwise dequantization of a value with a dynamic shape")
    split: list[int] = []
    block_shape: list[int] = []
    params = [p for p in (scale, zero_point, minval) if p is not None]
    ranks = {len(shape_of(p)) for p in params}
    if ranks - {len(shape)}:
        raise cx.unsupported("blockwise parameters must have the data's rank")
    for axis, size in enumerate(shape):
        count = shape_of(scale)[axis]
        if count is None or size % count:
            raise cx.unsupported("the scale's shape must divide the data's shape")
        split += [count, size // count]
        block_shape += [count, 1]
    values = reshape(cast(data, torch.float32), split)

    def per_block(param: ir.Value) -> ir.Value:
        return reshape(cast(param, torch.float32), block_shape)

    if minval is not None:
        low = compressed.integer_bounds(input_dtype or dtypes.dtype_of(data))
        if low is None:
            raise cx.unsupported("the min-value formulation needs integer data")
        values = cai.broadcasting_sub(values, cai.constant(np.float32(low[0])))
    elif zero_point is not None:
        values = cai.broadcasting_sub(values, per_block(zero_point))
    values = cai.broadcasting_mul(values, per_block(scale))
    if minval is not None:
        values = cai.broadcasting_add(values, per_block(minval))
    return cast(reshape(values, shape), out)


# ---------------------------------------------------------------------------- palettes ---


def _palette(cx: LoweringContext, node: torch.fx.Node) -> compressed.PaletteCodes | None:
    """The palette a ``lut_to_dense`` node of weights decompresses (None: not weights)."""
    args = bind_arguments(node)
    indices = weight_tensor(cx, args["indices"])
    lut = weight_tensor(cx, args["lut"])
    if indices is None or lut is None:
        return None
    if indices.dtype not in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
        raise cx.unsupported(f"palette indices of dtype {indices.dtype}")
    entries = lut.shape[-2] if lut.dim() >= 2 else 0
    bits = int(math.log2(entries)) if entries else 0
    if entries != 2**bits or not 1 <= bits <= 8:
        raise cx.unsupported(
            f"palettes of {entries} entries (1 to 8-bit indices: 2, 4, ..., 256 entries)"
        )
    axis = args["vector_axis"] or 0
    rank = indices.dim()
    lut_np = _array(lut)
    if lut.dtype not in (torch.int8, torch.uint8):
        lut_np = lut_np.astype(np.float32)
    try:
        return compressed.PaletteCodes(
            indices.to(torch.uint8).numpy(), bits, lut_np, axis % max(rank, 1)
        )
    except ValueError as error:
        raise cx.unsupported(str(error)) from None


@lowering("coreai::lut_to_dense.default")
def lut_to_dense(
    cx: LoweringContext, indices: ir.Value, lut: ir.Value, vector_axis: int | None = None
) -> ir.Value:
    """``lut[group, indices]``: a palettized weight (``lut_to_dense``)."""
    if len(cx.node.users) == 1 and _is_op(
        next(iter(cx.node.users)), "constexpr_blockwise_shift_scale"
    ):
        user = next(iter(cx.node.users))
        if _scaled_palette(cx, user) is not None:
            # the scale's lowering decompresses the scaled palette; this value is unused
            element = dtypes.to_mlir(cx.out_dtype)
            ttype = ir.RankedTensorType.get(cx.out_shape, element)
            return cai.ConstantOp(value=compressed.splat_attr(ttype, 0)).result
    palette = _palette(cx, cx.node)
    if palette is None:
        raise cx.unsupported(
            "the indices and the palettes must be weights of the program (palettes are "
            "decompressed from constants)"
        )
    return emit_compressed(cx, bind_arguments(cx.node)["indices"], palette, cx.out_dtype)


# ---------------------------------------------------------------------- sparse weights ---


@lowering("coreai::sparse_to_dense.default")
def sparse_to_dense(cx: LoweringContext, nonzero_data: ir.Value, mask: ir.Value) -> ir.Value:
    """The kept values scattered into the mask: a sparse weight (values + bit mask)."""
    args = bind_arguments(cx.node)
    values = weight_tensor(cx, args["nonzero_data"])
    kept = weight_tensor(cx, args["mask"])
    if values is None or kept is None:
        raise cx.unsupported("the values and the mask of a sparse weight must be weights")
    if not values.is_floating_point():
        raise cx.unsupported(f"sparse values of dtype {values.dtype} (float values only)")
    try:
        codes = compressed.SparseCodes(
            kept.to(torch.bool).numpy(), _array(values).astype(np.float32).reshape(-1)
        )
    except ValueError as error:
        raise cx.unsupported(str(error)) from None
    return emit_compressed(cx, args["nonzero_data"], codes, cx.out_dtype)


# -------------------------------------------------------------------------- activations ---


def _parameter(
    cx: LoweringContext,
    arg: Any,
    value: ir.Value,
    shape: list[int],
    dtype: torch.dtype,
) -> ir.Value:
    """A quantization parameter of ``shape`` (``[]`` or ``[C]``) and ``dtype``: a constant
    when it is a weight, else the value reshaped and converted."""
    tensor = weight_tensor(cx, arg)
    if tensor is not None:
        array = _array(tensor).astype(np.float64).reshape(shape)
        return _constant(array, dtype)
    return cast(reshape(value, shape), dtype)


def _constant(array: np.ndarray, dtype: torch.dtype) -> ir.Value:
    element = dtypes.to_mlir(dtype)
    ttype = ir.RankedTensorType.get(list(array.shape), element)
    if dtype.is_floating_point:
        attrs = [ir.FloatAttr.get(element, float(v)) for v in array.reshape(-1)]
    else:
        attrs = [ir.IntegerAttr.get(element, int(v)) for v in array.reshape(-1)]
    return cai.ConstantOp(value=ir.DenseElementsAttr.get(attrs, type=ttype)).result


def _splat(value: float, shape: list[int], dtype: torch.dtype) -> ir.Value:
    ttype = ir.RankedTensorType.get(shape, dtypes.to_mlir(dtype))
    return cai.ConstantOp(value=compressed.splat_attr(ttype, value)).result


def _layout(
    cx: LoweringContext, x: ir.Value, scale: ir.Value, axis: int | None
) -> tuple[list[int], ir.Value]:
    """The parameters' shape (``[]`` per tensor, ``[C]`` per channel) and the ``axis``
    operand (``[0, .., rank-1]`` per tensor, the channel axis per channel)."""
    rank = len(shape_of(x))
    count = math.prod(d or 0 for d in shape_of(scale)) if shape_of(scale) else 1
    si32 = ir.IntegerType.get_signed(32)
    if count == 1:
        array = np.arange(rank, dtype=np.int32)
        ttype = ir.RankedTensorType.get([rank], si32)
        return [], cai.ConstantOp(value=ir.DenseElementsAttr.get(array, type=ttype)).result
    if len([d for d in shape_of(scale) if d != 1]) != 1:
        raise cx.unsupported("activation scales are per tensor or per channel (1-D)")
    along = (axis or 0) % rank
    if shape_of(x)[along] != count:
        raise cx.unsupported(f"{count} scales do not match axis {along} of the input")
    ttype = ir.RankedTensorType.get([], si32)
    return [count], cai.ConstantOp(
        value=ir.DenseElementsAttr.get(np.array(along, np.int32), type=ttype)
    ).result


def _code_type(cx: LoweringContext, dtype: torch.dtype | None) -> tuple[torch.dtype, int]:
    if dtype is None or dtype not in (torch.int8, torch.uint8):
        raise cx.unsupported(f"activations are quantized to int8 or uint8, not {dtype}")
    return dtype, compressed.code_range(8, dtype == torch.int8)[0]


@lowering("coreai::quantize.default")
def quantize(
    cx: LoweringContext,
    input: ir.Value,
    scale: ir.Value,
    output_dtype: torch.dtype,
    zero_point: ir.Value | None = None,
    minval: ir.Value | None = None,
    axis: int | None = None,
) -> ir.Value:
    """``clamp(round(input / scale) + zero_point)`` (or ``round((input - minval) / scale) +
    qmin``): Core AI's ``quantize``, per tensor or per channel."""
    args = bind_arguments(cx.node)
    code, low = _code_type(cx, output_dtype)
    x_dtype = dtypes.dtype_of(input)
    if not x_dtype.is_floating_point:
        raise cx.unsupported(f"quantize of a {x_dtype} input (float inputs only)")
    shape, axis_value = _layout(cx, input, scale, axis)
    s = _parameter(cx, args["scale"], scale, shape, x_dtype)
    offset1, offset2 = _offsets(cx, args, zero_point, minval, shape, (code, low), x_dtype)
    return cai.quantize(input, s, offset1, offset2, axis_value)


def _offsets(
    cx: LoweringContext,
    args: Any,
    zero_point: ir.Value | None,
    minval: ir.Value | None,
    shape: Any,
    code_range: tuple[torch.dtype, int],
    float_dtype: torch.dtype,
) -> tuple[ir.Value, ir.Value]:
    """The integer and float offsets of Core AI's ``quantize`` / ``dequantize``: ``(qmin,
    minval)`` in the min-value form, else ``(zero_point or 0, 0.0)``."""
    code, low = code_range
    if minval is not None:
        return _splat(low, shape, code), _parameter(cx, args["minval"], minval, shape, float_dtype)
    offset1 = (
        _parameter(cx, args["zero_point"], zero_point, shape, code)
        if zero_point is not None
        else _splat(0, shape, code)
    )
    return offset1, _splat(0.0, shape, float_dtype)


@lowering("coreai::dequantize.default")
def dequantize(
    cx: LoweringContext,
    input: ir.Value,
    scale: ir.Value,
    zero_point: ir.Value | None = None,
    minval: ir.Value | None = None,
    axis: int | None = None,
    input_dtype: torch.dtype | None = None,
    output_dtype: torch.dtype | None = None,
) -> ir.Value:
    """``(input - zero_point) * scale`` (or ``(input - qmin) * scale + minval``): Core AI's
    ``dequantize``, per tensor or per channel."""
    args = bind_arguments(cx.node)
    code, low = _code_type(cx, dtypes.dtype_of(input))
    if input_dtype is not None and input_dtype != code:
        raise cx.unsupported(f"input_dtype {input_dtype} differs from the input's {code}")
    out = cx.out_dtype
    shape, axis_value = _layout(cx, input, scale, axis)
    s = _parameter(cx, args["scale"], scale, shape, out)
    offset1, offset2 = _offsets(cx, args, zero_point, minval, shape, (code, low), out)
    result = cai.dequantize(input, s, offset1, offset2, axis_value)
    compressed.check_decompression(result, f"{cx.node.name}")
    return result


# ------------------------------------------------- aten quantized tensors (Core ML route) ---

#: quantized dtypes -> their integer range
_QUANTIZED_RANGE = {torch.qint8: (-128, 127), torch.quint8: (0, 255)}
_DEQUANTIZE = "aten.dequantize.self"


def _aten_fake_quantize(
    cx: LoweringContext,
    x: ir.Value,
    scale: ir.Value | float,
    zero_point: ir.Value | int,
    dtype: torch.dtype,
) -> ir.Value:
    """``(clamp(round(x * (1 / scale)) + zero_point) - zero_point) * scale``: a quantized tensor
    that is only dequantized (what ``x.dequantize()`` of it gives), as PyTorch computes it.
    (``quantize_per_channel`` has no fake kernel in PyTorch: it does not export.)"""
    bounds = _QUANTIZED_RANGE.get(dtype)
    if bounds is None:
        raise cx.unsupported(f"quantized dtype {dtype} (qint8 and quint8 are supported)")
    users = list(cx.node.users)
    if not users or any(str(u.target) != _DEQUANTIZE for u in users):
        raise cx.unsupported(
            "a quantized tensor is supported when it is only dequantized (x.dequantize())"
        )

    def scalar(value: ir.Value | float) -> ir.Value:
        if not isinstance(value, ir.Value):
            return _constant(np.array(float(value)), torch.float32)
        return reshape(cast(value, torch.float32), [])

    s, zp = scalar(scale), scalar(zero_point)
    values = cast(x, torch.float32)
    inverse = cai.broadcasting_divide(_constant(np.array(1.0), torch.float32), s)
    q = cai.broadcasting_add(cai.round_(cai.broadcasting_mul(values, inverse)), zp)
    q = cai.broadcasting_minimum(
        cai.broadcasting_maximum(q, _constant(np.array(float(bounds[0])), torch.float32)),
        _constant(np.array(float(bounds[1])), torch.float32),
    )
    return cast(cai.broadcasting_mul(cai.broadcasting_sub(q, zp), s), cx.out_dtype)


@lowering("aten::quantize_per_tensor.tensor_qparams", "aten::quantize_per_tensor.default")
def quantize_per_tensor(
    cx: LoweringContext,
    self: ir.Value,
    scale: ir.Value | float,
    zero_point: ir.Value | int,
    dtype: torch.dtype,
) -> ir.Value:
    """A quantized tensor that is only dequantized (coreai-opt's Core ML route quantizes
    activations so): computed as PyTorch does."""
    return _aten_fake_quantize(cx, self, scale, zero_point, dtype)


@lowering("aten::dequantize.self")
def dequantize_self(cx: LoweringContext, self: ir.Value) -> ir.Value:
    """``x.dequantize()`` of a quantized tensor: the quantize lowering computed it already."""
    source = cx.node.args[0]
    if not (isinstance(source, torch.fx.Node) and "quantize_per_" in str(source.target)):
        raise cx.unsupported("dequantize of a tensor that is not quantized by the program")
    return cast(self, cx.out_dtype)
