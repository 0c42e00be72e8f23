"""Exporting a Hugging Face model directory for a task to a directory that the task's
``CoreAIModelFor…`` class loads with ``from_pretrained`` (``coreai-torch export --task``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from coreai_torch.hf.base import class_for_task


def export_directory(
    task: str,
    model_dir: str | Path,
    output: str | Path,
    *,
    max_context: int | None = None,
    precision: Any = None,
    compress: Any = None,
) -> dict[str, Any]:
    """Export ``model_dir`` for ``task`` and save it to ``output``; returns what was written
    (the ``coreai_config.json`` fields, the asset size and the time taken)."""
    cls = class_for_task(task)
    out = Path(output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty directory; choose a new output")
    if out.resolve() == Path(model_dir).resolve():
        raise ValueError("the output directory must differ from the model directory")
    options: dict[str, Any] = {"precision": precision, "compress": compress}
    if max_context is not None:
        options["max_context"] = max_context
    start = time.perf_counter()
    model = cls.from_pretrained(model_dir, export=True, **options)
    exported = time.perf_counter() - start
    try:
        model.save_pretrained(out)
    finally:
        model.close()
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file() and ".aimodel" in str(f))
    return {
        **model.coreai_config,
        "model": str(model_dir),
        "output": str(out),
        "asset_bytes": size,
        "seconds": {"export": round(exported, 3), "total": round(time.perf_counter() - start, 3)},
    }
