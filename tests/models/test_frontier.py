"""Frontier architectures that fail in ``torch.export`` itself (data-dependent Python in the
Hugging Face code), each with the workaround documented in docs/frontier_models.md: the test
shows the export error, applies the documented patch and checks the converted model against
HF eager on the runtime (1e-4 * max(1, max|ref|)).  Each model is built by a function
returning a :class:`Frontier` (the half-precision tests reuse them).

Small configs, random weights; nothing is downloaded.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn as nn

from coreai_torch import rewrite_moe
from coreai_torch.verify import export_decomposed
from tests.models.common import Call, check_model, redraw_weights
from tests.models.test_decoder_lms import SMALL, VOCAB


def _build(config_class: str, model_class: str, **overrides: Any) -> nn.Module:
    import transformers

    config = getattr(transformers, config_class)(**overrides)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return redraw_weights(getattr(transformers, model_class)(config).eval())


def _prompt() -> tuple[torch.Tensor]:
    return (torch.randint(0, VOCAB, (1, 16)),)


def _logits(model: nn.Module) -> Call:
    return Call(model, lambda m, ids: m(input_ids=ids, use_cache=False, return_dict=False)[0])


class Frontier(NamedTuple):
    """A frontier model (tensors in, logits out), its example inputs, the export error it
    raises as it is, and the documented patch (applied through ``monkeypatch``)."""

    model: nn.Module
    args: tuple[torch.Tensor, ...]
    error: str
    patch: Callable[[pytest.MonkeyPatch], None]


def _check_fails_then_works(case: Frontier, monkeypatch: pytest.MonkeyPatch) -> None:
    """``case.model`` does not export (the message contains ``case.error``); after
    ``case.patch`` it converts and matches eager."""
    with pytest.raises(Exception, match=case.error):
        export_decomposed(case.model, case.args)
    case.patch(monkeypatch)
    check_model(case.model, case.args)


# --------------------------------------------------------------- multimodal: LLaVA family


def static_placeholder_mask(self, input_ids, inputs_embeds, image_features):
    """``LlavaModel.get_placeholder_mask`` without its data-dependent count check."""
    mask = input_ids == self.config.image_token_id
    return mask.unsqueeze(-1).expand_as(inputs_embeds)


def llava() -> Frontier:
    import transformers

    vision = transformers.CLIPVisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
    )
    text = transformers.LlamaConfig(**{k: v for k, v in SMALL.items() if k != "use_cache"})
    model = _build(
        "LlavaConfig",
        "LlavaForConditionalGeneration",
        vision_config=vision,
        text_config=text,
        image_token_index=100,
        image_seq_length=16,
    )
    ids = torch.randint(0, 100, (1, 24))
    ids[0, 2:18] = 100  # 16 image tokens: one per patch
    wrapped = Call(
        model,
        lambda m, ids, pixels: m(
            input_ids=ids, pixel_values=pixels, use_cache=False, return_dict=False
        )[0],
    )

    def patch(monkeypatch: pytest.MonkeyPatch) -> None:
        mask = types.MethodType(static_placeholder_mask, model.model)
        monkeypatch.setattr(model.model, "get_placeholder_mask", mask)

    return Frontier(wrapped, (ids, torch.randn(1, 3, 32, 32)), "get_placeholder_mask", patch)


@pytest.mark.slow
def test_llava_with_a_static_placeholder_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    _check_fails_then_works(llava(), monkeypatch)


# ------------------------------------------------------- hybrid SSM / linear attention


def _static_mamba_mask(model: nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill from position 0: HF's mask, without asking ``cache_position``."""
    monkeypatch.setattr(
        model.model, "_update_mamba_mask", lambda attention_mask, cache_position: attention_mask
    )


def bamba() -> Frontier:
    model = _build(
        "BambaConfig",
        "BambaForCausalLM",
        **SMALL,
        attn_layer_indices=[1],
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_d_state=16,
        mamba_chunk_size=8,
    )

    def patch(monkeypatch: pytest.MonkeyPatch) -> None:
        _static_mamba_mask(model, monkeypatch)

    return Frontier(_logits(model), _prompt(), "_update_mamba_mask", patch)


@pytest.mark.slow
def test_bamba_with_a_static_mamba_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    _check_fails_then_works(bamba(), monkeypatch)


