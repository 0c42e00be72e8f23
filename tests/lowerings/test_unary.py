"""Float math functions and activations on the Core AI runtime vs eager PyTorch: exp/log
families, trigonometry, erf family, integer inputs (computed in float32), IEEE special values,
and float16/bfloat16 programs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.lowerings.support import check_fn
from tests.lowerings.values import INF, NAN, Case, check_cases, floats, grouped, ints, special


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


# --------------------------------------------------------------------- 16-bit float programs


LOW_PRECISION_TOLERANCE = {torch.float16: 4e-3, torch.bfloat16: 3e-2}


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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_arithmetic_low_precision(dtype: torch.dtype) -> None:
    def f(a, b, s):
        return (
            a + b, a - b, a * b, a / b, a // b, torch.remainder(a, b), torch.fmod(a, b),
            a**2, b.abs() ** a, 2**a, a + 1.5, a * 0.1, a + s, -a, a.abs(), a.sign(),
            a.reciprocal(), a.floor(), a.ceil(), a.trunc(), a.round(), torch.round(a, decimals=1),
            a == b, a < b, a >= b, torch.maximum(a, b), torch.fmax(a, b), a.clamp(-1, 1),
            torch.isnan(a / 0), torch.nan_to_num(a / 0), torch.where(a > b, a, b),
        )  # fmt: skip

    tol = LOW_PRECISION_TOLERANCE[dtype]
    a = floats(3, 4).to(dtype) * 4
    b = (floats(4).abs() + 0.5).to(dtype)
    check_fn(f, a, b, floats(), atol=tol, rtol=tol)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(MATH))
def test_math_each_low_precision(name: str, dtype: torch.dtype) -> None:
    op, domain = MATH[name]
    tol = LOW_PRECISION_TOLERANCE[dtype]
    check_fn(op, domain(4, 5).to(dtype), atol=tol, rtol=tol)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_activation_low_precision(name: str, dtype: torch.dtype) -> None:
    tol = LOW_PRECISION_TOLERANCE[dtype]
    check_fn(ACTIVATIONS[name], (floats(3, 4) * 4).to(dtype), atol=tol, rtol=tol)


# ----------------------------------------------------------------------- special functions -

S = torch.special
_EDGES = [0.0, -0.0, -1.0, -2.5, 1.0, 2.0, -3.0, 0.5, INF, -INF, NAN, 1e30, 1.4616, 3.7, 10.0]
_POSITIVE = [0.01, 0.3, 0.5, 1.0, 1.4616, 2.0, 3.7, 6.0, 10.0, 25.0, 100.0]

SPECIAL_FUNCTIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    "lgamma": lambda x, p: (torch.lgamma(x), torch.lgamma(p), torch.lgamma(-p - 0.5)),
    "digamma": lambda x, p: (torch.digamma(x), torch.digamma(p), torch.digamma(-p - 0.3)),
    "polygamma": lambda x, p: tuple(torch.polygamma(n, p) for n in range(5)),
    "zeta": lambda x, p: (torch.special.zeta(p + 1, p), torch.special.zeta(3.0, p)),
    "mvlgamma": lambda x, p: (torch.mvlgamma(p + 2, 3), torch.special.multigammaln(p + 1, 2)),
    "i0": lambda x, p: (torch.i0(x), torch.i0(p), torch.special.i0(-p)),
    "i0e": lambda x, p: (torch.special.i0e(x), torch.special.i0e(p * 10)),
    "i1": lambda x, p: (torch.special.i1(x), torch.special.i1(-p)),
    "i1e": lambda x, p: (torch.special.i1e(x), torch.special.i1e(-p * 10)),
    "erfcx": lambda x, p: (torch.special.erfcx(x), torch.special.erfcx(-p / 4)),
    "ndtri": lambda x, p: (torch.special.ndtri(torch.sigmoid(x)), torch.special.ndtri(p / 100)),
    "ndtri_tails": lambda x, p: torch.special.ndtri(torch.tensor([1e-30, 1e-10, 1 - 1e-7])),
    "ndtr": lambda x, p: (torch.special.ndtr(x), torch.special.log_ndtr(x)),
    "angle": lambda x, p: (torch.angle(x), torch.angle(p.long() - 5)),
    "ldexp": lambda x, p: torch.ldexp(x, torch.tensor([3, -2, 0, 1] * 3 + [5, 6, 7])),
    "frexp": lambda x, p: (torch.frexp(x), torch.frexp(p * 1e-3), torch.frexp(-p)),
    "xlogy": lambda x, p: (
        torch.xlogy(x, p[0]),
        torch.special.xlog1py(x, p[1]),
        torch.special.entr(p),
    ),
}


@pytest.mark.parametrize("names", grouped(list(SPECIAL_FUNCTIONS), 4))
def test_special_function(names: list[str]) -> None:
    cases = [(SPECIAL_FUNCTIONS[n], [torch.tensor(_EDGES), torch.tensor(_POSITIVE)]) for n in names]
    check_cases(cases, atol=1e-5, rtol=2e-4)


def test_special_functions_low_precision() -> None:
    p = torch.tensor(_POSITIVE).to(torch.float16)
    fns = (torch.lgamma, torch.digamma, torch.i0, torch.special.i1e)
    check_fn(lambda p: tuple(f(p) for f in fns), p, atol=1e-2, rtol=1e-2)


def test_nextafter_exact() -> None:
    """One unit in the last place up or down, across powers of two, 0, subnormals, ±inf."""
    x = [1.0, 1.0, 0.0, 0.0, -1.0, 2.0, 2.0, 0.75, -0.5, 3e38, INF, -INF, NAN, 1.0, 1e-40, 1e-45]
    y = [2.0, 0.0, 1.0, -1.0, 0.0, 0.0, 3.0, 1.0, -1.0, INF, 0.0, 0.0, 1.0, NAN, 0.0, 0.0]

    def f(x, y):
        return (
            torch.nextafter(x, y),
            torch.nextafter(x.half(), y.half()),
            torch.nextafter(x.bfloat16(), y.bfloat16()),
            torch.frexp(x),
        )

    check_fn(f, torch.tensor(x), torch.tensor(y), atol=0, rtol=0)
