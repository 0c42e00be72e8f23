"""Weights as zero-copy resource constants.

A parameter, buffer or lifted constant becomes a ``coreai.constant dense_resource<name>``
whose blob *is* the tensor's memory (``DenseResourceElementsAttr.get_from_buffer``): nothing is
copied at conversion time.  The tensors must stay alive and unmodified until the program is
saved; the MLIR context keeps a reference to each buffer.

One :class:`WeightStore` serves every graph of a program, so a tensor used by several entry
points (e.g. prefill and decode) is stored once.  It stays with the program, so that
``AIProgram.optimize()`` can store a weight transposed (:meth:`WeightStore.transposed`).

A transposed weight is not copied when it is created either: its resource is a *placeholder*
of the right size (untouched anonymous memory, which costs no RAM) that starts with a unique
tag, and the transposed data is produced while the asset is written
(:mod:`coreai_torch.ir.saving` replaces each tagged blob in the byte stream).  So saving a large
model needs no second copy of its weights.  Whatever else reads constants' data through MLIR
must see the real data: :meth:`WeightStore.materialize` fills the placeholders in place (one
copy, as an eager transpose would make), and ``AIProgram.mlir_module`` calls it.  A transposed
weight whose constants a later pass replaced (``compress()``) is dropped instead
(:meth:`WeightStore.prune`), never made.  The compressed codes of a weight still in its
checkpoint are not held either: they wait in a temporary file (:class:`SpillFile`), or are
computed again, until they are written (:meth:`WeightStore.deferring`).
"""

from __future__ import annotations

import collections
import contextlib
import io
import itertools
import mmap
import os
import re
import tempfile
import weakref
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from coreai_torch import dtypes
from coreai_torch._mlir import cai, ir
from coreai_torch.tensors import lazy

#: Tensors with fewer elements than this are emitted inline (``dense<...>``) so the compiler
#: can fold them; larger ones are zero-copy resources.
INLINE_LIMIT = 64

#: A placeholder's first bytes: this process's random prefix, then a serial number and the size.
_TAG_PREFIX = os.urandom(16)
TAG_BYTES = len(_TAG_PREFIX) + 16
_serials = itertools.count()

_HUGE_PAGE = 2 << 20

#: Columns transposed per block: a block of ``rows x 64`` elements is gathered contiguously,
#: then transposed by torch's cache-blocked 2-D transpose.
_BLOCK = 64


_RESOURCE = re.compile(r'^dense_resource<"?([^">]+)"?>')


def resource_name(op: ir.Operation) -> str | None:
    """The resource name of a ``coreai.constant dense_resource<name>``, else None."""
    if op.name != "coreai.constant":
        return None
    value = op.attributes["value"]
    if not ir.DenseResourceElementsAttr.isinstance(value):
        return None
    match = _RESOURCE.match(str(value))
    return match[1] if match else None


class _BytesSource:
    """An in-memory :class:`~coreai_torch.ir.bytecode.Source`."""

    def __init__(self, data: bytes) -> None:
        self.data, self.position = memoryview(data), 0

    def peek(self, count: int) -> bytes:
        return bytes(self.data[self.position : self.position + count])

    def take(self, count: int) -> bytes:
        out = self.peek(count)
        self.position += count
        return out

    def copy(self, count: int) -> None:
        self.position += count

    def at_end(self) -> bool:
        return self.position >= len(self.data)


def resource_tensor(op: ir.Operation) -> torch.Tensor:
    """A copy of the data of a ``coreai.constant dense_resource<...>`` (one Core AI made, say,
    which no store holds), read from the bytecode of a module holding only that constant."""
    from coreai_torch.ir.bytecode import rewrite_blobs

    with op.context, ir.Location.unknown():
        holder = ir.Module.create()
        with ir.InsertionPoint(holder.body):
            op.clone()
        stream = io.BytesIO()
        holder.operation.write_bytecode(stream)
    blobs: list[bytes] = []

    def keep(source: Any, size: int) -> bool:
        blobs.append(source.take(size))
        return True

    rewrite_blobs(_BytesSource(stream.getvalue()), keep)
    tensor_type = ir.RankedTensorType(op.result.type)
    dtype = dtypes.to_torch(tensor_type.element_type)
    return torch.frombuffer(bytearray(blobs[0]), dtype=dtype).reshape(list(tensor_type.shape))


