"""The LLM table of ``make bench``: the 0.27B benchmark Llama exported with
``coreai_torch.llm.export`` and run with ``coreai_torch.llm.Generator``, in float32, float16,
with int4 weights and both; and a small Mixtral-style model (8 experts, top-2, the layout of
``benchmarks/moe.py``) in float32 and with int4 weights.

Per variant: export time, asset size, KV-cache state bytes, prefill tokens/s for a 128-token
prompt and decode tokens/s over the following steps, and the prefill logits' error against
the float32 model in eager PyTorch (for compressed weights, the error of the compression
too).

    python -m benchmarks.run --one-llm fp16+int4     # one variant, as make bench runs it
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch.nn as nn

#: variant -> (model, llm.export options)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "fp32": ("llama", {}),
    "fp16": ("llama", {"precision": "fp16"}),
    "int4": ("llama", {"compress": "int4"}),
    "fp16+int4": ("llama", {"precision": "fp16", "compress": "int4"}),
    "mixtral": ("mixtral", {}),
    "mixtral+int4": ("mixtral", {"compress": "int4"}),
}
MODELS = {"llama": "0.27B Llama", "mixtral": "Mixtral-style, 8 experts, top-2 (27M)"}
MAX_CONTEXT = 512
PROMPT_TOKENS = 128
DECODE_STEPS = 16


def _model(name: str) -> nn.Module:
    import torch

    torch.manual_seed(0)
    if name == "llama":
        from benchmarks.models import llama_causal_lm

        return llama_causal_lm(use_cache=True)
    from benchmarks.moe import MODEL, _mixtral

    return _mixtral(**{**MODEL, "max_position_embeddings": MAX_CONTEXT, "use_cache": True})


def measure_llm(variant: str, runs: int) -> dict[str, Any]:
    """Export, save, load and generate with one variant; returns the measurements."""
    import numpy as np
    import torch

    from coreai_torch import llm

    name, options = VARIANTS[variant]
    model = _model(name)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    result: dict[str, Any] = {"variant": variant, "model": MODELS[name]}
    result["weight_bytes"] = weight_bytes
    prompt = torch.randint(0, model.config.vocab_size, (PROMPT_TOKENS,)).tolist()
    with torch.no_grad():
        expected = model(torch.tensor([prompt])).logits[0, -1].numpy()
    start = time.perf_counter()
    program = llm.export(model, max_context=MAX_CONTEXT, **options)
    result["export_s"] = time.perf_counter() - start
    del model
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llm.aimodel"
        program.save_asset(path)
        del program
        result["asset_bytes"] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        with llm.Generator(path, max_context=MAX_CONTEXT) as generator:
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
    result["max_abs_err"] = float(np.abs(first[0].astype(np.float32) - expected).max())
    result["max_ref"] = float(np.abs(expected).max())
    return result


def llm_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of :func:`measure_llm` results."""
    lines = [
        "| variant | model | export | asset | KV-cache state | prefill (128 tokens) | decode | "
        "max abs err vs fp32 eager (prefill logits) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r.get('variant', r.get('model'))} | failed: {r['error']} |||||||")
            continue
        lines.append(
            f"| {r['variant']} | {r['model']} | {r['export_s']:.1f} s | "
            f"{r['asset_bytes'] / 2**20:.1f} MiB "
            f"({100 * r['asset_bytes'] / r['weight_bytes']:.1f}% of the fp32 weights) | "
            f"{r['state_bytes'] / 2**20:.1f} MiB | {r['prefill_tokens_per_s']:.1f} tokens/s | "
            f"{r['decode_tokens_per_s']:.2f} tokens/s | "
            f"{r['max_abs_err']:.1e} (max ref {r['max_ref']:.1f}) |"
        )
    return "\n".join(lines)
