"""``AIProgram.compress(config)``: store a converted program's weights compressed.

Each float weight the configuration selects is fitted (:mod:`coreai_torch.compression.fitting`)
and its constant replaced by compressed constants and the op that decompresses them
(:mod:`coreai_torch.ir.compressed`), in the weight's own precision: a float16 / bfloat16 program
gets half-precision scales and palettes and decompresses to the half type, which the casts
already in the program take to float32 where it accumulates in float32.  What a weight can be
compressed as depends on what reads it (:mod:`coreai_torch.passes.weight_reads`): matmuls,
convolution kernels, embedding lookups and the stacked expert weights of mixture-of-experts
layers (batched, or gathered per token), possibly through casts and transposes; anything else
keeps the weight as it is, and the report says why.

Weights still in their checkpoint (:mod:`coreai_torch.tensors.lazy`) are read and fitted once, one
at a time, and their codes wait in a temporary file until the asset is written
(:mod:`coreai_torch.compression.spilling`): neither the weights nor their codes are held in memory.

Weights already compressed (by an earlier ``compress()`` or because the model was
quantized with torchao) are listed as such and left alone: compressing twice would compound
the error.  The decompressions are then placed where the runtime runs them fastest
(:mod:`coreai_torch.passes.placement`: ``cast -> matmul -> scale`` for 8-bit weights read by
float32 matmuls, lookups of compressed tables before their decompression); ``optimize()`` runs
the same passes (for models quantized with torchao).
"""

from __future__ import annotations

import math
import re
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from coreai_torch import dtypes
from coreai_torch import progress as progress_events
from coreai_torch._mlir import ir
from coreai_torch.compression.calibration import LARGE_OUTPUT_ERROR, Calibration, FittedWeight
from coreai_torch.compression.checks import check_finite, check_scale_range
from coreai_torch.compression.config import (
    CompressionConfig,
    LinearQuantization,
    Mixed,
    Palettization,
    Pruning,
)
from coreai_torch.compression.fitting import Workers, palettize, prune, quantize_linear
from coreai_torch.compression.spilling import Spilling, array_bytes
from coreai_torch.ir import compressed
from coreai_torch.ir.checks import verify_module
from coreai_torch.ir.compressed import LinearCodes, PaletteCodes
from coreai_torch.ir.weights import WeightStore, derived_arrays, resource_name
from coreai_torch.passes import pipeline
from coreai_torch.passes.pretranspose import weight_constants
from coreai_torch.passes.weight_reads import (
    Plan,
    operation,
    read_plan,
)
from coreai_torch.tensors import lazy

#: derived constants holding a compressed weight's codes (see compressed.Decompression)
_CODES = re.compile(r"^(.*)\.(?:codes|indices|values)(?:_\d+)?$")

# -------------------------------------------------------------------------------- report ---


@dataclass
class CompressedWeight:
    """One weight as ``compress()`` stored it."""

    name: str
    form: str
    bits: int
    shape: tuple[int, ...]
    bytes_before: int
    bytes_after: int
    #: reconstruction signal-to-noise ratio, 10·log10(Σw² / Σ(w - ŵ)²), in dB
    snr_db: float
    #: what reads it: "matmul", "convolution" or "embedding"
    reader: str
    #: ``‖(W - Ŵ) Xᵀ‖² / ‖W Xᵀ‖²`` on the calibration inputs (None: fitted without them)
    output_error: float | None = None

    @property
    def bits_per_weight(self) -> float:
        """Stored bits per element (codes, scales, zero points, palettes)."""
        return 8 * self.bytes_after / max(1, math.prod(self.shape))

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.__dict__,
            "shape": list(self.shape),
            "bits_per_weight": self.bits_per_weight,
        }