def referenced_resources(module: ir.Module) -> set[str]:
    """The names of the resources the constants of ``module`` hold."""
    names: set[str] = set()

    def visit(op: ir.Operation) -> ir.WalkResult:
        name = resource_name(op)
        if name is not None:
            names.add(name)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return names


class ModuleHolder(Protocol):
    """What holds a module with constants of a :class:`WeightStore` (an ``AIProgram``)."""

    @property
    def structural_module(self) -> ir.Module: ...


def _buffer(tensor: torch.Tensor) -> np.ndarray:
    """A C-contiguous numpy view of the tensor's memory (a copy only if it is strided)."""
    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy()
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu):
        return t.view(torch.uint8).numpy()
    return t.numpy()


def transpose_rows(source: torch.Tensor, first: int, out: torch.Tensor) -> None:
    """``out[:] = source.T[first : first + len(out)]`` for a 2-D ``source``, at close to memory
    speed: columns are gathered in blocks that fit the cache, then transposed."""
    rows = out.shape[0]
    for start in range(0, rows, _BLOCK):
        width = min(_BLOCK, rows - start)
        block = source[:, first + start : first + start + width].contiguous()
        out[start : start + width].copy_(block.t())


class PendingData:
    """A resource whose data is made when it is needed (saved or read): its blob holds a
    placeholder (:func:`_placeholder`, tagged) until then.  Subclasses say how to make it,
    a block of slices along the first dimension at a time (:meth:`fill`)."""

    name: str
    tag: bytes
    #: the placeholder the resource holds (anonymous memory; filled by ``materialize``)
    placeholder: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.placeholder.numel() * self.placeholder.element_size()

    @property
    def rows(self) -> int:
        """Slices along the first dimension of the data."""
        return self.placeholder.shape[0] if self.placeholder.dim() else 1

    @property
    def row_bytes(self) -> int:
        """Bytes of one such slice."""
        return self.nbytes // max(1, self.rows)

    def fill(self, first: int, out: torch.Tensor) -> None:
        """Slices ``first .. first + len(out)`` (first dimension) of the data into ``out``
        (contiguous, shaped like those slices)."""
        raise NotImplementedError

    def materialize(self) -> None:
        """Write the data into the placeholder (in place: the IR is unchanged)."""
        self.fill(0, self.placeholder.view(self.rows, *self.placeholder.shape[1:]))


@dataclass
class PendingTranspose(PendingData):
    """A weight stored transposed, made from the original tensor when it is needed."""

    name: str
    tag: bytes
    #: the weight's content, permuted: a view of the original tensor (no copy)
    view: torch.Tensor
    #: the original tensor and the permutation
    source: torch.Tensor
    perm: tuple[int, ...]
    placeholder: torch.Tensor

    def fill(self, first: int, out: torch.Tensor) -> None:
        if self.perm == (1, 0):
            transpose_rows(self.source.detach(), first, out)
        else:
            out.copy_(self.view[first : first + out.shape[0]])

    def materialize(self) -> None:
        """With torch's cache-blocked transpose."""
        self.placeholder.copy_(self.view)


@dataclass
class PendingLazy(PendingData):
    """A lazy tensor (:mod:`coreai_torch.tensors.lazy`) read when it is needed: by rows where its
    expression allows it, else whole (once, kept until its last slice is written)."""

    name: str
    tag: bytes
    tensor: torch.Tensor
    placeholder: torch.Tensor
    _whole: torch.Tensor | None = None

    def fill(self, first: int, out: torch.Tensor) -> None:
        count = out.shape[0]
        if self._whole is None:
            rows = lazy.read_rows(self.tensor, first, count) if self.tensor.dim() else None
            if rows is not None:
                out.copy_(rows.reshape(out.shape))
                return
            self._whole = lazy.materialize(self.tensor).reshape(self.placeholder.shape)
        whole = self._whole.reshape(self.rows, *self.placeholder.shape[1:])
        out.copy_(whole[first : first + count])
        if first + count >= self.rows:
            self._whole = None