def prefill_causal_mask(attention_mask, input_tensor, cache_position):
    """Jamba's additive causal mask for a prompt starting at position 0 (no padding mask),
    sized from the input's shape instead of ``cache_position[-1] + 1``."""
    seq = input_tensor.shape[1]
    dtype = input_tensor.dtype
    mask = torch.full((seq, seq), torch.finfo(dtype).min, dtype=dtype).triu(1)
    return mask[None, None].expand(input_tensor.shape[0], 1, -1, -1)


def jamba() -> Frontier:
    model = _build(
        "JambaConfig",
        "JambaForCausalLM",
        **SMALL,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=8,
        mamba_dt_rank=8,
        use_mamba_kernels=False,
    )
    rewrite_moe(model)

    def patch(monkeypatch: pytest.MonkeyPatch) -> None:
        _static_mamba_mask(model, monkeypatch)
        monkeypatch.setattr(model.model, "_update_causal_mask", prefill_causal_mask)

    return Frontier(_logits(model), _prompt(), "_update_mamba_mask", patch)


@pytest.mark.slow
def test_jamba_mixture_of_experts_with_static_masks(monkeypatch: pytest.MonkeyPatch) -> None:
    _check_fails_then_works(jamba(), monkeypatch)


def qwen3_next() -> Frontier:
    model = _build(
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        **{**SMALL, "num_hidden_layers": 4},  # three gated-delta-net layers, one attention
        head_dim=16,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_experts=4,
        num_experts_per_tok=2,
    )
    with torch.no_grad():  # Qwen3NextRMSNorm scales by 1 + weight: draw the weights around 0
        for module in model.modules():
            if type(module).__name__ == "Qwen3NextRMSNorm":
                module.weight.uniform_(-0.5, 0.5)
    rewrite_moe(model)

    def patch(monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(
            model.model,
            "_update_linear_attn_mask",
            lambda attention_mask, cache_position: attention_mask,
        )

    return Frontier(_logits(model), _prompt(), "_update_linear_attn_mask", patch)


@pytest.mark.slow
def test_qwen3_next_mixture_of_experts_with_a_static_linear_attention_mask(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _check_fails_then_works(qwen3_next(), monkeypatch)


# ------------------------------------------------------ DeepSeek-V2: complex rotary embedding


class RealRotaryEmbedding(nn.Module):
    """DeepSeek-V2's rotary embedding as ``(cos, sin)`` on a last axis of 2 instead of the
    complex ``torch.polar`` (default RoPE type)."""

    def __init__(self, rotary: nn.Module) -> None:
        super().__init__()
        self.rotary = rotary

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        inv_freq = self.rotary.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        freqs = (inv_freq @ position_ids[:, None, :].float()).transpose(1, 2)
        scale = self.rotary.attention_scaling
        return torch.stack([freqs.cos() * scale, freqs.sin() * scale], -1)


def real_apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, cos_sin: torch.Tensor):
    """``apply_rotary_emb`` of DeepSeek-V2 in real arithmetic: interleaved pairs rotated."""
    cos, sin = cos_sin.unsqueeze(1).unbind(-1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        a, b = x.float().reshape(*x.shape[:-1], -1, 2).unbind(-1)
        return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(3).type_as(x)

    return rotate(xq), rotate(xk)


def deepseek_v2() -> Frontier:
    """Exports, but its complex rotary embedding does not convert (``error``)."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2

    from tests.models.test_moe import moe_causal_lm

    model = rewrite_moe(moe_causal_lm("deepseek_v2"))

    def patch(monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(model.model, "rotary_emb", RealRotaryEmbedding(model.model.rotary_emb))
        monkeypatch.setattr(modeling_deepseek_v2, "apply_rotary_emb", real_apply_rotary_emb)

    return Frontier(_logits(model), (torch.randint(0, VOCAB, (2, 8)),), "complex", patch)


@pytest.mark.slow
def test_deepseek_v2_with_real_rotary_embeddings(monkeypatch: pytest.MonkeyPatch) -> None:
    from coreai_torch import UnsupportedOpError

    case = deepseek_v2()
    with pytest.raises(UnsupportedOpError, match=case.error):
        check_model(case.model, case.args)
    case.patch(monkeypatch)
    check_model(case.model, case.args)


#: name -> builder, for the tests that run every frontier model (half precision)
FRONTIER: dict[str, Callable[[], Frontier]] = {
    "llava": llava,
    "bamba": bamba,
    "jamba": jamba,
    "qwen3_next": qwen3_next,
    "deepseek_v2": deepseek_v2,
}
