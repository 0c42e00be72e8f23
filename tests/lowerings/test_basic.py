"""Smoke tests of the core lowerings on small MLP / CNN / attention blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.helpers import check_module


def test_mlp() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4), nn.Softmax(-1)).eval()
    check_module(model, (torch.randn(3, 8),))


@pytest.mark.parametrize(
    "act",
    [
        nn.ReLU(),
        nn.SiLU(),
        nn.Sigmoid(),
        nn.Tanh(),
        nn.Hardtanh(),
        nn.LeakyReLU(0.2),
        nn.GELU(approximate="tanh"),
    ],
)
def test_activations(act: nn.Module) -> None:
    check_module(nn.Sequential(nn.Linear(8, 8), act).eval(), (torch.randn(2, 8),))


def test_cnn_block() -> None:
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, stride=2, groups=2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 5),
    ).eval()
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    check_module(model, (torch.randn(2, 3, 16, 16),))


class Attention(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.ln = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln(x)).split(d, dim=-1)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(b, t, d))


def test_attention_block() -> None:
    check_module(Attention().eval(), (torch.randn(2, 5, 16),))


def test_embedding_int64_token_ids() -> None:
    model = nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 3)).eval()
    ids = torch.randint(0, 50, (2, 7), dtype=torch.int64)
    check_module(model, (ids,))
