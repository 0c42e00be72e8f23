"""Per-asset metadata: the ``metadata.json`` inside each ``.aimodel`` (``AIModelAssetMetadata``).

coreai-core's ``save_asset`` stamps ``creation_date`` (now) and the producer (``coreai-core
<version>``) over whatever it was given, so the fields are set after the asset is written, with
``AIModelAsset.update_metadata`` (which rewrites only that small file: the program and its hash
are untouched).  Author, license and description come from the model's card and config where
they are known (:func:`metadata_from_model_dir`) and are optional.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from coreai_torch._mlir import ca

DISTRIBUTION = "coreai-torch-converter"


def producer() -> str:
    """What the assets written here name as their producer: this converter and the
    coreai-core that serialized the program (``coreai-torch-converter 0.1.0 (coreai-core
    1.0.0b3)``)."""
    return f"{DISTRIBUTION} {_version(DISTRIBUTION)} (coreai-core {_version('coreai-core')})"


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class AssetMetadata:
    """The fields of an asset's metadata.  ``creation_date`` (Unix time) and ``producer`` left
    ``None`` are set when the metadata is written (now, and :func:`producer`); ``custom`` is
    the asset's ``creatorDefinedMetadata`` (JSON values)."""

    author: str = ""
    license: str = ""
    description: str = ""
    creation_date: float | None = None
    producer: str | None = None
    custom: Mapping[str, Any] = field(default_factory=dict)

    def for_component(self, component: str) -> AssetMetadata:
        """The same metadata for one asset of a multi-asset bundle (the description says which)."""
        if not self.description:
            return self
        return replace(self, description=f"{self.description} ({component} component)")


def write_asset_metadata(asset: str | os.PathLike[str], metadata: AssetMetadata) -> None:
    """Set the metadata of the saved asset ``asset`` (only its ``metadata.json`` changes)."""

    def update(m: Any) -> None:
        m.author = metadata.author
        m.license = metadata.license
        m.model_description = metadata.description
        m.creation_date = time.time() if metadata.creation_date is None else metadata.creation_date
        m._producer = producer() if metadata.producer is None else metadata.producer
        for key, value in metadata.custom.items():
            m.set_custom(key, value)

    ca.AIModelAsset.load(Path(asset)).update_metadata(update)


def read_asset_metadata(asset: str | os.PathLike[str]) -> AssetMetadata:
    """The metadata of the saved asset ``asset``."""
    m = ca.AIModelAsset.load(Path(asset)).metadata
    return AssetMetadata(
        author=m.author,
        license=m.license,
        description=m.model_description,
        creation_date=m.creation_date,
        producer=m._producer,
        custom=dict(m.creator_defined_metadata),  # type: ignore[attr-defined]  # not in its stub
    )


# ------------------------------------------------------------------ from a model's card ---

_FRONT_MATTER = re.compile(r"\A---\s*\n(.*?)\n---\s*(?:\n|\Z)", re.S)


def model_card_fields(model_dir: str | os.PathLike[str]) -> dict[str, str]:
    """``key: value`` lines of the YAML front matter of ``model_dir/README.md`` (the Hugging
    Face model card; scalar values only, e.g. ``license``, ``license_name``, ``base_model``)."""
    card = Path(model_dir) / "README.md"
    if not card.is_file():
        return {}
    match = _FRONT_MATTER.match(card.read_text(errors="replace"))
    if match is None:
        return {}
    found = {}
    for line in match.group(1).splitlines():
        key, sep, value = line.partition(":")
        value = value.strip().strip("'\"")
        if sep and key and not key.startswith((" ", "-", "#")) and value:
            found[key.strip()] = value
    return found


def metadata_from_model_dir(
    model_dir: str | os.PathLike[str] | None,
    config: Any = None,
    *,
    model_id: str | None = None,
    author: str | None = None,
    license: str | None = None,
    description: str | None = None,
) -> AssetMetadata:
    """Author, license and description of a converted Hugging Face model, from what is known:
    the arguments, else the card's front matter (``license``/``license_name``), the hub id's
    organisation as the author, and a description naming the architecture, the source and
    the converter.  Unknown fields stay empty (they are optional)."""
    card = model_card_fields(model_dir) if model_dir is not None else {}
    if license is None:
        license = (
            card.get("license_name") if card.get("license") == "other" else card.get("license")
        )
    if author is None and model_id and "/" in model_id:
        author = model_id.split("/", 1)[0]
    if description is None:
        kind = getattr(config, "model_type", None)
        what = f"a {kind} model" if kind else "a model"
        source = f" from {model_id}" if model_id else ""
        description = f"{what} converted{source} with {DISTRIBUTION} {_version(DISTRIBUTION)}"
        description = description[0].upper() + description[1:]
    return AssetMetadata(author=author or "", license=license or "", description=description)
