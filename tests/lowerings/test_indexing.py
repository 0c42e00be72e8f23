"""Reading by index on the runtime vs eager PyTorch: advanced indexing (static and dynamic
dims, high ranks), index_select, gather, embedding(_bag), masked_fill and nonzero."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from coreai_torch.errors import ConversionError
from tests.helpers import check_module
from tests.lowerings.support import Fn, check_fn, convert_fn, fast_first, idx, rand


@pytest.mark.parametrize("dtype", fast_first(torch.float32, torch.int64, torch.bool))
def test_advanced_indexing(dtype: torch.dtype) -> None:
    def f(x, i, j, b):
        return (
            x[i],  # first dim
            x[:, i],  # middle dim
            x[..., j],  # last dim, negative index
            x[i, j],  # two adjacent index tensors
            x[i, :, j],  # non-adjacent: broadcast dims go first
            x[:, i, j],
            x[b, :, b.t()],  # broadcasting 2-D index tensors
            x[:, b],  # 2-D index tensor
            x[i, None, 1:, j],
            x[1, i],  # int + tensor (select then index)
            x[idx(0)[0]],  # 0-d index tensor
        )

    x = rand(3, 4, 5, dtype=dtype)
    check_fn(f, x, idx(2, 0, -1), idx(-1, 3, 0), torch.tensor([[0, 1], [2, 0]]))


def test_boolean_masks() -> None:
    """Masked selections have data-dependent sizes: they may only be returned (an empty one
    consumed by another op would abort the runtime)."""
    x = torch.tensor([[1.0, -2.0, 3.0], [-4.0, 5.0, 0.0]])
    check_fn(
        lambda x, m: (x[x > 0], x[m], torch.masked_select(x, m[0]), torch.nonzero(x)), x, x > 1
    )
    check_fn(lambda x: (x[x > 9], torch.nonzero(x > 9), torch.nonzero(x > 9, as_tuple=True)), x)

    def put(x, m, rows, two):
        y, z, w = x.clone(), x.clone(), x.clone()
        y[m[:, 0]] = rows[0]  # one row for every selected position
        z[two] = rows  # consecutive rows (two positions selected, two rows)
        w = torch.ops.aten.index_put(w, (m,), torch.tensor(1.0), True)
        return y, z, w

    check_fn(put, x, x > 1, torch.randn(2, 3), torch.tensor([True, True]))
    with pytest.raises(ConversionError, match="data-dependent"):
        convert_fn(lambda x: x[x > 0].sum(), x)


@pytest.mark.parametrize("dtype", fast_first(torch.float32, torch.int64))
def test_index_select_gather(dtype: torch.dtype) -> None:
    def f(x, i, g, s):
        return (
            x.index_select(0, i),
            x.index_select(1, i.clamp(max=2)),
            x.index_select(-1, idx(3, 3, 0)),
            s.index_select(0, idx(0)),
            torch.gather(x, 2, g),
            torch.gather(x, 0, g[:2, :2, :1] % 3),  # index smaller than input in other dims
            torch.gather(x, -1, g[:, :1]),
            torch.take_along_dim(x, g, 2),
        )

    check_fn(
        f,
        rand(3, 4, 5, dtype=dtype),
        idx(2, 0, 1, 2),
        torch.randint(0, 5, (3, 4, 2)),
        rand(dtype=dtype),
    )


@pytest.mark.parametrize("dtype", fast_first(torch.float32, torch.float16))
def test_embedding(dtype: torch.dtype) -> None:
    model = nn.Embedding(20, 6, padding_idx=0).to(dtype).eval()
    check_module(model, (torch.randint(0, 20, (2, 7)),))


@pytest.mark.parametrize("mode", fast_first("sum", "mean", "max"))
def test_embedding_bag(mode: str) -> None:
    bag = nn.EmbeddingBag(10, 3, mode=mode).eval()
    weighted = nn.EmbeddingBag(10, 3, mode="sum").eval()

    def f(ids2d, flat, offsets, w):
        outs = [bag(ids2d), bag(flat, offsets)]
        if mode == "sum":
            outs.append(weighted(flat, offsets, per_sample_weights=w))
        return outs

    flat, offsets = idx(1, 2, 4, 5, 4, 3, 2, 9), idx(0, 2, 2, 5)  # one empty bag
    mod = Fn(f)
    mod.bag, mod.weighted = bag, weighted
    check_module(mod, (torch.randint(0, 10, (2, 4)), flat, offsets, torch.rand(8)))


def test_masked_fill_where() -> None:
    def f(x, m):
        return (
            x.masked_fill(m, -1.0),
            x.masked_fill(x > 0, float("-inf")),
            x.masked_fill(m[0], torch.tensor(2.0)),
            x.int().masked_fill(m, 7),
            torch.where(m, x, 0.0),
        )

    check_fn(f, torch.randn(3, 4), torch.rand(3, 4) > 0.5)


@pytest.mark.slow
@pytest.mark.parametrize("rank", [1, 5, 8])
def test_high_rank_indexing(rank: int) -> None:
    shape = [2, 3, 1, 2, 2, 1, 2, 3][:rank]

    def f(x, i):
        g = torch.zeros(shape, dtype=torch.long)
        return (
            x[i % shape[0]],
            x[..., i % shape[-1]],
            torch.gather(x, rank - 1, g),
            x.scatter(0, g, 1.0),
            x.index_select(-1, i % shape[-1]),
            torch.ops.aten.index_put(x, (i % shape[0],), torch.tensor(5.0), True),
            x.flip(0).roll(1, -1),
        )

    check_fn(f, torch.randn(shape), idx(0, 1, -1))


class DynamicIndexing(nn.Module):
    """Advanced indexing and gather whose input and index tensors have a dynamic dim (the
    causal-mask pattern of Hugging Face decoders, ``mask[batch_arange[:, None], arange(seq)]``,
    and DeBERTa's relative-position gathers)."""

    def forward(self, x: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b, t = x.shape[0], x.shape[1]
        rows = torch.arange(b).view(b, 1)
        cols = torch.arange(t)
        return (
            x[rows, cols],  # (b, 1) with (t,): broadcast to (b, t)
            x[:, cols.flip(0)],  # one dynamic index tensor
            x[rows, i],  # dynamic input, static index
            x[i % b][:, cols[:, None], cols[None, :]],  # (t, 1) with (1, t): a (t, t) grid
            torch.gather(x, 2, cols.flip(0).view(1, t, 1).expand(b, t, 2)),  # dynamic index
            torch.gather(x, 1, cols.view(1, t, 1).expand(b, t, 1)),  # smaller in a dynamic dim
        )


def test_advanced_indexing_dynamic_dims() -> None:
    from torch.export import Dim

    from coreai_torch import TorchConverter
    from coreai_torch.frontend.export import export_decomposed
    from tests.helpers import check_runs

    model = DynamicIndexing()
    seq = Dim("seq", min=2, max=32)
    i = idx(1, 0, 1)
    ep = export_decomposed(
        model, (torch.randn(2, 6, 6), i), dynamic_shapes=({1: seq, 2: seq}, None)
    )
    program = TorchConverter().add_exported_program(ep).to_coreai().optimize()
    assert "tensor<2x?x?xf32>" in str(program)
    check_runs(model, program, [(torch.randn(2, t, t), i) for t in (6, 2, 17)])
