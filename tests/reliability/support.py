"""Helpers of the reliability tests: running code that could abort in a child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run_isolated(code: str, timeout: float = 300) -> Any:
    """Run ``code`` in a fresh interpreter; assert it survived; return what it printed last.

    ``code`` reports its findings by printing one JSON line (the last line of stdout).  A
    process killed by a signal (the Core AI runtime aborting) fails the test with its stderr.
    """
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, (
        f"the child process did not survive (exit code {proc.returncode}):\n{proc.stderr[-3000:]}"
    )
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines, f"no output from the child process; stderr:\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1])
