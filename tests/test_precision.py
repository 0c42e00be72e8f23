"""Half precision: ``TorchConverter(compute_precision=torch.float16 | torch.bfloat16)``.

The policy (``coreai_torch.precision``), what the converted IR holds (half weights, casts at
the boundary and at the fp32 islands, selectors), numerics on the runtime against float32
eager PyTorch, the islands that keep overflowing models working, and models that are already
in 16 bits.  The model families are in ``tests/models/test_half_precision.py``.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from coreai_torch import TorchConverter, precision
from coreai_torch.cli import main
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.precision import Precision
from coreai_torch.verify import verify
from tests.helpers import check_half, run_program

HALF = [torch.float16, torch.bfloat16]
IDS = ["fp16", "bf16"]
ELEMENT = {torch.float16: "f16", torch.bfloat16: "bf16"}


def convert(model: nn.Module, args: tuple, **options: object):
    ep = export_decomposed(model.eval(), args)
    return TorchConverter(**options).add_exported_program(ep).to_coreai()


class MLP(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.fc2(F.gelu(self.fc1(self.norm(x)))), -1)


# ------------------------------------------------------------------------------ the policy ---


def test_from_spec() -> None:
    assert precision.from_spec("fp16").compute == torch.float16
    assert precision.from_spec("float16").compute == torch.float16
    assert precision.from_spec("bf16").compute == torch.bfloat16
    assert precision.from_spec("BFloat16").compute == torch.bfloat16
    assert precision.from_spec("fp32").compute == torch.float32
    assert precision.from_spec(None) == Precision()
    assert precision.from_spec(torch.bfloat16).name == "bf16"
    policy = Precision(torch.float16, keep_fp32_modules=["lm_head"])
    assert precision.from_spec(policy) is policy
    with pytest.raises(ValueError, match=r"unknown precision 'int4'.*'fp16', 'bf16', 'fp32'"):
        precision.from_spec("int4")
    with pytest.raises(ValueError, match=r"compute_precision must be one of torch\.float16"):
        Precision(torch.float64)


def test_converter_options_are_validated() -> None:
    with pytest.raises(ValueError, match="compute_precision must be one of"):
        TorchConverter(compute_precision=torch.int8)
    with pytest.raises(ValueError, match="io_dtype must be one of"):
        TorchConverter(compute_precision=torch.float16, io_dtype=torch.int32)
    with pytest.raises(TypeError, match="keep_fp32_ops must be a collection of op names"):
        TorchConverter(compute_precision=torch.float16, keep_fp32_ops="aten::mm")
    with pytest.raises(TypeError, match="keep_fp32_ops entries are qualified ATen op names"):
        TorchConverter(compute_precision=torch.float16, keep_fp32_ops=["mm"])
    with pytest.raises(TypeError, match="keep_fp32_modules entries are module paths"):
        TorchConverter(compute_precision=torch.float16, keep_fp32_modules=[3])
    with pytest.raises(TypeError, match="keep_fp32 must be a function of the FX node"):
        TorchConverter(compute_precision=torch.float16, keep_fp32="lm_head")
    converter = TorchConverter(
        compute_precision=precision.from_spec("bf16"), keep_fp32_ops=[torch.ops.aten.mm]
    )
    assert converter.precision.compute == torch.bfloat16
    assert converter.precision.keep_fp32_ops == {"aten::mm"}


# ------------------------------------------------------------------------------- the IR -------


@pytest.mark.parametrize("dtype", HALF, ids=IDS)
def test_weights_are_stored_half_and_the_boundary_stays_float32(dtype: torch.dtype) -> None:
    model, x = MLP(), torch.randn(4, 32)
    program = convert(model, (x,), compute_precision=dtype).optimize()
    text = str(program)
    half = ELEMENT[dtype]
    weights = re.findall(r"dense_resource<\"?([\w.]+)\"?> : tensor<[\dx]+x?(\w+)>", text)
    assert weights and all(t == half for _, t in weights), weights
    signature = re.search(r"coreai.graph @main\((.*)\) -> \((.*)\) attributes", text)
    assert "tensor<4x32xf32>" in signature.group(1) and "tensor<4x32xf32>" in signature.group(2)
    assert program.precision.compute == dtype
    check_half(model, (x,), program, rel=1e-2 if dtype == torch.float16 else 3e-2)


def test_io_dtype_makes_the_boundary_half() -> None:
    model, x = MLP(), torch.randn(4, 32)
    program = convert(model, (x,), compute_precision=torch.float16, io_dtype=torch.float16)
    text = str(program)
    assert re.search(r"@main\(%arg0: tensor<4x32xf16>.*-> \(tensor<4x32xf16>", text)
    out = run_program(program, {"x": x.half()})
    reference = model(x)
    assert out.dtype == np.float16
    assert np.abs(out.astype(np.float32) - reference.detach().numpy()).max() < 1e-2


def test_the_softmax_island_computes_in_float32() -> None:
    model, x = MLP(), torch.randn(4, 32)
    text = str(convert(model, (x,), compute_precision=torch.float16))
    assert re.search(r"coreai.softmax %\d+, %\d+ : \(tensor<4x32xf32>", text)
    text = str(convert(model, (x,), compute_precision=torch.float16, fp32_islands=False))
    assert re.search(r"coreai.softmax %\d+, %\d+ : \(tensor<4x32xf16>", text)


@pytest.mark.parametrize(
    "selector, fc1",
    [
        (dict(keep_fp32_modules=["fc2"]), "f16"),
        (dict(keep_fp32_modules=["*.fc2", "model.?c2"]), "f16"),
        (dict(keep_fp32_modules=[nn.Linear]), "f32"),
        (dict(keep_fp32_modules=["Linear"]), "f32"),
        (dict(keep_fp32_ops={"aten::addmm"}), "f32"),
        (dict(keep_fp32_ops={"aten::addmm.default"}), "f32"),
        (dict(keep_fp32=lambda node: "fc2" in str(node.meta.get("nn_module_stack"))), "f16"),
    ],
    ids=["path", "glob", "class", "class_name", "op", "overload", "predicate"],
)
def test_selectors_keep_nodes_and_their_weights_in_float32(selector: dict, fc1: str) -> None:
    model, x = MLP(), torch.randn(4, 32)
    if selector.get("keep_fp32_modules") == ["*.fc2", "model.?c2"]:
        model = nn.Sequential()
        model.add_module("model", MLP())
    program = convert(model, (x,), compute_precision=torch.float16, **selector).optimize()
    text = str(program)
    # the weights, stored transposed by optimize() (fc1: 32 x 128, fc2: 128 x 32)
    assert re.search(r"dense_resource<[^>]+> : tensor<128x32xf32>", text)
    assert re.search(rf"dense_resource<[^>]+> : tensor<32x128x{fc1}>", text)
    check_half(model, (x,), program, rel=1e-2)


def test_float32_is_the_program_as_exported() -> None:
    model, x = MLP(), torch.randn(4, 32)
    assert str(convert(model, (x,))) == str(convert(model, (x,), compute_precision="fp32"))


def test_dtype_arguments_of_half_nodes_follow_the_compute_dtype() -> None:
    class Dequantized(nn.Module):
        """An int8 weight with per-channel scales, dequantized to float32 in the graph."""

        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("q", torch.randint(-127, 128, (16, 64), dtype=torch.int8))
            self.scale = nn.Parameter(torch.rand(16, 1) / 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            weight = self.q.to(torch.float32) * self.scale
            return x @ weight.t() + torch.zeros_like(x[:, :16], dtype=torch.float32)

    model, x = Dequantized(), torch.randn(2, 64)
    program = convert(model, (x,), compute_precision=torch.float16).optimize()
    text = str(program)
    assert re.search(r"coreai.cast %\d+ : tensor<16x64xsi8> to tensor<16x64xf16>", text), text
    assert "tensor<16x64xf32>" not in text.split("batch_matmul")[0]
    check_half(model, (x,), program, rel=1e-2)


# ----------------------------------------------------------------- islands keep models working


class ScaledAfterMatmul(nn.Module):
    """Attention that scales its scores after ``q @ k^T``: the unscaled scores (~1e5) overflow
    float16 although every input, weight and result is well within its range."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        with torch.no_grad():  # q and k aligned and large: q . k ~ 10 * 10 * |x|^2
            self.q.weight.copy_(10 * torch.eye(dim))
            self.k.weight.copy_(10 * torch.eye(dim) + 0.1 * torch.randn(dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2)
        return torch.softmax(scores / math.sqrt(x.shape[-1]) / 100, -1) @ x


class LogSumExp(nn.Module):
    """``log(sum(exp(x)))`` written out: exp(12) overflows float16."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.exp(x).sum(-1)) - x.mean(-1)


class RunningMean(nn.Module):
    """The mean of every prefix: the cumulative sum of 1024 values of ~100 overflows float16."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(x, -1) / torch.arange(1, x.shape[-1] + 1)


class SumPool(nn.Module):
    """A mean written as a sum: the sum of 1024 values of ~100 overflows float16."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(-1, keepdim=True) / x.shape[-1]


@pytest.mark.parametrize(
    "model, x",
    [
        (ScaledAfterMatmul(), 4 * torch.randn(2, 8, 64)),
        (LogSumExp(), 12 + torch.randn(4, 128)),
        (RunningMean(), 100 + torch.rand(4, 1024)),
        (SumPool(), 100 + torch.rand(4, 1024)),
    ],
    ids=["attention_scores", "logsumexp", "cumsum", "large_sum"],
)
def test_fp32_islands_keep_overflowing_models_working(model: nn.Module, x: torch.Tensor) -> None:
    reference = model(x)
    assert reference.isfinite().all()
    with_islands = convert(model, (x,), compute_precision=torch.float16).optimize()
    check_half(model, (x,), with_islands, rel=1e-2)
    without = convert(
        model, (x,), compute_precision=torch.float16, fp32_islands=False, check_range=False
    )
    out = run_program(without.optimize(), {"x": x})
    assert not np.isfinite(out).all(), "the model was expected to overflow without islands"


class LongLinear(nn.Module):
    """A linear layer over 4096 positive inputs: its dot products (~400) are far above the
    spacing of float16 at 256 (0.25), so a float16 running sum stops growing there."""

    def __init__(self, k: int = 4096) -> None:
        super().__init__()
        self.fc = nn.Linear(k, 16, bias=False)
        with torch.no_grad():
            self.fc.weight.uniform_(0.0, 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class LongBatchedProduct(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b


class LongEmbeddingBag(nn.Module):
    """Bags of 4096 rows of a table of positive values: sums (~400) and means that a float16
    running sum gets wrong."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(8, 16, mode=mode)
        with torch.no_grad():
            self.bag.weight.uniform_(0.0, 0.2)

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.bag(indices, offsets)


class LongAdaptivePool(nn.Module):
    """Adaptive average pooling of 4099 rows into 2 (windows that do not divide the rows: one
    averaging matrix per dimension, a product of 2050 terms per output)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.adaptive_avg_pool2d(x, (2, 1))


_SEEDED = torch.Generator().manual_seed(0)
_BAG_ARGS = (torch.randint(0, 8, (8192,), generator=_SEEDED), torch.tensor([0, 4096]))


@pytest.mark.parametrize(
    "model, args",
    [
        (LongLinear(), (torch.rand(4, 4096),)),
        (LongBatchedProduct(), (torch.rand(2, 4, 4096), torch.rand(2, 4096, 8))),
        (LongEmbeddingBag("sum"), _BAG_ARGS),
        (LongEmbeddingBag("mean"), _BAG_ARGS),
        (LongAdaptivePool(), (torch.rand(1, 4, 4099, 1, generator=_SEEDED) * 400,)),
    ],
    ids=["linear", "bmm", "embedding_bag_sum", "embedding_bag_mean", "adaptive_avg_pool"],
)
def test_fp32_accumulation_of_long_float16_products(model: nn.Module, args: tuple) -> None:
    """The runtime's float16 matmul accumulates in float16: ``fp32_accumulation`` (the
    default) multiplies in float32 and rounds once, as ATen does."""
    program = convert(model, args, compute_precision=torch.float16).optimize()
    check_half(model, args, program, rel=2e-3)
    native = convert(model, args, compute_precision=torch.float16, fp32_accumulation=False)
    with pytest.raises(AssertionError, match="relative error"):
        check_half(model, args, native.optimize(), rel=1e-2)


class MixtralBlock(nn.Module):
    """A Hugging Face Mixtral block made static by ``rewrite_moe``; returns the block's output
    and the router logits."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        from coreai_torch import rewrite_moe
        from tests.models.common import redraw_weights

        config = MixtralConfig(hidden_size=256, intermediate_size=128, num_local_experts=8)
        torch.manual_seed(0)
        self.block = rewrite_moe(redraw_weights(MixtralSparseMoeBlock(config).eval()))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.block(x)


