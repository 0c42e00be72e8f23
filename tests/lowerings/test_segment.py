"""segment_reduce on the Core AI runtime vs eager PyTorch: every reduction by lengths and
offsets, with and without ``initial``, empty segments, NaN, segment axes after batch dims."""

from __future__ import annotations

import torch

from tests.lowerings.support import check_fn
from tests.lowerings.values import NAN, floats


def test_segment_reduce() -> None:
    """Every reduction by lengths and offsets, with and without ``initial``: empty segments,
    NaN inside a segment, a segment axis after batch dims, segments not covering the axis."""
    SR = torch.segment_reduce

    def f(d, lengths, offsets, m, rows, short):
        outs = []
        for r in ("mean", "max", "min", "sum", "prod"):
            outs += [
                SR(d, r, lengths=lengths), SR(d, r, lengths=lengths, initial=1),
                SR(d, r, offsets=offsets), SR(m, r, lengths=rows, axis=1, initial=2),
                SR(m.T.reshape(5, 2, 2)[:4], r, lengths=short, unsafe=True),
                SR(m, r, lengths=rows[:, 1:], axis=-1),
            ]  # fmt: skip
        return tuple(outs)

    d = torch.tensor([1.0, 2.0, 3.0, NAN, 5.0])
    lengths, offsets = torch.tensor([0, 1, 2, 2]), torch.tensor([0, 0, 1, 3, 5])
    rows = torch.tensor([[0, 1, 2, 2]] * 4)
    check_fn(f, d, lengths, offsets, floats(4, 5), rows, torch.tensor([2, 0, 1]))
