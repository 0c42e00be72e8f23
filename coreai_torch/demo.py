"""``make demo`` / ``coreai-torch demo``: convert a small transformer, run it, compare with PyTorch.

python -m coreai_torch.demo [--out build/demo]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from coreai_torch.converter import TorchConverter
from coreai_torch.verify import compare, eager_outputs, export_decomposed, run_entrypoint


class TransformerBlock(nn.Module):
    """A pre-norm decoder block with causal self-attention and a GELU MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Token embedding, two transformer blocks and a language-model head."""

    def __init__(
        self, vocab: int = 256, dim: int = 64, heads: int = 4, layers: int = 2, context: int = 32
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(context, dim) * 0.1)
        self.blocks = nn.ModuleList(TransformerBlock(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(token_ids) + self.pos[: token_ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return logits, logits.argmax(-1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("build/demo"),
        help="directory for the .aimodel (default: build/demo)",
    )
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model = TinyLM().eval()
    token_ids = torch.randint(0, 256, (1, 16), dtype=torch.int64)
    print(
        f"model: TinyLM, {sum(p.numel() for p in model.parameters()):,} parameters; "
        f"input token_ids {tuple(token_ids.shape)} int64"
    )

    start = time.perf_counter()
    ep = export_decomposed(model, (token_ids,))
    export_s = time.perf_counter() - start
    start = time.perf_counter()
    program = (
        TorchConverter()
        .add_exported_program(ep, input_names=["token_ids"], output_names=["logits", "next_token"])
        .to_coreai()
    )
    convert_s = time.perf_counter() - start
    start = time.perf_counter()
    program.optimize()
    optimize_s = time.perf_counter() - start

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "tiny_lm.aimodel"
    start = time.perf_counter()
    program.save_asset(path)
    save_s = time.perf_counter() - start
    print(
        f"torch.export + decompositions {export_s:.2f} s | to_coreai {convert_s:.3f} s | "
        f"optimize {optimize_s:.3f} s | save_asset {save_s:.3f} s -> {path}"
    )

    from coreai_torch.runtime import Session

    expected = eager_outputs(model, (token_ids,))
    start = time.perf_counter()
    with Session(path) as session:
        load_s = time.perf_counter() - start
        start = time.perf_counter()
        actual = run_entrypoint(session, program, (token_ids,))
        run_s = time.perf_counter() - start
    print(f"Core AI runtime: compile + load {load_s:.2f} s, inference {run_s * 1000:.1f} ms")
    print("output                   dtype    shape                max|err|   vs PyTorch")
    results = [
        compare(o.name, e, a)
        for o, e, a in zip(program.signatures["main"].outputs, expected, actual, strict=True)
    ]
    for result in results:
        print(result)
    ok = all(r.ok for r in results)
    print("MATCH: the converted program reproduces PyTorch" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
