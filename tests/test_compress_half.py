"""``compress()`` of half-precision programs (``TorchConverter(compute_precision=float16 |
bfloat16)``): every weight is compressed, before and after ``optimize()`` (in the half program
they are read through the casts of the float32 accumulation), with scales and the decompressed
weight in the half type; the program matches the fake-quantized model (its weights quantized
from their half-precision values, decompressed in half precision) within the half-precision
tolerance of ``tests/test_precision.py``, and the asset has the compressed size.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from coreai_torch import TorchConverter, compression
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.program import AIProgram
from coreai_torch.verify import HALF_TOLERANCE
from tests.helpers import asset_bytes, check_half
from tests.test_compress import (
    ASSET_OVERHEAD,
    DYNAMIC,
    check_dynamic_lookup,
    compress_in_order,
    fake_weights,
    reference_model,
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


def check_half_compression(dtype: torch.dtype, form: str, optimize_first: bool) -> AIProgram:
    config, bits = CONFIGS[form]
    model, args = small()
    program = convert_half(model, args, dtype)
    report = compress_in_order(program, config, optimize_first)
    assert {w.name for w in report.weights} == COMPRESSED and not report.skipped, str(report)
    assert {w.reader for w in report.weights} == {"matmul", "embedding"}
    half = f"x{ELEMENT[dtype]}>"
    lines = str(program).splitlines()
    stored = [line for line in lines if ".scale>" in line]
    assert all(line.endswith(half) for line in stored), stored  # scales stored in the half type
    decompressions = [
        line
        for line in lines
        if any(f"coreai.{op} " in line for op in ("blockwise_shift_scale", "lut_to_dense"))
        or "coreai.dequantize " in line
    ]
    # the embedding's rows decompress to the half type; weights only the float32 matmuls read
    # (float32 accumulation) decompress to float32 directly (decompress_to_float32)
    assert any(line.endswith(half) for line in decompressions), decompressions
    assert all(line.endswith((half, "xf32>")) for line in decompressions), decompressions
    if form != "int8":  # (int8 per channel: cast -> matmul -> scale, no decompression)
        assert any(line.endswith("xf32>") for line in decompressions), decompressions
    reference = reference_model(model, report, fake_weights(program, config, dtype))
    check_half(reference, args, program, rel=HALF_TOLERANCE[dtype])
    size = asset_bytes(program)
    assert size <= half_bound(model, report, bits), f"asset {size} B"
    # the weights are really compressed: far below the half-precision asset
    assert size < 0.6 * half_bound(model, report, 16)
    print(report, f"\nasset {size} B", sep="")
    return program


@pytest.mark.parametrize("optimize_first", [False, True], ids=["compress-first", "optimized"])
@pytest.mark.parametrize("form", list(CONFIGS))
@pytest.mark.parametrize("dtype", HALF)
def test_half_precision_programs_are_compressed(
    dtype: torch.dtype, form: str, optimize_first: bool
) -> None:
    check_half_compression(dtype, form, optimize_first)


@pytest.mark.parametrize("optimize_first", [False, True], ids=["compress-first", "optimized"])
@pytest.mark.parametrize("dtype", HALF)
def test_int8_per_channel_is_read_as_cast_matmul_scale(
    dtype: torch.dtype, optimize_first: bool
) -> None:
    """int8 weights with one scale per output channel, read by the float32 matmuls of a half
    program (float32 accumulation): ``cast(si8 -> f32) -> matmul -> multiply by the scale``
    (stored in the half type, cast to float32), the runtime's fastest form, instead of
    decompressing the weight to the half type and casting it; the numbers and the asset are
    those of ``check_half_compression``."""
    program = check_half_compression(dtype, "int8", optimize_first)
    text = str(program)
    half = ELEMENT[dtype]
    for name, shape in (("up", "128x256"), ("down", "256x128"), ("head", f"128x{VOCAB}")):
        constant = r'(%\d+) = coreai\.constant dense_resource<"?{}\.weight\.{}"?> : tensor<{}>'
        codes = re.search(constant.format(name, "codes", f"{shape}xsi8"), text)
        scale = re.search(constant.format(name, "scale", rf"(\d+)x{half}"), text)
        assert codes and scale, f"{name}: {text}"
        weight = re.search(rf"(%\d+) = coreai\.cast {codes[1]} : \S+ to tensor<{shape}xf32>", text)
        scale32 = re.search(
            rf"(%\d+) = coreai\.cast {scale[1]} : \S+ to tensor<{scale[2]}xf32>", text
        )
        assert weight and scale32, f"{name}: {text}"
        product = re.search(rf"(%\d+) = coreai\.\S*batch_matmul %\d+, {weight[1]} :", text)
        assert product and re.search(rf"= coreai\.\S*mul {product[1]}, {scale32[1]} :", text), text
    assert text.count("= coreai.dequantize") == 1, text  # only the embedding's looked-up rows


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


def test_weights_optimize_folded_are_compressed_under_their_name() -> None:
    """A weight Core AI's rewrite folded into a constant computed from it (``w * 2``) is
    compressed after optimize() as ``w.folded`` (it was left in float16, reported as no
    longer read)."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(128, 128))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ (self.w * 2)

    args = (torch.randn(2, 128),)
    program = convert_half(Scaled(), args, torch.float16).optimize()
    report = program.compress(compression.LinearQuantization(bits=8))
    assert [w.name for w in report.weights] == ["w.folded"] and report.skipped == []
    assert "dense_resource<resource_" not in str(program)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_half_tables_looked_up_by_a_dynamic_number_of_tokens(tie: bool) -> None:
    """float16, int8 compressed before optimize() (the order of llm.export): the table a
    prompt of any length looks up is compressed, alone or tied to the head."""
    check_dynamic_lookup("int8", False, tie, torch.float16)


@pytest.mark.slow
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("optimize_first", [True, False], ids=["optimized", "then-optimized"])
@pytest.mark.parametrize("form", list(DYNAMIC))
@pytest.mark.parametrize("dtype", HALF)
def test_half_dynamic_lookups(
    dtype: torch.dtype, form: str, optimize_first: bool, tie: bool
) -> None:
    check_dynamic_lookup(form, optimize_first, tie, dtype, runs=[(2, 3), (1, 12)])
