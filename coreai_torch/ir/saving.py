"""Saving a program as a Core AI asset in one pass over its bytes, at about disk speed.

The asset is what coreai-core's ``AIProgram.save_asset`` writes, byte for byte: the program's
bytecode (coreai-core's own serializer), its SHA-256 and the metadata.  Three things differ,
for large models:

* the bytecode is hashed while it is written, not read back whole into memory;
* weights stored transposed (``WeightStore.transposed``) are transposed into the stream as it
  passes, block by block, instead of being held as a second copy of the weights, and lazy
  weights (:mod:`coreai_torch.tensors.lazy`) are read from their checkpoint there;
* hashing, writing and transposing run beside the serializer, on the other core, and an
  asset of 1 GiB or more is written with direct I/O where the file system allows it (no
  page-cache copy: little CPU, and the data is on the disk when ``save_asset`` returns).

coreai-core's serializer holds the GIL and writes to a seekable file.  So it runs in a forked
child (which shares the parent's memory: the weights are not copied) and writes into an
in-memory file, while this process reads it right behind the child, freeing what it has read
(the child is paused when it gets 128 MB ahead), parses the stream's framing
(:mod:`coreai_torch.ir.bytecode`), replaces the placeholders of pending weights by their data,
and hands the bytes to a hashing and a writing thread.  Where ``fork`` is not available (or
not safe: macOS), :func:`save_in_process` makes the pending weights first and hashes the
written file in chunks.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import mmap
import os
import queue
import shutil
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from coreai.authoring import asset as core_asset
from coreai.runtime import _AIModelAsset

from coreai_torch._mlir import ca, clone_module, ir, serialize_module_to_bytecode
from coreai_torch.ir.bytecode import BytecodeFormatError, Source, TruncatedBytecode, rewrite_blobs
from coreai_torch.ir.weights import TAG_BYTES, PendingData, WeightStore, referenced_resources

#: coreai-core's bytecode version (``coreai.authoring.asset._CURRENT_BYTECODE_VERSION``)
BYTECODE_VERSION = 6
#: Bytes handed to the hashing and writing threads at a time, and how many are in flight.
CHUNK_BYTES = 8 << 20
CHUNKS_IN_FLIGHT = 6
#: The child is paused while this much of its output waits to be read (then memory).
_AHEAD_BYTES = 128 << 20
#: Programs with fewer weight bytes are saved in process: forking costs ~50 ms, and their
#: transposed weights are cheap to hold.
STREAM_MIN_BYTES = 64 << 20
#: Assets of at least this size are written with direct I/O: it spares the CPU a copy per byte,
#: but waits for the disk, where smaller ones return once in the page cache.
DIRECT_MIN_BYTES = 1 << 30
#: A serializer that neither writes nor runs (no CPU time, no page faults) for this long is
#: given up, and the asset saved in process: a child stuck on a lock that another thread held
#: at the fork, say.  One that is busy (cloning a large module before its first byte, on a
#: loaded machine) is waited for.
STALL_SECONDS = 10.0
#: Without the child's activity (no ``/proc``), only its output counts, for this long.
BLIND_STALL_SECONDS = 600.0
#: How often the child's activity is read while it writes nothing.
_WATCH_SECONDS = 0.25
_OK = b"ok"
#: Read output is freed in steps of this size.
_RELEASE_BYTES = 8 << 20

#: ``report(done, total)``: bytes written so far and the expected total
SaveProgress = Callable[[int, int], None]


@dataclass
class SaveStats:
    """Where the time of the last :func:`save_program` of this process went."""

    streamed: bool = False
    seconds: float = 0.0
    bytes: int = 0
    #: CPU seconds of the reading/transposing thread, the hashing and writing threads, and
    #: the serializer (the forked child)
    cpu: dict[str, float] = field(default_factory=dict)
    #: most serializer output held in memory at once (freed as it is read)
    peak_buffered: int = 0

    def reset(self) -> None:
        """Back to a fresh instance's values, in place (readers hold this object)."""
        fresh = SaveStats()
        for name in vars(fresh):
            setattr(self, name, getattr(fresh, name))


#: statistics of the last save in this process (for benchmarks)
last_stats = SaveStats()


def streaming_available() -> bool:
    """Whether assets are written by a forked serializer (Linux), else in process."""
    return sys.platform.startswith("linux") and hasattr(os, "fork")


