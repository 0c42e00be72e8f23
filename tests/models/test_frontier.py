"""Frontier architectures that fail in ``torch.export`` itself (data-dependent Python in the
Hugging Face code), each with the workaround documented in docs/frontier_models.md: the test
shows the export error, applies the documented patch and checks the converted model against
HF eager on the runtime (1e-4 * max(1, max|ref|)).  Each model is built by a function
returning a :class:`Frontier` (the half-precision tests reuse them).  Each also converts once
with a dynamic sequence length (the SSM scans rewritten with ``torch._higher_order_ops.scan``,
Bamba's length in whole chunks; docs/control_flow_and_dynamic_shapes.md).

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
from coreai_torch.frontend.export import export_decomposed
from tests.models.common import (
    Call,
    check_model,
    check_model_dynamic,
    model_tolerance,
    redraw_weights,
)
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
    wrapped = Call(
        model,
        lambda m, ids, pixels: m(
            input_ids=ids, pixel_values=pixels, use_cache=False, return_dict=False
        )[0],
    )

    def patch(monkeypatch: pytest.MonkeyPatch) -> None:
        mask = types.MethodType(static_placeholder_mask, model.model)
        monkeypatch.setattr(model.model, "get_placeholder_mask", mask)

    args = (llava_ids(24), torch.randn(1, 3, 32, 32))
    return Frontier(wrapped, args, "get_placeholder_mask", patch)


def llava_ids(length: int) -> torch.Tensor:
    """A prompt of ``length`` tokens with the 16 image tokens (one per patch) at 2-17."""
    ids = torch.randint(0, 100, (1, length))
    ids[0, 2:18] = 100
    return ids


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


# ---------------------------------------------------------------- dynamic sequence length
#
# One program for every prompt length (``torch.export.Dim`` on the sequence axis), run at three
# lengths.  The hybrid SSM models need more than their static patches: their sequence scans
# are Python loops (or pad to whole chunks) that torch.export specializes to the example
# length; written with ``torch._higher_order_ops.scan`` they stay dynamic.


def _seq() -> torch.export.Dim:
    """The sequence Dim (below the configs' 64 positions)."""
    return torch.export.Dim("seq", min=2, max=48)


def _prompts(case: Frontier, lengths: tuple[int, ...]) -> list[tuple[torch.Tensor]]:
    batch = case.args[0].shape[0]
    return [(torch.randint(0, VOCAB, (batch, n)),) for n in lengths]


def _check_export_specializes(case: Frontier, args: tuple[torch.Tensor, ...]) -> None:
    """torch.export cannot keep the sequence length of ``case.model`` dynamic."""
    with pytest.raises(torch._dynamo.exc.UserError, match="Constraints violated"):
        export_decomposed(case.model, args, dynamic_shapes=(({1: _seq()},),))


def _check_rewrite_keeps_the_length_dynamic(
    case: Frontier,
    monkeypatch: pytest.MonkeyPatch,
    rewrite: Callable[[pytest.MonkeyPatch], None],
) -> None:
    """``case.model`` (with its static patch) does not export with a dynamic length; after
    ``rewrite`` it computes what it computed (model tolerance, eager), exports with one and
    matches eager on the runtime at three lengths."""
    case.patch(monkeypatch)
    runs = _prompts(case, (12, 5, 20))
    _check_export_specializes(case, runs[0])
    with torch.no_grad():
        before = [case.model(*args) for args in runs]
        rewrite(monkeypatch)
        after = [case.model(*args) for args in runs]
    for ref, out in zip(before, after, strict=True):
        err = float((out - ref).abs().max())
        assert err <= model_tolerance([ref]), f"the rewrite changes the logits: max|err| {err:.3e}"
    check_model_dynamic(case.model, runs, (({1: _seq()},),))


@pytest.mark.slow
def test_llava_dynamic_text_length(monkeypatch: pytest.MonkeyPatch) -> None:
    """LLaVA's language side: a dynamic number of tokens around the 16 image tokens (the
    image features are written with ``masked_scatter`` over a dynamic length)."""
    case = llava()
    case.patch(monkeypatch)
    image = case.args[1]
    runs = [(llava_ids(n), image) for n in (24, 18, 40)]
    seq = torch.export.Dim("seq", min=17, max=48)
    check_model_dynamic(case.model, runs, (({1: seq}, None),))


@pytest.mark.slow
def test_deepseek_v2_dynamic_sequence_length(monkeypatch: pytest.MonkeyPatch) -> None:
    case = deepseek_v2()
    case.patch(monkeypatch)
    check_model_dynamic(case.model, _prompts(case, (12, 5, 20)), (({1: _seq()},),))


@pytest.mark.slow
def test_bamba_dynamic_length_in_whole_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mamba-2's chunked scan pads the sequence to whole chunks (``if pad_size > 0`` and the
    chunk reshapes of ``BambaMixer.torch_forward``): torch.export specializes any other
    length.  A length that is a multiple of ``mamba_chunk_size`` stays dynamic (prompts
    right-padded to whole chunks; the logits of the real tokens do not see the padding)."""
    case = bamba()
    case.patch(monkeypatch)
    _check_export_specializes(case, _prompts(case, (12,))[0])
    chunk = case.model.model.config.mamba_chunk_size
    seq = chunk * torch.export.Dim("chunks", min=2, max=6)
    check_model_dynamic(
        case.model, _prompts(case, (2 * chunk, 3 * chunk, 5 * chunk)), (({1: seq},),)
    )


def scanned_mamba_slow_forward(
    self: nn.Module,
    input_states: torch.Tensor,
    cache_params: Any = None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``JambaMambaMixer.slow_forward`` without a cache, its selective scan (a Python loop over
    the time steps) written with ``torch._higher_order_ops.scan``."""
    from torch._higher_order_ops.scan import scan

    assert cache_params is None, "prefill without a cache only"
    seq_len = input_states.shape[1]
    hidden, gate = self.in_proj(input_states).transpose(1, 2).chunk(2, dim=1)
    if attention_mask is not None:
        hidden = hidden * attention_mask.unsqueeze(1)
    hidden = self.act(self.conv1d(hidden)[..., :seq_len])
    if attention_mask is not None:
        hidden = hidden * attention_mask.unsqueeze(1)
    sizes = [self.time_step_rank, self.ssm_state_size, self.ssm_state_size]
    time_step, B, C = torch.split(self.x_proj(hidden.transpose(1, 2)), sizes, dim=-1)
    time_step, B, C = self.dt_layernorm(time_step), self.b_layernorm(B), self.c_layernorm(C)
    dt = nn.functional.softplus(self.dt_proj(time_step)).transpose(1, 2)  # (batch, inner, T)
    A = -torch.exp(self.A_log.float())
    dA = torch.exp(A[None, :, None, :] * dt[:, :, :, None])  # (batch, inner, T, state)
    dBu = dt[:, :, :, None] * B[:, None, :, :].float() * hidden[:, :, :, None].float()

    def step(state: torch.Tensor, xs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        a, bu, c = xs
        state = a * state + bu
        return state, (state.to(hidden.dtype) @ c.unsqueeze(-1))[..., 0]

    state = torch.zeros(hidden.shape[0], self.intermediate_size, self.ssm_state_size)
    over_time = (dA.permute(2, 0, 1, 3), dBu.permute(2, 0, 1, 3), C.transpose(0, 1))
    _, ys = scan(step, state.to(dA.dtype), over_time)
    y = ys.permute(1, 2, 0) + hidden * self.D[None, :, None]
    return self.out_proj((y * self.act(gate)).transpose(1, 2))


@pytest.mark.slow
def test_jamba_dynamic_length_with_a_scanned_selective_scan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As it is, the loop over time steps is unrolled."""
    from transformers.models.jamba.modeling_jamba import JambaMambaMixer

    def rewrite(monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(JambaMambaMixer, "slow_forward", scanned_mamba_slow_forward)

    _check_rewrite_keeps_the_length_dynamic(jamba(), monkeypatch, rewrite)


def scanned_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Qwen3-Next's gated delta rule token by token (``torch_recurrent_gated_delta_rule``),
    its loop over the tokens written with ``torch._higher_order_ops.scan``; a stand-in for
    ``torch_chunk_gated_delta_rule``, whose loop over chunks and padding to whole chunks
    torch.export specializes.  ``chunk_size`` is not used."""
    from torch._higher_order_ops.scan import scan
    from transformers.models.qwen3_next.modeling_qwen3_next import l2norm

    dtype = query.dtype
    if use_qk_l2norm_in_kernel:
        query, key = l2norm(query, dim=-1, eps=1e-6), l2norm(key, dim=-1, eps=1e-6)
    query = query * query.shape[-1] ** -0.5
    batch, _, heads, key_dim = key.shape
    if initial_state is None:
        initial_state = torch.zeros(batch, heads, key_dim, value.shape[-1])

    def step(state: torch.Tensor, xs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        q, k, v, g, beta = xs
        state = state * g.exp()[..., None, None]
        delta = (v - (state * k.unsqueeze(-1)).sum(-2)) * beta.unsqueeze(-1)
        state = state + k.unsqueeze(-1) * delta.unsqueeze(-2)
        return state, (state * q.unsqueeze(-1)).sum(-2)

    over_tokens = [x.float().transpose(0, 1) for x in (query, key, value, g, beta)]
    state, out = scan(step, initial_state.float(), over_tokens)
    return out.transpose(0, 1).to(dtype), (state if output_final_state else None)


@pytest.mark.slow
def test_qwen3_next_dynamic_length_with_a_scanned_gated_delta_rule(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As it is, the sequence is padded to whole chunks and the loop over chunks unrolled."""
    case = qwen3_next()

    def rewrite(monkeypatch: pytest.MonkeyPatch) -> None:
        for module in case.model.modules():
            if type(module).__name__ == "Qwen3NextGatedDeltaNet":
                monkeypatch.setattr(module, "chunk_gated_delta_rule", scanned_gated_delta_rule)

    _check_rewrite_keeps_the_length_dynamic(case, monkeypatch, rewrite)
