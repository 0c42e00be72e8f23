"""The ``torch.ops.coreai`` decompression ops (coreai-opt's finalized models) on the Core AI
runtime vs eager PyTorch: weights as int8/uint8 codes with per-channel or per-block scales,
zero points or min values, scalar and vector palettes, sparse weights, and activations
quantized and dequantized at run time (per tensor and per channel)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.helpers import check_module

coreai = torch.ops.coreai


class Decompressed(nn.Module):
    """``linear(x, weight())`` with ``weight`` decompressing buffers registered from ``parts``."""

    def __init__(self, weight: Callable[..., torch.Tensor], **parts: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight
        for name, value in parts.items():
            self.register_buffer(name, value)
        self.names = list(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight(*(getattr(self, n) for n in self.names))
        return F.linear(x, w)


def _codes(dtype: torch.dtype, *shape: int) -> torch.Tensor:
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max + 1, shape, dtype=dtype)


WEIGHTS: dict[str, Decompressed] = {
    "int8_per_channel": Decompressed(
        lambda d, s: coreai.constexpr_blockwise_shift_scale(d, s),
        d=_codes(torch.int8, 16, 32),
        s=torch.rand(16, 1) * 0.01,
    ),
    "uint8_blocks_zero_point": Decompressed(
        lambda d, s, z: coreai.constexpr_blockwise_shift_scale(d, s, zero_point=z),
        d=_codes(torch.uint8, 16, 32),
        s=torch.rand(16, 4) * 0.01,
        z=torch.randint(100, 156, (16, 4), dtype=torch.uint8),
    ),
    "int8_minval_half": Decompressed(
        lambda d, s, m: coreai.constexpr_blockwise_shift_scale(
            d, s, minval=m, output_dtype=torch.float32
        ),
        d=_codes(torch.int8, 16, 32),
        s=(torch.rand(1, 32) * 0.01).half(),
        m=-torch.rand(1, 32).half(),
    ),
    "scalar_palette": Decompressed(
        lambda i, lut: coreai.lut_to_dense(i, lut),
        i=torch.randint(0, 16, (16, 32), dtype=torch.uint8),
        lut=torch.randn(1, 1, 16, 1),
    ),
    "grouped_palettes": Decompressed(
        lambda i, lut: coreai.lut_to_dense(i, lut),
        i=torch.randint(0, 4, (16, 32), dtype=torch.uint8),
        lut=torch.randn(4, 1, 4, 1),
    ),
    "vector_palette": Decompressed(
        lambda i, lut: coreai.lut_to_dense(i, lut, 0),
        i=torch.randint(0, 8, (8, 32), dtype=torch.uint8),
        lut=torch.randn(1, 1, 8, 2),
    ),
}


def _sparse() -> Decompressed:
    mask = torch.rand(16, 32) > 0.6
    return Decompressed(
        lambda v, m: coreai.sparse_to_dense(v, m), v=torch.randn(int(mask.sum())), m=mask
    )


@pytest.mark.parametrize("name", [*WEIGHTS, "sparse"])
def test_decompressed_weights(name: str) -> None:
    model = _sparse() if name == "sparse" else WEIGHTS[name]
    check_module(model.eval(), (torch.randn(3, 32),), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("dtype", "per_channel"), [(torch.int8, False), (torch.uint8, False), (torch.int8, True)]
)
def test_activations_quantized_at_run_time(dtype: torch.dtype, per_channel: bool) -> None:
    class Activations(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            scale = torch.tensor([0.02, 0.05, 0.1, 0.03]) if per_channel else torch.tensor(0.05)
            axis = -1 if per_channel else None
            zero = None if dtype == torch.int8 else torch.tensor(128, dtype=torch.uint8)
            q = coreai.quantize(x, scale, dtype, zero_point=zero, axis=axis)
            return coreai.dequantize(q, scale, zero_point=zero, axis=axis)

    check_module(Activations().eval(), (torch.randn(3, 5, 4) * 3,), atol=1e-6, rtol=0)
