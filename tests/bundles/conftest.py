"""Fixtures of the bundle tests: the convention model converted once per test run (dynamic,
float32 caches; the static-shape family, float16 caches) and saved as assets, shared by the
test workers through a file lock; model directories with tokenizers of several chat styles."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock

from coreai_torch._mlir import ca
from tests.bundles.support import ConventionLM, convert, convert_static, model_dir


@pytest.fixture(scope="session")
def lm() -> ConventionLM:
    return ConventionLM().eval()


def _shared_asset(factory: pytest.TempPathFactory, name: str, build: Callable[[], Any]) -> Path:
    """``name`` saved once for every worker of the run (the base temp's parent is shared)."""
    root = factory.getbasetemp().parent / "bundle_assets"
    root.mkdir(exist_ok=True)
    path = root / name
    with FileLock(str(path) + ".lock"):
        if not (path / "main.hash").is_file():
            build().save_asset(path)
    return path


@pytest.fixture(scope="session")
def assets(tmp_path_factory: pytest.TempPathFactory, lm: ConventionLM) -> Path:
    """A directory holding ``dynamic.aimodel``: the convention model, converted and saved."""
    return _shared_asset(tmp_path_factory, "dynamic.aimodel", lambda: convert(lm)).parent


@pytest.fixture(scope="session")
def dynamic_program(assets: Path) -> Any:
    """The convention model as an ``AIProgram`` (read back from its saved asset)."""
    return ca.AIModelAsset.load(assets / "dynamic.aimodel").program


@pytest.fixture(scope="session")
def static_asset(tmp_path_factory: pytest.TempPathFactory, lm: ConventionLM) -> Path:
    """The static-shape family (contexts 64 and 128, query lengths 4 and 16), saved."""
    return _shared_asset(tmp_path_factory, "static.aimodel", lambda: convert_static(lm))


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {style: model_dir(root, style) for style in ("qwen", "llama3", "gemma", "base")}