@dataclass
class CompressionReport:
    """What ``AIProgram.compress()`` did: the compressed weights, the weights it left alone
    (with the reason), and the bytes before and after."""

    config: str
    weights: list[CompressedWeight] = field(default_factory=list)
    #: (weight name, why it was not compressed)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0
    #: weights whose SNR is below this many dB are flagged (None: none are)
    min_snr_db: float | None = 10.0
    #: bits per weight over every float weight of the program (the compressed ones as
    #: stored, the others at their own precision)
    bits_per_weight: float | None = None
    #: the relative output error of the whole model on the calibration samples
    #: (``Calibration.output_error``; None: no calibration)
    output_error: float | None = None
    #: the calibration's target bits per weight (``Mixed``)
    target_bpw: float | None = None
    #: what :attr:`output_error` was measured on
    measured_on: str = "the calibration samples"
    #: why the output error was not measured (a data-free export of a large model)
    not_measured: str | None = None

    @property
    def large_output_error(self) -> bool:
        """Whether the measured output error is large enough to check the model's quality
        before shipping it (above ``LARGE_OUTPUT_ERROR``)."""
        return self.output_error is not None and self.output_error > LARGE_OUTPUT_ERROR

    @property
    def low_snr(self) -> list[CompressedWeight]:
        """The compressed weights whose SNR is below :attr:`min_snr_db`."""
        if self.min_snr_db is None:
            return []
        return [w for w in self.weights if not w.snr_db >= self.min_snr_db]

    @property
    def bytes_before(self) -> int:
        return sum(w.bytes_before for w in self.weights)

    @property
    def bytes_after(self) -> int:
        return sum(w.bytes_after for w in self.weights)

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "weights": [w.to_dict() for w in self.weights],
            "skipped": [{"name": n, "reason": r} for n, r in self.skipped],
            "bytes_before": self.bytes_before,
            "bytes_after": self.bytes_after,
            "seconds": self.seconds,
            "min_snr_db": self.min_snr_db,
            "low_snr": [w.name for w in self.low_snr],
            "bits_per_weight": self.bits_per_weight,
            "output_error": self.output_error,
            "measured_on": self.measured_on,
            "not_measured": self.not_measured,
            "target_bpw": self.target_bpw,
        }

    def summary(self) -> str:
        """One line: how many weights, bytes before -> after."""
        ratio = self.bytes_after / self.bytes_before if self.bytes_before else 1.0
        return (
            f"{len(self.weights)} weight(s) ({self.config}): "
            f"{_mb(self.bytes_before)} -> {_mb(self.bytes_after)} ({ratio:.3f}x)"
            + (
                f", {self.bits_per_weight:.3f} bits per weight overall"
                if self.bits_per_weight is not None
                else ""
            )
            + (f", {len(self.skipped)} left as they were" if self.skipped else "")
        )

    def __str__(self) -> str:
        lines = [f"compressed {self.summary()} in {self.seconds:.2f} s"]
        if self.output_error is not None:
            lines.append(
                f"  output error on {self.measured_on}: {self.output_error:.4f} "
                f"(relative, {_relative_db(self.output_error)})"
                + (
                    f"  LARGE: above {LARGE_OUTPUT_ERROR:g}; measure the model's quality "
                    "(coreai-torch eval) and use more bits"
                    if self.large_output_error
                    else ""
                )
            )
        elif self.not_measured is not None:
            lines.append(f"  output error: not measured: {self.not_measured}")
        if self.weights:
            width = max(len(w.name) for w in self.weights)
            form = max(len(w.form) for w in self.weights)
            calibrated = any(w.output_error is not None for w in self.weights)
            lines.append(
                f"  {'weight':<{width}}  {'shape':<12} {'form':<{form}} {'before':>10} "
                f"{'after':>10}  {'bits':>5}  {'SNR':>8}" + ("  output error" if calibrated else "")
            )
            low = {id(w) for w in self.low_snr}
            for w in self.weights:
                shape = "x".join(map(str, w.shape))
                lines.append(
                    f"  {w.name:<{width}}  {shape:<12} {w.form:<{form}} "
                    f"{_mb(w.bytes_before):>10} {_mb(w.bytes_after):>10}  "
                    f"{w.bits_per_weight:5.2f}  {w.snr_db:5.1f} dB"
                    + (f"  {w.output_error:.2e}" if w.output_error is not None else "")
                    + ("  LOW" if id(w) in low else "")
                )
        if self.low_snr:
            lines.append(
                f"  {len(self.low_snr)} weight(s) below {self.min_snr_db:g} dB SNR (LOW): "
                f"{', '.join(w.name for w in self.low_snr[:8])}"
                + (", ..." if len(self.low_snr) > 8 else "")
                + "; compare the outputs with coreai_torch.verify.verify(model, args, "
                "program=program) (its report gives each output's error), and use more bits, "
                "smaller blocks/groups, or leave these weights out (weights=...)"
            )
        if self.skipped:
            lines.append("  left as they were:")
            lines += [f"    {name}: {reason}" for name, reason in self.skipped]
        return "\n".join(lines)


