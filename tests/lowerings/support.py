"""Small helpers for the per-family lowering tests: wrap a function as a module and check it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn

from coreai_torch.verify import VerifyReport
from tests.helpers import check_module, convert


class Fn(nn.Module):
    """An ``nn.Module`` whose forward is ``fn`` (lets a test export a lambda)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any) -> Any:
        return self.fn(*args)


def check_fn(fn: Callable[..., Any], *args: Any, **tolerance: float) -> VerifyReport:
    """Export ``fn`` over ``args``, convert, run on the runtime and compare with eager."""
    return check_module(Fn(fn).eval(), args, **tolerance)


def convert_fn(fn: Callable[..., Any], *args: Any) -> Any:
    """Export and convert ``fn`` (for tests that expect a conversion error)."""
    return convert(Fn(fn).eval(), args)


def runtime_outputs(fn: Callable[..., Any], *args: Any) -> list[np.ndarray]:
    """Export and convert ``fn``, run it once on the runtime; its outputs in return order (for
    results only some of whose properties are defined, compared by the test itself)."""
    from coreai_torch.runtime import Session
    from coreai_torch.verify import run_entrypoint

    program = convert_fn(fn, *args)
    with Session(program) as session:
        return run_entrypoint(session, program, args)


def rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A random tensor of any dtype (small non-negative ints, random bools)."""
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.randint(-5, 10, shape).to(dtype)


def fast_first(*values: Any) -> list[Any]:
    """Parameters where only the first runs in the fast suite (the rest are ``slow``)."""
    return [values[0], *(pytest.param(v, marks=pytest.mark.slow) for v in values[1:])]


def idx(*values: int) -> torch.Tensor:
    """An int64 index tensor of ``values``."""
    return torch.tensor(values)
