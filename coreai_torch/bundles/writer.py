"""Writing a bundle: one :func:`write_bundle` for every kind, and :func:`write_llm_bundle`,
which derives a language model's manifest from its Hugging Face directory.

Everything is checked before anything is visible: the manifest (Swift's decoding rules), the
tokenizer (the swift-transformers registry, the stop tokens) and every asset's functions
against the engine that will run them (read from the program in memory, before the asset is
saved).  The bundle is then written into a temporary directory beside the target, loaded back
with :meth:`Bundle.load <coreai_torch.bundles.reader.Bundle.load>` and renamed into place, so a
failure at any step leaves no bundle (and an existing one untouched).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from coreai_torch.bundles.asset_metadata import (
    AssetMetadata,
    metadata_from_model_dir,
    producer,
    write_asset_metadata,
)
from coreai_torch.bundles.manifest import LANGUAGE_KINDS, LanguageConfig, Manifest, VisionConfig
from coreai_torch.bundles.reader import (
    ASSET_SUFFIXES,
    MANIFEST_FILE,
    TOKENIZER_DIR,
    Bundle,
    check_bundle_assets,
)
from coreai_torch.bundles.signatures import function_signatures
from coreai_torch.bundles.tokenizer import write_tokenizer
from coreai_torch.errors import BundleError, BundleNotFoundError
from coreai_torch.ir.assets import check_asset

#: an asset to write: a program (saved with ``save_asset``) or a saved ``.aimodel`` directory
#: (hard-linked where the file system allows, else copied; never read into memory)
AssetSource = Any


def write_bundle(
    directory: str | os.PathLike[str],
    manifest: Manifest,
    assets: Mapping[str, AssetSource],
    *,
    tokenizer: Any = None,
    eos_token_ids: Iterable[int] = (),
    chat_template: str | None = None,
    files: Mapping[str, str | os.PathLike[str]] | None = None,
    asset_metadata: AssetMetadata | Mapping[str, AssetMetadata] | None = None,
    overwrite: bool = False,
) -> Bundle:
    """Write a bundle of any kind into ``directory`` and return it (loaded and checked).

    ``manifest``: the ``metadata.json`` to write; a role of ``assets`` the manifest does not
    name is written as ``<name>.aimodel`` (``main``) or ``<role>.aimodel``.  ``assets``: role ->
    an ``AIProgram`` or the path of a saved ``.aimodel``.  ``tokenizer`` (``llm``/``vlm``): a
    Hugging Face tokenizer or its directory, written to ``tokenizer/`` by
    :func:`~coreai_torch.bundles.tokenizer.write_tokenizer` with ``eos_token_ids`` and
    ``chat_template``.  ``files``: other files or directories to include, by their path in the
    bundle (e.g. a diffusion bundle's ``{"tokenizer": clip_dir, "vae_bn_mean.npy": path}``).
    ``asset_metadata``: the per-asset metadata (one for all assets, or by role); programs get
    the default (:class:`AssetMetadata`: producer and creation date) when it is None, saved
    assets keep theirs.  ``overwrite``: replace an existing bundle at ``directory``.

    Raises :class:`~coreai_torch.errors.BundleError` (a
    :class:`~coreai_torch.errors.CallingConventionError` for an asset the engine cannot run)
    before anything is written, ``FileExistsError`` if ``directory`` exists and ``overwrite``
    is false.
    """
    target = Path(directory)
    if target.suffix.lower() in ASSET_SUFFIXES:
        raise BundleError(
            f"{target}: a bundle is a directory that holds the .aimodel, not the .aimodel "
            "itself; choose a directory name without the .aimodel suffix"
        )
    if (target.exists() or target.is_symlink()) and not overwrite:
        raise FileExistsError(f"{target} exists; pass overwrite=True to replace it")
    if target.exists() and not target.is_dir():
        raise FileExistsError(f"{target} exists and is not a directory; refusing to replace it")
    manifest = _with_asset_paths(manifest, assets)
    where = f"{target / MANIFEST_FILE}"
    manifest.validate(where)
    extra_files = {str(Path(k)): Path(v) for k, v in (files or {}).items()}
    _check_sources(manifest, assets, extra_files, target)
    if tokenizer is not None and manifest.kind not in LANGUAGE_KINDS:
        raise BundleError(
            f"tokenizer= writes a language model's tokenizer/; a {manifest.kind} bundle's "
            "tokenizer files go in files= (e.g. files={'tokenizer': clip_tokenizer_dir})"
        )
    embeds = manifest.kind in LANGUAGE_KINDS and manifest.language_config().embedded_tokenizer
    if embeds and tokenizer is None and TOKENIZER_DIR not in extra_files:
        raise BundleError(
            f"{where}: language.embedded_tokenizer is true but no tokenizer was given: pass "
            "tokenizer= (a Hugging Face tokenizer or its directory), or set "
            "embedded_tokenizer=False to have the app download language.tokenizer"
        )
    signatures = {
        role: function_signatures(_checked_source(source, role)) for role, source in assets.items()
    }
    asset_where = {role: f"{target / manifest.assets[role]}" for role in manifest.assets}
    check_bundle_assets(manifest, signatures, asset_where, manifest_where=where)

    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(
        tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    )
    try:
        if tokenizer is not None:
            write_tokenizer(
                staging / TOKENIZER_DIR,
                tokenizer,
                eos_token_ids=eos_token_ids,
                chat_template=chat_template,
            )
        for relative, source in extra_files.items():
            _place(source, staging / relative)
        for role, source in assets.items():
            path = staging / manifest.assets[role]
            path.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(source, (str, os.PathLike)):
                _link_tree(Path(source), path)
            else:
                source.save_asset(path)
            metadata = _metadata_for(asset_metadata, role, source, multi=len(assets) > 1)
            if metadata is not None:
                write_asset_metadata(path, metadata)
        (staging / MANIFEST_FILE).write_text(manifest.dumps())
        Bundle.load(staging)  # the app's view of what was written
        _move_into_place(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return Bundle.load(target, check_assets=False)


def _with_asset_paths(manifest: Manifest, assets: Mapping[str, AssetSource]) -> Manifest:
    named = dict(manifest.assets)
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", manifest.name).strip("-.") or "model"
    for role in assets:
        named.setdefault(role, f"{stem}.aimodel" if role == "main" else f"{role}.aimodel")
    return replace(manifest, assets=named)


def _check_sources(
    manifest: Manifest,
    assets: Mapping[str, AssetSource],
    files: Mapping[str, Path],
    target: Path,
) -> None:
    where = target / MANIFEST_FILE
    for role, relative in manifest.assets.items():
        if role not in assets and str(Path(relative)) not in files:
            raise BundleError(
                f"{where}: assets.{role} names {relative!r}, which nothing provides: pass the "
                f"asset as assets={{'{role}': program_or_path}}"
            )
        if not relative.endswith(ASSET_SUFFIXES):
            raise BundleError(f"{where}: assets.{role} = {relative!r} must end in .aimodel")
    for relative, source in files.items():
        if Path(relative).is_absolute() or ".." in Path(relative).parts:
            raise BundleError(f"files: {relative!r} must be a path inside the bundle")
        if relative == MANIFEST_FILE:
            raise BundleError("files: metadata.json is written from the manifest")
        if not source.exists():
            raise BundleNotFoundError(
                f"files: {relative!r} is to be copied from {source}, which does not exist"
            )


def _checked_source(source: AssetSource, role: str) -> AssetSource:
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.suffix != ".aimodel":
            raise BundleError(
                f"asset '{role}': {path} is not a saved .aimodel (a compiled .aimodelc cannot "
                "be checked or stamped here)"
            )
        check_asset(path, verify_hash=False)
        return path
    if not hasattr(source, "save_asset"):
        raise TypeError(
            f"asset '{role}' must be an AIProgram or the path of a saved .aimodel, got "
            f"{type(source).__name__}"
        )
    return source


def _metadata_for(
    given: AssetMetadata | Mapping[str, AssetMetadata] | None,
    role: str,
    source: AssetSource,
    *,
    multi: bool,
) -> AssetMetadata | None:
    if isinstance(given, Mapping):
        return given.get(role)
    if given is None:
        return None if isinstance(source, (str, os.PathLike)) else AssetMetadata()
    return given.for_component(role) if multi else given


def _link_tree(source: Path, destination: Path) -> None:
    """Hard-link ``source``'s files into ``destination`` (copied where linking fails, and
    ``metadata.json`` always copied, since the bundle may restamp it)."""

    def link(src: str, dst: str) -> None:
        if Path(src).name != "metadata.json":
            try:
                os.link(src, dst)
                return
            except OSError:
                pass
        shutil.copy2(src, dst)

    shutil.copytree(source, destination, copy_function=link)


def _place(source: Path, destination: Path) -> None:
    destination.parent.mkdir(parents=True, exist_ok=True)
    if source.is_dir():
        shutil.copytree(source, destination)
    else:
        shutil.copyfile(source, destination)


def _move_into_place(staging: Path, target: Path) -> None:
    if not target.exists():
        os.rename(staging, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
    os.rename(target, old / "bundle")
    try:
        os.rename(staging, target)
    except BaseException:
        os.rename(old / "bundle", target)
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------- language models ---

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _load_config(config: Any, model_dir: Path | None) -> Any:
    """The model's Hugging Face config: ``config`` (an object or a dict), else read from
    ``model_dir`` with ``transformers.AutoConfig``."""
    if config is None:
        if model_dir is None:
            raise BundleError("pass config= (a Hugging Face config) or model_dir=")
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_dir)
    if isinstance(config, Mapping):
        from types import SimpleNamespace

        config = SimpleNamespace(**config)
    return config


def _text_config(config: Any) -> Any:
    text = getattr(config, "get_text_config", None)
    return text() if callable(text) else config


def eos_token_ids(config: Any = None, model_dir: str | os.PathLike[str] | None = None) -> list[int]:
    """The end-of-sequence ids a model's generation stops on: ``config.eos_token_id`` and
    ``generation_config.json``'s (int or list), which the app does not read itself."""
    ids: list[int] = []

    def add(value: Any) -> None:
        values = value if isinstance(value, (list, tuple)) else [value]
        ids.extend(int(v) for v in values if isinstance(v, int) and not isinstance(v, bool))

    if config is not None:
        add(getattr(config, "eos_token_id", None))
        add(getattr(_text_config(config), "eos_token_id", None))
    if model_dir is not None:
        generation = Path(model_dir) / "generation_config.json"
        if generation.is_file():
            add(json.loads(generation.read_text()).get("eos_token_id"))
    return list(dict.fromkeys(ids))