def _relative_db(relative: float) -> str:
    return "inf dB SNR" if relative <= 0 else f"{-10 * math.log10(relative):.1f} dB SNR"


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f} MB" if n >= 2**20 else f"{n / 2**10:.1f} KB"


def _form(
    config: CompressionConfig, plan: Plan
) -> LinearQuantization | Palettization | Pruning | str:
    """The form ``config`` gives a compressible weight, or why it leaves it alone."""
    if isinstance(config, Mixed):
        if config.other is None:
            return "not fitted by the calibration (Mixed(other=None))"
        return config.other
    form: LinearQuantization | Palettization | Pruning | None = config.form_for(
        plan.reader, plan.head
    )
    if form is None:
        if plan.head and config.output_head is False:
            return "the output head (output_head=False)"
        return "an embedding table (embeddings=False)"
    return form


# ---------------------------------------------------------------------------- fitting ---


def _fit(
    config: LinearQuantization | Palettization | Pruning,
    weight: np.ndarray | _Converted,
    plan: Plan,
    dtype: torch.dtype,
    workers: Workers | None = None,
) -> tuple[Any, float] | str:
    """The codes of ``weight`` (in the stored layout) and their SNR in dB, or why the
    configuration cannot be applied to it.  Each index of a batch axis (an expert) gets
    parameters of its own.  ``workers``: the fitting's threads, kept between weights."""
    shape = weight.shape
    channels, reduced = shape[plan.channel_axis], shape[plan.reduction_axis]
    if isinstance(config, Pruning):
        return prune(np.asarray(weight), config.sparsity)
    if isinstance(config, LinearQuantization):
        params = [1] * weight.ndim
        for axis in (*plan.batch_axes, plan.channel_axis):
            params[axis] = shape[axis]
        block = config.block_size
        if block is not None and block < reduced:
            if reduced % block:
                return f"its input size {reduced} is not a multiple of block_size={block}"
            params[plan.reduction_axis] = reduced // block
        return quantize_linear(
            weight,
            params,
            config.bits,
            symmetric=config.symmetric,
            scale_dtype=config.scale_dtype or dtype,
            workers=workers,
        )
    group = config.group_size
    if group is not None and group < channels and channels % group:
        return f"its {channels} output channels are not a multiple of group_size={group}"
    group = None if group is None or group >= channels else group
    return palettize(
        np.asarray(weight),
        plan.channel_axis,
        group,
        config.bits,
        config.iterations,
        plan.batch_axes,
    )


def _as_float32(tensor: torch.Tensor, perm: tuple[int, ...]) -> np.ndarray:
    """The weight as float32 numpy in the stored layout: a (strided) view of a float32
    weight, a converted copy of a float16 / bfloat16 one (a lazy weight is read now)."""
    t = lazy.materialize(tensor).detach()
    if t.dtype != torch.float32:
        t = t.float()
    return t.permute(perm).numpy()


