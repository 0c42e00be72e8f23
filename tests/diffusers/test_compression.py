"""Compressed recipes: mixed-bit palettes of the denoiser chosen by output PSNR."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.diffusers.support import generate, psnr, reference

#: every test here shares the session's exports (one worker under pytest-xdist)
pytestmark = pytest.mark.xdist_group("diffusers")


def test_allocate_bits_meets_the_budget() -> None:
    from coreai_torch.diffusers.mixed_bits import allocate_bits

    sensitivity = {
        "robust": {8: 80.0, 4: 60.0, 2: 45.0},
        "fragile": {8: 70.0, 4: 38.0, 2: 20.0},
    }
    sizes = {"robust": 1000, "fragile": 1000}
    chosen = allocate_bits(sensitivity, sizes, 40.0)
    assert chosen == {"robust": 2, "fragile": 8}  # 4 bits of "fragile" alone break 40 dB
    assert allocate_bits(sensitivity, sizes, 90.0) == {"robust": 8, "fragile": 8}
    assert allocate_bits(sensitivity, sizes, 10.0) == {"robust": 2, "fragile": 2}


@pytest.mark.slow
def test_mixed_bit_palettes(pipelines: dict[str, Path]) -> None:
    from coreai_torch.diffusers import CoreAIDiffusionPipeline
    from coreai_torch.diffusers.check import component_errors
    from coreai_torch.diffusers.mixed_bits import MixedBitPalettes

    recipe = MixedBitPalettes(target_psnr_db=30.0, candidate_bits=(6, 4, 2))
    with CoreAIDiffusionPipeline.from_pretrained(
        pipelines["sd"], export=True, compress=recipe
    ) as pipe:
        unet = pipe.coreai_config["components"]["unet"]
        report = unet["mixed_bits"]
        assert unet["compression"] == recipe.describe()
        assert pipe.coreai_config["components"]["text_encoder"]["compression"] is None
        assert pipe.coreai_config["components"]["vae_decoder"]["compression"] is None
        layers = report["layers"]
        assert len(layers) > 10
        assert {layer["bits"] for layer in layers.values()} <= {6, 4, 2}
        assert len({layer["bits"] for layer in layers.values()}) > 1  # mixed
        assert all(set(layer["psnr_db"]) == {"6", "4", "2"} for layer in layers.values())
        assert report["achieved_psnr_db"] >= 30.0
        assert report["bits_per_compressed_weight"] < 6
        # the program computes what the palettes give: its output against the float UNet on
        # the calibration inputs, measured on the runtime
        unet_error = next(e for e in component_errors(pipe, pipelines["sd"]) if e.role == "unet")
        assert unet_error.psnr_db >= 29.0, str(unet_error)
        image = generate(pipe)
        assert psnr(image, generate(reference(pipelines["sd"]))) >= 20.0


@pytest.mark.parametrize("bits", [(0,), ()])
def test_bad_candidate_bits(bits: Any) -> None:
    from coreai_torch.diffusers.mixed_bits import MixedBitPalettes

    with pytest.raises(ValueError, match="candidate_bits takes widths from 1 to 8"):
        MixedBitPalettes(candidate_bits=bits)
