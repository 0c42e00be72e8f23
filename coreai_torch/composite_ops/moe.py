"""Mixture-of-experts building blocks: per-token expert matmuls."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class GatherMatmul(nn.Module):
    """Matmul with the experts each token selected, the ``gather_matmul`` composite op.

    ``GatherMatmul(version=1)``

    ``forward(input, weight, indices, bias=None)``: ``weight`` holds one ``(out, in)`` matrix
    per expert, shape ``(experts, out, in)`` (``nn.Linear`` layout); ``indices`` (integer,
    shape ``(*batch, k)``) selects ``k`` experts per token; ``input`` is ``(*batch, in)`` (the
    same vector for every selected expert) or ``(*batch, k, in)``.  Returns
    ``out[..., j, :] = weight[indices[..., j]] @ input[..., (j,) :]`` (+ ``bias[indices]``,
    ``bias`` of shape ``(experts, out)``), shape ``(*batch, k, out)``.

    Attributes: ``version`` (int).
    """

    def __init__(self, version: int = 1):
        super().__init__()
        self.version = version

    def forward(
        self,
        input: torch.Tensor,
        weight: torch.Tensor,
        indices: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        selected = weight[indices]  # (*batch, k, out, in)
        if input.dim() == indices.dim():  # (*batch, in): the same input for every expert
            input = input.unsqueeze(-2)
        out = torch.matmul(selected, input.unsqueeze(-1)).squeeze(-1)
        return out if bias is None else out + bias[indices]


class SwiGLUExperts(nn.Module):
    """A mixture-of-experts SwiGLU feed-forward built from three :class:`GatherMatmul`.

    ``SwiGLUExperts(num_experts, dim, hidden_dim)`` owns ``gate``/``up`` weights
    ``(num_experts, hidden_dim, dim)`` and ``down`` ``(num_experts, dim, hidden_dim)``.
    ``forward(x, indices, routing_weights)`` with ``x`` ``(*batch, dim)`` and ``indices`` /
    ``routing_weights`` ``(*batch, k)`` returns
    ``sum_j routing_weights[..., j] * down_j(silu(gate_j(x)) * up_j(x))``, shape ``(*batch, dim)``.
    Externalize ``GatherMatmul`` to get its three ``gather_matmul`` composite ops.
    """

    def __init__(self, num_experts: int, dim: int, hidden_dim: int):
        super().__init__()
        self.gate = nn.Parameter(torch.randn(num_experts, hidden_dim, dim) * dim**-0.5)
        self.up = nn.Parameter(torch.randn(num_experts, hidden_dim, dim) * dim**-0.5)
        self.down = nn.Parameter(torch.randn(num_experts, dim, hidden_dim) * hidden_dim**-0.5)
        self.gate_proj = GatherMatmul()
        self.up_proj = GatherMatmul()
        self.down_proj = GatherMatmul()

    def forward(
        self, x: torch.Tensor, indices: torch.Tensor, routing_weights: torch.Tensor
    ) -> torch.Tensor:
        h = F.silu(self.gate_proj(x, self.gate, indices)) * self.up_proj(x, self.up, indices)
        out = self.down_proj(h, self.down, indices)  # (*batch, k, dim)
        return (out * routing_weights.unsqueeze(-1).to(out.dtype)).sum(-2)
