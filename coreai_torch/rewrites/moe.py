"""Static mixture-of-experts blocks for Hugging Face MoE models: ``rewrite_moe(model)``.

Every Hugging Face sparse-MoE block loops over the experts and gathers the tokens routed to
each (``torch.where(expert_mask[e])``): sizes that depend on the data, which ``torch.export``
rejects or turns into ``nonzero``. :func:`rewrite_moe` replaces each supported block with a
:class:`SparseMoE` that routes exactly as the Hugging Face class does and then applies the
selected experts with static shapes (:class:`~coreai_torch.composite_ops.GatedExperts`)::

    model = transformers.MixtralForCausalLM.from_pretrained(...)
    coreai_torch.rewrite_moe(model)          # in place; returns the model
    ep = torch.export.export(model, ...)     # no data-dependent shapes left

Supported blocks (transformers 4.57, :data:`REWRITES`): softmax over all experts, then top-k,
optionally renormalised: Mixtral (and MiniMax), Qwen2-MoE (shared expert and its gate; and
Qwen3-Next), Qwen3-MoE, OLMoE (and FlexOlmo), Jamba; DeepSeek-V2 (softmax, greedy or
group-limited top-k, scaling); DeepSeek-V3 (and GLM-4-MoE, dots.llm1: sigmoid scores with the
correction bias, group-limited top-k, renormalised and scaled); GPT-OSS (top-k logits, then
softmax over those k; clamped SwiGLU experts with biases). Any other module holding
``experts`` raises :class:`~coreai_torch.errors.UnsupportedMoEError` naming its class.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from coreai_torch.composite_ops.moe import STRATEGIES, GatedActivation, GatedExperts
from coreai_torch.errors import UnsupportedMoEError
from coreai_torch.frontend import hints

Routing = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


# ------------------------------------------------------------------------------- routers


class SoftmaxTopKRouter(nn.Module):
    """Mixtral / Qwen-MoE / OLMoE routing: softmax over every expert (float32), the top ``k``
    probabilities, renormalised to sum to 1 if ``normalize``, cast to the input's dtype.

    ``forward(x)`` with ``x`` ``(tokens, dim)`` returns ``(indices, weights, router_logits)``.
    """

    def __init__(self, gate: nn.Linear, top_k: int, normalize: bool):
        super().__init__()
        self.gate = gate
        self.top_k = top_k
        self.normalize = normalize

    def forward(self, x: torch.Tensor) -> Routing:
        logits = self.gate(x)
        probs = F.softmax(logits, dim=1, dtype=torch.float)
        weights, indices = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return indices, weights.to(x.dtype), logits


class TopKSoftmaxRouter(nn.Module):
    """GPT-OSS routing: the top ``k`` router logits (``linear`` with bias), softmax over those
    ``k`` only, in the logits' dtype.

    ``forward(x)`` returns ``(indices, weights, router_scores)``, the last being the weights
    scattered to ``(tokens, experts)`` (what the Hugging Face block returns).
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, top_k: int):
        super().__init__()
        self.weight, self.bias = weight, bias
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> Routing:
        logits = F.linear(x, self.weight, self.bias)
        top, indices = torch.topk(logits, self.top_k, dim=-1)
        weights = F.softmax(top, dim=1, dtype=top.dtype)
        return indices, weights, torch.zeros_like(logits).scatter(1, indices, weights)


