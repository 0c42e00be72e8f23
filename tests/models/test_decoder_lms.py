"""Decoder-only LMs (Hugging Face model classes from small configs, random weights) match
eager PyTorch on the Core AI runtime within 1e-4 × max(1, max|logits|).

GPT-2 has its own module (test_gpt2.py); Llama is in the fast suite, the rest are slow.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.models.common import Call, check_model, check_model_dynamic, redraw_weights

VOCAB = 128
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    use_cache=False,
)


def causal_lm(config_name: str, model_name: str, attn: str = "sdpa", **overrides: Any) -> Call:
    import transformers

    config = getattr(transformers, config_name)(**{**SMALL, **overrides})
    config._attn_implementation = attn
    model = getattr(transformers, model_name)(config).eval()
    # A head tied to the token embeddings gets small embeddings, so logits stay O(1).
    redraw_weights(model, embedding_std=0.15 if config.tie_word_embeddings else 1.0)
    return Call(model, lambda m, ids: m(input_ids=ids, use_cache=False, return_dict=False)[0])


def check_causal_lm(model: Call, batch: int = 2, seq: int = 16) -> None:
    ids = torch.randint(0, VOCAB, (batch, seq))
    check_model(model, (ids,))


def test_llama() -> None:
    check_causal_lm(causal_lm("LlamaConfig", "LlamaForCausalLM"))


def test_llama_with_padding_mask() -> None:
    """Left padding through ``attention_mask`` (the mask and the causal mask are combined)."""
    model = causal_lm("LlamaConfig", "LlamaForCausalLM")
    model.fn = lambda m, ids, mask: m(
        input_ids=ids, attention_mask=mask, use_cache=False, return_dict=False
    )[0]
    ids = torch.randint(0, VOCAB, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.int64)
    mask[1, :4] = 0
    check_model(model, (ids, mask))


def check_dynamic_sequence_length(model: Call) -> None:
    """One program for every prompt length (``torch.export.Dim`` on the sequence axis), run
    at three lengths (longer and shorter than the sliding windows of the configs)."""
    seq = torch.export.Dim("seq", min=2, max=32)
    runs = [(torch.randint(0, VOCAB, (2, n)),) for n in (12, 5, 20)]
    check_model_dynamic(model, runs, (({1: seq},),))


@pytest.mark.slow
def test_llama_dynamic_sequence_length() -> None:
    check_dynamic_sequence_length(causal_lm("LlamaConfig", "LlamaForCausalLM"))


SLOW_MODELS = {
    # Hugging Face's own attention (matmul, additive mask, softmax) instead of SDPA.
    "llama_eager": ("LlamaConfig", "LlamaForCausalLM", "eager", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", "sdpa", dict(sliding_window=8)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "sdpa", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "sdpa", dict(head_dim=16)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", "sdpa", dict(head_dim=16)),
    # Soft-capped attention logits need the eager attention path.
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        "eager",
        dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8),
    ),
    "phi": ("PhiConfig", "PhiForCausalLM", "sdpa", dict(partial_rotary_factor=0.5)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", "sdpa", dict(pad_token_id=0)),
    # Further decoder layouts: learned positions, ALiBi, parallel attention/MLP, multi-query.
    "opt": ("OPTConfig", "OPTForCausalLM", "sdpa", dict(ffn_dim=128, word_embed_proj_dim=64)),
    "bloom": ("BloomConfig", "BloomForCausalLM", "eager", dict(n_layer=2, n_head=4)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", "sdpa", dict(rotary_pct=0.25)),
    "falcon": (
        "FalconConfig",
        "FalconForCausalLM",
        "sdpa",
        dict(new_decoder_architecture=False, multi_query=True),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_MODELS))
def test_decoder_lm(name: str) -> None:
    config_name, model_name, attn, overrides = SLOW_MODELS[name]
    check_causal_lm(causal_lm(config_name, model_name, attn, **overrides))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_MODELS))
def test_decoder_lm_dynamic_sequence_length(name: str) -> None:
    config_name, model_name, attn, overrides = SLOW_MODELS[name]
    check_dynamic_sequence_length(causal_lm(config_name, model_name, attn, **overrides))
