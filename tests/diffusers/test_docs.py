"""The runnable example of docs/text_to_image.md runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.mark.slow
def test_example_runs() -> None:
    text = (DOCS / "text_to_image.md").read_text()
    example = re.search(r"## A runnable example.*?```python\n(.*?)```", text, re.S)
    assert example is not None, "text_to_image.md has no runnable example"
    exec(compile(example[1], "text_to_image.md", "exec"), {"__name__": "__example__"})
