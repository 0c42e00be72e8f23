"""torch.cond / while_loop / scan lowered to coreai.if and coreai.while, run on the runtime."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch._higher_order_ops.map import map as hop_map
from torch._higher_order_ops.scan import scan
from torch._higher_order_ops.while_loop import while_loop

from coreai_torch import TorchConverter
from coreai_torch.errors import UnsupportedOpError
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.program import AIProgram
from tests.helpers import check_runs


def convert(model: nn.Module, args: Sequence[Any], dynamic_shapes: Any = None) -> AIProgram:
    ep = export_decomposed(model, args, dynamic_shapes=dynamic_shapes)
    return TorchConverter().add_exported_program(ep).to_coreai()


def check(model: nn.Module, runs: Sequence[Sequence[Any]], *, optimize: bool = True) -> str:
    """Convert once with the first inputs, run every input tuple; returns the program text."""
    program = convert(model, runs[0])
    if optimize:
        program.optimize()
    check_runs(model, program, runs)
    return str(program)


# ------------------------------------------------------------------------------- cond -------


class CondWithWeights(nn.Module):
    """Predicate from a tensor comparison; a Linear (lifted weights) in one branch only."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.tensor([0.5, 1.0, 2.0, 3.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def true_fn(x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.fc(x)) * self.scale

        def false_fn(x: torch.Tensor) -> torch.Tensor:
            return (x - 1.0).abs() / 2

        return torch.cond(x.sum() > 0, true_fn, false_fn, (x,))


def test_cond_branches_with_weights() -> None:
    x = torch.randn(3, 4)
    text = check(CondWithWeights().eval(), [(x.abs(),), (-x.abs(),)])
    assert "coreai.if" in text


class CondMultiOutput(nn.Module):
    """Several results: computed in one branch, passed through, constant in both branches."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        def true_fn(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return x * y, x.clone(), torch.ones(2), y + 1

        def false_fn(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return x - y, y.clone(), torch.zeros(2), y.clone()

        return torch.cond((x * y).mean() < 0.25, true_fn, false_fn, (x, y))


def test_cond_multiple_outputs_passthrough_and_constants() -> None:
    x, y = torch.rand(2, 3), torch.rand(2, 3)
    check(CondMultiOutput(), [(x, y), (x + 1, y + 1)])


class CondConstantBranches(nn.Module):
    """Both branches only produce constants (the compiler would turn that into a select)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        picked = torch.cond(
            x.max() > 1,
            lambda x: torch.full((3,), 2.0) + 1,
            lambda x: torch.arange(3, dtype=torch.float32),
            (x,),
        )
        return picked, x * 2


def test_cond_constant_branches() -> None:
    x = torch.rand(4)
    for optimize in (True, False):
        check(CondConstantBranches(), [(x,), (x + 1,)], optimize=optimize)


