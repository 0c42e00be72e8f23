"""Models quantized with torchao convert with their weights kept compressed.

For each torchao configuration the issue lists, a small Hugging Face Llama (and a ViT) is
quantized with ``torchao.quantization.quantize_`` (or PT2E), exported, converted and optimized;
the program must match the quantized model's own eager output (``ep.module()``) on the Core AI
runtime within 1e-4 × max(1, max|ref|), and its asset must fit the bytes its bit width
allows (a weight silently stored as float would not).  The representative int4 case with
quantized embeddings and the int8 PT2E Llama run in the fast suite; the rest are slow.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn

from coreai_torch import TorchConverter, get_decomp_table
from coreai_torch.runtime import Session
from coreai_torch.verify import compare, eager_outputs, run_entrypoint
from tests.helpers import asset_bytes
from tests.lowerings.test_quantized import WeightOnlyQuantizer, pt2e
from tests.models.common import Call, model_tolerance, redraw_weights
from tests.models.test_decoder_lms import SMALL

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchao.quantization import (
        Float8WeightOnlyConfig,
        Int8WeightOnlyConfig,
        IntxWeightOnlyConfig,
        quantize_,
    )
    from torchao.quantization.granularity import PerAxis, PerGroup
    from torchao.quantization.quant_primitives import MappingType

VOCAB = 256
#: The model tests' small Llama, wide enough that the quantized weights dominate the asset.
LLAMA = {**SMALL, "vocab_size": VOCAB, "hidden_size": 256, "intermediate_size": 512}
LLAMA["num_hidden_layers"] = 1
#: Asset bytes beyond the weights (bytecode, metadata, rotary tables, masks).
ASSET_OVERHEAD = 64 * 1024


def llama() -> Call:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**LLAMA)
    config._attn_implementation = "sdpa"
    model = redraw_weights(LlamaForCausalLM(config).eval())
    return Call(model, lambda m, ids: m(input_ids=ids, use_cache=False, return_dict=False)[0])


def vit() -> Call:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=256,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=512,
        num_labels=10,
    )
    config._attn_implementation = "sdpa"
    model = redraw_weights(ViTForImageClassification(config).eval())
    return Call(model, lambda m, x: m(pixel_values=x, return_dict=False)[0])


def linears_and_embeddings(module: nn.Module, fqn: str) -> bool:
    return isinstance(module, (nn.Linear, nn.Embedding))


def asset_bound(model: nn.Module, bits_per_weight: float, quantized: Callable) -> int:
    """Bytes the asset may take: unquantized parameters in float32, quantized ones at
    ``bits_per_weight`` (codes + scales + zero points per element), plus a fixed overhead."""
    total = 0.0
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            q = name == "weight" and quantized(module, "")
            total += param.numel() * (bits_per_weight / 8 if q else 4)
    return int(total) + ASSET_OVERHEAD


def linears(module: nn.Module, fqn: str) -> bool:
    return isinstance(module, nn.Linear)


def check_quantized(
    model: Call,
    args: tuple[torch.Tensor, ...],
    config: Any,
    bits_per_weight: float,
    filter_fn: Callable = linears,
) -> dict[str, Any]:
    """``model`` quantized by ``quantize_(model, config, filter_fn)``: see :func:`check`."""

    def quantize(model: nn.Module) -> nn.Module:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantize_(model, config, filter_fn=filter_fn)
        return model

    return check(model, args, quantize, bits_per_weight, filter_fn, config)


def check(
    model: nn.Module,
    args: tuple[torch.Tensor, ...],
    quantize: Callable[[nn.Module], nn.Module],
    bits_per_weight: float,
    filter_fn: Callable,
    config: Any,
) -> dict[str, Any]:
    """Quantize ``model`` (the weights of the modules ``filter_fn`` selects), export, convert,
    optimize, run on the runtime against the quantized model's own ``ep.module()`` output,
    and check the asset against the bound for ``bits_per_weight``."""
    bound = asset_bound(model, bits_per_weight, filter_fn)
    fp32_bytes = sum(p.numel() * 4 for p in model.parameters())
    model = quantize(model)
    ep = torch.export.export(model, args).run_decompositions(get_decomp_table())
    reference = eager_outputs(ep.module(), args)
    program = TorchConverter().add_exported_program(ep).to_coreai().optimize()
    tol = model_tolerance(reference)
    with Session(program) as session:
        actual = run_entrypoint(session, program, args)
    for i, (e, a) in enumerate(zip(reference, actual, strict=True)):
        result = compare(f"out{i}", e, a, atol=tol, rtol=0.0)
        assert result.ok, f"{config}: {result} (tolerance {tol:.2e})"
    size = asset_bytes(program)
    assert size <= bound, f"asset {size} B > {bound} B allowed for {bits_per_weight} bits/weight"
    print(f"asset {size} B = {size / fp32_bytes:.3f} x fp32 ({fp32_bytes} B), bound {bound} B")
    return {"program": program, "asset_bytes": size, "exported": ep}


def tokens() -> tuple[torch.Tensor]:
    return (torch.randint(0, VOCAB, (2, 16)),)


def test_llama_int4_blocks_with_quantized_embeddings() -> None:
    """int4 in blocks of 32 on every linear layer and the embedding table (fast suite)."""
    config = IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32))
    result = check_quantized(llama(), tokens(), config, 4 + 32 / 32, linears_and_embeddings)
    text = str(result["program"])
    assert "blockwise_shift_scale" in text and "xsi4>" in text
    main = text[text.index("coreai.graph @main") :]
    # every matmul reads its decompressed weight directly (no transpose of a weight)
    assert "model.layers.0.mlp.down_proj.weight.codes> : tensor<512x256xsi4>" in main
    # the embedding lookup gathers compressed rows (optimize() puts it before decompression)
    assert any("gather_nd" in line and "256x256xsi4>" in line for line in main.splitlines())


INTX = [
    pytest.param(dtype, granularity, mapping, id=f"{name}-{gname}-{mapping.name.lower()}")
    for dtype, name in [(torch.int2, "int2"), (torch.int4, "int4"), (torch.int8, "int8")]
    for granularity, gname in [
        (PerGroup(32), "g32"),
        (PerGroup(64), "g64"),
        (PerGroup(128), "g128"),
        (PerAxis(0), "axis0"),
    ]
    for mapping in (MappingType.SYMMETRIC, MappingType.ASYMMETRIC)
]


def _intx_bits(dtype: torch.dtype, granularity: Any, mapping: MappingType) -> float:
    bits = {torch.int2: 2, torch.int4: 4, torch.int8: 8}[dtype]
    group = granularity.group_size if isinstance(granularity, PerGroup) else 256
    zero_point = bits if mapping == MappingType.ASYMMETRIC else 0
    return bits + (32 + zero_point) / group


@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "granularity", "mapping"), INTX)
def test_llama_intx_weight_only(dtype: torch.dtype, granularity: Any, mapping: Any) -> None:
    config = IntxWeightOnlyConfig(weight_dtype=dtype, granularity=granularity, mapping_type=mapping)
    check_quantized(llama(), tokens(), config, _intx_bits(dtype, granularity, mapping))


EMBEDDINGS = [
    pytest.param(torch.int8, PerAxis(0), MappingType.SYMMETRIC, "si8", id="int8-axis0"),
    pytest.param(torch.int8, PerGroup(32), MappingType.ASYMMETRIC, "si8", id="int8-g32-asym"),
    pytest.param(torch.int4, PerGroup(32), MappingType.ASYMMETRIC, "si4", id="int4-g32-asym"),
    pytest.param(torch.int2, PerGroup(64), MappingType.SYMMETRIC, "si2", id="int2-g64"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "granularity", "mapping", "storage"), EMBEDDINGS)
def test_llama_quantized_embeddings(
    dtype: torch.dtype, granularity: Any, mapping: Any, storage: str
) -> None:
    """``IntxWeightOnlyConfig`` on ``nn.Embedding`` (and the linear layers): the table stays
    compressed in the asset and the lookup reads it."""
    config = IntxWeightOnlyConfig(weight_dtype=dtype, granularity=granularity, mapping_type=mapping)
    bits = _intx_bits(dtype, granularity, mapping)
    result = check_quantized(llama(), tokens(), config, bits, linears_and_embeddings)
    text = str(result["program"])
    main = text[text.index("coreai.graph @main") :]
    table = f"model.embed_tokens.weight.codes> : tensor<256x256x{storage}>"
    assert table in text, "the embedding table is not stored compressed"
    assert any("gather_nd" in line for line in main.splitlines())


@pytest.mark.slow
def test_llama_int8_weight_only() -> None:
    """Int8WeightOnlyConfig exports as ``int8 weight -> cast -> matmul -> scale``: the int8
    weight must stay int8 (the cast is not folded into a float weight)."""
    result = check_quantized(llama(), tokens(), Int8WeightOnlyConfig(), 8 + 32 / 256)
    assert "xsi8>" in str(result["program"])


@pytest.mark.slow
def test_llama_float8_weight_only() -> None:
    result = check_quantized(llama(), tokens(), Float8WeightOnlyConfig(), 8 + 32 / 256)
    assert "xf8E4M3FN>" in str(result["program"])


CODEBOOKS = [
    pytest.param(bits, block, id=f"uint{bits}-{block[0]}x{block[1]}")
    for bits, block in [
        (1, [-1, -1]),
        (2, [16, -1]),
        (3, [1, -1]),
        (4, [1, -1]),
        (4, [-1, 64]),
        (5, [-1, -1]),
        (6, [64, -1]),
        (7, [-1, -1]),
        (8, [-1, -1]),
    ]
]


def _codebook_bits(bits: int, block: list[int]) -> float:
    stored = {1: 1, 2: 2, 3: 3, 4: 4, 5: 6, 6: 6, 7: 8, 8: 8}[bits]
    rows = 256 if block[0] == -1 else block[0]
    cols = 256 if block[1] == -1 else block[1]
    return stored + 32 * 2**stored / (rows * cols)


@pytest.mark.slow
@pytest.mark.parametrize(("bits", "block"), CODEBOOKS)
def test_llama_codebook_palettes(bits: int, block: list[int]) -> None:
    from torchao.prototype.quantization.codebook_coreml import CodebookWeightOnlyConfig

    dtype = getattr(torch, f"uint{bits}") if bits < 8 else torch.uint8
    config = CodebookWeightOnlyConfig(dtype=dtype, block_size=block)
    result = check_quantized(llama(), tokens(), config, _codebook_bits(bits, block))
    assert "lut_to_dense" in str(result["program"])


def _intx(dtype: torch.dtype, granularity: Any, mapping: Any, id: str) -> Any:
    config = IntxWeightOnlyConfig(weight_dtype=dtype, granularity=granularity, mapping_type=mapping)
    return pytest.param(config, _intx_bits(dtype, granularity, mapping), id=id)


VIT_CONFIGS = [
    _intx(torch.int4, PerGroup(32), MappingType.SYMMETRIC, "int4-g32"),
    _intx(torch.int8, PerGroup(32), MappingType.SYMMETRIC, "int8-g32"),
    _intx(torch.int8, PerAxis(0), MappingType.SYMMETRIC, "int8-axis0"),
    _intx(torch.int4, PerAxis(0), MappingType.SYMMETRIC, "int4-axis0"),
    _intx(torch.int4, PerGroup(32), MappingType.ASYMMETRIC, "int4-g32-asym"),
    _intx(torch.int8, PerAxis(0), MappingType.ASYMMETRIC, "int8-axis0-asym"),
    _intx(torch.int2, PerGroup(64), MappingType.ASYMMETRIC, "int2-g64-asym"),
    pytest.param(Int8WeightOnlyConfig(), 8 + 32 / 256, id="int8"),
    pytest.param(Float8WeightOnlyConfig(), 8 + 32 / 256, id="float8"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("config", "bits"), VIT_CONFIGS)
def test_vit(config: Any, bits: float) -> None:
    check_quantized(vit(), (torch.randn(2, 3, 32, 32),), config, bits)


@pytest.mark.slow
def test_vit_codebook() -> None:
    from torchao.prototype.quantization.codebook_coreml import CodebookWeightOnlyConfig

    config = CodebookWeightOnlyConfig(dtype=torch.uint4, block_size=[-1, -1])
    check_quantized(vit(), (torch.randn(2, 3, 32, 32),), config, _codebook_bits(4, [-1, -1]))


# ------------------------------------------------------------------------------------ PT2E


def linears_and_convolutions(module: nn.Module, fqn: str) -> bool:
    return isinstance(module, (nn.Linear, nn.Conv2d))


def check_pt2e(
    model: nn.Module, args: tuple[torch.Tensor, ...], quantizer: WeightOnlyQuantizer, bits: float
) -> dict[str, Any]:
    """PT2E (``prepare_pt2e`` / calibration on ``args`` / ``convert_pt2e``) with a weight-only
    ``quantizer`` on the linear (and convolution) layers."""
    convolutions = torch.ops.aten.conv2d.default in quantizer.targets
    return check(
        model,
        args,
        lambda m: pt2e(m, args, quantizer),
        bits,
        linears_and_convolutions if convolutions else linears,
        type(quantizer).__name__,
    )


def _per_channel(quant_min: int, quant_max: int) -> WeightOnlyQuantizer:
    return WeightOnlyQuantizer(quant_min, quant_max)


def _per_group(group: int) -> WeightOnlyQuantizer:
    """Linear weights quantized to 4-bit values by groups of ``group`` inputs: torchao 0.18's
    PT2E does it with an affine observer, which converts to ``torchao.dequantize_affine`` (no
    PT2E path of torchao 0.18 produces ``quantized_decomposed::dequantize_per_channel_group``).
    Convolutions are left alone (groups run along a kernel's last axis, 8 for the ViT's)."""
    from torchao.quantization.pt2e._affine_quantization import AffineQuantizedMinMaxObserver
    from torchao.quantization.pt2e.quantizer import QuantizationSpec

    quantizer = WeightOnlyQuantizer(-8, 7, targets=(torch.ops.aten.linear.default,))
    quantizer.spec = QuantizationSpec(
        dtype=torch.int8,
        quant_min=-8,
        quant_max=7,
        qscheme=None,
        observer_or_fake_quant_ctr=AffineQuantizedMinMaxObserver.with_args(
            mapping_type=MappingType.SYMMETRIC,
            target_dtype=torch.int8,
            granularity=PerGroup(group),
            quant_min=-8,
            quant_max=7,
            eps=torch.finfo(torch.float32).eps,
            scale_dtype=torch.float32,
            zero_point_dtype=torch.int8,
        ),
    )
    return quantizer


def dequantizations(result: dict[str, Any], op: Any) -> int:
    """How many ``op`` nodes the exported (decomposed) program has."""
    return sum(n.target == op for n in result["exported"].graph.nodes)


def stored_codes(program: Any, storage: str) -> int:
    """How many 2-D weights the program stores as ``storage`` codes."""
    return len(re.findall(rf"\.codes> : tensor<\d+x\d+x{storage}>", str(program)))


#: the Llama's linear layers: q, k, v, o, gate, up, down and the LM head
LLAMA_LINEARS = 8


def test_llama_pt2e_int8_per_channel() -> None:
    """PT2E weights through ``quantized_decomposed::dequantize_per_channel`` (fast suite)."""
    result = check_pt2e(llama(), tokens(), _per_channel(-127, 127), 8 + 32 / 256)
    qd = torch.ops.quantized_decomposed
    assert dequantizations(result, qd.dequantize_per_channel.default) == LLAMA_LINEARS
    assert stored_codes(result["program"], "si8") == LLAMA_LINEARS


@pytest.mark.slow
def test_llama_pt2e_int4_range_per_channel() -> None:
    """A 4-bit range held in int8 by PT2E is stored packed as si4."""
    result = check_pt2e(llama(), tokens(), _per_channel(-8, 7), 4 + 32 / 256)
    assert stored_codes(result["program"], "si4") == LLAMA_LINEARS


@pytest.mark.slow
def test_llama_pt2e_int4_groups() -> None:
    result = check_pt2e(llama(), tokens(), _per_group(32), 4 + (32 + 8) / 32)
    assert dequantizations(result, torch.ops.torchao.dequantize_affine.default) == LLAMA_LINEARS
    assert stored_codes(result["program"], "si4") == LLAMA_LINEARS
    assert "blockwise_shift_scale" in str(result["program"])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("quantizer", "bits"),
    [
        pytest.param(lambda: _per_channel(-127, 127), 8 + 32 / 256, id="int8-per-channel"),
        pytest.param(lambda: _per_channel(-8, 7), 4 + 32 / 256, id="int4-per-channel"),
        pytest.param(lambda: _per_group(32), 4 + (32 + 8) / 32, id="int4-g32"),
    ],
)
def test_vit_pt2e(quantizer: Callable[[], Any], bits: float) -> None:
    """The patch embedding (a convolution) and the linear layers."""
    check_pt2e(vit(), (torch.randn(2, 3, 32, 32),), quantizer(), bits)
