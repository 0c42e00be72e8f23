"""`make bench`: conversion time, peak memory and runtime latency of the benchmark models, and
(``--ablation``) what each IR simplification buys in latency.

Each model runs in a fresh subprocess (started in the repository root), which first converts,
saves, loads and runs a tiny model so that one-time costs (imports, MLIR and runtime set-up) are
not charged to the model.  Memory is the peak RSS of each phase above one baseline taken before
conversion (see ``benchmarks/memory.py``).  Results are printed as tables and written to
``bench_results/results.json``.

    python -m benchmarks.run [--models llama-0.27b vit-b16 resnet50 lstm-3x256] [--runs 10]
                             [--ablation] [--large] [--no-compression] [--compression-runs 3]
                             [--no-precision] [--no-llm] [--no-hf] [--no-server]

``--large`` adds the conversion of a 1.26B-parameter Llama against the disk's write floor
(``benchmarks/large.py``; needs about 8 GB of free memory).

The compression table (``benchmarks/compression.py``) converts the 0.27B Llama once per
weight form (fp32, int8, int4, 4-bit palettes).

The precision table (``benchmarks/precision.py``) converts each model in fp32, fp16 and bf16.

The LLM table (``benchmarks/llm.py``) exports the 0.27B Llama (fp32, fp16, int4, fp16+int4) and a
small Mixtral-style model with ``coreai_torch.llm``.

The server table (``benchmarks/server.py``) serves the 0.27B Llama with ``coreai-torch serve``
to 1, 4 and 8 concurrent clients (throughput, p50/p95 latency) next to ``llm.Generator`` alone.

The Hugging Face table (``benchmarks/hf.py``) runs the ``coreai_torch.hf`` classes: Whisper
tiny-shaped (encoder time, decoder tokens/s), a MiniLM-shaped embedding model (sentences/s at
128 tokens) and a LLaVA-style model (prefill of one image, decode tokens/s), in fp32 and
fp16+int4.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench_results"

#: Targets: to_coreai adds at most 10% of the weight bytes to the peak RSS ...
RSS_TARGET = 0.10
#: ... the asset is at most the weights + 5% ...
ASSET_TARGET = 1.05
#: ... and to_coreai runs "well under a second" for the 0.27B Llama (taken as half a second).
TO_COREAI_TARGET_S = 0.5
TO_COREAI_TARGET_MODEL = "llama-0.27b"
#: Outputs match eager PyTorch within TOLERANCE * max(1, max|ref|).
TOLERANCE = 1e-4


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _warm_up() -> None:
    """Convert, optimize, save, load and run a tiny model once."""
    import torch

    from coreai_torch import TorchConverter
    from coreai_torch.frontend.export import export_decomposed
    from coreai_torch.runtime import Session
    from coreai_torch.verify import run_entrypoint

    model, args = torch.nn.Sequential(torch.nn.Linear(4, 4)).eval(), (torch.randn(2, 4),)
    program = TorchConverter().add_exported_program(export_decomposed(model, args)).to_coreai()
    with Session(program.optimize()) as session:
        run_entrypoint(session, program, args)


def save_load_run(
    program: Any, args: Any, memory: Any, runs: int, name: str, result: dict[str, Any]
) -> list[Any]:
    """Save ``program``, load it on the runtime, call it once to warm up and ``runs`` times
    more: records save/load time and peak RSS, asset bytes and the median latency in
    ``result``; returns the outputs of the warm-up call."""
    from coreai_torch.runtime import Session
    from coreai_torch.verify import run_entrypoint

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{name}.aimodel"
        with memory.phase("save"):
            start = time.perf_counter()
            program.save_asset(path)
            result["save_s"] = time.perf_counter() - start
        result["asset_bytes"] = _dir_size(path)

        with memory.phase("load"):
            start = time.perf_counter()
            session = Session(path)
            session.open()
            session.function("main")
            result["load_s"] = time.perf_counter() - start
        try:
            actual = run_entrypoint(session, program, args)  # warm-up
            latencies = []
            for _ in range(runs):
                start = time.perf_counter()
                run_entrypoint(session, program, args)
                latencies.append(time.perf_counter() - start)
        finally:
            session.close()
    result.update({f"{phase}_rss": peak for phase, peak in memory.peaks.items()})
    result["latency_ms"] = statistics.median(latencies) * 1000
    return actual


def measure(name: str, runs: int) -> dict[str, Any]:
    """Convert, save, load and run one model; returns the measurements."""
    import torch

    from benchmarks.memory import PhaseMemory
    from benchmarks.models import MODELS
    from coreai_torch import TorchConverter
    from coreai_torch.frontend.export import export_decomposed
    from coreai_torch.verify import compare, eager_outputs

    torch.manual_seed(0)
    model, args = MODELS[name].build()
    weight_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    result: dict[str, Any] = {"model": name, "weight_bytes": weight_bytes}

    start = time.perf_counter()
    ep = export_decomposed(model, args)
    result["export_s"] = time.perf_counter() - start
    _warm_up()

    memory = PhaseMemory()
    result["memory_method"] = memory.method
    with memory.phase("to_coreai"):
        start = time.perf_counter()
        program = TorchConverter().add_exported_program(ep).to_coreai()
        result["to_coreai_s"] = time.perf_counter() - start
    with memory.phase("optimize"):
        start = time.perf_counter()
        program.optimize()
        result["optimize_s"] = time.perf_counter() - start
    actual = save_load_run(program, args, memory, runs, name, result)

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
    result["max_ref"] = max(float(e.abs().max()) for e in expected)
    result["targets"] = targets(result)
    return result


def measure_ablation(name: str, runs: int) -> dict[str, Any]:
    """The IR ablation of one model (see ``benchmarks/ablation.py``)."""
    import torch

    from benchmarks import ablation
    from benchmarks.models import ABLATION_MODELS
    from coreai_torch.frontend.export import export_decomposed

    torch.manual_seed(0)
    model, args = ABLATION_MODELS[name].build()
    ep = export_decomposed(model, args)
    _warm_up()
    return {"model": name, "runs": runs, "ablation": ablation.measure_ablation(ep, args, runs)}


def targets(r: dict[str, Any]) -> dict[str, bool | None]:
    """Pass (True) / fail (False) per target; None where a target does not apply."""
    weights = r["weight_bytes"]
    return {
        "to_coreai_rss": r["to_coreai_rss"] <= RSS_TARGET * weights,
        "asset": r["asset_bytes"] <= ASSET_TARGET * weights,
        "to_coreai_s": (
            r["to_coreai_s"] <= TO_COREAI_TARGET_S if r["model"] == TO_COREAI_TARGET_MODEL else None
        ),
        "max_abs_err": r["max_abs_err"] <= TOLERANCE * max(1.0, r["max_ref"]),
    }


def _mb(n: float) -> str:
    return f"{n / 2**20:,.0f} MB"


def _share(n: float, weights: int) -> str:
    return f"{_mb(n)} ({100 * n / weights:.1f}%)"


def _mark(ok: bool | None) -> str:
    return "—" if ok is None else ("pass" if ok else "FAIL")


def table(results: list[dict[str, Any]]) -> str:
    """Measurements (times, peak RSS above the pre-conversion baseline, sizes) and targets."""
    lines = [
        "| model | weights | to_coreai | optimize | save_asset | load | +RSS to_coreai | "
        "+RSS optimize | +RSS save | +RSS load | asset | latency | eager |",
        "|" + "---|" * 13,
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['model']} | failed: {r['error'][:80]} |" + " |" * 11)
            continue
        w = r["weight_bytes"]
        lines.append(
            f"| {r['model']} | {_mb(w)} | {r['to_coreai_s']:.3f} s | {r['optimize_s']:.2f} s | "
            f"{r['save_s']:.2f} s | {r['load_s']:.2f} s | {_share(r['to_coreai_rss'], w)} | "
            f"{_share(r['optimize_rss'], w)} | {_share(r['save_rss'], w)} | "
            f"{_share(r['load_rss'], w)} | {_share(r['asset_bytes'], w)} | "
            f"{r['latency_ms']:.1f} ms | {r['eager_ms']:.1f} ms |"
        )
    lines += [
        "",
        f"| model | to_coreai +RSS ≤ {RSS_TARGET:.0%} of weights | asset ≤ weights + "
        f"{ASSET_TARGET - 1:.0%} | to_coreai ≤ {TO_COREAI_TARGET_S} s ({TO_COREAI_TARGET_MODEL}) "
        f"| max abs err ≤ {TOLERANCE:g}·max(1, max abs ref) |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            continue
        t, w = r["targets"], r["weight_bytes"]
        tol = TOLERANCE * max(1.0, r["max_ref"])
        lines.append(
            f"| {r['model']} | {100 * r['to_coreai_rss'] / w:.1f}% {_mark(t['to_coreai_rss'])} | "
            f"{100 * r['asset_bytes'] / w:.1f}% {_mark(t['asset'])} | "
            f"{r['to_coreai_s']:.3f} s {_mark(t['to_coreai_s'])} | "
            f"{r['max_abs_err']:.1e} ≤ {tol:.1e} {_mark(t['max_abs_err'])} |"
        )
    return "\n".join(lines)


def _child(kind: str, name: str, runs: int) -> dict[str, Any]:
    """Run one measurement in a fresh interpreter started in the repository root."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", kind, name, "--runs", str(runs)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        print("   failed:\n   " + "\n   ".join(tail))
        return {"model": name, "error": " / ".join(tail)}
    return json.loads(line[len("RESULT ") :])