class NestedCond(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
        def inner_true(x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

        def inner_false(x: torch.Tensor) -> torch.Tensor:
            return x * 10

        def outer_true(x: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
            return torch.cond(flag, inner_true, inner_false, (x + 1,)) - 1

        def outer_false(x: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
            return -x

        return torch.cond(x[0, 0] > 0, outer_true, outer_false, (x, flag))


def test_nested_cond() -> None:
    x = torch.randn(2, 3)
    x[0, 0] = 1.0
    yes, no = torch.tensor(True), torch.tensor(False)
    text = check(NestedCond().eval(), [(x, yes), (x, no), (-x, yes)])
    assert text.count("coreai.if") >= 2


class CondShapes(nn.Module):
    """Branches returning different shapes (the result has a data-dependent size)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.sum() > 0, lambda x: x[:2] * 2, lambda x: x[:3] - 1, (x,))


def test_cond_branches_with_different_shapes() -> None:
    x = torch.rand(5, 3)
    check(CondShapes(), [(x,), (-x,)])


# ------------------------------------------------------------------------- while_loop -------


class DoubleUntil(nn.Module):
    """Iterate until a data-dependent condition; counter, growing tensor, weights in the body."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, limit: torch.Tensor) -> tuple[torch.Tensor, ...]:
        def cond_fn(i: torch.Tensor, acc: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
            return (acc.abs().sum() < limit) * (i < 20)

        def body_fn(
            i: torch.Tensor, acc: torch.Tensor, h: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            h = torch.relu(self.fc(h)) + 0.5
            return i + 1, acc * 2 + h, h

        zero = torch.zeros((), dtype=torch.int64)
        return while_loop(cond_fn, body_fn, (zero, x.clone(), x))


def test_while_loop_until_condition() -> None:
    x = torch.rand(2, 4)
    model = DoubleUntil().eval()
    runs = [(x, torch.tensor(5.0)), (x, torch.tensor(500.0)), (x, torch.tensor(0.0))]
    text = check(model, runs)
    assert "coreai.while" in text
    counts = [int(model(*r)[0]) for r in runs]
    assert counts[0] < counts[1] and counts[2] == 0  # the runs exercise different trip counts


class CountedLoopWithCond(nn.Module):
    """A loop whose body branches on the counter and passes a value through unchanged."""

    def forward(self, x: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, ...]:
        def cond_fn(i: torch.Tensor, v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return i < n

        def body_fn(i: torch.Tensor, v: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
            v = torch.cond(i % 2 == 0, lambda v: v + 1, lambda v: v * 2, (v,))
            return i + 1, v, w.clone()

        return while_loop(cond_fn, body_fn, (torch.zeros((), dtype=torch.int64), x, x * 3))


def test_while_loop_nested_cond_and_passthrough() -> None:
    x = torch.rand(3)
    check(CountedLoopWithCond(), [(x, torch.tensor(5)), (x, torch.tensor(0))])


# ------------------------------------------------------------------------------- scan -------


class RNN(nn.Module):
    """``scan`` over time steps: carried hidden state, stacked outputs, weights in the body."""

    def __init__(self) -> None:
        super().__init__()
        # requires_grad=False: torch.export traces scan's autograd otherwise, which fails on
        # the integer carry and the bool output
        self.w = nn.Parameter(torch.randn(4, 4) * 0.5, requires_grad=False)
        self.u = nn.Parameter(torch.randn(4, 4) * 0.5, requires_grad=False)

    def forward(self, xs: torch.Tensor, h0: torch.Tensor) -> tuple[torch.Tensor, ...]:
        def step(carry: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> tuple[Any, Any]:
            h, count = carry
            h = torch.clamp(h @ self.w + x @ self.u, -1, 1)
            return (h, count + 1), (h * 2, h.sum(-1) > 0)

        count = torch.zeros((), dtype=torch.int64)
        return scan(step, (h0, count), xs)


def test_scan_rnn() -> None:
    xs, h0 = torch.randn(5, 2, 4), torch.randn(2, 4)
    check(RNN(), [(xs, h0), (xs * 2, -h0)])


def test_scan_dynamic_length() -> None:
    model = RNN()
    xs, h0 = torch.randn(5, 2, 4), torch.randn(2, 4)
    steps = torch.export.Dim("steps", min=2, max=64)
    program = convert(model, (xs, h0), dynamic_shapes=({0: steps}, None))
    program.optimize()
    check_runs(model, program, [(xs, h0), (torch.randn(9, 2, 4), h0), (xs[:3], h0)])


class ReverseScan(nn.Module):
    """``scan`` over dim 1 in reverse (torch moves the dim and flips around the loop)."""

    def forward(self, xs: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def step(c: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            c = c * 0.5 + x
            return c, c.clone()

        return scan(step, h, xs, dim=1, reverse=True)


def test_scan_reverse_over_dim_1() -> None:
    check(ReverseScan(), [(torch.randn(2, 4, 3), torch.randn(2, 3))])


class ScanAfterFolding(nn.Module):
    """A weight-only ``exp`` folded at conversion time (the top-level node ``exp``) and an
    ``exp`` of the scanned input in the body (a sub-graph node also named ``exp``)."""

    def __init__(self) -> None:
        super().__init__()
        self.log_decay = nn.Parameter(torch.tensor([-0.5, -1.0, -2.0]), requires_grad=False)

    def forward(self, xs: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        decay = self.log_decay.exp()

        def step(c: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            c = c * decay + x.exp()
            return c, c.clone()

        return scan(step, h, xs)


def test_a_body_node_named_like_a_folded_node_is_lowered() -> None:
    """Folding covers the top-level graph only: the body's ``exp`` is not the folded one."""
    check(ScanAfterFolding(), [(torch.randn(5, 3), torch.randn(3))])


class MapRows(nn.Module):
    """``map`` (a scan without carried values) with a Linear applied to every row."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, xs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return hop_map(lambda x, y: self.fc(x * y), xs, y)


def test_map() -> None:
    xs, y = torch.randn(5, 2, 4), torch.randn(4)
    check(MapRows().eval(), [(xs, y)])


# ----------------------------------------------------------------------------- errors -------


@torch.library.custom_op("cf_test::mystery", mutates_args=())
def mystery(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@mystery.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class UnsupportedInBranch(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.sum() > 0, lambda x: mystery(x) * 2, lambda x: x - 1, (x,))


def test_unsupported_op_inside_a_branch_is_reported_up_front() -> None:
    with pytest.raises(UnsupportedOpError, match=r"cf_test::mystery\.default"):
        convert(UnsupportedInBranch(), (torch.randn(3),))
