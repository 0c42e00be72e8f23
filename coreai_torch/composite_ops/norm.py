"""RMSNorm as a composite op: ``RMSNormImpl`` (the op) and ``RMSNorm`` (owns the weight)."""

from __future__ import annotations

import torch
import torch.nn as nn


class RMSNormImpl(nn.Module):
    """Root-mean-square normalization, the ``rms_norm`` composite op.

    ``RMSNormImpl(axes=-1, eps=1e-5, version=1)``

    ``forward(input, scale=None)`` returns
    ``input * rsqrt(mean(input**2, axes, keepdim=True) + eps) * scale`` with the statistics
    computed in float32 and the normalized value cast back to ``input.dtype`` before the
    scale is applied (the Llama convention).  ``scale`` broadcasts against ``input``; when it
    is ``None`` no scale is applied (and it is not an input of the composite op).

    Attributes (record with ``composite_attrs``): ``axes`` (int or tuple of ints), ``eps``
    (float), ``version`` (int).
    """

    def __init__(self, axes: int | tuple[int, ...] = -1, eps: float = 1e-5, version: int = 1):
        super().__init__()
        self.axes = axes
        self.eps = eps
        self.version = version

    def forward(self, input: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        x = input.to(torch.float32)
        inv_rms = torch.rsqrt((x * x).mean(self.axes, keepdim=True) + self.eps)
        out = (x * inv_rms).to(input.dtype)
        return out if scale is None else out * scale

    def extra_repr(self) -> str:
        return f"axes={self.axes}, eps={self.eps}"


class RMSNorm(nn.Module):
    """Convenience wrapper owning the learnable scale of an :class:`RMSNormImpl`.

    ``RMSNorm(dim, eps=1e-5)``: ``weight`` is a ``(dim,)`` parameter initialised to ones;
    ``forward(x)`` is ``self.norm(x, self.weight)``.  Externalize ``RMSNormImpl`` (not this
    class) to get the ``rms_norm`` composite op, with the weight as its ``scale`` input.
    """

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.norm = RMSNormImpl(eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.norm(x, self.weight)
        return out
