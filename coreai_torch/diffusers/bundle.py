"""The diffusion bundle: the directory the Swift ``CoreAIDiffusionPipeline`` loads and
:class:`~coreai_torch.diffusers.CoreAIDiffusionPipeline` loads back, written and read by the
shared bundle writer and reader (:mod:`coreai_torch.bundles`).

What is diffusion-specific lives here: the manifest (``kind: "diffusion"``, the ``assets``
roles, the ``diffusion`` block) built from the pipeline's configurations, and the files beside
the assets that the Python class needs.  Layout::

    metadata.json          the manifest (schema 0.2, kind "diffusion")
    coreai_config.json     what the Python class needs: components, entry points, resolutions
    <Asset>.aimodel/       one per component (TextEncoder, TextEncoder2, Unet / MMDiT,
                           ControlNet, VAEDecoder, VAEEncoder), function ``main`` (+
                           ``main_<H>x<W>`` per extra resolution)
    tokenizer/ tokenizer_2/ tokenizer_3/    the pipeline's tokenizers (vocab.json + merges.txt)
    scheduler/             diffusers' scheduler configuration
    <module>/config.json   the source modules' configurations; model_index.json
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from coreai_torch.bundles import Bundle, DiffusionConfig, Manifest, SchedulerDefaults, write_bundle
from coreai_torch.bundles.manifest import DIFFUSION_TYPES

#: the Python side's file beside the manifest
COREAI_CONFIG = "coreai_config.json"
#: the layout version of :data:`COREAI_CONFIG`
FORMAT_VERSION = 1


def manifest(
    name: str,
    bundle_type: str,
    assets: Mapping[str, str],
    *,
    scheduler: Mapping[str, Any],
    vae: Mapping[str, Any],
    denoiser: Mapping[str, Any] | None = None,
    image_size: int,
    default_steps: int,
    default_guidance_scale: float,
    compression: str | None,
) -> Manifest:
    """The ``metadata.json`` of a diffusion bundle from the pipeline's scheduler, VAE and
    denoiser configurations.  A ``bundle_type`` the Swift pipeline has no type for (FLUX.1's
    ``flux``) leaves ``diffusion.type`` out; a transformer with rotary embeddings adds
    ``guidance_embeds``, ``rope_axes_dims`` and ``rope_theta``."""
    flow = "FlowMatch" in str(scheduler.get("_class_name", ""))
    scale = float(vae.get("scaling_factor") or 0.18215)
    denoiser = denoiser or {}
    axes = denoiser.get("axes_dims_rope")
    return Manifest(
        kind="diffusion",
        name=name,
        assets=dict(assets),
        diffusion=DiffusionConfig(
            type=bundle_type if bundle_type in DIFFUSION_TYPES else None,
            prediction_type="flow" if flow else scheduler.get("prediction_type") or "epsilon",
            image_size=int(image_size),
            scheduler=None
            if flow
            else SchedulerDefaults(
                training_steps=int(scheduler.get("num_train_timesteps", 1000)),
                beta_start=float(scheduler.get("beta_start", 0.00085)),
                beta_end=float(scheduler.get("beta_end", 0.012)),
                beta_schedule=str(scheduler.get("beta_schedule", "scaled_linear")),
            ),
            encoder_scale_factor=scale,
            decoder_scale_factor=scale,
            decoder_shift_factor=float(vae.get("shift_factor") or 0.0),
            default_guidance_scale=float(default_guidance_scale),
            default_steps=int(default_steps),
            batch_norm_eps=vae.get("batch_norm_eps"),
            guidance_embeds=None if axes is None else bool(denoiser.get("guidance_embeds")),
            rope_axes_dims=None if axes is None else tuple(int(a) for a in axes),
            rope_theta=None if axes is None else float(denoiser.get("rope_theta", 10000)),
        ),
        source={"model_definition": "diffusers"},
        compression=compression,
    )


def write_directory(
    out: Path, manifest: Manifest, assets: Mapping[str, Path], files: Mapping[str, Path]
) -> None:
    """Write the bundle ``out`` (a new directory, or an empty one) with the shared writer:
    checked, then written atomically; assets are hard-linked where the file system allows."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty directory; choose a new output")
    write_bundle(out, manifest, dict(assets), files=dict(files), overwrite=out.exists())


def bundle_files(directory: Path, manifest: Manifest) -> dict[str, Path]:
    """Every file and directory of a bundle besides its manifest and assets (to copy it)."""
    skipped = {"metadata.json", *manifest.assets.values()}
    return {item.name: item for item in directory.iterdir() if item.name not in skipped}


def read_directory(path: Path) -> tuple[Manifest, dict[str, Any]]:
    """The manifest (read and checked by the shared reader, as the app would) and
    :data:`COREAI_CONFIG` of a bundle directory."""
    file = path / COREAI_CONFIG
    if not file.is_file():
        raise FileNotFoundError(
            f"{path} is not a diffusion bundle written by coreai_torch (no {COREAI_CONFIG}); "
            "export a diffusers pipeline directory with export=True"
        )
    bundle = Bundle.load(path, check_assets=False)
    if bundle.kind != "diffusion":
        raise ValueError(f"{path} is a '{bundle.kind}' bundle, not a diffusion bundle")
    try:
        config = json.loads(file.read_text())
    except ValueError as error:
        raise ValueError(f"{file} is not JSON ({error}); export the pipeline again") from None
    if config.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(
            f"{path} was written by a newer coreai-torch (format {config['format_version']}); "
            "upgrade coreai-torch"
        )
    return bundle.manifest, config


def write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