class SpillFile:
    """An anonymous temporary file holding buffers until they are needed: written once,
    read back by ranges with ``pread`` (no memory map, so its pages are the system's page
    cache, never the process's memory).  Closed, and its space freed, when nothing refers
    to it any more."""

    def __init__(self, directory: str | None = None) -> None:
        # closed by the finalizer, once nothing refers to the spill file
        self._file = tempfile.TemporaryFile(dir=directory, buffering=0)  # noqa: SIM115
        self._fd = self._file.fileno()
        self._closer = weakref.finalize(self, self._file.close)
        #: bytes written
        self.size = 0

    def write(self, data: np.ndarray) -> int:
        """Append ``data``'s bytes; returns where they start.  ``OSError`` when they cannot be
        written (nothing is then counted as written)."""
        view = np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
        offset, done = self.size, 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], offset + done)
        self.size += len(view)
        return offset

    def read_into(self, offset: int, out: torch.Tensor | np.ndarray) -> None:
        """``out``'s bytes (a contiguous tensor or array) from ``offset``."""
        array = out.view(torch.uint8).numpy() if isinstance(out, torch.Tensor) else out
        view = array.reshape(-1).view(np.uint8).data
        done = 0
        while done < len(view):
            count = os.preadv(self._fd, [view[done:]], offset + done)
            if count <= 0:
                raise OSError(f"the temporary file of derived constants ends at {offset + done}")
            done += count

    def close(self) -> None:
        """Close the file now (its buffers can no longer be read)."""
        self._closer()


class _Recipe:
    """Makes the derived buffers of one weight (its compressed codes, scales, ...) when they
    are needed: those written to a :class:`SpillFile` are read back, the others computed
    again (all at once, when the first of them is needed, and let go once all are written)."""

    def __init__(
        self,
        compute: Callable[[], list[np.ndarray]],
        context: ir.Context,
        spill: SpillFile | None = None,
    ) -> None:
        self.compute = compute
        self.context = context
        self.spill = spill
        self.arrays: list[np.ndarray] | None = None
        self.waiting: set[int] = set()

    def keep(self, data: np.ndarray) -> int | None:
        """Where ``data`` went in the spill file, or None (no file, or it could not be
        written: the buffer is computed again)."""
        if self.spill is None:
            return None
        try:
            return self.spill.write(data)
        except OSError:
            return None

    def array(self, index: int) -> np.ndarray:
        if self.arrays is None:
            with self.context, ir.Location.unknown():
                self.arrays = [
                    np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in self.compute()
                ]
        return self.arrays[index]

    def done(self, index: int) -> None:
        self.waiting.discard(index)
        if not self.waiting:
            self.arrays = None


@dataclass
class PendingDerived(PendingData):
    """A derived buffer (:meth:`WeightStore.derived`) made when it is needed, from a lazy
    weight: read back from the spill file at ``offset``, or (None) computed again.  See
    :meth:`WeightStore.deferring`."""

    name: str
    tag: bytes
    placeholder: torch.Tensor
    recipe: _Recipe
    index: int
    offset: int | None = None

    def fill(self, first: int, out: torch.Tensor) -> None:
        count = out.numel() * out.element_size()
        start = first * self.row_bytes
        target = out.view(torch.uint8).reshape(-1)
        if self.offset is not None:
            assert self.recipe.spill is not None
            self.recipe.spill.read_into(self.offset + start, target)
            return
        data = self.recipe.array(self.index)
        if data.size != self.nbytes:
            raise RuntimeError(
                f"derived constant '{self.name}' was computed again with {data.size} bytes "
                f"instead of {self.nbytes}: its computation is not deterministic"
            )
        target.copy_(torch.from_numpy(data[start : start + count]))
        if start + count >= self.nbytes:
            self.recipe.done(self.index)


def derived_arrays(build: Callable[[Any], Any], store: WeightStore) -> list[np.ndarray]:
    """The buffers ``build(target)`` hands to ``target.derived()``, in order, without creating
    any resource: ``build`` is what made a weight's derived constants in ``store`` (needs the
    MLIR context it ran in)."""
    recorder = _DerivedRecorder()
    build(recorder)
    return recorder.arrays


