"""Float math functions on the Core AI runtime vs eager PyTorch: exp/log families,
trigonometry, the erf family, atan2/hypot, integer inputs (computed in float32), IEEE special
values, and float16/bfloat16 programs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
    ints,
    special,
)


def _unit(*shape: int) -> torch.Tensor:
    return torch.rand(shape) * 1.98 - 0.99


def _positive(*shape: int) -> torch.Tensor:
    return torch.rand(shape) * 5 + 0.01


def _above_one(*shape: int) -> torch.Tensor:
    return torch.rand(shape) * 5 + 1


# op, domain generator for float inputs
MATH: dict[str, tuple[Callable[[Any], Any], Callable[..., torch.Tensor]]] = {
    "exp": (torch.exp, floats),
    "exp2": (torch.exp2, floats),
    "expm1": (torch.expm1, floats),
    "log": (torch.log, _positive),
    "log2": (torch.log2, _positive),
    "log10": (torch.log10, _positive),
    "log1p": (torch.log1p, _positive),
    "log1p_small": (lambda x: torch.log1p(x * 1e-4), floats),
    "expm1_small": (lambda x: torch.expm1(x * 1e-4), floats),
    "sqrt": (torch.sqrt, _positive),
    "rsqrt": (torch.rsqrt, _positive),
    "sin": (torch.sin, floats),
    "cos": (torch.cos, floats),
    "tan": (torch.tan, floats),
    "asin": (torch.asin, _unit),
    "acos": (torch.acos, _unit),
    "atan": (torch.atan, floats),
    "sinh": (torch.sinh, floats),
    "cosh": (torch.cosh, floats),
    "tanh": (torch.tanh, floats),
    "asinh": (torch.asinh, floats),
    "acosh": (torch.acosh, _above_one),
    "atanh": (torch.atanh, _unit),
    "sigmoid": (torch.sigmoid, floats),
    "erf": (torch.erf, floats),
    "erfc": (torch.erfc, lambda *s: floats(*s) * 3),
    "erfinv": (torch.erfinv, _unit),
}


def _math(name: str) -> Case:
    """Float32 in several shapes (0-d, rank 7) plus int64/int32/bool inputs (float32 out)."""
    op, domain = MATH[name]
    args = [domain(3, 4), domain(), domain(1, 2, 1, 2, 1, 2, 3)]
    args += [ints(3, 4, low=1, high=4), ints(4, dtype=torch.int32, low=0, high=2)]
    args += [torch.rand(3) > 0.5]
    return (lambda *xs: tuple(op(x) for x in xs)), args


@pytest.mark.parametrize("names", grouped(list(MATH), 4))
def test_math(names: list[str]) -> None:
    check_cases([_math(n) for n in names], atol=1e-5, rtol=1e-4)


def test_math_special_values() -> None:
    def f(a):
        return (
            a.exp(), a.log(), torch.log1p(a), torch.expm1(a), torch.exp2(a), torch.log2(a),
            torch.log10(a), a.sqrt(), a.rsqrt(), a.sin(), a.cos(), a.atan(), a.tanh(),
            a.sigmoid(), torch.erf(a), torch.erfc(a), torch.erfinv(a), a.sinh(), a.asinh(),
        )  # fmt: skip

    check_fn(f, special())


def test_erfc_tail_and_erfinv_edges() -> None:
    """erfc keeps relative precision far in the tail; erfinv(±1) = ±inf, |x| > 1 NaN."""
    tail = torch.tensor([0.5, 1.0, 2.0, 4.0, 6.0, 9.0, -3.0, -9.0])
    edges = torch.tensor([1.0, -1.0, 0.0, 0.999999, -0.9999, 1.5, 0.5, -1e-6])
    check_fn(lambda t, e: (torch.erfc(t), torch.erfinv(e)), tail, edges, atol=0, rtol=5e-5)


# -------------------------------------------------------------------------- activations ----


# --------------------------------------------------------------------- 16-bit float programs


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_math_low_precision(dtype: torch.dtype) -> None:
    def f(x, u, p):
        return (
            x.exp(), p.log(), torch.log1p(p), torch.expm1(x), torch.exp2(x), torch.log2(p),
            p.sqrt(), p.rsqrt(), x.sin(), x.tanh(), x.sigmoid(), torch.erf(x), torch.erfc(x),
            torch.erfinv(u), torch.atan2(x, p), torch.hypot(x, p), u.asin(), x.asinh(),
            F.gelu(x), F.silu(x), F.elu(x), F.hardswish(x), F.leaky_relu(x), F.softplus(x),
        )  # fmt: skip

    tol = LOW_PRECISION_TOLERANCE[dtype]
    args = (floats(3, 4).to(dtype), _unit(3, 4).to(dtype), _positive(3, 4).to(dtype))
    check_fn(f, *args, atol=tol, rtol=tol)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(MATH))
def test_math_each_low_precision(name: str, dtype: torch.dtype) -> None:
    op, domain = MATH[name]
    tol = LOW_PRECISION_TOLERANCE[dtype]
    check_fn(op, domain(4, 5).to(dtype), atol=tol, rtol=tol)


# ----------------------------------------------------------------------- special functions -