def save_program(
    module: ir.Module,
    path: Path,
    *,
    metadata: Any = None,
    minimum_os: Any = None,
    weights: WeightStore | None = None,
    progress: SaveProgress | None = None,
    streaming: bool | None = None,
) -> ca.AIModelAsset:
    """Write ``module`` as the asset directory ``path`` (replaced if it exists), as
    coreai-core's ``AIProgram.save_asset`` does; the pending data of ``weights`` is made
    on the way.  ``streaming``: through a forked serializer (default: for programs of at
    least ``STREAM_MIN_BYTES`` of weights, where available) or in process."""
    last_stats.reset()
    start = time.perf_counter()
    minimum_os = minimum_os or core_asset.OSVersion.v27
    check_free_space(path, module, weights)
    if path.exists():
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    path.mkdir(parents=True)
    asset = _AIModelAsset._create(path=str(path), metadata=metadata)
    try:
        module.operation.verify()
        dialect_version = _AIModelAsset._dialect_version_for_os(minimum_os.value)
        bytecode_path = asset._program_bytecode_path
        if streaming is None:
            large = weights is not None and weights.total_bytes >= STREAM_MIN_BYTES
            streaming = large and streaming_available()
        digest = None
        if streaming:
            try:
                digest = _save_streaming(module, bytecode_path, dialect_version, weights, progress)
            except (BytecodeFormatError, _ForkError) as error:
                warnings.warn(
                    f"save_asset: streaming the asset failed ({error}); saving it in process, "
                    "with the transposed weights in memory",
                    RuntimeWarning,
                    stacklevel=3,
                )
        if digest is None:
            digest = save_in_process(module, bytecode_path, dialect_version, weights, progress)

        def _stamp(m: Any) -> None:
            m.creation_date = time.time()
            m._producer = core_asset._COREAI_PRODUCER

        asset.update_metadata(updates=_stamp)
        asset._program_hash_path.write_bytes(digest)
        last_stats.seconds = time.perf_counter() - start
    except BaseException as error:
        shutil.rmtree(path, ignore_errors=True)
        if isinstance(error, OSError) or not isinstance(error, Exception):
            raise
        raise RuntimeError(f"failed to persist mlasset to {path}: {error}") from error
    return ca.AIModelAsset._wrap(asset)


#: room kept free beyond the asset's weights (its bytecode, metadata, the file system's own)
SPACE_MARGIN = 64 << 20


def weight_bytes(module: ir.Module, weights: WeightStore | None) -> int:
    """Bytes of the weights ``module`` references (the bulk of its asset)."""
    if weights is None:
        return 0
    names = referenced_resources(module)
    tensors = sum(t.numel() * t.element_size() for n, t in weights.by_name.items() if n in names)
    return tensors + sum(b.size for n, b in weights.derived_by_name.items() if n in names)


def check_free_space(path: Path, module: ir.Module, weights: WeightStore | None) -> None:
    """Raise ``OSError`` (``ENOSPC``) naming ``path`` when its file system has less room than
    the asset's weights need, before anything is written (an asset that replaces another
    counts the room the old one frees)."""
    needed = weight_bytes(module, weights) + SPACE_MARGIN
    free = free_space(path)
    if path.is_dir():
        free += sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    if free < needed:
        raise OSError(
            errno.ENOSPC,
            f"no room for the asset: it needs about {needed / 2**30:.2f} GiB and the file "
            f"system of '{path}' has {free / 2**30:.2f} GiB free; free some space or save "
            "it elsewhere",
        )


