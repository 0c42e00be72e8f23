"""Exporting a local diffusers pipeline directory: one Core AI program per component, streamed
from the components' safetensors checkpoints.

Each component (:mod:`coreai_torch.diffusers.components`) is built with its parameters on the
meta device and bound to its checkpoint (:class:`~coreai_torch.tensors.lazy.WeightSource`), traced
once per exported resolution (one entry point each, weights stored once: ``main`` for the first
resolution, ``main_<H>x<W>`` for the others), converted (``precision``), compressed
(``compress``: one configuration for the text encoders and the denoiser, or a
:class:`~coreai_torch.diffusers.mixed_bits.MixedBitPalettes` recipe for the denoiser) and saved;
a weight is read from its checkpoint only while the asset is written.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from coreai_torch.converter import TorchConverter
from coreai_torch.errors import CheckpointError, UnsupportedModelError
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.llm.export import compression_config, precision_policy
from coreai_torch.precision import Precision
from coreai_torch.tensors import lazy
from coreai_torch.tensors.lazy import WeightSource

from .components import (
    Component,
    Family,
    Shapes,
    component_io,
    family_of,
    supported_pipelines,
)

#: diffusers' sinusoidal time-step (and guidance) projection, kept in float32
TIME_PROJECTION = "Timesteps"

#: libraries a pipeline's component may come from
_LIBRARIES = ("diffusers", "transformers")


@dataclass
class PipelineSource:
    """A local diffusers pipeline directory, read from its ``model_index.json`` (no weights)."""

    path: Path
    pipeline_class: str
    family: Family
    #: source name (subfolder) -> (library, class name), for the modules that are present
    modules: dict[str, tuple[str, str]]
    #: source name -> its configuration (dict), for the modules that are present
    configs: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def vae_scale_factor(self) -> int:
        return 1 << (len(self.configs["vae"]["block_out_channels"]) - 1)

    def default_resolution(self) -> tuple[int, int]:
        size = self.configs[self.family.denoiser].get("sample_size")
        size = size or self.family.default_sample_size
        if isinstance(size, (list, tuple)):
            return size[0] * self.vae_scale_factor, size[1] * self.vae_scale_factor
        return size * self.vae_scale_factor, size * self.vae_scale_factor

    def components(self) -> list[Component]:
        """The family's components this pipeline has (optional ones only when present)."""
        chosen = []
        for component in self.family.components:
            if component.source in self.modules:
                chosen.append(component)
            elif not component.optional:
                raise UnsupportedModelError(
                    f"{self.path}: the {self.pipeline_class} has no '{component.source}' "
                    f"(model_index.json), which its {component.role} needs"
                )
        return chosen


def read_pipeline(path: str | Path) -> PipelineSource:
    """The pipeline of a local directory written by diffusers' ``save_pretrained``; an
    unsupported pipeline class raises :class:`UnsupportedModelError` naming the supported
    ones.  Null entries of ``model_index.json`` (a component left out, e.g. SD3 without its
    T5 encoder) are absent modules."""
    require_diffusers()
    root = Path(path)
    index = root / "model_index.json"
    if not root.is_dir():
        raise FileNotFoundError(
            f"{path}: no such local directory; export reads diffusers pipeline directories "
            "(written by save_pretrained) and never downloads models"
        )
    if not index.is_file():
        raise FileNotFoundError(
            f"{root}: not a diffusers pipeline directory (no model_index.json); save the "
            "pipeline with DiffusionPipeline.save_pretrained first"
        )
    try:
        meta = json.loads(index.read_text())
    except ValueError as error:
        raise ValueError(f"{index} is not JSON ({error})") from None
    pipeline_class = meta.get("_class_name", "?")
    family = family_of(pipeline_class)
    if family is None:
        raise UnsupportedModelError(
            f"{root}: the diffusers pipeline class '{pipeline_class}' is not supported by "
            f"coreai_torch.diffusers (supported: {', '.join(supported_pipelines())}); "
            "export its modules one by one with TorchConverter"
        )
    modules: dict[str, tuple[str, str]] = {}
    for name, value in meta.items():
        if name.startswith("_") or not isinstance(value, list) or len(value) != 2:
            continue
        if value[0] is None or value[1] is None:
            continue  # a component saved as None
        modules[name] = (value[0], value[1])
    source = PipelineSource(root, pipeline_class, family, modules)
    for name in {c.source for c in family.components} & set(modules):
        source.configs[name] = _read_config(root / name)
    return source


