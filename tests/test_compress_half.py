"""``compress()`` of half-precision programs (``TorchConverter(compute_precision=float16 |
bfloat16)``): every weight is compressed, before and after ``optimize()`` (in the half program
they are read through the casts of the float32 accumulation), with scales and the decompressed
weight in the half type; the program matches the fake-quantized model (its weights quantized
from their half-precision values, decompressed in half precision) within the half-precision
tolerance of ``tests/test_precision.py``, and the asset has the compressed size.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from coreai_torch import TorchConverter, compression
from coreai_torch.program import AIProgram
from coreai_torch.verify import HALF_TOLERANCE, export_decomposed
from tests.helpers import asset_bytes, check_half
from tests.test_compress import (
    ASSET_OVERHEAD,
    compress_in_order,
    fake_linear,
    fake_palette,
    reference_model,
    stored_palette,
)

VOCAB = 512
HALF = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]
ELEMENT = {torch.float16: "f16", torch.bfloat16: "bf16"}


class Small(nn.Module):
    """An embedding, a feed-forward block and an output head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 128)
        self.norm = nn.LayerNorm(128)
        self.up = nn.Linear(128, 256)
        self.down = nn.Linear(256, 128)
        self.head = nn.Linear(128, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        x = x + self.down(F.gelu(self.up(self.norm(x))))
        return self.head(x)


COMPRESSED = {"embed.weight", "up.weight", "down.weight", "head.weight"}


def small() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    model = Small().eval()
    with torch.no_grad():
        model.embed.weight.mul_(0.5)
    return model, (torch.randint(0, VOCAB, (2, 9)),)


def convert_half(model: nn.Module, args: tuple, dtype: torch.dtype) -> AIProgram:
    ep = export_decomposed(model, args)
    return TorchConverter(compute_precision=dtype).add_exported_program(ep).to_coreai()


def half_bound(model: nn.Module, report: Any, bits_per_weight: float) -> int:
    """The asset size if the compressed weights take ``bits_per_weight`` and the rest is
    stored in 16 bits."""
    done = {w.name for w in report.weights}
    total = sum(
        p.numel() * (bits_per_weight / 8 if name in done else 2)
        for name, p in model.named_parameters()
    )
    return int(total) + ASSET_OVERHEAD


CONFIGS = {
    "int4": (compression.LinearQuantization(bits=4, block_size=32), 4 + 16 / 32),
    "int8": (compression.LinearQuantization(bits=8), 8 + 16 / 128),
    "palette4": (compression.Palettization(bits=4), 4.1),
}


def check_half_compression(dtype: torch.dtype, form: str, optimize_first: bool) -> None:
    config, bits = CONFIGS[form]
    model, args = small()
    program = convert_half(model, args, dtype)
    report = compress_in_order(program, config, optimize_first)
    assert {w.name for w in report.weights} == COMPRESSED and not report.skipped, str(report)
    assert {w.reader for w in report.weights} == {"matmul", "embedding"}
    half = f"x{ELEMENT[dtype]}>"
    decompressions = [
        line
        for line in str(program).splitlines()
        if any(f"coreai.{op} " in line for op in ("blockwise_shift_scale", "lut_to_dense"))
        or ".scale>" in line
        or ("coreai.dequantize " in line)
    ]
    assert decompressions and all(line.endswith(half) for line in decompressions), decompressions
    if isinstance(config, compression.LinearQuantization):

        def fake(name: str, w: torch.Tensor) -> torch.Tensor:
            return fake_linear(w.to(dtype), config).to(dtype).float()

    else:

        def fake(name: str, w: torch.Tensor) -> torch.Tensor:
            indices, palette = stored_palette(program, name, config.bits)
            slack = 2**-7 * float(palette.abs().max())
            return fake_palette(w.to(dtype).float(), indices, palette, None, slack)

    reference = reference_model(model, report, fake)
    check_half(reference, args, program, rel=HALF_TOLERANCE[dtype])
    size = asset_bytes(program)
    assert size <= half_bound(model, report, bits), f"asset {size} B"
    # the weights are really compressed: far below the half-precision asset
    assert size < 0.6 * half_bound(model, report, 16)
    print(report, f"\nasset {size} B", sep="")


@pytest.mark.parametrize("optimize_first", [False, True], ids=["compress-first", "optimized"])
@pytest.mark.parametrize("form", list(CONFIGS))
@pytest.mark.parametrize("dtype", HALF)
def test_half_precision_programs_are_compressed(
    dtype: torch.dtype, form: str, optimize_first: bool
) -> None:
    check_half_compression(dtype, form, optimize_first)


def test_optimize_keeps_half_weights_named_and_compressed() -> None:
    """``optimize()`` neither folds the transposes of half weights into anonymous copies (which
    compress() could not find) nor the casts of compressed constants (which would store them
    decompressed)."""
    model, args = small()
    program = convert_half(model, args, torch.float16).optimize()
    text = str(program)
    assert "dense_resource<resource_" not in text, text
    assert "dense_resource<up.weight.T> : tensor<128x256xf16>" in text
    program.compress(compression.LinearQuantization(bits=4, block_size=32))
    program.optimize()
    text = str(program)
    assert "dense_resource<resource_" not in text and "coreai.transpose" not in text, text
    assert "dense_resource<up.weight.codes> : tensor<128x256xsi4>" in text


def test_weights_optimize_folded_are_reported() -> None:
    """A weight the program no longer reads as a weight (here: Core AI's rewrite folded it
    into a constant computed from it) is listed with the reason, never skipped silently."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(128, 128))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ (self.w * 2)

    args = (torch.randn(2, 128),)
    program = convert_half(Scaled(), args, torch.float16).optimize()
    report = program.compress(compression.LinearQuantization(bits=8))
    assert report.weights == []
    ((name, reason),) = report.skipped
    assert name == "w" and "compress() before optimize()" in reason, reason
