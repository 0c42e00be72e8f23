"""PT2E programs (``torchao.quantization.pt2e``) and ``quantized_decomposed`` ops: weights
dequantized by ``dequantize_per_channel`` / ``_per_channel_group`` / ``_per_tensor`` are
stored compressed, activations are fake-quantized at run time as PyTorch computes it."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from torch.ao.quantization.fx import _decomposed  # noqa: F401  (registers quantized_decomposed)

from coreai_torch import TorchConverter, UnsupportedOpError, get_decomp_table
from coreai_torch.runtime import Session
from coreai_torch.verify import compare, eager_outputs, run_entrypoint
from tests.helpers import asset_bytes

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchao.quantization.pt2e import PerChannelMinMaxObserver
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer import (
        QuantizationAnnotation,
        QuantizationSpec,
        Quantizer,
    )

qd = torch.ops.quantized_decomposed


class WeightOnlyQuantizer(Quantizer):
    """Quantizes the weights of linear and convolution layers (``targets``) per output
    channel, to ``[quant_min, quant_max]`` (int8 storage), and nothing else."""

    def __init__(
        self,
        quant_min: int = -127,
        quant_max: int = 127,
        targets: tuple = (torch.ops.aten.linear.default, torch.ops.aten.conv2d.default),
    ) -> None:
        super().__init__()
        self.targets = targets
        self.spec = QuantizationSpec(
            dtype=torch.int8,
            quant_min=quant_min,
            quant_max=quant_max,
            qscheme=torch.per_channel_symmetric,
            ch_axis=0,
            observer_or_fake_quant_ctr=PerChannelMinMaxObserver,
        )

    def annotate(self, model: torch.fx.GraphModule) -> torch.fx.GraphModule:
        for node in model.graph.nodes:
            if node.target in self.targets:
                node.meta["quantization_annotation"] = QuantizationAnnotation(
                    input_qspec_map={node.args[1]: self.spec}, _annotated=True
                )
        return model

    def validate(self, model: torch.fx.GraphModule) -> None:
        pass


def pt2e(model: nn.Module, args: tuple[torch.Tensor, ...], quantizer: Quantizer) -> nn.Module:
    """``model`` quantized by PT2E (prepare, calibrate on ``args``, convert).  The export is
    run through ``run_decompositions({})`` first: it inlines the higher-order ops Hugging Face
    models export with (``torch.autocast`` / ``no_grad`` regions), whose submodules
    ``convert_pt2e`` cannot handle, and keeps ``aten.linear`` for the quantizer to annotate."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exported = torch.export.export(model.eval(), args).run_decompositions({})
        prepared = prepare_pt2e(exported.module(), quantizer)
        prepared(*args)
        return convert_pt2e(prepared)


def convert_and_check(
    model: nn.Module, args: tuple[torch.Tensor, ...], *, atol: float | None = None
) -> tuple[str, int]:
    """Export (decomposed), convert, optimize, run; compare with the program's own eager
    output. Returns the program text and its asset size."""
    ep = torch.export.export(model, args).run_decompositions(get_decomp_table())
    reference = eager_outputs(ep.module(), args)
    program = TorchConverter().add_exported_program(ep).to_coreai().optimize()
    tol = (
        atol if atol is not None else 1e-4 * max(1.0, max(float(r.abs().max()) for r in reference))
    )
    with Session(program) as session:
        actual = run_entrypoint(session, program, args)
    for e, a in zip(reference, actual, strict=True):
        result = compare("out", e, a, atol=tol, rtol=0.0)
        assert result.ok, str(result)
    size = asset_bytes(program)
    return str(program), size


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 128))


@pytest.mark.parametrize(
    ("quant_min", "quant_max", "storage"), [(-127, 127, "si8"), (-8, 7, "si4"), (-2, 1, "si2")]
)
def test_pt2e_weight_only_per_channel(quant_min: int, quant_max: int, storage: str) -> None:
    """``dequantize_per_channel`` of int8-held weights; 4- and 2-bit ranges are packed."""
    torch.manual_seed(0)
    args = (torch.randn(4, 256),)
    model = pt2e(mlp(), args, WeightOnlyQuantizer(quant_min, quant_max))
    text, size = convert_and_check(model, args)
    bits = int(storage[2:])
    assert f"x{storage}>" in text
    weights = 256 * 512 + 512 * 128
    assert size <= weights * bits / 8 + (512 + 128) * 4 * 3 + 48 * 1024


def test_pt2e_weight_only_convolution() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(16, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 32, 3))
    args = (torch.randn(1, 16, 12, 12),)
    text, size = convert_and_check(pt2e(model, args, WeightOnlyQuantizer()), args)
    assert "dequantize" in text and "x3x3xsi8>" in text
    assert size <= 16 * 64 * 9 + 64 * 32 * 9 + (64 + 32) * 4 * 3 + 48 * 1024