def free_space(path: Path) -> int:
    """Bytes free on the file system of ``path`` (of its nearest existing parent)."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return shutil.disk_usage(existing).free


def save_in_process(
    module: ir.Module,
    bytecode_path: Path,
    dialect_version: int,
    weights: WeightStore | None,
    progress: SaveProgress | None = None,
) -> bytes:
    """coreai-core's way, without its whole-file read: make the pending data, serialize
    to the file, hash it in chunks.  Returns the SHA-256."""
    if weights is not None:
        weights.materialize(referenced_resources(module))
    serialize(module, bytecode_path, dialect_version)
    digest = hashlib.sha256()
    size = bytecode_path.stat().st_size
    with open(bytecode_path, "rb") as file:
        while block := file.read(CHUNK_BYTES):
            digest.update(block)
    if progress is not None:
        progress(size, size)
    return digest.digest()


# ------------------------------------------------------------------------- the serializer ---


def serialize(module: ir.Module, path: Path | str, dialect_version: int) -> None:
    """coreai-core's serializer: ``module``'s bytecode into the file ``path``."""
    serialize_module_to_bytecode(
        module=clone_module(module=module),
        package_path=path,
        dialect_version=dialect_version,
        bytecode_version=BYTECODE_VERSION,
    )


class _ForkError(RuntimeError):
    """The serializer could not be started in a child process."""


@contextlib.contextmanager
def _single_threaded_mlir(context: ir.Context) -> Iterator[None]:
    """No MLIR worker threads while forking: the child has none, and would wait on them."""
    threaded = context.get_num_threads() > 1
    if threaded:
        context.enable_multithreading(False)
    try:
        yield
    finally:
        if threaded:
            context.enable_multithreading(True)


def _libc() -> Any:
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _serialize_child(module: ir.Module, out_fd: int, status_fd: int, version: int) -> None:
    """In the forked child: serialize into ``out_fd``, report ("ok" or the error), exit."""
    code, message = 0, _OK
    try:
        parent = os.getppid()
        _libc().prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: do not outlive the parent
        if os.getppid() != parent:
            os._exit(1)
        serialize(module, f"/dev/fd/{out_fd}", version)
    except BaseException as error:
        code, message = 1, f"{type(error).__name__}: {error}".encode(errors="replace")
    with contextlib.suppress(BaseException):
        os.write(status_fd, message[:4096])
    os._exit(code)


class _Serializer:
    """coreai-core's serializer in a forked child, writing the bytecode into an in-memory file
    (it needs a seekable file, so not a pipe) that this process reads and frees as it goes."""

    def __init__(self, module: ir.Module, dialect_version: int) -> None:
        try:
            self.fd = os.memfd_create("coreai-torch-bytecode", os.MFD_CLOEXEC)
        except (AttributeError, OSError) as error:
            raise _ForkError(f"no in-memory file: {error}") from error
        status_read, status_write = os.pipe()
        try:
            with _single_threaded_mlir(module.context), warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads
                pid = os.fork()
        except OSError as error:
            for fd in (self.fd, status_read, status_write):
                os.close(fd)
            raise _ForkError(f"fork failed: {error}") from error
        if pid == 0:
            os.close(status_read)
            _serialize_child(module, self.fd, status_write, dialect_version)
        os.close(status_write)
        self.pid, self.status_fd = pid, status_read
        self.exit_status: int | None = None
        self.stopped = False
        self._fallocate = _libc().fallocate
        #: byte ranges to free, handled by a thread: freeing waits for the child's writes
        self._to_release: queue.Queue[tuple[int, int] | None] = queue.Queue()
        self._releaser = threading.Thread(target=self._release_loop, daemon=True)
        self._releaser.start()

    def running(self) -> bool:
        if self.exit_status is None:
            try:
                pid, status, usage = os.wait4(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else (SIGCHLD ignored)
                pid, status, usage = self.pid, -1, None
            if pid:
                self._reaped(status, usage)
        return self.exit_status is None

    def _reaped(self, status: int, usage: Any) -> None:
        self.exit_status = status
        if usage is not None:
            last_stats.cpu["serializer"] = usage.ru_utime + usage.ru_stime

    def written(self) -> int:
        info = os.fstat(self.fd)
        last_stats.peak_buffered = max(last_stats.peak_buffered, info.st_blocks * 512)
        return info.st_size

    def pace(self, unread: int, wanted: int) -> None:
        """Flow control: stop the child while more than ``_AHEAD_BYTES`` wait to be read, until
        a quarter of them are read (or the reader wants more than there is)."""
        if not self.stopped and unread > _AHEAD_BYTES and unread >= wanted and self.running():
            self._signal(signal.SIGSTOP)
            self.stopped = True
        elif self.stopped and (unread <= _AHEAD_BYTES * 3 // 4 or unread < wanted):
            self._signal(signal.SIGCONT)
            self.stopped = False

    def activity(self) -> tuple[int, ...] | None:
        """Counters that grow while the child runs: its page faults and CPU ticks (None if
        they cannot be read)."""
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as file:
                stat = file.read()
        except OSError:
            return None
        fields = stat[stat.rindex(b")") + 2 :].split()
        # minflt, majflt, utime, stime: fields 10, 12, 14 and 15 of proc_pid_stat(5)
        return tuple(int(fields[i]) for i in (7, 9, 11, 12))

    def _signal(self, number: int) -> None:
        if self.exit_status is None:  # not reaped yet (a zombie takes signals harmlessly)
            os.kill(self.pid, number)

    def release(self, start: int, stop: int) -> None:
        """Free (soon) the memory of bytes ``start .. stop``, read already."""
        start, stop = start - start % mmap.PAGESIZE, stop - stop % mmap.PAGESIZE
        if stop > start:
            self._to_release.put((start, stop))

    def _release_loop(self) -> None:
        import ctypes

        while (span := self._to_release.get()) is not None:
            start, stop = span
            # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
            self._fallocate(self.fd, 3, ctypes.c_int64(start), ctypes.c_int64(stop - start))

    def finish(self, *, abandon: bool = False) -> str | None:
        """Reap the child; its error message if it failed.  ``abandon``: the output is not
        read to its end, so the child is killed (and its own error not reported)."""
        if abandon and self.running():
            self._signal(signal.SIGKILL)
        elif self.stopped:
            self._signal(signal.SIGCONT)
        if self.exit_status is None:
            try:
                _, status, usage = os.wait4(self.pid, 0)
            except ChildProcessError:
                status, usage = -1, None
            self._reaped(status, usage)
        self._to_release.put(None)
        self._releaser.join()
        message = os.read(self.status_fd, 4096)
        os.close(self.status_fd)
        os.close(self.fd)
        if abandon or message == _OK:
            return None
        return message.decode(errors="replace") or (
            f"the serializer exited with status {self.exit_status}"
        )


# --------------------------------------------------------------------------- the writing ---


class _Chunk:
    __slots__ = ("buffer", "size", "users")

    def __init__(self, buffer: mmap.mmap, size: int) -> None:
        self.buffer, self.size, self.users = buffer, size, 2


def _direct_io(fd: int) -> bool:
    """Switch ``fd`` to direct I/O (no page-cache copy: a fraction of the CPU of a buffered
    write, and nothing left to flush); False where the file system does not support it."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    import fcntl

    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | flag)
    except OSError:
        return False
    return True


