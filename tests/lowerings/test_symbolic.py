"""Symbolic sizes on the Core AI runtime vs eager PyTorch: Python arithmetic on SymInts and
SymFloats (``+ - * // % **``, ``abs``, ``floor``/``ceil``/``trunc``, ``sym_float``/``sym_int``,
square roots, ``sym_ite``/``sym_max``/``sym_min``, comparisons), ``numel``, data-dependent
sizes from ``.item()`` and dynamic int arguments — each program converted once and run at
several sizes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.export import Dim

from coreai_torch import TorchConverter
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.program import AIProgram
from tests.helpers import check_runs


def convert(model: nn.Module, args: Sequence[Any], dynamic_shapes: Any) -> AIProgram:
    ep = export_decomposed(model, args, dynamic_shapes=dynamic_shapes)
    return TorchConverter().add_exported_program(ep).to_coreai().optimize()


class SymbolicArithmetic(nn.Module):
    """Every scalar computed from the dynamic size ``n`` (and the static ``d``) scales a tensor."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n, d = x.shape
        scalars = (
            n + d, n * d, n - 2 * d, -n, n // 3, n % 3, n**2, abs(n - 5),
            torch.sym_float(n) / 4, math.floor(n / 3), math.ceil(n / 3), math.trunc(n / 3),
            torch.sym_ite(n > 4, n, n + 1), torch.sym_max(n, 6), torch.sym_min(n, 6),
            x.numel(), torch.sym_int(torch.sym_float(n) * 0.5), torch._sym_sqrt(n),
        )  # fmt: skip
        return tuple(x[:1, :1] * s for s in scalars)


def test_symbolic_arithmetic() -> None:
    model = SymbolicArithmetic()
    program = convert(model, (torch.randn(7, 3),), ({0: Dim("n", min=2, max=64)},))
    check_runs(model, program, [(torch.randn(n, 3),) for n in (7, 2, 12, 64)])


class SizeComparisons(nn.Module):
    """SymBools from comparisons of sizes, as ``torch.cond`` predicates and masks."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = x.shape[0]
        short = torch.cond(n < 5, lambda x: x * 2, lambda x: x - 1, (x,))
        even = torch.cond(n % 2 == 0, lambda x: x.sum(0), lambda x: x.amax(0), (x,))
        return short, even, torch.arange(n) >= n // 2


def test_size_comparisons() -> None:
    model = SizeComparisons()
    program = convert(model, (torch.randn(6, 3),), ({0: Dim("n", min=2, max=32)},))
    check_runs(model, program, [(torch.randn(n, 3),) for n in (6, 3, 9, 4)])


class ItemSlice(nn.Module):
    """A data-dependent size from ``.item()`` (an unbacked SymInt) used as a slice end."""

    def forward(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        k = n.item()
        torch._check(k >= 1)
        torch._check(k <= x.shape[0])
        return x[:k] * 2


def test_item_as_slice_end() -> None:
    model = ItemSlice()
    x = torch.randn(6, 3)
    program = convert(model, (x, torch.tensor(4)), None)
    check_runs(model, program, [(x, torch.tensor(4)), (x, torch.tensor(1)), (x, torch.tensor(6))])


class IntArgument(nn.Module):
    """A Python int argument exported as dynamic (``Dim.DYNAMIC``) becomes a 0-d input."""

    def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x[:n] * n


def test_dynamic_int_argument() -> None:
    model = IntArgument()
    x = torch.randn(6, 3)
    program = convert(model, (x, 4), (None, Dim.DYNAMIC))
    assert "tensor<si64>" in str(program)
    check_runs(model, program, [(x, 4), (x, 1), (x, 6)])