class _Converted:
    """A weight that is not float32 in memory (a lazy weight, a half-precision one) in its
    stored layout, converted to float32 by the slices fitting asks for: slices of a weight
    in memory alone, blocks of rows of the weight as the checkpoint holds it alone (a
    128k-row embedding or output head is never whole in memory), anything else from the
    whole weight, read once.  Slices may be asked for from several threads."""

    def __init__(self, tensor: torch.Tensor, perm: tuple[int, ...]) -> None:
        self.tensor, self.perm = tensor, perm
        self.shape = tuple(tensor.shape[p] for p in perm)
        self.ndim = len(perm)
        self._whole: np.ndarray | None = None
        self._lock = threading.Lock()

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        if not lazy.is_lazy(self.tensor):
            return self.tensor.detach().permute(self.perm)[index].float().numpy()
        cut = [a for a, s in enumerate(index) if s != slice(None)]
        if self._whole is None and len(cut) == 1 and self.perm[cut[0]] == 0:
            part = index[cut[0]]
            start, stop, _ = part.indices(self.shape[cut[0]])
            rows = lazy.read_rows(self.tensor, start, stop - start)
            if rows is not None:
                return rows.float().permute(self.perm).numpy()
        return np.asarray(self)[index]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        with self._lock:
            if self._whole is None:
                self._whole = _as_float32(self.tensor, self.perm)
        return self._whole if dtype is None else self._whole.astype(dtype, copy=False)


def _stored(tensor: torch.Tensor, perm: tuple[int, ...]) -> np.ndarray | _Converted:
    """The weight in its stored layout, as fitting reads it."""
    if tensor.dtype == torch.float32 and not lazy.is_lazy(tensor):
        return _as_float32(tensor, perm)
    return _Converted(tensor, perm)


# ------------------------------------------------------------------------------- rewrite ---


def _replace(plan: Plan, decompression: compressed.Decompression) -> None:
    """Replace the weight's constants (and the transposes absorbed into the stored layout)
    by the decompression, built once per constant (per graph)."""
    for const in plan.constants:
        with ir.InsertionPoint(const), const.location:
            value = decompression.build()
        if plan.transposes:
            for transpose in [operation(u.owner) for u in const.result.uses]:
                perm = operation(transpose.operands[1].owner)
                transpose.result.replace_all_uses_with(value)
                transpose.erase()
                if not list(perm.result.uses):
                    perm.erase()
        else:
            const.result.replace_all_uses_with(value)
        const.erase()


def _already_compressed(module: ir.Module, store: WeightStore) -> list[str]:
    """Names of the weights the module reads compressed: the derived constants holding
    their codes (``<weight>.codes``), palette indices (``<weight>.indices``) or sparse values
    (``<weight>.values``)."""
    names: dict[str, None] = {}

    def visit(op: ir.Operation) -> ir.WalkResult:
        name = resource_name(op)
        if name is not None and name in store.derived_by_name:
            match = _CODES.match(name)
            if match:
                names[match[1]] = None
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return list(names)


def display_name(resource: str) -> str:
    """A weight's name as users know it (``fc.weight``, not ``fc.weight.T``, the resource
    ``optimize()`` stores it transposed in)."""
    return resource.removesuffix(".T")


def _candidates(
    read: dict[str, list[ir.Operation]], store: WeightStore, config: CompressionConfig
) -> list[tuple[str, str, list[ir.Operation], torch.dtype]]:
    """``(name, resource, constants, dtype)`` of the weights ``config`` selects: floating,
    of rank 2 or more (not biases, norms, integer tables), at least ``min_elements``."""
    found = []
    for resource, constants in read.items():
        name = display_name(resource)
        tensor = store.by_name[resource]
        element = ir.RankedTensorType(constants[0].result.type).element_type
        dtype = dtypes.to_torch(element) if not ir.IntegerType.isinstance(element) else None
        if dtype not in compressed.FLOAT_DTYPES or tensor.dim() < 2:
            continue
        if tensor.numel() >= config.min_elements and config.selects(name):
            found.append((name, resource, constants, dtype))
    return found


