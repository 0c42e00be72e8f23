"""Checking a saved Core AI asset before the Core AI runtime reads it.

coreai-core trusts the files of an ``.aimodel`` directory: a missing or truncated bytecode file
aborts the process (``SIGSEGV``/``SIGABRT`` in its bytecode reader), and a bytecode file whose
weights were damaged runs and gives wrong outputs.  :func:`check_asset` answers all of these
with :class:`~coreai_torch.errors.InvalidAssetError` before coreai-core sees the asset:

* the path exists and is a directory holding ``main.mlirb``, ``main.hash`` and
  ``metadata.json``;
* ``metadata.json`` is a JSON object whose known fields have the right types;
* the bytecode is laid out as MLIR bytecode: header, known sections each within the file, the
  resource entries (the weights) matching their offset table, nothing after the last section;
* ``main.hash`` is a SHA-256 digest and matches the bytecode (streamed in 8 MiB blocks; skip
  with ``verify_hash=False``).

What the checks cannot see (bytecode written consistently, hash included, by a faulty or
hostile tool) is caught by :func:`compile_isolated`: on Linux the program is compiled for the
runtime in a forked child process, so a crash of coreai-core's reader ends in an
``InvalidAssetError`` rather than in the death of the caller.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coreai_torch._mlir import ca
from coreai_torch.errors import AssetNotFoundError, InvalidAssetError
from coreai_torch.ir.bytecode import (
    EMPTY_BLOB,
    MAGIC,
    BytecodeFormatError,
    encode_varint,
    resource_entries,
    with_empty_blobs,
)

#: the files of an asset written by ``save_asset``
BYTECODE_FILE = "main.mlirb"
HASH_FILE = "main.hash"
METADATA_FILE = "metadata.json"
#: bytes hashed at a time
HASH_CHUNK_BYTES = 8 << 20
#: types of the metadata fields coreai-core reads
_METADATA_FIELDS: dict[str, type] = {
    "producer": str,
    "creationDate": str,
    "assetVersion": str,
    "author": str,
    "license": str,
    "version": str,
    "shortDescription": str,
}
#: MLIR bytecode sections (mlir/Bytecode/Encoding.h): ids 0-8; 0-4 are required
_SECTION_NAMES = (
    "string",
    "dialect",
    "attribute/type",
    "attribute/type offset",
    "IR",
    "resource",
    "resource offset",
    "dialect versioning",
    "properties",
)
_REQUIRED_SECTIONS = range(5)
_RESOURCE, _RESOURCE_OFFSET = 5, 6
_ALIGNMENT_BYTE = 0xCB
#: a child compiling the program that shows no activity for this long is given up
STALL_SECONDS = 30.0


@dataclass
class AssetInfo:
    """What :func:`check_asset` found."""

    path: Path
    bytecode_bytes: int
    #: whether the bytecode was compared with ``main.hash``
    hash_verified: bool
    #: seconds spent hashing (0 when not verified)
    hash_seconds: float = 0.0


def check_asset(
    path: str | os.PathLike[str], *, verify_hash: bool = True, defer_hash: bool = False
) -> AssetInfo:
    """Check that ``path`` is a complete, undamaged Core AI asset (see the module docstring).

    Raises :class:`~coreai_torch.errors.AssetNotFoundError` (also a ``FileNotFoundError``) for
    a path that does not exist and :class:`~coreai_torch.errors.InvalidAssetError` (also a
    ``ValueError``) naming the file and the problem for anything else.  ``verify_hash=False``
    skips the SHA-256 comparison (damaged weights then go unnoticed); it costs about a second
    per GB of bytecode.  ``defer_hash``: check ``main.hash`` but leave the hashing to a later
    :func:`check_hash` (done while the program compiles).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"an asset path must be a str or os.PathLike, got {type(path).__name__}")
    root = Path(path)
    if not root.exists():
        raise AssetNotFoundError(f"{root}: no such .aimodel asset (the path does not exist)")
    if not root.is_dir():
        raise InvalidAssetError(
            f"{root} is a file, not a Core AI asset (an asset is a directory *.aimodel written "
            "by save_asset)"
        )
    bytecode, digest_file = root / BYTECODE_FILE, root / HASH_FILE
    metadata = root / METADATA_FILE
    required = (bytecode, digest_file, metadata) if verify_hash else (bytecode, metadata)
    missing = [f.name for f in required if not f.is_file()]
    if missing:
        present = sorted(p.name for p in root.iterdir())[:10]
        raise InvalidAssetError(
            f"{root} is not a complete Core AI asset: {', '.join(missing)} missing (it holds "
            f"{present or 'nothing'}); save the program again with save_asset()"
        )
    _check_metadata(metadata)
    size = bytecode.stat().st_size
    if size == 0:
        raise InvalidAssetError(f"{bytecode} is empty: the asset is damaged; save it again")
    check_bytecode_layout(bytecode)  # first: it says where a truncated file ends
    info = AssetInfo(root, size, hash_verified=False)
    if verify_hash:
        expected = _expected_digest(digest_file)
        if not defer_hash:
            info.hash_seconds = _compare_hash(bytecode, digest_file, expected)
            info.hash_verified = True
    return info


