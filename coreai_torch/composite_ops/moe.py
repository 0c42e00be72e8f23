"""Mixture-of-experts building blocks: per-token expert matmuls."""

from __future__ import annotations

from collections.abc import Callable

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
        # Row vector times the gathered (in, out) matrices: optimize() then stores the weight
        # as (experts, in, out), and the runtime reads only the selected experts' rows.
        selected = weight.transpose(-1, -2)[indices]  # (*batch, k, in, out)
        if input.dim() == indices.dim():  # (*batch, in): the same input for every expert
            input = input.unsqueeze(-2).expand(*indices.shape, input.shape[-1])
        # one (1, in) x (in, out) product per selected expert, batched without broadcasting
        # (a token count known only at run time would make every broadcast a run-time one)
        rows = input.reshape(-1, 1, input.shape[-1])
        out = torch.bmm(rows, selected.reshape(-1, *selected.shape[-2:]))
        out = out.reshape(*indices.shape, out.shape[-1])
        return out if bias is None else out + bias[indices]


class GatedActivation(nn.Module):
    """``activation(gate) * up``: the gate of a SwiGLU (``F.silu``) / GeGLU feed-forward."""

    def __init__(self, activation: Callable[[torch.Tensor], torch.Tensor] = F.silu):
        super().__init__()
        self.activation = activation

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.activation(gate) * up


#: How :class:`GatedExperts` computes the selected experts.
STRATEGIES = ("gather", "dense", "routed", "auto")