def _buffered_io(fd: int) -> None:
    import fcntl

    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)


class _Sink:
    """Bytes in order, hashed by one thread and written by another, in chunks of
    ``CHUNK_BYTES`` (page-aligned, reused): every chunk but the last is full, so the file is
    written with direct I/O where possible."""

    def __init__(self, fd: int, progress: SaveProgress | None, total: int) -> None:
        self.fd = fd
        self.direct = total >= DIRECT_MIN_BYTES and _direct_io(fd)
        self.digest = hashlib.sha256()
        self.written = 0
        self.error: BaseException | None = None
        self._progress, self._total = progress, total
        self._free: queue.Queue[mmap.mmap] = queue.Queue()
        self._chunks = 0  # allocated so far (on demand, up to CHUNKS_IN_FLIGHT)
        self._lock = threading.Lock()
        self._current: mmap.mmap | None = None
        self._used = 0
        self._queues: list[queue.Queue[_Chunk | None]] = [queue.Queue(), queue.Queue()]
        self._threads = [
            threading.Thread(target=self._run, args=(q, work), daemon=True)
            for q, work in zip(self._queues, (self._hash, self._write), strict=True)
        ]
        for thread in self._threads:
            thread.start()

    def _hash(self, chunk: _Chunk) -> None:
        self.digest.update(memoryview(chunk.buffer)[: chunk.size])

    def _write(self, chunk: _Chunk) -> None:
        view = memoryview(chunk.buffer)[: chunk.size]
        if self.direct and chunk.size % mmap.PAGESIZE:  # the last chunk: its tail buffered
            aligned = chunk.size - chunk.size % mmap.PAGESIZE
            self._write_all(view[:aligned])
            _buffered_io(self.fd)
            self.direct = False
            view = view[aligned:]
        self._write_all(view)

    def _write_all(self, view: memoryview) -> None:
        while view:
            try:
                view = view[os.write(self.fd, view) :]
            except OSError as error:
                if not (self.direct and error.errno == errno.EINVAL):
                    raise
                _buffered_io(self.fd)  # direct I/O refused after all: write buffered
                self.direct = False

    def _run(self, jobs: queue.Queue[_Chunk | None], work: Callable[[_Chunk], None]) -> None:
        try:
            self._loop(jobs, work)
        finally:
            last_stats.cpu[work.__name__.strip("_")] = time.thread_time()

    def _loop(self, jobs: queue.Queue[_Chunk | None], work: Callable[[_Chunk], None]) -> None:
        while (chunk := jobs.get()) is not None:
            try:
                if self.error is None:
                    work(chunk)
            except BaseException as error:
                self.error = error
            with self._lock:
                chunk.users -= 1
                if chunk.users == 0:
                    self._free.put(chunk.buffer)

    def room(self, size: int) -> memoryview:
        """The free part of the current chunk, at most ``size`` bytes (at least one):
        fill a prefix of it and :meth:`commit` that."""
        if self.error is not None:
            raise self.error
        if self._current is None:
            self._current, self._used = self._next_chunk(), 0
        return memoryview(self._current)[self._used : min(CHUNK_BYTES, self._used + size)]

    def _next_chunk(self) -> mmap.mmap:
        if self._chunks < CHUNKS_IN_FLIGHT and self._free.empty():
            self._chunks += 1
            return mmap.mmap(-1, CHUNK_BYTES)
        return self._free.get()

    def commit(self, size: int) -> None:
        self._used += size
        if self._used == CHUNK_BYTES:
            self._submit()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view:
            room = self.room(len(view))
            room[:] = view[: len(room)]
            self.commit(len(room))
            view = view[len(room) :]

    def _submit(self) -> None:
        if self._current is None:
            return
        chunk = _Chunk(self._current, self._used)
        self._current = None
        for jobs in self._queues:
            jobs.put(chunk)
        self.written += chunk.size
        if self._progress is not None:
            self._progress(self.written, max(self._total, self.written))

    def close(self) -> bytes:
        """Flush, stop the threads; the SHA-256 of everything written."""
        self._submit()
        for jobs in self._queues:
            jobs.put(None)
        for thread in self._threads:
            thread.join()
        if self.error is not None:
            raise self.error
        return self.digest.digest()

    def abort(self) -> None:
        self.error = self.error or RuntimeError("aborted")
        for jobs in self._queues:
            jobs.put(None)
        for thread in self._threads:
            thread.join()


