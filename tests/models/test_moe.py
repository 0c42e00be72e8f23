"""Mixture-of-experts LLMs: ``rewrite_moe`` replaces Hugging Face sparse-MoE blocks with static
ones that route exactly as the originals (same experts, outputs within 1e-4 * max(1, max|ref|))
for prefill (T tokens) and decode (1 token), and whole MoE models then convert and match HF
eager logits on the Core AI runtime.

Every block and model is built from a small config with random weights; nothing is downloaded.
"""

from __future__ import annotations

import copy
import importlib
import re
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from coreai_torch import UnsupportedMoEError, UnsupportedOpError, rewrite_moe
from coreai_torch.composite_ops import GatherMatmul, default_specs
from coreai_torch.rewrites.moe import SparseMoE
from tests.externalize_support import check_externalized, composites, graphs
from tests.helpers import check_module
from tests.models.common import Call, check_model, model_tolerance, redraw_weights
from tests.models.test_decoder_lms import SMALL, VOCAB, check_dynamic_sequence_length

DIM = 64

_DEEPSEEK_V2_BLOCK = dict(
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_shared_experts=1,
    routed_scaling_factor=1.5,
)
_DEEPSEEK_V3_BLOCK = dict(
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
)
#: name -> (transformers module, block class, config class, config overrides)
BLOCKS: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "mixtral": (
        "mixtral",
        "MixtralSparseMoeBlock",
        "MixtralConfig",
        dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
    ),
    "qwen2_moe": (  # shared expert with its sigmoid gate; top-k not renormalised
        "qwen2_moe",
        "Qwen2MoeSparseMoeBlock",
        "Qwen2MoeConfig",
        dict(
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
        ),
    ),
    "qwen3_moe": (
        "qwen3_moe",
        "Qwen3MoeSparseMoeBlock",
        "Qwen3MoeConfig",
        dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
    ),
    "olmoe": (
        "olmoe",
        "OlmoeSparseMoeBlock",
        "OlmoeConfig",
        dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2),
    ),
    "deepseek_v2_greedy": (
        "deepseek_v2",
        "DeepseekV2MoE",
        "DeepseekV2Config",
        dict(_DEEPSEEK_V2_BLOCK, topk_method="greedy"),
    ),
    "deepseek_v2_grouped": (
        "deepseek_v2",
        "DeepseekV2MoE",
        "DeepseekV2Config",
        dict(_DEEPSEEK_V2_BLOCK, topk_method="group_limited_greedy", n_group=4, topk_group=2),
    ),
    "deepseek_v3": (  # sigmoid + correction bias, grouped by the best two, renormalised
        "deepseek_v3",
        "DeepseekV3MoE",
        "DeepseekV3Config",
        _DEEPSEEK_V3_BLOCK,
    ),
    "gpt_oss": (  # top-k logits, then softmax over them; clamped SwiGLU experts with biases
        "gpt_oss",
        "GptOssMLP",
        "GptOssConfig",
        dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
    ),
    # Blocks whose code is one of the above (under another name), and Jamba's.
    "minimax": (
        "minimax",
        "MiniMaxSparseMoeBlock",
        "MiniMaxConfig",
        dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
    ),
    "qwen3_next": (
        "qwen3_next",
        "Qwen3NextSparseMoeBlock",
        "Qwen3NextConfig",
        dict(
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        ),
    ),
    "flex_olmo": (
        "flex_olmo",
        "FlexOlmoSparseMoeBlock",
        "FlexOlmoConfig",
        dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2),
    ),
    "jamba": (
        "jamba",
        "JambaSparseMoeBlock",
        "JambaConfig",
        dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2),
    ),
    "glm4_moe": (
        "glm4_moe",
        "Glm4MoeMoE",
        "Glm4MoeConfig",
        dict(_DEEPSEEK_V3_BLOCK, norm_topk_prob=True),
    ),
    "dots1": ("dots1", "Dots1MoE", "Dots1Config", dict(_DEEPSEEK_V3_BLOCK, norm_topk_prob=False)),
}

#: prefill (batch 2 x 7 tokens) and decode (1 token)
TOKENS = {"prefill": (2, 7), "decode": (1, 1)}


