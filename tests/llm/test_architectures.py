"""Every architecture ``llm.export`` supports (small configs, random weights): greedy
generation of 32 tokens after prompts of three lengths equals ``model.generate`` token for
token, every step's logits within 1e-4 * max(1, max|ref|) of eager PyTorch; composite ops and
cache states as documented.  Slow: one export per architecture."""

from __future__ import annotations

import re

import pytest
import torch

from coreai_torch import llm
from tests.llm.support import (
    ARCHITECTURES,
    MAX_CONTEXT,
    PROMPTS,
    causal_lm,
    check_generation,
    tiny_tokenizer,
)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_generation_matches_transformers(name: str) -> None:
    model, tokenizer = causal_lm(name), tiny_tokenizer()
    program = llm.export(model, max_context=MAX_CONTEXT)
    composites = set(re.findall(r'composite_declaration<"(\w+)"', str(program)))
    # Gemma 2 soft-caps attention scores: its attention stays plain ops
    attention = set() if name == "gemma2" else {"scaled_dot_product_attention"}
    assert {"rms_norm", "rope"} | attention <= composites
    states = [s.name for s in program.signatures["decode"].states]
    assert states == [f"layers.{i}.{k}_cache" for i in range(2) for k in ("k", "v")]
    with llm.Generator(program, tokenizer=tokenizer) as generator:
        for prompt in PROMPTS:
            check_generation(generator, model, tokenizer.encode(prompt))


@pytest.mark.slow
def test_all_logits_and_a_prompt_filling_the_context() -> None:
    """``all_logits=True`` returns every prompt position's logits; a prompt of max_context
    tokens (the largest prefill) still generates its one token."""
    from coreai_torch.runtime import Session

    model = causal_lm("mistral")
    program = llm.export(model, max_context=MAX_CONTEXT, all_logits=True)
    ids = torch.randint(0, 100, (1, MAX_CONTEXT))
    with torch.no_grad():
        expected = model(ids).logits
    states = {
        name: torch.zeros_like(value)
        for name, value in program.signatures["prefill"].initial_states.items()
    }
    with Session(program) as session:
        out = session.run(
            {"input_ids": ids, "start_position": torch.tensor([0])},
            entrypoint="prefill",
            state=states,
        )["logits"]
    assert out.shape == (1, MAX_CONTEXT, 128)
    tol = 1e-4 * max(1.0, float(expected.abs().max()))
    assert float((torch.from_numpy(out) - expected).abs().max()) <= tol
    with llm.Generator(program) as generator:
        (token,) = generator.generate(ids[0].tolist(), max_new_tokens=1)
        assert token == int(expected[0, -1].argmax())


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_half_precision_model_keeps_its_dtype(dtype: torch.dtype) -> None:
    """``precision=None`` exports the model as it is: a bfloat16 / float16 model gives a
    program computing (and caching) in that dtype, generating what PyTorch generates."""
    from tests.llm.support import reference

    model = causal_lm("llama").to(dtype)
    program = llm.export(model, max_context=MAX_CONTEXT)
    ids = [5, 6, 7, 8]
    expected = reference(model, ids, 8)
    with llm.Generator(program) as generator:
        cache = generator.session.descriptor("decode").state_descriptor("layers.0.k_cache")
        assert cache.dtype == str(dtype).removeprefix("torch.")
        steps: list = []
        tokens = list(generator.generate(ids, 8, eos_token_id=[], on_logits=steps.append))
    assert tokens == expected.tokens
    assert steps[0].dtype.name == str(dtype).removeprefix("torch.")
