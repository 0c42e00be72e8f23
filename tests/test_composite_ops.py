"""coreai_torch.composite_ops: eager semantics, composite IR and numerics on the runtime,
and a 2-layer Llama-style decoder with every block externalized."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from coreai_torch import ExternalizeSpec
from coreai_torch.composite_ops import (
    SDPA,
    GatherMatmul,
    RMSNorm,
    RMSNormImpl,
    RoPE,
    SwiGLUExperts,
    default_specs,
    rope_cos_sin,
)
from tests.externalize_support import check_externalized, composites, graphs


def specs_for(*classes: type) -> list[ExternalizeSpec]:
    """The recommended specs (``default_specs()``) of the given composite op classes."""
    return [s for s in default_specs() if s.target_class in classes]


# ------------------------------------------------------------------------ eager semantics


def test_rms_norm_matches_the_definition() -> None:
    x = torch.randn(3, 5, 8)
    w = torch.randn(8)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    torch.testing.assert_close(RMSNormImpl(eps=1e-6)(x, w), expected)
    over_two = x / torch.sqrt(x.pow(2).mean((-2, -1), keepdim=True) + 1e-5)
    torch.testing.assert_close(RMSNormImpl(axes=(-2, -1))(x), over_two)
    half = x.half()
    out = RMSNormImpl()(half, w.half())
    assert out.dtype == torch.float16
    torch.testing.assert_close(
        out,
        (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w).half(),
        atol=2e-3,
        rtol=2e-3,
    )
    norm = RMSNorm(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(w)
    torch.testing.assert_close(norm(x), expected)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:  # Hugging Face's Llama convention
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def test_rope_matches_llama_and_complex_rotation() -> None:
    x = torch.randn(2, 3, 5, 8)  # (batch, heads, seq, head_dim)
    cos, sin = rope_cos_sin(5, 8)
    torch.testing.assert_close(RoPE()(x, cos, sin), x * cos + _rotate_half(x) * sin)
    # interleaved: multiply consecutive pairs by e^{i * position * frequency}
    cos_i, sin_i = rope_cos_sin(5, 8, interleaved=True)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    angles = torch.arange(5).float()[:, None] * inv_freq
    rotated = torch.view_as_complex(x.reshape(2, 3, 5, 4, 2).contiguous()) * torch.polar(
        torch.ones_like(angles), angles
    )
    torch.testing.assert_close(
        RoPE(interleaved=True)(x, cos_i, sin_i), torch.view_as_real(rotated).flatten(-2)
    )
    # partial rotary: the features past cos.shape[-1] pass through
    cos4, sin4 = rope_cos_sin(5, 4)
    out = RoPE()(x, cos4, sin4)
    torch.testing.assert_close(out[..., 4:], x[..., 4:])
    torch.testing.assert_close(out[..., :4], RoPE()(x[..., :4], cos4, sin4))


def test_sdpa_is_pytorch_sdpa() -> None:
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    mask = torch.rand(5, 6) > 0.5
    expected = F.scaled_dot_product_attention(q, k, v, mask, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(SDPA(scale=0.3, enable_gqa=True)(q, k, v, mask), expected)


def test_gather_matmul_matches_a_loop() -> None:
    weight, bias = torch.randn(4, 6, 5), torch.randn(4, 6)
    x = torch.randn(3, 5)
    idx = torch.tensor([[0, 3], [2, 2], [1, 0]])
    out = GatherMatmul()(x, weight, idx, bias)
    for t in range(3):
        for j in range(2):
            e = int(idx[t, j])
            torch.testing.assert_close(out[t, j], weight[e] @ x[t] + bias[e])
    per_expert_input = torch.randn(3, 2, 5)
    out = GatherMatmul()(per_expert_input, weight, idx)
    torch.testing.assert_close(out[1, 0], weight[2] @ per_expert_input[1, 0])


# --------------------------------------------------------------------- converted numerics


class NormsAndRope(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = RMSNorm(8)
        self.norm_2d = RMSNormImpl(axes=(-2, -1), eps=1e-4)
        self.rope = RoPE()
        self.rope_gptj = RoPE(interleaved=True)
        cos, sin = rope_cos_sin(5, 8)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)

    def forward(self, x: torch.Tensor, positions: torch.Tensor):
        y = self.norm(x)  # (2, 3, 5, 8)
        cos_i, sin_i = rope_cos_sin(positions, 8, interleaved=True)
        cos_p, sin_p = rope_cos_sin(positions, 4)
        return (
            self.norm_2d(y),
            self.rope(y, self.cos, self.sin),
            self.rope_gptj(y, cos_i, sin_i),
            self.rope(y, cos_p, sin_p),  # partial rotary
        )


def test_rms_norm_and_rope_composites_on_the_runtime() -> None:
    model = NormsAndRope().eval()
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
    sample = (torch.randn(2, 3, 5, 8), torch.arange(5) + 3)
    program, report = check_externalized(model, sample, specs_for(RMSNormImpl, RoPE))
    rms = composites(program, "rms_norm")
    assert sorted(g.attrs["axes"] for g in rms) == ["-1 : si64", "[-2 : si64, -1 : si64]"]
    rope = composites(program, "rope")
    assert all(g.decl_inputs == ["input", "cos", "sin"] for g in rope)
    # the externalized RoPE modules; the bodies of the non-interleaved ones hold the rope
    # composite their rotate-half arithmetic is recognised as (patterns.find_ropes)
    called = graphs(program)["main"].invokes
    modules = [g for g in rope if g.name in called]
    assert sorted(g.attrs["interleaved"] for g in modules) == ["false", "false", "true"]
    for g in modules:
        nested = [c for c in g.invokes if c in {r.name for r in rope}]
        assert len(nested) == (g.attrs["interleaved"] == "false")
    assert report.max_abs < 1e-5


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.plain = SDPA()
        self.causal = SDPA(is_causal=True)
        self.gqa = SDPA(is_causal=True, scale=0.25, enable_gqa=True)
        self.masked = SDPA()

    def forward(self, q, k, v, kv, bool_mask, float_mask):
        return (
            self.plain(q, k, v),
            self.causal(q, k, v),
            self.gqa(q, kv, kv),
            self.masked(q, k, v, attn_mask=bool_mask),
            self.masked(q, k, v, float_mask),
        )


def test_sdpa_composites_on_the_runtime() -> None:
    q, k, v = (torch.randn(2, 4, 6, 8) for _ in range(3))
    kv = torch.randn(2, 2, 6, 8)
    bool_mask = torch.rand(6, 6) > 0.4
    bool_mask[:, 0] = True
    float_mask = torch.randn(2, 1, 6, 6)
    program, report = check_externalized(
        Attention().eval(), (q, k, v, kv, bool_mask, float_mask), specs_for(SDPA)
    )
    sdpa = {g.name.split(".")[0] + str(len(g.decl_inputs)): g for g in composites(program, "sdpa")}
    assert set(sdpa) == {"plain3", "causal3", "gqa3", "masked4"}
    assert sdpa["gqa3"].attrs == {
        "enable_gqa": "true",
        "is_causal": "true",
        "scale": "2.500000e-01 : f32",
        "version": "1 : si64",
    }
    # one masked graph per mask dtype/shape
    masked = [g for g in composites(program, "sdpa") if len(g.decl_inputs) == 4]
    assert len(masked) == 2
    assert report.max_abs < 1e-5


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 4, bias=False)
        self.experts = SwiGLUExperts(num_experts=4, dim=8, hidden_dim=16)
        self.proj = GatherMatmul()
        self.proj_weight = nn.Parameter(torch.randn(4, 3, 8))
        self.proj_bias = nn.Parameter(torch.randn(4, 3))

    def forward(self, x: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights = torch.softmax(self.router(x), -1).gather(-1, indices)
        return (
            self.experts(x, indices, weights),
            self.proj(x, self.proj_weight, indices, self.proj_bias),
        )


def test_mixture_of_experts_composites_on_the_runtime() -> None:
    sample = (torch.randn(5, 8), torch.tensor([[0, 3], [1, 2], [3, 3], [2, 0], [1, 1]]))
    program, report = check_externalized(Experts().eval(), sample, specs_for(GatherMatmul))
    gm = composites(program, "gather_matmul")
    assert {tuple(g.decl_inputs) for g in gm} == {
        ("input", "weight", "indices"),
        ("input", "weight", "indices", "bias"),
    }
    assert len(graphs(program)["main"].invokes) == 4
    assert report.max_abs < 1e-4


# ------------------------------------------------------------------------ Llama-style decoder


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.k = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(heads * self.head_dim, dim, bias=False)
        self.rope = RoPE()
        self.sdpa = SDPA(is_causal=True, enable_gqa=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        y = self.sdpa(q, k, v)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class DecoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(dim)
        self.attn = SelfAttention(dim, heads, kv_heads)
        self.mlp_norm = RMSNorm(dim)
        self.mlp = Mlp(dim, hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class TinyLlama(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(DecoderLayer(dim, 4, 2, 64) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        cos, sin = rope_cos_sin(16, dim // 4)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, self.cos[:t], self.sin[:t])
        return self.lm_head(self.norm(x))


def test_llama_style_decoder_with_every_block_externalized() -> None:
    model = TinyLlama().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 7))
    specs = [*specs_for(RMSNormImpl, RoPE, SDPA), DecoderLayer, SelfAttention, Mlp]
    program, report = check_externalized(model, (ids,), specs)
    found = graphs(program)
    main = found["main"]
    layers = [found[name] for name in main.invokes if found[name].op is None]
    assert [g.name.split("_")[0] for g in layers] == ["layers.0", "layers.1"]
    for layer in layers:
        callees = [found[c] for c in layer.invokes]
        assert [c.op or c.name.split(".")[2].split("_")[0] for c in callees] == [
            "rms_norm",
            "attn",
            "rms_norm",
            "mlp",
        ]
        attention = callees[1]
        assert [found[c].op for c in attention.invokes] == ["rope", "rope", "sdpa"]
        sdpa = found[attention.invokes[2]]
        assert sdpa.attrs["is_causal"] == "true" and sdpa.attrs["enable_gqa"] == "true"
    # the final norm is a composite too; every composite op records a version
    assert found[main.invokes[-1]].op == "rms_norm"
    assert all(g.attrs["version"] == "1 : si64" for g in composites(program))
    with torch.no_grad():
        assert torch.equal(reference(ids), model(ids))
    assert report.max_abs < 1e-4, report
    print(f"decoder max abs error {report.max_abs:.2e}")


# ------------------------------------------------------------------------------ misc checks


@pytest.mark.parametrize("spec", default_specs(), ids=lambda s: s.composite_op_name)
def test_default_specs_name_real_attributes(spec: ExternalizeSpec) -> None:
    instance = spec.target_class()
    for attr in spec.composite_attrs or []:
        assert hasattr(instance, attr)
    assert re.fullmatch(r"[a-z_]+", spec.composite_op_name)
    assert spec.target_class.__doc__ and "forward(" in spec.target_class.__doc__
    assert math.isfinite(getattr(instance, "version", 1))


class CachedAttention(nn.Module):
    """Single-token decode with a KV cache kept in buffers (state), composite RoPE and SDPA."""

    def __init__(self, dim: int = 16, heads: int = 2, max_len: int = 8) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.norm = RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.rope = RoPE()
        self.sdpa = SDPA()
        self.register_buffer("k_cache", torch.zeros(1, heads, max_len, self.head_dim))
        self.register_buffer("v_cache", torch.zeros(1, heads, max_len, self.head_dim))
        cos, sin = rope_cos_sin(max_len, self.head_dim)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).view(1, 1, 3, self.heads, self.head_dim).unbind(2)
        cos, sin = self.cos.index_select(0, pos), self.sin.index_select(0, pos)
        q = self.rope(q.transpose(1, 2), cos, sin)
        k = self.rope(k.transpose(1, 2), cos, sin)
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v.transpose(1, 2))
        mask = (torch.arange(self.k_cache.shape[2]) <= pos).view(1, -1)
        y = self.sdpa(q, self.k_cache, self.v_cache, attn_mask=mask)
        return x + y.transpose(1, 2).reshape(1, 1, -1)


def test_kv_cache_decode_with_composites_keeps_state() -> None:
    from coreai_torch.runtime import Session
    from coreai_torch.verify import compare, run_entrypoint

    model = CachedAttention().eval()
    reference = copy.deepcopy(model)
    sample = (torch.randn(1, 1, 16), torch.tensor([0]))
    from tests.externalize_support import convert_externalized

    program = convert_externalized(model, sample, specs_for(RMSNormImpl, RoPE, SDPA))
    assert {g.op for g in composites(program)} == {
        "rms_norm",
        "rope",
        "sdpa",
        "scaled_dot_product_attention",
    }
    assert [s.name for s in program.signatures["main"].states] == ["b_k_cache", "b_v_cache"]
    program.optimize()
    worst = 0.0
    with Session(program) as session:
        for step in range(4):
            x = torch.randn(1, 1, 16)
            pos = torch.tensor([step])
            (actual,) = run_entrypoint(session, program, (x, pos))
            with torch.no_grad():
                expected = reference(x, pos)
            error = compare("out", expected, actual)
            assert error.ok, (step, error)
            worst = max(worst, error.max_abs)
        cache = session.state_values()["b_k_cache"]
    assert torch.allclose(torch.from_numpy(cache), reference.k_cache, atol=1e-5)
    assert worst < 1e-4


@pytest.mark.slow
def test_hugging_face_llama_with_externalized_blocks() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import (
        LlamaDecoderLayer,
        LlamaMLP,
        LlamaRMSNorm,
    )

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    config._attn_implementation = "sdpa"

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm = LlamaForCausalLM(config)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.lm(input_ids=ids, use_cache=False).logits

    specs = [
        ExternalizeSpec(LlamaRMSNorm, "rms_norm", ["variance_epsilon"]),
        LlamaDecoderLayer,
        LlamaMLP,
    ]
    program, report = check_externalized(Logits().eval(), (torch.randint(0, 128, (1, 9)),), specs)
    found = graphs(program)
    layers = [found[c] for c in found["main"].invokes if found[c].op is None]
    assert len(layers) == 2
    # the externalized LlamaRMSNorm (identical instances share one graph); its body holds the
    # aten rms_norm composite that the hand-written RMSNorm is recognised as
    rms = composites(program, "rms_norm")
    user = [g for g in rms if g.decl_inputs == ["hidden_states", "weight"]]
    assert len(user) == 1 and len(rms) == 2
    assert [found[c].op for c in user[0].invokes] == ["rms_norm"]
    assert (
        found["main"].invokes.count(user[0].name)
        + sum(layer.invokes.count(user[0].name) for layer in layers)
        == 5
    )
    assert report.max_abs < 1e-4
