"""``AIProgram.optimize()`` never makes a program read its weights more often, and
``compress()`` covers every weight in either order.

Core AI's rewrite folds a per-channel scale of a convolution's result into the kernel even when
the result is read elsewhere too (PReLU after a convolution, as in MTCNN): every convolution
then ran twice, on an anonymous scaled copy of its kernel that made the asset larger and that
``compress()`` after ``optimize()`` left in float32.  ``coreai_torch.passes.safe_rewrite``
guards against it; the kernels the rewrite does fold (batch norm) are named after their weight
(``coreai_torch.passes.folded_weights``), so ``compress()`` finds them.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn as nn

from coreai_torch import TorchConverter
from coreai_torch._mlir import ir, run_pre_compilation_rewrite
from coreai_torch.compression import LinearQuantization
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.program import AIProgram
from coreai_torch.verify import verify
from tests.helpers import asset_bytes

#: the ops that read a weight's data at run time
WEIGHT_READERS = frozenset(
    {
        "coreai.conv2d",
        "coreai.conv3d",
        "coreai.conv_transpose2d",
        "coreai.conv_transpose3d",
        "coreai.batch_matmul",
        "coreai.decomposable.broadcasting_batch_matmul",
        "coreai.gather_nd",
        "coreai.gather_along_axis",
    }
)


def weight_readers(program: AIProgram) -> Counter[str]:
    """How many ops of each weight-reading kind the program runs."""
    found: Counter[str] = Counter()

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name in WEIGHT_READERS:
            found[op.name] += 1
        return ir.WalkResult.ADVANCE

    program.structural_module.operation.walk(visit)
    return found


class PReLUNet(nn.Module):
    """MTCNN's shape: convolutions each followed by a per-channel PReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 32, 3),
            nn.PReLU(32),
            nn.MaxPool2d(2, 2),
            nn.Conv2d(32, 64, 3),
            nn.PReLU(64),
            nn.Conv2d(64, 128, 3),
            nn.PReLU(128),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _prelu_net() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    model = PReLUNet().eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.PReLU):
                module.weight.uniform_(0.05, 0.5)  # a learned slope per channel
    return model, (torch.randn(1, 3, 24, 24),)


def _convert(model: nn.Module, args: tuple) -> AIProgram:
    return TorchConverter().add_exported_program(export_decomposed(model, args)).to_coreai()


def test_prelu_cnn_keeps_its_convolutions_and_asset_size_after_optimize() -> None:
    model, args = _prelu_net()
    program = _convert(model, args)
    before, size = weight_readers(program), asset_bytes(program)
    assert before["coreai.conv2d"] == 3
    program.optimize()
    assert weight_readers(program) == before  # was 6 convolutions
    assert asset_bytes(program) < 1.01 * size  # was 2x (a scaled copy of every kernel)
    report = verify(model, args, program=program)
    assert report.ok, str(report)


def test_compress_covers_the_prelu_cnn_in_either_order() -> None:
    model, args = _prelu_net()
    config = LinearQuantization(bits=8)
    ratios, names = [], []
    for optimize_first in (True, False):
        program = _convert(model, args)
        size = asset_bytes(program)
        if optimize_first:
            program.optimize()
        report = program.compress(config)
        if not optimize_first:
            program.optimize()
        ratios.append(asset_bytes(program) / size)
        names.append(sorted(w.name for w in report.weights))
        assert verify(model, args, program=program, atol=0.05, rtol=0.05).ok
    assert names[0] == names[1] == ["body.3.weight", "body.5.weight"]
    assert ratios[0] == pytest.approx(ratios[1], abs=0.01)  # optimize first: 0.64x before
    assert ratios[0] < 0.3


def test_raw_core_ai_rewrite_still_duplicates_shared_convolutions() -> None:
    """Documents the upstream behaviour the guard exists for: if this starts failing,
    coreai-core's rewrite no longer duplicates a convolution whose result is read twice."""
    model, args = _prelu_net()
    program = _convert(model, args)
    module = program.mlir_module
    with module.context:
        run_pre_compilation_rewrite(module=module)
    assert weight_readers(program)["coreai.conv2d"] == 6