class GatedExperts(nn.Module):
    """Gated feed-forward experts (SwiGLU and its variants) applied to the experts each token
    selected; every shape is static.

    ``GatedExperts(gate, up, down, glu=GatedActivation(), gate_bias=None, up_bias=None,
    down_bias=None, strategy="gather")`` owns ``gate``/``up`` ``(experts, hidden, dim)`` and
    ``down`` ``(experts, dim, hidden)`` (``nn.Linear`` layout per expert; optional biases
    ``(experts, hidden)`` / ``(experts, dim)``).

    ``forward(x, indices, routing_weights)`` with ``x`` ``(*batch, dim)`` and ``indices`` /
    ``routing_weights`` ``(*batch, k)`` returns
    ``sum_j routing_weights[..., j] * down_j(glu(gate_j(x), up_j(x)))`` in ``x``'s dtype,
    accumulated in the dtype of ``expert output * routing_weights`` (float32 weights give a
    float32 sum). ``strategy`` says how:

    * ``"gather"``: each token's ``k`` expert matrices are gathered (three :class:`GatherMatmul`,
      the ``gather_matmul`` composite when externalized); cost follows ``tokens * k``.
    * ``"dense"``: every expert runs on every token (batched matmuls) and the outputs are
      combined with the routing weights scattered to ``(tokens, experts)`` (zero for the
      experts a token did not select); cost follows ``experts``.
    * ``"routed"``: the experts some token selected (at most ``min(tokens * k, experts)``,
      a size known at run time) are gathered and run on every token; the others' weights are
      not read.  One token reads its ``k`` experts, a long prompt every expert (and copies
      their weights once).
    * ``"auto"``: ``"gather"`` when ``tokens * k < experts`` (decode), else ``"dense"``
      (prefill), decided from the token count when the model is exported; ``"routed"`` when
      the token count is known only at run time.
    """

    def __init__(
        self,
        gate: torch.Tensor,
        up: torch.Tensor,
        down: torch.Tensor,
        glu: nn.Module | None = None,
        *,
        gate_bias: torch.Tensor | None = None,
        up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
        strategy: str = "gather",
    ):
        super().__init__()
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        experts, hidden, dim = gate.shape
        if up.shape != gate.shape or down.shape != (experts, dim, hidden):
            raise ValueError(
                f"expert weights must be gate/up (experts, hidden, dim) and down "
                f"(experts, dim, hidden); got {tuple(gate.shape)}, {tuple(up.shape)}, "
                f"{tuple(down.shape)}"
            )
        self.num_experts = experts
        self.strategy = strategy
        self.gate, self.up, self.down = (_parameter(w) for w in (gate, up, down))
        self.gate_bias, self.up_bias, self.down_bias = (
            None if b is None else _parameter(b) for b in (gate_bias, up_bias, down_bias)
        )
        self.glu = glu if glu is not None else GatedActivation()
        self.gate_proj = GatherMatmul()
        self.up_proj = GatherMatmul()
        self.down_proj = GatherMatmul()

    def forward(
        self, x: torch.Tensor, indices: torch.Tensor, routing_weights: torch.Tensor
    ) -> torch.Tensor:
        batch = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        k = indices.shape[-1]
        indices = indices.reshape(-1, k)
        routing_weights = routing_weights.reshape(-1, k)
        tokens = x2.shape[0]
        if self.strategy == "routed" or (self.strategy == "auto" and not isinstance(tokens, int)):
            out = self._routed(x2, indices, routing_weights)
        elif self._gathers(tokens, k):
            out = self._gathered(x2, indices, routing_weights)
        else:
            out = self._dense(x2, indices, routing_weights)
        return out.to(x.dtype).reshape(*batch, x.shape[-1])

    def _gathers(self, tokens: int | torch.SymInt, k: int) -> bool:
        if self.strategy != "auto":
            return self.strategy == "gather"
        return isinstance(tokens, int) and tokens * k < self.num_experts

    def _gathered(self, x: torch.Tensor, indices: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = self.glu(
            self.gate_proj(x, self.gate, indices, self.gate_bias),
            self.up_proj(x, self.up, indices, self.up_bias),
        )
        # (tokens, k, dim)
        out: torch.Tensor = self.down_proj(h, self.down, indices, self.down_bias)
        return (out * w.unsqueeze(-1)).sum(-2)

    def _routed(self, x: torch.Tensor, indices: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # the experts some token selected come first in `order` (most selections first; at
        # most tokens * k of them): their weights are gathered and run on every token
        tokens, k = indices.shape
        experts = torch.arange(self.num_experts, device=indices.device)
        hits = indices.unsqueeze(-1) == experts  # (tokens, k, experts)
        combine = (hits * w.unsqueeze(-1)).sum(-2)  # (tokens, experts): zero where unselected
        order = torch.argsort(hits.sum((0, 1)), descending=True, stable=True)
        chosen = order[: torch.sym_min(tokens * k, self.num_experts)]
        # batched products without broadcasting (with a run-time token count every broadcast
        # would be a run-time one, between the gathered weights and their matmul)
        xs = x.unsqueeze(0).expand(chosen.shape[0], *x.shape)
        h = self.glu(
            _gathered_linear(xs, self.gate, self.gate_bias, chosen),
            _gathered_linear(xs, self.up, self.up_bias, chosen),
        )
        out = _gathered_linear(h, self.down, self.down_bias, chosen)  # (chosen, tokens, dim)
        out = out.to(torch.promote_types(out.dtype, w.dtype))
        weights = combine[:, chosen]  # (tokens, chosen)
        return torch.bmm(weights.unsqueeze(1), out.transpose(0, 1)).squeeze(1)

    def _dense(self, x: torch.Tensor, indices: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = self.glu(
            _batched_linear(x, self.gate, self.gate_bias), _batched_linear(x, self.up, self.up_bias)
        )
        out = torch.matmul(h, self.down.transpose(1, 2))  # (experts, tokens, dim)
        if self.down_bias is not None:
            out = out + self.down_bias.unsqueeze(1)
        # (tokens, experts): each token's routing weights at its experts, zero elsewhere (a
        # comparison, not a scatter, so the token count may be dynamic)
        experts = torch.arange(self.num_experts, device=indices.device)
        dense = ((indices.unsqueeze(-1) == experts) * w.unsqueeze(-1)).sum(-2)
        out = out.to(torch.promote_types(out.dtype, w.dtype))  # (strict export traces it)
        return torch.matmul(dense.unsqueeze(1), out.transpose(0, 1)).squeeze(1)


def _batched_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ weight[e].T (+ bias[e])`` for every expert ``e``: ``(experts, tokens, out)``."""
    out = torch.matmul(x, weight.transpose(1, 2))
    return out if bias is None else out + bias.unsqueeze(1)


def _gathered_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, chosen: torch.Tensor
) -> torch.Tensor:
    """``x[i] @ weight[chosen[i]].T (+ bias[chosen[i]])`` for ``x`` ``(chosen, tokens, in)``:
    ``(chosen, tokens, out)``."""
    out = torch.bmm(x, weight.transpose(1, 2)[chosen])  # (stored transposed: rows gathered)
    return out if bias is None else out + bias[chosen].unsqueeze(1)


def _parameter(t: torch.Tensor) -> nn.Parameter:
    return t if isinstance(t, nn.Parameter) else nn.Parameter(t)


class SwiGLUExperts(GatedExperts):
    """A mixture-of-experts SwiGLU feed-forward: :class:`GatedExperts` with random weights.

    ``SwiGLUExperts(num_experts, dim, hidden_dim, strategy="gather")`` owns ``gate``/``up``
    weights ``(num_experts, hidden_dim, dim)`` and ``down`` ``(num_experts, dim, hidden_dim)``.
    ``forward(x, indices, routing_weights)`` with ``x`` ``(*batch, dim)`` and ``indices`` /
    ``routing_weights`` ``(*batch, k)`` returns
    ``sum_j routing_weights[..., j] * down_j(silu(gate_j(x)) * up_j(x))``, shape ``(*batch, dim)``.
    Externalize ``GatherMatmul`` to get its three ``gather_matmul`` composite ops.
    """

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, strategy: str = "gather"):
        super().__init__(
            torch.randn(num_experts, hidden_dim, dim) * dim**-0.5,
            torch.randn(num_experts, hidden_dim, dim) * dim**-0.5,
            torch.randn(num_experts, dim, hidden_dim) * hidden_dim**-0.5,
            strategy=strategy,
        )
