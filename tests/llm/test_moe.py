"""Mixture-of-experts LLMs through ``llm.export`` (small configs, random weights): the sparse
blocks are made static for the trace and the user's model gets its own back; ``main``
gathers the weights of the experts the call's tokens selected (their count is known only at
run time; a decode step reads its token's experts only) and combines them with the routing
weights; each layer's stacked expert weights are stored once, and stay compressed (and
gathered compressed) with ``compress="int4"``.  Generation against ``transformers`` for every MoE
architecture is in ``test_architectures.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

from coreai_torch import bundles, compression, llm, rewrite_moe
from coreai_torch._mlir import ir
from coreai_torch.rewrites.moe import SparseMoE
from tests.helpers import asset_bytes
from tests.llm.support import causal_lm, check_engine, export_bundle
from tests.llm.test_precision import FP16_TOLERANCE, compressed_weights, fake_quantized
from tests.test_compress import fake_linear

NEW_TOKENS = 16
#: prompts of 1, 5 and 23 tokens
PROMPTS = [[7], [5, 6, 7, 8, 9], list(range(3, 26))]


def test_mixtral_experts_are_stored_once_and_the_model_keeps_its_blocks() -> None:
    model = causal_lm("mixtral")
    blocks = [type(m) for m in model.modules() if hasattr(m, "experts")]
    program = llm.export(model, max_context=16)
    # the user's model keeps its own blocks
    assert [type(m) for m in model.modules() if hasattr(m, "experts")] == blocks
    assert not any(isinstance(m, SparseMoE) for m in model.modules())
    # each layer's stacked gate, up and down weights are stored once
    text = str(program)
    experts = set(re.findall(r"dense_resource<\"?([\w.]*experts\.\w+(?:\.T)?)", text))
    assert len(experts) == 3 * 2, sorted(experts)
    stacked = rewrite_moe(causal_lm("mixtral"))
    weight_bytes = sum(p.numel() * p.element_size() for p in stacked.parameters())
    assert asset_bytes(program) <= 1.1 * weight_bytes


def expert_weight_readers(program: Any) -> dict[str, set[str]]:
    """The ops reading each stored expert weight (its codes and scales when compressed)."""
    readers: dict[str, set[str]] = {}

    def visit(op: Any) -> Any:
        if op.name == "coreai.constant" and ".experts." in str(op.attributes["value"]):
            name = re.search(r"dense_resource<\"?([\w.]+)", str(op.attributes["value"]))[1]
            users = readers.setdefault(name, set())
            users.update(use.owner.name for use in op.result.uses)
        return ir.WalkResult.ADVANCE

    program.mlir_module.operation.walk(visit)
    return readers


@pytest.mark.parametrize("compress", [None, "int4"])
def test_main_reads_only_the_selected_experts(compress: str | None) -> None:
    """Every stored expert weight is read by a gather of the experts the call's tokens
    selected (a decode step: its token's top-k), never whole by a matmul or a decompression
    of every expert; the stacks are still stored once."""
    program = llm.export(causal_lm("mixtral"), max_context=16, compress=compress)
    readers = expert_weight_readers(program)
    assert len(readers) == 3 * 2 * (1 if compress is None else 2), sorted(readers)
    assert all(users == {"coreai.gather_nd"} for users in readers.values()), readers


def _bits(name: str, weight: torch.Tensor) -> float:
    """Bits per weight of the int4 preset (the embedding and the head in int8 per row)."""
    if "embed_tokens" in name or "lm_head" in name:
        return compression.bits_per_weight(compression.SAFE_FORM, tuple(weight.shape))
    return 4.5


def fake_experts(config: compression.LinearQuantization):
    """Quantize-dequantize stacked expert weights ``(experts, out, in)`` one expert at a time
    (blocks along each expert's input axis), other weights as they are."""

    def fake(name: str, w: torch.Tensor) -> torch.Tensor:
        if w.dim() == 3:
            return torch.stack([fake_linear(e, config) for e in w])
        if "embed_tokens" in name or "lm_head" in name:  # the preset's safe form
            return fake_linear(
                w, dataclasses.replace(compression.SAFE_FORM, scale_dtype=config.scale_dtype)
            )
        return fake_linear(w, config)

    return fake


def test_int4_experts_stay_compressed_in_fp16(tmp_path: Path) -> None:
    """``precision="fp16", compress="int4"``: the expert weights (the bulk of the model) are
    stored as 4-bit codes, and generation follows the eager model in float16 with the same
    quantized weights (tolerance as in test_precision.py)."""
    model = causal_lm("mixtral")
    bundle, program = export_bundle(model, tmp_path, precision="fp16", compress="int4")
    reference: nn.Module = rewrite_moe(copy.deepcopy(model))
    names = compressed_weights(str(program))
    expert_names = {n for n, _ in reference.named_parameters() if ".experts." in n}
    assert len(expert_names) == 3 * 2 and expert_names <= names
    bound = 96 * 1024 + sum(
        p.numel() * (_bits(n, p) / 8 if n in names else 2) for n, p in reference.named_parameters()
    )
    assert asset_bytes(program) <= bound
    config = dataclasses.replace(compression.from_spec("int4"), scale_dtype=torch.float16)
    reference = fake_quantized(reference, names, fake_experts(config), torch.float16)
    with bundles.open_engine(bundle, stop_token_ids=[]) as engine:
        for ids in PROMPTS:
            check_engine(engine, reference, ids, NEW_TOKENS, tolerance=FP16_TOLERANCE)
