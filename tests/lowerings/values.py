"""Operands for the elementwise / reduction tests: random tensors of every dtype, divisors
without zeros, IEEE special values, and the operand pairs that exercise type promotion."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

NAN, INF = float("nan"), float("inf")

#: atol = rtol for float16 / bfloat16 programs of elementwise math (ATen's opmath rounds once)
LOW_PRECISION_TOLERANCE = {torch.float16: 4e-3, torch.bfloat16: 3e-2}

#: IEEE edge cases (and halves, large and tiny values) for float32 checks.
SPECIAL = [NAN, INF, -INF, 0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 1.5, 2.5, -2.5, 1e30, -1e-30]
SPECIAL += [3.0, 7.5, 16777217.0, 0.1, -7.0, 100.0]


def floats(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape).to(dtype)


def ints(*shape: int, dtype: torch.dtype = torch.int64, low: int = -9, high: int = 10):
    if dtype == torch.uint8:
        low = max(low, 0)
    return torch.randint(low, high, shape).to(dtype)


def bools(*shape: int) -> torch.Tensor:
    return torch.rand(shape) > 0.5


def divisors(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Nonzero values (ints in ±[1, 5], floats with |x| >= 0.25) to divide by."""
    if dtype.is_floating_point:
        x = torch.randn(shape)
        return (x + torch.where(x >= 0, 0.25, -0.25)).to(dtype)
    magnitude = torch.randint(1, 6, shape)
    if dtype == torch.uint8:
        return magnitude.to(dtype)
    sign = torch.where(torch.rand(shape) > 0.5, 1, -1)
    return (magnitude * sign).to(dtype)


def spd(*batch: int, n: int = 4) -> torch.Tensor:
    """Random symmetric positive-definite ``n`` x ``n`` matrices (well conditioned)."""
    x = torch.randn(*batch, n, n)
    return x @ x.mT + n * torch.eye(n)


def special(*, second: bool = False) -> torch.Tensor:
    """The special values, or (``second``) a rotation of them to pair every case."""
    values = torch.tensor(SPECIAL)
    return values.roll(7) if second else values


def rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if dtype == torch.bool:
        return bools(*shape)
    if dtype.is_floating_point:
        return floats(*shape, dtype=dtype)
    return ints(*shape, dtype=dtype)


# ------------------------------------------------------------------ operand combinations ---


