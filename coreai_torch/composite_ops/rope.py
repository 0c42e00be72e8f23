"""Rotary position embedding as a composite op."""

from __future__ import annotations

import torch
import torch.nn as nn


def _rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:  # pairs (x0, x1), (x2, x3), ... -> (-x1, x0), (-x3, x2), ...
        pairs = x.unflatten(-1, (-1, 2))
        return torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    half = x.shape[-1] // 2  # halves (a, b) -> (-b, a)
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RoPE(nn.Module):
    """Rotary position embedding, the ``rope`` composite op.

    ``RoPE(interleaved=False, version=1)``

    ``forward(input, cos, sin)`` returns ``input * cos + rotate(input) * sin`` over the first
    ``rot = cos.shape[-1]`` features of the last dimension (the rest passes through, for
    partial rotary embeddings).  ``cos`` and ``sin`` must broadcast against
    ``input[..., :rot]`` (e.g. ``(batch, 1, seq, rot)`` for ``(batch, heads, seq, head_dim)``
    inputs).  With ``interleaved=False`` (Llama / GPT-NeoX) ``rotate`` maps halves
    ``(a, b)`` to ``(-b, a)`` and each frequency appears in both halves of ``cos``/``sin``;
    with ``interleaved=True`` (GPT-J) it maps pairs ``(x0, x1)`` to ``(-x1, x0)`` and each
    frequency appears twice in a row.  :func:`rope_cos_sin` builds matching tables.

    Attributes: ``interleaved`` (bool), ``version`` (int).
    """

    def __init__(self, interleaved: bool = False, version: int = 1):
        super().__init__()
        self.interleaved = interleaved
        self.version = version

    def forward(self, input: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot = cos.shape[-1]
        if rot == input.shape[-1]:
            return input * cos + _rotate(input, self.interleaved) * sin
        x, rest = input[..., :rot], input[..., rot:]
        out = x * cos + _rotate(x, self.interleaved) * sin
        return torch.cat((out, rest.expand(*out.shape[:-1], rest.shape[-1])), dim=-1)

    def extra_repr(self) -> str:
        return f"interleaved={self.interleaved}"


def rope_cos_sin(
    positions: torch.Tensor | int,
    dim: int,
    base: float = 10000.0,
    *,
    interleaved: bool = False,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` tables of shape ``(*positions.shape, dim)`` for :class:`RoPE`.

    ``positions`` is a tensor of positions or a sequence length (positions ``0..n-1``).
    """
    if isinstance(positions, int):
        positions = torch.arange(positions)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    if interleaved:
        angles = freqs.repeat_interleave(2, dim=-1)
    else:
        angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)