def main(argv: list[str] | None = None) -> int:
    from benchmarks.ablation import ablation_table
    from benchmarks.kernels import kernel_table
    from benchmarks.models import ABLATION_MODELS, MODELS
    from benchmarks.moe import PARTS, moe_table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument(
        "--ablation",
        action="store_true",
        help=f"also measure the IR ablation on {', '.join(ABLATION_MODELS)}",
    )
    parser.add_argument("--ablation-runs", type=int, default=15)
    parser.add_argument(
        "--large", action="store_true", help="also convert the 1.26B Llama (benchmarks/large.py)"
    )
    parser.add_argument(
        "--no-precision", action="store_true", help="skip the fp32 / fp16 / bf16 table"
    )
    parser.add_argument("--precision-runs", type=int, default=5)
    parser.add_argument("--one-precision", help=argparse.SUPPRESS)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--one-ablation", help=argparse.SUPPRESS)
    parser.add_argument("--one-kernels", help=argparse.SUPPRESS)
    parser.add_argument("--one-large", help=argparse.SUPPRESS)
    parser.add_argument(
        "--compression",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the compression table (the 0.27B Llama per weight form)",
    )
    parser.add_argument("--compression-runs", type=int, default=3)
    parser.add_argument("--one-compression", help=argparse.SUPPRESS)
    parser.add_argument("--one-llm", help=argparse.SUPPRESS)
    parser.add_argument("--no-llm", action="store_true", help="skip the LLM table")
    parser.add_argument("--one-moe", help=argparse.SUPPRESS)
    parser.add_argument("--one-hf", help=argparse.SUPPRESS)
    parser.add_argument("--no-hf", action="store_true", help="skip the Hugging Face table")
    parser.add_argument("--one-server", help=argparse.SUPPRESS)
    parser.add_argument(
        "--no-server", action="store_true", help="skip the server table (coreai-torch serve)"
    )
    parser.add_argument("--one-streaming", help=argparse.SUPPRESS)
    parser.add_argument(
        "--no-streaming", action="store_true", help="skip the 1B Llama streamed from its checkpoint"
    )
    parser.add_argument("--one-diffusion", help=argparse.SUPPRESS)
    parser.add_argument(
        "--no-diffusion", action="store_true", help="skip the SD-1.5 UNet (benchmarks/diffusion.py)"
    )
    parser.add_argument(
        "--8b",
        dest="eight_b",
        action="store_true",
        help="also stream an 8B Llama, fp16 and fp16+int4 (about 35 GB of free disk)",
    )
    args = parser.parse_args(argv)

    if args.one:  # child process: measure one model, print JSON
        print("RESULT " + json.dumps(measure(args.one, args.runs)))
        return 0
    if args.one_ablation:
        print("RESULT " + json.dumps(measure_ablation(args.one_ablation, args.runs)))
        return 0
    if args.one_large:
        from benchmarks.large import measure_if_possible

        print("RESULT " + json.dumps(measure_if_possible(int4=args.one_large == "int4")))
        return 0
    if args.one_compression:
        from benchmarks.compression import measure_compression

        print("RESULT " + json.dumps(measure_compression(args.one_compression, args.runs)))
        return 0
    if args.one_precision:
        from benchmarks.precision import measure_precision

        print("RESULT " + json.dumps(measure_precision(args.one_precision, args.runs)))
        return 0
    if args.one_kernels:
        from benchmarks.kernels import measure_kernels

        print("RESULT " + json.dumps({"model": "kernels", "rows": measure_kernels(args.runs)}))
        return 0
    if args.one_llm:
        from benchmarks.llm import measure_llm

        print("RESULT " + json.dumps(measure_llm(args.one_llm, args.runs)))
        return 0
    if args.one_hf:
        from benchmarks.hf import measure_hf

        print("RESULT " + json.dumps(measure_hf(args.one_hf, args.runs)))
        return 0
    if args.one_server:
        from benchmarks.server import measure_server

        print("RESULT " + json.dumps(measure_server(args.one_server, args.runs)))
        return 0
    if args.one_diffusion:
        import tempfile

        from benchmarks.diffusion import measure as measure_diffusion

        with tempfile.TemporaryDirectory(prefix="coreai_bench_diffusion_") as scratch:
            print("RESULT " + json.dumps(measure_diffusion(Path(scratch))))
        return 0
    if args.one_streaming:
        from benchmarks.streaming import measure_streaming

        print("RESULT " + json.dumps(measure_streaming(args.one_streaming), default=str))
        return 0
    if args.one_moe:
        from benchmarks.moe import measure_moe

        print("RESULT " + json.dumps(measure_moe(args.one_moe, args.runs)))
        return 0

    results, ablations = [], []
    for name in args.models:
        print(f"== {name}: {MODELS[name].description}", flush=True)
        results.append(_child("--one", name, args.runs))
    if args.ablation:
        for name, spec in ABLATION_MODELS.items():
            print(f"== IR ablation, {name}: {spec.description}", flush=True)
            ablations.append(_child("--one-ablation", name, args.ablation_runs))
    large_results = []
    if args.large:
        for variant in ("fp32", "int4"):
            print(
                f"== large model: converting a 1.26B Llama ({variant}) vs the write floor",
                flush=True,
            )
            large_results.append(_child("--one-large", variant, args.runs))
    compressed = []
    if args.compression:
        from benchmarks.compression import FORMS

        for form in FORMS:
            print(f"== compression: the 0.27B Llama as {form}", flush=True)
            compressed.append(_child("--one-compression", form, args.compression_runs))
    precisions = []
    if not args.no_precision:
        from benchmarks.precision import PRECISIONS

        for name in args.models:
            for precision in PRECISIONS:
                print(f"== {name} in {precision}", flush=True)
                spec = f"{name}:{precision}"
                precisions.append(_child("--one-precision", spec, args.precision_runs))
    print("== single-op throughput (the runtime's own kernels)", flush=True)
    kernels = _child("--one-kernels", "all", args.runs)
    llms = []
    if not args.no_llm:
        from benchmarks.llm import MODELS as LLM_MODELS
        from benchmarks.llm import VARIANTS

        for variant, (llm_model, _) in VARIANTS.items():
            print(
                f"== LLM, {LLM_MODELS[llm_model]} through coreai_torch.llm ({variant})", flush=True
            )
            llms.append(_child("--one-llm", variant, min(args.runs, 3)))
    print("== mixture of experts (benchmarks/moe.py)", flush=True)
    moe = [_child("--one-moe", part, args.runs) for part in PARTS]
    hf_rows = []
    if not args.no_hf:
        from benchmarks.hf import ROWS as HF_ROWS

        for row in HF_ROWS:
            print(f"== Hugging Face classes (benchmarks/hf.py): {row}", flush=True)
            hf_rows.append(_child("--one-hf", row, min(args.runs, 5)))
    served = []
    if not args.no_server:
        print("== server: coreai-torch serve at 1, 4, 8 clients (benchmarks/server.py)", flush=True)
        served.append(_child("--one-server", "llama", min(args.runs, 3)))
    streamed = []
    if not args.no_streaming:
        specs = [
            "1b:int4",
            "1b:int4+calibration",
            *(["8b:int4", "8b:none"] if args.eight_b else []),
        ]
        for spec in specs:
            print(f"== streaming export (benchmarks/streaming.py): {spec}", flush=True)
            streamed.append(_child("--one-streaming", spec, 1))
    diffusion = []
    if not args.no_diffusion:
        print("== SD-1.5 UNet from its checkpoint (benchmarks/diffusion.py)", flush=True)
        diffusion.append(_child("--one-diffusion", "unet", 1))
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "results.json"
    out.write_text(
        json.dumps(
            {
                "models": results,
                "ablation": ablations,
                "compression": compressed,
                "kernels": kernels,
                "large": large_results,
                "precision": precisions,
                "llm": llms,
                "moe": moe,
                "hf": hf_rows,
                "server": served,
                "streaming": streamed,
                "diffusion": diffusion,
            },
            indent=2,
        )
    )
    if results:
        method = next((r["memory_method"] for r in results if "memory_method" in r), "?")
        print(f"\nPeak RSS above the pre-conversion baseline ({method}).\n")
        print(table(results))
    if ablations:
        print(
            f"\nIR ablation: median / min latency over {args.ablation_runs} interleaved rounds "
            "(Δ: median vs full).\n"
        )
        print(ablation_table(ablations))
    if compressed:
        from benchmarks.compression import compression_table

        print("\nCompressed weights (AIProgram.compress), peak RSS above the exported model.\n")
        print(compression_table(compressed))
    if precisions:
        from benchmarks.precision import ASSET_RATIO_TARGET, precision_table

        print(
            f"\nCompute precision (median of {args.precision_runs} runs; half-precision assets "
            f"≤ {ASSET_RATIO_TARGET}× the fp32 one).\n"
        )
        print(precision_table(precisions))
    if "rows" in kernels:
        print(
            f"\nSingle ops, median of {args.runs} runs "
            "(no IR to simplify: the runtime's kernels).\n"
        )
        print(kernel_table(kernels["rows"]))
    if large_results:
        from benchmarks.large import table as large_table

        print("\nLarge model (conversion only; noisy on a shared machine).\n")
        print("\n\n".join(large_table(r) for r in large_results))
    if llms:
        from benchmarks.llm import llm_table

        print("\nLLM (llm.export + llm.Generator), median of the runs.\n")
        print(llm_table(llms))
    print("\nMixture of experts (rewrite_moe), median of runs:\n")
    print(moe_table(moe))
    if hf_rows:
        from benchmarks.hf import hf_table

        print("\nHugging Face classes (coreai_torch.hf), median of the runs.\n")
        print(hf_table(hf_rows))
    if served:
        from benchmarks.server import NEW_TOKENS, PROMPT_TOKENS, server_table

        print(
            f"\nServing (coreai-torch serve, 0.27B Llama fp32; completions of {PROMPT_TOKENS} "
            f"prompt tokens + {NEW_TOKENS} new, greedy).\n"
        )
        print(server_table(served))
    if streamed:
        from benchmarks.streaming import table as streaming_table

        print(
            "\nStreamed export (llm.export from a bf16 checkpoint, max_context 512, fp16; "
            "whole-process peak RSS).\n"
        )
        print(streaming_table(streamed))
    if diffusion:
        from benchmarks.diffusion import table as diffusion_table

        print("\nDiffusion: an SD-1.5-shaped UNet exported from its fp16 checkpoint (fp16).\n")
        print(diffusion_table(diffusion[0]))
    print(f"\nJSON: {out}")
    measured = [
        *results,
        *ablations,
        *compressed,
        *precisions,
        kernels,
        *large_results,
        *llms,
        *moe,
        *hf_rows,
        *served,
        *streamed,
        *diffusion,
    ]
    failed = any("error" in r for r in measured)
    return 1 if failed or any(r.get("within_bound") is False for r in compressed) else 0


if __name__ == "__main__":
    raise SystemExit(main())
