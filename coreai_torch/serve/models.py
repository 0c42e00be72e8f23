"""What ``coreai-torch serve MODEL`` accepts, loaded as a :class:`~coreai_torch.llm.Generator`:

* an exported ``.aimodel`` (``coreai-torch llm export``), with ``tokenizer=`` a directory;
* a directory saved by ``CoreAIModelForCausalLM.save_pretrained`` (its ``model.aimodel`` and
  tokenizer);
* a bundle directory (``metadata.json`` naming ``assets.main``, the tokenizer in
  ``tokenizer/``);
* a Hugging Face model directory (``save_pretrained``), exported on the fly with
  :func:`coreai_torch.llm.export` (``max_context`` / ``precision`` / ``compress`` apply).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from coreai_torch.hf.base import COREAI_CONFIG, read_coreai_config
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
    if path.suffix == ".aimodel":
        asset: Any = path
        found_tokenizer = None
    elif (path / COREAI_CONFIG).is_file():
        meta = read_coreai_config(path)
        if meta.get("task") != "text-generation":
            raise ValueError(
                f"{path} holds a {meta.get('class', '?')} (task '{meta.get('task')}'); the "
                "server generates text with a text-generation model"
            )
        asset, found_tokenizer = path / meta["assets"]["model"], _tokenizer_dir(path)
    elif (path / "metadata.json").is_file():
        asset, found_tokenizer, name = _bundle(path)
    elif (path / "config.json").is_file():
        from coreai_torch.llm.export import export

        asset = export(path, **exporting)
        found_tokenizer = _tokenizer_dir(path)
        exporting = {}
    else:
        raise FileNotFoundError(
            f"{path}: neither an .aimodel, a saved CoreAIModelForCausalLM directory "
            f"({COREAI_CONFIG}), a bundle (metadata.json) nor a Hugging Face model directory "
            "(config.json)"
        )
    given = [k for k, v in exporting.items() if v is not None]
    if given:
        raise ValueError(
            f"{path} is already exported; {', '.join(given)} apply only to a Hugging Face "
            "model directory exported on the fly"
        )
    chosen = tokenizer if tokenizer is not None else found_tokenizer
    return Generator(asset, tokenizer=chosen, verify_hash=verify_hash), name


def _tokenizer_dir(path: Path) -> Path | None:
    return path if any((path / f).is_file() for f in _TOKENIZER_FILES) else None


def _bundle(path: Path) -> tuple[Path, Path | None, str]:
    """The main asset, the tokenizer directory and the name of a bundle."""
    file = path / "metadata.json"
    try:
        meta = json.loads(file.read_text())
        main = meta["assets"]["main"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{file}: not a bundle's metadata (no assets.main: {error})") from None
    if meta.get("kind") not in ("llm", None):
        raise ValueError(f"{path} is a '{meta.get('kind')}' bundle; the server runs 'llm' bundles")
    return path / main, _tokenizer_dir(path / "tokenizer"), str(meta.get("name") or path.name)