def _check_metadata(path: Path) -> None:
    try:
        data = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as error:
        raise InvalidAssetError(
            f"{path} is not valid JSON ({error}): the asset's metadata is damaged; save the "
            "program again, or rewrite the file as a JSON object"
        ) from error
    if not isinstance(data, dict):
        raise InvalidAssetError(
            f"{path} holds a JSON {type(data).__name__}, not an object: the asset's metadata "
            "is damaged"
        )
    for key, kind in _METADATA_FIELDS.items():
        if key in data and not isinstance(data[key], kind):
            raise InvalidAssetError(
                f"{path}: field {key!r} must be a {kind.__name__}, got {data[key]!r}"
            )


def file_sha256(path: Path, progress: Callable[[int], None] | None = None) -> bytes:
    """The SHA-256 of the file ``path``, read in :data:`HASH_CHUNK_BYTES` blocks."""
    digest = hashlib.sha256()
    buffer = bytearray(HASH_CHUNK_BYTES)
    view = memoryview(buffer)
    done = 0
    with open(path, "rb", buffering=0) as file:
        while count := file.readinto(buffer):
            digest.update(view[:count])
            done += count
            if progress is not None:
                progress(done)
    return digest.digest()


def check_hash(path: str | os.PathLike[str]) -> float:
    """Raise :class:`InvalidAssetError` unless the asset's bytecode matches ``main.hash``;
    returns the seconds spent hashing."""
    root = Path(path)
    digest_file = root / HASH_FILE
    if not digest_file.is_file():
        raise InvalidAssetError(
            f"{root} is not a complete Core AI asset: {HASH_FILE} missing; save the program "
            "again with save_asset(), or load it with verify_hash=False"
        )
    return _compare_hash(root / BYTECODE_FILE, digest_file, _expected_digest(digest_file))


def _expected_digest(digest_file: Path) -> bytes:
    expected = digest_file.read_bytes()
    if len(expected) != hashlib.sha256().digest_size:
        raise InvalidAssetError(
            f"{digest_file} holds {len(expected)} bytes, not a 32-byte SHA-256 digest: the "
            "asset is damaged; save it again"
        )
    return expected


def _compare_hash(bytecode: Path, digest_file: Path, expected: bytes) -> float:
    start = time.perf_counter()
    actual = file_sha256(bytecode)
    seconds = time.perf_counter() - start
    if actual != expected:
        raise InvalidAssetError(
            f"{bytecode} does not match {digest_file.name} (SHA-256 {actual.hex()[:16]}..., "
            f"expected {expected.hex()[:16]}...): the program or its weights changed after the "
            "asset was saved (a damaged or incomplete copy); save or copy the asset again"
        )
    return seconds


# ------------------------------------------------------------------------ bytecode layout ---


