"""``save_asset`` streams the asset (hashed on the way, transposed weights made as they are
written) and writes exactly what coreai-core's ``save_asset`` writes."""

from __future__ import annotations

import contextlib
import copy
import errno
import fcntl
import hashlib
import json
import os
import shutil
import signal
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
import torch.nn as nn

from coreai_torch import TorchConverter, progress
from coreai_torch._mlir import ca
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.ir import saving
from coreai_torch.ir.bytecode import BytecodeFormatError, rewrite_blobs
from coreai_torch.passes import pipeline
from coreai_torch.program import AIProgram
from coreai_torch.runtime import Session
from coreai_torch.verify import eager_outputs, run_entrypoint


@pytest.fixture(autouse=True)
def _stream_small_programs_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(saving, "STREAM_MIN_BYTES", 0)
    monkeypatch.setattr(saving, "DIRECT_MIN_BYTES", 0)


class TiedLM(nn.Module):
    """Embedding, MLP and an output projection tied to the embedding (stored transposed)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(300, 64)
        self.up = nn.Linear(64, 256)
        self.down = nn.Linear(256, 64, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.down(torch.relu(self.up(h)))
        return h @ self.embed.weight.t()


Case = tuple[AIProgram, nn.Module, tuple[torch.Tensor, ...]]


def _convert(model: nn.Module, *args: torch.Tensor) -> Case:
    ep = export_decomposed(model.eval(), args)
    return TorchConverter().add_exported_program(ep).to_coreai(), model, args


def _mlp() -> Case:
    return _convert(
        nn.Sequential(nn.Linear(96, 200), nn.ReLU(), nn.Linear(200, 48)), torch.randn(3, 96)
    )


def _tied() -> Case:
    return _convert(TiedLM(), torch.randint(0, 300, (2, 7)))


def _two_entry_points() -> Case:
    """Prefill- and decode-shaped entry points sharing every weight."""
    model = nn.Sequential(nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 64)).eval()
    converter = TorchConverter()
    for name, rows in (("main", 8), ("decode", 1)):
        ep = export_decomposed(model, (torch.randn(rows, 128),))
        converter.add_exported_program(ep, entrypoint_name=name)
    return converter.to_coreai(), model, (torch.randn(8, 128),)


def _half() -> Case:
    model = nn.Sequential(nn.Linear(64, 80), nn.ReLU(), nn.Linear(80, 32)).to(torch.bfloat16)
    return _convert(model, torch.randn(4, 64, dtype=torch.bfloat16))


PROGRAMS = {"mlp": _mlp, "tied": _tied, "two_entry_points": _two_entry_points, "bf16": _half}


@contextlib.contextmanager
def _children_reaped() -> Iterator[None]:
    """The block leaves no child process behind (the serializer is always reaped)."""
    before = {c.pid for c in psutil.Process().children()}
    yield
    assert {c.pid for c in psutil.Process().children()} == before


def _metadata(asset: Path) -> dict:
    data = json.loads((asset / "metadata.json").read_text())
    data.pop("creationDate")
    return data


def _assert_same_asset(ours: Path, reference: Path) -> None:
    bytecode = (ours / "main.mlirb").read_bytes()
    assert bytecode == (reference / "main.mlirb").read_bytes()
    assert (ours / "main.hash").read_bytes() == hashlib.sha256(bytecode).digest()
    assert (ours / "main.hash").read_bytes() == (reference / "main.hash").read_bytes()
    assert _metadata(ours) == _metadata(reference)
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in reference.iterdir())


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_streamed_asset_is_byte_identical_to_coreai_core_and_runs(
    name: str, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    program, model, args = PROGRAMS[name]()
    program.optimize()
    assert program.weights is not None and program.weights.pending  # transposes deferred
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fall-back
        program.save_asset(tmp_path / "ours.aimodel")
    assert saving.last_stats.streamed
    assert program.weights.pending  # made in the stream, never held in memory

    # coreai-core's own save_asset of the same program (its weights made in memory first)
    ca.AIProgram.save_asset(program, tmp_path / "core.aimodel")
    assert not program.weights.pending
    _assert_same_asset(tmp_path / "ours.aimodel", tmp_path / "core.aimodel")

    # coreai-core's loader reads it; the runtime runs it and matches PyTorch
    summary = ca.AIModelAsset.load(tmp_path / "ours.aimodel").summary(include_statistics=False)
    assert list(summary.function_names) == program.function_names
    expected = eager_outputs(model, args)
    with Session(tmp_path / "ours.aimodel") as session:
        actual = run_entrypoint(session, program, args)
    for e, a in zip(expected, actual, strict=True):
        np.testing.assert_allclose(
            np.asarray(a, dtype=np.float32),
            e.float().numpy(),
            atol=2e-2 if name == "bf16" else 1e-4,
        )


def test_in_process_save_writes_the_same_asset(tmp_path: Path) -> None:
    program, _, _ = _tied()
    program.optimize()
    program.save_asset(tmp_path / "streamed.aimodel")
    module = program.structural_module
    saving.save_program(
        module, tmp_path / "in_process.aimodel", weights=program.weights, streaming=False
    )
    assert not saving.last_stats.streamed
    _assert_same_asset(tmp_path / "streamed.aimodel", tmp_path / "in_process.aimodel")


def test_reading_the_module_makes_the_transposed_weights_first() -> None:
    program, model, args = _mlp()
    program.optimize()
    store = program.weights
    assert store is not None
    pending = list(store.pending.values())
    assert pending and all(
        not torch.equal(p.placeholder, p.view) for p in pending
    )  # placeholders, until ...
    assert "dense_resource" in program.to_mlir()  # (structure only: still deferred)
    assert store.pending
    _ = program.mlir_module  # ... anything may read the constants' data through MLIR
    assert not store.pending
    assert all(torch.equal(p.placeholder, p.view) for p in pending)
    copy_ = copy.deepcopy(program)  # a copy shares the weights and saves them right
    with Session(copy_) as session:
        actual = run_entrypoint(session, copy_, args)
    np.testing.assert_allclose(actual[0], eager_outputs(model, args)[0].numpy(), atol=1e-4)


def test_a_copy_made_before_saving_saves_the_transposed_weights(tmp_path: Path) -> None:
    program, _, _ = _mlp()
    program.optimize()
    duplicate = copy.deepcopy(program)
    assert duplicate.weights is program.weights and program.weights.pending
    duplicate.save_asset(tmp_path / "copy.aimodel")
    program.save_asset(tmp_path / "original.aimodel")
    _assert_same_asset(tmp_path / "copy.aimodel", tmp_path / "original.aimodel")


def test_a_serializer_that_dies_is_a_clean_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    program, _, _ = _mlp()
    program.optimize()
    monkeypatch.setattr(saving, "_serialize_child", lambda *a: os._exit(3))
    with _children_reaped(), pytest.raises(RuntimeError, match=r"persist mlasset.*exited"):
        program.save_asset(tmp_path / "dead.aimodel")
    assert not (tmp_path / "dead.aimodel").exists()  # reaped


def test_an_error_while_streaming_stops_the_serializer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    program, _, _ = _mlp()
    program.optimize()

    def fail(self: object, source: object, size: int) -> bool:
        raise ValueError("disk on fire")

    monkeypatch.setattr(saving._PendingWriter, "__call__", fail)
    with _children_reaped(), pytest.raises(RuntimeError, match="disk on fire"):
        program.save_asset(tmp_path / "broken.aimodel")
    assert not (tmp_path / "broken.aimodel").exists()


def test_an_unexpected_stream_falls_back_to_saving_in_process(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    program, _, _ = _tied()
    program.optimize()
    program.save_asset(tmp_path / "reference.aimodel")

    def odd(source: object, replace: object) -> None:
        raise BytecodeFormatError("a section this reader does not know")

    monkeypatch.setattr(saving, "rewrite_blobs", odd)
    with pytest.warns(RuntimeWarning, match="saving it in process"):
        program.save_asset(tmp_path / "fallback.aimodel")
    _assert_same_asset(tmp_path / "fallback.aimodel", tmp_path / "reference.aimodel")


class _Recorder:
    """A ``Source`` over bytes that records the blobs it is asked to replace."""

    def __init__(self, data: bytes) -> None:
        self.data, self.position, self.out = data, 0, bytearray()

    def peek(self, count: int) -> bytes:
        return self.data[self.position : self.position + count]

    def take(self, count: int) -> bytes:
        chunk = self.peek(count)
        assert len(chunk) == count
        self.out += chunk
        self.position += count
        return chunk

    def copy(self, count: int) -> None:
        self.take(count)

    def at_end(self) -> bool:
        return self.position >= len(self.data)


def test_the_bytecode_reader_finds_every_weight_blob(tmp_path: Path) -> None:
    program, _, _ = _tied()
    program.optimize(transpose_weights=False)
    program.save_asset(tmp_path / "m.aimodel")
    data = (tmp_path / "m.aimodel" / "main.mlirb").read_bytes()
    source = _Recorder(data)
    blobs: list[bytes] = []

    def record(src: _Recorder, size: int) -> bool:
        blobs.append(src.peek(size))
        return False

    rewrite_blobs(source, record)
    assert bytes(source.out) == data  # everything forwarded, in order
    assert program.weights is not None
    weights = {t.detach().contiguous().numpy().tobytes() for t in program.weights.by_name.values()}
    assert weights <= set(blobs)
    with pytest.raises(BytecodeFormatError):
        rewrite_blobs(_Recorder(b"not bytecode"), record)


def test_progress_of_optimize_and_save(tmp_path: Path) -> None:
    events: list[tuple[str, int, int]] = []
    program, _, _ = _tied()
    with progress.track(lambda *event: events.append(event)):
        program.optimize().save_asset(tmp_path / "m.aimodel")
    optimize = [e for e in events if e[0] == "optimize"]
    save = [e for e in events if e[0] == "save"]
    steps = len(pipeline.OPTIMIZE)  # one step per pass
    assert optimize[0] == ("optimize", 0, steps) and optimize[-1] == ("optimize", steps, steps)
    size = (tmp_path / "m.aimodel" / "main.mlirb").stat().st_size
    assert save[-1] == ("save", size, size)

    from rich.console import Console

    out = __import__("io").StringIO()
    program.progress = progress.RichProgress(console=Console(file=out, width=100))
    program.save_asset(tmp_path / "m.aimodel")
    assert f"{size / 1e3:.1f}/{size / 1e3:.1f} KB" in out.getvalue()


def test_a_serializer_that_hangs_is_given_up(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    program, _, _ = _mlp()
    program.optimize()
    program.save_asset(tmp_path / "reference.aimodel")
    monkeypatch.setattr(saving, "_serialize_child", lambda *a: time.sleep(60))
    monkeypatch.setattr(saving, "STALL_SECONDS", 0.5)
    start = time.monotonic()
    with _children_reaped(), pytest.warns(RuntimeWarning, match="no progress for 0.5 s"):
        program.save_asset(tmp_path / "hung.aimodel")
    assert time.monotonic() - start < 20  # not the minute the child sleeps
    _assert_same_asset(tmp_path / "hung.aimodel", tmp_path / "reference.aimodel")


def test_a_serializer_busy_before_its_first_byte_is_waited_for(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Writing nothing for longer than ``STALL_SECONDS`` is no stall while the child runs (as
    it does when cloning a large module before its first byte)."""
    program, _, _ = _mlp()
    program.optimize()
    program.save_asset(tmp_path / "reference.aimodel")
    serialize = saving._serialize_child

    def busy_first(*args: object) -> None:
        end = time.process_time() + 1.5  # CPU seconds: three stall limits, however loaded
        while time.process_time() < end:
            pass
        serialize(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(saving, "_serialize_child", busy_first)
    monkeypatch.setattr(saving, "STALL_SECONDS", 0.5)
    with _children_reaped(), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fall-back
        program.save_asset(tmp_path / "busy.aimodel")
    assert saving.last_stats.streamed
    _assert_same_asset(tmp_path / "busy.aimodel", tmp_path / "reference.aimodel")


def test_a_file_system_that_refuses_direct_io_is_written_buffered(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    program, _, _ = _tied()
    program.optimize()
    program.save_asset(tmp_path / "reference.aimodel")
    write, refused = os.write, []

    def no_direct_io(fd: int, data: memoryview) -> int:
        if os.O_DIRECT & fcntl.fcntl(fd, fcntl.F_GETFL):
            refused.append(len(data))
            raise OSError(errno.EINVAL, "Invalid argument")
        return write(fd, data)

    monkeypatch.setattr(saving.os, "write", no_direct_io)
    program.save_asset(tmp_path / "buffered.aimodel")
    monkeypatch.undo()
    assert refused  # direct I/O was tried, refused, and the asset written buffered
    _assert_same_asset(tmp_path / "buffered.aimodel", tmp_path / "reference.aimodel")


def test_a_full_disk_names_the_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    program, _, _ = _mlp()
    program.optimize()
    write = os.write

    def full(fd: int, data: memoryview) -> int:
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")) == "main.mlirb":
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(fd, data)

    monkeypatch.setattr(saving.os, "write", full)
    with _children_reaped(), pytest.raises(OSError, match=r"could not write '.*full.aimodel'"):
        program.save_asset(tmp_path / "full.aimodel")
    assert not (tmp_path / "full.aimodel").exists()


def test_an_asset_larger_than_the_free_space_is_refused_before_writing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    program, _, _ = _mlp()
    program.optimize()
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(
        saving.shutil, "disk_usage", lambda path: usage._replace(free=saving.SPACE_MARGIN)
    )
    with pytest.raises(OSError, match=r"no room for the asset: it needs about .* GiB.*tight"):
        program.save_asset(tmp_path / "tight.aimodel")
    assert not (tmp_path / "tight.aimodel").exists()


def test_a_smaller_asset_is_streamed_through_the_page_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    program, _, _ = _tied()
    program.optimize()
    program.save_asset(tmp_path / "direct.aimodel")
    monkeypatch.setattr(saving, "DIRECT_MIN_BYTES", 1 << 40)
    program.save_asset(tmp_path / "buffered.aimodel")
    assert saving.last_stats.streamed
    _assert_same_asset(tmp_path / "buffered.aimodel", tmp_path / "direct.aimodel")


def _serialize_ahead(module: object, out_fd: int, status_fd: int, version: int) -> None:
    """A serializer child that writes coreai-core's whole output at once, then stays until it
    has been paused and resumed: the reader's flow control runs whatever the machine's pace."""
    code, message = 1, b"the test serializer failed"
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCONT})
        scratch = os.memfd_create("scratch")
        saving.serialize(module, f"/dev/fd/{scratch}", version)  # type: ignore[arg-type]
        data = memoryview(os.pread(scratch, os.fstat(scratch).st_size, 0))
        while data:
            data = data[os.write(out_fd, data) :]
        if signal.sigtimedwait({signal.SIGCONT}, 60) is not None:
            code, message = 0, saving._OK
    finally:
        os.write(status_fd, message)
        os._exit(code)


