"""Tiny diffusers pipelines saved once per session, and their exports (each export is shared by
the tests that only read it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.diffusers import support


@pytest.fixture(scope="session")
def pipelines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("diffusers_sources")
    return {
        "sd": support.sd_pipeline(root),
        "sdxl": support.sdxl_pipeline(root),
        "sd3": support.sd3_pipeline(root),
    }


@pytest.fixture(scope="session")
def flux_pipelines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny FLUX pipelines: FLUX.1 guidance-distilled ("flux") and not ("flux_schnell"),
    FLUX.2 [klein] ("flux2")."""
    root = tmp_path_factory.mktemp("diffusers_flux_sources")
    return {
        "flux": support.flux_pipeline(root),
        "flux_schnell": support.flux_pipeline(root, guidance_embeds=False),
        "flux2": support.flux2_pipeline(root),
    }


_EXPORTS: dict[tuple[str, str | None], Any] = {}


@pytest.fixture(scope="session")
def exported(pipelines: dict[str, Path], request: pytest.FixtureRequest) -> Any:
    """``exported(kind, precision)``: the CoreAIDiffusionPipeline of a tiny pipeline, exported
    once per session."""
    from coreai_torch.diffusers import CoreAIDiffusionPipeline

    def get(kind: str, precision: str | None = None) -> Any:
        if (kind, precision) not in _EXPORTS:
            if kind.startswith("flux"):
                source = request.getfixturevalue("flux_pipelines")[kind]
                options = support.FLUX2_EXPORT if kind == "flux2" else support.FLUX_EXPORT
            else:
                source, options = pipelines[kind], {}
            _EXPORTS[kind, precision] = CoreAIDiffusionPipeline.from_pretrained(
                source, export=True, precision=precision, **options
            )
        return _EXPORTS[kind, precision]

    yield get
    for pipe in _EXPORTS.values():
        pipe.close()
    _EXPORTS.clear()
