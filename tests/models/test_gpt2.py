"""A 2-layer GPT-2 (Hugging Face model class from a config, random weights) matches PyTorch."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.models.common import check_model, check_model_dynamic, redraw_weights


class LogitsOnly(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False, return_dict=False)[0]


def small_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=128,
        n_positions=32,
        use_cache=False,
        attn_implementation="sdpa",
    )
    # O(1) activations, so broken attention cannot hide behind tiny weights; the head is tied
    # to the token embeddings, which stay small so logits stay O(1)
    model = redraw_weights(GPT2LMHeadModel(config).eval(), embedding_std=0.15)
    return LogitsOnly(model).eval()


def two_layer_gpt2() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A 2-layer GPT-2 returning logits, and token ids for it."""
    return small_gpt2(), (torch.randint(0, 128, (2, 16), dtype=torch.int64),)


def test_gpt2_two_layers_matches_pytorch() -> None:
    check_model(*two_layer_gpt2())


@pytest.mark.slow
def test_gpt2_dynamic_sequence_length() -> None:
    """One program for every sequence length (learned positions sliced to it)."""
    seq = torch.export.Dim("seq", min=2, max=32)
    runs = [(torch.randint(0, 128, (2, n)),) for n in (12, 5, 20)]
    check_model_dynamic(small_gpt2(), runs, ({1: seq},))


@pytest.mark.slow
def test_gpt2_small_width_two_layers_matches_pytorch() -> None:
    """GPT-2 small's width (768, 12 heads, vocab 50257) with 2 layers: the model tolerance
    rule, since float32 rounding alone reaches ~3e-4 at logits of magnitude ~40."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, use_cache=False, attn_implementation="sdpa")
    model = redraw_weights(GPT2LMHeadModel(config).eval())
    ids = torch.randint(0, config.vocab_size, (1, 32), dtype=torch.int64)
    check_model(LogitsOnly(model).eval(), (ids,))
