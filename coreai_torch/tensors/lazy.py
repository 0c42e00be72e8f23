"""Weights that stay on disk until the asset is written: lazy tensors read from a checkpoint.

A model too large for memory is converted with its parameters as *lazy tensors*: fake tensors
(shapes and dtypes only, no memory) that know where their data comes from.  Tracing,
converting and optimizing work on the fake tensors; the data is read when it is needed -- one
weight at a time when ``compress()`` fits it, row block by row block while ``save_asset()``
writes it.

    with coreai_torch.empty_parameters():            # parameters on the meta device,
        model = MyModel(config)                       # buffers computed as usual
    weights = coreai_torch.WeightSource("checkpoint/")   # *.safetensors (sharded or not)
    weights.bind(model)                               # parameters -> lazy tensors (checked)
    ep = torch.export.export(model, args).run_decompositions(get_decomp_table())
    program = TorchConverter().add_exported_program(ep).to_coreai()
    program.optimize().save_asset("model.aimodel")

What a lazy tensor holds is an *expression*: a tensor of the checkpoint (:class:`Stored`), an
in-memory tensor (:class:`Held`) or an ATen op applied to other expressions (:class:`Call`).
Ops applied to lazy tensors outside of tracing (a cast to float16, a transpose, stacking the
experts of a mixture-of-experts layer) are recorded by :class:`LazyMode`, the fake-tensor mode
lazy tensors belong to, and replayed on the real data when it is read.  So the data a lazy
tensor stands for is exactly what PyTorch computes from the checkpoint's tensors.

Checkpoint tensors are read with ``pread`` into the caller's buffers (no memory map, so the
file's pages never count towards the process's memory), by whole rows along the first
dimension when the expression allows it (casts, copies, row slices), else whole.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from coreai_torch.errors import CheckpointError

#: safetensors dtype names -> torch dtypes
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

#: the attribute of a fake tensor that holds its expression
_SOURCE = "_coreai_lazy_source"


# -------------------------------------------------------------------------- expressions ---


class Expr:
    """What a lazy tensor's data is: :meth:`evaluate` computes it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    #: the data, kept once computed (tensors of at most ``KEEP_ELEMENTS`` elements)
    _value: torch.Tensor | None = None
    #: the data's statistics, once computed
    _statistics: Statistics | None = None

    def evaluate(self) -> torch.Tensor:
        """The whole tensor."""
        raise NotImplementedError

    def rows(self, first: int, count: int) -> torch.Tensor | None:
        """Rows ``first .. first + count`` (along the first dimension) without computing the
        rest, or None when the expression cannot read rows alone."""
        return None

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * self.dtype.itemsize

    def describe(self) -> str:
        """Where the data comes from, for messages."""
        return "a computed tensor"


@dataclass(eq=False)
class Entry:
    """One tensor of a safetensors file: where its bytes are."""

    name: str
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    #: absolute byte offset of the data in the file, and its length
    offset: int
    nbytes: int


