"""Modules whose forward is one ``torch.ops.coreai`` decompression op (coreai-opt's finalizers
build them; :func:`coreai_torch._compression.utils.wrap_for_parametrization` makes weight
parametrizations of the weight-producing ones).

Every tensor is a buffer (in ``state_dict()``, reloadable with ``load_state_dict(...,
assign=True)``); ``None`` arguments are not stored.  Importing this module registers the ops.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from coreai_torch._compression import ops as _ops  # noqa: F401  (registers torch.ops.coreai)

__all__ = [
    "ActivationDequantizeModule",
    "ActivationQuantizeModule",
    "PalettizeModule",
    "ScaledPalettizeModule",
    "SparseModule",
    "WeightDequantizeModule",
]

coreai = torch.ops.coreai


class _Buffers(nn.Module):
    """Registers tensor arguments as buffers (``None`` ones are not stored)."""

    def _store(self, **tensors: torch.Tensor | None) -> None:
        for name, tensor in tensors.items():
            if tensor is not None and not isinstance(tensor, torch.Tensor):
                raise TypeError(
                    f"{type(self).__name__}: {name} must be a tensor or None, got "
                    f"{type(tensor).__name__}"
                )
            self.register_buffer(name, tensor.detach() if tensor is not None else None)


class PalettizeModule(_Buffers):
    """A palettized weight: ``lut_to_dense(indices, lut, vector_axis)``.

    ``indices``: uint8 (the weight's shape, divided by ``V`` along ``vector_axis`` for vector
    palettes); ``lut``: ``[*groups, 2**bits, V]`` in the weight's dtype (or an integer
    LUT, see :class:`ScaledPalettizeModule`)."""

    indices: torch.Tensor
    lut: torch.Tensor

    def __init__(
        self, indices: torch.Tensor, lut: torch.Tensor, vector_axis: int | None = None
    ) -> None:
        super().__init__()
        self._store(indices=indices, lut=lut)
        self.vector_axis = vector_axis

    def forward(self, *_: Any) -> torch.Tensor:
        return coreai.lut_to_dense(self.indices, self.lut, self.vector_axis)

    def extra_repr(self) -> str:
        return f"lut={list(self.lut.shape)}, vector_axis={self.vector_axis}"


class ScaledPalettizeModule(PalettizeModule):
    """A palettized weight scaled per block: ``(lut_to_dense(indices, lut) - zero_point) *
    scale``.  ``lut`` is float, or int8/uint8 (a quantized LUT; ``zero_point`` then has its
    dtype); ``scale`` has the weight's rank (``[C_out, 1]`` per output channel)."""

    scale: torch.Tensor
    zero_point: torch.Tensor | None

    def __init__(
        self,
        indices: torch.Tensor,
        lut: torch.Tensor,
        scale: torch.Tensor,
        zero_point: torch.Tensor | None = None,
        vector_axis: int | None = None,
    ) -> None:
        super().__init__(indices, lut, vector_axis)
        self._store(scale=scale, zero_point=zero_point)

    def forward(self, *_: Any) -> torch.Tensor:
        dense = coreai.lut_to_dense(self.indices, self.lut, self.vector_axis)
        return coreai.constexpr_blockwise_shift_scale(dense, self.scale, self.zero_point)


class WeightDequantizeModule(_Buffers):
    """A linearly quantized weight: ``constexpr_blockwise_shift_scale(quantized_data, scale,
    zero_point, minval, input_dtype, output_dtype)`` (see
    :mod:`coreai_torch._compression.ops`)."""

    quantized_data: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor | None
    minval: torch.Tensor | None

    def __init__(
        self,
        quantized_data: torch.Tensor,
        scale: torch.Tensor,
        zero_point: torch.Tensor | None = None,
        minval: torch.Tensor | None = None,
        input_dtype: torch.dtype | None = None,
        output_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self._store(quantized_data=quantized_data, scale=scale, zero_point=zero_point)
        self._store(minval=minval)
        self.input_dtype = input_dtype
        self.output_dtype = output_dtype

    def forward(self, *_: Any) -> torch.Tensor:
        return coreai.constexpr_blockwise_shift_scale(
            self.quantized_data,
            self.scale,
            self.zero_point,
            self.minval,
            self.input_dtype,
            self.output_dtype,
        )

    def extra_repr(self) -> str:
        return f"input_dtype={self.input_dtype}, scale={list(self.scale.shape)}"


class SparseModule(_Buffers):
    """A sparse weight: the values ``nonzero_data`` (1-D, row-major) scattered into the bool
    ``mask`` (the weight's shape)."""

    nonzero_data: torch.Tensor
    mask: torch.Tensor

    def __init__(self, nonzero_data: torch.Tensor, mask: torch.Tensor) -> None:
        super().__init__()
        self._store(nonzero_data=nonzero_data, mask=mask.to(torch.bool))

    def forward(self, *_: Any) -> torch.Tensor:
        return coreai.sparse_to_dense(self.nonzero_data, self.mask)


class ActivationQuantizeModule(_Buffers):
    """Quantizes its input: ``clamp(round(x / scale) + zero_point)`` (or
    ``round((x - minval) / scale) + qmin``) in ``output_dtype``; per tensor (0-D scale) or per
    channel along ``axis``."""

    scale: torch.Tensor
    zero_point: torch.Tensor | None
    minval: torch.Tensor | None

    def __init__(
        self,
        scale: torch.Tensor,
        output_dtype: torch.dtype,
        zero_point: torch.Tensor | None = None,
        minval: torch.Tensor | None = None,
        axis: int | None = 0,
    ) -> None:
        super().__init__()
        self._store(scale=scale, zero_point=zero_point, minval=minval)
        self.output_dtype = output_dtype
        self.axis = axis

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return coreai.quantize(
            x, self.scale, self.output_dtype, self.zero_point, self.minval, self.axis
        )


class ActivationDequantizeModule(_Buffers):
    """Dequantizes its input: ``(q - zero_point) * scale`` (or ``(q - qmin) * scale +
    minval``) in ``output_dtype``."""

    scale: torch.Tensor
    zero_point: torch.Tensor | None
    minval: torch.Tensor | None

    def __init__(
        self,
        scale: torch.Tensor,
        zero_point: torch.Tensor | None = None,
        minval: torch.Tensor | None = None,
        axis: int | None = 0,
        input_dtype: torch.dtype | None = None,
        output_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self._store(scale=scale, zero_point=zero_point, minval=minval)
        self.axis = axis
        self.input_dtype = input_dtype
        self.output_dtype = output_dtype

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return coreai.dequantize(
            q,
            self.scale,
            self.zero_point,
            self.minval,
            self.axis,
            self.input_dtype,
            self.output_dtype,
        )