class _Watchdog:
    """Gives up on a serializer that makes no progress while it is waited for: no output and
    no activity for ``STALL_SECONDS``."""

    def __init__(self, serializer: _Serializer) -> None:
        self.serializer = serializer
        self.since = self.checked = time.monotonic()
        self.seen: tuple[int, tuple[int, ...] | None] | None = None

    def check(self, written: int) -> None:
        now = time.monotonic()
        if now - self.checked < min(_WATCH_SECONDS, STALL_SECONDS / 4):
            return
        self.checked = now
        state = (written, self.serializer.activity())
        if state != self.seen:
            self.seen, self.since = state, now
            return
        limit = STALL_SECONDS if state[1] is not None else BLIND_STALL_SECONDS
        if now - self.since > limit:
            raise _ForkError(f"the serializer made no progress for {limit:g} s")


class _ChildOutput(Source):
    """The serializer's output, read once as the child writes it; what is consumed goes to the
    sink (or is dropped) and its memory is freed."""

    def __init__(self, serializer: _Serializer, sink: _Sink) -> None:
        self.serializer, self.sink = serializer, sink
        self.position = 0
        self._head = bytearray()
        self._released = 0

    def _available(self, wanted: int) -> int:
        """Bytes written and not read (waits for at least ``wanted``, or the child's end)."""
        child = self.serializer
        watch: _Watchdog | None = None
        while True:
            running = child.running()  # before the size: once it has exited, the size is final
            written = child.written()
            unread = written - self.position - len(self._head)
            child.pace(unread, wanted)
            if unread >= wanted or not running:
                return unread
            watch = watch or _Watchdog(child)
            watch.check(written)
            time.sleep(0.0005)

    def _fill(self, count: int) -> None:
        while len(self._head) < count:
            unread = self._available(count - len(self._head))
            if unread <= 0:
                return
            data = os.pread(
                self.serializer.fd, min(unread, max(count, 4096)), self.position + len(self._head)
            )
            self._head += data

    def _advance(self, count: int) -> None:
        self.position += count
        if self.position - self._released >= _RELEASE_BYTES:
            self.serializer.release(self._released, self.position)
            self._released = self.position - self.position % mmap.PAGESIZE

    def peek(self, count: int) -> bytes:
        self._fill(count)
        return bytes(self._head[:count])

    def take(self, count: int) -> bytes:
        self._fill(count)
        if len(self._head) < count:
            raise TruncatedBytecode("the bytecode stream ends early")
        data = bytes(self._head[:count])
        del self._head[:count]
        self.sink.write(data)
        self._advance(count)
        return data

    def at_end(self) -> bool:
        self._fill(1)
        return not self._head

    def copy(self, count: int) -> None:
        buffered = min(count, len(self._head))
        if buffered:
            self.sink.write(self._head[:buffered])
            del self._head[:buffered]
            self._advance(buffered)
        left = count - buffered
        while left:
            unread = self._available(1)
            if unread <= 0:
                raise TruncatedBytecode("the bytecode stream ends early")
            view = self.sink.room(min(left, unread))
            got = os.preadv(self.serializer.fd, [view], self.position)
            self.sink.commit(got)
            self._advance(got)
            left -= got

    def skip(self, count: int) -> None:
        """Consume ``count`` bytes without reading them (once written, they are freed)."""
        buffered = min(count, len(self._head))
        del self._head[:buffered]
        self._advance(buffered)
        left = count - buffered
        while left:
            unread = self._available(min(left, _RELEASE_BYTES))
            if unread <= 0:
                raise TruncatedBytecode("the bytecode stream ends early")
            step = min(left, unread)
            self._advance(step)
            left -= step


