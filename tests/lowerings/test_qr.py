"""QR on the Core AI runtime vs eager PyTorch: ``linalg.qr`` (reduced and complete; tall, wide
and batched matrices), ``geqrf`` with ``householder_product`` and ``ormqr``."""

from __future__ import annotations

import torch

from tests.lowerings.support import check_fn


def test_qr() -> None:
    def fn(a: torch.Tensor, wide: torch.Tensor, square: torch.Tensor) -> tuple[torch.Tensor, ...]:
        reflectors, tau = torch.geqrf(a)
        return (
            *torch.linalg.qr(a),
            *torch.linalg.qr(wide, mode="complete"),
            *torch.linalg.qr(square, mode="complete"),
            torch.linalg.householder_product(reflectors, tau),
            torch.ormqr(reflectors, tau, square[:, :5, :2]),
            torch.ormqr(reflectors, tau, square[:, :2, :5], left=False, transpose=True),
        )

    args = (torch.randn(2, 5, 3), torch.randn(3, 5), torch.randn(2, 5, 5))
    check_fn(fn, *args, atol=1e-3, rtol=1e-3)
