"""Test helpers: convert a module, run it on the Core AI runtime, compare with PyTorch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch.nn as nn

from coreai_torch import TorchConverter
from coreai_torch.program import AIProgram
from coreai_torch.verify import VerifyReport, export_decomposed, verify


def convert(
    model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None, **names: Any
) -> AIProgram:
    """Export (decomposed) and convert ``model``; ``names`` go to add_exported_program."""
    ep = export_decomposed(model, args, kwargs)
    return TorchConverter().add_exported_program(ep, **names).to_coreai()


def check_module(
    model: nn.Module,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None = None,
    *,
    atol: float = 1e-4,
    rtol: float = 1e-4,
    optimize: bool = True,
) -> VerifyReport:
    """Convert ``model``, run it on the runtime and assert it matches eager PyTorch."""
    program = convert(model, args, kwargs)
    if optimize:
        program.optimize()
    report = verify(model, args, kwargs, program=program, atol=atol, rtol=rtol)
    assert report.ok, f"converted program does not match PyTorch:\n{report}\n\n{program}"
    return report
