"""Seed 001 ("Conversion Workflows") runs verbatim and its programs match PyTorch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parent / "seed_examples" / "seed001_workflows.py"


def test_seed001_examples_verbatim() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).parent.parent,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "seed 001: all examples ran and matched PyTorch" in result.stdout
