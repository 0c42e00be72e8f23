"""Vision models (Hugging Face model classes from small configs, random weights) match eager
PyTorch on the Core AI runtime within 1e-4 × max(1, max|ref|).

ViT is in the fast suite (the code-built ResNet-18 layout is in test_resnet.py); the rest are
slow.  Each model returns its classification logits (or segmentation logits) and, where the
model has one, the last hidden state, so every spatial position is checked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn

from tests.models.common import SMALL_TRANSFORMER, Call, check_model, redraw_weights

IMAGE = 32
LABELS = 10


def hf_model(config_name: str, model_name: str, gain: float = 1.0, **config: Any) -> nn.Module:
    import transformers

    cfg = getattr(transformers, config_name)(**config)
    if config_name in ("ViTConfig", "Dinov2Config", "BeitConfig"):
        cfg._attn_implementation = "sdpa"
    return redraw_weights(getattr(transformers, model_name)(cfg).eval(), gain=gain)


def logits_and_hidden(m: nn.Module, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits, hidden = m(pixel_values=pixels, output_hidden_states=True, return_dict=False)[:2]
    return logits, hidden[-1]


def logits_only(m: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    return m(pixel_values=pixels, return_dict=False)[0]


def check_image_model(model: nn.Module, fn: Callable[..., Any], batch: int = 2) -> None:
    check_model(Call(model, fn), (torch.randn(batch, 3, IMAGE, IMAGE),))


def vit() -> nn.Module:
    return hf_model(
        "ViTConfig",
        "ViTForImageClassification",
        image_size=IMAGE,
        patch_size=8,
        **SMALL_TRANSFORMER,
        num_labels=LABELS,
    )


def test_vit() -> None:
    check_image_model(vit(), logits_and_hidden)


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[..., Any]]] = {
    # ViT variants: layer scale and bicubic-interpolated position embeddings (DINOv2);
    # relative position bias tables and mean pooling (BEiT).
    "dinov2": (
        lambda: hf_model(
            "Dinov2Config",
            "Dinov2Model",
            image_size=IMAGE,
            patch_size=8,
            **SMALL_TRANSFORMER,  # Dinov2 sizes its MLP with mlp_ratio
            mlp_ratio=2,
        ),
        lambda m, pixels: m(pixel_values=pixels, return_dict=False)[:2],
    ),
    "beit": (
        lambda: hf_model(
            "BeitConfig",
            "BeitForImageClassification",
            image_size=IMAGE,
            patch_size=8,
            **SMALL_TRANSFORMER,
            use_relative_position_bias=True,
            num_labels=LABELS,
        ),
        logits_and_hidden,
    ),
    "swin": (
        lambda: hf_model(
            "SwinConfig",
            "SwinForImageClassification",
            image_size=IMAGE,
            patch_size=2,
            embed_dim=16,
            depths=[2, 2],
            num_heads=[2, 4],
            window_size=4,
            mlp_ratio=2.0,
            drop_path_rate=0.0,
            num_labels=LABELS,
        ),
        logits_and_hidden,
    ),
    "convnext": (
        lambda: hf_model(
            "ConvNextConfig",
            "ConvNextForImageClassification",
            image_size=IMAGE,
            num_stages=2,
            hidden_sizes=[16, 32],
            depths=[1, 1],
            num_labels=LABELS,
        ),
        logits_and_hidden,
    ),
    "resnet": (
        lambda: hf_model(
            "ResNetConfig",
            "ResNetForImageClassification",
            embedding_size=16,
            hidden_sizes=[32, 64],
            depths=[1, 1],
            layer_type="bottleneck",
            num_labels=LABELS,
        ),
        logits_and_hidden,
    ),
    "mobilenet_v2": (
        lambda: hf_model(
            "MobileNetV2Config",
            "MobileNetV2ForImageClassification",
            image_size=IMAGE,
            depth_multiplier=0.35,
            num_labels=LABELS,
        ),
        logits_and_hidden,
    ),
    "efficientnet": (
        lambda: hf_model(
            "EfficientNetConfig",
            "EfficientNetForImageClassification",
            image_size=IMAGE,
            width_coefficient=0.25,
            depth_coefficient=0.25,
            hidden_dim=320,  # round_filters(1280) at width 0.25
            num_labels=LABELS,
            gain=1.4,
        ),
        logits_and_hidden,
    ),
    "segformer": (
        lambda: hf_model(
            "SegformerConfig",
            "SegformerForSemanticSegmentation",
            num_encoder_blocks=2,
            depths=[1, 1],
            sr_ratios=[2, 1],
            hidden_sizes=[16, 32],
            patch_sizes=[7, 3],
            strides=[4, 2],
            num_attention_heads=[1, 2],
            mlp_ratios=[2, 2],
            decoder_hidden_size=32,
            drop_path_rate=0.0,
            num_labels=5,
        ),
        logits_only,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_vision_model(name: str) -> None:
    build, fn = MODELS[name]
    check_image_model(build(), fn)