def _transformers_module(family: str) -> Any:
    return importlib.import_module(f"transformers.models.{family}.modeling_{family}")


def hf_block(name: str, seed: int = 0) -> nn.Module:
    """The Hugging Face block ``name`` with random weights (router logits ~ N(0, 1))."""
    import transformers

    family, block_class, config_class, overrides = BLOCKS[name]
    config = getattr(transformers, config_class)(hidden_size=DIM, **overrides)
    torch.manual_seed(seed)
    block = getattr(_transformers_module(family), block_class)(config).eval()
    redraw_weights(block)
    bias = getattr(getattr(block, "gate", None), "e_score_correction_bias", None)
    if bias is not None:
        with torch.no_grad():
            bias.uniform_(-0.1, 0.1)
    return block


class _OneHotArguments(TorchFunctionMode):
    """Records what ``F.one_hot`` is called with: the experts an HF block selected."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.one_hot:
            self.calls.append(args[0].clone())
        return func(*args, **(kwargs or {}))


def hf_selected_experts(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The experts the Hugging Face block selects for each token of ``x``, ``(tokens, k)``."""
    flat = x.reshape(-1, x.shape[-1])
    if type(block).__name__.startswith("Deepseek"):
        return block.gate(x if "V2" in type(block).__name__ else flat)[0]
    with _OneHotArguments() as mode:
        block(x)
    (selected,) = mode.calls
    return selected


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


