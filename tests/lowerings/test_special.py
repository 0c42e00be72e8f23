"""Special functions on the Core AI runtime vs eager PyTorch: the gamma family (lgamma,
digamma, polygamma, zeta, mvlgamma), Bessel I0/I1 and their scaled forms, erfcx, ndtri/ndtr,
angle, ldexp, frexp, xlogy and nextafter, at edge values and in float16."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.lowerings.support import check_fn
from tests.lowerings.values import INF, NAN, check_cases, grouped

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