def operand_pairs(kinds: set[str], divisor: bool = False) -> list[tuple[Any, Any]]:
    """Operand pairs covering broadcasting, rank 6, 0-d tensors, Python scalars and the dtype
    promotions PyTorch applies.  ``kinds`` ⊆ {"float", "int", "bool", "uint8"};
    ``divisor`` keeps right operands away from zero."""

    def right(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return divisors(*shape, dtype=dtype) if divisor else rand(*shape, dtype=dtype)

    pairs: list[tuple[Any, Any]] = []
    if "float" in kinds:
        pairs += [
            (floats(2, 3, 4), right(3, 1, dtype=torch.float32)),  # broadcasting
            (floats(2, 1, 3, 1, 2, 2), right(1, 2, 1, 2, 1, 2, dtype=torch.float32)),  # rank 6
            (floats(), right(dtype=torch.float32)),  # 0-d
            (floats(3, 4), 2.5),  # Python float
            (floats(3, 4), right(dtype=torch.float32).double()),  # 0-d float64 keeps float32
        ]
    if "int" in kinds:
        pairs += [
            (ints(3, 4), right(3, 4, dtype=torch.int64)),
            (ints(3, 4, dtype=torch.int32), right(4, dtype=torch.int32)),
            (ints(3, 4, dtype=torch.int32), right(dtype=torch.int64)),  # 0-d int64: int32
            (ints(3, 4), 3),  # Python int
        ]
    if "int" in kinds and "float" in kinds:
        pairs += [
            (ints(3, 4, dtype=torch.int32), 2.5),  # int tensor, float scalar: float32
            (ints(3, 4), right(dtype=torch.float32)),  # int tensor, 0-d float: float32
            (floats(3, 4), right(3, 4, dtype=torch.int64)),  # float with int tensor
        ]
    if "uint8" in kinds:
        pairs += [(ints(3, 4, dtype=torch.uint8), right(3, 4, dtype=torch.uint8))]
    if "bool" in kinds:
        pairs += [(bools(3, 4), bools(4)), (bools(3, 4), True)]
        if "int" in kinds:
            pairs += [(bools(3, 4), right(3, 4, dtype=torch.int32))]  # bool with int: int
    return pairs


def binary_case(
    op: Callable[[Any, Any], Any], pairs: list[tuple[Any, Any]]
) -> tuple[Callable[..., Any], list[torch.Tensor]]:
    """A function of the pairs' tensors applying ``op`` to every pair, and its arguments."""
    tensors = [x for pair in pairs for x in pair if isinstance(x, torch.Tensor)]

    def fn(*args: torch.Tensor) -> tuple[Any, ...]:
        it = iter(args)
        results = []
        for a, b in pairs:
            a = next(it) if isinstance(a, torch.Tensor) else a
            b = next(it) if isinstance(b, torch.Tensor) else b
            results.append(op(a, b))
        return tuple(results)

    return fn, tensors


def grouped(names: list[str], size: int, *, slow_singles: bool = True) -> list[Any]:
    """pytest params: ``names`` in groups of ``size`` (one conversion each, fast suite), and
    with ``slow_singles`` every name alone as well (``make test-all``)."""
    import pytest

    params = [
        pytest.param(names[i : i + size], id="+".join(names[i : i + size]))
        for i in range(0, len(names), size)
    ]
    if slow_singles:
        params += [pytest.param([n], id=f"{n}-alone", marks=pytest.mark.slow) for n in names]
    return params


Case = tuple[Callable[..., Any], list[torch.Tensor]]


def combined(cases: list[Case]) -> Case:
    """One function (and argument list) computing every case: one conversion for all."""
    counts = [len(args) for _, args in cases]

    def fn(*args: torch.Tensor) -> tuple[Any, ...]:
        outputs, start = [], 0
        for (case_fn, _), n in zip(cases, counts, strict=True):
            outputs.append(case_fn(*args[start : start + n]))
            start += n
        return tuple(outputs)

    return fn, [a for _, args in cases for a in args]


def check_cases(cases: list[Case], **tolerance: float) -> None:
    """Convert and check all ``cases`` as one program."""
    from tests.lowerings.support import check_fn

    fn, args = combined(cases)
    check_fn(fn, *args, **tolerance)


# ------------------------------------------------------- operands of reductions and scans ---


def with_nans(x: torch.Tensor) -> torch.Tensor:
    """One NaN in some slices along dim 1, none in others (NaN indices are well defined)."""
    x = x.clone()
    x[0, 1, 2] = NAN
    x[1, 3, 0] = NAN
    return x


def reduction_operands() -> list[torch.Tensor]:
    """float32 (3, 5, 4), int64, int32, bool, uint8, float32 with NaN, rank 6, 0-d."""
    return [
        floats(3, 5, 4),
        ints(3, 5, 4),
        ints(3, 5, 4, dtype=torch.int32),
        bools(3, 5, 4),
        ints(3, 5, 4, dtype=torch.uint8),
        with_nans(floats(3, 5, 4)),
        floats(2, 1, 2, 3, 1, 2),
        floats(),
    ]


#: indices into :func:`reduction_operands`
FLOAT, INT64, INT32, BOOL, UINT8, NANS, RANK6, SCALAR = range(8)


def over_operands(op: Callable[[Any], Any], which: list[int]) -> Case:
    """``op`` applied to each of the :func:`reduction_operands` picked by ``which``."""
    xs = reduction_operands()
    return (lambda *args: tuple(op(x) for x in args)), [xs[i] for i in which]