class SharedScale(nn.Module):
    """A layer's result read by a per-channel scale and by something else."""

    def __init__(self, layer: nn.Module, scale_shape: tuple[int, ...], form: str) -> None:
        super().__init__()
        self.layer, self.form = layer, form
        self.register_buffer("s", torch.rand(scale_shape) + 0.5)
        self.register_buffer("s2", torch.rand(scale_shape) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        y, s = self.layer(x), self.s
        if self.form == "outputs":
            return y * s, y + 1.0
        if self.form == "two scales":
            return y * s + y * self.s2
        if self.form == "divide":
            return torch.where(y > 0, y, y / s)
        return torch.where(y > 0, y, (y - 1.0) * s)  # shifted


def _layer(kind: str) -> tuple[nn.Module, tuple[int, ...], tuple[int, ...]]:
    if kind == "conv2d":
        return nn.Conv2d(4, 16, 3), (1, 16, 1, 1), (1, 4, 8, 8)
    if kind == "conv2d_no_bias":
        return nn.Conv2d(4, 16, 3, bias=False), (1, 16, 1, 1), (2, 4, 8, 8)
    if kind == "conv2d_grouped":
        return nn.Conv2d(4, 16, 3, groups=4), (1, 16, 1, 1), (1, 4, 8, 8)
    if kind == "conv3d":
        return nn.Conv3d(4, 8, 3), (1, 8, 1, 1, 1), (1, 4, 5, 5, 5)
    if kind == "conv1d":
        return nn.Conv1d(4, 16, 3), (1, 16, 1), (1, 4, 12)
    if kind == "conv_transpose2d":
        return nn.ConvTranspose2d(4, 16, 3), (1, 16, 1, 1), (1, 4, 6, 6)
    return nn.Linear(16, 16), (1, 16), (3, 16)


class ConvBatchNorm(nn.Module):
    """The fold the rewrite is for: batch norm into the convolution (one reader each)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 16, 3)
        self.norm = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(torch.relu(self.norm(self.conv(x))))


KINDS = ["conv2d", "conv2d_no_bias", "conv2d_grouped", "conv3d", "conv1d", "conv_transpose2d"]
FORMS = ["outputs", "two scales", "divide", "shifted"]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", [*KINDS, "linear"])
def test_optimize_never_adds_weight_reading_ops(kind: str, form: str) -> None:
    torch.manual_seed(0)
    layer, scale_shape, input_shape = _layer(kind)
    model = SharedScale(layer, scale_shape, form).eval()
    args = (torch.randn(input_shape),)
    program = _convert(model, args)
    before = weight_readers(program)
    program.optimize()
    after = weight_readers(program)
    assert all(after[op] <= count for op, count in before.items()), (before, after)
    assert not set(after) - set(before)
    report = verify(model, args, program=program)
    assert report.ok, str(report)


def test_batch_norm_is_still_folded_into_its_convolution() -> None:
    torch.manual_seed(0)
    model = ConvBatchNorm().eval()
    with torch.no_grad():
        model.norm.running_var.uniform_(0.5, 2.0)
        model.norm.running_mean.uniform_(-1.0, 1.0)
    args = (torch.randn(1, 4, 8, 8),)
    program = _convert(model, args)
    before = weight_readers(program)
    program.optimize()
    assert weight_readers(program) == before
    text = str(program)
    assert "broadcasting_mul" not in text and "broadcasting_divide" not in text  # folded
    assert verify(model, args, program=program).ok


def _batch_norm_net() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(16, 32, 3),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3),
        nn.BatchNorm2d(64),
    ).eval()
    with torch.no_grad():
        for norm in (model[1], model[4]):
            norm.running_var.uniform_(0.5, 2.0)
            norm.running_mean.uniform_(-1.0, 1.0)
    return model, (torch.randn(1, 16, 16, 16),)


def test_compress_after_optimize_covers_the_kernels_batch_norm_was_folded_into() -> None:
    """optimize() folds batch norm into an anonymous copy of the kernel; compress() after it
    left that copy in float32 (int8 asset 1.0x the float32 one) and called the weight no longer
    read.  The copy is now the weight ``<name>.folded``."""
    model, args = _batch_norm_net()
    config = LinearQuantization(bits=8)
    ratios, names = [], []
    for optimize_first in (True, False):
        program = _convert(model, args)
        size = asset_bytes(program)
        if optimize_first:
            program.optimize()
            assert "dense_resource<resource_" not in str(program)  # no anonymous weight
        report = program.compress(config)
        if not optimize_first:
            program.optimize()
        assert report.skipped == []  # every weight the program reads is listed
        names.append(sorted(w.name for w in report.weights))
        ratios.append(asset_bytes(program) / size)
        assert verify(model, args, program=program, atol=0.05, rtol=0.05).ok
    assert names == [["0.weight.folded", "3.weight.folded"], ["0.weight", "3.weight"]]
    # (compressed first, batch norm stays a scale and shift after the decompression)
    assert ratios[0] == pytest.approx(ratios[1], abs=0.03) and max(ratios) < 0.32
