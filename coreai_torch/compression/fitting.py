"""Fitting compressed codes to float weights: linear quantization per block (torch kernels
over numpy views, in cache-sized steps on every core), palettes by weighted k-means (numpy)
and magnitude pruning (the kept values and a mask).  ``AIProgram.compress()``
(:mod:`coreai_torch.compression.apply`) calls these and emits the results with
:mod:`coreai_torch.ir.compressed`.

Parameters are given by their shape: ``params[d]`` blocks along axis ``d`` of the weight (a
``[N, K]`` weight with ``params == [N, K // 32]`` has one scale per row and block of 32).

Palettes: Lloyd's algorithm on each palette's values, vectorised over all palettes of a
weight at once.  Large groups are first reduced to a histogram of ``HISTOGRAM_BINS`` bins
(each bin's mean, weighted by its count: the *weighted* k-means), which makes a fit cost a
few passes over the weight whatever its size; centroids start at the weighted quantiles.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import numpy as np
import torch

from coreai_torch.ir.compressed import LinearCodes, PaletteCodes, SparseCodes

#: values per palette above which k-means runs on a histogram of this many bins
HISTOGRAM_BINS = 4096
#: weight elements processed per step (bounds the temporary memory)
CHUNK = 1 << 22


def _blocked(shape: Sequence[int], params: Sequence[int]) -> tuple[list[int], tuple[int, ...]]:
    """The shape that splits each axis into (blocks, elements per block), and the axes of
    the elements within a block."""
    split: list[int] = []
    for size, blocks in zip(shape, params, strict=True):
        split += [blocks, size // blocks]
    return split, tuple(range(1, 2 * len(shape), 2))


def _chunks(
    shape: Sequence[int], params: Sequence[int], size: int = CHUNK
) -> Iterator[tuple[tuple[slice, ...], list[int]]]:
    """``(index, params of the chunk)`` for slices of about ``size`` elements of the weight
    along an axis whose every index has its own parameters (so that no block spans two
    chunks); the same index selects the chunk's parameters."""
    axis = next((a for a, (s, p) in enumerate(zip(shape, params, strict=True)) if s == p), None)
    total = int(np.prod(shape))
    if axis is None or total <= size:
        yield tuple(slice(None) for _ in shape), list(params)
        return
    step = max(1, size * shape[axis] // total)
    for start in range(0, shape[axis], step):
        index = [slice(None)] * len(shape)
        index[axis] = slice(start, start + step)
        chunk = list(params)
        chunk[axis] = min(step, shape[axis] - start)
        yield tuple(index), chunk


class _Noise:
    """Σw² and Σ(w - ŵ)² accumulated over chunks, for the fit's signal-to-noise ratio."""

    def __init__(self) -> None:
        self.signal = 0.0
        self.noise = 0.0

    def add(self, weight: np.ndarray | torch.Tensor, error: np.ndarray | torch.Tensor) -> None:
        """Add a chunk of the weight and the error of its approximation (same shape)."""
        self.add_norms(_norm(weight), _norm(error))

    def add_norms(self, weight: float, error: float) -> None:
        """Add a chunk given by the norms of the weight and of the error."""
        self.signal += weight**2
        self.noise += error**2

    @property
    def snr_db(self) -> float:
        """10·log10(Σw² / Σ(w - ŵ)²) in dB."""
        if self.noise == 0:
            return math.inf
        return 10 * math.log10(self.signal / self.noise) if self.signal > 0 else -math.inf


#: float32 norms at least this large are exact enough: no square of an element that matters
#: left float32's range (squares of values below ~1e-19 underflow, above ~1e19 overflow)
_FLOAT32_NORM_FLOOR = 1e-10


def _norm(values: np.ndarray | torch.Tensor) -> float:
    """‖values‖₂: in float32 (25× faster than float64 on the CPU), again in float64 when a
    float32 sum of squares may have left float32's range (an infinite or tiny result)."""
    tensor = torch.from_numpy(values) if isinstance(values, np.ndarray) else values
    tensor = tensor.reshape(-1)
    if tensor.dtype == torch.float32:
        norm = float(torch.linalg.vector_norm(tensor))
        if math.isfinite(norm) and norm >= _FLOAT32_NORM_FLOOR:
            return norm
    return float(torch.linalg.vector_norm(tensor, dtype=torch.float64))


def return_freed_memory() -> None:
    """Give the heap memory freed by a fit back to the system (glibc's ``malloc_trim``):
    the chunk-sized temporaries of one weight after another, between the compressed results
    that stay, otherwise fragment the heap and the process keeps a fifth of the weights'
    size it no longer uses.  Nothing to do elsewhere."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    import ctypes

    try:
        return ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None


class Slices(Protocol):
    """A weight read by slices, each a float32 array (a weight converted from another dtype,
    or read from its checkpoint, as it is fitted)."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def ndim(self) -> int: ...

    def __getitem__(self, index: tuple[slice, ...], /) -> np.ndarray: ...


def quantize_linear(
    weight: np.ndarray | Slices,
    params: Sequence[int],
    bits: int,
    *,
    symmetric: bool = True,
    scale_dtype: torch.dtype = torch.float32,
    workers: Workers | None = None,
) -> tuple[LinearCodes, float]:
    """``weight`` as ``bits``-bit codes with one scale (and zero point) per block, and the
    fit's SNR in dB.  ``weight`` may be any strided view, or anything that gives float32
    views of its slices (``weight[index]``): it is read in steps of ``LINEAR_CHUNK``
    elements, shared by the threads of ``workers`` (an entered :class:`Workers`; default:
    workers of its own).

    Symmetric: ``scale = max|w| / (2**(bits-1) - 1)``, codes in ``[-2**(bits-1), 2**(bits-1)-1]``.
    Asymmetric: ``scale = (max - min) / (2**bits - 1)`` over the block's range widened to
    include 0, ``zero_point = round(-min / scale)``, unsigned codes.  Scales are rounded to
    ``scale_dtype`` before the codes are computed, so codes and stored scales agree.
    """
    if workers is None:
        with Workers() as own:
            return quantize_linear(
                weight, params, bits, symmetric=symmetric, scale_dtype=scale_dtype, workers=own
            )
    params = list(params)
    shape = list(weight.shape)
    fit = _LinearFit(
        weight,
        bits,
        symmetric,
        scale_dtype,
        codes=np.empty(shape, np.int8 if symmetric else np.uint8),
        scale=np.empty(params, np.float32),
        zero_point=None if symmetric else np.empty(params, np.int32),
    )
    steps = list(_chunks(shape, params, LINEAR_CHUNK))
    noise = _Noise()
    largest = max(_elements(shape, index) for index, _ in steps)
    for signal, error in workers.map(fit, steps, largest):
        noise.add_norms(signal, error)
    return_freed_memory()
    return (
        LinearCodes(fit.codes, bits, fit.scale, fit.zero_point, signed=symmetric),
        noise.snr_db,
    )


#: weight elements per step of :func:`quantize_linear`: the step's float32 temporaries stay
#: in a core's cache (memory traffic, not arithmetic, bounds the fit: steps of 4M elements
#: take 1.5x longer)
LINEAR_CHUNK = 1 << 18
#: threads fitting at most (each runs torch's kernels on one core; Python's share of a step
#: would serialise more)
MAX_THREADS = 8


class _LinearFit:
    """One step of :func:`quantize_linear`: the codes, scales (and zero points) of a slice
    of the weight, written into the whole weight's arrays."""

    def __init__(
        self,
        weight: np.ndarray | Slices,
        bits: int,
        symmetric: bool,
        scale_dtype: torch.dtype,
        *,
        codes: np.ndarray,
        scale: np.ndarray,
        zero_point: np.ndarray | None,
    ) -> None:
        self.weight, self.symmetric, self.scale_dtype = weight, symmetric, scale_dtype
        self.high = (1 << (bits - 1)) - 1 if symmetric else (1 << bits) - 1
        self.codes, self.scale, self.zero_point = codes, scale, zero_point

    def __call__(
        self, step: tuple[tuple[slice, ...], list[int]], scratch: torch.Tensor
    ) -> tuple[float, float]:
        """Fit the slice ``step`` (index, its parameters' shape); ``scratch``: ``[4, n]``
        float32 for the step's temporaries.  Returns the slice's ``(‖w‖, ‖w - ŵ‖)``."""
        index, params = step
        w = torch.from_numpy(np.asarray(self.weight[index], dtype=np.float32))
        size = w.numel()
        order = _dense_order(w)
        if order is None:  # not a permutation of a dense block: gathered into the scratch
            w = scratch[0, :size].view(w.shape).copy_(w)
            order = list(range(w.dim()))
        # computed in the order the slice's elements lie in memory (a weight stored
        # transposed is read by rows): the blocks are the same, only the loops differ
        w = w.permute(order)
        params = [params[a] for a in order]
        codes = torch.from_numpy(self.codes[index])
        scale = torch.from_numpy(self.scale[index]).permute(order)
        split, inner = _blocked(w.shape, params)
        blocks = w.view(split)
        q, error = scratch[1, :size].view(split), scratch[2, :size].view(split)
        high = self.high
        if self.symmetric:
            s = torch.abs(blocks, out=q).amax(dim=inner, keepdim=True) / high
        else:
            lo = blocks.amin(dim=inner, keepdim=True).clamp_(max=0)
            hi = blocks.amax(dim=inner, keepdim=True).clamp_(min=0)
            s = (hi - lo) / high
        s = s.to(self.scale_dtype).float()
        s[s == 0] = 1.0  # an all-zero block (or a scale below the storage precision)
        torch.div(blocks, s, out=q).round_()
        scale.copy_(s.view(params))
        if self.symmetric:
            q.clamp_(-high - 1, high)
            torch.addcmul(blocks, q, s, value=-1, out=error)
        else:
            zp = torch.round(-lo / s).clamp_(0, high)
            assert self.zero_point is not None
            torch.from_numpy(self.zero_point[index]).permute(order).copy_(zp.view(params))
            q.add_(zp).clamp_(0, high)
            torch.addcmul(blocks, torch.sub(q, zp, out=error), s, value=-1, out=error)
        staged = scratch[3].view(codes.dtype)  # the codes, before they are laid out
        _write(codes, staged[:size].view(w.shape).copy_(q.view(w.shape)), order, staged[size:])
        return _norm(blocks), _norm(error)


def _write(
    target: torch.Tensor, values: torch.Tensor, order: list[int], staging: torch.Tensor
) -> None:
    """``target[...] = values.permute(inverse of order)``: through a contiguous block of
    ``staging`` (of ``values``'s dtype) when ``target`` is a strided slice (torch transposes
    2-D blocks a cache-sized tile at a time only into contiguous memory)."""
    inverse = sorted(range(len(order)), key=order.__getitem__)
    values = values.permute(inverse)
    if target.is_contiguous() or values.is_contiguous():
        target.copy_(values)
    else:
        target.copy_(staging[: values.numel()].view(values.shape).copy_(values))


def _elements(shape: Sequence[int], index: tuple[slice, ...]) -> int:
    """Elements of ``weight[index]`` (at least 1), ``weight`` of ``shape``."""
    sizes = [len(range(*part.indices(n))) for n, part in zip(shape, index, strict=True)]
    return max(1, math.prod(sizes))


def _dense_order(tensor: torch.Tensor) -> list[int] | None:
    """The permutation of ``tensor``'s axes that makes it contiguous (axes by decreasing
    stride), or None if none does."""
    strides = tensor.stride()
    order = sorted(range(tensor.dim()), key=lambda a: -strides[a])
    return order if tensor.permute(order).is_contiguous() else None


_Step = TypeVar("_Step")
_Result = TypeVar("_Result")


class Workers:
    """The threads fits share their steps among (as many as torch has intra-op threads, up to
    ``MAX_THREADS``) and their scratch buffers, kept from one weight to the next (fresh
    memory costs a page fault per 4 KiB page the first time it is written, more than the
    arithmetic on it).

    While entered, torch's kernels run on one thread: each fitting thread runs its own on a
    core (torch's kernels release the GIL), and neither they nor the kernels of the thread
    that entered (bit-packing the codes) wait at every kernel for a thread of their team that
    another process holds, as kernels split over threads do on a busy machine."""

    def __init__(self) -> None:
        self.threads = max(1, min(torch.get_num_threads(), MAX_THREADS))
        self._buffers: list[torch.Tensor] = []
        self._before: list[int] = []

    def __enter__(self) -> Workers:
        self._before.append(torch.get_num_threads())
        torch.set_num_threads(1)  # threads started meanwhile take it too
        return self

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self._before.pop())

    def map(
        self, work: Callable[[_Step, torch.Tensor], _Result], steps: list[_Step], elements: int
    ) -> list[_Result]:
        """``[work(step, buffer) for step in steps]``, the steps shared by the threads, each
        with a ``[4, elements]`` float32 buffer of its own."""
        threads = min(self.threads, len(steps))
        buffers = self._scratch(max(1, threads), elements)
        if threads <= 1:
            return [work(step, buffers[0]) for step in steps]
        results: list[Any] = [None] * len(steps)
        failed = threading.Event()

        def run(first: int) -> None:
            for i in range(first, len(steps), threads):
                if failed.is_set():
                    return
                try:
                    results[i] = work(steps[i], buffers[first])
                except BaseException:
                    failed.set()
                    raise

        with ThreadPoolExecutor(threads) as pool:
            for future in [pool.submit(run, k) for k in range(threads)]:
                future.result()
        return results

    def _scratch(self, count: int, elements: int) -> list[torch.Tensor]:
        """``count`` buffers of ``[4, elements]`` float32."""
        while len(self._buffers) < count:
            self._buffers.append(torch.empty(0))
        for k in range(count):
            if self._buffers[k].numel() < 4 * elements:
                self._buffers[k] = torch.empty(4 * elements)
        return [b[: 4 * elements].view(4, elements) for b in self._buffers[:count]]


