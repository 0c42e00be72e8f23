"""CLIP (text and vision towers, projections and similarity logits; Hugging Face model class
from a small config, random weights) matches eager PyTorch on the Core AI runtime within
1e-4 × max(1, max|ref|)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.models.common import (
    SMALL_TRANSFORMER,
    Call,
    check_model,
    check_model_dynamic,
    redraw_weights,
)

VOCAB = 128


def clip() -> nn.Module:
    from transformers import CLIPConfig, CLIPModel

    config = CLIPConfig(
        text_config=dict(
            vocab_size=VOCAB, max_position_embeddings=32, eos_token_id=2, **SMALL_TRANSFORMER
        ),
        vision_config=dict(image_size=32, patch_size=8, **SMALL_TRANSFORMER),
        projection_dim=32,
    )
    config._attn_implementation = "sdpa"
    model = redraw_weights(CLIPModel(config).eval())
    with torch.no_grad():
        model.logit_scale.fill_(2.0)  # exp(2) ≈ 7.4: similarity logits of order 1-10
    return model


def similarity(m: nn.Module, ids: torch.Tensor, mask: torch.Tensor, pixels: torch.Tensor):
    out = m(input_ids=ids, attention_mask=mask, pixel_values=pixels, return_dict=True)
    return (
        out.logits_per_image,
        out.text_embeds,
        out.image_embeds,
        out.text_model_output.last_hidden_state,
        out.vision_model_output.last_hidden_state,
    )


def clip_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (3, 10))
    ids[:, -1] = 2  # end of text (pooled position)
    mask = torch.ones_like(ids)
    return ids, mask, torch.randn(2, 3, 32, 32)


@pytest.mark.slow
def test_clip_text_and_vision() -> None:
    """Causal text tower pooled at the end-of-text token, ViT tower, cosine-similarity logits."""
    check_model(Call(clip(), similarity), clip_inputs())


@pytest.mark.slow
def test_clip_text_dynamic_sequence_length() -> None:
    """The text tower (causal mask, pooling at the end-of-text token) for every length."""
    seq = torch.export.Dim("seq", min=2, max=32)
    runs = []
    for n in (10, 4, 20):
        ids = torch.randint(3, VOCAB, (3, n))
        ids[:, -1] = 2
        runs.append((ids, torch.ones_like(ids)))
    text = Call(clip(), lambda m, i, a: m.get_text_features(input_ids=i, attention_mask=a))
    check_model_dynamic(text, runs, (({1: seq}, {1: seq}),))
