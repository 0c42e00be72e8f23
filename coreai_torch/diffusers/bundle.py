"""The diffusion bundle: the directory the Swift ``CoreAIDiffusionPipeline`` loads and
:class:`~coreai_torch.diffusers.CoreAIDiffusionPipeline` loads back.

What is diffusion-specific lives here -- the ``metadata.json`` manifest (``kind: "diffusion"``,
the ``assets`` roles, the ``diffusion`` block) and its checks -- and the directory is written
atomically (a temporary directory renamed into place) by :func:`write_directory`.  Layout::

    metadata.json          the manifest (schema 0.2, kind "diffusion")
    coreai_config.json     what the Python class needs: components, entry points, resolutions
    <Asset>.aimodel/       one per component (TextEncoder, TextEncoder2, Unet / MMDiT, VAEDecoder,
                           VAEEncoder), function ``main`` (+ ``main_<H>x<W>`` per extra resolution)
    tokenizer/ tokenizer_2/ tokenizer_3/    the pipeline's tokenizers (vocab.json + merges.txt)
    scheduler/             diffusers' scheduler configuration
    <module>/config.json   the source modules' configurations; model_index.json
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

#: the manifest's schema version and the Python side's file
METADATA = "metadata.json"
METADATA_VERSION = "0.2"
COREAI_CONFIG = "coreai_config.json"
#: the layout version of :data:`COREAI_CONFIG`
FORMAT_VERSION = 1
#: the manifest roles the Swift loader reads (``transformer`` is read as ``unet``)
ROLES = (
    "text_encoder",
    "text_encoder_2",
    "text_encoder_3",
    "unet",
    "transformer",
    "vae_decoder",
    "vae_encoder",
)


def manifest(
    name: str,
    bundle_type: str,
    assets: Mapping[str, str],
    *,
    scheduler: Mapping[str, Any],
    vae: Mapping[str, Any],
    image_size: int,
    default_steps: int,
    default_guidance_scale: float,
    compression: str | None,
) -> dict[str, Any]:
    """The ``metadata.json`` of a diffusion bundle (``kind: "diffusion"``)."""
    flow = "FlowMatch" in str(scheduler.get("_class_name", ""))
    diffusion: dict[str, Any] = {
        "type": bundle_type,
        "prediction_type": "flow" if flow else scheduler.get("prediction_type") or "epsilon",
        "image_size": int(image_size),
        "encoder_scale_factor": float(vae.get("scaling_factor") or 0.18215),
        "decoder_scale_factor": float(vae.get("scaling_factor") or 0.18215),
        "decoder_shift_factor": float(vae.get("shift_factor") or 0.0),
        "default_guidance_scale": float(default_guidance_scale),
        "default_steps": int(default_steps),
    }
    if not flow:
        diffusion["scheduler"] = {
            "training_steps": int(scheduler.get("num_train_timesteps", 1000)),
            "beta_start": float(scheduler.get("beta_start", 0.00085)),
            "beta_end": float(scheduler.get("beta_end", 0.012)),
            "beta_schedule": str(scheduler.get("beta_schedule", "scaled_linear")),
        }
    return {
        "metadata_version": METADATA_VERSION,
        "kind": "diffusion",
        "name": name,
        "assets": dict(assets),
        "diffusion": diffusion,
        "source": {"model_definition": "diffusers"},
        "compression": compression,
    }


def check_manifest(meta: Any, where: Path) -> dict[str, Any]:
    """``meta`` as the Swift loader needs it (raises ``ValueError`` naming the problem)."""

    def fail(problem: str) -> ValueError:
        return ValueError(f"{where / METADATA}: {problem}; export the pipeline again")

    if not isinstance(meta, dict):
        raise fail("not a JSON object")
    if meta.get("metadata_version") != METADATA_VERSION:
        raise fail(f"metadata_version must be '{METADATA_VERSION}'")
    if meta.get("kind") != "diffusion":
        raise fail(f"kind is {meta.get('kind')!r}, not 'diffusion'")
    if not isinstance(meta.get("name"), str):
        raise fail("name must be a string")
    assets = meta.get("assets")
    if not isinstance(assets, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in assets.items()
    ):
        raise fail("assets must map roles to asset names (strings)")
    unknown = sorted(set(assets) - set(ROLES))
    if unknown:
        raise fail(f"unknown asset role(s) {unknown} (roles: {', '.join(ROLES)})")
    for role in ("vae_decoder", "text_encoder"):
        if role not in assets:
            raise fail(f"no '{role}' asset")
    if "unet" not in assets and "transformer" not in assets:
        raise fail("no 'unet' or 'transformer' asset")
    for role, rel in assets.items():
        if Path(rel).name != rel or not (where / rel).is_dir():
            raise fail(f"the {role} asset '{rel}' is not a directory beside the manifest")
    diffusion = meta.get("diffusion")
    if not isinstance(diffusion, dict):
        raise fail("no 'diffusion' block")
    for key, kind in (("type", str), ("image_size", int), ("prediction_type", str)):
        if not isinstance(diffusion.get(key), kind) or isinstance(diffusion.get(key), bool):
            raise fail(f"diffusion.{key} must be a {kind.__name__}")
    return meta


def read_directory(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The checked manifest and :data:`COREAI_CONFIG` of a bundle directory."""
    loaded = []
    for name in (METADATA, COREAI_CONFIG):
        file = path / name
        if not file.is_file():
            raise FileNotFoundError(
                f"{path} is not a diffusion bundle written by coreai_torch (no {name}); export "
                "a diffusers pipeline directory with export=True"
            )
        try:
            loaded.append(json.loads(file.read_text()))
        except ValueError as error:
            raise ValueError(f"{file} is not JSON ({error}); export the pipeline again") from None
    meta, config = loaded
    check_manifest(meta, path)
    if config.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(
            f"{path} was written by a newer coreai-torch (format {config['format_version']}); "
            "upgrade coreai-torch"
        )
    return meta, config


def write_directory(out: Path, fill: Callable[[Path], None]) -> None:
    """Write a bundle atomically: ``fill(tmp)`` writes it into a temporary directory beside
    ``out``, which is renamed to ``out`` once complete (an existing empty ``out`` is replaced;
    a non-empty one is refused)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty directory; choose a new output")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        fill(tmp)
        check_manifest(json.loads((tmp / METADATA).read_text()), tmp)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