class _DerivedRecorder:
    """Stands for a :class:`WeightStore` whose :meth:`~WeightStore.derived` only records."""

    def __init__(self) -> None:
        self.arrays: list[np.ndarray] = []

    def derived(self, data: np.ndarray, name: str, tensor_type: ir.RankedTensorType) -> None:
        self.arrays.append(data)


def _placeholder(shape: tuple[int, ...], dtype: torch.dtype, tag: bytes) -> torch.Tensor:
    """An uninitialised tensor over fresh anonymous memory, starting with ``tag``: pages the
    program never writes stay shared with the kernel's zero page and cost no RAM."""
    count = int(np.prod(shape, dtype=np.int64))
    nbytes = count * dtype.itemsize
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    memory[: len(tag)] = tag
    if nbytes > 2 * _HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        # reads then map the kernel's huge zero page: 512x fewer page faults when saving
        with contextlib.suppress(OSError):
            memory.madvise(mmap.MADV_HUGEPAGE, _HUGE_PAGE, nbytes - _HUGE_PAGE)
    return torch.frombuffer(memory, dtype=dtype, count=count).view(shape)


#: names of the resources whose blobs still hold placeholders, in every store of the process
#: (how many stores have a pending one of that name): Core AI must not fold ops reading them
PENDING_RESOURCES: collections.Counter[str] = collections.Counter()


def is_pending(name: str) -> bool:
    """Whether a resource of this name holds a placeholder in some program of the process."""
    return PENDING_RESOURCES[name] > 0


class _PendingTable(dict):
    """``tag -> PendingData``, keeping :data:`PENDING_RESOURCES` up to date."""

    def __setitem__(self, tag: bytes, entry: PendingData) -> None:
        if tag not in self:
            PENDING_RESOURCES[entry.name] += 1
        super().__setitem__(tag, entry)

    def __delitem__(self, tag: bytes) -> None:
        name = self[tag].name
        super().__delitem__(tag)
        PENDING_RESOURCES[name] -= 1
        if PENDING_RESOURCES[name] <= 0:
            del PENDING_RESOURCES[name]

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            for tag in list(self):
                del self[tag]


