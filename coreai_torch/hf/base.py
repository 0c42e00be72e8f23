"""What every ``CoreAIModelFor…`` class shares: loading (exporting or not), saving, the
runtime sessions and their states, and the Hugging Face model surface (``config``,
``generation_config``, ``device``, ``dtype``) that ``generate`` and pipelines read.

A saved model directory holds, beside the Hugging Face files (``config.json``,
``generation_config.json``, the tokenizer / processor files)::

    coreai_config.json      task, class, assets, max_context, precision, compression, ...
    model.aimodel/          the Core AI program(s): one asset per name in ``assets``
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import os
import re
import shutil
import tempfile
import threading
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Self

import numpy as np
import torch
import torch.nn as nn
from transformers import (
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    StoppingCriteria,
    StoppingCriteriaList,
)

from coreai_torch.bundles import is_bundle_dir
from coreai_torch.errors import CheckpointError, UnsupportedModelError
from coreai_torch.hf.tasks import BUNDLE_TASKS, CLASSES, register_pipeline_names
from coreai_torch.ir.assets import check_asset
from coreai_torch.tensors import lazy
from coreai_torch.tensors.lazy import WeightSource

register_pipeline_names()

#: File that marks a directory written by ``save_pretrained`` of a ``CoreAIModelFor…`` class.
COREAI_CONFIG = "coreai_config.json"
#: Version of :data:`COREAI_CONFIG`'s layout (2: a causal LM is saved as a bundle).
FORMAT_VERSION = 2

#: Files copied from the source model directory to an exported one: the tokenizer, feature
#: extractor, image processor and processor files (never weights).
PREPROCESSING_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "normalizer.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "preprocessor_config.json",
    "processor_config.json",
    "image_processor_config.json",
    "video_preprocessor_config.json",
    "chat_template.json",
    "chat_template.jinja",
)


class CoreAIModel(PreTrainedModel):
    """Base of the ``CoreAIModelFor…`` classes: Core AI programs run on the Core AI runtime
    behind a Hugging Face model's interface.  ``CoreAIModel.from_pretrained(out_dir)`` loads a
    saved directory as the class it was saved from; export with the subclasses."""

    #: the ``transformers.pipeline`` task and the ``coreai-torch export --task`` name
    task: ClassVar[str] = ""
    config_class = PretrainedConfig
    base_model_prefix = "coreai"
    main_input_name = "input_ids"
    _supports_sdpa = True

    def __init__(
        self,
        config: PretrainedConfig,
        assets: Mapping[str, Path],
        coreai_config: dict[str, Any],
        *,
        generation_config: GenerationConfig | None = None,
        source_dir: Path | None = None,
        owned_dir: tempfile.TemporaryDirectory | None = None,
        verify_hash: bool = True,
    ) -> None:
        super().__init__(config)
        #: what :meth:`save_pretrained` writes to ``coreai_config.json``
        self.coreai_config = dict(coreai_config)
        #: entry point name -> the ``.aimodel`` directory it is read from
        self.assets = {name: Path(path) for name, path in assets.items()}
        self._source_dir = source_dir
        self._owned_dir = owned_dir  # the assets of a fresh export, until saved elsewhere
        if generation_config is not None:
            self.generation_config = generation_config
        self.sessions = _open_sessions(self.assets, verify_hash)
        self._finalizer = weakref.finalize(self, _close_sessions, self.sessions, owned_dir)

    # -- the Hugging Face model surface -------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """Tensors in and out live on the CPU (the runtime holds its own buffers)."""
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def to(self, *args: Any, **kwargs: Any) -> CoreAIModel:
        """A no-op for the CPU (pipelines call it); other devices raise."""
        for value in (*args, *kwargs.values()):
            moved = isinstance(value, (str, torch.device, int)) and not isinstance(value, bool)
            if moved and _device_type(value) != "cpu":
                raise ValueError(
                    f"{type(self).__name__} runs on the Core AI runtime; it cannot be moved to "
                    f"{value!r}"
                )
        return self

    def eval(self) -> CoreAIModel:
        return self

    @property
    def max_context(self) -> int | None:
        """Positions the KV cache holds (None for models without one)."""
        return self.coreai_config.get("max_context")

    def close(self) -> None:
        """Release the runtime (also done when the model is garbage collected)."""
        self._finalizer()

    def __enter__(self) -> CoreAIModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        assets = ", ".join(f"{k}={v.name}" for k, v in self.assets.items())
        return (
            f"{type(self).__name__}(model_type={self.config.model_type!r}, {assets}, "
            f"precision={self.coreai_config.get('precision')!r}, "
            f"compression={self.coreai_config.get('compression')!r})"
        )

    # -- async code ---------------------------------------------------------------------------

    async def acall(self, *args: Any, **kwargs: Any) -> Any:
        """``model(*args, **kwargs)``, awaited: it runs in a worker thread, so the caller's
        event loop keeps running.  Calls from several tasks or threads run side by side (each
        call has its own runtime state)."""
        return await asyncio.to_thread(self, *args, **kwargs)

    async def agenerate(self, *args: Any, **kwargs: Any) -> Any:
        """``generate(*args, **kwargs)``, awaited (it runs in a worker thread; pass
        ``streamer=transformers.AsyncTextIteratorStreamer(...)`` to receive the text as it is
        produced).  Cancelling the awaiting task stops the generation after the step in flight
        and frees its cache before ``CancelledError`` is raised."""
        if not self.can_generate():
            raise TypeError(f"{type(self).__name__} does not generate; use `await model.acall()`")
        stop = threading.Event()
        criteria = list(kwargs.pop("stopping_criteria", None) or [])
        kwargs["stopping_criteria"] = StoppingCriteriaList([*criteria, _Cancelled(stop)])
        work = asyncio.ensure_future(asyncio.to_thread(self.generate, *args, **kwargs))
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            stop.set()
            await asyncio.wait({work})
            raise

    # -- loading and saving -------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | os.PathLike[str] | nn.Module,
        export: bool | None = None,
        *,
        max_context: int | None = None,
        precision: Any = None,
        compress: Any = None,
        verify_hash: bool = True,
        **options: Any,
    ) -> CoreAIModel:
        """Load a directory written by :meth:`save_pretrained`, or, with ``export=True``, export
        a Hugging Face model directory (written by ``transformers``' ``save_pretrained``; a
        model instance is accepted too) with the converter.

        The assets of a saved directory are checked before the runtime reads them (files
        complete, bytecode matching ``main.hash``; ``verify_hash=False`` skips the hash, see
        :class:`coreai_torch.runtime.Session`).

        ``max_context``: positions of the KV cache (models with one; default the model's own
        limit, at most 2048); ``precision``: ``"fp16"`` / ``"bf16"`` / a torch dtype / a
        :class:`~coreai_torch.precision.Precision` (default: the model's float32);
        ``compress``: ``"int4"``, ``"int8"``, ``"palette4"``, ... or a
        :mod:`coreai_torch.compression` configuration.  Directories are local only: nothing is
        ever downloaded.
        """
        if isinstance(model_dir, nn.Module):
            if export is False:
                raise ValueError(
                    f"{cls.__name__}.from_pretrained got a torch model with export=False; a model "
                    "instance can only be exported (export=True)"
                )
            return cls._export_model(
                model_dir,
                max_context=max_context,
                precision=precision,
                compress=compress,
                **options,
            )
        path = local_dir(model_dir, cls.__name__)
        exported = (path / COREAI_CONFIG).is_file() or is_bundle_dir(path)
        if export is None:
            export = not exported
        if not export:
            if not exported:
                raise FileNotFoundError(
                    f"{path} is not a Core AI model directory (no {COREAI_CONFIG}); pass "
                    f"export=True to export the Hugging Face model in it"
                )
            given = {
                k: v
                for k, v in dict(
                    max_context=max_context, precision=precision, compress=compress, **options
                ).items()
                if v is not None
            }
            if given:
                raise ValueError(
                    f"{path} is already exported; {', '.join(given)} apply only when exporting "
                    "(export=True on the Hugging Face model directory)"
                )
            return cls._load(path, verify_hash=verify_hash)
        if exported:
            raise ValueError(
                f"{path} is already a Core AI model directory ({COREAI_CONFIG}); load it without "
                "export=True, or export the original Hugging Face model directory"
            )
        return cls._export_model(
            path, max_context=max_context, precision=precision, compress=compress, **options
        )

    @classmethod
    def _load(cls, path: Path, *, verify_hash: bool = True) -> CoreAIModel:
        if is_bundle_dir(path):  # a language (or vision-language) model's bundle
            from coreai_torch.bundles.manifest import Manifest

            kind = Manifest.read(path / "metadata.json").kind
            loader = class_for_task(BUNDLE_TASKS.get(kind, "text-generation"))
            if not issubclass(loader, cls):
                raise ValueError(
                    f"{path} is a bundle (metadata.json) of a {kind} model; load it with "
                    f"{loader.__name__} (this is {cls.__name__}, task '{cls.task}')"
                )
            return loader._load(path, verify_hash=verify_hash)
        meta = read_coreai_config(path)
        if cls is CoreAIModel and meta.get("task") in CLASSES:  # the class the directory names
            return class_for_task(meta["task"])._load(path, verify_hash=verify_hash)
        if meta.get("task") != cls.task:
            raise ValueError(
                f"{path} holds a {meta.get('class', '?')} (task '{meta.get('task')}'); load it "
                f"with that class (this is {cls.__name__}, task '{cls.task}')"
            )
        if meta.get("format_version", 0) > FORMAT_VERSION:
            raise ValueError(
                f"{path} was written by a newer coreai-torch (format {meta['format_version']}, "
                f"this one reads up to {FORMAT_VERSION}); upgrade coreai-torch"
            )
        assets = {name: path / rel for name, rel in meta["assets"].items()}
        for asset in assets.values():
            check_asset(asset, verify_hash=False)  # cheap checks first; the hash at loading
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path, local_files_only=True)
        generation = load_generation_config(path, config) if cls.can_generate() else None
        return cls(
            config,
            assets,
            meta,
            generation_config=generation,
            source_dir=path,
            verify_hash=verify_hash,
        )

    def save_pretrained(self, save_directory: str | os.PathLike[str], **_: Any) -> None:
        """Write the asset(s), ``config.json``, ``generation_config.json``, the tokenizer /
        processor files of the source directory and ``coreai_config.json`` to
        ``save_directory``; :meth:`from_pretrained` loads it back without exporting."""
        out = Path(save_directory)
        if out.exists() and not out.is_dir():
            raise NotADirectoryError(f"{out} exists and is not a directory")
        out.mkdir(parents=True, exist_ok=True)
        meta = dict(self.coreai_config)
        meta["assets"] = {}
        for name, asset in self.assets.items():
            target = out / f"{name}.aimodel"
            if target.resolve() != asset.resolve():
                if target.exists():
                    shutil.rmtree(target)
                shutil.copytree(asset, target)
            meta["assets"][name] = target.name
        self.config.save_pretrained(out)
        if self.generation_config is not None:
            self.generation_config.save_pretrained(out)
        if self._source_dir is not None and self._source_dir.resolve() != out.resolve():
            for name in PREPROCESSING_FILES:
                if (self._source_dir / name).is_file():
                    shutil.copy2(self._source_dir / name, out / name)
        (out / COREAI_CONFIG).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")

    @classmethod
    def _export_model(
        cls,
        source: PreTrainedModel | Path,
        *,
        max_context: int | None,
        precision: Any,
        compress: Any,
    ) -> Self:
        """Export ``source`` (a model instance, or the local directory of one) and return the
        loaded result.  Subclasses add the keyword options of their task."""
        raise NotImplementedError

    @classmethod
    def _from_programs(
        cls,
        model: PreTrainedModel,
        programs: Mapping[str, Any],
        meta: dict[str, Any],
        source: PreTrainedModel | Path,
    ) -> Self:
        """The runtime model of freshly exported ``programs`` (saved to a temporary directory
        until :meth:`save_pretrained` copies them); ``source`` is what they were exported from
        (a directory's tokenizer and processor files are saved with them)."""
        source_dir = source if isinstance(source, Path) else None
        owned = tempfile.TemporaryDirectory(prefix="coreai_torch_hf_")
        assets = {}
        for name, program in programs.items():
            assets[name] = Path(owned.name) / f"{name}.aimodel"
            program.save_asset(assets[name])
        meta = {
            "format_version": FORMAT_VERSION,
            "task": cls.task,
            "class": cls.__name__,
            "model_type": model.config.model_type,
            "assets": {name: f"{name}.aimodel" for name in programs},
            **meta,
        }
        config = copy.deepcopy(model.config)
        generation = None
        if cls.can_generate():
            generation = (
                load_generation_config(source_dir, config)
                if source_dir is not None
                else copy.deepcopy(getattr(model, "generation_config", None))
            ) or GenerationConfig.from_model_config(config)
        return cls(
            config,
            assets,
            meta,
            generation_config=generation,
            source_dir=source_dir,
            owned_dir=owned,
        )

    # -- runtime helpers ----------------------------------------------------------------------

    def _run(
        self,
        asset: str,
        entrypoint: str,
        inputs: Mapping[str, Any],
        state: Mapping[str, Any] | None = None,
    ) -> dict[str, np.ndarray]:
        """One call of an asset's entry point; ``state`` is the caller's own (a generation's
        cache row), so concurrent calls never share buffers."""
        return self.sessions[asset].run(
            inputs, entrypoint=entrypoint, state=state, keep_state=False
        )

    def _run_each_row(
        self, entrypoint: str, name: str, batch: torch.Tensor, output: str
    ) -> torch.Tensor:
        """``entrypoint`` of the ``model`` asset run on each row of ``batch`` (its input
        ``name``, a batch of one), the rows of its ``output`` concatenated (float32)."""
        rows = [
            self._run("model", entrypoint, {name: np.ascontiguousarray(row[None].float().numpy())})[
                output
            ]
            for row in batch
        ]
        return torch.from_numpy(np.concatenate(rows).astype(np.float32))

    def _fresh_states(self, asset: str, entrypoint: str) -> dict[str, Any]:
        """Zeroed runtime buffers for the states of ``entrypoint``."""
        return self.sessions[asset].zero_states(entrypoint)

    def _input_shape(self, asset: str, entrypoint: str, name: str) -> list[int]:
        """The shape of an input of an entry point (-1: dynamic)."""
        return list(self.sessions[asset].descriptor(entrypoint).input_descriptor(name).shape)


# ------------------------------------------------------------------------------- helpers ----


def class_for_task(task: str) -> type[CoreAIModel]:
    """The ``CoreAIModelFor…`` class of ``task``."""
    import coreai_torch.hf as hf

    if task not in CLASSES:
        raise ValueError(f"unknown task '{task}'; the tasks are {', '.join(CLASSES)}")
    found: type[CoreAIModel] = getattr(hf, CLASSES[task])
    return found


def local_dir(model_dir: Any, who: str) -> Path:
    """``model_dir`` as an existing local directory, or a clear error (never downloads)."""
    if not isinstance(model_dir, (str, os.PathLike)):
        raise TypeError(
            f"{who}.from_pretrained expects the path of a local model directory, got "
            f"{type(model_dir).__name__}"
        )
    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(
            f"{model_dir}: no such local directory; {who}.from_pretrained reads local "
            "directories only (written by save_pretrained) and never downloads models"
        )
    if not (path / "config.json").is_file() and not is_bundle_dir(path):
        raise FileNotFoundError(
            f"{path}: not a model directory (no config.json) nor a bundle (no metadata.json); "
            "save the model with save_pretrained first"
        )
    return path


def read_coreai_config(path: Path, *, check_assets: bool = True) -> dict[str, Any]:
    """The :data:`COREAI_CONFIG` of a saved directory, its layout checked (a clear error
    naming the file rather than a ``KeyError`` later); ``check_assets=False`` for a bundle's,
    whose manifest names the assets."""
    file = path / COREAI_CONFIG
    try:
        meta = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ValueError(
            f"{file} cannot be read as JSON ({error}); export the model again"
        ) from None
    if not check_assets and isinstance(meta, dict):
        return meta
    assets = meta.get("assets") if isinstance(meta, dict) else None
    if (
        not isinstance(assets, dict)
        or not assets
        or not all(
            isinstance(name, str) and isinstance(rel, str) and rel and Path(rel).name == rel
            for name, rel in assets.items()
        )
    ):
        raise ValueError(
            f"{file} does not name its assets (an 'assets' object of entry names -> "
            f".aimodel directories beside it); export the model again"
        )
    return meta


def load_generation_config(path: Path, config: PretrainedConfig) -> GenerationConfig:
    if (path / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(path, local_files_only=True)
    return GenerationConfig.from_model_config(config)


def load_hf_config(path: Path) -> PretrainedConfig:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except ValueError as error:
        raise UnsupportedModelError(f"{path}: {error}") from None


def load_for_export(auto_class: Any, config: PretrainedConfig, path: Path) -> PreTrainedModel:
    """The model of the local directory ``path`` (``auto_class``, e.g. ``AutoModel``), for
    export.  A safetensors checkpoint whose tensors name the model's parameters (after the
    renames ``from_pretrained`` applies: the class's checkpoint conversion mapping, a task
    model's base-model prefix) is streamed: the model is built with empty parameters bound to
    the checkpoint (:class:`~coreai_torch.tensors.lazy.WeightSource`), whose weights are read one at
    a time while the asset is written.  Other checkpoints (``.bin`` files, names only
    ``from_pretrained`` knows how to map) are loaded with ``from_pretrained``, in memory."""
    if not any(path.glob("*.safetensors")):
        return auto_class.from_pretrained(path, local_files_only=True).eval()
    source = WeightSource(path)  # a damaged checkpoint is a CheckpointError naming the file
    with lazy.empty_parameters():  # in float32, as from_pretrained loads it
        model = auto_class.from_config(config, dtype=torch.float32)
    source.entries = _checkpoint_names(model, source.entries)
    try:
        return source.bind(model).eval()
    except CheckpointError:
        source.close()
        return auto_class.from_pretrained(path, local_files_only=True).eval()


def _checkpoint_names(model: nn.Module, entries: dict[str, Any]) -> dict[str, Any]:
    """``entries`` (checkpoint name -> tensor) under the names the model's parameters have:
    the class's ``_checkpoint_conversion_mapping`` (regular expressions, the first that
    matches applies; LLaVA's checkpoints name ``language_model.model.*`` what the class calls
    ``model.language_model.*``), then the base-model prefix removed or added."""
    mapping = getattr(type(model), "_checkpoint_conversion_mapping", None) or {}
    own = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    prefix = f"{getattr(model, 'base_model_prefix', '')}."
    renamed = {}
    for name, entry in entries.items():
        new = name
        for pattern, replacement in mapping.items():
            new, count = re.subn(pattern, replacement, new)
            if count:
                break
        if new not in own and prefix != "." and new.startswith(prefix):
            new = new.removeprefix(prefix)  # a task model's checkpoint, the base model built
        elif new not in own and prefix + new in own:
            new = prefix + new  # a base model's checkpoint, a task model built
        renamed[new] = entry
    return renamed


def check_model_type(config: Any, supported: tuple[str, ...], who: str, what: str) -> None:
    """Raise :class:`UnsupportedModelError` unless ``config.model_type`` is in ``supported``."""
    model_type = getattr(config, "model_type", None)
    if model_type not in supported:
        from coreai_torch.hf.tasks import suggest_task

        hint = suggest_task(model_type)
        raise UnsupportedModelError(
            f"{what}: model type '{model_type}' is not supported by {who} (supported: "
            f"{', '.join(supported)})" + (f"; {hint}" if hint else "")
        )


def checked_config(
    model_or_dir: PreTrainedModel | Path, supported: tuple[str, ...], who: str
) -> Any:
    """The configuration of a model instance or of a local directory (read from its
    ``config.json``, no weight loaded), after :func:`check_model_type`."""
    if isinstance(model_or_dir, nn.Module):
        config = getattr(model_or_dir, "config", None)
        check_model_type(config, supported, who, type(model_or_dir).__name__)
    else:
        config = load_hf_config(model_or_dir)
        check_model_type(config, supported, who, str(model_or_dir))
    return config


def _open_sessions(assets: Mapping[str, Path], verify_hash: bool) -> dict[str, Any]:
    from coreai_torch.runtime import Session

    sessions: dict[str, Any] = {}
    try:
        for name, path in assets.items():
            session = Session(path, verify_hash=verify_hash)
            session.open()
            sessions[name] = session
    except Exception:
        _close_sessions(sessions, None)
        raise
    return sessions


def _close_sessions(sessions: dict[str, Any], owned: tempfile.TemporaryDirectory | None) -> None:
    for session in sessions.values():
        with contextlib.suppress(Exception):  # closing at garbage collection must not raise
            session.close()
    sessions.clear()
    if owned is not None:
        owned.cleanup()


class _Cancelled(StoppingCriteria):
    """A stopping criterion: every sequence is done once ``event`` is set."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool)


def _device_type(value: str | torch.device | int) -> str:
    if isinstance(value, int):
        return "cuda"
    try:
        return torch.device(value).type
    except RuntimeError:
        return str(value)
