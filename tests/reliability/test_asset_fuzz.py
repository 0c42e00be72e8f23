"""Damaged assets never abort the process that loads them (``tests/reliability/asset_corruption``).

Each test runs one worker process that saves a reference asset and loads many corrupted copies
of it, one after the other, with ``Session``: truncated at random offsets, random bytes of the
weights or of the rest of the bytecode flipped, files removed, the hash or the metadata damaged.
Before these checks a truncated bytecode file aborted the process (SIGABRT in coreai-core), a
missing one crashed it (SIGSEGV) and flipped weight bytes ran with wrong outputs.

* With the hash checked (the default) every damaged asset is refused with
  ``InvalidAssetError``; only metadata that still parses as valid metadata loads (it is not part
  of the program) and then computes exactly.
* With ``main.hash`` rewritten to match the damaged bytecode (a faulty tool, or a deliberate
  change), or with ``verify_hash=False``, the process still survives every load: the damage is
  refused, or the program runs (flipped weights then change its outputs: what the hash is for).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.reliability.support import ROOT


def _load_corrupted(workdir: Path, seed: int, count: int, *options: str) -> list[dict]:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.reliability.asset_corruption", str(workdir), str(seed)]
        + [str(count), *options],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    results = [line for line in lines if "outcome" in line]
    loading = [line["loading"] for line in lines if "loading" in line]
    assert proc.returncode == 0 and len(results) == count, (
        f"the loading process died (exit code {proc.returncode}) while loading "
        f"{loading[-1] if loading else 'nothing'} after {len(results)} of {count} assets:\n"
        f"{proc.stderr[-3000:]}"
    )
    return results


def _check_hash_verified(results: list[dict]) -> None:
    for r in results:
        if r["kind"] == "damage_metadata" and r["outcome"] == "ran":
            assert r["max_diff"] <= 1e-5, r  # metadata is not the program
        else:
            assert r["outcome"] == "InvalidAssetError", r


def _check_survived(results: list[dict]) -> None:
    for r in results:
        assert r["outcome"] in ("InvalidAssetError", "ran"), r
        if r["kind"] == "truncate":
            assert r["outcome"] == "InvalidAssetError", r


def test_a_sample_of_damaged_assets_is_refused(tmp_path: Path) -> None:
    results = _load_corrupted(tmp_path, 7, 12)
    _check_hash_verified(results)
    assert {r["kind"] for r in results} == {
        "truncate",
        "flip_weights",
        "flip_bytecode",
        "remove_file",
        "damage_hash",
        "damage_metadata",
    }
    messages = " ".join(r["message"] for r in results if "message" in r)
    assert "does not match main.hash" in messages
    assert "(truncated)" in messages
    assert "missing" in messages


def test_a_sample_of_rehashed_damage_does_not_abort(tmp_path: Path) -> None:
    _check_survived(_load_corrupted(tmp_path, 11, 9, "--rehash"))


@pytest.mark.slow
def test_hundreds_of_damaged_assets_never_abort(tmp_path: Path) -> None:
    """300 corrupted assets: 150 checked with the hash, 90 rehashed, 60 without the hash."""
    verified = _load_corrupted(tmp_path / "verified", 1, 150)
    _check_hash_verified(verified)
    rehashed = _load_corrupted(tmp_path / "rehashed", 2, 90, "--rehash")
    _check_survived(rehashed)
    unverified = _load_corrupted(tmp_path / "unverified", 3, 60, "--no-verify-hash")
    _check_survived(unverified)
    counts = Counter((r["kind"], r["outcome"]) for r in rehashed + unverified)
    # the child compilation is what spared the process for part of them
    crashed = [r for r in rehashed + unverified if "coreai-core crashed" in r.get("message", "")]
    assert crashed, counts