class _Reader:
    """Reads the framing of a bytecode file, seeking over section contents and blob data."""

    def __init__(self, file: Any, size: int) -> None:
        self.file, self.size, self.position = file, size, 0

    def read(self, count: int, what: str) -> bytes:
        if count > self.size - self.position:
            raise BytecodeFormatError(
                f"{what} at byte {self.position} needs {count} bytes; the file ends "
                f"{self.size - self.position} bytes later (truncated)"
            )
        self.file.seek(self.position)
        data = self.file.read(count)
        self.position += count
        return data

    def skip(self, count: int, what: str) -> None:
        if count > self.size - self.position:
            raise BytecodeFormatError(
                f"{what} at byte {self.position} is {count} bytes long; the file ends "
                f"{self.size - self.position} bytes later (truncated)"
            )
        self.position += count

    def varint(self, what: str) -> int:
        first = self.read(1, what)
        byte = first[0]
        if byte & 1:
            return byte >> 1
        if byte == 0:
            return int.from_bytes(self.read(8, what), "little")
        length = (byte & -byte).bit_length()
        return int.from_bytes(first + self.read(length - 1, what), "little") >> length

    def align(self, alignment: int, what: str) -> None:
        if alignment < 1 or alignment & (alignment - 1) or alignment > 1 << 16:
            raise BytecodeFormatError(f"{what} has an invalid alignment {alignment}")
        padding = -self.position % alignment
        if padding and any(b != _ALIGNMENT_BYTE for b in self.read(padding, what)):
            raise BytecodeFormatError(f"the alignment padding of {what} holds data")


def check_bytecode_layout(path: Path) -> list[tuple[int, int]]:
    """Raise :class:`InvalidAssetError` unless ``path`` is laid out as MLIR bytecode: the
    header, sections 0-8 (each at most once, 0-4 present) within the file, the resource
    entries matching their offset table, nothing after the last section.  Reads only the
    framing (a few KB for a multi-GB file).  Returns the ``(offset, size)`` of each weight
    blob's data."""
    return _read_framing(path, _check_layout)


def _read_framing(path: Path, read: Callable[[_Reader], Any]) -> Any:
    """``read`` on the bytecode file ``path``; a malformed file is an :class:`InvalidAssetError`."""
    try:
        with open(path, "rb") as file:
            return read(_Reader(file, path.stat().st_size))
    except BytecodeFormatError as error:
        raise InvalidAssetError(
            f"{path} is not a readable Core AI program: {error}; the asset is damaged, save "
            "it again"
        ) from error


def _read_header(reader: _Reader) -> None:
    if reader.read(min(len(MAGIC), reader.size), "the header") != MAGIC:
        raise BytecodeFormatError("no MLIR bytecode header ('ML\\xefR')")
    reader.varint("the bytecode version")
    while reader.read(1, "the producer name") != b"\0":
        if reader.position > 256:
            raise BytecodeFormatError("the producer name does not end")


def _check_layout(reader: _Reader) -> list[tuple[int, int]]:
    _read_header(reader)
    seen: set[int] = set()
    entries: list[tuple[int, int]] | None = None
    blobs: list[tuple[int, int]] = []
    while reader.position < reader.size:
        code = reader.read(1, "a section id")[0]
        section = code & 0x7F
        if section >= len(_SECTION_NAMES):
            raise BytecodeFormatError(f"unknown section id {section} at byte {reader.position}")
        name = f"the {_SECTION_NAMES[section]} section"
        if section in seen:
            raise BytecodeFormatError(f"{name} appears twice")
        seen.add(section)
        length = reader.varint(name)
        if code & 0x80:
            reader.align(reader.varint(name), name)
        if section == _RESOURCE_OFFSET:
            try:
                entries = resource_entries(reader.read(length, name))
            except IndexError as error:
                raise BytecodeFormatError(f"{name} does not parse") from error
        elif section == _RESOURCE:
            if entries is None:
                raise BytecodeFormatError("the resource section comes before its offsets")
            blobs = _check_resources(reader, length, entries)
        else:
            reader.skip(length, name)
    absent = [_SECTION_NAMES[s] for s in _REQUIRED_SECTIONS if s not in seen]
    if absent:
        raise BytecodeFormatError(f"sections missing (truncated?): {', '.join(absent)}")
    if (_RESOURCE in seen) != (_RESOURCE_OFFSET in seen):
        raise BytecodeFormatError("the resource section and its offsets do not come together")
    return blobs


