"""LU factorizations and what is built on them on the Core AI runtime vs eager PyTorch:
``linalg.lu`` / ``lu_factor`` / ``lu_solve`` (adjoint), ``linalg.solve`` (vector and left=False
cases), inverses and determinants."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tests.lowerings.support import check_fn, runtime_outputs


def test_lu_solve_inverse_determinants() -> None:
    def fn(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        p, lower, upper = torch.linalg.lu(a)
        lu, pivots = torch.linalg.lu_factor(a)
        sign, logabs = torch.linalg.slogdet(a)
        return (
            p,
            lower,
            upper,
            pivots,
            torch.linalg.lu_solve(lu, pivots, b),
            torch.linalg.lu_solve(lu, pivots, b, adjoint=True),
            torch.linalg.solve(a, b),
            torch.linalg.solve(a, b[..., 0]),
            torch.linalg.solve(a, b.mT, left=False),
            torch.linalg.inv(a),
            torch.linalg.det(a),
            sign,
            logabs,
        )

    check_fn(fn, torch.randn(2, 4, 4), torch.randn(2, 4, 2), atol=1e-3, rtol=1e-3)


def _singular_determinants(det: Any, sign: Any, logabs: Any) -> None:
    """What is defined for an exactly singular matrix in float32: |det| at rounding level,
    log|det| very negative (or -inf), and sign * exp(log|det|) == det."""
    det, sign, logabs = (np.asarray(v, dtype=np.float64) for v in (det, sign, logabs))
    assert (np.abs(det) < 1e-5).all(), det
    assert (logabs < -10).all(), logabs  # -inf where the pivot is exactly 0
    assert np.isin(np.abs(sign), (0.0, 1.0)).all(), sign
    np.testing.assert_allclose(sign * np.exp(logabs), det, rtol=0, atol=1e-6)


def test_determinants_of_singular_matrices() -> None:
    """LAPACK's answer for an exactly singular matrix depends on the processor (the rounding
    of its kernels): eager PyTorch gives det 0 and sign 0 on some x86 machines, det 3.6e-7 and
    sign 1 on others (MKL's AVX2 kernels).  Both the runtime and eager are held to what is
    defined rather than to each other."""
    singular = torch.tensor(
        [
            [[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [1.0, 0.0, 1.0]],  # rows 1 and 2 proportional
            [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]],  # rank 2, no zero pivot
        ]
    )

    def fn(s: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (torch.linalg.det(s), *torch.linalg.slogdet(s))

    _singular_determinants(*fn(singular))
    _singular_determinants(*runtime_outputs(fn, singular))


def test_unpack_tensorinv_and_non_square_factors() -> None:
    def fn(a: torch.Tensor, wide: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        lu, pivots = torch.linalg.lu_factor(a)
        return (
            *torch.lu_unpack(lu, pivots),
            *torch.linalg.lu(wide),
            *torch.linalg.lu(wide.mT),
            torch.linalg.tensorinv(t, ind=2),
            torch.linalg.inv_ex(a)[1],
        )

    args = (torch.randn(3, 4, 4), torch.randn(3, 5), torch.randn(2, 3, 6))
    check_fn(fn, *args, atol=1e-3, rtol=1e-3)
