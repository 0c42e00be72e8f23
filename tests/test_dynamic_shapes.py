"""Programs exported with torch.export.Dim: converted once, run on the runtime at several sizes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.export import Dim

from coreai_torch import TorchConverter
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.program import AIProgram
from tests.helpers import check_runs


def convert(model: nn.Module, args: Sequence[Any], dynamic_shapes: Any) -> AIProgram:
    ep = export_decomposed(model, args, dynamic_shapes=dynamic_shapes)
    program = TorchConverter().add_exported_program(ep).to_coreai()
    program.optimize()
    return program


class Block(nn.Module):
    """Pre-norm transformer block: LayerNorm, grouped-query causal attention, GELU MLP."""

    def __init__(self, dim: int = 16, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.out = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 32), nn.GELU(), nn.Linear(32, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln1(x)
        q = self.q(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(h).split(self.kv_heads * self.head_dim, dim=-1)
        k = k.reshape(b, t, self.kv_heads, -1).transpose(1, 2)
        v = v.reshape(b, t, self.kv_heads, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


def test_transformer_block_dynamic_batch_and_sequence() -> None:
    model = Block().eval()
    batch, seq = Dim("batch", min=1, max=16), Dim("seq", min=2, max=256)
    program = convert(model, (torch.randn(2, 5, 16),), ({0: batch, 1: seq},))
    text = str(program)
    assert "tensor<?x?x16xf32>" in text  # one program with dynamic dims
    sizes = [(2, 5), (1, 17), (3, 64)]
    check_runs(model, program, [(torch.randn(b, t, 16),) for b, t in sizes])


class SizeArithmetic(nn.Module):
    """Tensor ops whose sizes are computed from symbolic dims."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b, t, d = x.shape
        counts = x.new_zeros(b, t * 2).sum(-1, keepdim=True) + t * d  # new_zeros, sym mul
        steps = torch.arange(t // 2).to(x.dtype) * 0.5  # arange(sym floordiv)
        head = x[:, : t - 1].reshape(b * (t - 1), d)  # symbolic slice end + view
        heads = x.view(b, t, 2, -1).transpose(1, 2).reshape(b, 2, -1)
        ends = x.select(1, -1) + x[:, 0] + x[:, -2]  # select / slice on a dynamic dim
        table = torch.full((b, 3), 1.5) * (t % 3)  # sym mod
        table = table + torch.sym_max(t, 6) - torch.sym_min(t, 6)
        mean = x.mean(1, keepdim=True).expand(b, t, d) - x  # expand to symbolic sizes
        first, rest = x.split([1, t - 1], dim=1)  # split with a symbolic size
        zeros = torch.zeros_like(x[..., 0]) + torch.sym_float(t) / 4  # *_like, sym_float, truediv
        moved = x.roll(-2, 1) + F.pad(x, (0, 0, 2, 0))[:, :-2]  # roll / pad a dynamic dim
        copied = torch.empty_like(x).copy_(x * 2)
        return counts, steps, head, heads, ends, table, mean, first * 2, rest, zeros, moved, copied


def test_symbolic_size_arithmetic() -> None:
    model = SizeArithmetic()
    batch, seq = Dim("batch", min=1, max=64), Dim("seq", min=4, max=128)
    program = convert(model, (torch.randn(2, 5, 4),), ({0: batch, 1: seq},))
    runs = [(torch.randn(2, 5, 4),), (torch.randn(1, 9, 4),), (torch.randn(3, 16, 4),)]
    check_runs(model, program, runs)


class ConvNorm(nn.Module):
    """Dynamic batch and spatial size through GroupNorm and pooling-free conv layers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.norm(self.conv(x)))
        return y.flatten(2).mean(-1)


def test_group_norm_dynamic_batch_and_size() -> None:
    model = ConvNorm().eval()
    batch, size = Dim("batch", min=1, max=8), Dim("size", min=4, max=64)
    program = convert(model, (torch.randn(2, 3, 8, 8),), ({0: batch, 2: size, 3: size},))
    runs = [(torch.randn(2, 3, 8, 8),), (torch.randn(1, 3, 5, 5),), (torch.randn(3, 3, 12, 12),)]
    check_runs(model, program, runs)


class CondOnSize(nn.Module):
    """``torch.cond`` whose predicate is a symbolic size (a SymBool)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.shape[0] > 4, lambda x: x.sum(0) * 2, lambda x: x.amax(0), (x,))


def test_cond_on_symbolic_size() -> None:
    model = CondOnSize()
    program = convert(model, (torch.randn(6, 3),), ({0: Dim("n", min=2, max=32)},))
    check_runs(model, program, [(torch.randn(6, 3),), (torch.randn(3, 3),), (torch.randn(9, 3),)])


class RepeatedCumsum(nn.Module):
    """The same cumulative sum computed twice (Hugging Face's Gemma 2 builds two attention
    masks, each from ``cumsum`` of the same positions)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        starts = x != 1
        return starts.cumsum(-1) * 2, starts.cumsum(-1) * 3


def test_repeated_scan_over_a_dynamic_dim() -> None:
    """The runtime fails on (or aborts for) two identical scans of a dynamic-shaped value;
    the converter keeps one."""
    model = RepeatedCumsum()
    seq = Dim("seq", min=2, max=32)
    ep = export_decomposed(model, (torch.randint(0, 3, (2, 12)),), dynamic_shapes=({1: seq},))
    program = TorchConverter().add_exported_program(ep).to_coreai()
    assert str(program).count("coreai.scan") == 1
    runs = [(torch.randint(0, 3, (2, n)),) for n in (12, 3)]
    check_runs(model, program, runs)
    check_runs(model, program.optimize(), runs)


class ScatterFeatures(nn.Module):
    """Features written over placeholder tokens (LLaVA's image tokens): ``masked_scatter``
    with a dynamic number of tokens, a mask broadcast over the feature dim on the runtime and
    a dynamic number of feature rows."""

    def forward(self, x: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return x.masked_scatter((ids == 3).unsqueeze(-1), rows)


def test_masked_scatter_dynamic_tokens_and_rows() -> None:
    model = ScatterFeatures()

    def inputs(n: int, placeholders: int, extra: int) -> tuple[torch.Tensor, ...]:
        ids = torch.randint(4, 9, (2, n))
        ids.view(-1)[torch.randperm(2 * n)[:placeholders]] = 3
        return torch.randn(2, n, 4), ids, torch.randn(placeholders + extra, 4)

    seq, rows = Dim("seq", min=2, max=64), Dim("rows", min=2, max=64)
    program = convert(model, inputs(8, 5, 0), ({1: seq}, {1: seq}, {0: rows}))
    check_runs(model, program, [inputs(8, 5, 0), inputs(3, 2, 3), inputs(20, 11, 1)])