def _check_resources(
    reader: _Reader, length: int, entries: list[tuple[int, int]]
) -> list[tuple[int, int]]:
    end = reader.position + length
    blobs = []
    if end > reader.size:
        raise BytecodeFormatError(
            f"the resource section (the weights) is {length} bytes long; the file ends "
            f"{reader.size - reader.position} bytes after its start (truncated)"
        )
    for index, (kind, entry_size) in enumerate(entries):
        start = reader.position
        if kind == 0 and entry_size:  # a blob: alignment, size, padding, data
            what = f"weight blob {index}"
            alignment = reader.varint(what)
            blob = reader.varint(what)
            reader.align(alignment, what)
            blobs.append((reader.position, blob))
            reader.skip(blob, what)
            if reader.position - start != entry_size:
                raise BytecodeFormatError(
                    f"{what} takes {reader.position - start} bytes; its offset table says "
                    f"{entry_size}"
                )
        else:
            reader.skip(entry_size, f"resource entry {index}")
    if reader.position != end:
        raise BytecodeFormatError(
            f"the resource entries take {reader.position - end + length} bytes; the resource "
            f"section is {length}"
        )
    return blobs


def weightless_bytecode(path: str | os.PathLike[str]) -> bytes:
    """The asset's program bytecode (``path`` is its ``main.mlirb``) with every weight blob
    emptied: a few KB that describe the same functions, inputs, outputs and states, read
    without reading the weights (coreai-core's ``summary()`` of the asset itself holds the
    whole file in memory)."""
    return _read_framing(Path(path), _weightless)


def _weightless(reader: _Reader) -> bytes:
    _read_header(reader)
    header_end = reader.position
    reader.position = 0
    out = bytearray(reader.read(header_end, "the header"))
    entries: list[tuple[int, int]] | None = None
    while reader.position < reader.size:
        code = reader.read(1, "a section id")[0]
        section = code & 0x7F
        name = f"section {section}"
        length = reader.varint(name)
        if code & 0x80:
            reader.align(reader.varint(name), name)
        if section == _RESOURCE_OFFSET:
            body = reader.read(length, name)
            try:
                entries = resource_entries(body)
            except IndexError as error:
                raise BytecodeFormatError(f"{name} does not parse") from error
            body = with_empty_blobs(body)
        elif section == _RESOURCE:
            if entries is None:
                raise BytecodeFormatError("the resource section comes before its offsets")
            parts = []
            for kind, entry_size in entries:
                if kind == 0 and entry_size:
                    reader.skip(entry_size, "a weight blob")
                    parts.append(EMPTY_BLOB)
                else:
                    parts.append(reader.read(entry_size, "a resource entry"))
            body = b"".join(parts)
        else:
            body = reader.read(length, name)
        out += bytes([section]) + encode_varint(len(body)) + body  # sections unaligned
    return bytes(out)


def structure_summary(path: str | os.PathLike[str]) -> Any:
    """coreai-core's ``AIModelAssetSummary`` (functions and their inputs, outputs and states,
    without statistics) of the asset directory ``path``, read from its
    :func:`weightless_bytecode` (memory: a few KB, not the asset's size)."""
    root = Path(path)
    bytecode = root / BYTECODE_FILE
    if not bytecode.is_file():
        raise InvalidAssetError(
            f"{root} has no {BYTECODE_FILE}: not a Core AI asset written by "
            "save_asset (a compiled .aimodelc cannot be read here)"
        )
    skeleton = weightless_bytecode(bytecode)
    with tempfile.TemporaryDirectory(prefix="coreai_torch_structure_") as tmp:
        copy = Path(tmp) / "structure.aimodel"
        copy.mkdir()
        (copy / BYTECODE_FILE).write_bytes(skeleton)
        (copy / METADATA_FILE).write_text('{"assetVersion": "2.0"}')
        try:
            return ca.AIModelAsset.load(copy).summary(include_statistics=False)
        except RuntimeError as error:
            raise InvalidAssetError(
                f"{root}: coreai-core cannot read the program's structure ({error})"
            ) from error


# ----------------------------------------------------------------- compiling in a child ---


