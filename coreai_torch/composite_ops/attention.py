"""Scaled dot-product attention as a composite op."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class SDPA(nn.Module):
    """Scaled dot-product attention, the ``sdpa`` composite op.

    ``SDPA(is_causal=False, scale=None, enable_gqa=False, version=1)``

    ``forward(query, key, value, attn_mask=None)`` is
    ``torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask,
    is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)``: ``query`` is
    ``(..., heads, L, E)``, ``key`` ``(..., kv_heads, S, E)``, ``value`` ``(..., kv_heads, S, Ev)``;
    ``attn_mask`` is a boolean mask (True = attend) or an additive float mask broadcasting to
    ``(..., heads, L, S)``.  With ``enable_gqa`` the key/value heads are shared by groups of
    ``heads // kv_heads`` query heads.  ``scale`` defaults to ``1 / sqrt(E)``.  No dropout.

    Attributes: ``is_causal`` (bool), ``scale`` (float; omitted from the composite op when
    ``None``), ``enable_gqa`` (bool), ``version`` (int).
    """

    def __init__(
        self,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
        version: int = 1,
    ):
        super().__init__()
        self.is_causal = is_causal
        self.scale = scale
        self.enable_gqa = enable_gqa
        self.version = version

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attn_mask,
            is_causal=self.is_causal,
            scale=self.scale,
            enable_gqa=self.enable_gqa,
        )

    def extra_repr(self) -> str:
        return f"is_causal={self.is_causal}, scale={self.scale}, enable_gqa={self.enable_gqa}"
