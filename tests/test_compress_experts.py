"""``compress()`` of mixture-of-experts programs: the stacked expert weights of
``rewrite_moe``'s blocks (``GatedExperts``: ``(experts, out, in)``) stay compressed, with
parameters per expert and blocks along the reduction axis, whether the experts run densely
(every expert, batched matmuls) or gathered (the experts each token selected, read from the
compressed stack before decompression), compressed before or after ``optimize()``.

References are the rewritten block / model with each compressed weight fake-quantized in
PyTorch (``tests/test_compress.py``), per expert; outputs within 1e-4 x max(1, max|ref|).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import torch.nn as nn

from coreai_torch import TorchConverter, compression, rewrite_moe
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.program import AIProgram
from coreai_torch.runtime import Session
from coreai_torch.verify import HALF_TOLERANCE, compare, eager_outputs, run_entrypoint
from tests.helpers import asset_bytes, check_half
from tests.models.common import Call, redraw_weights
from tests.test_compress import (
    bound,
    check_against,
    compress_in_order,
    fake_linear,
    fake_palette,
    reference_model,
    stored_palette,
)

DIM, HIDDEN, EXPERTS = 256, 128, 8
#: prefill (2 x 7 tokens) and decode (1 token)
TOKENS = {"prefill": (2, 7), "decode": (1, 1)}
INT4 = compression.LinearQuantization(bits=4, block_size=32)
INT8 = compression.LinearQuantization(bits=8)
#: configuration -> bits per expert weight (codes + float32 scales)
BITS = {"int4": (INT4, 4 + 32 / 32), "int8": (INT8, 8 + 32 / HIDDEN)}


class Block(nn.Module):
    """A rewritten Mixtral block's output (without the router logits)."""

    def __init__(self, strategy: str) -> None:
        super().__init__()
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        config = MixtralConfig(
            hidden_size=DIM,
            intermediate_size=HIDDEN,
            num_local_experts=EXPERTS,
            num_experts_per_tok=2,
        )
        torch.manual_seed(0)
        block = redraw_weights(MixtralSparseMoeBlock(config).eval())
        self.block = rewrite_moe(block, strategy=strategy)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)[0]


def fake(config: Any) -> Any:
    """``fake(name, weight)``: each matrix (each expert's) quantize-dequantized."""

    def apply(name: str, w: torch.Tensor) -> torch.Tensor:
        if w.dim() == 3:
            return torch.stack([fake_linear(expert, config) for expert in w])
        return fake_linear(w, config)

    return apply


def convert(model: nn.Module, args: tuple) -> AIProgram:
    return TorchConverter().add_exported_program(export_decomposed(model, args)).to_coreai()


EXPERT_WEIGHTS = {f"block.experts.{n}" for n in ("gate", "up", "down")}


def check_block(form: str, strategy: str, tokens: str, optimize_first: bool) -> AIProgram:
    config, bits = BITS[form]
    model = Block(strategy)
    args = (torch.randn(*TOKENS[tokens], DIM),)
    program = convert(model, args)
    report = compress_in_order(program, config, optimize_first)
    assert {w.name for w in report.weights} == EXPERT_WEIGHTS, str(report)
    assert {w.reader for w in report.weights} == {"experts"}
    assert report.skipped == []  # the router (8 x 256) is below min_elements
    gate = next(w for w in report.weights if w.name == "block.experts.gate")
    assert gate.shape == (EXPERTS, HIDDEN, DIM)
    reference = reference_model(model, report, fake(config))
    size = check_against(program, reference, args, bound(model, report, bits))
    experts_fp32 = 3 * EXPERTS * DIM * HIDDEN * 4
    assert size <= (bits / 32 + 0.01) * experts_fp32, f"asset {size} B"  # near the bound
    print(report, f"\nasset {size} B", sep="")
    return program


def gathers_compressed_codes(program: AIProgram) -> bool:
    """Whether every expert stack is read by a ``gather_nd`` of its compressed codes (and no
    ``gather_nd`` reads a decompressed stack)."""
    text = str(program)
    for name in ("gate", "up", "down"):
        codes = re.search(
            rf"(%\d+) = coreai\.constant dense_resource<block\.experts\.{name}\.codes> : "
            r"tensor<\d+x\d+x\d+xsi[48]>",
            text,
        )
        if not codes or f"coreai.gather_nd {codes[1]} at" not in text:
            return False
    return not gathers_decompressed(program)


def gathers_decompressed(program: AIProgram) -> bool:
    """Whether a ``gather_nd`` reads the result of a decompression (a whole stack)."""
    from coreai_torch._mlir import ir

    found = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name == "coreai.gather_nd":
            source = op.operands[0].owner
            found.append(
                not isinstance(source, ir.Block)
                and source.name in ("coreai.blockwise_shift_scale", "coreai.lut_to_dense")
            )
        return ir.WalkResult.ADVANCE

    program.structural_module.operation.walk(visit)
    return any(found)


@pytest.mark.parametrize(
    ("form", "strategy", "tokens", "optimize_first"),
    [
        ("int4", "gather", "decode", False),
        ("int4", "gather", "prefill", True),
        ("int4", "dense", "prefill", False),
        ("int8", "gather", "decode", True),
    ],
)
def test_expert_weights_stay_compressed(
    form: str, strategy: str, tokens: str, optimize_first: bool
) -> None:
    program = check_block(form, strategy, tokens, optimize_first)
    if strategy == "gather":
        assert gathers_compressed_codes(program), str(program)
    else:  # every expert runs: the whole stack is decompressed, once per call
        assert str(program).count("coreai.blockwise_shift_scale") == 3


