"""``CoreAIDiffusionPipeline``: a diffusers pipeline whose text encoders, denoiser and VAE run
as Core AI programs, with diffusers' interface and diffusers' own code on the host.

The pipeline object diffusers would build (``StableDiffusionPipeline``,
``StableDiffusionXLPipeline``, ``StableDiffusion3Pipeline``, and their image-to-image
variants) is built with runtime-backed modules (:mod:`coreai_torch.diffusers.modules`) in
place of the torch ones, so tokenization, the initial noise (the ``generator``), the scheduler
(any compatible diffusers scheduler, swapped as with diffusers), classifier-free guidance and
the image post-processing are diffusers' own.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import tempfile
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .bundle import read_directory
from .components import GUIDANCE_BATCH, family_of
from .export import require_diffusers
from .modules import (
    RuntimeDenoiser,
    RuntimeFluxTransformer,
    RuntimeModule,
    RuntimeSD3Transformer,
    RuntimeTextEncoder,
    RuntimeUNet,
    RuntimeVAE,
    runtime_controlnet,
)

#: optional pipeline arguments given as None / False when the pipeline is built
_LEFT_OUT = {
    "safety_checker",
    "feature_extractor",
    "image_encoder",
    "text_encoder_3",
    "tokenizer_3",
}


class CoreAIDiffusionPipeline:
    """Text-to-image (and image-to-image) on Core AI programs, called like diffusers.

    ``CoreAIDiffusionPipeline.from_pretrained(pipeline_dir, export=True, precision="fp16",
    height=512, width=512)`` exports a local diffusers pipeline directory;
    ``save_pretrained(out)`` writes the diffusion bundle, which ``from_pretrained(out)`` loads
    back.  ``pipe(prompt, ...)`` takes diffusers' arguments and returns what diffusers
    returns (``.images``); ``pipe(prompt, image=init_image, strength=0.6)`` runs the
    image-to-image pipeline on the exported VAE encoder.  ``pipe.scheduler`` can be replaced by
    any scheduler compatible with the pipeline's own.
    """

    def __init__(
        self,
        directory: Path,
        *,
        owned: tempfile.TemporaryDirectory[str] | None = None,
        verify_hash: bool = True,
    ) -> None:
        require_diffusers()
        self.directory = Path(directory)
        self.manifest, self.coreai_config = read_directory(self.directory)
        family = family_of(self.coreai_config["pipeline_class"])
        if family is None:
            raise ValueError(
                f"{directory}: unknown pipeline class {self.coreai_config['pipeline_class']!r}; "
                "upgrade coreai-torch"
            )
        self.family = family
        self._owned = owned
        self.modules = self._runtime_modules(verify_hash)
        self.pipe = self._build(self.coreai_config["pipeline_class"])
        self._image_to_image: Any = None
        scheduler = self.pipe.scheduler
        self._compatible = {type(scheduler).__name__, *(c.__name__ for c in scheduler.compatibles)}
        self._finalizer = weakref.finalize(self, _close, list(self.modules.values()), owned)

    # -- loading and saving -------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        pipeline_dir: str | Path,
        export: bool | None = None,
        *,
        precision: Any = None,
        compress: Any = None,
        height: int | None = None,
        width: int | None = None,
        resolutions: list[tuple[int, int]] | None = None,
        max_sequence_length: int | None = None,
        verify_hash: bool = True,
    ) -> CoreAIDiffusionPipeline:
        """Load a bundle written by :meth:`save_pretrained`, or, with ``export=True`` (the
        default for a diffusers directory), export the diffusers pipeline in ``pipeline_dir``
        (:func:`~coreai_torch.diffusers.export.export_pipeline`: ``precision``, ``compress``,
        ``height`` / ``width`` or ``resolutions``, ``max_sequence_length``).  Local
        directories only; nothing is downloaded."""
        from .bundle import COREAI_CONFIG
        from .export import export_pipeline

        path = Path(pipeline_dir)
        if not path.is_dir():
            raise FileNotFoundError(
                f"{pipeline_dir}: no such local directory; CoreAIDiffusionPipeline reads local "
                "directories only and never downloads models"
            )
        exported = (path / COREAI_CONFIG).is_file()
        if export is None:
            export = not exported
        options = dict(
            precision=precision,
            compress=compress,
            height=height,
            width=width,
            resolutions=resolutions,
            max_sequence_length=max_sequence_length,
        )
        if not export:
            given = [k for k, v in options.items() if v is not None]
            if given:
                raise ValueError(
                    f"{path} is already exported; {', '.join(given)} apply only when exporting "
                    "(export=True on the diffusers pipeline directory)"
                )
            return cls(path, verify_hash=verify_hash)
        if exported:
            raise ValueError(
                f"{path} is already a Core AI diffusion bundle ({COREAI_CONFIG}); load it "
                "without export=True, or export the original diffusers pipeline directory"
            )
        owned = tempfile.TemporaryDirectory(prefix="coreai_torch_diffusion_")
        try:
            export_pipeline(path, Path(owned.name) / "bundle", name=path.resolve().name, **options)
            return cls(Path(owned.name) / "bundle", owned=owned)
        except BaseException:
            owned.cleanup()
            raise

    def save_pretrained(self, save_directory: str | Path) -> None:
        """Write the diffusion bundle (assets, ``metadata.json``, tokenizers, scheduler,
        configurations) to ``save_directory``, a new or empty directory."""
        from .bundle import bundle_files, write_directory

        out = Path(save_directory)
        if out.exists() and out.resolve() == self.directory.resolve():
            return
        files = bundle_files(self.directory, self.manifest)
        with tempfile.TemporaryDirectory(prefix="coreai_torch_scheduler_") as scratch:
            scheduler = self.scheduler  # the one in use (it may have been swapped)
            scheduler.save_config(Path(scratch) / "scheduler")
            index = json.loads((self.directory / "model_index.json").read_text())
            index["scheduler"] = ["diffusers", type(scheduler).__name__]
            (Path(scratch) / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
            files["scheduler"] = Path(scratch) / "scheduler"
            files["model_index.json"] = Path(scratch) / "model_index.json"
            assets = {role: self.directory / rel for role, rel in self.manifest.assets.items()}
            write_directory(out, self.manifest, assets, files)

    def close(self) -> None:
        """Release the runtime (also done when the pipeline is garbage collected)."""
        self._finalizer()

    def __enter__(self) -> CoreAIDiffusionPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- running ------------------------------------------------------------------------------

    @property
    def scheduler(self) -> Any:
        """The diffusers scheduler the pipeline steps with (replace it like diffusers':
        ``pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config)``)."""
        return self.pipe.scheduler

    @scheduler.setter
    def scheduler(self, scheduler: Any) -> None:
        self.pipe.scheduler = scheduler
        if self._image_to_image is not None:
            self._image_to_image.scheduler = scheduler

    @property
    def resolutions(self) -> list[tuple[int, int]]:
        """The (height, width) sizes the programs were exported for."""
        return [(int(h), int(w)) for h, w in self.coreai_config["resolutions"]]

    def __call__(
        self, prompt: Any = None, negative_prompt: Any = None, *, image: Any = None, **kwargs: Any
    ) -> Any:
        """diffusers' ``__call__`` (``prompt``, ``negative_prompt``, ``num_inference_steps``,
        ``guidance_scale``, ``generator``, ``height``, ``width``, ``output_type``, ...); with
        ``image=`` the image-to-image pipeline (``strength``).  A ControlNet pipeline takes its
        control image as ``image=`` (as diffusers' does), and runs image-to-image with
        ``image=`` and ``control_image=``."""
        self._check_scheduler()
        height, width = kwargs.pop("height", None), kwargs.pop("width", None)
        # ControlNet pipelines take their control image as image=; image-to-image is then
        # image= (the initial image) with control_image=
        takes_image = "image" in inspect.signature(type(self.pipe).__call__).parameters
        to_image = image is not None and (not takes_image or "control_image" in kwargs)
        if image is not None and not self.family.image_to_image:
            raise ValueError(
                f"{self.coreai_config['pipeline_class']} takes image= as reference images, "
                "which add tokens the exported transformer does not take; call it without image="
            )
        pipe = self.image_to_image if to_image else self.pipe
        # image-to-image pipelines with a size (SD3, FLUX, ControlNet) resize the image to it
        if "height" in inspect.signature(type(pipe).__call__).parameters:
            default = self.resolutions[0]
            height, width = height or default[0], width or default[1]
            if (height, width) not in self.resolutions:
                shown = ", ".join(f"{h}x{w}" for h, w in self.resolutions)
                raise ValueError(
                    f"height={height}, width={width} was not exported (this pipeline's "
                    f"programs take {shown}); call it with one of those sizes, or export the "
                    f"diffusers pipeline again with height={height}, width={width} (or "
                    "resolutions=[...])"
                )
            kwargs.update(height=height, width=width)
        if self.family.denoiser == "transformer":
            length = self.coreai_config["extras"]["max_sequence_length"]
            given = kwargs.setdefault("max_sequence_length", length)
            if given != length:
                raise ValueError(
                    f"max_sequence_length={given}: the transformer was exported for "
                    f"{length} T5 tokens; call with max_sequence_length={length} or export "
                    f"again with max_sequence_length={given}"
                )
        if image is not None:
            kwargs["image"] = image
        if negative_prompt is not None:
            kwargs["negative_prompt"] = negative_prompt
        return pipe(prompt=prompt, **kwargs)

    @property
    def image_to_image(self) -> Any:
        """diffusers' image-to-image pipeline on the same programs."""
        if "vae_encoder" not in self.coreai_config["components"]:
            raise ValueError(
                "this pipeline was exported without its VAE encoder, which image-to-image needs"
            )
        if self._image_to_image is None:
            self._image_to_image = self._build(self.family.image_to_image)
            self._image_to_image.scheduler = self.pipe.scheduler
        return self._image_to_image

    def __getattr__(self, name: str) -> Any:
        if name in ("pipe", "modules", "coreai_config", "manifest", "family", "_finalizer"):
            raise AttributeError(name)
        return getattr(self.pipe, name)

    def __repr__(self) -> str:
        roles = ", ".join(
            f"{role}={c['asset']}" for role, c in self.coreai_config["components"].items()
        )
        return (
            f"CoreAIDiffusionPipeline({self.coreai_config['pipeline_class']}, {roles}, "
            f"precision={self.coreai_config['precision']!r}, "
            f"compression={self.coreai_config['compression']!r}, "
            f"resolutions={self.resolutions})"
        )

    # -- building -----------------------------------------------------------------------------

    def _check_scheduler(self) -> None:
        name = type(self.pipe.scheduler).__name__
        if name not in self._compatible:
            raise ValueError(
                f"{name} gives time steps this pipeline's denoiser cannot take (it was trained "
                f"with the schedules of {self.coreai_config['pipeline_class']}); use one of "
                f"{', '.join(sorted(self._compatible))}, e.g. pipe.scheduler = "
                f"{sorted(self._compatible)[0]}.from_config(pipe.scheduler.config)"
            )

    def _runtime_modules(self, verify_hash: bool) -> dict[str, RuntimeModule]:
        components = self.coreai_config["components"]
        extras = self.coreai_config["extras"]
        modules: dict[str, RuntimeModule] = {}

        def config(source: str) -> dict[str, Any]:
            read: dict[str, Any] = json.loads((self.directory / source / "config.json").read_text())
            return read

        def entrypoints(role: str) -> dict[str, tuple[int, int] | None]:
            return {k: tuple(v) if v else None for k, v in components[role]["entrypoints"].items()}

        for role, component in components.items():
            asset = self.directory / component["asset"]
            source = component["source"]
            if role.startswith("text_encoder"):
                modules[source] = RuntimeTextEncoder(
                    asset,
                    config(source),
                    entrypoints(role),
                    outputs=tuple(component["outputs"]),
                    projection="Projection" in component["class"],
                    layers=tuple(component.get("layers", ())),
                    masked="attention_mask" in component["inputs"],
                    verify_hash=verify_hash,
                )
            elif role == "controlnet":
                modules[source] = runtime_controlnet(
                    RuntimeModule(
                        asset, config(source), entrypoints(role), verify_hash=verify_hash
                    ),
                    extras,
                    GUIDANCE_BATCH,
                    tuple(component["outputs"]),
                )
            elif role in ("unet", "transformer"):
                runtime: type[RuntimeDenoiser] = RuntimeSD3Transformer
                options: dict[str, Any] = {}
                if role == "unet":
                    runtime, options = RuntimeUNet, {"residuals": tuple(component["inputs"][3:])}
                elif component["class"] in ("FluxTransformer2DModel", "Flux2Transformer2DModel"):
                    runtime = RuntimeFluxTransformer
                    options = {"inputs": tuple(component["inputs"])}
                modules[source] = runtime(
                    asset,
                    self._denoiser_config(config(source)),
                    entrypoints(role),
                    extra=extras,
                    batch=component.get("batch", GUIDANCE_BATCH),
                    verify_hash=verify_hash,
                    **options,
                )
        encoder = components.get("vae_encoder")
        modules["vae"] = RuntimeVAE(
            self.directory / components["vae_decoder"]["asset"],
            config("vae"),
            entrypoints("vae_decoder"),
            encoder=self.directory / encoder["asset"] if encoder else None,
            statistics=self._vae_statistics(),
            verify_hash=verify_hash,
        )
        return modules

    def _vae_statistics(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """FLUX.2's VAE batch-norm mean and variance, from the bundle's ``.npy`` files."""
        from .export import VAE_STATISTICS

        files = [self.directory / name for name in VAE_STATISTICS]
        if not all(file.is_file() for file in files):
            return None
        mean, var = (torch.from_numpy(np.load(file)) for file in files)
        return mean, var

    def _denoiser_config(self, config: dict[str, Any]) -> dict[str, Any]:
        """The denoiser's configuration with ``sample_size`` the first exported resolution's
        latent height (diffusers' default image size)."""
        vae = json.loads((self.directory / "vae" / "config.json").read_text())
        factor = 2 ** (len(vae["block_out_channels"]) - 1)
        return {**config, "sample_size": self.resolutions[0][0] // factor}

    def _build(self, class_name: str) -> Any:
        import diffusers

        cls = getattr(diffusers, class_name)
        index = json.loads((self.directory / "model_index.json").read_text())
        arguments: dict[str, Any] = {}
        for name, parameter in inspect.signature(cls.__init__).parameters.items():
            if name == "self" or parameter.kind in (
                parameter.VAR_KEYWORD,
                parameter.VAR_POSITIONAL,
            ):
                continue
            if name in self.modules:
                arguments[name] = self.modules[name]
            elif name.startswith("tokenizer") and (self.directory / name).is_dir():
                library, tokenizer_class = index[name]
                loader = getattr(importlib.import_module(library), tokenizer_class)
                arguments[name] = loader.from_pretrained(self.directory / name)
            elif name == "scheduler":
                if self.__dict__.get("pipe") is not None:
                    arguments[name] = self.pipe.scheduler
                else:
                    library, scheduler_class = index[name]
                    loader = getattr(importlib.import_module(library), scheduler_class)
                    arguments[name] = loader.from_pretrained(self.directory / name)
            elif name == "requires_safety_checker":
                arguments[name] = False
            elif name in index and not isinstance(index[name], list):
                arguments[name] = index[name]  # a registered setting (FLUX.2's is_distilled)
            elif name in _LEFT_OUT or parameter.default is None:
                arguments[name] = None
        pipe = cls(**arguments)
        pipe.set_progress_bar_config(disable=True)
        return pipe


def _close(modules: list[RuntimeModule], owned: tempfile.TemporaryDirectory[str] | None) -> None:
    for module in modules:
        with contextlib.suppress(Exception):  # closing at garbage collection must not raise
            module.close()
    if owned is not None:
        owned.cleanup()
