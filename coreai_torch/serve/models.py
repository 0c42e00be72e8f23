"""What ``coreai-torch serve MODEL`` accepts, loaded as a :class:`~coreai_torch.llm.Generator`:

* a bundle directory (``coreai-torch llm export``, ``CoreAIModelForCausalLM.save_pretrained``,
  Apple's exports: ``metadata.json`` naming ``assets.main``, the tokenizer in ``tokenizer/``);
* an exported ``.aimodel``, with ``tokenizer=`` a directory and ``max_context=`` the context
  it was exported for (a bare asset does not record it);
* a Hugging Face model directory (``save_pretrained``), exported on the fly with
  :func:`coreai_torch.llm.export` (``max_context`` / ``precision`` / ``compress`` apply).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from coreai_torch.bundles import is_bundle_dir
from coreai_torch.hf.base import COREAI_CONFIG
from coreai_torch.llm.generate import Generator

#: files whose presence makes a directory a tokenizer directory
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_generator(
    model: str | os.PathLike[str],
    *,
    tokenizer: str | os.PathLike[str] | None = None,
    max_context: int | None = None,
    precision: Any = None,
    compress: Any = None,
    verify_hash: bool = True,
) -> tuple[Generator, str]:
    """The generator of ``model`` (see the module) and the name it is served under."""
    path = Path(model)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such model (an .aimodel, a bundle or a directory)")
    name = path.name.removesuffix(".aimodel") or "model"
    exporting = {"max_context": max_context, "precision": precision, "compress": compress}
    context = None
    if path.suffix == ".aimodel":
        asset: Any = path
        found_tokenizer = None
        context, exporting = max_context, {"precision": precision, "compress": compress}
        if context is None:
            raise ValueError(
                f"{path} is a bare asset, which does not record the context it was exported "
                "for: pass max_context (--max-context), or serve its bundle"
            )
    elif is_bundle_dir(path):
        asset, found_tokenizer, name = path, None, _bundle_name(path)
    elif (path / COREAI_CONFIG).is_file():
        raise ValueError(
            f"{path} was saved by an earlier coreai-torch (prefill/decode entry points), which "
            "the server no longer runs; export the model again to a bundle "
            "(coreai-torch llm export MODEL_DIR -o BUNDLE_DIR)"
        )
    elif (path / "config.json").is_file():
        from coreai_torch.llm.export import default_max_context, export, load_config

        if max_context is None:
            max_context = default_max_context(load_config(path))
        asset = export(path, **exporting | {"max_context": max_context})
        found_tokenizer, context = _tokenizer_dir(path), max_context
        exporting = {}
    else:
        raise FileNotFoundError(
            f"{path}: neither an .aimodel, a bundle (metadata.json) nor a Hugging Face model "
            "directory (config.json)"
        )
    given = [k for k, v in exporting.items() if v is not None]
    if given:
        raise ValueError(
            f"{path} is already exported; {', '.join(given)} apply only to a Hugging Face "
            "model directory exported on the fly"
        )
    chosen = tokenizer if tokenizer is not None else found_tokenizer
    generator = Generator(asset, tokenizer=chosen, max_context=context, verify_hash=verify_hash)
    return generator, name


def _tokenizer_dir(path: Path) -> Path | None:
    return path if any((path / f).is_file() for f in _TOKENIZER_FILES) else None


def _bundle_name(path: Path) -> str:
    """The name a bundle's manifest gives it (else the directory's)."""
    try:
        meta = json.loads((path / "metadata.json").read_text())
    except (OSError, ValueError):
        return path.name
    name = meta.get("name") if isinstance(meta, dict) else None
    return str(name or path.name)
