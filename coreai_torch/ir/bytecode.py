"""The framing of an MLIR bytecode stream, enough to find its resource blobs as it passes.

An MLIR bytecode file (https://mlir.llvm.org/docs/BytecodeFormat/) is a header followed by
sections, each ``id`` (high bit: an alignment follows), ``length``, [``alignment``, padding],
contents.  The *resource offset* section lists, in order, the kind and encoded size of every
resource entry; the *resource* section, which comes after it, holds the entries themselves.  A
blob entry is ``alignment``, ``size``, padding to the alignment, then the blob's bytes: a
weight's data, stored as is.

:func:`rewrite_blobs` copies a bytecode stream from a :class:`Source` to a sink and lets the
caller replace the bytes of chosen blobs on the way (``coreai_torch.ir.saving`` writes the
transposed weights there), reading every byte once and holding only headers in memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

MAGIC = b"ML\xefR"
_RESOURCE, _RESOURCE_OFFSET = 5, 6
_BLOB_KIND = 0
_ALIGNMENT_BYTE = 0xCB


class BytecodeFormatError(RuntimeError):
    """The stream is not MLIR bytecode as this module reads it."""


class TruncatedBytecode(BytecodeFormatError):
    """The stream ends in the middle of the bytecode."""


class Source(Protocol):
    """A byte stream that is consumed once, front to back."""

    #: offset of the next byte in the stream
    position: int

    def peek(self, count: int) -> bytes:
        """The next ``count`` bytes (fewer only at the end), without consuming them."""

    def take(self, count: int) -> bytes:
        """Consume ``count`` bytes, forward them to the output and return them (raises
        :class:`TruncatedBytecode` if the stream ends first)."""

    def copy(self, count: int) -> None:
        """Consume ``count`` bytes and forward them to the output."""

    def at_end(self) -> bool:
        """Whether the stream is exhausted."""


#: ``replace(source, size)`` is called at the start of each blob's data; it either consumes
#: the ``size`` bytes itself (forwarding replacement bytes) and returns True, or returns False
#: and leaves them to be copied.
BlobReplacer = Callable[[Source, int], bool]


def _varint(source: Source) -> int:
    """An MLIR bytecode "prefix varint": the first byte's trailing zeros + 1 is its length."""
    first = source.take(1)
    byte = first[0]
    if byte & 1:
        return byte >> 1
    if byte == 0:
        return int.from_bytes(source.take(8), "little")
    length = (byte & -byte).bit_length()
    return int.from_bytes(first + source.take(length - 1), "little") >> length


def _decode_varint(data: bytes, offset: int) -> tuple[int, int]:
    """The varint at ``data[offset:]`` and the offset after it."""
    byte = data[offset]
    if byte & 1:
        return byte >> 1, offset + 1
    if byte == 0:
        return int.from_bytes(data[offset + 1 : offset + 9], "little"), offset + 9
    length = (byte & -byte).bit_length()
    return int.from_bytes(data[offset : offset + length], "little") >> length, offset + length


def encode_varint(value: int) -> bytes:
    """``value`` as an MLIR bytecode prefix varint (the inverse of the readers here)."""
    for length in range(1, 9):
        if value < 1 << (7 * length):
            return ((value << length) | (1 << (length - 1))).to_bytes(length, "little")
    return b"\0" + value.to_bytes(8, "little")


#: a blob entry holding no data (alignment 1, size 0)
EMPTY_BLOB = encode_varint(1) + encode_varint(0)


def with_empty_blobs(section: bytes) -> bytes:
    """The resource offset section ``section`` rewritten for a resource section in which every
    blob entry is :data:`EMPTY_BLOB` (the other entries unchanged)."""
    out = bytearray()
    offset = 0
    groups, offset = _decode_varint(section, offset)
    out += encode_varint(groups)
    while offset < len(section):
        key, offset = _decode_varint(section, offset)
        count, offset = _decode_varint(section, offset)
        out += encode_varint(key) + encode_varint(count)
        for _ in range(count):
            name, offset = _decode_varint(section, offset)
            size, offset = _decode_varint(section, offset)
            kind = section[offset]
            offset += 1
            size = len(EMPTY_BLOB) if kind == _BLOB_KIND and size else size
            out += encode_varint(name) + encode_varint(size) + bytes([kind])
    return bytes(out)


def resource_entries(section: bytes) -> list[tuple[int, int]]:
    """``(kind, size)`` of every resource entry, in the order of the resource section."""
    entries = []
    offset = 0
    _, offset = _decode_varint(section, offset)  # number of external resource groups
    while offset < len(section):
        _, offset = _decode_varint(section, offset)  # group key
        count, offset = _decode_varint(section, offset)
        for _ in range(count):
            _, offset = _decode_varint(section, offset)  # resource key
            size, offset = _decode_varint(section, offset)
            entries.append((section[offset], size))
            offset += 1
    if offset != len(section):
        raise BytecodeFormatError("the resource offset section does not parse")
    return entries


def _align(source: Source, alignment: int) -> None:
    padding = -source.position % alignment if alignment > 1 else 0
    if padding and any(b != _ALIGNMENT_BYTE for b in source.take(padding)):
        raise BytecodeFormatError("alignment padding holds data")


def _blob(source: Source, entry_size: int, replace: BlobReplacer) -> None:
    start = source.position
    alignment = _varint(source)
    size = _varint(source)
    _align(source, alignment)
    if not replace(source, size):
        source.copy(size)
    if source.position - start != entry_size:
        raise BytecodeFormatError(
            f"a blob entry of {entry_size} bytes was read as {source.position - start}"
        )


def rewrite_blobs(source: Source, replace: BlobReplacer) -> None:
    """Forward the whole bytecode stream, calling ``replace`` at the start of each blob."""
    if source.take(len(MAGIC)) != MAGIC:
        raise BytecodeFormatError("not MLIR bytecode (no 'ML\\xefR' header)")
    _varint(source)  # bytecode version
    while source.take(1) != b"\0":  # producer, NUL-terminated
        pass
    entries: list[tuple[int, int]] | None = None
    while not source.at_end():
        code = source.take(1)[0]
        length = _varint(source)
        if code & 0x80:
            _align(source, _varint(source))
        section = code & 0x7F
        if section == _RESOURCE_OFFSET:
            entries = resource_entries(source.take(length))
        elif section == _RESOURCE:
            if entries is None:
                raise BytecodeFormatError("resource section before its offsets")
            end = source.position + length
            for kind, size in entries:
                if kind == _BLOB_KIND and size:
                    _blob(source, size, replace)
                else:
                    source.copy(size)
            if source.position != end:
                raise BytecodeFormatError("the resource section does not match its offsets")
        else:
            source.copy(length)