class _Output(nn.Module):
    """A block's output without its router logits."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _first(self.block(x))


# ------------------------------------------------------------------------- eager: exactness


@pytest.mark.parametrize("strategy", ["gather", "dense", "routed"])
@pytest.mark.parametrize("tokens", list(TOKENS))
@pytest.mark.parametrize("name", list(BLOCKS))
def test_static_block_routes_and_computes_like_the_hf_block(
    name: str, tokens: str, strategy: str
) -> None:
    block = hf_block(name)
    static = rewrite_moe(copy.deepcopy(block), strategy=strategy)
    assert isinstance(static, SparseMoE) and static.replaces == type(block).__name__
    x = torch.randn(*TOKENS[tokens], DIM)
    with torch.no_grad():
        expected_experts = hf_selected_experts(block, x)
        indices = static.router(x.reshape(-1, DIM))[0]
        expected, actual = block(x), static(x)
    # identical routing decisions (the order within a token's top-k does not matter)
    torch.testing.assert_close(indices.sort(-1).values, expected_experts.sort(-1).values)
    assert isinstance(actual, tuple) == isinstance(expected, tuple)
    if isinstance(expected, tuple):  # (output, router_logits)
        torch.testing.assert_close(actual[1], expected[1], rtol=0, atol=0)
    ref = _first(expected)
    err = float((_first(actual) - ref).abs().max())
    assert err <= model_tolerance([ref]), f"max|err| {err:.3e}"
    assert float(ref.abs().max()) > 0.1  # the experts contribute


def test_deepseek_v3_routing_uses_the_correction_bias_and_the_groups() -> None:
    """The routing test above is not vacuous: the bias and the group limit change choices."""
    block = hf_block("deepseek_v3")
    static = rewrite_moe(copy.deepcopy(block))
    x = torch.randn(64, DIM)
    with torch.no_grad():
        chosen = static.router(x)[0]
        static.router.bias.zero_()
        unbiased = static.router(x)[0]
        static.router.grouped = False
        ungrouped = static.router(x)[0]
    assert not torch.equal(chosen.sort(-1).values, unbiased.sort(-1).values)
    assert not torch.equal(unbiased.sort(-1).values, ungrouped.sort(-1).values)


# ------------------------------------------------------------------------ on the runtime


def _check_block_on_runtime(name: str, tokens: str) -> None:
    block = rewrite_moe(hf_block(name))
    x = torch.randn(*TOKENS[tokens], DIM)
    with torch.no_grad():
        reference = [_first(block(x))]
    check_module(block, (x,), atol=model_tolerance(reference), rtol=0.0)


@pytest.mark.parametrize("tokens", list(TOKENS))
def test_mixtral_block_on_the_runtime(tokens: str) -> None:
    _check_block_on_runtime("mixtral", tokens)


@pytest.mark.slow
@pytest.mark.parametrize("tokens", list(TOKENS))
@pytest.mark.parametrize("name", [n for n in BLOCKS if n != "mixtral"])
def test_static_block_on_the_runtime(name: str, tokens: str) -> None:
    _check_block_on_runtime(name, tokens)


@pytest.mark.parametrize(
    "name",
    [
        "qwen2_moe",
        "deepseek_v3",
    ],
)
def test_one_program_for_every_prompt_length(name: str) -> None:
    """A dynamic token count (``torch.export.Dim``): the experts run dense, and neither the
    routing nor the combination needs a static size."""
    from tests.models.common import check_model_dynamic

    block = _Output(rewrite_moe(hf_block(name)))
    runs = [(torch.randn(1, n, DIM),) for n in (12, 5)]
    check_model_dynamic(block, runs, ({1: torch.export.Dim("tokens", min=2, max=32)},))


def test_decode_gathers_experts_through_gather_matmul_composites() -> None:
    """One token: each expert projection is a ``gather_matmul`` composite (3 per block)."""
    block = rewrite_moe(hf_block("qwen3_moe"))
    specs = [s for s in default_specs() if s.target_class is GatherMatmul]
    program, report = check_externalized(block, (torch.randn(1, 1, DIM),), specs)
    gather_matmuls = {g.name for g in composites(program, "gather_matmul")}
    assert len([c for c in graphs(program)["main"].invokes if c in gather_matmuls]) == 3
    assert report.max_abs < 1e-4


def test_decode_gathers_the_stored_expert_weights_directly() -> None:
    """optimize() stores each stacked expert weight once, transposed to (experts, in, out),
    under its own name, and the program gathers the selected experts from it (the runtime
    then reads only their rows; benchmarks/moe.py)."""
    from tests.helpers import convert

    block = rewrite_moe(hf_block("mixtral"))
    text = str(convert(block, (torch.randn(1, 1, DIM),)).optimize())
    for name in ("gate", "up", "down"):
        constant = re.search(rf"(%\d+) = coreai\.constant dense_resource<experts\.{name}\.T>", text)
        assert constant, f"experts.{name} is not stored transposed"
        assert f"coreai.gather_nd {constant[1]} at" in text
    assert "coreai.transpose" not in text
    assert "dense_resource<resource_" not in text  # no anonymous copy of a weight


# -------------------------------------------------------------------------- whole models

_DEEPSEEK = dict(
    num_key_value_heads=4,
    intermediate_size=128,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,  # layer 0 is a dense MLP, layer 1 the MoE
    n_group=4,
    topk_group=2,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
)
MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(intermediate_size=128, num_local_experts=4, num_experts_per_tok=2),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            intermediate_size=128,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_experts=4,
            num_experts_per_tok=2,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            head_dim=16,
        ),
    ),
    "olmoe": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        dict(intermediate_size=32, num_experts=4, num_experts_per_tok=2),
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            head_dim=16,
            sliding_window=4,
        ),
    ),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(_DEEPSEEK, q_lora_rank=32)),
    "deepseek_v2": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(_DEEPSEEK, q_lora_rank=None, topk_method="group_limited_greedy"),
    ),
}


#: Models whose attention has no SDPA path in transformers (GPT-OSS: attention sinks).
EAGER_ATTENTION = {"gpt_oss"}


def moe_causal_lm(name: str, **overrides: Any) -> nn.Module:
    """The Hugging Face MoE causal LM ``name`` (small config, random weights), not rewritten."""
    import transformers

    config_name, model_name, model_overrides = MODELS[name]
    config = getattr(transformers, config_name)(**{**SMALL, **model_overrides, **overrides})
    config._attn_implementation = "eager" if name in EAGER_ATTENTION else "sdpa"
    torch.manual_seed(0)
    return redraw_weights(getattr(transformers, model_name)(config).eval())


def _rewritten_lm(name: str, strategy: str = "auto") -> Call:
    """The MoE causal LM ``name`` after ``rewrite_moe``: token ids in, logits out."""
    model = rewrite_moe(moe_causal_lm(name), strategy=strategy)
    assert any(isinstance(m, SparseMoE) for m in model.modules())
    return Call(model, lambda m, ids: m(input_ids=ids, use_cache=False, return_dict=False)[0])


def _check_moe_model(name: str, strategy: str = "auto") -> None:
    check_model(_rewritten_lm(name, strategy), (torch.randint(0, VOCAB, (2, 8)),))


def test_mixtral_model_matches_hf_logits_on_the_runtime() -> None:
    _check_moe_model("mixtral")


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "qwen2_moe",
        "qwen3_moe",
        "olmoe",
        "deepseek_v3",
        "gpt_oss",
        pytest.param(
            "deepseek_v2",
            marks=pytest.mark.xfail(
                strict=True,
                raises=UnsupportedOpError,
                reason="DeepSeek-V2's attention applies rotary embeddings with complex tensors "
                "(torch.view_as_complex), which coreai-torch does not lower "
                "(docs/frontier_models.md)",
            ),
        ),
    ],
)
def test_moe_model_matches_hf_logits_on_the_runtime(name: str) -> None:
    _check_moe_model(name)


@pytest.mark.slow
def test_mixtral_model_with_every_token_gathering_its_experts() -> None:
    _check_moe_model("mixtral", strategy="gather")


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in MODELS if n != "deepseek_v2"])
def test_moe_model_dynamic_sequence_length(name: str) -> None:
    """One program for every prompt length (the experts the T tokens selected, gathered).
    DeepSeek-V2 needs its documented rotary patch: tests/models/test_frontier.py."""
    check_dynamic_sequence_length(_rewritten_lm(name))


@pytest.mark.slow
def test_mixtral_model_dynamic_sequence_length_with_every_token_gathering_its_experts() -> None:
    check_dynamic_sequence_length(_rewritten_lm("mixtral", strategy="gather"))


def test_hf_moe_models_do_not_export_without_the_rewrite() -> None:
    """What rewrite_moe is for: the HF block's data-dependent expert loop."""
    from coreai_torch.frontend.export import export_decomposed

    model = moe_causal_lm("mixtral")
    wrapped = Call(model, lambda m, ids: m(input_ids=ids, use_cache=False, return_dict=False)[0])
    with pytest.raises(Exception, match="data-dependent"):
        export_decomposed(wrapped, (torch.randint(0, VOCAB, (1, 4)),))