# ------------------------------------------------------------------------------ palettes ---


def _rows_searchsorted(rows: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """``np.searchsorted(rows[g], queries[g])`` for every row ``g`` at once (``rows`` sorted
    per row): each row and its queries are mapped into an interval of their own."""
    low = np.minimum(rows.min(1, initial=np.inf), queries.min(1)).astype(np.float64)[:, None]
    high = np.maximum(rows.max(1, initial=-np.inf), queries.max(1)).astype(np.float64)[:, None]
    span = np.where(high > low, high - low, 1.0)
    offset = 2.0 * np.arange(rows.shape[0], dtype=np.float64)[:, None]
    line = ((rows - low) / span + offset).ravel()
    found = np.searchsorted(line, ((queries - low) / span + offset).ravel(), side="left")
    return found.reshape(queries.shape) - (np.arange(rows.shape[0]) * rows.shape[1])[:, None]


def _histogram(
    values: np.ndarray, bins: int, weights: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the (weighted) mean value in each of ``bins`` equal bins and the bin counts
    (or weights) (read in chunks of columns, so the temporaries stay small)."""
    groups, count = values.shape
    low = values.min(1, keepdims=True).astype(np.float64)
    width = (values.max(1, keepdims=True).astype(np.float64) - low) / bins
    width[width == 0] = 1.0
    offsets = (np.arange(groups) * bins)[:, None]
    counts = np.zeros(groups * bins)
    sums = np.zeros(groups * bins)
    step = max(1, CHUNK // groups)
    for start in range(0, count, step):
        part = values[:, start : start + step]
        which = np.clip(((part - low) / width).astype(np.int64), 0, bins - 1) + offsets
        if weights is None:
            counts += np.bincount(which.ravel(), minlength=groups * bins)
            sums += np.bincount(which.ravel(), part.ravel().astype(np.float64), groups * bins)
        else:
            mass = weights[:, start : start + step].astype(np.float64)
            counts += np.bincount(which.ravel(), mass.ravel(), groups * bins)
            sums += np.bincount(which.ravel(), (part * mass).ravel(), groups * bins)
    counts, sums = counts.reshape(groups, bins), sums.reshape(groups, bins)
    centers = low + (np.arange(bins) + 0.5) * width
    means = np.where(counts > 0, sums / np.maximum(counts, 1), centers)
    return means, counts


def kmeans_1d(
    values: np.ndarray, k: int, iterations: int = 100, weights: np.ndarray | None = None
) -> np.ndarray:
    """Sorted centroids ``[groups, k]`` of weighted 1-D k-means on each row of ``values``;
    ``weights`` (``values``' shape, nonnegative): how much each value counts (default 1).

    With the points of a row sorted, each cluster is a run of points between two
    boundaries: an iteration finds the runs by binary search and their weighted means from
    prefix sums, ``O(groups * k * log points)``.
    """
    groups, count = values.shape
    if count > HISTOGRAM_BINS:  # bin means, in order, weighted by their counts
        points, weights = _histogram(values, HISTOGRAM_BINS, weights)
    elif weights is None:
        points = np.sort(np.asarray(values, dtype=np.float64), 1)
        weights = np.ones_like(points)
    else:
        order = np.argsort(values, 1)
        points = np.take_along_axis(np.asarray(values, dtype=np.float64), order, 1)
        weights = np.take_along_axis(np.asarray(weights, dtype=np.float64), order, 1)
    zero = np.zeros((groups, 1))
    mass_before = np.concatenate([zero, np.cumsum(weights, 1)], 1)
    total_before = np.concatenate([zero, np.cumsum(weights * points, 1)], 1)
    targets = (np.arange(k) + 0.5) / k * mass_before[:, -1:]
    start = np.clip(_rows_searchsorted(mass_before[:, 1:], targets), 0, points.shape[1] - 1)
    centroids = np.take_along_axis(points, start, 1)
    ends = np.full((groups, 1), points.shape[1])
    split = None
    for _ in range(iterations):
        centroids = np.sort(centroids, 1)
        boundaries = (centroids[:, 1:] + centroids[:, :-1]) / 2
        new = _rows_searchsorted(points, boundaries)
        if split is not None and np.array_equal(new, split):
            break
        split = new
        edges = np.concatenate([np.zeros_like(ends), split, ends], 1)
        mass = np.diff(np.take_along_axis(mass_before, edges, 1), axis=1)
        total = np.diff(np.take_along_axis(total_before, edges, 1), axis=1)
        centroids = np.where(mass > 0, total / np.maximum(mass, 1e-300), centroids)
    return np.sort(centroids, 1)


def palettize(
    weight: np.ndarray,
    channel_axis: int,
    group_size: int | None,
    bits: int,
    iterations: int = 100,
    batch_axes: Sequence[int] = (),
) -> tuple[PaletteCodes, float]:
    """``weight`` as ``bits``-bit indices into palettes fitted by :func:`kmeans_1d` (one
    palette per ``group_size`` indices along ``channel_axis``; None: one for the weight, and
    separate palettes for each index of the ``batch_axes``, e.g. each expert of a stack),
    and the fit's SNR in dB."""
    shape = list(weight.shape)
    channels = shape[channel_axis]
    size = channels if group_size is None else group_size
    groups = channels // size
    lead = [*batch_axes, channel_axis]
    batches = [shape[a] for a in batch_axes]
    moved = np.moveaxis(np.asarray(weight, dtype=np.float32), lead, list(range(len(lead))))
    moved_shape = moved.shape
    rows = moved.reshape(math.prod(batches) * groups, -1)
    k = 1 << bits
    palettes = kmeans_1d(rows, k, iterations).astype(np.float32)
    boundaries = (palettes[:, 1:] + palettes[:, :-1]) / 2
    indices = np.empty(rows.shape, np.uint8)
    noise = _Noise()
    single = rows.shape[0] == 1
    rows_per_step = max(1, CHUNK // rows.shape[1])
    columns_per_step = CHUNK if single else rows.shape[1]
    for start in range(0, rows.shape[0], rows_per_step):
        for column in range(0, rows.shape[1], columns_per_step):
            part = (slice(start, start + rows_per_step), slice(column, column + columns_per_step))
            chunk = rows[part]
            found = (
                np.searchsorted(boundaries[0], chunk[0])[None]
                if single
                else _rows_searchsorted(boundaries[part[0]], chunk)
            )
            indices[part] = found
            noise.add(chunk, chunk - np.take_along_axis(palettes[part[0]], found, 1))
    codes = np.moveaxis(indices.reshape(moved_shape), list(range(len(lead))), lead)
    # [*batches, groups, k] -> [*lut groups (the weight's rank), k, 1]
    lut = palettes.reshape(*batches, groups, *[1] * (len(shape) - len(lead)), k, 1)
    lut = np.moveaxis(lut, list(range(len(lead))), lead)
    return_freed_memory()
    return PaletteCodes(np.ascontiguousarray(codes), bits, np.ascontiguousarray(lut)), (
        noise.snr_db
    )


def prune(weight: np.ndarray, sparsity: float) -> tuple[SparseCodes, float]:
    """``weight`` with its ``floor(size * sparsity)`` elements of smallest magnitude dropped, as
    :class:`~coreai_torch.ir.compressed.SparseCodes`, and the SNR in dB of what is kept.
    Deterministic (the same weight gives the same codes)."""
    magnitude = np.abs(weight).reshape(-1)
    drop = int(magnitude.size * sparsity)
    keep = np.ones(magnitude.size, bool)
    if drop:
        keep[np.argpartition(magnitude, drop - 1)[:drop]] = False
    mask = keep.reshape(weight.shape)
    values = np.ascontiguousarray(weight)[mask]
    signal = float(np.square(weight, dtype=np.float64).sum())
    noise = float(np.square(magnitude[~keep], dtype=np.float64).sum())
    snr = 10 * np.log10(signal / noise) if noise > 0 else float("inf")
    return SparseCodes(mask, values), float(snr)
