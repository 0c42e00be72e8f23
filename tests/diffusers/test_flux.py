"""Tiny FLUX.1 and FLUX.2 [klein] pipelines exported whole: the rotary tables computed on the
host (as diffusers computes them) and fed to the transformer, 4 denoising steps against
diffusers' pipeline on the same weights and seed, each component against its PyTorch module,
the bundle round trip."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.diffusers.support import (
    FLUX2_EXPORT,
    FLUX_EXPORT,
    PROMPT,
    generate,
    psnr,
    reference,
)

#: every test here shares the session's exports (one worker under pytest-xdist)
pytestmark = pytest.mark.xdist_group("diffusers")

FP32_PSNR = 60.0
FP16_PSNR = 35.0
#: diffusers' call at the exported size and text length
CALL = dict(FLUX_EXPORT)
CALLS = {"flux": CALL, "flux_schnell": CALL, "flux2": dict(FLUX2_EXPORT)}


def test_rotary_tables_are_diffusers() -> None:
    """The host's tables and image ids are what FluxTransformer2DModel and FluxPipeline make."""
    from diffusers import FluxPipeline
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    from coreai_torch.diffusers.components import packed_image_ids, rotary_tables

    image_ids = packed_image_ids(16, 12)
    expected_ids = FluxPipeline._prepare_latent_image_ids(1, 8, 6, "cpu", torch.float32)
    torch.testing.assert_close(image_ids, expected_ids, rtol=0, atol=0)
    text_ids = torch.zeros(5, 3)
    cos, sin = rotary_tables({"axes_dims_rope": (4, 6, 6)}, text_ids, image_ids)
    ref_cos, ref_sin = FluxPosEmbed(theta=10000, axes_dim=[4, 6, 6])(
        torch.cat([text_ids, image_ids])
    )
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (5 + 48, 16)
    torch.testing.assert_close(cos, ref_cos.float(), rtol=0, atol=0)
    torch.testing.assert_close(sin, ref_sin.float(), rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["flux", "flux_schnell", "flux2"])
def test_flux_text_to_image_fp32(kind: str, flux_pipelines: dict[str, Path], exported: Any) -> None:
    ours = generate(exported(kind))
    theirs = generate(reference(flux_pipelines[kind]), **CALLS[kind])
    assert ours.shape == theirs.shape == (1, 32, 32, 3)
    assert psnr(ours, theirs) >= FP32_PSNR


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["flux", "flux2"])
def test_flux_text_to_image_fp16(kind: str, flux_pipelines: dict[str, Path], exported: Any) -> None:
    pipe = exported(kind, "fp16")
    assert pipe.coreai_config["components"]["transformer"]["precision"] == "fp16"
    ours = generate(pipe)
    theirs = generate(reference(flux_pipelines[kind]), **CALLS[kind])
    assert psnr(ours, theirs) >= FP16_PSNR


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["flux", "flux2"])
def test_flux_components_match_pytorch(
    kind: str, flux_pipelines: dict[str, Path], exported: Any
) -> None:
    from coreai_torch.diffusers.check import component_errors

    errors = component_errors(exported(kind), flux_pipelines[kind])
    roles = {"text_encoder", "transformer", "vae_decoder", "vae_encoder"}
    assert {e.role for e in errors} == (roles if kind == "flux2" else {*roles, "text_encoder_2"})
    for error in errors:
        assert error.max_abs_error <= 1e-4 * max(1.0, error.max_abs_reference), str(error)


@pytest.mark.slow
def test_flux_bundle_round_trip(tmp_path: Path, exported: Any) -> None:
    from coreai_torch.bundles import Bundle
    from coreai_torch.diffusers import CoreAIDiffusionPipeline

    pipe = exported("flux")
    transformer = pipe.coreai_config["components"]["transformer"]
    assert transformer["inputs"] == [
        "hidden_states",
        "encoder_hidden_states",
        "pooled_projections",
        "timestep",
        "guidance",
        "rotary_emb_cos",
        "rotary_emb_sin",
    ]
    assert transformer["outputs"] == ["output"] and transformer["batch"] == 1
    schnell = exported("flux_schnell").coreai_config["components"]["transformer"]
    assert "guidance" not in schnell["inputs"]
    out = tmp_path / "bundle"
    pipe.save_pretrained(out)
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["kind"] == "diffusion"
    assert meta["assets"] == {
        "text_encoder": "TextEncoder.aimodel",
        "text_encoder_2": "TextEncoder2.aimodel",
        "transformer": "Transformer.aimodel",
        "vae_decoder": "VAEDecoder.aimodel",
        "vae_encoder": "VAEEncoder.aimodel",
    }
    diffusion = meta["diffusion"]
    assert "type" not in diffusion  # the Swift pipeline has no FLUX.1 type
    assert diffusion["prediction_type"] == "flow"
    assert diffusion["rope_axes_dims"] == [4, 6, 6] and diffusion["guidance_embeds"] is True
    assert (out / "tokenizer_2" / "tokenizer.json").is_file()
    assert Bundle.load(out).kind == "diffusion"
    with CoreAIDiffusionPipeline.from_pretrained(out) as loaded:
        np.testing.assert_array_equal(generate(loaded), generate(pipe))


