"""Every architecture ``llm.export`` supports (small configs, random weights), written as a
bundle and run by the reference driver exactly as the app runs it (the pipelined engine: the
function ``main``, int32 ids and positions by order, float16 logits, KV states that grow into
memory nobody zeroed): greedy generation of 32 tokens after prompts of three lengths equals
``model.generate`` token for token, every step's logits within 1e-4 * max(1, max|ref|) of
eager PyTorch (plus the float16 logits' rounding); ``coreai doctor`` finds nothing wrong with
the bundle.

Fast: Llama, Gemma 2 (a sliding window, soft-capped attention and logits) and Mixtral (a
mixture of experts); the others are slow (one export each)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from coreai_torch import bundles, llm
from tests.bundles.support import assert_doctor_clean
from tests.llm.support import (
    ARCHITECTURES,
    MOE_ARCHITECTURES,
    PROMPTS,
    causal_lm,
    check_engine,
    export_bundle,
    reference,
    tiny_tokenizer,
)

FAST = ("llama", "gemma2", "mixtral")


def _params(names: list[str]) -> list[object]:
    return [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in names]


def check_bundle(name: str, root: Path, fresh_memory: str = "noise") -> None:
    model, tokenizer = causal_lm(name), tiny_tokenizer()
    bundle, program = export_bundle(model, root)
    assert program.function_names == ["main"], program.function_names
    if name in ARCHITECTURES:
        composites = set(re.findall(r'composite_declaration<"(\w+)"', str(program)))
        # eager attention (soft-capping, Gemma 3's) stays plain ops
        eager = model.config._attn_implementation == "eager"
        attention = set() if eager else {"scaled_dot_product_attention"}
        assert {"rms_norm", "rope"} | attention <= composites, composites
    with bundles.open_engine(
        bundle, "pipelined", stop_token_ids=[], fresh_memory=fresh_memory
    ) as engine:
        for prompt in PROMPTS:
            check_engine(engine, model, tokenizer.encode(prompt))
    assert_doctor_clean(bundle)


@pytest.mark.parametrize("name", _params(list(ARCHITECTURES)))
def test_dense_bundle_matches_transformers(name: str, tmp_path: Path) -> None:
    check_bundle(name, tmp_path)


@pytest.mark.parametrize("name", _params(list(MOE_ARCHITECTURES)))
def test_moe_bundle_matches_transformers(name: str, tmp_path: Path) -> None:
    """Mixtures of experts (DeepSeek-V3's latent attention caches keys and values of
    different widths); the experts run dense on every call's tokens."""
    check_bundle(name, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_half_precision_model_keeps_its_dtype(dtype: torch.dtype, tmp_path: Path) -> None:
    """``precision=None`` exports the model as it is: a bfloat16 / float16 model gives a
    program computing (and caching) in that dtype, generating what PyTorch generates; the
    logits are float16 either way."""
    model = causal_lm("llama").to(dtype)
    bundle, program = export_bundle(model, tmp_path)
    main = bundles.function_signatures(program)["main"]
    assert {s.dtype for s in main.states} == {str(dtype).removeprefix("torch.")}
    assert main.outputs[0].dtype == "float16"
    ids = [5, 6, 7, 8]
    expected = reference(model, ids, 8)
    with bundles.open_engine(bundle, "sequential", stop_token_ids=[]) as engine:
        assert engine.generate(ids, 8) == expected.tokens
    assert_doctor_clean(bundle)


def test_every_architecture_is_tested() -> None:
    assert sorted(llm.ARCHITECTURES) == sorted(
        {"smollm": "llama", "gemma3": "gemma3_text"}.get(n, n)
        for n in {*ARCHITECTURES, *MOE_ARCHITECTURES}
        if n != "smollm"
    )
