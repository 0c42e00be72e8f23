"""Tiny random-weight diffusers pipelines built from config classes (no downloads), saved with
``save_pretrained`` as a user's pipeline directory would be."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

#: The prompt every end-to-end test generates.
PROMPT = "a photograph of an astronaut riding a horse"


def saved(pipe: Any, out: Path) -> Path:
    """``pipe`` saved with diffusers' ``save_pretrained`` to ``out``."""
    pipe.save_pretrained(out)
    return out


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
        bos_token_id=512,
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
            beta_start=0.00085,
            beta_end=0.012,
            beta_schedule="scaled_linear",
            steps_offset=1,
            **({"skip_prk_steps": True} if scheduler == "PNDMScheduler" else {}),
        ),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    return saved(pipe, directory / "sd")


def sdxl_pipeline(directory: Path) -> Path:
    """A Stable Diffusion XL-shaped pipeline (two CLIP text encoders, the second with a
    projection; a UNet with added time/text conditioning), random weights; 32x32 images."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=1,
        sample_size=16,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        transformer_layers_per_block=(1, 2),
        projection_class_embeddings_input_dim=6 * 8 + 32,
        cross_attention_dim=64,
        norm_num_groups=1,
    ).eval()
    tokenizer = clip_tokenizer(directory / "_tokenizer")
    pipe = StableDiffusionXLPipeline(
        vae=tiny_vae(),
        text_encoder=CLIPTextModel(clip_text_config()).eval(),
        text_encoder_2=CLIPTextModelWithProjection(clip_text_config(projection=32)).eval(),
        tokenizer=tokenizer,
        tokenizer_2=tokenizer,
        unet=unet,
        scheduler=EulerDiscreteScheduler(
            beta_start=0.00085,
            beta_end=0.012,
            steps_offset=1,
            beta_schedule="scaled_linear",
            timestep_spacing="leading",
        ),
    )
    return saved(pipe, directory / "sdxl")


def t5_tokenizer(directory: Path) -> Any:
    """A ``T5TokenizerFast`` over single characters (a Unigram model, no downloads)."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    pieces += [(c, -2.0) for c in string.ascii_letters + string.digits + string.punctuation]
    model = Tokenizer(models.Unigram(pieces, unk_id=2))
    model.pre_tokenizer = pre_tokenizers.Metaspace()
    model.decoder = decoders.Metaspace()
    tokenizer = T5TokenizerFast(
        tokenizer_object=model,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        extra_ids=0,
    )
    tokenizer.save_pretrained(directory)
    return T5TokenizerFast.from_pretrained(directory)


def sd3_pipeline(directory: Path, t5: bool = False) -> Path:
    """A Stable Diffusion 3-shaped pipeline (an MMDiT, two CLIP text encoders with
    projections; without T5 ``text_encoder_3`` is saved as None), random weights; 32x32
    images."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextModelWithProjection

    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(
        sample_size=16,
        patch_size=1,
        in_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        caption_projection_dim=32,
        joint_attention_dim=64,
        pooled_projection_dim=64,
        out_channels=4,
    ).eval()
    tokenizer = clip_tokenizer(directory / "_tokenizer")
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=tiny_vae(shift_factor=0.0609, scaling_factor=1.5035),
        text_encoder=CLIPTextModelWithProjection(clip_text_config(projection=32)).eval(),
        tokenizer=tokenizer,
        text_encoder_2=CLIPTextModelWithProjection(clip_text_config(projection=32)).eval(),
        tokenizer_2=tokenizer,
        text_encoder_3=_t5_encoder() if t5 else None,
        tokenizer_3=t5_tokenizer(directory / "_t5") if t5 else None,
    )
    return saved(pipe, directory / ("sd3_t5" if t5 else "sd3"))


#: the tiny FLUX transformers' shared sizes: one double- and one single-stream block of two
#: 16-wide heads over 16 packed latent channels (4 latent channels in 2x2 patches)
TINY_FLUX_TRANSFORMER: dict[str, Any] = dict(
    patch_size=1,
    in_channels=16,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=2,
)

#: the tiny FLUX pipelines are exported (and compared) at 32x32 with 16 T5 tokens
FLUX_EXPORT: dict[str, Any] = {"height": 32, "width": 32, "max_sequence_length": 16}


def flux_pipeline(directory: Path, guidance_embeds: bool = True) -> Path:
    """A FLUX.1-shaped pipeline (a double- and a single-stream transformer block with rotary
    embeddings, CLIP for the pooled prompt, T5 for the tokens, a 16-channel-packed VAE),
    random weights; 32x32 images (16x16 latents, 8x8 packed tokens)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel

    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        **TINY_FLUX_TRANSFORMER,
        joint_attention_dim=64,
        pooled_projection_dim=32,
        guidance_embeds=guidance_embeds,
        axes_dims_rope=(4, 6, 6),
    ).eval()
    pipe = FluxPipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=tiny_vae(shift_factor=0.1159, scaling_factor=0.3611, use_quant_conv=False),
        text_encoder=CLIPTextModel(clip_text_config()).eval(),
        tokenizer=clip_tokenizer(directory / "_tokenizer"),
        text_encoder_2=_t5_encoder(),
        tokenizer_2=t5_tokenizer(directory / "_t5"),
    )
    return saved(pipe, directory / ("flux" if guidance_embeds else "flux_schnell"))


