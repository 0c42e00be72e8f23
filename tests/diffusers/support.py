"""Tiny random-weight diffusers pipelines built from config classes (no downloads), saved with
``save_pretrained`` as a user's pipeline directory would be."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

#: The prompt every end-to-end test generates.
PROMPT = "a photograph of an astronaut riding a horse"


def clip_tokenizer(directory: Path, max_length: int = 77) -> Any:
    """A byte-level ``CLIPTokenizer`` (one token per byte, no merges) saved in ``directory``."""
    from transformers import CLIPTokenizer
    from transformers.models.clip.tokenization_clip import bytes_to_unicode

    directory.mkdir(parents=True, exist_ok=True)
    symbols = list(bytes_to_unicode().values())
    tokens = [*symbols, *(s + "</w>" for s in symbols), "<|startoftext|>", "<|endoftext|>"]
    (directory / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    (directory / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(
        str(directory / "vocab.json"), str(directory / "merges.txt"), model_max_length=max_length
    )
    tokenizer.save_pretrained(directory)
    return tokenizer


def clip_text_config(hidden: int = 32, projection: int | None = None, **overrides: Any) -> Any:
    from transformers import CLIPTextConfig

    config = dict(
        bos_token_id=512 * 2 // 2 + 512 - 512 + 0,
        eos_token_id=513,
        pad_token_id=513,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        layer_norm_eps=1e-5,
        num_attention_heads=4,
        num_hidden_layers=3,
        vocab_size=514,
        max_position_embeddings=77,
        hidden_act="gelu",
    )
    if projection is not None:
        config["projection_dim"] = projection
    config.update(overrides)
    return CLIPTextConfig(**config)


def tiny_vae(latent_channels: int = 4, **overrides: Any) -> Any:
    from diffusers import AutoencoderKL

    torch.manual_seed(1)
    return AutoencoderKL(
        block_out_channels=[32, 32],
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2,
        latent_channels=latent_channels,
        norm_num_groups=32,
        sample_size=32,
        **overrides,
    ).eval()


def sd_pipeline(directory: Path, scheduler: str = "PNDMScheduler") -> Path:
    """A Stable Diffusion 1.x-shaped pipeline (UNet with cross-attention, CLIP text encoder,
    VAE), random weights, saved to ``directory``; 32x32 images (16x16 latents)."""
    import diffusers
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=1,
        sample_size=16,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=32,
    ).eval()
    text_encoder = CLIPTextModel(clip_text_config()).eval()
    scheduler_class = getattr(diffusers, scheduler)
    pipe = StableDiffusionPipeline(
        vae=tiny_vae(),
        text_encoder=text_encoder,
        tokenizer=clip_tokenizer(directory / "_tokenizer"),
        unet=unet,
        scheduler=scheduler_class(
            beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
            **({"skip_prk_steps": True} if scheduler == "PNDMScheduler" else {}),
        ),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    out = directory / "sd"
    pipe.save_pretrained(out)
    return out
