"""``F.linear_cross_entropy`` with chunking options (PyTorch's chunked custom ops) on the Core AI
runtime vs eager PyTorch."""

from __future__ import annotations

import torch

from tests.lowerings.support import check_fn


def test_linear_cross_entropy_chunked() -> None:
    """``F.linear_cross_entropy`` with ``options`` exports PyTorch's chunked custom ops: mean,
    sum and per-sample losses, bias, class weights, ignore_index, an unbatched input."""
    import torch.nn.functional as F
    from torch.nn import LinearCrossEntropyOptions

    options = LinearCrossEntropyOptions(batch_chunk_size=3, allow_retain_graph=True)

    def loss(*args: torch.Tensor, **kwargs: object) -> torch.Tensor:
        return F.linear_cross_entropy(*args, options=options, **kwargs)  # type: ignore[arg-type]

    def fn(x, w, t, b, cw, x1, t1):
        return (
            loss(x, w, t),
            loss(x, w, t, linear_bias=b, weight=cw, reduction="none", ignore_index=1),
            loss(x, w, t, linear_bias=b, weight=cw, ignore_index=2),
            loss(x, w, t, reduction="sum", weight=cw),
            loss(x1, w, t1),
        )

    args = (torch.randn(8, 3), torch.randn(5, 3), torch.randint(0, 5, (8,)), torch.randn(5))
    check_fn(fn, *args, torch.rand(5), torch.randn(3), torch.tensor(2), atol=1e-5, rtol=1e-5)
