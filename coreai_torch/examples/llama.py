"""A Llama-style decoder with a static KV cache held in registered buffers.

The cache buffers are mutated in place (``index_copy_``), so the converter turns them into
Core AI states.  Export the same module twice — a prefill with ``T`` tokens and a decode step
with one token — and stage both as entry points of one program: they share their weights
(stored once) and their states (the caches)::

    model = LlamaKV(LlamaConfig()).eval()
    prefill = export_decomposed(model, model.example_inputs(8))
    decode = export_decomposed(model, model.example_inputs(1))
    program = (TorchConverter()
               .add_exported_program(prefill, entrypoint_name="prefill")
               .add_exported_program(decode, entrypoint_name="decode")
               .to_coreai())

Inputs: ``token_ids`` ``(1, T)`` int64 and ``positions`` ``(T,)`` int64 (where the tokens go in
the cache).  Output: ``logits`` ``(1, T, vocab)``.  Norms, rotary embeddings and attention are
``coreai_torch.composite_ops`` modules, so they can be externalized as composite ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from coreai_torch.composite_ops import SDPA, RMSNorm, RoPE, rope_cos_sin


@dataclass
class LlamaConfig:
    vocab_size: int = 256
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    layers: int = 2
    max_len: int = 32
    rope_base: float = 10000.0
    eps: float = 1e-6


class Attention(nn.Module):
    k_cache: torch.Tensor
    v_cache: torch.Tensor

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads = cfg.heads, cfg.kv_heads
        self.head_dim = cfg.hidden // cfg.heads
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * self.head_dim, cfg.hidden, bias=False)
        self.rope = RoPE()
        self.sdpa = SDPA(enable_gqa=cfg.kv_heads != cfg.heads)
        shape = (1, cfg.kv_heads, cfg.max_len, self.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape))
        self.register_buffer("v_cache", torch.zeros(shape))

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        self.k_cache.index_copy_(2, positions, k)
        self.v_cache.index_copy_(2, positions, v)
        y = self.sdpa(q, self.k_cache, self.v_cache, mask)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden, eps=cfg.eps)
        self.attn = Attention(cfg)
        self.post_norm = RMSNorm(cfg.hidden, eps=cfg.eps)
        self.gate = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.up = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.down = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), positions, cos, sin, mask)
        h = self.post_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class LlamaKV(nn.Module):
    """Token ids + cache positions -> logits; the KV cache lives in buffers (Core AI states)."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, cfg: LlamaConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or LlamaConfig()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, eps=cfg.eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        cos, sin = rope_cos_sin(cfg.max_len, cfg.hidden // cfg.heads, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        # query i attends to cache slots <= positions[i]
        mask = (
            torch.arange(self.cfg.max_len, device=positions.device)[None, :] <= positions[:, None]
        )
        x = self.embed(token_ids)
        for layer in self.layers:
            x = layer(x, positions, cos, sin, mask)
        return self.lm_head(self.norm(x))

    def example_inputs(self, tokens: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``(token_ids, positions)`` for ``tokens`` tokens written at ``start``."""
        ids = torch.randint(0, self.cfg.vocab_size, (1, tokens), dtype=torch.int64)
        return ids, torch.arange(start, start + tokens, dtype=torch.int64)

    def reset_cache(self) -> None:
        for layer in cast("list[DecoderLayer]", self.layers):
            layer.attn.k_cache.zero_()
            layer.attn.v_cache.zero_()


def init_weights(model: nn.Module, gain: float = 1.0) -> None:
    """Fan-in scaled random weights, so activations and logits stay O(1) through the stack."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                std = gain / (p.shape[1] ** 0.5) if "embed" not in name else 1.0
                p.normal_(0.0, std)
            elif name.endswith("weight"):
                p.uniform_(0.8, 1.2)
