"""The LLM table of ``make bench``: the 0.27B benchmark Llama exported with
``coreai_torch.llm.export`` and run with ``coreai_torch.llm.Generator``.

Per variant (fp32, and fp16 / int4 once ``llm.export`` accepts them): export time, asset
size, KV-cache state bytes, prefill tokens/s for a 128-token prompt and decode tokens/s over
the following steps, and the prefill logits' error against eager PyTorch.

    python -m benchmarks.run --one-llm fp32     # one variant, as make bench runs it
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

#: variant -> llm.export options
VARIANTS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "fp16": {"precision": "fp16"},
    "int4": {"compress": "int4"},
}
MAX_CONTEXT = 512
PROMPT_TOKENS = 128
DECODE_STEPS = 32


def measure_llm(variant: str, runs: int) -> dict[str, Any]:
    """Export, save, load and generate with one variant; returns the measurements."""
    import numpy as np
    import torch

    from benchmarks.models import llama_causal_lm
    from coreai_torch import llm

    torch.manual_seed(0)
    model = llama_causal_lm(use_cache=True)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    result: dict[str, Any] = {"variant": variant, "weight_bytes": weight_bytes}
    start = time.perf_counter()
    try:
        program = llm.export(model, max_context=MAX_CONTEXT, **VARIANTS[variant])
    except NotImplementedError as error:
        result["unavailable"] = str(error).split(";")[0]
        return result
    result["export_s"] = time.perf_counter() - start
    prompt = torch.randint(0, model.config.vocab_size, (PROMPT_TOKENS,)).tolist()
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0, -1].numpy()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llm.aimodel"
        program.save_asset(path)
        del program
        result["asset_bytes"] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        with llm.Generator(path) as generator:
            result["state_bytes"] = generator.state_bytes
            first: list[np.ndarray] = []
            list(generator.generate(prompt, max_new_tokens=2, on_logits=first.append))  # warm-up
            prefill, decode = [], []
            for _ in range(runs):
                list(generator.generate(prompt, max_new_tokens=DECODE_STEPS + 1))
                prefill.append(generator.stats.prefill_tokens_per_second)
                decode.append(generator.stats.decode_tokens_per_second)
    result["prefill_tokens_per_s"] = statistics.median(prefill)
    result["decode_tokens_per_s"] = statistics.median(decode)
    result["max_abs_err"] = float(np.abs(first[0] - expected).max())
    result["max_ref"] = float(np.abs(expected).max())
    return result


def llm_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of :func:`measure_llm` results."""
    lines = [
        "| variant | export | asset | KV-cache state | prefill (128 tokens) | decode | "
        "max abs err (prefill logits) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r or "unavailable" in r:
            why = r.get("unavailable") or f"failed: {r['error']}"
            lines.append(f"| {r.get('variant', r.get('model'))} | {why} | | | | | |")
            continue
        lines.append(
            f"| {r['variant']} | {r['export_s']:.1f} s | {r['asset_bytes'] / 2**20:.0f} MiB "
            f"({100 * r['asset_bytes'] / r['weight_bytes']:.1f}% of weights) | "
            f"{r['state_bytes'] / 2**20:.0f} MiB | {r['prefill_tokens_per_s']:.1f} tokens/s | "
            f"{r['decode_tokens_per_s']:.2f} tokens/s | "
            f"{r['max_abs_err']:.1e} (max ref {r['max_ref']:.1f}) |"
        )
    return "\n".join(lines)
