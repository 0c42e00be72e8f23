"""`make bench`: conversion time, peak memory and runtime latency of the benchmark models.

Each model runs in a fresh subprocess so memory baselines are clean.  Results are printed as a
table and written to ``bench_results/results.json``.

    python -m benchmarks.run [--models llama-0.27b vit-b16 resnet50] [--runs 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

RESULTS = Path("bench_results")


class PeakRSS:
    """Samples this process's RSS in a background thread; ``peak - baseline`` per phase."""

    def __init__(self, interval: float = 0.002) -> None:
        self._proc = psutil.Process(os.getpid())
        self._interval = interval
        self._stop = threading.Event()
        self.baseline = 0
        self.peak = 0

    def __enter__(self) -> PeakRSS:
        self.baseline = self.peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(self._interval)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)

    @property
    def delta(self) -> int:
        return self.peak - self.baseline


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def measure(name: str, runs: int) -> dict[str, Any]:
    """Convert, save, load and run one model; returns the measurements."""
    import torch

    from benchmarks.models import MODELS
    from coreai_torch import TorchConverter
    from coreai_torch.runtime import Session
    from coreai_torch.verify import compare, eager_outputs, export_decomposed, run_entrypoint

    torch.manual_seed(0)
    model, args = MODELS[name].build()
    weight_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    result: dict[str, Any] = {"model": name, "weight_bytes": weight_bytes}

    start = time.perf_counter()
    ep = export_decomposed(model, args)
    result["export_s"] = time.perf_counter() - start

    with PeakRSS() as mem:
        start = time.perf_counter()
        program = TorchConverter().add_exported_program(ep).to_coreai()
        result["to_coreai_s"] = time.perf_counter() - start
    result["to_coreai_rss"] = mem.delta

    with PeakRSS() as mem:
        start = time.perf_counter()
        program.optimize()
        result["optimize_s"] = time.perf_counter() - start
    result["optimize_rss"] = mem.delta

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{name}.aimodel"
        with PeakRSS() as mem:
            start = time.perf_counter()
            program.save_asset(path)
            result["save_s"] = time.perf_counter() - start
        result["save_rss"] = mem.delta
        result["asset_bytes"] = _dir_size(path)

        with PeakRSS() as mem:
            start = time.perf_counter()
            session = Session(path)
            session.open()
            session.function("main")
            result["load_s"] = time.perf_counter() - start
        result["load_rss"] = mem.delta
        try:
            actual = run_entrypoint(session, program, args)  # warm-up
            latencies = []
            for _ in range(runs):
                start = time.perf_counter()
                run_entrypoint(session, program, args)
                latencies.append(time.perf_counter() - start)
        finally:
            session.close()
    result["latency_ms"] = statistics.median(latencies) * 1000

    expected = eager_outputs(model, args)
    eager = []
    with torch.no_grad():
        for _ in range(runs):
            start = time.perf_counter()
            model(*args)
            eager.append(time.perf_counter() - start)
    result["eager_ms"] = statistics.median(eager) * 1000
    result["max_abs_err"] = max(
        compare("out", e, a).max_abs for e, a in zip(expected, actual, strict=True)
    )
    return result


def _mb(n: float) -> str:
    return f"{n / 2**20:,.0f} MB"


def table(results: list[dict[str, Any]]) -> str:
    head = (
        "| model | weights | to_coreai | +RSS to_coreai | optimize | save_asset | +RSS save | "
        "asset | load | latency | eager | max abs err |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['model']} | failed: {r['error'][:80]} |" + " |" * 10)
            continue
        lines.append(
            f"| {r['model']} | {_mb(r['weight_bytes'])} | {r['to_coreai_s']:.3f} s | "
            f"{_mb(r['to_coreai_rss'])} ({100 * r['to_coreai_rss'] / r['weight_bytes']:.1f}%) | "
            f"{r['optimize_s']:.2f} s | {r['save_s']:.2f} s | {_mb(r['save_rss'])} | "
            f"{_mb(r['asset_bytes'])} ({100 * r['asset_bytes'] / r['weight_bytes']:.1f}%) | "
            f"{r['load_s']:.2f} s | {r['latency_ms']:.1f} ms | {r['eager_ms']:.1f} ms | "
            f"{r['max_abs_err']:.1e} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.models import MODELS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.one:  # child process: measure one model, print JSON
        print("RESULT " + json.dumps(measure(args.one, args.runs)))
        return 0

    results = []
    for name in args.models:
        print(f"== {name}: {MODELS[name].description}", flush=True)
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.run", "--one", name, "--runs", str(args.runs)],
            capture_output=True,
            text=True,
        )
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            results.append({"model": name, "error": " / ".join(tail)})
            print("   failed:\n   " + "\n   ".join(tail))
            continue
        results.append(json.loads(line[len("RESULT ") :]))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "results.json").write_text(json.dumps(results, indent=2))
    print()
    print(table(results))
    print(f"\nJSON: {RESULTS / 'results.json'}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
