"""Mixture of experts: a small Mixtral-style model (8 experts, top-2) through ``rewrite_moe``.

* Model rows: asset size against the weight bytes, and the latency of a 64-token prefill and of
  one token (a decode step's MoE and projection work; the KV cache is the LLM API's) with each
  way of running the experts (``GatedExperts`` strategies): ``gather`` (each token's 2 experts'
  weights gathered) and ``dense`` (every expert on every token); ``auto`` picks ``dense`` for
  the prefill and ``gather`` for one token. Every row is checked against Hugging Face eager.
* Expert sweep: one MoE block (top-2, fixed sizes) with 4..32 experts: does the runtime's
  latency follow the 2 active experts or all of them?

    python -m benchmarks.run --models            # only the MoE and kernel tables
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from benchmarks.kernels import _median_seconds

#: The benchmark model: Mixtral layout, 8 experts, top-2 (about 27M parameters, 108 MB).
MODEL = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    use_cache=False,
)
PREFILL_TOKENS = 64
#: The expert sweep: one block of this size with each number of experts (top-2).
SWEEP_BLOCK = dict(hidden_size=512, intermediate_size=1408, num_experts_per_tok=2)
SWEEP_EXPERTS = (4, 8, 16, 32)


class _Logits(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, use_cache=False, return_dict=False)[0]


class _BlockOutput(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return out[0] if isinstance(out, tuple) else out


def _mixtral(**config: Any) -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(**config)
    config._attn_implementation = "sdpa"
    return MixtralForCausalLM(config).eval()


def _weight_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def _measure_program(
    static: nn.Module, reference: nn.Module, args: tuple[torch.Tensor, ...], runs: int
) -> dict[str, Any]:
    """Convert ``static``, save it, run it ``runs`` times; errors against ``reference``."""
    from coreai_torch import TorchConverter
    from coreai_torch.frontend.export import export_decomposed
    from coreai_torch.runtime import Session
    from coreai_torch.verify import run_entrypoint

    program = TorchConverter().add_exported_program(export_decomposed(static, args)).to_coreai()
    program.optimize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "moe.aimodel"
        program.save_asset(path)
        asset = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        with Session(path) as session:
            (actual,) = run_entrypoint(session, program, args)
            seconds = _median_seconds(lambda: run_entrypoint(session, program, args), runs)
    with torch.no_grad():
        expected = reference(*args)
        eager = _median_seconds(lambda: reference(*args), runs)
    return {
        "asset_bytes": asset,
        "latency_ms": seconds * 1e3,
        "hf_eager_ms": eager * 1e3,
        "max_abs_err": float((torch.as_tensor(actual) - expected).abs().max()),
        "max_ref": float(expected.abs().max()),
    }


#: The measurements, each run in its own process by ``benchmarks/run.py`` (memory stays that
#: of one model: about 1.2 GB for the model, 1.8 GB for the 32-expert block).
PARTS = ["model", *(f"experts-{n}" for n in SWEEP_EXPERTS)]


def measure_moe(part: str, runs: int) -> dict[str, Any]:
    """One part of :data:`PARTS`: the model rows, or the block with ``experts-<n>`` experts."""
    import copy

    from coreai_torch import rewrite_moe

    if part == "model":
        hf = _Logits(_mixtral(**MODEL))
        rows = []
        for tokens in (PREFILL_TOKENS, 1):
            ids = torch.randint(0, MODEL["vocab_size"], (1, tokens))
            for strategy in ("gather", "dense"):
                static = rewrite_moe(copy.deepcopy(hf), strategy=strategy)
                row = _measure_program(static, hf, (ids,), runs)
                rows.append({"tokens": tokens, "strategy": strategy, **row})
                del static
        return {"part": part, "weight_bytes": _weight_bytes(hf), "rows": rows}

    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    experts = int(part.removeprefix("experts-"))
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(MixtralConfig(num_local_experts=experts, **SWEEP_BLOCK)).eval()
    rows = []
    for tokens, strategy in ((1, "gather"), (1, "dense"), (PREFILL_TOKENS, "dense")):
        x = torch.randn(1, tokens, SWEEP_BLOCK["hidden_size"])
        static = _BlockOutput(rewrite_moe(copy.deepcopy(block), strategy=strategy))
        row = _measure_program(static, _BlockOutput(block), (x,), runs)
        rows.append({"experts": experts, "tokens": tokens, "strategy": strategy, **row})
        del static
    return {"part": part, "rows": rows}


def moe_table(parts: list[dict[str, Any]]) -> str:
    """The model table and the expert sweep table from the results of :data:`PARTS`."""
    lines: list[str] = []
    for part in parts:
        if "error" in part:
            lines.append(f"{part.get('model', '?')}: failed: {part['error'][:200]}")
    model = next((p for p in parts if p.get("part") == "model"), None)
    if model is not None:
        weights = model["weight_bytes"]
        lines += [
            f"Mixtral-style model, {MODEL['num_local_experts']} experts, top-"
            f"{MODEL['num_experts_per_tok']}, hidden {MODEL['hidden_size']}, "
            f"{MODEL['num_hidden_layers']} layers: weights {weights / 2**20:,.0f} MB",
            "",
            "| tokens | experts run as | asset | latency | HF eager | max abs err |",
            "|---|---|---|---|---|---|",
        ]
        for r in model["rows"]:
            lines.append(
                f"| {r['tokens']} | {r['strategy']} | {r['asset_bytes'] / 2**20:,.0f} MB "
                f"({100 * r['asset_bytes'] / weights:.1f}%) | {r['latency_ms']:.2f} ms | "
                f"{r['hf_eager_ms']:.2f} ms | {r['max_abs_err']:.1e} "
                f"(max ref {r['max_ref']:.2g}) |"
            )
        lines.append("")
    sweep = [p for p in parts if str(p.get("part", "")).startswith("experts-")]
    if sweep:
        lines += [
            f"One MoE block (hidden {SWEEP_BLOCK['hidden_size']}, expert MLP "
            f"{SWEEP_BLOCK['intermediate_size']}, top-{SWEEP_BLOCK['num_experts_per_tok']}) "
            "by number of experts:",
            "",
            "| experts | 1 token, gather | 1 token, dense | "
            f"{PREFILL_TOKENS} tokens, dense | HF eager, {PREFILL_TOKENS} tokens |",
            "|---|---|---|---|---|",
        ]
        for part in sweep:
            cells = {(r["tokens"], r["strategy"]): r for r in part["rows"]}
            prefill = cells[(PREFILL_TOKENS, "dense")]
            lines.append(
                f"| {part['rows'][0]['experts']} | {cells[(1, 'gather')]['latency_ms']:.2f} ms | "
                f"{cells[(1, 'dense')]['latency_ms']:.2f} ms | {prefill['latency_ms']:.2f} ms | "
                f"{prefill['hf_eager_ms']:.2f} ms |"
            )
    return "\n".join(lines)