class WeightStore:
    """Creates (and shares) the resource attributes of a program's weights."""

    def __init__(self) -> None:
        self._attrs: dict[tuple, ir.Attribute] = {}
        self._names: set[str] = set()
        #: every tensor handed in stays alive while the store lives: keys are addresses
        self._tensors: list[torch.Tensor] = []
        #: resource name -> the tensor it holds (for a pending transpose: a view of the data)
        self.by_name: dict[str, torch.Tensor] = {}
        #: placeholder tag -> the data it stands for (a transpose, a lazy tensor), until made
        self.pending: dict[bytes, PendingData] = _PendingTable()
        self.total_bytes = 0
        #: resource name -> the buffer of a derived constant (see :meth:`derived`)
        self.derived_by_name: dict[str, np.ndarray] = {}
        self.derived_bytes = 0
        #: the recipe of the derived buffers being deferred (see :meth:`deferring`)
        self._recipe: _Recipe | None = None
        self._recipe_count = 0
        #: programs holding constants of this store (see :meth:`share_with`)
        self._users: weakref.WeakSet[ModuleHolder] = weakref.WeakSet()
        #: resource name of a weight ``optimize()`` computed from another -> the other's
        #: (:mod:`coreai_torch.passes.folded_weights`)
        self.folded: dict[str, str] = {}

    @staticmethod
    def _key(tensor: torch.Tensor) -> tuple:
        return lazy.key(tensor)

    def _unique_name(self, name: str) -> str:
        name = re.sub(r"[^A-Za-z0-9_.]", "_", name) or "weight"
        candidate, k = name, 1
        while candidate in self._names:
            candidate = f"{name}_{k}"
            k += 1
        self._names.add(candidate)
        return candidate

    def constant(self, tensor: torch.Tensor, name: str) -> ir.Value:
        """A ``coreai.constant`` holding ``tensor`` (inline when tiny, zero-copy otherwise)."""
        if lazy.is_lazy(tensor) and tensor.numel() < INLINE_LIMIT:
            tensor = lazy.materialize(tensor)
        if tensor.is_sparse or tensor.device.type != "cpu":
            tensor = tensor.to_dense().cpu() if tensor.is_sparse else tensor.cpu()
        ttype = dtypes.tensor_type(list(tensor.shape), tensor.dtype)
        if tensor.numel() < INLINE_LIMIT:
            if tensor.dtype in (
                torch.bfloat16,
                torch.float8_e4m3fn,
                torch.float8_e5m2,
                torch.float8_e8m0fnu,
            ):
                return cai.constant(tensor.detach().float().numpy(), dtype=ttype.element_type)
            return cai.constant(tensor.detach().numpy().copy(), dtype=ttype.element_type)
        key = self._key(tensor)
        attr = self._attrs.get(key)
        if attr is None:
            self._tensors.append(tensor)
            attr = self._lazy_resource(tensor, name) if lazy.is_lazy(tensor) else None
            attr = attr or self._resource(tensor, name)
            self._attrs[key] = attr
            self.total_bytes += tensor.numel() * tensor.element_size()
        return cai.ConstantOp(value=attr).result

    def _resource(
        self, tensor: torch.Tensor, name: str, buffer: torch.Tensor | None = None
    ) -> ir.Attribute:
        """A resource named after ``name`` holding ``tensor``, over the memory of ``buffer``
        (default: the tensor's own; a lazy tensor is read now)."""
        if buffer is None and lazy.is_lazy(tensor):
            buffer = lazy.materialize(tensor)
            self._tensors.append(buffer)
        return self._named_resource(tensor, self._unique_name(name), buffer)

    def _named_resource(
        self, tensor: torch.Tensor, unique: str, buffer: torch.Tensor | None = None
    ) -> ir.Attribute:
        ttype = dtypes.tensor_type(list(tensor.shape), tensor.dtype)
        self.by_name[unique] = tensor
        data = _buffer(tensor if buffer is None else buffer)
        return ir.DenseResourceElementsAttr.get_from_buffer(data, unique, ttype)

    def tensor(self, name: str) -> torch.Tensor | None:
        """The data of resource ``name`` (a strided view for a pending transpose), or None."""
        return self.by_name.get(name)

    def transposed(self, name: str, perm: tuple[int, ...]) -> ir.Attribute | None:
        """A new resource holding weight ``name`` permuted by ``perm``, named ``<name>.T``;
        None if ``name`` is not a weight of this store.

        No copy is made now: the resource holds a placeholder until the asset is written (or
        :meth:`materialize` is called)."""
        tensor = self.by_name.get(name)
        if tensor is None or len(perm) != tensor.dim():
            return None
        with torch.no_grad():
            view = tensor.detach().permute(perm)  # of a lazy tensor: lazy too
        nbytes = view.numel() * view.element_size()
        if nbytes < TAG_BYTES:
            copy = lazy.materialize(view).contiguous()
            self._tensors.append(copy)
            return self._resource(copy, f"{name}.T")
        if lazy.is_lazy(view):
            return self._lazy_resource(view, f"{name}.T")
        tag, placeholder = self._new_placeholder(view)
        unique = self._unique_name(f"{name}.T")
        self.pending[tag] = PendingTranspose(unique, tag, view, tensor, perm, placeholder)
        return self._named_resource(view, unique, buffer=placeholder)

    def _new_placeholder(self, like: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        """A fresh tag and a placeholder of ``like``'s shape and dtype starting with it."""
        nbytes = like.numel() * like.element_size()
        tag = _TAG_PREFIX + next(_serials).to_bytes(8, "little") + nbytes.to_bytes(8, "little")
        placeholder = _placeholder(tuple(like.shape), like.dtype, tag)
        self._tensors.append(placeholder)
        return tag, placeholder

    def _lazy_resource(self, tensor: torch.Tensor, name: str) -> ir.Attribute | None:
        """A resource whose data is read from ``tensor``'s source when it is needed; None
        when the tensor is too small for a placeholder (it is read now instead)."""
        if tensor.numel() * tensor.element_size() < TAG_BYTES:
            return None
        tag, placeholder = self._new_placeholder(tensor)
        unique = self._unique_name(name)
        self.pending[tag] = PendingLazy(unique, tag, tensor, placeholder)
        return self._named_resource(tensor, unique, buffer=placeholder)

    def share_with(self, user: ModuleHolder) -> None:
        """Record that ``user`` (a program) holds constants of this store, so that
        :meth:`prune` keeps what it references.  Users are held weakly."""
        self._users.add(user)

    def prune(self) -> list[str]:
        """Drop the pending transposes whose resource no user of the store references any more
        (their constants were replaced, e.g. by compressed ones): they are never made, and the
        store lets go of their placeholders (:attr:`by_name` still describes their data, as a
        view).  Does nothing for a store without users.  Returns the resource names dropped."""
        if not self.pending or not self._users:
            return []
        live: set[str] = set()
        for user in list(self._users):
            live |= referenced_resources(user.structural_module)
        dropped = [entry for entry in self.pending.values() if entry.name not in live]
        for entry in dropped:
            del self.pending[entry.tag]
            self._tensors = [t for t in self._tensors if t is not entry.placeholder]
        return [entry.name for entry in dropped]

    def materialize(self, referenced: Collection[str] | None = None) -> None:
        """Make the pending weights now (in place, so the IR is unchanged): for anything that
        reads the constants' data through MLIR rather than by saving.

        ``referenced``: only those of these resources (a module's
        :func:`referenced_resources`); the others stay pending.  Transposes no user of the
        store references are dropped first (:meth:`prune`)."""
        self.prune()
        for entry in list(self.pending.values()):
            if referenced is None or entry.name in referenced:
                del self.pending[entry.tag]
                entry.materialize()

    def derived(
        self, data: np.ndarray, name: str, tensor_type: ir.RankedTensorType
    ) -> ir.Attribute:
        """A resource of ``tensor_type`` over the bytes of ``data``, a buffer computed from
        weights at conversion time (bit-packed codes, scales, palettes), for
        ``coreai.constant`` ops (any number of them, in any graph of the program).

        ``data`` is kept alive (not copied) and must hold exactly the bytes the type needs:
        ``ceil(elements * bits / 8)``, sub-byte types bit-packed.  Derived constants are not
        :attr:`by_name` weights: passes that re-lay weights (``pretranspose``) leave them alone.
        """
        element = tensor_type.element_type
        bits = (
            ir.IntegerType(element).width
            if ir.IntegerType.isinstance(element)
            else ir.FloatType(element).width
        )
        numel = int(np.prod(tensor_type.shape, dtype=np.int64))
        expected = -(-numel * bits // 8)
        buffer = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        if buffer.size != expected:
            raise ValueError(
                f"derived constant '{name}' of type {tensor_type} needs {expected} bytes, got "
                f"{buffer.size}"
            )
        unique = self._unique_name(name)
        self.derived_bytes += buffer.size
        recipe = self._recipe
        if recipe is not None:
            index = self._recipe_count
            self._recipe_count += 1
            if buffer.size >= TAG_BYTES:  # a placeholder until it is written
                tag, placeholder = self._new_placeholder(
                    torch.empty(buffer.size, dtype=torch.uint8)
                )
                offset = recipe.keep(buffer)
                self.pending[tag] = PendingDerived(unique, tag, placeholder, recipe, index, offset)
                if offset is None:
                    recipe.waiting.add(index)
                buffer = placeholder.numpy()
        self.derived_by_name[unique] = buffer
        return ir.DenseResourceElementsAttr.get_from_buffer(buffer, unique, tensor_type)

    @contextlib.contextmanager
    def deferring(
        self, compute: Callable[[], list[np.ndarray]], spill: SpillFile | None = None
    ) -> Iterator[None]:
        """Inside the block, the buffers handed to :meth:`derived` are not kept in memory:
        their resources hold placeholders, filled when they are needed from ``spill``, where
        they are written now, or (no file, or no room in it) by ``compute()``, which must
        return the same buffers in the same order.  How a lazy weight is stored compressed
        without holding its codes until the asset is written, and fitted once."""
        self._recipe = _Recipe(compute, ir.Context.current, spill)
        self._recipe_count = 0
        try:
            yield
        finally:
            self._recipe = None