def _read_config(folder: Path) -> dict[str, Any]:
    file = folder / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{folder}: no config.json (is the pipeline directory complete?)")
    config: dict[str, Any] = json.loads(file.read_text())
    return config


# ------------------------------------------------------------------------- the modules -----


def module_class(library: str, class_name: str) -> type[Any]:
    """The class ``model_index.json`` names for a module."""
    if library not in _LIBRARIES:
        raise UnsupportedModelError(
            f"a pipeline module of library '{library}' ({class_name}) cannot be exported; "
            f"the supported libraries are {', '.join(_LIBRARIES)}"
        )
    found: type[Any] = getattr(importlib.import_module(library), class_name)
    return found


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a component folder: its index's shards, else its full-precision
    ``*.safetensors`` files (variants such as ``*.fp16.safetensors`` only when there is
    nothing else)."""
    for index in sorted(folder.glob("*.safetensors.index.json")):
        if ".fp16." in index.name:
            continue
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / shard for shard in shards]
    files = sorted(folder.glob("*.safetensors"))
    plain = [f for f in files if f.name.count(".") == 1]
    return plain or files


def weight_source(folder: Path) -> WeightSource:
    """One :class:`WeightSource` over a component's checkpoint files (sharded or not)."""
    files = checkpoint_files(folder)
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors checkpoint")
    source = WeightSource(files[0])
    for extra in files[1:]:
        more = WeightSource(extra)
        source.entries.update(more.entries)
        source.files.extend(more.files)
    return source


def load_module(source: PipelineSource, name: str, *, streamed: bool = True) -> nn.Module:
    """The pipeline's module ``name`` in float32: built with empty parameters bound to its
    checkpoint (read only while an asset is written), or loaded in memory with
    ``from_pretrained`` when its checkpoint's names are not the module's (old formats that
    diffusers renames while loading) or ``streamed`` is False."""
    library, class_name = source.modules[name]
    cls = module_class(library, class_name)
    folder = source.path / name
    if streamed and checkpoint_files(folder):
        with lazy.empty_parameters():
            if library == "diffusers":
                module = cls.from_config(cls.load_config(folder))
            else:
                config = cls.config_class.from_pretrained(folder, local_files_only=True)
                module = cls._from_config(config, dtype=torch.float32)
        try:
            return weight_source(folder).bind(module).eval()
        except CheckpointError:
            pass
    options: dict[str, Any] = {"torch_dtype": torch.float32}
    if library == "transformers":
        options["local_files_only"] = True
    loaded: nn.Module = cls.from_pretrained(folder, **options).eval()
    return loaded


# ------------------------------------------------------------------------------ export -----


@dataclass
class ExportedComponent:
    """What :func:`export_component` wrote."""

    component: Component
    asset: Path
    entrypoints: dict[str, tuple[int, int] | None]  # name -> resolution (None: any)
    precision: str
    compression: str | None
    seconds: float
    report: Any = None  # the compression report / mixed-bit choice


