"""``linalg.matrix_exp`` on the Core AI runtime vs eager PyTorch: each Taylor degree ATen picks
by the norm, scaling and squaring, batches, 1x1 matrices, NaN, float64 and float16."""

from __future__ import annotations

import torch

from tests.lowerings.support import check_fn


def _matrix_exp_cases() -> list[torch.Tensor]:
    """One matrix per Taylor degree ATen picks by the 1-norm (1, 2, 4, 8, 12, then 18 with 0,
    1 and several squarings), a skew-symmetric one with a large norm (bounded result)."""
    torch.manual_seed(0)
    base = torch.randn(4, 4)
    base = base / torch.linalg.matrix_norm(base, 1)
    cases = [base * norm for norm in (1e-8, 3e-4, 0.03, 0.4, 1.2, 2.5, 5.0, 40.0)]
    skew = torch.randn(4, 4)
    return [*cases, (skew - skew.T) * 5]


def test_matrix_exp() -> None:
    """Single matrices (degree chosen by norm), batches (always degree 18 with per-matrix
    squarings), 1x1 matrices, NaN and float64."""
    cases = _matrix_exp_cases()
    batch = torch.stack([cases[0], cases[3], cases[6], cases[7]]).reshape(2, 2, 4, 4)
    nan = torch.randn(2, 3, 3)
    nan[1, 0, 0] = float("nan")
    E = torch.linalg.matrix_exp

    def fn(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        *singles, batch, ones, nan, double = args
        return (*(E(a) for a in singles), E(batch), E(ones), E(nan), E(double))

    args = [*cases, batch, torch.randn(3, 1, 1), nan, cases[5].double()]
    check_fn(fn, *args, atol=1e-4, rtol=1e-4)


def test_matrix_exp_low_precision() -> None:
    """float16 computes in float32 and rounds once (PyTorch's CPU kernel overflows in
    float16, so compare with float32 rounded)."""
    from coreai_torch.runtime import run_program
    from tests.lowerings.support import convert_fn

    a = torch.randn(2, 3, 3) * 0.5
    program = convert_fn(torch.linalg.matrix_exp, a.half())
    (got,) = run_program(program, {"args_0": a.half().numpy()}).values()
    expected = torch.linalg.matrix_exp(a.half().float()).half()
    torch.testing.assert_close(torch.from_numpy(got), expected, atol=2e-3, rtol=2e-3)
