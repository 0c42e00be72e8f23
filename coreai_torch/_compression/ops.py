"""The ``torch.ops.coreai`` decompression ops (CPU and fake kernels).

Registered once, when ``coreai_torch`` is imported (so that a saved ``ExportedProgram`` holding
them loads after ``import coreai_torch``).  They are not decomposed (``get_decomp_table()``
keeps them whole) and the converter lowers each to Core AI's native op, with the data kept
compressed in the asset (:mod:`coreai_torch.lowerings.coreai_ops`):

* ``constexpr_blockwise_shift_scale(data, scale, zero_point=None, minval=None,
  input_dtype=None, output_dtype=None)``: ``(data - zero_point) * scale`` or, with ``minval``,
  ``(data - qmin) * scale + minval``, each scale element covering a block of
  ``data.shape / scale.shape``; ``input_dtype`` is the codes' integer type (its width and
  ``qmin``; ``torch.int4`` codes live in int8), or ``torch.float4_e2m1fn_x2`` for FP4 codes
  packed two per byte.  The result has ``output_dtype`` (default: the scale's dtype);
* ``lut_to_dense(indices, lut, vector_axis=None)``: palette lookup, ``lut`` of shape
  ``[*groups, 2**bits, V]`` (one palette per block of the indices; ``V`` values per entry,
  laid along ``vector_axis``);
* ``sparse_to_dense(nonzero_data, mask)``: the kept values scattered into ``mask``;
* ``quantize(input, scale, output_dtype, zero_point=None, minval=None, axis=None)`` and
  ``dequantize(input, scale, zero_point=None, minval=None, axis=None, input_dtype=None,
  output_dtype=None)``: activations, per tensor (0-D scale) or per channel along ``axis``.

The math follows Core AI's ops, so that what PyTorch computes with these kernels is what the
converted program computes on the runtime.
"""

from __future__ import annotations

import torch

from coreai_torch._compression._floatx import unpack_float4
from coreai_torch.ir.compressed import integer_bounds

__all__ = ["library"]

#: the ``coreai`` op namespace
library = torch.library.Library("coreai", "DEF")

library.define(
    "constexpr_blockwise_shift_scale(Tensor data, Tensor scale, Tensor? zero_point=None, "
    "Tensor? minval=None, ScalarType? input_dtype=None, ScalarType? output_dtype=None) -> Tensor"
)
library.define("lut_to_dense(Tensor indices, Tensor lut, int? vector_axis=None) -> Tensor")
library.define("sparse_to_dense(Tensor nonzero_data, Tensor mask) -> Tensor")
library.define(
    "quantize(Tensor input, Tensor scale, ScalarType output_dtype, Tensor? zero_point=None, "
    "Tensor? minval=None, int? axis=None) -> Tensor"
)
library.define(
    "dequantize(Tensor input, Tensor scale, Tensor? zero_point=None, Tensor? minval=None, "
    "int? axis=None, ScalarType? input_dtype=None, ScalarType? output_dtype=None) -> Tensor"
)

_FLOAT4 = torch.float4_e2m1fn_x2
_E8M0 = torch.float8_e8m0fnu


def _need_range(dtype: torch.dtype | None, what: str) -> tuple[int, int]:
    bounds = integer_bounds(dtype) if dtype is not None else None
    if bounds is None:
        raise ValueError(f"{what} needs an integer dtype of at most 8 bits, got {dtype}")
    return bounds


def _output_dtype(scale: torch.Tensor, output_dtype: torch.dtype | None) -> torch.dtype:
    if output_dtype is not None:
        return output_dtype
    if scale.dtype == _E8M0:
        raise ValueError("a float8_e8m0fnu scale needs output_dtype (the compute dtype)")
    return scale.dtype


def _data_shape(data: torch.Tensor, input_dtype: torch.dtype | None) -> list[int]:
    shape = list(data.shape)
    if input_dtype == _FLOAT4 or data.dtype == _FLOAT4:
        shape[-1] *= 2
    return shape