@pytest.mark.slow
@pytest.mark.parametrize("optimize_first", [False, True], ids=["compress-first", "optimized"])
@pytest.mark.parametrize("tokens", list(TOKENS))
@pytest.mark.parametrize("strategy", ["gather", "dense"])
@pytest.mark.parametrize("form", list(BITS))
def test_expert_weights_sweep(form: str, strategy: str, tokens: str, optimize_first: bool) -> None:
    program = check_block(form, strategy, tokens, optimize_first)
    assert gathers_compressed_codes(program) == (strategy == "gather")


@pytest.mark.parametrize("strategy", ["gather", "dense"])
def test_expert_palettes(strategy: str) -> None:
    """4-bit palettes, one per expert matrix; gathered experts gather their indices and
    palettes."""
    model = Block(strategy)
    args = (torch.randn(*TOKENS["decode"], DIM),)
    program = convert(model, args).optimize()
    config = compression.Palettization(bits=4)
    report = program.compress(config)
    assert {w.name for w in report.weights} == EXPERT_WEIGHTS

    def palettes(name: str, w: torch.Tensor) -> torch.Tensor:
        indices, lut = stored_palette(program, name, 4)
        assert lut.shape == (EXPERTS, 16)
        return torch.stack(
            [fake_palette(w[e], indices[e], lut[e : e + 1], None) for e in range(EXPERTS)]
        )

    reference = reference_model(model, report, palettes)
    check_against(program, reference, args, bound(model, report, 4 + 32 * 16 / (DIM * HIDDEN)))
    if strategy == "gather":
        assert "coreai.lut_to_dense" in str(program) and not gathers_decompressed(program)


def mixtral_model() -> Call:
    from tests.models.test_moe import moe_causal_lm

    model = rewrite_moe(moe_causal_lm("mixtral"))
    return Call(model, lambda m, ids: m(input_ids=ids, use_cache=False, return_dict=False)[0])


@pytest.mark.parametrize("tokens", [(2, 8), (1, 1)], ids=["prefill", "decode"])
def test_whole_mixtral_model_int4(tokens: tuple[int, int]) -> None:
    """A rewritten Mixtral LM (2 layers, 4 experts, top-2) with every large weight in int4:
    embeddings, attention, experts (dense for the prompt, gathered for one token) and the
    head."""
    from tests.models.test_moe import VOCAB

    model = mixtral_model()
    args = (torch.randint(0, VOCAB, tokens),)
    program = convert(model, args)
    report = program.compress(INT4)
    program.optimize()
    experts = [w for w in report.weights if w.reader == "experts"]
    assert len(experts) == 6, str(report)  # gate, up, down of both layers
    assert {w.reader for w in report.weights} == {"experts", "matmul", "embedding"}
    assert all("experts" not in name for name, _ in report.skipped), str(report)
    reference = reference_model(model, report, fake(INT4))
    check_against(program, reference, args, bound(model, report, 5))
    assert gathers_compressed_layers(program) == (tokens == (1, 1))


def gathers_compressed_layers(program: AIProgram) -> bool:
    """Whether the program gathers experts (from their compressed stacks only)."""
    stacks = re.findall(r"coreai\.gather_nd .*: \(tensor<\d+x\d+x\d+xsi4>", str(program))
    return bool(stacks) and not gathers_decompressed(program)


@pytest.mark.parametrize("optimize_first", [False, True], ids=["compress-first", "optimized"])
def test_prefill_and_decode_share_the_compressed_experts(optimize_first: bool) -> None:
    """Two entry points (a prompt: dense experts; one token: gathered experts) read the same
    stacks: compressed once, stored once."""
    model = Block("auto")
    prefill, decode = (torch.randn(1, 7, DIM),), (torch.randn(1, 1, DIM),)
    converter = TorchConverter()
    converter.add_exported_program(export_decomposed(model, prefill), entrypoint_name="prefill")
    converter.add_exported_program(export_decomposed(model, decode), entrypoint_name="decode")
    program = converter.to_coreai()
    report = compress_in_order(program, INT4, optimize_first)
    assert {w.name for w in report.weights} == EXPERT_WEIGHTS and not report.skipped
    reference = reference_model(model, report, fake(INT4))
    with Session(program) as session:
        for entry, args in (("prefill", prefill), ("decode", decode)):
            expected = eager_outputs(reference, args)[0]
            actual = run_entrypoint(session, program, args, entrypoint=entry)[0]
            tol = 1e-4 * max(1.0, float(expected.abs().max()))
            assert compare(entry, expected, actual, atol=tol, rtol=0).ok
    assert asset_bytes(program) <= bound(model, report, 5)
    assert gathers_compressed_layers(program)


@pytest.mark.parametrize("optimize_first", [False, True], ids=["compress-first", "optimized"])
def test_half_precision_experts(optimize_first: bool) -> None:
    """A float16 program: the experts are compressed with float16 scales and decompressed to
    float16 (cast to float32 for the float32 accumulation of the matmuls)."""
    model = Block("auto")
    args = (torch.randn(1, 7, DIM),)
    ep = export_decomposed(model, args)
    program = TorchConverter(compute_precision=torch.float16).add_exported_program(ep).to_coreai()
    report = compress_in_order(program, INT4, optimize_first)
    assert {w.name for w in report.weights} == EXPERT_WEIGHTS and not report.skipped
    assert "block.experts.gate.scale> : tensor<8x8x128xf16>" in str(program)
    quantized = fake(INT4)
    reference = reference_model(
        model, report, lambda name, w: quantized(name, w.half()).half().float()
    )
    check_half(reference, args, program, rel=HALF_TOLERANCE[torch.float16])
    experts_fp16 = 3 * EXPERTS * DIM * HIDDEN * 2
    assert asset_bytes(program) <= (4.5 / 16 + 0.02) * experts_fp16