def _gone(
    store: WeightStore, config: CompressionConfig, present: set[str], compressed_: set[str]
) -> list[str]:
    """Weights ``config`` would select that the program no longer reads as weights: a
    rewrite (``optimize()``) removed them or computed another constant from them."""
    gone = []
    # weights optimize() computed from others, read under their own name (conv.weight.folded)
    succeeded = {display_name(o) for n, o in store.folded.items() if display_name(n) in present}
    for resource, tensor in store.by_name.items():
        name = display_name(resource)
        if (
            resource.endswith(".T")
            or name in present
            or name in succeeded
            or name in compressed_
            or not tensor.is_floating_point()
            or tensor.dim() < 2
            or tensor.numel() < config.min_elements
            or not config.selects(name)
        ):
            continue
        gone.append(name)
    return gone


def compress(
    module: ir.Module,
    store: WeightStore | None,
    config: CompressionConfig,
    *,
    calibration: Calibration | None = None,
    progress: Any = None,
) -> CompressionReport:
    """Compress the weights of a converted program (its ``module`` and weight ``store``) that
    ``config`` selects; returns the report.  ``calibration``: codes fitted against
    calibration data (:func:`coreai_torch.compression.calibrate`), stored for the weights it
    fitted instead of fitting them again (needed by :class:`Mixed`).  Modifies the module in
    place, then places the decompressions (:data:`coreai_torch.passes.pipeline.PLACEMENT`).
    Reports its progress (``"compress"``, bytes of weights done) to ``progress`` like
    ``optimize()``."""
    if not isinstance(config, (LinearQuantization, Palettization, Pruning, Mixed)):
        raise TypeError(
            "compress() takes a coreai_torch.compression.LinearQuantization, Palettization, "
            f"Pruning or Mixed, got {type(config).__name__}"
        )
    if calibration is not None and not isinstance(calibration, Calibration):
        raise TypeError(
            "compress(calibration=...) takes what coreai_torch.compression.calibrate() returns, "
            f"got {type(calibration).__name__}"
        )
    if isinstance(config, Mixed) and calibration is None:
        raise ValueError(
            f"compress({config.describe()}) chooses each weight's form from its measured error: "
            "it needs calibration data (calibration=compression.calibrate(model, samples, "
            "config))"
        )
    if store is None:
        raise ValueError(
            "compress() needs a program converted by TorchConverter (its weights are not known)"
        )
    start = time.perf_counter()
    report = CompressionReport(config.describe(), min_snr_db=config.min_snr_db)
    if calibration is not None:
        report.output_error = calibration.output_error
        report.target_bpw = calibration.target_bpw
        report.measured_on = calibration.measured_on
        report.not_measured = calibration.not_measured
    listener = progress_events.resolve(progress)
    with module.context, ir.Location.unknown():
        done = _already_compressed(module, store)
        report.skipped += [(display_name(name), "already compressed") for name in done]
        read = weight_constants(module, store)
        candidates = _candidates(read, store, config)
        kept = check_finite([(n, store.by_name[r]) for n, r, _, _ in candidates], config.non_finite)
        report.skipped += list(kept.items())
        candidates = [c for c in candidates if c[0] not in kept]
        if isinstance(config, LinearQuantization):
            check_scale_range(
                [(n, store.by_name[r]) for n, r, _, _ in candidates],
                config.bits,
                config.symmetric,
                config.scale_dtype,
            )
        present = {display_name(r) for r in read}
        report.skipped += [
            (
                name,
                "no longer read by the program as a weight (optimize() computed a new "
                "constant from it or removed it): compress() before optimize() to compress it",
            )
            for name in _gone(store, config, present, {display_name(n) for n in done})
        ]
        total = sum(
            store.by_name[r].numel() * store.by_name[r].element_size() for _, r, _, _ in candidates
        )
        spilling = Spilling()
        with (
            Workers() as workers,
            progress_events.phase(listener, "compress", total, "bytes") as advance,
        ):
            finished = 0
            for name, resource, constants, dtype in candidates:
                tensor = store.by_name[resource]
                fitted = calibration.lookup(name) if calibration is not None else None
                entry = _compress_one(
                    store,
                    config,
                    name,
                    tensor,
                    constants,
                    dtype,
                    spilling,
                    workers,
                    fitted=fitted,
                    transposed=resource.endswith(".T"),
                )
                if isinstance(entry, str):
                    report.skipped.append((name, entry))
                else:
                    report.weights.append(entry)
                finished += tensor.numel() * tensor.element_size()
                advance(finished, total)
        report.bits_per_weight = _bits_per_weight(store, report)
    pipeline.run(pipeline.PLACEMENT, module, pipeline.PassContext(store), when="after compress()")
    verify_module(module, "after compress()")
    report.seconds = time.perf_counter() - start
    if report.large_output_error:
        warnings.warn(
            f"compress({config.describe()}): the compressed model's outputs on "
            f"{report.measured_on} are off by {report.output_error:.3f} (relative squared error, "
            f"{_relative_db(report.output_error or 0.0)}); measure its quality before shipping "
            "it (coreai-torch eval perplexity) and use more bits",
            RuntimeWarning,
            stacklevel=3,
        )
    return report


