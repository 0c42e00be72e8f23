"""Seeds 003 ("Composite Ops Guide") and 004 ("Externalization") run verbatim and match PyTorch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
EXAMPLES = Path(__file__).parent / "seed_examples"


@pytest.mark.parametrize(
    ("script", "done"),
    [
        ("seed003_composite_ops.py", "seed 003: all examples ran and matched PyTorch"),
        ("seed004_externalization.py", "seed 004: all examples ran and matched PyTorch"),
    ],
)
def test_seed_examples_verbatim(script: str, done: str) -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert done in result.stdout
