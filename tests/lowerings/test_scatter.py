"""Writing by index on the Core AI runtime vs eager PyTorch: scatter / scatter_add /
scatter_reduce, index_put (accumulating, ``x[i] = v`` patterns, dynamic indices), index_reduce,
put, slice/select/diagonal/masked/as_strided scatter and nonzero_static."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.lowerings.support import check_fn, fast_first, idx, rand


@pytest.mark.parametrize("dtype", fast_first(torch.float32, torch.int64))
def test_scatter(dtype: torch.dtype) -> None:
    def f(x, i, src):
        return (
            x.scatter(1, i, src),
            x.scatter(1, i[:, :2], src),  # index smaller than src and self
            x.scatter(0, i[:2] % 3, 5),
            x.scatter(1, i, src, reduce="add"),
            x.scatter(1, i, src, reduce="multiply"),
            x.scatter_add(1, i, src),
            x.scatter_add(-1, i[:1], src),
            torch.zeros(5, dtype=dtype).scatter(0, idx(4, 1), idx(3, 9).to(dtype)),
        )

    i = torch.tensor([[0, 1, 1], [3, 2, 3], [1, 1, 0]])  # duplicates per row, disjoint sets
    i = torch.stack([torch.randperm(4)[:3] for _ in range(3)])
    check_fn(f, rand(3, 4, dtype=dtype), i, rand(3, 3, dtype=dtype))


@pytest.mark.parametrize("include_self", fast_first(True, False))
def test_scatter_reduce(include_self: bool) -> None:
    def f(x, i, src, xi, srci):
        outs = []
        for reduce in ("sum", "prod", "mean", "amax", "amin"):
            outs += [
                x.scatter_reduce(1, i, src, reduce, include_self=include_self),
                x.scatter_reduce(0, i[:2, :2] % 3, src, reduce, include_self=include_self),
                xi.scatter_reduce(1, i, srci, reduce, include_self=include_self),
            ]
        return outs

    i = torch.tensor([[0, 1, 1], [3, 3, 3], [1, 2, 0]])  # duplicate targets
    xi, srci = torch.randint(-9, 9, (3, 4)), torch.randint(-9, 9, (3, 3))
    check_fn(f, torch.randn(3, 4), i, torch.randn(3, 3), xi, srci)


@pytest.mark.parametrize("accumulate", fast_first(True, False))
def test_index_put(accumulate: bool) -> None:
    def f(x, i, j, v):
        outs = []
        for indices, values in [
            ((i,), v[0]),  # rows
            ((i, j), v[0, 0, 0]),  # elements, scalar broadcast
            ((None, j), v[0, :3]),  # x[:, j] = ...
            ((i, None, j), v[0, 0, :4]),  # non-adjacent
            ((idx(-1),), v[0, :1]),  # negative index
        ]:
            outs.append(torch.ops.aten.index_put(x, indices, values, accumulate))
        return outs

    i = idx(0, 2, 0) if accumulate else idx(0, 2, 1)  # duplicates only when accumulating
    j = idx(1, -1, 3)
    check_fn(f, torch.randn(3, 4, 5), i, j, torch.randn(3, 4, 5))


def test_setitem_patterns() -> None:
    def f(x, m, i):
        y = x.clone()
        y[m] = 0.0  # boolean mask, one value
        z = x.clone()
        z[:, 1:3] = -1.0
        w = x.clone()
        w[i] += 1.0
        u = x.clone()
        u[..., 0] = x[..., 1]
        return (
            y,
            z,
            w,
            u,
            x.index_fill(1, idx(0, 2), 9.0),
            x.index_copy(0, idx(2, 0), x[:2]),
            x.index_add(0, i, x[:3]),
            torch.ops.aten.index_put(x, (i[:0],), torch.tensor(5.0)),  # no positions
        )

    check_fn(f, torch.randn(3, 4), torch.rand(3, 4) > 0.5, idx(0, 2, 0))


def test_slice_select_diagonal_masked_scatter() -> None:
    def f(x, s, m, src):
        return (
            torch.slice_scatter(x, s[:, :2], 1, 0, 4, 2),
            torch.slice_scatter(x, s[:1], 0, -1),
            torch.select_scatter(x, s[:, 0], 1, -1),
            torch.select_scatter(x, s[0], 0, 1),
            torch.diagonal_scatter(x, s[0, :3], 0),
            torch.diagonal_scatter(x, s[0, :3], 1),
            torch.diagonal_scatter(x, s[0, :2], -1),
            x.masked_scatter(m, src),
            x.masked_scatter(m[0], src),
            x.int().masked_scatter(m, src.int()),
            F.pad(x[None, None], (1, 2, 2, 1), mode="circular"),  # empty + slice_scatter
        )

    check_fn(f, torch.randn(3, 4), torch.randn(3, 4), torch.rand(3, 4) > 0.5, torch.randn(20))


def test_index_reduce_put_strided_nonzero_static() -> None:
    def f(x, i, src, flat_i, w):
        outs = [x.index_reduce(0, i, src, r) for r in ("prod", "mean", "amax", "amin")]
        outs.append(x.index_reduce(1, i[:2], src[:, :2], "amax", include_self=False))
        outs += [x.put(flat_i, src[0, :3]), x.put(flat_i, src[0, :3], accumulate=True)]
        outs += [
            torch.as_strided_scatter(x, src[:2, :2], (2, 2), (1, 2)),
            torch.nonzero_static(x > 0, size=6),
        ]
        outs.append(F.embedding(flat_i % 10, w.clone(), max_norm=1.0))  # renormalises rows
        return outs

    args = (torch.randn(3, 4), idx(0, 2, 0), torch.randn(3, 4), idx(0, 5, -1), torch.randn(10, 4))
    check_fn(f, *args)


class CacheWrite(nn.Module):
    """A KV-cache style write of a dynamic number of rows at runtime positions."""

    def forward(self, cache: torch.Tensor, rows: torch.Tensor, start: torch.Tensor):
        positions = torch.arange(rows.shape[2]) + start
        written = cache.index_copy(2, positions, rows)  # index_put with a dynamic index
        second = cache.clone()
        second[:, :, positions] = rows * 2
        return written, second


def test_index_put_dynamic_index() -> None:
    from torch.export import Dim

    from coreai_torch import TorchConverter
    from coreai_torch.frontend.export import export_decomposed
    from tests.helpers import check_runs

    model = CacheWrite()
    cache = torch.randn(1, 2, 16, 4)
    t = Dim("t", min=1, max=16)
    args = (cache, torch.randn(1, 2, 5, 4), idx(3))
    ep = export_decomposed(model, args, dynamic_shapes=(None, {2: t}, None))
    program = TorchConverter().add_exported_program(ep).to_coreai().optimize()
    runs = [(cache, torch.randn(1, 2, n, 4), idx(s)) for n, s in ((5, 3), (1, 15), (16, 0))]
    check_runs(model, program, runs)