def test_pt2e_static_activations_and_weights() -> None:
    """XNNPACK's static configuration: int8 activations (quantize/dequantize_per_tensor at
    run time) and per-channel int8 weights.  An activation that the runtime's matmul rounds
    to the other side of a quantization boundary moves by one step of that quantizer, so
    the tolerance is one output step."""
    from torchao.testing.pt2e._xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )

    torch.manual_seed(0)
    args = (torch.randn(8, 256),)
    quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(True))
    model = pt2e(mlp(), args, quantizer)
    ep = torch.export.export(model, args)
    steps = [
        n.args[1]
        for n in ep.graph.nodes
        if n.target == qd.dequantize_per_tensor.default and isinstance(n.args[1], float)
    ]
    text, _ = convert_and_check(model, args, atol=max(steps) * 1.001)
    assert "xsi8>" in text and "coreai.round" in text


class GroupQuantizedLinear(nn.Module):
    """A linear layer whose int4 weight (held in int8) is dequantized per group of columns
    with ``dequantize_per_channel_group``, as ExecuTorch's 8da4w source transform does."""

    def __init__(self, out_features: int, in_features: int, group: int) -> None:
        super().__init__()
        weight = torch.randn(out_features, in_features)
        blocks = weight.reshape(out_features, -1, group)
        scale = blocks.abs().amax(-1) / 7
        codes = torch.clamp(torch.round(blocks / scale[..., None]), -8, 7).to(torch.int8)
        self.register_buffer("codes", codes.reshape(out_features, in_features))
        self.register_buffer("scales", scale)
        self.register_buffer("zeros", torch.randint(-2, 3, scale.shape, dtype=torch.int64))
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = qd.dequantize_per_channel_group(
            self.codes, self.scales, self.zeros, -8, 7, torch.int8, self.group, torch.float32
        )
        return nn.functional.linear(x, weight)


@pytest.mark.parametrize("group", [32, 128])
def test_dequantize_per_channel_group(group: int) -> None:
    torch.manual_seed(0)
    model = GroupQuantizedLinear(192, 256, group)
    text, size = convert_and_check(model, (torch.randn(3, 256),))
    assert "blockwise_shift_scale" in text and "x192xsi4>" in text  # stored [K, N]
    assert size <= 192 * 256 / 2 + 192 * 256 / group * (4 + 0.5) + 48 * 1024


class RuntimeDequantize(nn.Module):
    """Dequantization of a run-time value (no weight): computed at run time."""

    def forward(self, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        a = qd.dequantize_per_channel(q, scales, None, 1, -128, 127, torch.int8)
        b = qd.dequantize_per_tensor(q, 0.5, 3, -128, 127, torch.int8)
        c = qd.dequantize_per_channel_group(
            q, scales[:6], None, -128, 127, torch.int8, 8, torch.float32
        )
        return a + b + c


def test_run_time_values_are_dequantized_at_run_time() -> None:
    q = torch.randint(-128, 128, (6, 8), dtype=torch.int8)
    convert_and_check(RuntimeDequantize(), (q, torch.rand(8) + 0.5))


class PerTensorWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("codes", torch.randint(0, 256, (64, 128), dtype=torch.uint8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = qd.dequantize_per_tensor(self.codes, 0.01, 128, 0, 255, torch.uint8)
        q = qd.quantize_per_tensor(x, 0.05, 2, -128, 127, torch.int8)
        return qd.dequantize_per_tensor(q, 0.05, 2, -128, 127, torch.int8) @ w


def test_per_tensor_weight_and_activation_fake_quantization() -> None:
    torch.manual_seed(0)
    # activations that are not near a rounding boundary of the activation quantizer
    x = (torch.randint(-100, 100, (4, 64)) * 0.05).float()
    text, _ = convert_and_check(PerTensorWeight(), (x,))
    assert "xui8>" in text and "coreai.dequantize" in text


def test_a_codebook_of_run_time_values_is_rejected() -> None:
    from torchao.prototype.quantization.codebook_coreml import codebook_ops  # noqa: F401

    class RuntimeCodes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("book", torch.randn(1, 1, 16, 1))

        def forward(self, codes: torch.Tensor) -> torch.Tensor:
            return torch.ops.quant.dequantize_codebook(codes, self.book, 4, [-1, -1])

    ep = torch.export.export(RuntimeCodes(), (torch.randint(0, 16, (8, 32), dtype=torch.int32),))
    ep = ep.run_decompositions(get_decomp_table())
    with pytest.raises(UnsupportedOpError, match="codes and the codebook must be weights"):
        TorchConverter().add_exported_program(ep).to_coreai()
