"""ATen-derived composite ops (layer/RMS/group/instance norm, pixel_shuffle, SDPA), the
hand-written RMSNorm and RoPE recognised as ``rms_norm`` and ``rope``, and
``generate_composite_decl`` / ``emit_composite`` for user lowerings."""

from __future__ import annotations

import coreai.authoring as ca  # before the dialect import (coreai-core's import order)
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from coreai._compiler import ir
from coreai._compiler.dialects import coreai

from coreai_torch import TorchConverter, UnsupportedOpError, generate_composite_decl
from coreai_torch._utils import get_operands
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.ir.composite import emit_composite
from coreai_torch.verify import verify
from tests.externalize_support import composites, graphs
from tests.helpers import check_module, convert

assert ca  # imported for its side effect (import order)


class Norms(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.ln_same = nn.LayerNorm(8)
        self.ln_plain = nn.LayerNorm([3, 8], elementwise_affine=False, eps=1e-3)
        self.gn = nn.GroupNorm(2, 4)
        self.inorm = nn.InstanceNorm2d(4, affine=True)
        self.inorm_running = nn.InstanceNorm2d(4, track_running_stats=True)

    def forward(self, x: torch.Tensor, img: torch.Tensor):
        return (
            self.ln_same(self.ln(x)),
            self.ln_plain(x),
            self.gn(img),
            self.inorm(img),
            self.inorm_running(img),
            F.pixel_shuffle(img, 2),
            F.pixel_shuffle(torch.cat([img, img], 1).unsqueeze(0), 2),  # 5-D input
        )


def test_norms_and_pixel_shuffle_are_composites() -> None:
    model = Norms().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(0.5, 1.5)
        model.inorm_running.running_mean.uniform_(-1, 1)
        model.inorm_running.running_var.uniform_(0.5, 2)
    sample = (torch.randn(2, 3, 8), torch.randn(2, 4, 6, 6))
    program = convert(model, sample)
    found = graphs(program)
    ln = composites(program, "layer_norm")
    assert len(ln) == 2  # ln and ln_same are identical: one graph
    affine = next(g for g in ln if len(g.decl_inputs) == 3)
    assert affine.name.startswith("ln.layer_norm_") and affine.private and affine.no_inline
    assert affine.decl_inputs == ["input", "weight", "bias"]
    assert affine.attrs == {
        "eps": "9.99999974E-6 : f32",
        "normalized_shape": "[8 : si64]",
        "version": "1 : si64",
    }
    plain = next(g for g in ln if g is not affine)
    assert plain.decl_inputs == ["input"] and plain.attrs["normalized_shape"] == (
        "[3 : si64, 8 : si64]"
    )
    (gn,) = composites(program, "group_norm")
    assert gn.attrs == {
        "eps": "9.99999974E-6 : f32",
        "num_groups": "2 : si64",
        "version": "1 : si64",
    }
    instance = {g.attrs["use_input_stats"]: g for g in composites(program, "instance_norm")}
    assert instance["true"].decl_inputs == ["input", "weight", "bias"]
    assert instance["true"].attrs["momentum"] == "1.000000e-01 : f32"
    # in eval mode with tracked statistics the running stats are inputs
    assert instance["false"].decl_inputs == ["input", "running_mean", "running_var"]
    ps = composites(program, "pixel_shuffle")
    assert {g.attrs["upscale_factor"] for g in ps} == {"2 : si64"} and len(ps) == 2
    assert all(g.decl_inputs == ["input"] and g.decl_outputs == ["output"] for g in ps)
    assert len(found["main"].invokes) == 8
    program.optimize()
    report = verify(model, sample, program=program)
    assert report.ok, report
    assert report.max_abs < 1e-5


class Attention(nn.Module):
    def forward(self, q, k, v, k3, v3, kv, bool_mask, float_mask):
        return (
            F.scaled_dot_product_attention(q, k, v, is_causal=True),
            F.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask),  # one row hidden
            F.scaled_dot_product_attention(q, k, v, attn_mask=float_mask, scale=0.2),
            F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True),
            F.scaled_dot_product_attention(q[0], k3, v3),  # (3-D) query, broadcasting batch
            F.scaled_dot_product_attention(q[0, 0], k, v),  # 2-D query against 4-D keys
        )


