"""``compress()`` of weights still in their checkpoint (``coreai_torch.tensors.lazy``): each
weight is read and fitted once, its codes wait in a temporary spill file (not in memory) until the
asset is written, and the asset is byte for byte the one the in-memory program writes.  Without
room for the spill file the codes are fitted again while the asset is written, to the same
bytes."""

from __future__ import annotations

import errno
import gc
import tempfile
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from coreai_torch import TorchConverter, compression
from coreai_torch.compression import apply, spilling
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.ir.weights import PendingDerived, SpillFile
from coreai_torch.tensors import lazy

CONFIG = compression.LinearQuantization(bits=4, block_size=32, min_elements=1024)


class _Model(nn.Module):
    """An embedding table, a linear layer stored transposed and one that is not read so."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(96, 64)
        self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.emb(ids))))


def _ids() -> torch.Tensor:
    return torch.arange(8).reshape(1, 8)


def _programs(tmp_path: Path) -> tuple[Any, Any]:
    """The program of the model converted from its bf16 checkpoint (lazy weights), and of
    the same model loaded in memory."""
    torch.manual_seed(0)
    reference = _Model()
    save_file(
        {k: v.to(torch.bfloat16) for k, v in reference.state_dict().items()},
        str(tmp_path / "model.safetensors"),
    )
    with lazy.empty_parameters():
        streamed = _Model()
    lazy.WeightSource(tmp_path).bind(streamed).eval()
    in_memory = _Model()
    in_memory.load_state_dict(load_file(str(tmp_path / "model.safetensors")))
    return _convert(streamed), _convert(in_memory.eval())


def _convert(model: nn.Module) -> Any:
    return TorchConverter().add_exported_program(export_decomposed(model, (_ids(),))).to_coreai()


@pytest.fixture
def fits(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, ...]]]:
    """The shapes of the weights linear quantization fits, one entry per fit."""
    shapes: list[tuple[int, ...]] = []
    fit: Callable[..., Any] = apply.quantize_linear

    def counted(weight: Any, *args: Any, **kwargs: Any) -> Any:
        shapes.append(tuple(weight.shape))
        return fit(weight, *args, **kwargs)

    monkeypatch.setattr(apply, "quantize_linear", counted)
    yield shapes


def _bytecode(program: Any, path: Path, **options: Any) -> bytes:
    program.save_asset(path, **options)
    return (path / "main.mlirb").read_bytes()


def _streamed_and_expected(tmp_path: Path, fits: list[tuple[int, ...]]) -> tuple[Any, bytes]:
    """The streamed program (not compressed yet) and the bytecode of the in-memory one,
    compressed; ``fits`` is cleared of the in-memory fits."""
    streamed, in_memory = _programs(tmp_path)
    in_memory.compress(CONFIG)
    expected = _bytecode(in_memory.optimize(), tmp_path / "m.aimodel")
    fits.clear()
    return streamed, expected


def _derived(program: Any) -> list[PendingDerived]:
    return [e for e in program.weights.pending.values() if isinstance(e, PendingDerived)]


def test_lazy_weights_are_fitted_once_and_their_codes_read_back_from_the_spill_file(
    tmp_path: Path, fits: list[tuple[int, ...]]
) -> None:
    streamed, in_memory = _programs(tmp_path)
    report = streamed.compress(CONFIG)
    assert sorted(w.name for w in report.weights) == ["down.weight", "emb.weight", "up.weight"]
    assert len(fits) == 3
    deferred = _derived(streamed)
    assert deferred and all(e.offset is not None for e in deferred)  # none fitted again

    streamed_bytes = _bytecode(streamed.optimize(), tmp_path / "s.aimodel", streaming=True)
    assert len(fits) == 3
    assert _bytecode(streamed, tmp_path / "again.aimodel", streaming=True) == streamed_bytes
    # saved in process, the codes are read back into their constants
    assert _bytecode(streamed, tmp_path / "in_process.aimodel", streaming=False) == streamed_bytes
    assert len(fits) == 3

    in_memory.compress(CONFIG)
    assert _bytecode(in_memory.optimize(), tmp_path / "m.aimodel") == streamed_bytes


def test_the_spill_file_is_released_with_the_program(tmp_path: Path) -> None:
    streamed, _ = _programs(tmp_path)
    streamed.compress(CONFIG)
    spill = weakref.ref(_derived(streamed)[0].recipe.spill)
    streamed.optimize()
    _bytecode(streamed, tmp_path / "s.aimodel", streaming=True)
    assert spill() is not None
    del streamed
    gc.collect()
    assert spill() is None


def test_without_room_for_the_spill_file_the_codes_are_fitted_again(
    tmp_path: Path, fits: list[tuple[int, ...]], monkeypatch: pytest.MonkeyPatch
) -> None:
    streamed, expected = _streamed_and_expected(tmp_path, fits)

    monkeypatch.setattr(spilling, "free_space", lambda path: 0)
    streamed.compress(CONFIG)
    assert all(e.offset is None for e in _derived(streamed))
    assert _bytecode(streamed.optimize(), tmp_path / "s.aimodel", streaming=True) == expected
    assert len(fits) == 6  # each weight fitted again while it was written


def test_a_spill_file_that_cannot_be_written_falls_back_to_fitting_again(
    tmp_path: Path, fits: list[tuple[int, ...]], monkeypatch: pytest.MonkeyPatch
) -> None:
    streamed, expected = _streamed_and_expected(tmp_path, fits)

    write = SpillFile.write
    written: list[int] = []

    def full_after_one(self: SpillFile, data: Any) -> int:
        if written:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(write(self, data))
        return written[-1]

    monkeypatch.setattr(SpillFile, "write", full_after_one)
    streamed.compress(CONFIG)
    offsets = [e.offset for e in _derived(streamed)]
    assert offsets.count(None) == len(offsets) - 1  # the first buffer went to the file
    assert _bytecode(streamed.optimize(), tmp_path / "s.aimodel", streaming=False) == expected
    assert len(fits) == 6


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm (tmpfs) here")
def test_codes_are_not_spilled_to_a_temporary_directory_held_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", "/dev/shm")
    if not spilling.memory_backed("/dev/shm"):
        pytest.skip("/dev/shm is not a tmpfs here")
    streamed, _ = _programs(tmp_path)
    streamed.compress(CONFIG)
    assert all(e.offset is None for e in _derived(streamed))
