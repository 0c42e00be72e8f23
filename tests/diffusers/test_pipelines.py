"""Tiny SD 1.x, SDXL and SD3 pipelines exported whole and run like diffusers: the images of 4
denoising steps against diffusers' own pipeline on the same weights and seed (PSNR), each
component against its PyTorch module, the bundle written and loaded back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.diffusers.support import PROMPT, generate, psnr, reference

#: every test here shares the session's exports (one worker under pytest-xdist)
pytestmark = pytest.mark.xdist_group("diffusers")

#: the lowest PSNR (dB) of the final image against diffusers' over 4 steps
FP32_PSNR = 60.0
FP16_PSNR = 35.0


#: SD 1.x runs in the fast suite, the others in the slow one (an export is ~30 s each)
KINDS = [
    "sd",
    pytest.param("sdxl", marks=pytest.mark.slow),
    pytest.param("sd3", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("kind", KINDS)
def test_text_to_image_fp32(kind: str, pipelines: dict[str, Path], exported: Any) -> None:
    pipe = exported(kind)
    ours = generate(pipe)
    theirs = generate(reference(pipelines[kind]))
    assert ours.shape == theirs.shape == (1, 32, 32, 3)
    assert ours.dtype == theirs.dtype
    assert psnr(ours, theirs) >= FP32_PSNR


@pytest.mark.parametrize("kind", KINDS)
def test_text_to_image_fp16(kind: str, pipelines: dict[str, Path], exported: Any) -> None:
    pipe = exported(kind, "fp16")
    assert pipe.coreai_config["precision"] == "fp16"
    ours = generate(pipe)
    theirs = generate(reference(pipelines[kind]))
    assert psnr(ours, theirs) >= FP16_PSNR


@pytest.mark.parametrize("kind", KINDS)
def test_components_match_pytorch(kind: str, pipelines: dict[str, Path], exported: Any) -> None:
    from coreai_torch.diffusers.check import component_errors

    errors = component_errors(exported(kind), pipelines[kind])
    roles = {e.role for e in errors}
    assert {"text_encoder", "vae_decoder", "vae_encoder"} <= roles
    assert ("transformer" if kind == "sd3" else "unet") in roles
    for error in errors:
        assert error.max_abs_error <= 1e-4 * max(1.0, error.max_abs_reference), str(error)


def test_bundle_round_trip(tmp_path: Path, exported: Any) -> None:
    from coreai_torch.bundles import Bundle
    from coreai_torch.diffusers import CoreAIDiffusionPipeline
    from tests.bundles.support import assert_doctor_clean

    pipe = exported("sd")
    out = tmp_path / "bundle"
    pipe.save_pretrained(out)
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["metadata_version"] == "0.2" and meta["kind"] == "diffusion"
    assert meta["assets"] == {
        "text_encoder": "TextEncoder.aimodel",
        "unet": "Unet.aimodel",
        "vae_decoder": "VAEDecoder.aimodel",
        "vae_encoder": "VAEEncoder.aimodel",
    }
    assert meta["diffusion"]["type"] == "stable-diffusion"
    assert meta["diffusion"]["image_size"] == 32
    assert meta["diffusion"]["prediction_type"] == "epsilon"
    assert (out / "tokenizer" / "vocab.json").is_file()
    assert (out / "tokenizer" / "merges.txt").is_file()
    bundle = Bundle.load(out)  # the app's loading rules, every asset's function 'main' checked
    assert bundle.kind == "diffusion" and bundle.diffusion.type == "stable-diffusion"
    assert_doctor_clean(out)  # the community bundle lint
    with CoreAIDiffusionPipeline.from_pretrained(out) as loaded:
        np.testing.assert_array_equal(generate(loaded), generate(pipe))


@pytest.mark.slow
def test_sd3_bundle_names(exported: Any) -> None:
    pipe = exported("sd3")
    meta = pipe.manifest
    assert meta.assets["transformer"] == "MMDiT.aimodel"
    assert meta.diffusion.type == "stable-diffusion-3"
    assert meta.diffusion.prediction_type == "flow"
    assert meta.diffusion.scheduler is None  # a flow-matching schedule has no betas
    assert "text_encoder_3" not in meta.assets  # saved without T5
    transformer = pipe.coreai_config["components"]["transformer"]
    assert transformer["inputs"] == [
        "sample",
        "timestep",
        "encoder_hidden_states",
        "pooled_projections",
    ]
    assert transformer["outputs"] == ["noise_pred"]
    assert pipe.coreai_config["components"]["text_encoder"]["outputs"] == [
        "hidden_embeds",
        "pooled_outputs",
    ]


@pytest.mark.slow
def test_sd3_with_t5(tmp_path: Path) -> None:
    """SD3 with its T5 encoder: a third text encoder, 77 + max_sequence_length tokens."""
    from coreai_torch.diffusers import CoreAIDiffusionPipeline
    from tests.diffusers.support import sd3_pipeline

    source = sd3_pipeline(tmp_path, t5=True)
    with CoreAIDiffusionPipeline.from_pretrained(
        source, export=True, max_sequence_length=16
    ) as pipe:
        assert pipe.manifest.assets["text_encoder_3"] == "TextEncoder3.aimodel"
        ours = generate(pipe)
        theirs = generate(reference(source), max_sequence_length=16)
        assert psnr(ours, theirs) >= FP32_PSNR
        with pytest.raises(ValueError, match="exported for 16 T5 tokens"):
            pipe(PROMPT, num_inference_steps=1, max_sequence_length=32)
