"""Audio models (Wav2Vec2 for CTC; Hugging Face model class from a small config, random
weights) match eager PyTorch on the Core AI runtime within 1e-4 × max(1, max|ref|)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

from tests.models.common import Call, check_model, check_model_dynamic, redraw_weights


def wav2vec2(**overrides: Any) -> nn.Module:
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    config = Wav2Vec2Config(
        **{
            "vocab_size": 32,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "intermediate_size": 64,
            "conv_dim": (16, 16),
            "conv_stride": (5, 2),
            "conv_kernel": (10, 3),
            "num_conv_pos_embeddings": 16,
            "num_conv_pos_embedding_groups": 2,
            **overrides,
        }
    )
    config._attn_implementation = "sdpa"
    return redraw_weights(Wav2Vec2ForCTC(config).eval())


def logits_and_hidden(m: nn.Module, audio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = m(input_values=audio, output_hidden_states=True, return_dict=True)
    return out.logits, out.hidden_states[-1]


VARIANTS = [
    # wav2vec2-base layout: group norm in the first feature conv, post-norm transformer
    dict(feat_extract_norm="group", do_stable_layer_norm=False),
    # wav2vec2-large-lv60 layout: layer norm in every feature conv, pre-norm transformer
    dict(feat_extract_norm="layer", do_stable_layer_norm=True, conv_bias=True),
]
VARIANT_IDS = ["base", "stable_layer_norm"]


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_wav2vec2(variant: dict[str, Any]) -> None:
    """Conv feature encoder, weight-normed grouped positional conv, transformer, CTC head."""
    check_model(Call(wav2vec2(**variant), logits_and_hidden), (torch.randn(2, 400),))


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_wav2vec2_dynamic_length(variant: dict[str, Any]) -> None:
    """One program for every audio length (a multiple of the first conv's stride x 2, so
    torch.export's guards on the conv output sizes hold over the whole range)."""
    samples = 10 * torch.export.Dim("frames", min=40, max=200)
    runs = [(torch.randn(2, n),) for n in (400, 1000, 640)]
    check_model_dynamic(Call(wav2vec2(**variant), logits_and_hidden), runs, (({1: samples},),))
