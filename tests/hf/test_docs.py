"""The runnable example of each ``docs/hf_*.md`` page runs (each exports a small model)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGES = [
    "hf_causal_lm.md",
    "hf_feature_extraction.md",
    "hf_speech_recognition.md",
    "hf_image_text_to_text.md",
]


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_example_runs(page: str) -> None:
    text = (DOCS / page).read_text()
    example = re.search(r"## A runnable example.*?```python\n(.*?)```", text, re.S)
    assert example is not None, f"{page} has no runnable example"
    exec(compile(example[1], page, "exec"), {"__name__": "__example__"})
