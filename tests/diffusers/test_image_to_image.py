"""Image-to-image on the exported VAE encoder, and the command line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.diffusers.support import generate, psnr

#: every test here shares the session's exports (one worker under pytest-xdist)
pytestmark = pytest.mark.xdist_group("diffusers")


def _init_image() -> Any:
    from PIL import Image

    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8))


def test_image_to_image(pipelines: dict[str, Path], exported: Any) -> None:
    from diffusers import StableDiffusionImg2ImgPipeline

    pipe = exported("sd")
    ours = generate(pipe, image=_init_image(), strength=0.6)
    reference = StableDiffusionImg2ImgPipeline.from_pretrained(pipelines["sd"])
    reference.set_progress_bar_config(disable=True)
    theirs = generate(reference, image=_init_image(), strength=0.6)
    assert ours.shape == theirs.shape == (1, 32, 32, 3)
    assert psnr(ours, theirs) >= 60.0


def test_scheduler_swap(pipelines: dict[str, Path], exported: Any) -> None:
    from diffusers import DPMSolverMultistepScheduler

    from tests.diffusers.support import reference

    pipe = exported("sd")
    original = pipe.scheduler
    pipe.scheduler = DPMSolverMultistepScheduler.from_config(original.config)
    try:
        ours = generate(pipe)
    finally:
        pipe.scheduler = original
    theirs_pipe = reference(pipelines["sd"])
    theirs_pipe.scheduler = DPMSolverMultistepScheduler.from_config(original.config)
    assert psnr(ours, generate(theirs_pipe)) >= 60.0


@pytest.mark.slow
def test_cli_export(tmp_path: Path, pipelines: dict[str, Path], exported: Any) -> None:
    from coreai_torch.cli.main import main
    from coreai_torch.diffusers import CoreAIDiffusionPipeline

    out = tmp_path / "bundle"
    assert main(["export", "--task", "text-to-image", str(pipelines["sd"]), "-o", str(out)]) == 0
    meta = json.loads((out / "metadata.json").read_text())
    assert meta["kind"] == "diffusion" and meta["diffusion"]["type"] == "stable-diffusion"
    with CoreAIDiffusionPipeline.from_pretrained(out) as pipe:
        np.testing.assert_array_equal(generate(pipe), generate(exported("sd")))
    assert main(["export", "--task", "text-to-image", str(pipelines["sd"]), "-o", str(out)]) != 0


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from coreai_torch.cli.main import main

    missing = str(tmp_path / "none")
    assert main(["export", "--task", "text-to-image", missing, "-o", str(tmp_path / "o")]) == 2
    assert "never downloads" in capsys.readouterr().err
    args = ["export", "--task", "text-generation", missing, "-o", "x", "--height", "64"]
    assert main(args) == 2
    assert "--height / --width apply to --task text-to-image" in capsys.readouterr().err
