"""Normalizations and softmax on the Core AI runtime vs eager PyTorch: layer, group, instance
and RMS norm (composites and inline), softmax / log_softmax, and batch norm with batch
statistics: ``track_running_stats=False`` (batch statistics in eval mode too) and training
mode, whose running-statistic updates become Core AI state."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from coreai_torch import TorchConverter
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.runtime import Session
from tests.helpers import check_module
from tests.lowerings.support import check_fn


@pytest.mark.parametrize(
    ("norm", "shape"),
    [
        (nn.BatchNorm1d(4, track_running_stats=False), (5, 4)),
        (nn.BatchNorm1d(4, affine=False, track_running_stats=False), (3, 4, 6)),
        (nn.BatchNorm2d(3, track_running_stats=False), (2, 3, 5, 4)),
        (nn.BatchNorm3d(2, track_running_stats=False), (2, 2, 3, 2, 4)),
    ],
    ids=["1d-affine", "1d-plain", "2d", "3d"],
)
def test_batch_statistics_in_eval_mode(norm: nn.Module, shape: tuple[int, ...]) -> None:
    if norm.affine:
        with torch.no_grad():
            norm.weight.uniform_(0.5, 2)
            norm.bias.uniform_(-1, 1)
    check_module(norm.eval(), (torch.randn(shape) * 3 + 1,))


def test_batch_statistics_of_functional_batch_norm() -> None:
    check_fn(lambda x: F.batch_norm(x, None, None, training=True), torch.randn(4, 3, 5))


class TrainModeBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4, momentum=0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))


def test_training_mode_updates_running_statistics_as_state() -> None:
    torch.manual_seed(0)
    model = TrainModeBlock().train()
    x = torch.randn(2, 3, 6, 6) * 2 + 0.5
    ep = export_decomposed(model, (x,))
    program = TorchConverter().add_exported_program(ep, output_names=["y"]).to_coreai()
    program.optimize()
    state = {
        "b_bn_running_mean": model.bn.running_mean.clone(),
        "b_bn_running_var": model.bn.running_var.clone(),
        "b_bn_num_batches_tracked": model.bn.num_batches_tracked.clone(),
    }
    with Session(program) as session:
        assert sorted(session.descriptor().state_names) == sorted(state)
        for step in range(3):
            inputs = x + step
            out = session.run({"x": inputs}, state=state if step == 0 else None)
            with torch.no_grad():
                expected = model(inputs)
            np.testing.assert_allclose(out["y"], expected.numpy(), atol=1e-4, rtol=1e-4)
            current = session.state_values()
            np.testing.assert_allclose(
                current["b_bn_running_mean"], model.bn.running_mean.numpy(), atol=1e-5
            )
            np.testing.assert_allclose(
                current["b_bn_running_var"], model.bn.running_var.numpy(), atol=1e-4, rtol=1e-5
            )
            assert current["b_bn_num_batches_tracked"] == model.bn.num_batches_tracked.item()
    assert model.bn.num_batches_tracked.item() == 3


# --------------------------------------------------------- layer, group, instance, RMS ----


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_normalizations(dtype: torch.dtype) -> None:
    """Over one or several trailing dims, with and without affine parameters."""
    w8, b8 = torch.randn(8).to(dtype), torch.randn(8).to(dtype)
    w6 = torch.randn(6).to(dtype)

    def f(x, img):
        return (
            F.layer_norm(x, [8], w8, b8),
            F.layer_norm(x, [5, 8], eps=1e-3),
            F.rms_norm(x, [8], w8),
            F.rms_norm(x, [5, 8]),
            F.group_norm(img, 3, w6, w6),
            F.group_norm(img, 1),
            F.instance_norm(img),
            F.instance_norm(img, weight=w6, bias=w6),
        )

    tol = {torch.float32: 1e-4, torch.float16: 4e-3}[dtype]
    x, img = (torch.randn(2, 5, 8) * 3).to(dtype), torch.randn(2, 6, 4, 3).to(dtype)
    check_fn(f, x, img, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax(dtype: torch.dtype) -> None:
    def f(x):
        return (
            x.softmax(-1), x.softmax(0), F.log_softmax(x, 1), x.log_softmax(-1),
            x.softmax(-1, dtype=torch.float32),
        )  # fmt: skip

    x = (torch.randn(3, 4, 7) * 5).to(dtype)
    x[0, 0, 0] = float("-inf")
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    check_fn(f, x, atol=tol, rtol=tol)