class RMSNorms(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rms = nn.RMSNorm(8)
        self.rms_plain = nn.RMSNorm([3, 8], eps=1e-3, elementwise_affine=False)

    def forward(self, x: torch.Tensor):
        return (
            self.rms(x),
            self.rms_plain(x),
            F.rms_norm(x.half(), [8], self.rms.weight.half()),  # computed in float32
        )


def test_rms_norm_is_a_composite() -> None:
    model = RMSNorms().eval()
    with torch.no_grad():
        model.rms.weight.uniform_(0.5, 1.5)
    sample = (3 * torch.randn(2, 3, 8),)
    program = convert(model, sample)
    found = composites(program, "rms_norm")
    assert len(found) == 3
    affine = next(g for g in found if g.name.startswith("rms.rms_norm_"))
    assert affine.private and affine.no_inline
    assert affine.decl_inputs == ["input", "weight"] and affine.decl_outputs == ["output"]
    # eps=None is PyTorch's default: the machine epsilon of the compute dtype (float32)
    assert affine.attrs == {
        "eps": "1.1920929E-7 : f32",
        "normalized_shape": "[8 : si64]",
        "version": "1 : si64",
    }
    plain = next(g for g in found if g.name.startswith("rms_plain.rms_norm_"))
    assert plain.decl_inputs == ["input"]
    assert plain.attrs["normalized_shape"] == "[3 : si64, 8 : si64]"
    assert plain.attrs["eps"] == "1.000000e-03 : f32"
    half = next(g for g in found if "xf16" in g.text)
    assert "tensor<2x3x8xf32>" in half.text  # upcast inside, as ATen does
    report = verify(model, sample, program=program.optimize(), atol=1e-6, rtol=1e-6)
    assert report.ok, report


class HandWrittenRMSNorm(nn.Module):
    """Hugging Face's LlamaRMSNorm, verbatim."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(size) + 0.5)
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class HandWrittenNorms(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = HandWrittenRMSNorm(8)
        self.half_norm = HandWrittenRMSNorm(8).half()

    def forward(self, x: torch.Tensor):
        h = x.half()
        variance = h.float().pow(2).mean(-1, keepdim=True)  # also used below: stays raw ops
        shared = h.float() * torch.rsqrt(variance + 1e-5)
        return self.norm(x), self.half_norm(h), shared + variance


def test_hand_written_rms_norm_becomes_the_rms_norm_composite() -> None:
    model = HandWrittenNorms().eval()
    sample = (3 * torch.randn(2, 3, 8),)
    program = convert(model, sample)
    found = {g.name.split(".rms_norm_")[0]: g for g in composites(program, "rms_norm")}
    assert set(found) == {"norm", "half_norm"}
    assert found["norm"].decl_inputs == ["input", "weight"]
    assert found["norm"].attrs["eps"] == "9.99999997E-7 : f32"
    # in half precision the weight multiplies after the cast back: not part of the composite
    assert found["half_norm"].decl_inputs == ["input"]
    assert "coreai.rsqrt" in graphs(program)["main"].text  # the chain whose values are reused
    report = verify(model, sample, program=program.optimize(), atol=0, rtol=0)
    assert report.ok, report  # bit-identical


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``rotate_half``, verbatim."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class HandWrittenRoPE(nn.Module):
    """Hugging Face's ``apply_rotary_pos_emb`` (full and partial rotary), and a rotation whose
    halves are reused elsewhere (stays raw ops)."""

    def forward(self, q, k, cos, sin):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q_embed = (q * cos) + (rotate_half(q) * sin)
        k_embed = (k * cos) + (rotate_half(k) * sin)
        rot, rest = k[..., :4], k[..., 4:]  # partial: the first 4 features rotate
        partial = torch.cat(((rot * cos[..., :4]) + (rotate_half(rot) * sin[..., :4]), rest), -1)
        half = q[..., 4:]
        reused = (q * cos) + (torch.cat((-half, q[..., :4]), -1) * sin) + half.amax()
        return q_embed, k_embed, partial, reused


def test_hand_written_rope_becomes_the_rope_composite() -> None:
    model = HandWrittenRoPE().eval()
    angles = torch.randn(2, 5, 4)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    sample = (torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), cos, sin)
    program = convert(model, sample)
    found = composites(program, "rope")
    assert len(found) == 3  # q and k share nothing but their op: one graph per shape
    assert all(g.decl_inputs == ["input", "cos", "sin"] for g in found)
    assert all(g.attrs["interleaved"] == "false" for g in found)
    report = verify(model, sample, program=program.optimize(), atol=0, rtol=0)
    assert report.ok, report  # bit-identical


def test_aten_composites_can_be_switched_off() -> None:
    model = RMSNorms().eval()
    sample = (torch.randn(2, 3, 8),)
    ep = export_decomposed(model, sample)
    program = TorchConverter(aten_composites=False).add_exported_program(ep).to_coreai()
    assert list(graphs(program)) == ["main"] and "coreai.rsqrt" in str(program)
    assert verify(model, sample, program=program.optimize(), atol=1e-6, rtol=1e-6).ok
    with pytest.raises(TypeError):
        TorchConverter(False)  # type: ignore[misc]  # the options are keyword-only


def test_sdpa_composite_variants() -> None:
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)
    kv = torch.randn(2, 2, 6, 8)
    bool_mask = torch.rand(5, 6) > 0.5
    bool_mask[2] = False
    bool_mask[[0, 1, 3, 4], 0] = True
    float_mask = torch.randn(1, 4, 5, 6)
    float_mask[..., 1, :] = float("-inf")
    sample = (q, k, v, k[0], v[0], kv, bool_mask, float_mask)
    program = convert(Attention().eval(), sample)
    found = composites(program, "scaled_dot_product_attention")
    assert len(found) == 6
    by_inputs = {}
    for g in found:
        by_inputs.setdefault(len(g.decl_inputs), []).append(g)
    assert len(by_inputs[4]) == 2
    assert all(g.decl_inputs[3] == "attn_mask" for g in by_inputs[4])
    gqa = next(g for g in found if g.attrs["enable_gqa"] == "true")
    assert "tensor<2x2x6x8xf32>" in gqa.text
    assert {g.attrs.get("scale") for g in found} == {None, "2.000000e-01 : f32"}
    program.optimize()
    report = verify(Attention().eval(), sample, program=program)
    assert report.ok, report


def test_native_norms_return_mean_and_rstd() -> None:
    class Native(nn.Module):
        def forward(self, x, img, w, b):
            out, mean, rstd = torch.ops.aten.native_layer_norm(x, [8], w, b, 1e-5)
            g_out, g_mean, g_rstd = torch.ops.aten.native_group_norm(
                img, b[:4], None, 2, 4, 9, 2, 1e-5
            )
            return out, mean, rstd, g_out, g_mean, g_rstd

    sample = (torch.randn(2, 3, 8), torch.randn(2, 4, 3, 3), torch.randn(8), torch.randn(8))
    check_module(Native().eval(), sample)


def test_attention_dropout_is_rejected() -> None:
    class Dropout(nn.Module):
        def forward(self, q):
            return F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)

    with pytest.raises(UnsupportedOpError, match=r"dropout_p=0\.1: attention dropout is random"):
        convert(Dropout(), (torch.randn(1, 2, 3, 4),))


def test_a_user_override_replaces_the_composite() -> None:
    model = nn.LayerNorm(8).eval()
    ep = export_decomposed(model, (torch.randn(2, 8),))
    converter = TorchConverter()

    @converter.register_torch_lowering("aten::layer_norm.default", allow_override=True)
    def plain_layer_norm(values_map, node, loc):
        x, w, b = get_operands(values_map, node, [0, 2, 3], loc)
        mean = coreai.reduce_mean(x, [-1], loc=loc)
        centered = coreai.broadcasting_sub(x, mean, loc=loc)
        var = coreai.reduce_mean(coreai.broadcasting_mul(centered, centered), [-1])
        inv = coreai.rsqrt(coreai.broadcasting_add(var, 1e-5))
        return coreai.broadcasting_add(
            coreai.broadcasting_mul(coreai.broadcasting_mul(centered, inv), w), b
        )

    program = converter.add_exported_program(ep).to_coreai()
    assert not composites(program) and list(graphs(program)) == ["main"]
    assert verify(model, (torch.randn(2, 8),), program=program.optimize()).ok


# --------------------------------------------------------- user lowerings emitting composites


@torch.library.custom_op("composite_test::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor, scale: torch.Tensor, alpha: float) -> torch.Tensor:
    return torch.tanh(x * alpha) * scale


@scaled_tanh.register_fake
def _(x, scale, alpha):
    return torch.empty_like(x)


class UsesScaledTanh(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.rand(6) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scaled_tanh(scaled_tanh(x, self.scale, 0.5), self.scale, 2.0)


def _tanh_body(alpha: float):
    def body(x: ir.Value, scale: ir.Value) -> ir.Value:
        return coreai.broadcasting_mul(coreai.tanh(coreai.broadcasting_mul(x, alpha)), scale)

    return body


def test_user_lowering_emits_its_own_composite_op() -> None:
    model = UsesScaledTanh().eval()
    sample = (torch.randn(3, 6),)
    converter = TorchConverter()

    @converter.register_torch_lowering("composite_test::scaled_tanh.default")
    def lower(values_map, node, loc):
        x, scale = get_operands(values_map, node, [0, 1], loc)
        alpha = node.args[2]
        (y,) = emit_composite(
            "scaled_tanh",
            [x, scale],
            _tanh_body(alpha),
            input_names=["input", "scale"],
            op_attrs={"alpha": alpha},
        )
        return y

    program = converter.add_exported_program(export_decomposed(model, sample)).to_coreai()
    found = composites(program, "scaled_tanh")
    assert sorted(g.attrs["alpha"] for g in found) == ["2.000000e+00 : f32", "5.000000e-01 : f32"]
    assert all(
        g.decl_inputs == ["input", "scale"] and g.attrs["version"] == "1 : si64" for g in found
    )
    assert verify(model, sample, program=program.optimize()).ok


def test_user_lowering_builds_a_composite_graph_with_generate_composite_decl() -> None:
    model = UsesScaledTanh().eval()
    sample = (torch.randn(3, 6),)
    converter = TorchConverter()
    built: dict[float, str] = {}

    @converter.register_torch_lowering("composite_test::scaled_tanh.default")
    def lower(values_map, node, loc):
        x, scale = get_operands(values_map, node, [0, 1], loc)
        alpha = node.args[2]
        if alpha not in built:
            decl = generate_composite_decl(
                "scaled_tanh", ["input", "scale"], ["output"], {"alpha": alpha, "version": 2}
            )
            # insert the graph in front of the graph being built (@main)
            current = ir.InsertionPoint.current.block.owner
            name = f"scaled_tanh_{len(built)}"
            with ir.InsertionPoint(current), loc:
                graph = coreai.GraphOp(
                    name,
                    [x.type, scale.type],
                    [x.type],
                    ["input", "scale"],
                    ["output"],
                    private=True,
                    no_inline=True,
                    composite_decl=decl,
                )
                with graph.block:
                    coreai.output([_tanh_body(alpha)(*graph.arguments)])
            built[alpha] = name
        return coreai.invoke([x.type], built[alpha], [x, scale], loc=loc)[0]

    program = converter.add_exported_program(export_decomposed(model, sample)).to_coreai()
    found = composites(program, "scaled_tanh")
    assert {g.name for g in found} == {"scaled_tanh_0", "scaled_tanh_1"}
    assert all(g.attrs["version"] == "2 : si64" for g in found)
    assert verify(model, sample, program=program.optimize()).ok


def test_generate_composite_decl_values_and_errors() -> None:
    from coreai_torch._mlir import new_context

    with new_context(), ir.Location.unknown():
        decl = generate_composite_decl(
            "my_op",
            ["a"],
            ["b"],
            {
                "flag": True,
                "count": 3,
                "eps": 0.5,
                "mode": "fast",
                "dims": (1, -1),
                "dtype": torch.float16,
                "skipped": None,
            },
        )
        text = str(decl)
        assert text.startswith('#coreai.composite_declaration<"my_op" = {input_names = ["a"]')
        for part in (
            "count = 3 : si64",
            "dims = [1 : si64, -1 : si64]",
            "dtype = f16",
            "eps = 5.000000e-01 : f32",
            "flag = true",
            'mode = "fast"',
            "version = 1 : si64",
        ):
            assert part in text, text
        assert "skipped" not in text
        with pytest.raises(ValueError, match="composite op name"):
            generate_composite_decl("bad name", ["a"], ["b"])
        with pytest.raises(TypeError, match="attribute 'bad' has type object"):
            generate_composite_decl("op", ["a"], ["b"], {"bad": object()})
        with pytest.raises(TypeError, match="input_names must be a list"):
            generate_composite_decl("op", "a", ["b"])
    with pytest.raises(RuntimeError, match="needs an active MLIR context"):
        generate_composite_decl("op", ["a"], ["b"])


def test_causal_attention_with_dynamic_lengths() -> None:
    class Causal(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    from coreai_torch.runtime import Session
    from coreai_torch.verify import compare, run_entrypoint

    lq, lk = torch.export.Dim("lq", min=2, max=32), torch.export.Dim("lk", min=2, max=32)
    sample = (torch.randn(1, 2, 5, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8))
    ep = export_decomposed(Causal(), sample, dynamic_shapes=({2: lq}, {2: lk}, {2: lk}))
    program = TorchConverter().add_exported_program(ep).to_coreai()
    (graph,) = composites(program, "scaled_dot_product_attention")
    assert "coreai.range" in graph.text  # the causal mask is built at run time
    program.optimize()
    with Session(program) as session:
        for n, m in ((3, 5), (6, 4), (7, 7)):
            args = (torch.randn(1, 2, n, 8), torch.randn(1, 2, m, 8), torch.randn(1, 2, m, 8))
            (actual,) = run_entrypoint(session, program, args)
            assert compare("out", Causal()(*args), actual).ok, (n, m)