def test_mixture_of_experts_routers_compute_in_float32() -> None:
    """Router logits rounded to bfloat16 tie (token 3 here: experts 7 and 5, second and third),
    and the runtime's top-k breaks the tie for the lower index, another expert than float32
    picks: the default policy keeps ``rewrite_moe``'s routers in float32, so the bfloat16
    program routes every token as the float32 model does."""
    model = MixtralBlock()
    torch.manual_seed(130)
    x = torch.randn(1, 7, 256)
    from coreai_torch.runtime import run_program as run_outputs

    out, _ = model(x)

    gate = model.block.router.gate.weight
    half_logits = F.linear(x.reshape(7, 256).bfloat16(), gate.bfloat16())
    assert (half_logits[3, 7] == half_logits[3, 5]).item(), "the example lost its tie"
    program = convert(model, (x,), compute_precision=torch.bfloat16).optimize()
    results = run_outputs(program, {"x": x}).values()
    converted = next(torch.as_tensor(r) for r in results if r.shape == tuple(out.shape))
    cosine = F.cosine_similarity(converted.float().flatten(), out.flatten(), dim=0)
    assert cosine > 0.9999  # below 0.99 with the router in bfloat16 (another expert)


class HandWrittenRMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(dim) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


@pytest.mark.parametrize(
    "norm",
    [
        nn.LayerNorm(64),
        nn.GroupNorm(4, 16),
        nn.InstanceNorm2d(16, affine=True),
        nn.BatchNorm2d(16),
        nn.RMSNorm(64),
        HandWrittenRMSNorm(64),
    ],
    ids=["layer_norm", "group_norm", "instance_norm", "batch_norm", "rms_norm", "hand_written"],
)
def test_norms_of_large_activations(norm: nn.Module) -> None:
    """Activations of ~300 (their squares overflow float16): the norms' statistics are
    computed in float32 inside their composite ops."""
    shape = (
        (2, 4, 64)
        if isinstance(norm, (nn.LayerNorm, nn.RMSNorm, HandWrittenRMSNorm))
        else (
            2,
            16,
            4,
            4,
        )
    )
    x = 300 * torch.randn(shape)
    if isinstance(norm, nn.BatchNorm2d):
        with torch.no_grad():
            norm.running_var.fill_(9e4)
    program = convert(norm, (x,), compute_precision=torch.float16).optimize()
    check_half(norm, (x,), program, rel=1e-2)