def _bits_per_weight(store: WeightStore, report: CompressionReport) -> float | None:
    """Bits per element over every float weight of the program: the compressed ones as
    stored, the others (and weights compressed before) at their own precision."""
    stored = {w.name: w.bytes_after for w in report.weights}
    elements = bits = 0
    for resource, tensor in store.by_name.items():
        name = display_name(resource)
        if (resource.endswith(".T") and name in store.by_name) or not tensor.is_floating_point():
            continue
        elements += tensor.numel()
        bits += 8 * stored[name] if name in stored else 8 * tensor.numel() * tensor.element_size()
    return bits / elements if elements else None


def _calibrated_codes(fitted: FittedWeight, plan: Plan, transposed: bool) -> Any:
    """The fitted codes in the plan's stored layout, or None when the plan reads the weight
    along other axes than the calibration fitted it (output channels first)."""
    rank = len(plan.perm)
    layout = list(range(rank))
    if transposed:  # the program holds the weight transposed (optimize())
        if rank != 2:
            return None
        layout = [1, 0]
    axes = [layout[a] for a in plan.perm]
    if axes.index(0) != plan.channel_axis or plan.batch_axes:
        return None
    codes = fitted.read_codes()
    if isinstance(codes, LinearCodes):
        return LinearCodes(
            np.ascontiguousarray(codes.codes.transpose(axes)),
            codes.bits,
            np.ascontiguousarray(codes.scale.transpose(axes)),
            None
            if codes.zero_point is None
            else np.ascontiguousarray(codes.zero_point.transpose(axes)),
            signed=codes.signed,
        )
    lut_axes = [*axes, rank, rank + 1]
    return PaletteCodes(
        np.ascontiguousarray(codes.indices.transpose(axes)),
        codes.bits,
        np.ascontiguousarray(codes.lut.transpose(lut_axes)),
    )


#: elements of a weight compared with its codes at once (:func:`_snr_db`)
SNR_ELEMENTS = 1 << 22


def _snr_db(weight: Any, codes: Any) -> float:
    """The signal-to-noise ratio of ``codes`` against ``weight`` (its stored layout), a piece
    of rows at a time where the codes can be cut so (a 128k-row table is never whole in
    float32, nor its error in float64)."""
    signal = error = 0.0
    for rows, part in _row_pieces(codes, weight.shape):
        w = np.asarray(weight if rows is None else weight[rows], dtype=np.float32)
        difference = part.dequantized()
        np.subtract(w, difference, out=difference)
        error += float(np.square(difference, dtype=np.float64).sum())
        signal += float(np.square(w, dtype=np.float64).sum())
    if error == 0:
        return math.inf
    return 10 * math.log10(signal / error) if signal > 0 else -math.inf


