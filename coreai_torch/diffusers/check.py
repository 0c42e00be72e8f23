"""Each exported component against its PyTorch module: the largest absolute difference of
every output on the component's example inputs (one call per entry point)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .components import Shapes, family_of
from .export import load_module, read_pipeline
from .mixed_bits import output_psnr
from .modules import RuntimeModule


@dataclass(frozen=True)
class ComponentError:
    """One output of one entry point: the largest absolute error and the largest reference."""

    role: str
    entrypoint: str
    output: str
    max_abs_error: float
    max_abs_reference: float
    #: PSNR (dB) with the reference's largest magnitude as the peak
    psnr_db: float

    def __str__(self) -> str:
        return (
            f"{self.role}/{self.entrypoint}/{self.output}: max |error| {self.max_abs_error:.3g} "
            f"(max |reference| {self.max_abs_reference:.3g}), PSNR {self.psnr_db:.1f} dB"
        )


def component_errors(pipeline: Any, source_dir: str | Path, seed: int = 0) -> list[ComponentError]:
    """Run every component of ``pipeline`` (a
    :class:`~coreai_torch.diffusers.CoreAIDiffusionPipeline`) and its PyTorch module from
    ``source_dir`` (the diffusers directory it was exported from, loaded in memory) on the
    same random example inputs; returns the errors of every output."""
    source = read_pipeline(source_dir)
    config = pipeline.coreai_config
    family = family_of(config["pipeline_class"])
    assert family is not None
    by_role = {c.role: c for c in family.components}
    errors: list[ComponentError] = []
    for role, saved in config["components"].items():
        component = by_role[role]
        module = load_module(source, component.source, streamed=False)
        wrapper = component.wrap(module).eval()
        runner = RuntimeModule(Path(pipeline.directory) / saved["asset"], {}, {})
        try:
            for entry, resolution in saved["entrypoints"].items():
                height, width = resolution or config["resolutions"][0]
                factor = config["extras"]["vae_scale_factor"]
                shapes = Shapes(
                    height,
                    width,
                    height // factor,
                    width // factor,
                    source.configs,
                    config["extras"],
                )
                torch.manual_seed(seed)
                args = component.example(shapes)
                with torch.no_grad():
                    expected = wrapper(*args)
                expected = expected if isinstance(expected, tuple) else (expected,)
                actual = runner.run(entry, **dict(zip(saved["inputs"], args, strict=True)))
                for name, reference in zip(saved["outputs"], expected, strict=True):
                    errors.append(
                        ComponentError(
                            role,
                            entry,
                            name,
                            float((actual[name] - reference).abs().max()),
                            float(reference.abs().max()),
                            output_psnr(actual[name], reference),
                        )
                    )
        finally:
            runner.close()
        del module, wrapper
    return errors