class OnePlusWeightRMSNorm(nn.Module):
    """Gemma's RMSNorm (scaled by ``1 + weight``, a small weight) of ``|x|``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1e-2 * torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.abs()  # a half activation (a norm reading a fed input directly is not fused)
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return normed * (1.0 + self.weight)


def test_rms_norm_weights_computed_from_parameters_stay_float32() -> None:
    """A fused RMSNorm reads its weight as exported, in float32, also when the weight is
    computed from a parameter (Gemma's ``1 + w``): the float16 program rounds its result once,
    within half an ulp of float16 of float32 eager's (``1 + w`` rounded to float16 added up to
    another half ulp, 9e-4 relative)."""
    torch.manual_seed(0)
    norm, x = OnePlusWeightRMSNorm(256), torch.randn(8, 256).half().float()
    program = convert(norm, (x,), compute_precision=torch.float16).optimize()
    out = torch.as_tensor(np.asarray(run_program(program, {"x": x}), np.float32))
    expected = norm(x).detach()
    relative = ((out - expected).abs() / expected.abs()).max().item()
    assert relative <= 2.0**-11 + 1e-5, relative


# ---------------------------------------------------------------- models already in 16 bits ---


@pytest.mark.parametrize("dtype", HALF, ids=IDS)
def test_a_half_model_converts_as_it_is(dtype: torch.dtype) -> None:
    model, x = MLP().to(dtype), torch.randn(4, 32).to(dtype)
    program = convert(model, (x,)).optimize()
    text = str(program)
    assert f'tensor<4x32x{ELEMENT[dtype]}> {{coreai.name = "x"}}' in text
    out = run_program(program, {"x": x})
    expected = model(x).float().detach().numpy()
    assert np.abs(np.asarray(out, np.float32) - expected).max() < 2 * torch.finfo(dtype).eps


# ------------------------------------------------------------------ programs, shapes, control


def test_entry_points_share_one_half_copy_of_each_weight() -> None:
    model = MLP()
    converter = TorchConverter(compute_precision=torch.float16)
    for name, batch in (("one", 1), ("four", 4)):
        ep = export_decomposed(model.eval(), (torch.randn(batch, 32),))
        converter.add_exported_program(ep, entrypoint_name=name)
    program = converter.to_coreai()
    parameters = sum(p.numel() for p in model.parameters() if p.numel() >= 64)
    assert program.weights.total_bytes == 2 * parameters  # once, in 16 bits
    for name, batch in (("one", 1), ("four", 4)):
        x = torch.randn(batch, 32)
        with torch.no_grad():
            expected = model(x).numpy()
        out = run_program(program, {"x": x}, entrypoint=name)
        assert np.abs(out - expected).max() < 1e-3


def test_dynamic_shapes() -> None:
    model = MLP().eval()
    batch = torch.export.Dim("batch", min=1, max=16)
    ep = export_decomposed(model, (torch.randn(4, 32),), dynamic_shapes=({0: batch},))
    program = TorchConverter(compute_precision=torch.float16).add_exported_program(ep)
    program = program.to_coreai().optimize()
    for n in (3, 9):
        check_half(model, (torch.randn(n, 32),), program, rel=1e-2)


def test_control_flow_bodies_run_as_exported() -> None:
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            return torch.cond(h.sum() > 0, lambda t: t * 2, lambda t: t - 1, (h,))

    model, x = Branchy(), torch.randn(2, 16)
    program = convert(model, (x,), compute_precision=torch.bfloat16).optimize()
    check_half(model, (x,), program, rel=3e-2)
    check_half(model, (-x,), program, rel=3e-2)


# --------------------------------------------------------------------- verify and the CLI ---


@pytest.mark.parametrize(
    "model, x, op, line",
    [
        (ScaledAfterMatmul(), 4 * torch.randn(2, 8, 64), "bmm", "scores = self.q(x) @ self"),
        (LogSumExp(), 12 + torch.randn(4, 128), "exp", "return torch.log(torch.exp(x)"),
    ],
    ids=["attention_scores", "logsumexp"],
)
def test_verify_names_the_first_node_that_overflows(
    model: nn.Module, x: torch.Tensor, op: str, line: str
) -> None:
    report = verify(model, (x,), precision=Precision(torch.float16, fp32_islands=False))
    assert not report.ok
    found = report.divergence
    assert found is not None and found.node.name == op and found.precision == "fp16"
    assert "NaN/Inf" in found.error.problem
    assert line in found.source and line in str(report)
    assert f"keep_fp32_ops={{'aten::{op}'}}" in str(report)
    assert verify(model, (x,), precision="fp16").ok  # the default islands


class MaskedLogSumExp(nn.Module):
    """A boolean mask computed before the overflowing ``exp`` and used after it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = x > 0
        return torch.where(keep, torch.exp(x), 0.0).sum(-1).log()