def _row_pieces(codes: Any, shape: tuple[int, ...]) -> Iterator[tuple[Any, Any]]:
    """``(index, codes of those rows)`` covering the weight about :data:`SNR_ELEMENTS` at a
    time along its first axis (``index`` None: the whole weight, for codes that are not
    cut by rows)."""
    n = shape[0] if shape else 1
    per_row = max(1, math.prod(shape[1:]))
    if not isinstance(codes, LinearCodes) or not shape:
        yield None, codes  # palettes and sparse codes: whole
        return
    params = [p for p in (codes.scale, codes.zero_point, codes.offset) if p is not None]
    unit = math.lcm(*[n // p.shape[0] for p in params])
    step = max(unit, SNR_ELEMENTS // per_row // unit * unit)
    if step >= n:
        yield None, codes
        return
    for first in range(0, n, step):
        rows = slice(first, min(first + step, n))
        part = compressed.rows_of(codes, first, step)
        yield (rows, *[slice(None)] * (len(shape) - 1)), part


def _compress_one(
    store: WeightStore,
    config: CompressionConfig,
    name: str,
    tensor: torch.Tensor,
    constants: list[ir.Operation],
    dtype: torch.dtype,
    spilling: Spilling,
    workers: Workers,
    *,
    fitted: FittedWeight | None = None,
    transposed: bool = False,
) -> CompressedWeight | str:
    """Compress one weight (its constants in every graph), or say why not."""
    plan = read_plan(name, constants, tensor.dim())
    if isinstance(plan, str):
        return plan
    calibrated = _calibrated_codes(fitted, plan, transposed) if fitted is not None else None
    form: Any
    if calibrated is not None:
        assert fitted is not None
        form = fitted.config
        codes = calibrated
        snr = _snr_db(_stored(tensor, plan.perm), codes)
    else:
        form = _form(config, plan)
        if isinstance(form, str):
            return form
        result = _fit(form, _stored(tensor, plan.perm), plan, dtype, workers)
        if isinstance(result, str):
            return result
        codes, snr = result

    def decompress(target: WeightStore, codes: Any) -> compressed.Decompression:
        if isinstance(codes, compressed.LinearCodes):
            scale_dtype = getattr(form, "scale_dtype", None)
            return compressed.linear_decompression(target, name, codes, dtype, scale_dtype)
        return compressed.decompression(target, name, codes, dtype)  # palettes, sparse

    if lazy.is_lazy(tensor):
        from_calibration = calibrated is not None

        # keep none of the codes in memory: they wait in the spill file or, without room
        # there, the data is fitted again (the same) while the asset is written
        def refit() -> list[np.ndarray]:
            if from_calibration:  # read again: the closure does not hold the codes
                assert fitted is not None
                again_codes = _calibrated_codes(fitted, plan, transposed)
                return derived_arrays(lambda target: decompress(target, again_codes), store)
            again = _fit(form, _stored(tensor, plan.perm), plan, dtype)
            assert not isinstance(again, str)
            return derived_arrays(lambda target: decompress(target, again[0]), store)

        with store.deferring(refit, spilling.file_for(array_bytes(codes))):
            decompression = decompress(store, codes)
        del codes
    else:
        decompression = decompress(store, codes)
    _replace(plan, decompression)
    original = store.by_name.get(name, tensor)  # the weight as the model holds it
    return CompressedWeight(
        name,
        form.describe(),
        getattr(form, "bits", dtype.itemsize * 8),
        tuple(original.shape),
        tensor.numel() * tensor.element_size(),
        decompression.stored_bytes,
        snr,
        plan.reader,
        fitted.output_error if calibrated is not None and fitted is not None else None,
    )
