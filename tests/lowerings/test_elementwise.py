"""Elementwise arithmetic, rounding, comparisons, logic, where and min/max/clamp on the Core AI
runtime vs eager PyTorch (bitwise ops: test_bitwise.py).

Each case converts one program that applies the op to many operand pairs at once (dtypes,
broadcasting, rank 6, 0-d tensors, Python scalars, mixed-dtype promotion)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.lowerings.support import check_fn
from tests.lowerings.values import (
    LOW_PRECISION_TOLERANCE,
    Case,
    binary_case,
    bools,
    check_cases,
    divisors,
    floats,
    grouped,
    ints,
    operand_pairs,
    rand,
    special,
)

ALL = {"float", "int", "bool", "uint8"}
NUMERIC = {"float", "int", "uint8"}

# op, operand kinds, right operand must be nonzero
BINARY: dict[str, tuple[Callable[[Any, Any], Any], set[str], bool]] = {
    "add": (torch.add, ALL, False),
    "add_alpha": (lambda a, b: torch.add(a, b, alpha=2), NUMERIC, False),
    "sub": (torch.sub, NUMERIC, False),
    "sub_alpha": (lambda a, b: torch.sub(a, b, alpha=3), NUMERIC, False),
    "rsub": (
        lambda a, b: torch.rsub(a, b) if isinstance(b, torch.Tensor) else b - a,
        NUMERIC,
        False,
    ),
    "mul": (torch.mul, ALL, False),
    "div": (torch.div, NUMERIC | {"bool"}, True),
    "div_floor": (lambda a, b: torch.div(a, b, rounding_mode="floor"), NUMERIC, True),
    "div_trunc": (lambda a, b: torch.div(a, b, rounding_mode="trunc"), NUMERIC, True),
    "floor_divide": (torch.floor_divide, NUMERIC, True),
    "remainder": (torch.remainder, NUMERIC, True),
    "fmod": (torch.fmod, NUMERIC, True),
    "pow": (
        lambda a, b: torch.pow(a, abs(b) if isinstance(b, (int, float)) else b.abs()),
        NUMERIC,
        False,
    ),
    "maximum": (lambda a, b: torch.maximum(a, torch.as_tensor(b)), ALL, False),
    "minimum": (lambda a, b: torch.minimum(a, torch.as_tensor(b)), ALL, False),
    "fmax": (lambda a, b: torch.fmax(a, torch.as_tensor(b)), ALL, False),
    "fmin": (lambda a, b: torch.fmin(a, torch.as_tensor(b)), ALL, False),
    "eq": (torch.eq, ALL, False),
    "ne": (torch.ne, ALL, False),
    "lt": (torch.lt, ALL, False),
    "le": (torch.le, ALL, False),
    "gt": (torch.gt, ALL, False),
    "ge": (torch.ge, ALL, False),
    "logical_and": (lambda a, b: torch.logical_and(a, torch.as_tensor(b)), ALL, False),
    "logical_or": (lambda a, b: torch.logical_or(a, torch.as_tensor(b)), ALL, False),
    "logical_xor": (lambda a, b: torch.logical_xor(a, torch.as_tensor(b)), ALL, False),
    "copysign": (torch.copysign, {"float", "int"}, False),
    "atan2": (lambda a, b: torch.atan2(a, torch.as_tensor(b)), {"float", "int"}, False),
    "hypot": (lambda a, b: torch.hypot(a, torch.as_tensor(b)), {"float"}, False),
}


def _binary(name: str) -> Case:
    op, kinds, divisor = BINARY[name]
    pairs = operand_pairs(kinds, divisor=divisor)
    if name == "pow":  # keep integer powers small and exact
        pairs = [
            (a, b) for a, b in pairs if not (isinstance(b, torch.Tensor) and b.dtype == torch.int32)
        ]
    return binary_case(op, pairs)


@pytest.mark.parametrize("names", grouped(list(BINARY), 3))
def test_binary(names: list[str]) -> None:
    check_cases([_binary(n) for n in names])


# ------------------------------------------------------------------------------- unary -----

UNARY: dict[str, tuple[Callable[[Any], Any], set[str]]] = {
    "neg": (torch.neg, NUMERIC),
    "abs": (torch.abs, NUMERIC),
    "sign": (torch.sign, ALL),
    "signbit": (torch.signbit, ALL),
    "reciprocal": (torch.reciprocal, ALL),
    "floor": (torch.floor, NUMERIC),
    "ceil": (torch.ceil, NUMERIC),
    "trunc": (torch.trunc, NUMERIC),
    "frac": (torch.frac, {"float"}),
    "round": (torch.round, NUMERIC),
    "round_decimals": (lambda x: torch.round(x * 100, decimals=1), {"float"}),
    "round_negative_decimals": (lambda x: torch.round(x * 1000, decimals=-2), {"float"}),
    "square": (torch.square, NUMERIC),
    "pow_scalar_base": (lambda x: torch.pow(2, x), {"float"}),
    "isnan": (torch.isnan, ALL),
    "isinf": (torch.isinf, ALL),
    "isfinite": (torch.isfinite, ALL),
    "isposinf": (torch.isposinf, NUMERIC),
    "isneginf": (torch.isneginf, NUMERIC),
    "nan_to_num": (torch.nan_to_num, ALL),
    "logical_not": (torch.logical_not, ALL),
    "clamp": (lambda x: x.clamp(-2, 3), NUMERIC),
    "clamp_float_bounds": (lambda x: x.clamp(-0.5, 0.75), NUMERIC),
    "clamp_min": (lambda x: x.clamp(min=1), NUMERIC),
    "clamp_max": (lambda x: x.clamp(max=-1), NUMERIC),
    "clamp_inverted": (lambda x: x.clamp(2, -2), NUMERIC),
}


def unary_operands(kinds: set[str]) -> list[torch.Tensor]:
    """Operands of every requested kind: several shapes incl. 0-d and rank 7."""
    xs = []
    if "float" in kinds:
        xs += [floats(3, 4) * 3, floats(), floats(1, 2, 1, 2, 1, 2, 3), special()]
    if "int" in kinds:
        xs += [ints(3, 4), ints(5, dtype=torch.int32), ints()]
    if "uint8" in kinds:
        xs += [ints(2, 3, dtype=torch.uint8)]
    if "bool" in kinds:
        xs += [bools(3, 4)]
    return xs


def _unary(name: str) -> Case:
    op, kinds = UNARY[name]
    return (lambda *xs: tuple(op(x) for x in xs)), unary_operands(kinds)


@pytest.mark.parametrize("names", grouped(list(UNARY), 4))
def test_unary(names: list[str]) -> None:
    check_cases([_unary(n) for n in names])


def test_clamp_tensor_bounds() -> None:
    def f(x, lo, hi, i, ilo):
        return (
            x.clamp(lo, hi),
            x.clamp(min=lo),
            x.clamp(max=hi),
            torch.clamp(x, lo.unsqueeze(0), 0.5 + hi),
            i.clamp(ilo, ilo + 3),
            i.clamp(min=lo),  # int tensor, float bounds: float32
        )

    check_fn(f, floats(3, 4), floats(4) - 1, floats(3, 1) + 1, ints(3, 4), ints(4))


# ------------------------------------------------------------------------ special values ---


def test_arithmetic_special_values() -> None:
    def f(a, b):
        return (
            a + b, a - b, a * b, a / b, a // b, torch.div(a, b, rounding_mode="trunc"),
            torch.remainder(a, b), torch.fmod(a, b), a**b, a**2, a**0, a**0.5, a**-1,
            a**-2, a**3, 2**a, torch.copysign(a, b), torch.atan2(a, b), torch.hypot(a, b),
        )  # fmt: skip

    check_fn(f, special(), special(second=True))


def test_unary_special_values() -> None:
    def f(a, b):
        return (
            -a, a.abs(), a.sign(), torch.signbit(a), a.reciprocal(), a.floor(), a.ceil(),
            a.trunc(), a.frac(), a.round(), torch.round(a, decimals=2),
            torch.round(a, decimals=-1), torch.isnan(a), torch.isinf(a), torch.isfinite(a),
            torch.isposinf(a), torch.isneginf(a), torch.nan_to_num(a),
            torch.nan_to_num(a, 1.0, 2.0, -2.0),
        )  # fmt: skip

    check_fn(f, special(), special(second=True))


def test_comparison_special_values() -> None:
    def f(a, b):
        return (
            a == b, a != b, a < b, a <= b, a > b, a >= b, torch.maximum(a, b),
            torch.minimum(a, b), torch.fmax(a, b), torch.fmin(a, b), a.clamp(-1, 1),
            a.clamp(b, b + 1), torch.logical_and(a, b), torch.logical_not(a),
            torch.where(a > b, a, b),
        )  # fmt: skip

    check_fn(f, special(), special(second=True))


def test_floor_divide_matches_torch_not_floor_of_quotient() -> None:
    """``1 // 0.1`` is 9 in PyTorch (ATen's fmod-based algorithm), not floor(10.0)."""
    a = torch.tensor([1.0, -1.0, 1.0, 0.3, -0.3, 5.0, 1e-8, 7.0])
    b = torch.tensor([0.1, 0.1, -0.1, 0.1, 0.1, 0.7, 0.1, 1e30])
    check_fn(lambda a, b: (a // b, torch.remainder(a, b), torch.fmod(a, b)), a, b)


# ----------------------------------------------------------------------- integer specials --


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8])
def test_integer_wraparound_and_extremes(dtype: torch.dtype) -> None:
    info = torch.iinfo(dtype)
    x = torch.tensor([info.min, info.max, 0, 1, 7, info.max // 3], dtype=dtype)
    y = torch.tensor([1, 1, 3, 2, 2, 3], dtype=dtype)

    def f(x, y):
        return x + y, x - y, x * y, x * 3, -x, x.abs(), x // y, x % y, torch.fmod(x, y), x**2

    check_fn(f, x, y)


def test_integer_pow_negative_exponents() -> None:
    """ATen: ``b ** -n`` is 0 for |b| > 1, 1 for b == 1, ±1 for b == -1."""
    base = torch.tensor([2, 1, -1, -1, 0, -2, 3, 1])
    exponent = torch.tensor([-1, -3, -1, -2, 2, -3, 2, 0])
    check_fn(lambda b, e: (b**e, torch.pow(b.int(), e.int())), base, exponent)


def test_where_and_logical_dtypes() -> None:
    def f(c, x, i, b, u):
        return (
            torch.where(c, x, i),  # float with int: float32
            torch.where(c, i, 0),
            torch.where(c, 1.5, x),
            torch.where(c, b, False),
            torch.where(x > 0, x, torch.tensor(0.0)),
            torch.where(c, x.unsqueeze(0), i),
            torch.logical_and(u, x),
            torch.logical_or(i, b),
            torch.logical_xor(x, c),
            torch.logical_not(u),
        )

    check_fn(f, bools(3, 4), floats(3, 4), ints(4), bools(3, 4), ints(3, 4, dtype=torch.uint8))


def test_alpha_and_rsub_scalars() -> None:
    def f(x, i):
        return (
            torch.add(x, i, alpha=0.5),
            torch.sub(i, 2, alpha=3),
            torch.rsub(x, 1.5, alpha=2),
            torch.rsub(i, x),
            torch.add(i, i, alpha=-2),
        )

    check_fn(f, floats(3, 4), ints(3, 4))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.uint8, torch.float64])
@pytest.mark.parametrize("name", [n for n in BINARY if n not in ("hypot",)])
def test_binary_more_dtypes(name: str, dtype: torch.dtype) -> None:
    op, kinds, divisor = BINARY[name]
    if dtype.is_floating_point and "float" not in kinds:
        return
    if not dtype.is_floating_point and not kinds & {"int", "uint8"}:
        return
    make = divisors if divisor else rand
    a, b = rand(3, 4, dtype=dtype), make(4, dtype=dtype)
    if name == "pow":
        b = b.abs() % 3
    check_fn(lambda a, b: op(a, b), a, b)


def test_gcd_lcm() -> None:
    """Euclid's algorithm runs as a Core AI while loop (no division by zero on finished lanes)."""
    a = torch.tensor([[12, 0, -18, 7, 0, 2**40, 1071, -5], [3, 9, 27, 81, 1, 2, 3, 4]])
    b = torch.tensor([8, 5, 24, 0, 0, 6, 462, -15])

    def f(a, b):
        return (
            torch.gcd(a, b), torch.lcm(a, b), torch.gcd(a.int(), b.int()),
            torch.gcd(a[0, 0], b[0]), torch.lcm(a.short(), b.short()),
        )  # fmt: skip

    check_fn(f, a, b)


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
