"""Fixtures of the bundle tests: the convention model converted once per session (dynamic,
float32 caches; static-shape family, float16 caches), saved as assets, and model directories
with tokenizers of several chat styles."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.bundles.support import ConventionLM, convert, convert_static, model_dir


@pytest.fixture(scope="session")
def lm() -> ConventionLM:
    return ConventionLM().eval()


@pytest.fixture(scope="session")
def dynamic_program(lm: ConventionLM) -> Any:
    return convert(lm)


@pytest.fixture(scope="session")
def assets(tmp_path_factory: pytest.TempPathFactory, dynamic_program: Any) -> Path:
    """A directory holding ``dynamic.aimodel`` (the convention model, saved once)."""
    root = tmp_path_factory.mktemp("assets")
    dynamic_program.save_asset(root / "dynamic.aimodel")
    return root


@pytest.fixture(scope="session")
def static_asset(tmp_path_factory: pytest.TempPathFactory, lm: ConventionLM) -> Path:
    """The static-shape family (contexts 64 and 128, query lengths 4 and 16), saved."""
    path = tmp_path_factory.mktemp("static") / "static.aimodel"
    convert_static(lm).save_asset(path)
    return path


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {style: model_dir(root, style) for style in ("qwen", "llama3", "gemma", "base")}
