"""Half precision on the benchmark models: asset size, conversion time, latency and error
against float32 eager PyTorch, per compute precision (``make bench``; docs/precision.md).

Each (model, precision) runs in a fresh subprocess like the other benchmarks.  The target:
a half-precision asset is at most :data:`ASSET_RATIO_TARGET` of the float32 one.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

#: the precisions measured, float32 first (the reference of the asset ratio)
PRECISIONS = ("fp32", "fp16", "bf16")
#: a half-precision asset is at most this fraction of the float32 asset
ASSET_RATIO_TARGET = 0.52


def measure_precision(spec: str, runs: int) -> dict[str, Any]:
    """Convert ``model:precision`` (e.g. ``llama-0.27b:fp16``), save, load and run it."""
    import numpy as np
    import torch

    from benchmarks.models import MODELS
    from coreai_torch import TorchConverter
    from coreai_torch.frontend.export import export_decomposed
    from coreai_torch.runtime import Session
    from coreai_torch.verify import eager_outputs, run_entrypoint

    name, precision = spec.rsplit(":", 1)
    torch.manual_seed(0)
    model, args = MODELS[name].build()
    result: dict[str, Any] = {"model": name, "precision": precision}
    ep = export_decomposed(model, args)

    start = time.perf_counter()
    program = TorchConverter(compute_precision=precision).add_exported_program(ep).to_coreai()
    result["to_coreai_s"] = time.perf_counter() - start
    start = time.perf_counter()
    program.optimize()
    result["optimize_s"] = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{name}.aimodel"
        program.save_asset(path)
        result["asset_bytes"] = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        with Session(path) as session:
            actual = run_entrypoint(session, program, args)  # warm-up
            latencies = []
            for _ in range(runs):
                start = time.perf_counter()
                run_entrypoint(session, program, args)
                latencies.append(time.perf_counter() - start)
    result["latency_ms"] = statistics.median(latencies) * 1000

    errors, cosines = [], []
    for e, a in zip(eager_outputs(model, args), actual, strict=True):
        ref, out = e.detach().double().numpy(), np.asarray(a, np.float64)
        errors.append(float(np.abs(out - ref).max()) / max(1.0, float(np.abs(ref).max())))
        norm = float(np.linalg.norm(out) * np.linalg.norm(ref)) or 1.0
        cosines.append(float((out * ref).sum()) / norm)
    result["rel_err"] = max(errors)
    result["cosine"] = min(cosines)
    return result


def precision_table(results: list[dict[str, Any]]) -> str:
    """One row per (model, precision); the asset ratio is against the model's float32 asset."""
    fp32 = {
        r["model"]: r["asset_bytes"]
        for r in results
        if r.get("precision") == "fp32" and "error" not in r
    }
    lines = [
        "| model | precision | asset | vs fp32 | to_coreai | optimize | latency | "
        "error vs fp32 eager | cosine |",
        "|" + "---|" * 9,
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['model']} | failed: {r['error'][:80]} |" + " |" * 7)
            continue
        base = fp32.get(r["model"])
        ratio = r["asset_bytes"] / base if base else float("nan")
        mark = ""
        if r["precision"] != "fp32":
            mark = " pass" if ratio <= ASSET_RATIO_TARGET else " FAIL"
        lines.append(
            f"| {r['model']} | {r['precision']} | {r['asset_bytes'] / 2**20:,.0f} MB | "
            f"{ratio:.3f}{mark} | {r['to_coreai_s']:.2f} s | {r['optimize_s']:.2f} s | "
            f"{r['latency_ms']:.1f} ms | {r['rel_err']:.1e} · max(1, max abs ref) | "
            f"{r['cosine']:.6f} |"
        )
    return "\n".join(lines)
