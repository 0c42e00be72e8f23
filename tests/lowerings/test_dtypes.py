"""PyTorch dtype semantics of the elementwise lowerings: the type-promotion matrix (tensors,
0-d tensors, Python scalars), int64 kept as si64, and integer division by zero, which would
abort the Core AI runtime process (those cases run in a subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from coreai_torch.errors import ConversionError
from tests.lowerings.support import check_fn, convert_fn

ROOT = Path(__file__).resolve().parents[2]

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def exact(dtype: torch.dtype, *shape: int) -> torch.Tensor:
    """Small values that every dtype represents exactly (so results are exact too)."""
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    low = 0 if dtype == torch.uint8 else -4
    return torch.randint(low, 5, shape).to(dtype)


FAST_LEFT = (torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool)


@pytest.mark.parametrize(
    "left",
    [d if d in FAST_LEFT else pytest.param(d, marks=pytest.mark.slow) for d in DTYPES],
    ids=str,
)
def test_promotion_matrix(left: torch.dtype) -> None:
    """``left`` tensors against every dtype as a tensor, a 0-d tensor and a Python scalar."""
    a = exact(left, 3, 4)
    others = [exact(d, 4) for d in DTYPES] + [exact(d) for d in DTYPES]

    def f(a, *bs):
        out = []
        for b in bs:
            out += [a + b, a * b, torch.maximum(a, b), a == b, a < b, torch.where(a > 0, a, b)]
        for s in (2, 1.5, True):
            out += [a * s, a + s, a == s]
        return tuple(out)

    check_fn(f, a, *others)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
def test_integer_inputs_of_float_ops(dtype: torch.dtype) -> None:
    """True division, float functions and float scalars promote integers to float32."""
    x = exact(dtype, 3, 4)

    def f(x):
        return x / 2, x.exp(), x.sigmoid(), x * 0.5, x.sqrt(), x.float().mean(), x.reciprocal()

    check_fn(f, x)


def test_int64_stays_si64() -> None:
    program = convert_fn(lambda x: (x + 1) * x // 3, torch.tensor([5, 7]))
    text = str(program)
    assert "si64" in text
    assert "si32" not in text and "coreai.cast" not in text


def test_int64_beyond_int32_range() -> None:
    x = torch.tensor([2**40, -(2**50), 3 * 2**33, 7])
    check_fn(lambda x: (x + 2**35, x * 3, x // 7, x % 1000, x.abs(), x.sum(), x.max()), x)


def test_division_by_zero_scalar_is_rejected() -> None:
    with pytest.raises(ConversionError, match="division by zero"):
        convert_fn(lambda x: x // 0, torch.tensor([5, 7]))


# ------------------------------------------------------ integer division by runtime zeros ---

_ZERO_DIVISION_SCRIPT = """
import torch
from tests.lowerings.support import convert_fn
from coreai_torch.runtime import Session
from coreai_torch.verify import run_entrypoint

def f(a, b):
    return (a // b, torch.div(a, b, rounding_mode="trunc"), a % b, torch.fmod(a, b),
            a.int() // b.int(), a.int() % b.int(), a.clamp(-3, 3) ** (b - 1))

a = torch.tensor([7, -7, 5, -9, -2**63, 2**63 - 1, -2**31, 0])
b = torch.tensor([0, 0, -1, -1, -1, -1, -1, 0])
program = convert_fn(f, a, b)
with Session(program) as session:
    out = run_entrypoint(session, program, (a, b))
for result in out:
    print(" ".join(str(int(v)) for v in result.reshape(-1)))
"""


def _run_isolated(script: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_integer_division_by_runtime_zero_and_minus_one_does_not_abort() -> None:
    """Zero divisors give ``x // 0 == x`` and ``x % 0 == 0`` (PyTorch raises instead);
    ``-1`` divisors wrap like PyTorch (``INT_MIN // -1 == INT_MIN``); ``0 ** -1`` is 0."""
    done = _run_isolated(_ZERO_DIVISION_SCRIPT)
    assert done.returncode == 0, f"process died ({done.returncode}):\n{done.stderr[-3000:]}"
    lines = [line for line in done.stdout.splitlines() if line and line[0] in "-0123456789"]
    rows = [[int(v) for v in line.split()] for line in lines]
    a = [7, -7, 5, -9, -(2**63), 2**63 - 1, -(2**31), 0]
    negated = [-v if v != -(2**63) else v for v in a]
    assert rows[0] == [7, -7, *negated[2:7], 0]  # floor
    assert rows[1] == [7, -7, *negated[2:7], 0]  # trunc
    assert rows[2] == [0] * 8  # remainder
    assert rows[3] == [0] * 8  # fmod
    # .int() wraps like PyTorch: -2**63 -> 0, 2**63 - 1 -> -1
    assert rows[4] == [7, -7, -5, 9, 0, 1, -(2**31), 0]
    assert rows[5] == [0] * 8
    a_small, b_minus_1 = (
        torch.tensor(a).clamp(-3, 3),
        torch.tensor([-1, -1, -2, -2, -2, -2, -2, -1]),
    )
    assert rows[6] == (a_small**b_minus_1).tolist()  # 0 ** -n would abort the runtime
