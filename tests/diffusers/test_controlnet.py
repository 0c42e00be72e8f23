"""ControlNet for SD 1.x: the ControlNet as one more component, the UNet taking its residuals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.diffusers.support import controlnet_pipeline, generate, psnr

#: every test here shares the session's exports (one worker under pytest-xdist)
pytestmark = pytest.mark.xdist_group("diffusers")


def _control_image():
    from PIL import Image

    rng = np.random.default_rng(1)
    return Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8))


@pytest.mark.slow
def test_controlnet(tmp_path: Path) -> None:
    from diffusers import StableDiffusionControlNetPipeline

    from coreai_torch.diffusers import CoreAIDiffusionPipeline
    from coreai_torch.diffusers.check import component_errors

    source = controlnet_pipeline(tmp_path)
    with CoreAIDiffusionPipeline.from_pretrained(source, export=True) as pipe:
        config = pipe.coreai_config["components"]
        assert pipe.manifest.assets["controlnet"] == "ControlNet.aimodel"
        residuals = config["controlnet"]["outputs"]
        assert residuals[-1] == "mid_block_res" and len(residuals) == 5  # 4 down, 1 mid
        assert config["unet"]["inputs"][3:] == residuals
        ours = generate(pipe, image=_control_image())  # the control image, as in diffusers
        reference = StableDiffusionControlNetPipeline.from_pretrained(source)
        reference.set_progress_bar_config(disable=True)
        theirs = generate(reference, image=_control_image())
        assert psnr(ours, theirs) >= 60.0
        for error in component_errors(pipe, source):
            assert error.max_abs_error <= 1e-4 * max(1.0, error.max_abs_reference), str(error)
        meta = json.loads((pipe.directory / "metadata.json").read_text())
        assert meta["diffusion"]["type"] == "stable-diffusion"