@pytest.mark.slow
def test_flux_image_to_image(flux_pipelines: dict[str, Path], exported: Any) -> None:
    from diffusers import FluxImg2ImgPipeline
    from PIL import Image

    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8))
    ours = generate(exported("flux"), image=image, strength=0.6)
    pipe = FluxImg2ImgPipeline.from_pretrained(flux_pipelines["flux"])
    pipe.set_progress_bar_config(disable=True)
    theirs = generate(pipe, image=image, strength=0.6, **CALL)
    assert psnr(ours, theirs) >= FP32_PSNR


@pytest.mark.slow
def test_flux_bad_calls(exported: Any) -> None:
    pipe = exported("flux")
    with pytest.raises(ValueError, match="exported for 16 T5 tokens"):
        pipe(PROMPT, num_inference_steps=1, max_sequence_length=32)
    with pytest.raises(ValueError, match="height=64, width=64 was not exported"):
        pipe(PROMPT, num_inference_steps=1, height=64, width=64)
    with pytest.raises(ValueError, match="takes no joint_attention_kwargs"):
        pipe(PROMPT, num_inference_steps=1, joint_attention_kwargs={"scale": 0.5})


@pytest.mark.slow
def test_flux_true_cfg(flux_pipelines: dict[str, Path], exported: Any) -> None:
    """A negative prompt with true_cfg_scale runs the batch-1 transformer twice per step."""
    call = {"negative_prompt": "a blurry photograph", "true_cfg_scale": 2.0}
    ours = generate(exported("flux"), **call)
    theirs = generate(reference(flux_pipelines["flux"]), **call, **CALL)
    assert psnr(ours, theirs) >= FP32_PSNR


@pytest.mark.slow
def test_flux2_bundle(tmp_path: Path, exported: Any) -> None:
    """FLUX.2's bundle: the Swift pipeline's type, names and VAE statistics files."""
    from coreai_torch.bundles import Bundle
    from coreai_torch.diffusers import CoreAIDiffusionPipeline

    pipe = exported("flux2")
    components = pipe.coreai_config["components"]
    assert components["text_encoder"]["inputs"] == ["input_ids", "attention_mask"]
    assert components["text_encoder"]["outputs"] == ["hidden_states"]
    assert components["text_encoder"]["layers"] == [9, 18, 27]
    assert components["transformer"]["inputs"] == [
        "hidden_states",
        "encoder_hidden_states",
        "timestep",
        "rotary_emb_cos",
        "rotary_emb_sin",
    ]
    out = tmp_path / "bundle"
    pipe.save_pretrained(out)
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["diffusion"]["type"] == "flux2"
    assert meta["diffusion"]["rope_axes_dims"] == [4, 4, 4, 4]
    assert meta["diffusion"]["batch_norm_eps"] > 0
    assert meta["assets"]["transformer"] == "Transformer.aimodel"
    statistics = np.load(out / "vae_bn_var.npy")
    assert statistics.dtype == np.float32 and statistics.shape == (16,)
    assert Bundle.load(out).diffusion.type == "flux2"  # the FLUX.2 file names checked
    with CoreAIDiffusionPipeline.from_pretrained(out) as loaded:
        torch.testing.assert_close(loaded.vae.bn.running_var, torch.from_numpy(statistics))
        np.testing.assert_array_equal(generate(loaded), generate(pipe))
    with pytest.raises(ValueError, match="takes image= as reference images"):
        pipe(PROMPT, image=np.zeros((32, 32, 3), np.uint8), num_inference_steps=1)
    with pytest.raises(ValueError, match=r"hidden_states\[2\] was not exported"):
        pipe(PROMPT, num_inference_steps=1, text_encoder_out_layers=(2,))
