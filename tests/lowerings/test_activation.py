"""Activation functions on the Core AI runtime vs eager PyTorch: relu/gelu/silu/elu
families, shrinks, thresholds, glu and prelu over several shapes and IEEE special values, in
models and in float16/bfloat16."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from tests.lowerings.support import check_fn
from tests.lowerings.values import (
    LOW_PRECISION_TOLERANCE,
    Case,
    check_cases,
    floats,
    grouped,
)

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu,
    "relu6": F.relu6,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "mish": F.mish,
    "elu": F.elu,
    "elu_alpha": lambda x: F.elu(x, alpha=0.3),
    "selu": F.selu,
    "celu": lambda x: F.celu(x, alpha=1.5),
    "leaky_relu": lambda x: F.leaky_relu(x, 0.2),
    "rrelu_eval": lambda x: F.rrelu(x, training=False),
    "hardtanh": lambda x: F.hardtanh(x, -0.5, 2.0),
    "hardsigmoid": F.hardsigmoid,
    "hardswish": F.hardswish,
    "softplus": lambda x: F.softplus(x, beta=2.0, threshold=5.0),
    "logsigmoid": F.logsigmoid,
    "softsign": F.softsign,
    "tanhshrink": F.tanhshrink,
    "hardshrink": lambda x: F.hardshrink(x, 0.7),
    "softshrink": lambda x: F.softshrink(x, 0.7),
    "threshold": lambda x: F.threshold(x, 0.1, -2.0),
    "glu": lambda x: F.glu(x, -1),
    "prelu": lambda x: F.prelu(x, torch.tensor([0.1], dtype=x.dtype)),
}


def _activation(name: str) -> Case:
    op = ACTIVATIONS[name]
    edge = torch.tensor([[float("nan"), float("inf"), -float("inf"), 0.0]])
    if name == "gelu":
        edge[0, 1] = 1e30  # see test_gelu_of_positive_infinity
    return (lambda *xs: tuple(op(x) for x in xs)), [
        floats(3, 4) * 4,
        edge,
        floats(2, 1, 2, 1, 2, 4),
    ]


@pytest.mark.parametrize("names", grouped(list(ACTIVATIONS), 4))
def test_activation(names: list[str]) -> None:
    check_cases([_activation(n) for n in names])


def test_gelu_of_positive_infinity() -> None:
    """gelu(+inf) is +inf (its limit). PyTorch's own float32 CPU kernel gives +inf on some
    machines and NaN on others (vectorized vs scalar erf path), so compare with the limit."""
    from coreai_torch.runtime import run_program
    from tests.lowerings.support import convert_fn

    x = torch.tensor([float("inf"), 1.0, -2.0])
    program = convert_fn(F.gelu, x)
    (got,) = run_program(program, {"args_0": x.numpy()}).values()
    assert got[0] == float("inf")
    torch.testing.assert_close(torch.from_numpy(got[1:]), F.gelu(x[1:]), atol=1e-5, rtol=1e-5)


def test_activations_in_model() -> None:
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.Hardswish(),
        torch.nn.Linear(16, 16),
        torch.nn.ELU(),
        torch.nn.Linear(16, 16),
        torch.nn.Mish(),
        torch.nn.Linear(16, 4),
        torch.nn.LogSigmoid(),
    ).eval()
    from tests.helpers import check_module

    check_module(model, (floats(2, 8),))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_activation_low_precision(name: str, dtype: torch.dtype) -> None:
    tol = LOW_PRECISION_TOLERANCE[dtype]
    check_fn(ACTIVATIONS[name], (floats(3, 4) * 4).to(dtype), atol=tol, rtol=tol)
