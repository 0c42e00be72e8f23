"""Attention on the Core AI runtime vs eager PyTorch: ``scaled_dot_product_attention`` (causal,
boolean and additive masks, a given scale, grouped-query heads, 3-D queries, float16, with
ATen composites on and off) and RoPE written by hand (fused into the ``rope`` op)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from coreai_torch import TorchConverter
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.verify import verify
from tests.lowerings.support import check_fn

SDPA = F.scaled_dot_product_attention


def _masks(queries: int, keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    boolean = torch.rand(queries, keys) > 0.5
    boolean[:, 0] = True  # every query sees a key (a row of -inf gives NaN in both)
    additive = torch.randn(1, 1, queries, keys)
    return boolean, additive


@pytest.mark.parametrize(("queries", "keys"), [(5, 6), (1, 9)], ids=["prefill", "one-token"])
def test_sdpa(queries: int, keys: int) -> None:
    def f(q, k, v, kv, boolean, additive):
        return (
            SDPA(q, k, v),
            SDPA(q, k, v, is_causal=True) if queries == keys else SDPA(q, k, v, scale=0.3),
            SDPA(q, k, v, attn_mask=boolean),
            SDPA(q, k, v, attn_mask=additive, scale=0.2),
            SDPA(q, kv, kv, enable_gqa=True),
            SDPA(q[0], k[0], v[0]),
        )

    q, k, v = torch.randn(2, 4, queries, 8), torch.randn(2, 4, keys, 8), torch.randn(2, 4, keys, 8)
    check_fn(f, q, k, v, torch.randn(2, 2, keys, 8), *_masks(queries, keys))


def test_causal_square_attention() -> None:
    q, k, v = (torch.randn(1, 2, 7, 16) for _ in range(3))
    check_fn(lambda q, k, v: SDPA(q, k, v, is_causal=True), q, k, v)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sdpa_half_precision(dtype: torch.dtype) -> None:
    q, k, v = (torch.randn(2, 4, 6, 16).to(dtype) for _ in range(3))
    tol = {torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    check_fn(lambda q, k, v: SDPA(q, k, v, is_causal=True), q, k, v, atol=tol, rtol=tol)


def test_sdpa_inline_without_composites() -> None:
    class Attention(nn.Module):
        def forward(self, q, k, v, mask):
            return SDPA(q, k, v, attn_mask=mask), SDPA(q, k, v, is_causal=True)

    args = (*(torch.randn(1, 2, 5, 8) for _ in range(3)), _masks(5, 5)[0])
    ep = export_decomposed(Attention().eval(), args)
    program = TorchConverter(aten_composites=False).add_exported_program(ep).to_coreai()
    assert "composite" not in str(program)
    assert verify(Attention().eval(), args, program=program.optimize()).ok


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), -1)


@pytest.mark.parametrize("heads", [1, 4])
def test_rope(heads: int) -> None:
    """Hand-written rotary embeddings (Hugging Face's form) become the ``rope`` op."""

    def f(q, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + _rotate_half(q) * sin

    angles = torch.randn(2, 5, 4)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    check_fn(f, torch.randn(2, heads, 5, 8), cos, sin)