def isolation_available() -> bool:
    """Whether programs are compiled for the runtime in a forked child (Linux)."""
    return sys.platform.startswith("linux") and hasattr(os, "fork")


def compile_isolated(
    compile_fn: Callable[[], None],
    *,
    what: str,
    asset_path: Path | None = None,
    hash_verified: bool = False,
    meanwhile: Callable[[], Any] | None = None,
) -> None:
    """Run ``compile_fn`` (coreai-core reading and compiling a program) in a forked child.

    A child killed by a signal (coreai-core aborting on a malformed program) raises
    :class:`InvalidAssetError` when the program came from ``asset_path``, else ``RuntimeError``.
    A child that raised a Python exception is re-run in process, so that the caller gets the
    original exception.  A child that makes no progress for :data:`STALL_SECONDS` is killed
    and ``compile_fn`` is run in process.  ``meanwhile`` runs here while the child compiles
    (the hash check of a large asset: it then costs no time); if it raises, the child is
    killed and its work dropped.
    """
    with tempfile.TemporaryFile() as log:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads
                pid = os.fork()
        except OSError:
            if meanwhile is not None:
                meanwhile()
            compile_fn()
            return
        if pid == 0:  # the child: its stderr (coreai-core's diagnostics) into the log
            code = 1
            try:
                sys.stderr.flush()
                os.dup2(log.fileno(), 2)
                compile_fn()
                code = 0
            except BaseException:  # reported by re-running in the parent
                pass
            finally:
                os._exit(code)
        try:
            if meanwhile is not None:
                meanwhile()
                hash_verified = True
        except BaseException:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise
        status = _wait(pid)
        log.seek(0)
        diagnostics = log.read().decode(errors="replace")
    if status is None:  # stalled
        warnings.warn(
            f"compiling {what} in a child process made no progress for {STALL_SECONDS:g} s; "
            "compiling it in this process",
            RuntimeWarning,
            stacklevel=3,
        )
        compile_fn()
        return
    if os.WIFSIGNALED(status):
        raise _crash_error(os.WTERMSIG(status), diagnostics, what, asset_path, hash_verified)
    if os.WEXITSTATUS(status) != 0:
        compile_fn()  # raises the child's exception here, with its type and traceback
        return
    if diagnostics.strip():
        sys.stderr.write(diagnostics)


def _crash_error(
    number: int, diagnostics: str, what: str, asset_path: Path | None, hash_verified: bool
) -> BaseException:
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    if number == signal.SIGKILL:
        return MemoryError(
            f"the process compiling {what} for the Core AI runtime was killed (SIGKILL; out of "
            "memory?)"
        )
    errors = [
        line.split("error:", 1)[1].strip()
        for line in diagnostics.splitlines()
        if "error:" in line and "failed to parse bytecode" not in line
    ]
    said = f" ({'; '.join(errors[:3])})" if errors else ""
    if asset_path is not None:
        if hash_verified:
            why = (
                "although its files are complete and match main.hash (written by a faulty "
                "tool, or altered together with its hash)"
            )
        else:
            why = "(damaged? it was loaded with verify_hash=False: load it with the hash check)"
        return InvalidAssetError(
            f"coreai-core crashed ({name}) reading {asset_path / BYTECODE_FILE}{said}: the "
            f"program is malformed {why}; save the program again with save_asset()"
        )
    return RuntimeError(
        f"coreai-core crashed ({name}) compiling {what} for the Core AI runtime{said}; this "
        "process was spared (the compilation ran in a child process)"
    )


def _wait(pid: int) -> int | None:
    """The child's exit status, or None (after killing it) if it stalled."""
    since = time.monotonic()
    seen: tuple[int, ...] | None = None
    delay = 0.001
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(delay)
        delay = min(delay * 2, 0.25)
        activity = _activity(pid)
        now = time.monotonic()
        if activity is None or activity != seen:
            seen, since = activity, now
        elif now - since > STALL_SECONDS:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None


def _activity(pid: int) -> tuple[int, ...] | None:
    """Counters that grow while ``pid`` runs (page faults, CPU ticks), None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            stat = file.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()
    return tuple(int(fields[i]) for i in (7, 9, 11, 12))