def _blocks(param: torch.Tensor, shape: list[int], what: str) -> torch.Tensor:
    """``param`` (one element per block) repeated to ``shape``."""
    if param.dim() < len(shape):
        param = param.reshape([1] * (len(shape) - param.dim()) + list(param.shape))
    if param.dim() != len(shape) or any(
        p == 0 or s % p for s, p in zip(shape, param.shape, strict=True)
    ):
        raise ValueError(
            f"the {what} of shape {list(param.shape)} does not divide the data's shape "
            f"{shape} into blocks"
        )
    for axis, (size, count) in enumerate(zip(shape, param.shape, strict=True)):
        if count != size:
            param = param.repeat_interleave(size // count, dim=axis)
    return param


def _values(data: torch.Tensor, input_dtype: torch.dtype | None) -> torch.Tensor:
    if input_dtype == _FLOAT4 or data.dtype == _FLOAT4:
        return unpack_float4(data)
    return data.to(torch.float32)


@torch.library.impl(library, "constexpr_blockwise_shift_scale", "CompositeExplicitAutograd")
def _blockwise_shift_scale(
    data: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None = None,
    minval: torch.Tensor | None = None,
    input_dtype: torch.dtype | None = None,
    output_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    out = _output_dtype(scale, output_dtype)
    shape = _data_shape(data, input_dtype)
    values = _values(data, input_dtype)
    if minval is not None:
        low = _need_range(input_dtype or data.dtype, "the min-value formulation")[0]
        values = values - low
    elif zero_point is not None:
        values = values - _blocks(zero_point.to(torch.float32), shape, "zero point")
    values = values * _blocks(scale.to(torch.float32), shape, "scale")
    if minval is not None:
        values = values + _blocks(minval.to(torch.float32), shape, "minval")
    return values.to(out)


@torch.library.register_fake("coreai::constexpr_blockwise_shift_scale", lib=library)
def _blockwise_shift_scale_fake(
    data: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None = None,
    minval: torch.Tensor | None = None,
    input_dtype: torch.dtype | None = None,
    output_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    shape = _data_shape(data, input_dtype)
    return data.new_empty(shape, dtype=_output_dtype(scale, output_dtype))


def _lut_shape(indices: torch.Tensor, lut: torch.Tensor, vector_axis: int | None) -> list[int]:
    rank = indices.dim()
    if lut.dim() != rank + 2:
        raise ValueError(
            f"lut_to_dense: the palettes of rank-{rank} indices have rank {rank + 2} "
            f"([*groups, entries, vector]), got shape {list(lut.shape)}"
        )
    shape = list(indices.shape)
    vector = lut.shape[-1]
    if vector > 1:
        axis = (vector_axis or 0) % rank
        shape[axis] *= vector
    return shape


@torch.library.impl(library, "lut_to_dense", "CompositeExplicitAutograd")
def _lut_to_dense(
    indices: torch.Tensor, lut: torch.Tensor, vector_axis: int | None = None
) -> torch.Tensor:
    shape = _lut_shape(indices, lut, vector_axis)
    rank = indices.dim()
    groups, entries, vector = list(lut.shape[:rank]), lut.shape[-2], lut.shape[-1]
    group = torch.zeros(indices.shape, dtype=torch.long, device=indices.device)
    for axis, (size, count) in enumerate(zip(indices.shape, groups, strict=True)):
        if count == 0 or size % count:
            raise ValueError(
                f"lut_to_dense: {count} palette groups do not divide axis {axis} of the "
                f"indices (size {size})"
            )
        along = [1] * rank
        along[axis] = size
        position = torch.arange(size, device=indices.device) // (size // count)
        group = group * count + position.reshape(along)
    codes = indices.to(torch.long)
    if codes.numel() and int(codes.max()) >= entries:
        raise ValueError(f"lut_to_dense: an index exceeds the {entries} palette entries")
    values = lut.reshape(-1, entries, vector)[group, codes]  # [*indices.shape, vector]
    if vector == 1:
        return values.squeeze(-1)
    axis = (vector_axis or 0) % rank
    return values.movedim(-1, axis + 1).reshape(shape)


@torch.library.register_fake("coreai::lut_to_dense", lib=library)
def _lut_to_dense_fake(
    indices: torch.Tensor, lut: torch.Tensor, vector_axis: int | None = None
) -> torch.Tensor:
    return lut.new_empty(_lut_shape(indices, lut, vector_axis))


@torch.library.impl(library, "sparse_to_dense", "CompositeExplicitAutograd")
def _sparse_to_dense(nonzero_data: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    keep = mask.to(torch.bool)
    count = int(keep.sum())
    if nonzero_data.numel() != count:
        raise ValueError(
            f"sparse_to_dense: the mask keeps {count} values but {nonzero_data.numel()} are given"
        )
    out = torch.zeros(mask.shape, dtype=nonzero_data.dtype, device=nonzero_data.device)
    out[keep] = nonzero_data.reshape(-1)
    return out


@torch.library.register_fake("coreai::sparse_to_dense", lib=library)
def _sparse_to_dense_fake(nonzero_data: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return nonzero_data.new_empty(mask.shape)


def _along(param: torch.Tensor, rank: int, axis: int | None, what: str) -> torch.Tensor:
    """A per-tensor (one element) or per-channel (1-D, along ``axis``) parameter shaped to
    broadcast against a rank-``rank`` input."""
    if param.numel() == 1:
        return param.reshape([])
    if param.dim() != 1:
        raise ValueError(
            f"the {what} of an activation is 0-D (per tensor) or 1-D (per channel along "
            f"axis), got shape {list(param.shape)}"
        )
    along = [1] * rank
    along[(axis or 0) % rank] = param.shape[0]
    return param.reshape(along)


@torch.library.impl(library, "quantize", "CompositeExplicitAutograd")
def _quantize(
    input: torch.Tensor,
    scale: torch.Tensor,
    output_dtype: torch.dtype,
    zero_point: torch.Tensor | None = None,
    minval: torch.Tensor | None = None,
    axis: int | None = None,
) -> torch.Tensor:
    low, high = _need_range(output_dtype, "quantize")
    if output_dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"quantize produces int8 or uint8 values, not {output_dtype}")
    rank = input.dim()
    scaled_input = input
    if minval is not None:
        scaled_input = input - _along(minval.to(input.dtype), rank, axis, "minval")
    q = torch.round(scaled_input / _along(scale.to(input.dtype), rank, axis, "scale"))
    if minval is not None:
        q = q + low
    elif zero_point is not None:
        q = q + _along(zero_point.to(q.dtype), rank, axis, "zero point")
    return q.clamp(low, high).to(output_dtype)


@torch.library.register_fake("coreai::quantize", lib=library)
def _quantize_fake(
    input: torch.Tensor,
    scale: torch.Tensor,
    output_dtype: torch.dtype,
    zero_point: torch.Tensor | None = None,
    minval: torch.Tensor | None = None,
    axis: int | None = None,
) -> torch.Tensor:
    return input.new_empty(input.shape, dtype=output_dtype)


@torch.library.impl(library, "dequantize", "CompositeExplicitAutograd")
def _dequantize(
    input: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None = None,
    minval: torch.Tensor | None = None,
    axis: int | None = None,
    input_dtype: torch.dtype | None = None,
    output_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    out = _output_dtype(scale, output_dtype)
    rank = input.dim()
    values = input.to(torch.float32)
    if minval is not None:
        values = values - _need_range(input_dtype or input.dtype, "dequantize")[0]
    elif zero_point is not None:
        values = values - _along(zero_point.to(torch.float32), rank, axis, "zero point")
    values = values * _along(scale.to(torch.float32), rank, axis, "scale")
    if minval is not None:
        values = values + _along(minval.to(torch.float32), rank, axis, "minval")
    return values.to(out)


@torch.library.register_fake("coreai::dequantize", lib=library)
def _dequantize_fake(
    input: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None = None,
    minval: torch.Tensor | None = None,
    axis: int | None = None,
    input_dtype: torch.dtype | None = None,
    output_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    return input.new_empty(input.shape, dtype=_output_dtype(scale, output_dtype))
