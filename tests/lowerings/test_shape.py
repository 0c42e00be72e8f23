"""View and layout ops on the runtime vs eager PyTorch: reshape, permute, expand, squeeze,
cat/stack, split, slice/select/narrow, flip/roll/repeat, unfold/diagonal/as_strided, copies,
and zero-element intermediates resolved at conversion time."""

from __future__ import annotations

import pytest
import torch

from coreai_torch.errors import RuntimeHazardError
from tests.lowerings.support import check_fn, convert_fn, fast_first, rand

DTYPES = fast_first(torch.float32, torch.int64, torch.bool, torch.float16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_views(dtype: torch.dtype) -> None:
    def f(x, s, r8):
        return (
            x.view(4, -1),
            x.reshape(-1),
            x.reshape(2, 1, 3, 1, 4),
            s.reshape(1, 1),
            s.view(1).view(()),
            x[0, 0, 0].reshape(()),
            x.flatten(1),
            x.unflatten(2, (2, 2)),
            r8.reshape(2, -1),
        )

    check_fn(
        f, rand(2, 3, 4, dtype=dtype), rand(dtype=dtype), rand(1, 2, 1, 2, 1, 2, 1, 2, dtype=dtype)
    )


@pytest.mark.parametrize("dtype", fast_first(torch.float32, torch.bool))
def test_permutes(dtype: torch.dtype) -> None:
    def f(x, m, v, s, r8):
        return (
            x.permute(2, 0, 1),
            x.permute(-1, -3, -2),
            x.transpose(0, 2),
            x.transpose(-1, -2),
            m.t(),
            v.t(),
            s.t(),
            x.mT,
            x.movedim(0, -1),
            x.swapaxes(0, 1),
            r8.permute(7, 6, 5, 4, 3, 2, 1, 0),
        )

    r8 = rand(1, 2, 1, 3, 1, 2, 1, 2, dtype=dtype)
    check_fn(
        f,
        rand(2, 3, 4, dtype=dtype),
        rand(3, 5, dtype=dtype),
        rand(4, dtype=dtype),
        rand(dtype=dtype),
        r8,
    )


@pytest.mark.parametrize("dtype", fast_first(torch.float32, torch.int64))
def test_expand_squeeze_unsqueeze(dtype: torch.dtype) -> None:
    def f(x, s, r8):
        return (
            r8.expand(2, 2, 2, 2, 2, 2, 2, 3),
            x.expand(2, 3, 4),
            x.expand(5, 2, -1, 4),
            s.expand(3, 2),
            x.squeeze(),
            x.squeeze(1),
            x.squeeze(0),  # not a unit dim: no-op
            x.squeeze(-1),
            x.squeeze((1, 2)),
            s.squeeze(),
            s.unsqueeze(0),
            s.unsqueeze(-1),
            x.unsqueeze(0),
            x.unsqueeze(-1),
            x.unsqueeze(2),
            x[None, :, None],
        )

    r8 = rand(1, 1, 2, 1, 2, 1, 1, 3, dtype=dtype)
    check_fn(f, rand(2, 1, 1, dtype=dtype), rand(dtype=dtype), r8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cat_stack(dtype: torch.dtype) -> None:
    def f(a, b, c):
        return (
            torch.cat([a, b], 0),
            torch.cat([a, b, a], -1),
            torch.cat([a], 1),
            torch.cat([a.unsqueeze(0), c], 0),
            torch.stack([a, b]),
            torch.stack([a, b, a], -1),
            torch.stack([a[0, 0], b[0, 0]]),
        )

    check_fn(f, rand(2, 3, dtype=dtype), rand(2, 3, dtype=dtype), rand(4, 2, 3, dtype=dtype))


def test_cat_promotion_and_empty_inputs() -> None:
    """Mixed dtypes promote; empty inputs of cat never reach the runtime (it aborts on
    zero-element tensors), whether sliced, created empty, or empty chunks of a split."""

    def f(x, kv, i, b):
        empty = x[:, :0]  # a zero-width slice
        return (
            torch.cat([i, x[0]]),
            torch.cat([b, i]),
            torch.cat([empty, x, empty], 1),
            torch.cat([x, torch.empty(0)], 0),  # legacy 1-D empty input
            torch.cat([kv[:, :, :0].transpose(1, 2).transpose(1, 2), kv], 2),
            torch.cat(x.split([1, 0, 2], 1), 1) * 2,
        )

    check_fn(f, torch.randn(2, 3), torch.randn(1, 2, 3, 4), torch.arange(4), torch.rand(2) > 0.5)


def test_zero_size_value_is_rejected() -> None:
    """An empty value that an op would consume on the runtime is rejected at conversion."""
    with pytest.raises(RuntimeHazardError, match="zero elements"):
        convert_fn(lambda x: torch.exp(x[:, :0]) + 1, torch.randn(2, 3))


@pytest.mark.parametrize("dtype", fast_first(torch.float32, torch.int64))
def test_split_chunk_unbind(dtype: torch.dtype) -> None:
    def f(x):
        return (
            *x.split(2, 1),
            *x.split([1, 4], -1),
            *torch.chunk(x, 3, 1),
            *x.unbind(0),
            *x.unbind(-1),
            *x.tensor_split(3, 1),
            *torch.split(x, [1, 1], 0),
        )

    check_fn(f, rand(2, 5, dtype=dtype))


SLICES = [
    (0, 1, 3, 1),
    (1, 0, None, 2),
    (1, -3, None, 1),
    (1, -100, 3, 1),
    (1, -3, 100, 1),
    (1, 2, 2**63 - 1, 1),
    (-1, None, -1, 1),
    (-1, 1, None, 3),
    (0, -1, None, 1),
    (2, 0, 5, 2),
]


@pytest.mark.parametrize("dtype", fast_first(torch.float32, torch.bool))
def test_slice_select_narrow(dtype: torch.dtype) -> None:
    def f(x, v, y):
        sliced = []
        for dim, start, end, step in SLICES:
            index = [slice(None)] * 3
            index[dim] = slice(start, end, step)
            sliced.append(y[tuple(index)])
        return (
            *sliced,
            x[1],
            x[-1],
            x[:, 2],
            x[..., -2],
            x.select(1, -1),
            v[0],
            x.narrow(1, 1, 2),
            x.narrow(-1, -3, 2),
            x[1, None, ..., 0],
        )

    check_fn(f, rand(3, 4, 5, dtype=dtype), rand(3, dtype=dtype), rand(3, 6, 5, dtype=dtype))


@pytest.mark.parametrize("dtype", fast_first(torch.float32, torch.int64, torch.bool))
def test_flip_roll_repeat(dtype: torch.dtype) -> None:
    def f(x, s, m):
        return (
            x.flip(0),
            x.flip(-1),
            x.flip(0, 2),
            x.flip(()),
            s.flip(0),
            x.roll(1, 1),
            x.roll(-2, -1),
            x.roll((1, 7), (0, 2)),
            x.roll(5),
            torch.rot90(x, 1, (1, 2)),
            m.repeat(2, 1),
            m.repeat(1, 3),
            m.repeat(2, 1, 2),
            m.repeat(1, 1),
            s.repeat(3),
            m.tile(2),
            m.tile(2, 1, 1),
            m.repeat_interleave(2, 0),
        )

    check_fn(f, rand(2, 3, 4, dtype=dtype), rand(dtype=dtype), rand(2, 3, dtype=dtype))


def test_unfold_diagonal_as_strided() -> None:
    def f(x, m):
        return (
            x.unfold(1, 2, 1),
            x.unfold(-1, 3, 2),
            x.unfold(0, 1, 1),
            torch.diagonal(m),
            torch.diagonal(m, 1),
            torch.diagonal(m, -2),
            torch.diagonal(x, 0, 1, 2),
            torch.diagonal(x, 1, -1, 0),
            torch.as_strided(m, (2, 2), (1, 2)),
            torch.as_strided(m, (3,), (5,), 1),
            torch.as_strided(m.t(), (2, 3), (4, 1)),
        )

    check_fn(f, torch.randn(2, 4, 5), torch.randn(4, 5))


def test_copies_and_casts() -> None:
    def f(x, i, b):
        y = x.clone()
        y.copy_(b)
        z = x.clone()
        z[0] = x[1]
        return (
            x.to(torch.int32),
            x.to(torch.float16),
            i.to(torch.float32),
            i.to(torch.int8),  # wraps like PyTorch
            i.to(torch.uint8),
            i.to(torch.bool),
            b.to(torch.float32),
            y,
            z,
            x.detach().contiguous(),
        )

    check_fn(
        f,
        torch.randn(2, 3) * 10,
        torch.tensor([[-300, -1, 0], [127, 128, 1000]]),
        torch.rand(3) > 0.5,
    )


@pytest.mark.slow
@pytest.mark.parametrize("rank", range(0, 9))
def test_rank_sweep(rank: int) -> None:
    shape = [2, 1, 3, 1, 2, 1, 2, 1][:rank]

    def f(x):
        outs = [
            x.reshape(-1),
            x.flip(list(range(rank))),
            x.unsqueeze(0),
            x.squeeze(),
            x.expand(2, *shape),
        ]
        if rank:
            outs += [
                x.permute(*reversed(range(rank))),
                torch.cat([x, x], -1),
                x.narrow(0, 1, 1),
                x.roll(1, 0),
            ]
        return outs

    check_fn(f, torch.randn(shape))