def test_a_large_asset_streams_through_every_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The limits of a multi-GB save, scaled down to a 5 MB model with weights stored
    transposed: many chunks, reused; rows across two chunks and rows larger than a chunk;
    the serializer paused and resumed; its output freed as it is read; direct I/O."""
    chunk = 32 << 10
    for name, value in (
        ("STREAM_MIN_BYTES", 1 << 20),
        ("DIRECT_MIN_BYTES", 1 << 20),
        ("CHUNK_BYTES", chunk),
        ("CHUNKS_IN_FLIGHT", 3),
        ("_AHEAD_BYTES", 256 << 10),
        ("_RELEASE_BYTES", 64 << 10),
    ):
        monkeypatch.setattr(saving, name, value)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 9000), nn.ReLU(), nn.Linear(9000, 100))
    program, _, args = _convert(model, torch.randn(2, 48))
    program.optimize()
    assert program.weights is not None
    rows = sorted(entry.row_bytes for entry in program.weights.pending.values())
    assert rows[0] < chunk and chunk % rows[0] and rows[-1] > chunk  # both kinds of crossing

    signals: list[int] = []
    held: list[int] = []
    sinks: list[saving._Sink] = []
    send, release_loop = saving._Serializer._signal, saving._Serializer._release_loop

    def record_signal(self: saving._Serializer, number: int) -> None:
        signals.append(number)
        send(self, number)

    def record_held(self: saving._Serializer) -> None:
        release_loop(self)  # every release done: what the output still holds
        held.append(os.fstat(self.fd).st_blocks * 512)

    class Sink(saving._Sink):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            self.direct_at_start = self.direct
            sinks.append(self)

    monkeypatch.setattr(saving._Serializer, "_signal", record_signal)
    monkeypatch.setattr(saving._Serializer, "_release_loop", record_held)
    monkeypatch.setattr(saving, "_Sink", Sink)
    monkeypatch.setattr(saving, "_serialize_child", _serialize_ahead)
    with _children_reaped(), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fall-back
        program.save_asset(tmp_path / "ours.aimodel")
    assert saving.last_stats.streamed and program.weights.pending  # made in the stream

    size = (tmp_path / "ours.aimodel" / "main.mlirb").stat().st_size
    (sink,) = sinks
    assert sink.written == size and size > 5_000_000
    assert sink._chunks == 3  # ~160 chunks through three buffers
    assert sink.direct_at_start == _direct_io_supported(tmp_path)
    assert signals[:2] == [signal.SIGSTOP, signal.SIGCONT]  # paused, resumed
    assert held and held[-1] < size // 2  # freed as read (no more than a huge page left)

    ca.AIProgram.save_asset(program, tmp_path / "core.aimodel")
    _assert_same_asset(tmp_path / "ours.aimodel", tmp_path / "core.aimodel")
    with Session(tmp_path / "ours.aimodel") as session:
        (actual,) = run_entrypoint(session, program, args)
    np.testing.assert_allclose(actual, model(*args).detach().numpy(), rtol=1e-4, atol=1e-4)


def _direct_io_supported(directory: Path) -> bool:
    fd = os.open(directory / "probe", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        return saving._direct_io(fd)
    finally:
        os.close(fd)