class Stored(Expr):
    """A tensor of a checkpoint, read from its file."""

    def __init__(self, entry: Entry, reader: _Reader) -> None:
        self.entry = entry
        self.reader = reader
        self.shape = entry.shape
        self.dtype = entry.dtype

    def evaluate(self) -> torch.Tensor:
        return self.rows(0, self.shape[0] if self.shape else 1)

    def rows(self, first: int, count: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``first .. first + count - 1``, read into ``out`` if given (contiguous, of
        those rows' shape and dtype: a buffer reused across reads costs no new pages)."""
        shape = self.shape or (1,)
        if out is None:
            out = torch.empty((count, *shape[1:]), dtype=self.dtype)
        row_bytes = self.entry.nbytes // max(1, shape[0])
        self.reader.read_into(self.entry.path, self.entry.offset + first * row_bytes, out)
        return out if self.shape else out.reshape(())

    def describe(self) -> str:
        return f"tensor '{self.entry.name}' of {self.entry.path}"


class Held(Expr):
    """An in-memory tensor (the data is already there)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.detach()
        self.shape = tuple(tensor.shape)
        self.dtype = tensor.dtype

    def evaluate(self) -> torch.Tensor:
        return self.tensor

    def rows(self, first: int, count: int) -> torch.Tensor:
        return self.tensor[first : first + count]

    def describe(self) -> str:
        return "an in-memory tensor"


class Loaded(Expr):
    """A tensor a user's loader returns when called (``WeightSource({"w": loader})``)."""

    def __init__(self, name: str, loader: Callable[[], torch.Tensor], like: torch.Tensor) -> None:
        self.name = name
        self.loader = loader
        self.shape = tuple(like.shape)
        self.dtype = like.dtype

    def evaluate(self) -> torch.Tensor:
        tensor = self.loader()
        if not isinstance(tensor, torch.Tensor):
            raise CheckpointError(
                f"the loader of weight '{self.name}' returned {type(tensor).__name__}, not a tensor"
            )
        if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
            raise CheckpointError(
                f"the loader of weight '{self.name}' returned {tuple(tensor.shape)} "
                f"{tensor.dtype}; the model expects {self.shape} {self.dtype}"
            )
        return tensor.detach()

    def describe(self) -> str:
        return f"the loader of '{self.name}'"


#: ops whose result holds the same data as their input (copies or aliases)
_SAME_DATA = {
    torch.ops.aten.clone.default,
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.lift_fresh.default,
    torch.ops.aten.lift_fresh_copy.default,
}

#: ops that compute each row of their result from the same row of their first argument
_ROW_WISE = {torch.ops.aten._to_copy.default, *_SAME_DATA}


class Call(Expr):
    """An ATen op applied to expressions (and plain values)."""

    def __init__(self, func: Any, args: Any, kwargs: Any, out: torch.Tensor) -> None:
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.shape = tuple(out.shape)
        self.dtype = out.dtype

    def _inputs(self, value: Callable[[Expr], Any]) -> tuple[Any, Any]:
        inputs: tuple[Any, Any] = pytree.tree_map(
            lambda a: value(a) if isinstance(a, Expr) else a, (self.args, self.kwargs)
        )
        return inputs

    def evaluate(self) -> torch.Tensor:
        whole = self._by_rows()
        if whole is not None:
            return whole
        args, kwargs = self._inputs(lambda e: e.evaluate())
        with torch.no_grad():
            out: torch.Tensor = self.func(*args, **kwargs)
        return out

    def _by_rows(self) -> torch.Tensor | None:
        """The whole tensor computed by blocks of rows into one result (a chain of casts of a
        checkpoint tensor then holds the result and one block, not every intermediate)."""
        if self.func not in _ROW_WISE or not self.shape or self.shape[0] < 2:
            return None
        rows = self.shape[0]
        step = max(1, (64 << 20) // max(1, self.nbytes // rows))
        out: torch.Tensor | None = None
        for first in range(0, rows, step):
            block = self.rows(first, min(step, rows - first))
            if block is None:
                return None
            if out is None:
                out = torch.empty(self.shape, dtype=self.dtype)
            out[first : first + block.shape[0]] = block
        return out

    def rows(self, first: int, count: int) -> torch.Tensor | None:
        if self.func in _ROW_WISE and self.args and isinstance(self.args[0], Expr):
            source = self.args[0].rows(first, count)
            if source is None:
                return None
            with torch.no_grad():
                out: torch.Tensor = self.func(source, *self.args[1:], **self.kwargs)
            return out
        return None

    def describe(self) -> str:
        sources = [a.describe() for a in pytree.tree_leaves(self.args) if isinstance(a, Expr)]
        return f"{self.func} of {', '.join(sources) or 'constants'}"


# -------------------------------------------------------------------------- lazy tensors ---


class LazyMode(FakeTensorMode):
    """The fake-tensor mode of lazy tensors: while :attr:`recording`, every op that reads a
    lazy tensor gives lazy results (their expressions record the op)."""

    def __init__(self) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self._recording = threading.local()

    @property
    def recording(self) -> bool:
        return getattr(self._recording, "on", True)

    @contextlib.contextmanager
    def paused(self, paused: bool = True) -> Iterator[None]:
        """No recording inside the block (``torch.export`` tracing: its ops are the
        program's, not the weights'); ``paused=False``: recording, also inside a paused
        block."""
        before = self.recording
        self._recording.on = not paused
        try:
            yield
        finally:
            self._recording.on = before

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if not self.recording:
            return out
        leaves = pytree.tree_leaves((args, kwargs))
        if not any(isinstance(leaf, torch.Tensor) and is_lazy(leaf) for leaf in leaves):
            return out
        recorded_args, recorded_kwargs = pytree.tree_map(_as_expr, (args, kwargs))
        for item in pytree.tree_leaves(out):
            if isinstance(item, FakeTensor):
                setattr(item, _SOURCE, Call(func, recorded_args, recorded_kwargs, item))
        return out


def _as_expr(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        source = getattr(value, _SOURCE, None)
        if source is not None:
            return source
        if isinstance(value, FakeTensor):
            raise CheckpointError(
                "an op reads a fake tensor whose data is unknown (not a lazy weight): create "
                "the module's parameters with coreai_torch.empty_parameters() and bind them "
                "with WeightSource.bind(), or compute this tensor from real tensors"
            )
        return Held(value)
    return value


#: the mode every lazy tensor of this process belongs to
MODE = LazyMode()


def lazy_tensor(source: Expr) -> torch.Tensor:
    """A lazy tensor standing for ``source``'s data (a fake CPU tensor of its shape and
    dtype)."""
    with MODE:
        tensor = torch.empty(source.shape, dtype=source.dtype)
    setattr(tensor, _SOURCE, source)
    return tensor


def is_lazy(tensor: object) -> bool:
    """Whether ``tensor`` is a lazy tensor (its data read when needed)."""
    return isinstance(tensor, FakeTensor) and getattr(tensor, _SOURCE, None) is not None


def source_of(tensor: torch.Tensor) -> Expr:
    """The expression of a lazy tensor."""
    source = getattr(tensor, _SOURCE, None)
    if not isinstance(source, Expr):
        raise TypeError(f"not a lazy tensor: {type(tensor).__name__}")
    return source


#: lazy tensors of at most this many elements keep their data once read (conversion-time
#: folding reads small weights, and views of one tensor must be the same tensor, as they are
#: for weights in memory)
KEEP_ELEMENTS = 1 << 16


def materialize(tensor: torch.Tensor) -> torch.Tensor:
    """The data of ``tensor``: read (and computed) now for a lazy tensor; the tensor itself
    otherwise.  Small lazy tensors (:data:`KEEP_ELEMENTS`) are read once."""
    if not is_lazy(tensor):
        return tensor
    source = source_of(tensor)
    kept = source._value
    if kept is not None:
        return kept
    value = source.evaluate()
    if tuple(value.shape) != tuple(tensor.shape) or value.dtype != tensor.dtype:
        raise CheckpointError(
            f"{source_of(tensor).describe()} gave {tuple(value.shape)} {value.dtype}, "
            f"expected {tuple(tensor.shape)} {tensor.dtype}"
        )
    if tensor.numel() <= KEEP_ELEMENTS:
        source._value = value
    return value


def read_rows(tensor: torch.Tensor, first: int, count: int) -> torch.Tensor | None:
    """Rows ``first .. first + count`` of a lazy tensor read alone (as ``tensor[first : first
    + count]``: those past its last row are not read), or None if its expression needs the
    whole tensor."""
    if tensor.dim():
        count = max(0, min(count, tensor.shape[0] - first))
    return source_of(tensor).rows(first, count)


@dataclass(frozen=True)
class Statistics:
    """What checks want to know of a weight's values, found in one pass over them."""

    #: largest magnitude among the finite values (0 for none)
    finite_peak: float
    nan: int
    inf: int


#: bytes of a lazy tensor read at a time to compute its :class:`Statistics`
STATISTICS_BLOCK = 64 << 20


def statistics(tensor: torch.Tensor) -> Statistics:
    """The :class:`Statistics` of ``tensor``'s values.  A lazy tensor's are remembered, and
    derived from its source's through copies and casts where that is exact (a cast rounds each
    value on its own, so the largest rounded value is the rounded largest one); a checkpoint
    tensor is read once, by blocks of rows."""
    if not is_lazy(tensor):
        return _statistics([tensor.detach()])
    return _source_statistics(source_of(tensor))


def _source_statistics(source: Expr) -> Statistics:
    found = source._statistics
    if found is not None:
        return found
    if (
        isinstance(source, Call)
        and source.func in _ROW_WISE
        and isinstance(source.args[0], Expr)
        and source.args[0].dtype.is_floating_point
        and source.dtype.is_floating_point
    ):
        inner = _source_statistics(source.args[0])
        peak = torch.tensor(inner.finite_peak, dtype=torch.float64).to(source.dtype)
        if torch.isfinite(peak):  # nothing overflows
            found = Statistics(float(peak), inner.nan, inner.inf)
    if found is None:
        rows = source.shape[0] if source.shape else 1
        step = max(1, STATISTICS_BLOCK // max(1, source.nbytes // max(1, rows)))
        if isinstance(source, Stored) and source.shape:
            buffer = torch.empty((min(step, rows), *source.shape[1:]), dtype=source.dtype)
            found = _statistics(
                source.rows(first, len(part), out=part)
                for first in range(0, rows, step)
                for part in (buffer[: min(step, rows - first)],)
            )
        elif source.shape and source.rows(0, min(step, rows)) is not None:
            found = _statistics(
                source.rows(first, min(step, rows - first)) for first in range(0, rows, step)
            )
        else:
            found = _statistics([source.evaluate()])
    source._statistics = found
    return found


@contextlib.contextmanager
def statistics_in_background(tensors: Iterable[torch.Tensor]) -> Iterator[None]:
    """Compute the :func:`statistics` of the lazy ``tensors`` on another thread while the
    block runs (the checkpoint is read on a second core while, say, the model is traced), and
    wait for them at its end.  A tensor whose statistics cannot be computed is left for the
    caller's own :func:`statistics` call to report."""
    sources = list({id(s): s for s in map(source_of, filter(is_lazy, tensors))}.values())
    stop = threading.Event()

    def work() -> None:
        for source in sources:
            if stop.is_set():
                return
            with contextlib.suppress(Exception):
                _source_statistics(source)

    thread = threading.Thread(target=work, name="coreai-weight-statistics", daemon=True)
    thread.start()
    try:
        yield
    except BaseException:
        stop.set()
        raise
    finally:
        thread.join()


def _statistics(blocks: Any) -> Statistics:
    peak, nan, inf = 0.0, 0, 0
    for block in blocks:
        if block.numel() == 0 or not block.dtype.is_floating_point:
            continue
        low, high = torch.aminmax(block.reshape(-1))
        largest = max(-float(low), float(high))
        if math.isfinite(largest):  # one pass: no NaN, no infinity
            peak = max(peak, largest)
            continue
        values = block.float().abs()
        finite = torch.isfinite(values)
        nan += int(torch.isnan(values).sum())
        inf += int(torch.isinf(values).sum())
        if bool(finite.any()):
            peak = max(peak, float(values[finite].amax()))
    return Statistics(peak, nan, inf)


@contextlib.contextmanager
def tracing() -> Iterator[None]:
    """Trace (``torch.export``) a module holding lazy tensors: their ops are not recorded."""
    with MODE.paused():
        yield


def converted(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` (detached) in ``dtype``; of a lazy tensor a lazy one, cast when its data is
    read (also inside :func:`tracing`)."""
    with MODE.paused(False), torch.no_grad():
        return tensor.detach().to(dtype)


def key(tensor: torch.Tensor) -> tuple[Any, ...]:
    """A key that is equal for two tensors holding the same data (storage and layout; for
    lazy tensors: the expression they read, seen through copies and aliases, as a weight
    detached in each traced entry point is still one weight)."""
    if isinstance(tensor, FakeTensor):
        source = getattr(tensor, _SOURCE, None)
        if source is None:
            return ("fake", id(tensor))
        while (
            isinstance(source, Call)
            and source.func in _SAME_DATA
            and source.args
            and isinstance(source.args[0], Expr)
        ):
            source = source.args[0]
        return ("lazy", id(source), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
    return (
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
    )


# ---------------------------------------------------------------------------- checkpoints ---


class _Reader:
    """Reads byte ranges of files into tensors with ``pread`` (one descriptor per file)."""

    def __init__(self) -> None:
        self._files: dict[Path, int] = {}
        self._lock = threading.Lock()

    def read_into(self, path: Path, offset: int, out: torch.Tensor) -> None:
        with self._lock:
            fd = self._files.get(path)
            if fd is None:
                fd = self._files[path] = os.open(path, os.O_RDONLY)
        view = out.view(torch.uint8).numpy().reshape(-1).data
        done = 0
        while done < len(view):
            count = os.preadv(fd, [view[done:]], offset + done)
            if count <= 0:
                raise CheckpointError(
                    f"{path} ends at byte {offset + done}, before the tensor data it lists: "
                    "the file is truncated"
                )
            done += count

    def close(self) -> None:
        with self._lock:
            for fd in self._files.values():
                os.close(fd)
            self._files.clear()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def _safetensors_files(path: Path) -> list[Path]:
    """The files of a checkpoint: ``path`` itself, the shards its index lists, or every
    ``*.safetensors`` of a directory; missing shards are an error naming them."""
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint (a .safetensors file or a directory)")
    if path.is_file():
        return [path]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as error:
            raise CheckpointError(f"{index}: not a safetensors index ({error})") from error
        files = sorted({path / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(
                f"{index} lists {len(missing)} shard(s) that are not in {path}: "
                f"{', '.join(missing)}; the checkpoint is incomplete (download or copy them)"
            )
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    return files


def read_index(path: Path) -> dict[str, Entry]:
    """The tensors of one safetensors file (header only), checked against its size."""
    size = path.stat().st_size
    with open(path, "rb") as file:
        head = file.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: not a safetensors file (shorter than its header)")
        (length,) = struct.unpack("<Q", head)
        if length > min(size - 8, 100 << 20):
            raise CheckpointError(f"{path}: not a safetensors file (header of {length} bytes)")
        try:
            header = json.loads(file.read(length))
        except ValueError as error:
            raise CheckpointError(f"{path}: its safetensors header is not JSON ({error})") from None
    start = 8 + length
    entries: dict[str, Entry] = {}
    end = start
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise CheckpointError(f"{path}: tensor '{name}' has unsupported dtype {info!r}")
        begin, stop = info["data_offsets"]
        shape = tuple(int(d) for d in info["shape"])
        numel = 1
        for d in shape:
            numel *= d
        if stop - begin != numel * dtype.itemsize:
            raise CheckpointError(
                f"{path}: tensor '{name}' spans {stop - begin} bytes, but {shape} {dtype} needs "
                f"{numel * dtype.itemsize}"
            )
        entries[name] = Entry(name, path, dtype, shape, start + begin, stop - begin)
        end = max(end, start + stop)
    if end > size:
        raise CheckpointError(
            f"{path} is truncated: its header lists {end} bytes of tensor data, the file has "
            f"{size}; copy or download it again"
        )
    return entries


# -------------------------------------------------------------------------- weight source ---


@dataclass
class WeightSource:
    """Where a model's weights come from when they are not in memory: a safetensors file, a
    directory of them (sharded with ``model.safetensors.index.json``, as ``save_pretrained``
    writes them, or not), or a mapping from names to tensors or to loaders
    (``fn() -> Tensor``, called when the data is needed).

    ``prefix`` is prepended to the names of the module's parameters before they are looked up
    (``prefix="model."`` when the checkpoint was saved from a wrapper), ``strip`` removed
    from them.  :meth:`bind` replaces a module's parameters on the meta device by lazy tensors.
    """

    location: str | os.PathLike[str] | Mapping[str, Any]
    prefix: str = ""
    strip: str = ""
    entries: dict[str, Expr] = field(init=False, default_factory=dict)
    #: the tensor names of the checkpoint, per file (for messages)
    files: list[Path] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self._reader = _Reader()
        if isinstance(self.location, Mapping):
            for name, value in self.location.items():
                if isinstance(value, torch.Tensor):
                    self.entries[name] = source_of(value) if is_lazy(value) else Held(value)
                elif callable(value):
                    self.entries[name] = _Deferred(name, value)
                else:
                    raise TypeError(
                        f"WeightSource: '{name}' maps to a {type(value).__name__}; give tensors "
                        "or loaders fn() -> Tensor"
                    )
            return
        if not isinstance(self.location, (str, os.PathLike)):
            raise TypeError(
                "WeightSource takes a safetensors file or directory, or a mapping from names to "
                f"tensors or loaders; got {type(self.location).__name__}"
            )
        self.files = _safetensors_files(Path(self.location))
        for path in self.files:
            for name, entry in read_index(path).items():
                self.entries[name] = Stored(entry, self._reader)

    @property
    def nbytes(self) -> int:
        """Bytes of the source's tensors (of those whose size is known)."""
        return sum(e.nbytes for e in self.entries.values() if not isinstance(e, _Deferred))

    def name_for(self, parameter: str) -> str:
        """The source's name for a module's parameter ``parameter``."""
        name = parameter.removeprefix(self.strip) if self.strip else parameter
        return self.prefix + name

    def bind(self, module: nn.Module) -> nn.Module:
        """Replace every parameter of ``module`` on the meta device by a lazy tensor of the
        source (in place; returns ``module``).  Tied parameters stay tied: a parameter shared
        under several names is looked up under each until one is found.  Raises
        :class:`~coreai_torch.errors.CheckpointError` naming the tensor and the file when a
        parameter is missing or its shape disagrees; a dtype that differs is cast (the model's
        dtype wins, as ``load_state_dict`` does).  Buffers stay as they are."""
        owners: dict[int, list[tuple[nn.Module, str, str]]] = {}
        tensors: dict[int, torch.Tensor] = {}
        for module_name, submodule in module.named_modules(remove_duplicate=False):
            for attr, parameter in submodule._parameters.items():
                if parameter is None or not parameter.is_meta:
                    continue
                full = f"{module_name}.{attr}" if module_name else attr
                owners.setdefault(id(parameter), []).append((submodule, attr, full))
                tensors[id(parameter)] = parameter
        problems: list[str] = []
        bound: dict[int, torch.Tensor] = {}
        for ident, places in owners.items():
            parameter = tensors[ident]
            names = [self.name_for(full) for _, _, full in places]
            expr = next((self.entries[n] for n in names if n in self.entries), None)
            if expr is None:
                problems.append(
                    f"'{names[0]}' is not in the checkpoint"
                    + (f" (nor {', '.join(repr(n) for n in names[1:])})" if len(names) > 1 else "")
                )
                continue
            if isinstance(expr, _Deferred):
                expr = Loaded(expr.name, expr.loader, parameter)
            elif tuple(expr.shape) != tuple(parameter.shape):
                problems.append(
                    f"{expr.describe()} has shape {tuple(expr.shape)}, but the model's "
                    f"'{places[0][2]}' is {tuple(parameter.shape)} (does the configuration "
                    "match the checkpoint?)"
                )
                continue
            tensor = lazy_tensor(expr)
            if tensor.dtype != parameter.dtype:
                with torch.no_grad():  # recorded: the cast is made when the data is read
                    tensor = tensor.to(parameter.dtype)
            bound[ident] = tensor
        if problems:
            shown = "\n  ".join(problems[:20])
            more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
            raise CheckpointError(
                f"the checkpoint {self._where()} does not hold the weights of "
                f"{type(module).__name__}:\n  {shown}{more}"
            )
        for ident, places in owners.items():
            lazy = nn.Parameter(bound[ident], requires_grad=False)
            for submodule, attr, _ in places:
                submodule._parameters[attr] = lazy
        return module

    def _where(self) -> str:
        if self.files:
            return str(self.files[0].parent if len(self.files) > 1 else self.files[0])
        return "(a mapping)"

    def close(self) -> None:
        """Close the checkpoint's files (they are reopened if read again)."""
        self._reader.close()


@dataclass(eq=False)
class _Deferred(Expr):
    """A loader of a mapping source, until :meth:`WeightSource.bind` knows its shape."""

    name: str
    loader: Callable[[], torch.Tensor]


@contextlib.contextmanager
def empty_parameters() -> Iterator[None]:
    """Create modules with their parameters on the meta device (no memory, no
    initialisation) and their buffers computed as usual: bind the parameters to a checkpoint
    with :meth:`WeightSource.bind` afterwards.  Parameters shared by several modules stay
    shared."""
    register = nn.Module.register_parameter

    def register_on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]