def hub_id(config: Any = None, model_id: str | None = None) -> str | None:
    """The model's Hugging Face id: ``model_id``, else the config's ``_name_or_path`` when it
    is a hub id rather than a local directory."""
    if model_id:
        return model_id
    name = getattr(config, "_name_or_path", None) or getattr(config, "name_or_path", None)
    if isinstance(name, str) and _HUB_ID.match(name) and not Path(name).exists():
        return name
    return None


def language_config_from_hf(
    config: Any,
    *,
    max_context_length: int | None = None,
    tokenizer_id: str | None = None,
    function: str = "main",
    **fields: Any,
) -> LanguageConfig:
    """The ``language`` block of a Hugging Face causal LM: ``vocab_size`` and
    ``max_context_length`` (default ``max_position_embeddings``) from its (text) config,
    ``tokenizer`` the hub id (``tokenizer_id``, else the config's), an embedded tokenizer and
    ``function_map`` ``{"main": [function]}``; ``fields`` set the other keys."""
    text = _text_config(_load_config(config, None))
    vocab = getattr(text, "vocab_size", None)
    context = max_context_length or getattr(text, "max_position_embeddings", None)
    if not isinstance(vocab, int) or not isinstance(context, int):
        raise BundleError(
            "the config names no vocab_size / max_position_embeddings; pass "
            "max_context_length= and check that the config is a causal LM's"
        )
    tokenizer = tokenizer_id or hub_id(config) or getattr(text, "model_type", None) or "model"
    return LanguageConfig(
        tokenizer=tokenizer,
        vocab_size=vocab,
        max_context_length=context,
        function_map={"main": (function,)},
        **fields,
    )


