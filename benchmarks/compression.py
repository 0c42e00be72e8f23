"""The compression table of ``make bench``: the benchmark Llama (0.27B) converted as fp32 and
with its weights compressed (``AIProgram.compress``) as int8 per channel, int4 in blocks of
32 and 4-bit palettes.

Per form, in a fresh process: the asset's bytes against the fp32 weight bytes (bounds: int8
≤ 0.26×, int4 blocks of 32 ≤ 0.16×, 4-bit palettes ≤ 0.14×), conversion time (to_coreai,
compress, optimize: compressing first, no transposed float copies are made) and its peak RSS
above the exported model, the RSS the runtime adds to load the asset, latency per forward
(the Linux CPU runtime decompresses every weight on every call: compressed forms are slower
than fp32 here), and the SNR of the logits against fp32 eager PyTorch.

    python -m benchmarks.run --models --compression-runs 3     # only this table (and kernels)
"""

from __future__ import annotations

import math
import time
from typing import Any

#: form -> ``compression.from_spec`` name (None: not compressed)
FORMS: dict[str, str | None] = {
    "fp32": None,
    "int8": "int8",
    "int4-b32": "int4",
    "palette4": "palette4",
}
#: asset bytes / fp32 weight bytes each form must stay under
BOUNDS = {"int8": 0.26, "int4-b32": 0.16, "palette4": 0.14}
MODEL = "llama-0.27b"


def snr_db(reference: Any, actual: Any) -> float:
    """10·log10(Σ ref² / Σ (ref - actual)²) in dB (inf when equal)."""
    import numpy as np

    ref = np.asarray(reference, dtype=np.float64)
    noise = float(np.square(ref - np.asarray(actual, dtype=np.float64)).sum())
    signal = float(np.square(ref).sum())
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


def measure_compression(form: str, runs: int) -> dict[str, Any]:
    """Convert, compress, save, load and run the benchmark Llama as ``form``."""
    import torch

    from benchmarks.memory import PhaseMemory
    from benchmarks.models import MODELS
    from benchmarks.run import _warm_up, save_load_run
    from coreai_torch import TorchConverter, compression
    from coreai_torch.frontend.export import export_decomposed
    from coreai_torch.verify import eager_outputs

    torch.manual_seed(0)
    model, args = MODELS[MODEL].build()
    weight_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    result: dict[str, Any] = {"form": form, "model": MODEL, "weight_bytes": weight_bytes}
    reference = eager_outputs(model, args)[0]
    ep = export_decomposed(model, args)
    _warm_up()

    memory = PhaseMemory()
    result["memory_method"] = memory.method
    with memory.phase("convert"):  # compress before optimize(), as the CLI does
        start = time.perf_counter()
        program = TorchConverter().add_exported_program(ep).to_coreai()
        result["to_coreai_s"] = time.perf_counter() - start
        spec = FORMS[form]
        start = time.perf_counter()
        if spec is not None:
            report = program.compress(compression.from_spec(spec))
            result["compressed_weights"] = len(report.weights)
            result["compressed_bytes"] = report.bytes_after
            result["weight_snr_db"] = min((w.snr_db for w in report.weights), default=math.inf)
        result["compress_s"] = time.perf_counter() - start
        start = time.perf_counter()
        program.optimize()
        result["optimize_s"] = time.perf_counter() - start
    actual = save_load_run(program, args, memory, runs, form, result)[0]
    result["logits_snr_db"] = snr_db(reference.numpy(), actual)
    result["ratio"] = result["asset_bytes"] / weight_bytes
    bound = BOUNDS.get(form)
    result["within_bound"] = None if bound is None else result["ratio"] <= bound
    return result


def _mb(n: float) -> str:
    return f"{n / 2**20:,.0f} MB"


def compression_table(results: list[dict[str, Any]]) -> str:
    """One row per form: asset size and bound, conversion, load, latency, logits SNR."""
    lines = [
        f"| form ({MODEL}) | asset | asset / fp32 weights | bound | convert: to_coreai + "
        "compress + optimize | +RSS convert | +RSS save | +RSS load | latency / forward | "
        "logits SNR vs fp32 eager |",
        "|" + "---|" * 10,
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r.get('form', '?')} | failed: {r['error'][:80]} |" + " |" * 8)
            continue
        bound = BOUNDS.get(r["form"])
        mark = "—" if bound is None else f"≤ {bound:.2f} {'pass' if r['within_bound'] else 'FAIL'}"
        snr = r["logits_snr_db"]
        lines.append(
            f"| {r['form']} | {_mb(r['asset_bytes'])} | {r['ratio']:.3f}× | {mark} | "
            f"{r['to_coreai_s']:.1f} + {r['compress_s']:.1f} + {r['optimize_s']:.1f} s | "
            f"{_mb(r['convert_rss'])} | {_mb(r['save_rss'])} | {_mb(r['load_rss'])} | "
            f"{r['latency_ms']:,.0f} ms | {'exact' if math.isinf(snr) else f'{snr:.1f} dB'} |"
        )
    return "\n".join(lines)