def test_verify_bisects_past_boolean_values() -> None:
    """The probes compare every value still needed after them, boolean masks included."""
    x = 12 + torch.randn(4, 128)
    report = verify(MaskedLogSumExp(), (x,), precision=Precision(torch.float16, fp32_islands=False))
    assert report.divergence is not None and report.divergence.node.name == "exp"


LOUD_PY = """
import torch
import torch.nn as nn


class Loud(nn.Module):
    '''A branch scaled up by 20000 and back: float16 overflows in between.'''

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        loud = self.fc(8 * x) * 20000.0
        return loud / (20000.0 + x.abs())


def make():
    torch.manual_seed(0)
    return Loud().eval(), (torch.randn(4, 16),)


class Accumulates(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.register_buffer("total", torch.zeros(16))

    def forward(self, x):
        y = self.fc(x)
        self.total.add_(y.sum(0))
        return y


def stateful():
    torch.manual_seed(0)
    return Accumulates().eval(), (torch.randn(4, 16),)
"""


def test_cli_converts_and_verifies_half_programs(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "loud.py").write_text(LOUD_PY)
    argv = ["convert", "loud.py:make", "--precision", "fp16", "--no-check-range"]
    assert main([*argv, "-o", "loud.aimodel"]) == 0
    assert "computed in fp16" in capsys.readouterr().out
    assert main(["verify", "loud.aimodel", "loud.py:make", "--precision", "fp16", "--bisect"]) == 1
    out = capsys.readouterr().out
    assert "fp16 tolerance 0.01 x max(1, max|expected|)" in out and "MISMATCH" in out
    assert "first diverging node: node 'mul_1' (op aten::mul.Tensor)" in out
    assert "loud.py:14 in forward: loud = self.fc(8 * x) * 20000.0" in out
    assert "keep_fp32_ops={'aten::mul'}" in out
    # the product stays large until the division: keep both in float32
    argv = ["convert", "loud.py:make", "--precision", "fp16", "--keep-fp32", "aten::mul,aten::div"]
    assert main([*argv, "-o", "kept.aimodel"]) == 0
    capsys.readouterr()
    assert main(["verify", "kept.aimodel", "loud.py:make", "--precision", "fp16"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "MATCH"
    # by default the conversion finds them on the example inputs, and says so
    with pytest.warns(RuntimeWarning, match="(?s)node 'mul_1' .*loud.py:14"):
        assert main(["convert", "loud.py:make", "--precision", "fp16", "-o", "auto.aimodel"]) == 0
    assert "range check on the example inputs: " in capsys.readouterr().out
    assert main(["verify", "auto.aimodel", "loud.py:make", "--precision", "fp16"]) == 0


def test_cli_verifies_a_half_program_with_a_state(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The state is stored in bfloat16 in the asset: verify feeds it in that type."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "loud.py").write_text(LOUD_PY)
    assert main(["convert", "loud.py:stateful", "--precision", "bf16", "-o", "s.aimodel"]) == 0
    assert "total bfloat16(16,)" in capsys.readouterr().out
    assert main(["verify", "s.aimodel", "loud.py:stateful", "--precision", "bf16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].startswith("b_total (state)") and lines[-2].endswith(" ok")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--precision", "int4"], "unknown precision 'int4'; use one of 'fp16', 'bf16', 'fp32'"),
        (["--keep-fp32", "lm_head"], "--keep-fp32 needs --precision fp16 or bf16"),
    ],
)
def test_cli_precision_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture, argv: list[str], message: str
) -> None:
    (tmp_path / "loud.py").write_text(LOUD_PY)
    assert main(["convert", str(tmp_path / "loud.py:make"), *argv]) == 2
    assert message in capsys.readouterr().err