def qwen_tokenizer(directory: Path) -> Any:
    """A byte-level ``Qwen2TokenizerFast`` (one token per byte, no merges) with a ChatML
    template, saved in ``directory``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import Qwen2TokenizerFast
    from transformers.models.clip.tokenization_clip import bytes_to_unicode

    vocab = {symbol: i for i, symbol in enumerate(bytes_to_unicode().values())}
    model = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    tokenizer = Qwen2TokenizerFast(
        tokenizer_object=model,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tokenizer.save_pretrained(directory)
    return Qwen2TokenizerFast.from_pretrained(directory)


#: the tiny FLUX.2 pipeline is exported (and compared) at 32x32 with 32 text tokens
FLUX2_EXPORT: dict[str, Any] = {"height": 32, "width": 32, "max_sequence_length": 32}


def flux2_pipeline(directory: Path) -> Path:
    """A FLUX.2 [klein]-shaped pipeline (a Qwen3 text encoder read at layers 9, 18 and 27, a
    double- and a single-stream transformer block with 4-axis rotary embeddings, a VAE with a
    latent batch norm), random weights, not distilled (classifier-free guidance); 32x32
    images."""
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2KleinPipeline,
        Flux2Transformer2DModel,
    )
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    tokenizer = qwen_tokenizer(directory / "_qwen")
    text_encoder = Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=27,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=512,
            tie_word_embeddings=True,
        )
    ).eval()
    transformer = Flux2Transformer2DModel(
        **TINY_FLUX_TRANSFORMER,
        joint_attention_dim=48,
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=False,
    ).eval()
    vae = AutoencoderKLFlux2(
        block_out_channels=(32, 32),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        norm_num_groups=32,
        sample_size=32,
    ).eval()
    with torch.no_grad():  # statistics the pipeline must read from the bundle
        vae.bn.running_mean.normal_(0, 0.1)
        vae.bn.running_var.uniform_(0.5, 1.5)
    pipe = Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        is_distilled=False,
    )
    return saved(pipe, directory / "flux2")


def _t5_encoder() -> Any:
    from transformers import T5Config, T5EncoderModel

    config = T5Config(
        vocab_size=104,
        d_model=64,
        d_ff=64,
        d_kv=8,
        num_layers=2,
        num_heads=4,
        feed_forward_proj="gated-gelu",
        dense_act_fn="gelu_new",
    )
    return T5EncoderModel(config).eval()


def psnr(actual: Any, expected: Any) -> float:
    """PSNR in dB of two images in [0, 1] (inf when equal)."""
    import numpy as np

    mse = float(np.mean((np.asarray(actual, np.float64) - np.asarray(expected, np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * float(np.log10(1.0 / mse))


def generate(pipe: Any, steps: int = 4, **kwargs: Any) -> Any:
    """The images of ``pipe`` (ours or diffusers') for :data:`PROMPT`, seed 0."""
    return pipe(
        prompt=PROMPT,
        num_inference_steps=steps,
        guidance_scale=7.5,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
        **kwargs,
    ).images


def reference(path: Path) -> Any:
    """The diffusers pipeline of ``path`` in float32 (PyTorch eager)."""
    from diffusers import DiffusionPipeline

    index = json.loads((path / "model_index.json").read_text())
    left_out = {k: None for k, v in index.items() if isinstance(v, list) and v[0] is None}
    pipe = DiffusionPipeline.from_pretrained(path, **left_out)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def controlnet_pipeline(directory: Path) -> Path:
    """The SD 1.x pipeline of :func:`sd_pipeline` with a ControlNet made from its UNet."""
    from diffusers import (
        ControlNetModel,
        StableDiffusionControlNetPipeline,
        StableDiffusionPipeline,
    )

    source = StableDiffusionPipeline.from_pretrained(sd_pipeline(directory))
    torch.manual_seed(2)
    controlnet = ControlNetModel.from_unet(
        source.unet, conditioning_embedding_out_channels=(16, 32)
    )
    with torch.no_grad():  # from_unet zero-initialises the output convolutions: make them count
        for parameter in controlnet.parameters():
            if not parameter.abs().sum():
                parameter.normal_(0, 0.05)
    pipe = StableDiffusionControlNetPipeline(
        **{k: v for k, v in source.components.items() if k != "image_encoder"},
        controlnet=controlnet.eval(),
    )
    pipe.register_to_config(requires_safety_checker=False)
    return saved(pipe, directory / "controlnet")