def write_llm_bundle(
    directory: str | os.PathLike[str],
    asset: AssetSource | Mapping[str, AssetSource],
    *,
    model_dir: str | os.PathLike[str] | None = None,
    config: Any = None,
    tokenizer: Any = None,
    name: str | None = None,
    max_context_length: int | None = None,
    model_id: str | None = None,
    function: str = "main",
    compression: str | None = None,
    chat_template: str | None = None,
    asset_metadata: AssetMetadata | None = None,
    files: Mapping[str, str | os.PathLike[str]] | None = None,
    overwrite: bool = False,
    vision: VisionConfig | None = None,
) -> Bundle:
    """Write a language-model bundle (kind ``llm``) the app's ``LanguageBundle`` loads.

    ``asset``: the converted decoder (``AIProgram`` or saved ``.aimodel``) in the app's calling
    convention.  ``model_dir``: the Hugging Face model directory it was converted from (its
    ``config.json``, ``generation_config.json``, tokenizer files and ``README.md`` are read);
    ``config``/``tokenizer`` may be given instead or on top.  The manifest is derived:
    ``name`` (default: the directory's name), ``language`` from the config
    (:func:`language_config_from_hf`, ``max_context_length`` the exported context), ``source``
    (the hub id, ``model_id`` or the config's, and this converter), ``compression`` and
    ``compilation`` (date).  The asset's metadata defaults to
    :func:`~coreai_torch.bundles.asset_metadata.metadata_from_model_dir`.  ``files``: other
    files to include (see :func:`write_bundle`; e.g. the Hugging Face ``config.json``, which
    the app ignores and Python loaders read).  With ``vision`` (and ``asset`` the assets by
    role) the bundle is a vision-language one: see :func:`write_vlm_bundle`.
    """
    model_dir = None if model_dir is None else Path(model_dir)
    if model_dir is not None and not model_dir.is_dir():
        raise BundleNotFoundError(f"model directory {model_dir} does not exist")
    hf_config = _load_config(config, model_dir)
    identifier = hub_id(hf_config, model_id)
    language = language_config_from_hf(
        hf_config,
        max_context_length=max_context_length,
        tokenizer_id=identifier or (model_dir.name if model_dir is not None else None),
        function=function,
    )
    manifest = Manifest(
        kind="llm" if vision is None else "vlm",
        name=name or Path(directory).name,
        language=language,
        vision=vision,
        source={
            "model_definition": "torch",
            **({"hf_model_id": identifier} if identifier else {}),
            "converter": producer(),
        },
        compression=compression,
        compilation={"date": datetime.datetime.now().astimezone().isoformat(), "targets": []},
    )
    assets = dict(asset) if isinstance(asset, Mapping) else {"main": asset}
    programs = [a for a in assets.values() if not isinstance(a, (str, os.PathLike))]
    if asset_metadata is None and programs:
        asset_metadata = metadata_from_model_dir(model_dir, hf_config, model_id=identifier)
    return write_bundle(
        directory,
        manifest,
        assets,
        tokenizer=tokenizer if tokenizer is not None else model_dir,
        eos_token_ids=eos_token_ids(hf_config, model_dir),
        chat_template=chat_template,
        files=files,
        asset_metadata=asset_metadata,
        overwrite=overwrite,
    )


#: the asset roles of a ``vlm`` bundle (``ModelBundle.ComponentKey``)
VLM_ROLES = ("main", "embedding", "vision")


def write_vlm_bundle(
    directory: str | os.PathLike[str],
    assets: Mapping[str, AssetSource],
    vision: VisionConfig,
    **options: Any,
) -> Bundle:
    """Write a vision-language bundle (kind ``vlm``) the app's ``CoreAIVisionLanguageModel``
    loads: ``assets`` ``main`` (the decoder, whose first input is the token embeddings),
    ``embedding`` (token ids to embeddings) and ``vision`` (pixels to the projected image
    features), the top-level ``vision`` block, and the rest as :func:`write_llm_bundle`
    (``options``: its keyword arguments; the asset metadata describes each component)."""
    missing = [role for role in VLM_ROLES if role not in assets]
    if missing:
        raise BundleError(
            f"a vlm bundle needs the assets {list(VLM_ROLES)}; {missing} not given (the app's "
            "CoreAIVisionLanguageModel loads all three)"
        )
    return write_llm_bundle(directory, assets, vision=vision, **options)
