"""Bad input to coreai_torch.diffusers: clear errors that name the fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from coreai_torch.errors import UnsupportedModelError
from tests.diffusers.support import PROMPT

#: every test here shares the session's exports (one worker under pytest-xdist)
pytestmark = pytest.mark.xdist_group("diffusers")


def test_unsupported_pipeline_class(tmp_path: Path) -> None:
    from coreai_torch.diffusers import CoreAIDiffusionPipeline

    (tmp_path / "model_index.json").write_text(
        json.dumps(
            {"_class_name": "KandinskyPipeline", "unet": ["diffusers", "UNet2DConditionModel"]}
        )
    )
    with pytest.raises(UnsupportedModelError) as error:
        CoreAIDiffusionPipeline.from_pretrained(tmp_path, export=True)
    message = str(error.value)
    assert "'KandinskyPipeline' is not supported" in message
    assert "StableDiffusionPipeline" in message and "StableDiffusion3Pipeline" in message
    assert "TorchConverter" in message


def test_not_a_pipeline_directory(tmp_path: Path) -> None:
    from coreai_torch.diffusers import CoreAIDiffusionPipeline

    with pytest.raises(FileNotFoundError, match=r"no model_index\.json"):
        CoreAIDiffusionPipeline.from_pretrained(tmp_path, export=True)
    with pytest.raises(FileNotFoundError, match="never downloads"):
        CoreAIDiffusionPipeline.from_pretrained("runwayml/stable-diffusion-v1-5")


def test_resolution_not_exported(exported: Any) -> None:
    pipe = exported("sd")
    with pytest.raises(ValueError) as error:
        pipe(PROMPT, num_inference_steps=1, height=64, width=64)
    message = str(error.value)
    assert "height=64, width=64 was not exported" in message
    assert "32x32" in message
    assert "export the diffusers pipeline again with height=64, width=64" in message


def test_bad_export_resolution(pipelines: dict[str, Path]) -> None:
    from coreai_torch.diffusers import CoreAIDiffusionPipeline

    with pytest.raises(ValueError, match="must be positive multiples of 4"):
        CoreAIDiffusionPipeline.from_pretrained(pipelines["sd"], export=True, height=30, width=32)
    with pytest.raises(ValueError, match="either height= / width= or resolutions="):
        CoreAIDiffusionPipeline.from_pretrained(
            pipelines["sd"], export=True, height=32, resolutions=[(32, 32)]
        )


def test_incompatible_scheduler(exported: Any) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler

    pipe = exported("sd")
    original = pipe.scheduler
    pipe.scheduler = FlowMatchEulerDiscreteScheduler()
    try:
        with pytest.raises(ValueError) as error:
            pipe(PROMPT, num_inference_steps=1)
    finally:
        pipe.scheduler = original
    message = str(error.value)
    assert (
        "FlowMatchEulerDiscreteScheduler gives time steps this pipeline's denoiser cannot take"
        in (message)
    )
    assert "EulerDiscreteScheduler" in message
    assert ".from_config(pipe.scheduler.config)" in message


def test_time_step_shape() -> None:
    from coreai_torch.diffusers.modules import check_timestep

    assert check_timestep(torch.tensor(981), 2).tolist() == [981.0, 981.0]
    assert check_timestep(torch.tensor([5.5]), 2).dtype == torch.float32
    with pytest.raises(
        ValueError, match=r"one time step per sample \(\[batch\]\), got a time step"
    ):
        check_timestep(torch.zeros(2, 16), 2)
    with pytest.raises(ValueError, match="non-finite time step"):
        check_timestep(torch.tensor(float("nan")), 2)


def test_exported_options_on_a_bundle(tmp_path: Path, exported: Any) -> None:
    from coreai_torch.diffusers import CoreAIDiffusionPipeline

    exported("sd").save_pretrained(tmp_path / "b")
    with pytest.raises(ValueError, match=r"already exported; precision apply only when exporting"):
        CoreAIDiffusionPipeline.from_pretrained(tmp_path / "b", precision="fp16")
    with pytest.raises(ValueError, match="already a Core AI diffusion bundle"):
        CoreAIDiffusionPipeline.from_pretrained(tmp_path / "b", export=True)
    with pytest.raises(FileExistsError, match="not an empty directory"):
        exported("sd").save_pretrained(tmp_path / "b")


def test_bad_precision_and_compression(pipelines: dict[str, Path]) -> None:
    from coreai_torch.diffusers import CoreAIDiffusionPipeline

    with pytest.raises(ValueError, match=r"the diffusers export \(precision='fp8'\)"):
        CoreAIDiffusionPipeline.from_pretrained(pipelines["sd"], export=True, precision="fp8")
    with pytest.raises(ValueError, match=r"the diffusers export \(compress='int99'\)"):
        CoreAIDiffusionPipeline.from_pretrained(pipelines["sd"], export=True, compress="int99")