# ------------------------------------------------------------------------------- refusals


class HomeMadeMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 4)
        self.experts = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(e(x) for e in self.experts)


def test_other_moe_blocks_are_refused_by_class_and_nothing_changes() -> None:
    import transformers
    from transformers.models.phimoe.modeling_phimoe import PhimoeSparseMoeBlock

    config = transformers.PhimoeConfig(hidden_size=DIM, intermediate_size=32, num_local_experts=4)
    model = nn.ModuleDict(
        {"ok": hf_block("mixtral"), "phi": PhimoeSparseMoeBlock(config), "own": HomeMadeMoE()}
    )
    with pytest.raises(UnsupportedMoEError) as info:
        rewrite_moe(model)
    message = str(info.value)
    assert "PhimoeSparseMoeBlock at phi" in message and "HomeMadeMoE at own" in message
    assert "MixtralSparseMoeBlock" in message  # in the list of supported blocks
    assert type(model["ok"]).__name__ == "MixtralSparseMoeBlock"  # refused before any change


def test_a_supported_class_with_another_structure_is_refused() -> None:
    block = hf_block("mixtral")
    block.experts[1].w1 = nn.Identity()
    with pytest.raises(UnsupportedMoEError, match="MixtralSparseMoeBlock does not have the "):
        rewrite_moe(block)


def test_models_without_moe_blocks_are_left_alone() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    before = copy.deepcopy(model.state_dict())
    assert rewrite_moe(model) is model
    assert model.state_dict().keys() == before.keys()
    with pytest.raises(ValueError, match="strategy"):
        rewrite_moe(model, strategy="sparse")
