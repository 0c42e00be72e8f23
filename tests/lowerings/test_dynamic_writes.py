"""Writes into tensors whose dims have a run-time size, at runtime offsets: ``slice_scatter``
(``x[a:b] = v``, ``x[a:b].copy_(v)``), ``select_scatter`` (``x[:, i] = v``), ``index_put``
(``x[i] = v``, ``x[i] += v``, masks) and ``index_copy`` (and ``index_copy_``) — each exported
with ``torch.export.Dim``s, converted once, run on the runtime at several sizes and compared
with eager PyTorch; then states of run-time size written at a runtime offset and carried from
call to call, as a KV cache that grows is."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.export import Dim

from coreai_torch import TorchConverter
from coreai_torch.frontend.export import export_decomposed
from tests.helpers import check_runs

ROWS = Dim("rows", min=3, max=64)
NEW = Dim("new", min=1, max=32)
SEEN = Dim("seen", min=1, max=32)


def convert_dynamic(model: nn.Module, args: tuple[Any, ...], dynamic: Any) -> Any:
    ep = export_decomposed(model, args, dynamic_shapes=dynamic, strict=False)
    return TorchConverter().add_exported_program(ep).to_coreai().optimize()


# ------------------------------------------------------------------------ slice_scatter ---


class SliceWrites(nn.Module):
    """Slices of a tensor of run-time length written at runtime and static offsets."""

    def forward(self, x: torch.Tensor, new: torch.Tensor, seen: torch.Tensor) -> Any:
        n, p = new.shape[1], seen.shape[0]
        at_end = x.clone()
        at_end[:, p - n : p] = new  # the new rows of a KV cache: offset P - T
        tail = x.clone()
        tail[:, -n:] = new * 2  # a negative runtime start
        fixed = x.clone()
        fixed[:, 1 : 1 + n] = new + 1  # a static start, runtime length
        strided = x.clone()
        strided[:, ::2] = -x[:, ::2]  # a step over a dim of run-time size
        copied = x.clone()
        copied[:, p - n : p].copy_(new[:, :1])  # copy_ broadcasts into the slice
        return (
            at_end,
            tail,
            fixed,
            strided,
            copied,
            torch.slice_scatter(x, new, 1, p - n, p),  # the op itself
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32])
def test_slice_scatter_dynamic(dtype: torch.dtype) -> None:
    model = SliceWrites()

    def args(rows: int, new: int, seen: int) -> tuple[torch.Tensor, ...]:
        x = (torch.randn(3, rows) * 4).to(dtype)
        return x, (torch.randn(3, new) * 4).to(dtype), torch.zeros(seen)

    program = convert_dynamic(model, args(16, 3, 7), ({1: ROWS}, {1: NEW}, {0: SEEN}))
    assert "tensor<3x?x" in str(program)
    runs = [args(16, 3, 7), args(9, 1, 9), args(40, 12, 30), args(3, 2, 2)]
    check_runs(model, program, runs)


# ----------------------------------------------------------------------- select_scatter ---


class SelectWrites(nn.Module):
    def forward(self, x: torch.Tensor, row: torch.Tensor) -> Any:
        last = x.clone()
        last[:, -1] = row  # a negative index into a dim of run-time size
        first = x.clone()
        first[:, 0] = row * 2
        return last, first, torch.select_scatter(x, x[1], 0, 1)


def test_select_scatter_dynamic() -> None:
    model = SelectWrites()
    program = convert_dynamic(model, (torch.randn(3, 8), torch.randn(3)), ({1: ROWS}, None))
    runs = [(torch.randn(3, n), torch.randn(3)) for n in (8, 3, 33)]
    check_runs(model, program, runs)


# --------------------------------------------------------------- index_put / index_copy ---


class IndexWrites(nn.Module):
    """Index writes into a tensor whose rows (dim 1) have a run-time count."""

    def forward(self, x: torch.Tensor, new: torch.Tensor, start: torch.Tensor) -> Any:
        positions = torch.arange(new.shape[1]) + start
        put = x.clone()
        put[:, positions] = new  # index_put: (None, index), runtime length and offset
        copied = x.index_copy(1, positions, new)
        in_place = x.clone()
        in_place.index_copy_(1, positions, new * 3)
        wrapped = x.clone()
        wrapped[:, positions - x.shape[1]] = new - 1  # negative indices wrap
        elements = x.clone()
        elements[0, positions] = 7.0  # two indices, a scalar value
        added = x.clone()
        added[:, positions % 2] += new  # accumulate, duplicate targets
        masked = x.clone()
        masked[x > 1] = 0.0  # a mask of run-time size
        return put, copied, in_place, wrapped, elements, added, masked


def test_index_put_and_copy_dynamic() -> None:
    model = IndexWrites()

    def args(rows: int, new: int, start: int) -> tuple[torch.Tensor, ...]:
        return torch.randn(2, rows, 3), torch.randn(2, new, 3), torch.tensor(start)

    program = convert_dynamic(model, args(16, 5, 3), ({1: ROWS}, {1: NEW}, None))
    assert "tensor<2x?x3xf32>" in str(program)
    check_runs(model, program, [args(16, 5, 3), args(6, 1, 5), args(50, 20, 30), args(3, 2, 0)])


class RowsOfDynamicTable(nn.Module):
    """``index_put`` whose only index is the first dim, in a table of run-time length and
    width, including a runtime index tensor of run-time length."""

    def forward(self, table: torch.Tensor, rows: torch.Tensor, which: torch.Tensor) -> Any:
        written = torch.index_put(table, (which,), rows)
        summed = torch.index_put(table, (which,), rows, accumulate=True)
        return written, summed


def test_index_put_dynamic_table() -> None:
    model = RowsOfDynamicTable()
    width = Dim("width", min=1, max=16)

    def args(n: int, w: int, which: list[int]) -> tuple[torch.Tensor, ...]:
        return torch.randn(n, w), torch.randn(len(which), w), torch.tensor(which)

    dynamic = ({0: ROWS, 1: width}, {0: NEW, 1: width}, {0: NEW})
    program = convert_dynamic(model, args(8, 4, [1, 5, 1]), dynamic)
    runs = [args(8, 4, [1, 5, 1]), args(3, 1, [2]), args(20, 16, [0, -1, 19, 7, 7, 7])]
    check_runs(model, program, runs)


# ------------------------------------------------------- states written at an offset ---


class GrowingCache(nn.Module):
    """``cache[:, P - T : P] = f(new)`` into a state whose length is known only at run time
    (the caller grows it), reading back only the first ``P`` rows: what a decoder does with
    a KV cache that the app grows."""

    def forward(self, new: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor) -> Any:
        count, seen = new.shape[1], positions.shape[1]
        cache[:, seen - count : seen].copy_(torch.tanh(new) + positions[:, -count:, None])
        return cache[:, :seen].sum(1)


def _grow(state: np.ndarray, length: int) -> np.ndarray:
    """A longer buffer holding ``state``'s rows, the new rows garbage (as the app grows it)."""
    grown = np.full((state.shape[0], length, state.shape[2]), np.nan, state.dtype)
    grown[:, : state.shape[1]] = state
    return grown


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_state_written_at_a_runtime_offset(dtype: torch.dtype) -> None:
    from coreai.runtime import NDArray

    from coreai_torch.runtime import Session, to_numpy

    model = GrowingCache()
    capacity = Dim("capacity", min=2, max=128)
    example = (
        torch.randn(1, 3, 4),
        torch.arange(5, dtype=torch.int32)[None],
        torch.zeros(1, 8, 4, dtype=dtype),
    )
    ep = export_decomposed(
        model, example, dynamic_shapes=({1: NEW}, {1: SEEN}, {1: capacity}), strict=False
    )
    program = TorchConverter().add_exported_program(ep).to_coreai().optimize()
    assert "tensor<1x?x4x" in str(program)
    state_name = program.signatures["main"].states[0].name

    eager = torch.full((1, 4, 4), float("nan"), dtype=dtype)  # garbage never read
    runtime = to_numpy(NDArray(eager.numpy().copy()))
    seen = 0
    # prefill 3, decode 1, a rewrite of the last position (prefix reuse), then past two growths
    steps = [(3, 0), (1, 0), (1, -1), (6, 0), (9, 0)]
    with Session(program, verify_hash=False) as session:
        for count, rewind in steps:
            seen += rewind
            total = seen + count
            if total > eager.shape[1]:  # grow both as the app does: copy, garbage after
                length = max(total, 2 * eager.shape[1])
                eager = torch.from_numpy(_grow(eager.numpy(), length))
                runtime = _grow(runtime, length)
            new = torch.randn(1, count, 4)
            positions = torch.arange(total, dtype=torch.int32)[None]
            expected = model(new, positions, eager)
            state = {state_name: NDArray(np.ascontiguousarray(runtime))}
            out = session.run({"new": new.numpy(), "positions": positions.numpy()}, state=state)
            runtime = to_numpy(state[state_name]).copy()
            (actual,) = out.values()
            tolerance = 1e-5 if dtype == torch.float32 else 2e-2
            np.testing.assert_allclose(
                actual, expected.float().numpy(), rtol=tolerance, atol=tolerance
            )
            np.testing.assert_allclose(
                runtime[:, :total].astype(np.float32),
                eager[:, :total].float().numpy(),
                rtol=tolerance,
                atol=tolerance,
            )
            seen = total
