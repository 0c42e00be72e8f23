"""Symmetric eigenvalues, singular values and pseudo-inverses on the Core AI runtime vs eager
PyTorch (Jacobi rotations): ``eigvalsh``, ``svdvals``, ``pinv`` (general and hermitian, with
tolerances), ``matrix_rank``, and the eigenvalues of ``eigh``."""

from __future__ import annotations

import torch

from tests.lowerings.support import check_fn
from tests.lowerings.values import spd


def test_eigenvalues_singular_values_pseudo_inverses() -> None:
    def fn(a: torch.Tensor, wide: torch.Tensor, sym: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (
            torch.linalg.eigvalsh(sym),
            torch.linalg.eigvalsh(sym, UPLO="U"),
            torch.linalg.eigh(sym)[0],
            torch.linalg.svdvals(a),
            torch.linalg.svdvals(wide),
            torch.linalg.pinv(a),
            torch.linalg.pinv(wide, atol=0.1),
            torch.linalg.pinv(sym, hermitian=True),
            torch.linalg.matrix_rank(a),
        )

    check_fn(fn, torch.randn(2, 5, 3), torch.randn(3, 5), spd(n=5), atol=1e-3, rtol=1e-3)
