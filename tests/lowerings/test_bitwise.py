"""Bitwise ops on the Core AI runtime vs eager PyTorch: and/or/xor/not over every integer
dtype, bool and Python scalars (with broadcasting and promotion), shifts at and beyond the
bit width, and ``hash_tensor`` with the uint64 conversions it relies on."""

from __future__ import annotations

import pytest
import torch

from tests.lowerings.support import check_fn
from tests.lowerings.values import (
    INF,
    binary_case,
    bools,
    check_cases,
    ints,
    operand_pairs,
)

BITWISE = {
    "and": torch.bitwise_and,
    "or": torch.bitwise_or,
    "xor": torch.bitwise_xor,
    "operators": lambda a, b: (a & b) | (a ^ b) if isinstance(b, torch.Tensor) else a & b,
}


@pytest.mark.parametrize("name", list(BITWISE))
def test_binary_bitwise(name: str) -> None:
    """Every integer kind, bool and Python ints, with broadcasting, 0-d and promotion."""
    check_cases([binary_case(BITWISE[name], operand_pairs({"int", "bool", "uint8"}))])


def test_not_and_extremes() -> None:
    """``~``, masks and xor at each integer dtype's extremes, and bool."""
    dtypes = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)

    def extremes(dtype: torch.dtype) -> torch.Tensor:
        info = torch.iinfo(dtype)
        other = -1 if dtype.is_signed else 7
        return torch.tensor([info.min, info.max, 0, 1, other, 85], dtype=dtype)

    def f(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        *ints, b = xs
        outs: list[torch.Tensor] = [~b, torch.bitwise_not(b), b ^ True]
        for x in ints:
            info = torch.iinfo(x.dtype)
            outs += [~x, x & info.max, x | info.min, x ^ x.flip(0)]
        return tuple(outs)

    check_fn(f, *(extremes(d) for d in dtypes), bools(6))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8])
def test_shifts(dtype: torch.dtype) -> None:
    info = torch.iinfo(dtype)
    x = ints(3, 8, dtype=dtype, low=-100, high=100)
    if dtype == torch.uint8:
        x[0, :4] = torch.tensor([0, 255, 1, 128])
        shifts = torch.tensor([0, 1, 3, 7, 8, 13, 200, 2], dtype=dtype)
    else:
        x[0, :4] = torch.tensor([info.min, info.max, -1, 0])
        shifts = torch.tensor([0, 1, 3, info.bits - 1, info.bits, info.bits + 5, -1, 2])
        shifts = shifts.to(dtype)

    def f(x, s):
        return (
            x << s, x >> s, x << 2, x >> 1, torch.bitwise_left_shift(x, s),
            torch.bitwise_right_shift(x, s), x & s, x | 5, x ^ s, ~x, 6 & x,
        )  # fmt: skip

    check_fn(f, x, shifts)


def test_hash_tensor_and_uint64_casts() -> None:
    """``hash_tensor`` XORs the elements' 64-bit patterns (floats as float64: signed zeros,
    infinities, float32 and float64 subnormals; ints sign-extended; bools; uint8), over all
    dims or some, with keepdim; negative ints convert to uint64 by their bits."""
    H = torch.hash_tensor
    x = torch.tensor([[1.5, -2.0, 0.0, -0.0], [1e-40, INF, -INF, 3.25], [1e30, -7.0, 0.1, 2.0]])
    f64 = torch.tensor([1e-310, -5e-324, 1.0, 2.0**-1022, 1e300], dtype=torch.float64)

    def f(x, i, b, u, d, h):
        return (
            H(x), H(x, dim=1), H(x, dim=0, keepdim=True), H(i), H(i, dim=-1), H(b), H(u),
            H(d), H(h), H(x[0, 0]), i.to(torch.uint64), (i[0] - 9).to(torch.int32).to(torch.uint64),
        )  # fmt: skip

    ints_ = torch.tensor([[-1, 2, 3], [2**40, -(2**62), 5]])
    check_fn(f, x, ints_, bools(5), ints(2, 3, dtype=torch.uint8, low=0, high=250), f64, x.half())