class GroupLimitedRouter(nn.Module):
    """DeepSeek routing, in float32: scores over every expert, the best ``topk_group`` of
    ``n_group`` expert groups kept (the other experts' scores set to 0), then the top ``k``.

    ``score="softmax"`` (DeepSeek-V2): the weights are the selected softmax scores; a group
    scores its best expert; ``grouped=False`` is V2's ``"greedy"`` method (no group limit).
    ``score="sigmoid"`` (DeepSeek-V3): experts are chosen by ``sigmoid + bias`` and a group by
    its two best experts; the weights are the selected sigmoid scores, divided by their sum
    (+1e-20) if ``normalize``. Weights are finally multiplied by ``scaling``.

    ``forward(x)`` with ``x`` ``(tokens, dim)`` returns ``(indices, weights, router_logits)``.
    """

    bias: torch.Tensor | None

    def __init__(
        self,
        weight: nn.Parameter,
        *,
        top_k: int,
        score: str,
        grouped: bool,
        n_group: int,
        topk_group: int,
        scaling: float,
        normalize: bool = False,
        bias: torch.Tensor | None = None,
    ):
        super().__init__()
        if score not in ("softmax", "sigmoid"):
            raise ValueError(f"score must be 'softmax' or 'sigmoid', got {score!r}")
        experts = weight.shape[0]
        if grouped and experts % n_group:
            raise ValueError(f"{experts} experts do not split into {n_group} groups")
        self.weight = weight
        self.register_buffer("bias", bias, persistent=False)
        self.top_k, self.score, self.grouped = top_k, score, grouped
        self.n_group, self.topk_group = n_group, topk_group
        self.scaling, self.normalize = scaling, normalize

    def forward(self, x: torch.Tensor) -> Routing:
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid() if self.score == "sigmoid" else logits.softmax(-1)
        choice = scores if self.bias is None else scores + self.bias.unsqueeze(0)
        if self.grouped:
            choice = self._limit_to_best_groups(choice)
        indices = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, indices)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return indices, weights * self.scaling, logits

    def _limit_to_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        tokens, experts = choice.shape
        grouped = choice.view(tokens, self.n_group, experts // self.n_group)
        if self.score == "sigmoid":
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        groups = torch.arange(self.n_group, device=choice.device)
        group_mask = (group_idx.unsqueeze(-1) == groups).any(-2)  # HF scatters ones: the same
        expert_mask = (
            group_mask.unsqueeze(-1)
            .expand(tokens, self.n_group, experts // self.n_group)
            .reshape(tokens, experts)
        )
        return choice.masked_fill(~expert_mask, 0.0)


# --------------------------------------------------------------------------- the block


class SparseMoE(nn.Module):
    """A sparse mixture-of-experts feed-forward with static shapes.

    ``router(x)`` gives each token's expert ``indices``, routing ``weights`` and the router
    logits (or scores: the block's second output); ``experts`` (:class:`GatedExperts`) applies
    them; an optional ``shared_expert`` runs on every token, scaled by
    ``sigmoid(shared_expert_gate(x))`` when that gate exists.
    ``forward(hidden_states)`` (``(..., dim)``) returns the output, or ``(output,
    router_logits)`` when ``returns_router_logits`` (as the replaced block did).
    """

    def __init__(
        self,
        router: nn.Module,
        experts: GatedExperts,
        *,
        shared_expert: nn.Module | None = None,
        shared_expert_gate: nn.Module | None = None,
        returns_router_logits: bool = True,
        replaces: str = "",
    ):
        super().__init__()
        self.router = router
        self.experts = experts
        self.shared_expert = shared_expert
        self.shared_expert_gate = shared_expert_gate
        self.returns_router_logits = returns_router_logits
        #: the class name of the block this one replaced
        self.replaces = replaces

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        indices, weights, logits = self.router(x)
        out = self.experts(x, indices, weights)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        out = out.reshape(hidden_states.shape)
        return (out, logits) if self.returns_router_logits else out

    def extra_repr(self) -> str:
        return f"replaces={self.replaces}"


# ---------------------------------------------------------- Hugging Face blocks → SparseMoE


def _stack_experts(block: Any, names: tuple[str, str, str], strategy: str) -> GatedExperts:
    """One :class:`GatedExperts` from a ``ModuleList`` of gated MLPs whose ``names`` are the
    gate, up and down ``nn.Linear`` (and which share one ``act_fn``)."""
    experts = block.experts

    def linear(expert: Any, name: str) -> nn.Linear:
        found = getattr(expert, name, None)
        if not isinstance(found, nn.Linear):
            raise _unexpected(block, f"each expert should have nn.Linear {', '.join(names)}")
        return found

    linears = [[linear(e, n) for n in names] for e in experts]
    acts = {type(getattr(e, "act_fn", None)) for e in experts}
    if len(acts) != 1 or type(None) in acts:
        raise _unexpected(block, "the experts should share one act_fn")

    def stacked(i: int, what: str) -> torch.Tensor | None:
        tensors = [getattr(row[i], what) for row in linears]
        if all(t is None for t in tensors):
            return None
        if any(t is None for t in tensors):
            raise _unexpected(block, f"some experts' {names[i]} have a bias, others not")
        with torch.no_grad():
            return torch.stack([t.detach() for t in tensors])

    def weights(i: int) -> torch.Tensor:
        with torch.no_grad():
            return torch.stack([row[i].weight.detach() for row in linears])

    return GatedExperts(
        weights(0),
        weights(1),
        weights(2),
        GatedActivation(experts[0].act_fn),
        gate_bias=stacked(0, "bias"),
        up_bias=stacked(1, "bias"),
        down_bias=stacked(2, "bias"),
        strategy=strategy,
    )


def _softmax_topk_block(
    block: Any,
    strategy: str,
    *,
    normalize: bool,
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    router: str = "gate",
) -> SparseMoE:
    return SparseMoE(
        SoftmaxTopKRouter(getattr(block, router), block.top_k, normalize),
        _stack_experts(block, names, strategy),
        shared_expert=getattr(block, "shared_expert", None),
        shared_expert_gate=getattr(block, "shared_expert_gate", None),
        replaces=type(block).__name__,
    )


def _mixtral(block: Any, strategy: str) -> SparseMoE:
    return _softmax_topk_block(block, strategy, normalize=True, names=("w1", "w3", "w2"))


def _qwen_or_olmoe(block: Any, strategy: str) -> SparseMoE:
    return _softmax_topk_block(block, strategy, normalize=bool(block.norm_topk_prob))


def _jamba(block: Any, strategy: str) -> SparseMoE:
    return _softmax_topk_block(block, strategy, normalize=False, router="router")


def _deepseek_v2(block: Any, strategy: str) -> SparseMoE:
    gate = block.gate
    if gate.topk_method not in ("greedy", "group_limited_greedy"):
        raise _unexpected(block, f"unknown topk_method {gate.topk_method!r}")
    router = GroupLimitedRouter(  # V2's gate does not renormalise (norm_topk_prob unused)
        gate.weight,
        top_k=gate.top_k,
        score="softmax",
        grouped=gate.topk_method == "group_limited_greedy",
        n_group=gate.num_group,
        topk_group=gate.topk_group,
        scaling=gate.routed_scaling_factor,
    )
    return _deepseek_block(block, router, strategy)


def _deepseek_v3(block: Any, strategy: str) -> SparseMoE:
    gate = block.gate
    router = GroupLimitedRouter(
        gate.weight,
        top_k=gate.top_k,
        score="sigmoid",
        grouped=True,
        n_group=gate.n_group,
        topk_group=gate.topk_group,
        scaling=gate.routed_scaling_factor,
        normalize=bool(gate.norm_topk_prob),
        bias=gate.e_score_correction_bias,
    )
    return _deepseek_block(block, router, strategy)


def _deepseek_block(block: Any, router: GroupLimitedRouter, strategy: str) -> SparseMoE:
    return SparseMoE(
        router,
        _stack_experts(block, ("gate_proj", "up_proj", "down_proj"), strategy),
        shared_expert=getattr(block, "shared_experts", None),
        returns_router_logits=False,
        replaces=type(block).__name__,
    )


class ClampedSwiGLU(nn.Module):
    """GPT-OSS's gated activation: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``
    with ``g = clamp(gate, max=limit)``."""

    def __init__(self, alpha: float, limit: float):
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def _gpt_oss(block: Any, strategy: str) -> SparseMoE:
    router, experts = block.router, block.experts
    if not isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor):
        raise _unexpected(
            block, "experts.gate_up_proj should be an (experts, dim, 2*hidden) tensor"
        )
    with torch.no_grad():  # (experts, in, out) with gate/up interleaved -> nn.Linear layout
        gate_up = experts.gate_up_proj.detach().transpose(1, 2)
        gate_up_bias = experts.gate_up_proj_bias.detach()
        static_experts = GatedExperts(
            gate_up[:, 0::2].contiguous(),
            gate_up[:, 1::2].contiguous(),
            experts.down_proj.detach().transpose(1, 2).contiguous(),
            ClampedSwiGLU(experts.alpha, experts.limit),
            gate_bias=gate_up_bias[:, 0::2].contiguous(),
            up_bias=gate_up_bias[:, 1::2].contiguous(),
            down_bias=experts.down_proj_bias.detach().clone(),
            strategy=strategy,
        )
    return SparseMoE(
        TopKSoftmaxRouter(router.weight, router.bias, router.top_k),
        static_experts,
        replaces=type(block).__name__,
    )


_HF = "transformers.models."
#: Supported Hugging Face blocks (``module.qualname``) → builder of the static block.
REWRITES: dict[str, Callable[[nn.Module, str], SparseMoE]] = {
    _HF + "mixtral.modeling_mixtral.MixtralSparseMoeBlock": _mixtral,
    _HF + "minimax.modeling_minimax.MiniMaxSparseMoeBlock": _mixtral,  # Mixtral's code
    _HF + "qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock": _qwen_or_olmoe,
    _HF + "qwen3_next.modeling_qwen3_next.Qwen3NextSparseMoeBlock": _qwen_or_olmoe,
    _HF + "qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock": _qwen_or_olmoe,
    _HF + "olmoe.modeling_olmoe.OlmoeSparseMoeBlock": _qwen_or_olmoe,
    _HF + "flex_olmo.modeling_flex_olmo.FlexOlmoSparseMoeBlock": _qwen_or_olmoe,
    _HF + "jamba.modeling_jamba.JambaSparseMoeBlock": _jamba,
    _HF + "deepseek_v2.modeling_deepseek_v2.DeepseekV2MoE": _deepseek_v2,
    _HF + "deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE": _deepseek_v3,
    _HF + "glm4_moe.modeling_glm4_moe.Glm4MoeMoE": _deepseek_v3,  # DeepSeek-V3's code
    _HF + "dots1.modeling_dots1.Dots1MoE": _deepseek_v3,  # DeepSeek-V3's code
    _HF + "gpt_oss.modeling_gpt_oss.GptOssMLP": _gpt_oss,
}
hints.register_moe_blocks(REWRITES)  # conversion and export errors name rewrite_moe for them


def _qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _unexpected(block: Any, what: str) -> UnsupportedMoEError:
    import transformers

    return UnsupportedMoEError(
        f"{type(block).__name__} does not have the structure rewrite_moe knows ({what}); it "
        f"was written for transformers 4.57 (installed: {transformers.__version__})"
    )


# ------------------------------------------------------------------------- rewrite_moe


def rewrite_moe(model: nn.Module, *, strategy: str = "auto") -> nn.Module:
    """Replace every Hugging Face sparse-MoE block in ``model`` (in place) with an exact
    :class:`SparseMoE` without data-dependent shapes, so it exports and converts.

    ``strategy`` (``"auto"``, ``"gather"``, ``"dense"`` or ``"routed"``) is how the experts
    run, see :class:`~coreai_torch.composite_ops.GatedExperts`: ``"auto"`` gathers each token's
    experts when ``tokens * top_k < num_experts`` (decode) and runs every expert otherwise
    (prefill); with a token count known only at run time it gathers the experts the call's
    tokens selected (``"routed"``: a decode step reads its ``top_k`` experts).
    Expert weights are stacked into ``(experts, out, in)`` tensors (one copy; the per-expert
    modules are released). Raises :class:`~coreai_torch.errors.UnsupportedMoEError`, before
    changing anything, if a module holding ``experts`` is not a supported block. A model
    without MoE blocks is returned unchanged. Returns ``model`` (the new block when ``model``
    is itself a supported block).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    found: list[tuple[str, nn.Module]] = []
    unsupported: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, SparseMoE) or _inside(name, found):
            continue
        if _qualified_name(type(module)) in REWRITES:
            found.append((name, module))
        elif hasattr(module, "experts"):
            unsupported.append(f"{type(module).__name__} at {name or '<model>'}")
    if unsupported:
        raise UnsupportedMoEError(
            "rewrite_moe cannot make these mixture-of-experts blocks static: "
            + "; ".join(unsupported)
            + f". Supported: {', '.join(_supported_names())}. Other routers are refused rather "
            "than approximated; replace the block with a coreai_torch.rewrites.moe.SparseMoE "
            "(a router + GatedExperts) that computes what it computes."
        )
    while found:  # one block at a time: its per-expert weights are freed before the next
        name, module = found.pop(0)
        static = REWRITES[_qualified_name(type(module))](module, strategy)
        del module
        if not name:  # the model is itself a block
            return static
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, static)
    return model


def _supported_names() -> Sequence[str]:
    return [q.rsplit(".", 1)[1] for q in REWRITES]


def _inside(name: str, found: Sequence[tuple[str, nn.Module]]) -> bool:
    """Whether the module ``name`` is part of a block already found."""
    return any(not f or name.startswith(f + ".") for f, _ in found)