@contextlib.contextmanager
def _torch_threads(count: int) -> Iterator[None]:
    """Torch's intra-op threads set to ``count`` meanwhile (the other core hashes and writes)."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class _PendingWriter:
    """Replaces each pending resource's placeholder in the stream by its data (a transposed
    weight, a lazy tensor read from its checkpoint)."""

    def __init__(self, pending: dict[bytes, PendingData], sink: _Sink) -> None:
        self.pending, self.sink = pending, sink
        self.done: set[str] = set()

    def __call__(self, source: Source, size: int) -> bool:
        if size < TAG_BYTES or not self.pending:
            return False
        entry = self.pending.get(source.peek(TAG_BYTES))
        if entry is None:
            return False
        if entry.nbytes != size:
            raise BytecodeFormatError(f"blob of {size} bytes tagged as {entry.name}")
        assert isinstance(source, _ChildOutput)
        shape, dtype = tuple(entry.placeholder.shape[1:]), entry.placeholder.dtype
        rows, row_bytes = entry.rows, entry.row_bytes
        first = 0
        while first < rows:  # whole slices into the current chunk, one at a time across two
            room = self.sink.room((rows - first) * row_bytes)
            count = min(len(room) // row_bytes, rows - first)
            if count:
                nbytes = count * row_bytes
                out = torch.frombuffer(room[:nbytes], dtype=dtype).view(count, *shape)
                entry.fill(first, out)
                self.sink.commit(nbytes)
            else:
                count, nbytes = 1, row_bytes
                out = torch.empty((1, *shape), dtype=dtype)
                entry.fill(first, out)
                self.sink.write(out.view(torch.uint8).numpy().reshape(-1).data)
            source.skip(nbytes)
            first += count
        self.done.add(entry.name)
        return True


def _save_streaming(
    module: ir.Module,
    bytecode_path: Path,
    dialect_version: int,
    weights: WeightStore | None,
    progress: SaveProgress | None,
) -> bytes:
    """Serialize in a forked child, transpose/hash/write here.  Returns the SHA-256."""
    pending = dict(weights.pending) if weights is not None else {}
    names = referenced_resources(module)
    expected = {e.name for e in pending.values() if e.name in names}
    total = 0
    if weights is not None:
        total = sum(t.numel() * t.element_size() for n, t in weights.by_name.items() if n in names)
    fd = os.open(bytecode_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    serializer: _Serializer | None = None
    try:
        serializer = _Serializer(module, dialect_version)
        sink = _Sink(fd, progress, total)
        writer = _PendingWriter(pending, sink)
        source = _ChildOutput(serializer, sink)
        cpu = time.thread_time()
        try:
            with _torch_threads(1):
                rewrite_blobs(source, writer)
            digest = sink.close()
            last_stats.cpu["read"] = time.thread_time() - cpu
        except BaseException as error:
            sink.abort()
            truncated = isinstance(error, TruncatedBytecode)
            failure = serializer.finish(abandon=not truncated)
            serializer = None
            if failure is not None:  # the serializer failed first: that is the error
                raise RuntimeError(failure) from error
            raise
        failure, serializer = serializer.finish(), None
        if failure is not None:
            raise RuntimeError(failure)
        if writer.done != expected:
            missing = ", ".join(sorted(expected - writer.done)) or "none"
            raise BytecodeFormatError(f"pending weights not found in the stream: {missing}")
        last_stats.streamed, last_stats.bytes = True, sink.written
        return digest
    finally:
        if serializer is not None:
            serializer.finish(abandon=True)
        os.close(fd)
