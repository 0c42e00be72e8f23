"""Matrix products on the Core AI runtime vs eager PyTorch: mm, bmm, matmul (vector and batch
broadcasting), addmm/baddbmm/addmv/addbmm with beta and alpha, linear, bilinear, and 16-bit
operands, which accumulate in float32 like ATen."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.lowerings.support import check_fn


def test_products() -> None:
    check_fn(
        lambda s, m, v, b1, b2, x1, x2, w, bias: (
            torch.addmv(s, m, v, beta=0.5, alpha=2.0),
            torch.addbmm(m, b1, b2, beta=0.0),
            torch.nn.functional.bilinear(x1, x2, w, bias),
        ),
        torch.randn(3),
        torch.randn(3, 4),
        torch.randn(4),
        torch.randn(2, 3, 5),
        torch.randn(2, 5, 4),
        torch.randn(2, 3),
        torch.randn(2, 5),
        torch.randn(4, 3, 5),
        torch.randn(4),
    )


def test_matmul_broadcasting() -> None:
    def f(a, b, v, m3, w, bias):
        return (
            a @ b, torch.mm(a, b), torch.bmm(m3, m3.mT), v @ b, a @ v, v @ v,
            m3 @ b, b.T @ m3.mT, torch.matmul(m3[None], m3.mT), F.linear(m3, w, bias),
            F.linear(v, w), torch.addmm(bias, b.T, w.T, beta=2.0, alpha=0.5),
            torch.baddbmm(m3[..., :4], m3, m3.mT, alpha=0.25),
        )  # fmt: skip

    a, b = torch.randn(4, 5), torch.randn(5, 4)
    m3, w = torch.randn(3, 4, 5), torch.randn(6, 5)
    check_fn(f, a, b, torch.randn(5), m3, w, torch.randn(6))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_products_accumulate_in_float32(dtype: torch.dtype) -> None:
    """A dot product of 1024 terms of 0.1: a float16 running sum would drift far off."""

    def f(a, b, m, c):
        return a @ b, torch.addmm(c, a, b), F.linear(m, a), torch.bmm(m, m.mT)

    a = torch.full((2, 1024), 0.1).to(dtype)
    b = torch.full((1024, 3), 0.1).to(dtype)
    m = (torch.randn(2, 4, 1024) * 0.1).to(dtype)
    tol = {torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    check_fn(f, a, b, m, torch.randn(2, 3).to(dtype), atol=tol, rtol=tol)