def entrypoint_names(resolutions: Sequence[tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """``main`` for the first resolution, ``main_<H>x<W>`` for the others."""
    names = {"main": resolutions[0]}
    for height, width in resolutions[1:]:
        names[f"main_{height}x{width}"] = (height, width)
    return names


def shapes_for(
    source: PipelineSource, resolution: tuple[int, int], extras: dict[str, Any]
) -> Shapes:
    height, width = resolution
    factor = source.vae_scale_factor
    return Shapes(height, width, height // factor, width // factor, source.configs, extras)


def export_component(
    source: PipelineSource,
    component: Component,
    module: nn.Module,
    resolutions: Sequence[tuple[int, int]],
    extras: dict[str, Any],
    out: Path,
    *,
    policy: Precision,
    compress: Any = None,
) -> ExportedComponent:
    """Trace, convert, compress and save one component to ``out/<asset>.aimodel``."""
    start = time.perf_counter()
    wrapper = component.wrap(module).eval()
    entrypoints: dict[str, tuple[int, int] | None] = (
        dict(entrypoint_names(resolutions)) if component.per_resolution else {"main": None}
    )
    inputs, outputs = component_io(component, source.configs)
    converter = TorchConverter(compute_precision=policy)
    calibration: tuple[torch.Tensor, ...] = ()
    with lazy.tracing(), torch.no_grad():
        for name, resolution in entrypoints.items():
            torch.manual_seed(getattr(compress, "seed", 0))
            args = component.example(shapes_for(source, resolution or resolutions[0], extras))
            calibration = calibration or args
            ep = export_decomposed(wrapper, args, strict=False)
            converter.add_exported_program(
                ep,
                input_names=list(inputs),
                output_names=list(outputs),
                entrypoint_name=name,
            )
    program = converter.to_coreai()
    report = None
    if compress is not None:
        apply = getattr(compress, "apply", None)
        report = apply(program, wrapper, calibration) if apply else program.compress(compress)
    program.optimize()
    asset = out / f"{component.asset}.aimodel"
    program.save_asset(asset)
    return ExportedComponent(
        component,
        asset,
        entrypoints,
        "fp16" if policy.is_half else "fp32",
        getattr(compress, "describe", lambda: None)() if compress is not None else None,
        time.perf_counter() - start,
        report,
    )


def component_precision(
    source: PipelineSource, component: Component, policy: Precision, module: nn.Module
) -> Any:
    """The precision ``component`` is converted in: the requested one, except a VAE whose
    configuration asks to be upcast (``force_upcast``: SDXL's VAE overflows in float16), and
    with the sinusoidal projections of the time step and guidance (diffusers' ``Timesteps``)
    in float32, as diffusers computes them: in 16 bits the sine of a time step near 1000 (or
    FLUX's guidance times 1000) has no significant digit left."""
    if not policy.is_half:
        return policy
    if component.source == "vae" and source.configs["vae"].get("force_upcast"):
        return precision_policy(None)
    if not any(type(m).__name__ == TIME_PROJECTION for m in module.modules()):
        return policy
    return dataclasses.replace(
        policy, keep_fp32_modules=(*policy.keep_fp32_modules, TIME_PROJECTION)
    )


def resolve_options(precision: Any, compress: Any) -> tuple[Precision, Any]:
    """The precision policy and the compression (a configuration, a name or a mixed-bit
    recipe) of ``precision=`` / ``compress=``; bad values raise ``ValueError`` /
    ``TypeError`` naming the argument."""
    try:
        policy = precision_policy(precision)
        if compress is None or hasattr(compress, "apply"):
            return policy, compress
        return policy, compression_config(compress)
    except (ValueError, TypeError) as error:  # the messages name llm.export's arguments
        message = str(error).replace("llm.export(", "the diffusers export (")
        raise type(error)(message) from None


def require_diffusers() -> None:
    """Raise ``ImportError`` naming the extra to install when diffusers is missing."""
    try:
        import diffusers  # noqa: F401
    except ImportError:
        raise ImportError(
            "coreai_torch.diffusers needs the diffusers package: pip install "
            '"coreai-torch-converter[diffusers]"'
        ) from None


# ----------------------------------------------------------------------------- pipelines ---

#: the subfolders copied from the source pipeline into a bundle besides the configurations
_COPIED = ("tokenizer", "tokenizer_2", "tokenizer_3", "scheduler")


def check_resolutions(
    source: PipelineSource,
    height: int | None,
    width: int | None,
    resolutions: Sequence[tuple[int, int]] | None,
) -> list[tuple[int, int]]:
    """The resolutions to export: ``resolutions``, else ``(height, width)``, else the
    pipeline's default; each a multiple of what the VAE and denoiser need."""
    if resolutions is not None and (height is not None or width is not None):
        raise ValueError("give either height= / width= or resolutions=[(h, w), ...], not both")
    if resolutions is None:
        default = source.default_resolution()
        resolutions = [(height or default[0], width or default[1])]
    chosen = []
    step = source.vae_scale_factor * source.family.packing
    step *= int(source.configs[source.family.denoiser].get("patch_size") or 1)
    step *= 2 ** (len(source.configs[source.family.denoiser].get("block_out_channels", [0])) - 1)
    for resolution in resolutions:
        if (
            not isinstance(resolution, (tuple, list))
            or len(resolution) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in resolution)
        ):
            raise TypeError(f"a resolution is a (height, width) pair of ints, got {resolution!r}")
        h, w = resolution
        if h <= 0 or w <= 0 or h % step or w % step:
            raise ValueError(
                f"resolution {h}x{w}: height and width must be positive multiples of {step} "
                f"for this {source.pipeline_class} (the VAE's and denoiser's downsampling)"
            )
        if (h, w) not in chosen:
            chosen.append((h, w))
    return chosen


def text_extras(source: PipelineSource, max_sequence_length: int) -> dict[str, Any]:
    """Sequence lengths and pooled sizes the components' example inputs need."""
    extras: dict[str, Any] = {"vae_scale_factor": source.vae_scale_factor}
    for name, tokenizer in (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2")):
        config = source.path / tokenizer / "tokenizer_config.json"
        if name in source.modules and config.is_file():
            # the tokenizer pads to its model_max_length, at most the encoder's positions
            length = json.loads(config.read_text()).get("model_max_length") or 77
            positions = source.configs[name].get("max_position_embeddings") or length
            extras[f"{name}_length"] = int(min(length, positions))
    family = source.family
    extras[f"{family.padded_source}_length"] = max_sequence_length
    clip = extras.get("text_encoder_length", 77)
    extras["text_length"] = {
        "clip": clip,
        "clip+t5": clip + max_sequence_length,
        "padded": max_sequence_length,
    }[family.text_tokens]
    if family.text_tokens != "clip":
        extras["max_sequence_length"] = max_sequence_length
    if "text_encoder_2" in source.configs and family.padded_source != "text_encoder_2":
        extras["pooled_dim"] = source.configs["text_encoder_2"].get("projection_dim")
    unet = source.configs.get("unet", {})
    if unet.get("addition_embed_type") == "text_time":
        extras["add_embedding_in_features"] = unet["projection_class_embeddings_input_dim"]
    return extras


def export_pipeline(
    path: str | Path,
    out: str | Path,
    *,
    precision: Any = None,
    compress: Any = None,
    height: int | None = None,
    width: int | None = None,
    resolutions: Sequence[tuple[int, int]] | None = None,
    max_sequence_length: int | None = None,
    name: str | None = None,
) -> dict[str, Any]:
    """Export the diffusers pipeline in the local directory ``path`` to the diffusion bundle
    ``out`` (a new directory); returns the :data:`~coreai_torch.diffusers.bundle.COREAI_CONFIG`
    written, with the time each component took.

    ``precision``: None (float32) or ``"fp16"`` (``torch.float16``, a
    :class:`~coreai_torch.precision.Precision`); ``compress``: a
    :mod:`coreai_torch.compression` configuration or name (``"int4"``, ``"palette4"``, ...)
    applied to the text encoders and the denoiser, or a
    :class:`~coreai_torch.diffusers.mixed_bits.MixedBitPalettes` recipe (per-layer bits of the
    denoiser chosen by output PSNR); the VAE is never compressed.  ``height`` / ``width`` (or
    ``resolutions``, a list of pairs) fix the image sizes the denoiser and VAE take (default:
    the denoiser's ``sample_size``).  ``max_sequence_length``: the T5 tokens of SD3 (default
    256) and FLUX (default 512), as diffusers' defaults."""
    from .bundle import COREAI_CONFIG, FORMAT_VERSION, manifest, write_directory, write_json

    source = read_pipeline(path)
    policy, compression = resolve_options(precision, compress)
    chosen = check_resolutions(source, height, width, resolutions)
    extras = text_extras(source, max_sequence_length or source.family.max_sequence_length)
    target = Path(out)

    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise FileExistsError(f"{target} exists and is not an empty directory; choose a new output")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".export", dir=target.parent))
    try:
        components: dict[str, Any] = {}
        for component in source.components():
            module = load_module(source, component.source)
            done = export_component(
                source,
                component,
                module,
                chosen,
                extras,
                staging,
                policy=component_precision(source, component, policy, module),
                compress=compression if compresses(compression, component) else None,
            )
            del module
            inputs, outputs = component_io(component, source.configs)
            denoiser = component.source in (source.family.denoiser, "controlnet")
            components[component.role] = {
                "asset": done.asset.name,
                "source": component.source,
                "class": source.modules[component.source][1],
                "inputs": list(inputs),
                "outputs": list(outputs),
                "entrypoints": {k: list(v) if v else None for k, v in done.entrypoints.items()},
                "precision": done.precision,
                **({"layers": list(component.layers)} if component.layers else {}),
                **({"batch": source.family.denoiser_batch} if denoiser else {}),
                "compression": done.compression,
                "seconds": round(done.seconds, 3),
                **({"mixed_bits": done.report} if isinstance(done.report, dict) else {}),
            }
        description = compression_name(compression)
        config: dict[str, Any] = {
            "format_version": FORMAT_VERSION,
            "task": "text-to-image",
            "class": "CoreAIDiffusionPipeline",
            "pipeline_class": source.pipeline_class,
            "type": source.family.bundle_type,
            "precision": "fp16" if policy.is_half else "fp32",
            "compression": description,
            "resolutions": [list(r) for r in chosen],
            "extras": extras,
            "components": components,
        }
        write_json(staging / COREAI_CONFIG, config)
        sources = {c["source"] for c in components.values()}
        files = {COREAI_CONFIG: staging / COREAI_CONFIG}
        files |= {f"{s}/config.json": source.path / s / "config.json" for s in sources}
        for folder in _COPIED:
            encoder = folder.replace("tokenizer", "text_encoder")
            if (source.path / folder).is_dir() and (folder == "scheduler" or encoder in sources):
                files[folder] = source.path / folder
        files["model_index.json"] = source.path / "model_index.json"
        files |= vae_statistics(source, staging)
        scheduler = json.loads((source.path / "scheduler" / "scheduler_config.json").read_text())
        write_directory(
            target,
            manifest(
                name or source.path.resolve().name,
                source.family.bundle_type,
                {role: c["asset"] for role, c in components.items()},
                scheduler=scheduler,
                vae=source.configs["vae"],
                denoiser=source.configs[source.family.denoiser],
                image_size=chosen[0][0],
                default_steps=source.family.default_steps,
                default_guidance_scale=source.family.default_guidance_scale,
                compression=description,
            ),
            {role: staging / c["asset"] for role, c in components.items()},
            files,
        )
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return config


#: the batch-norm statistics of FLUX.2's VAE that its pipelines read on the host, as the
#: Swift pipeline reads them (``Flux2Pipeline+Resources.swift``)
VAE_STATISTICS = {"vae_bn_mean.npy": "bn.running_mean", "vae_bn_var.npy": "bn.running_var"}


def vae_statistics(source: PipelineSource, out: Path) -> dict[str, Path]:
    """``vae_bn_mean.npy`` / ``vae_bn_var.npy`` (float32) written to ``out`` from a VAE
    checkpoint with a latent batch norm (``AutoencoderKLFlux2``); none for other VAEs."""
    import numpy as np

    if "batch_norm_eps" not in source.configs.get("vae", {}):
        return {}
    folder = source.path / "vae"
    stored = weight_source(folder).entries
    missing = [name for name in VAE_STATISTICS.values() if name not in stored]
    if missing:
        raise CheckpointError(
            f"{folder}: the VAE has a latent batch norm (batch_norm_eps) but its checkpoint "
            f"lacks {', '.join(missing)}"
        )
    found: dict[str, Path] = {}
    for file_name, tensor in VAE_STATISTICS.items():
        np.save(out / file_name, stored[tensor].evaluate().float().numpy())
        found[file_name] = out / file_name
    return found


def compresses(compression: Any, component: Component) -> bool:
    """Whether ``compression`` applies to ``component`` (never the VAE; a mixed-bit recipe
    to the denoiser only)."""
    if compression is None or not component.compressible:
        return False
    applies_to = getattr(compression, "applies_to", None)
    return applies_to is None or applies_to(component.role)


def compression_name(compression: Any) -> str | None:
    """A short description of ``compress=`` for the manifest."""
    if compression is None:
        return None
    describe = getattr(compression, "describe", None)
    return describe() if describe else str(compression)
