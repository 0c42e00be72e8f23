"""Calibration: fit a model's compressed weights against the activations of sample inputs,
block by block, before the model is converted.

    calibration = compression.calibrate(model, samples, compression.from_spec("int4"))
    program.compress(compression.from_spec("int4"), calibration=calibration)

The model runs in PyTorch one block at a time (the blocks of its largest ``nn.ModuleList``,
the decoder layers of a transformer; a model without one is a single block): the samples'
activations at the first block's input are carried from one block to the next; each block's
weights are read (a model streamed from its checkpoint, :mod:`coreai_torch.tensors.lazy`, reads
them now and drops them afterwards), the inputs of its ``nn.Linear`` / ``nn.Conv2d`` layers
are accumulated into each layer's Hessian ``XᵀX``, the layers are fitted
(:mod:`coreai_torch.compression.calibrated`: GPTQ with activation-aware scales, or weighted
palettes), and the block's output computed *with the fitted weights* is the next block's
input, so every block corrects the error of those before it.  The layers after the blocks
(a final norm and the output head) are fitted last on the compressed stream.

Memory: one block's weights, its Hessians and two streams of activations (the compressed
model's for all samples, the float model's for a few, to measure the output error at the
end).  Of the token embedding table only the rows the samples look up are read; the output
head is read, fitted and measured a piece of rows at a time (:func:`fit_in_pieces`), never
whole in float32 nor evaluated over the whole vocabulary at once; the codes of a model
streamed from its checkpoint wait in a temporary file until ``compress()`` stores them
(:mod:`coreai_torch.compression.spilling`).

:class:`~coreai_torch.compression.config.Mixed` (``target_bpw=``) first measures what each
candidate form of every weight does to the model's output (:func:`_fisher`: one forward and
backward pass for the output sensitivities; then one pass over the float model fitting every
form), chooses a form per weight to meet the budget with the least total effect
(:func:`allocate`), then fits the chosen forms as above.

``program.compress(config, calibration=...)`` stores the fitted codes instead of fitting the
weights again (:mod:`coreai_torch.compression.apply`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from coreai_torch import progress as progress_events
from coreai_torch.compression import calibrated as fits
from coreai_torch.compression.config import (
    CompressionConfig,
    LinearQuantization,
    Mixed,
    Palettization,
    Pruning,
    bits_per_weight,
)
from coreai_torch.compression.fitting import Workers, return_freed_memory
from coreai_torch.compression.spilling import SpilledCodes, Spilling, spilled
from coreai_torch.ir.compressed import LinearCodes, PaletteCodes, joined_rows, rows_of
from coreai_torch.tensors import lazy

#: the float-model samples carried along to measure the output error at the end
MEASURED_SAMPLES = 4
#: layers with more inputs per output channel than this (a Hessian of 2 GB in float64) are
#: compressed without calibration (a convolution of 1024 channels and 64 taps has 65,536)
MAX_HESSIAN_INPUTS = 16384
#: how :func:`calibrate` fits: GPTQ (with activation-aware scales or weighted palettes),
#: activation-aware scales / weighted palettes alone, or round-to-nearest (the data-free
#: codes, with their output error measured)
METHODS = ("gptq", "awq", "rtn")
#: relative output error (``‖Δy‖² / ‖y‖²``) of the whole model above which the calibration
#: and the compression report warn
LARGE_OUTPUT_ERROR = 0.1


class CalibrationError(ValueError):
    """Calibration data that does not fit the model (wrong shape, token ids outside the
    vocabulary, too few samples), or a budget the forms cannot meet."""


@dataclass
class FittedWeight:
    """One weight fitted against its calibration inputs."""

    name: str
    #: the form chosen for it
    config: LinearQuantization | Palettization
    #: the codes in the weight's own layout (``[out, in, ...]``); those of a weight streamed
    #: from its checkpoint wait in a temporary file (:meth:`read_codes` reads them)
    codes: LinearCodes | PaletteCodes | SpilledCodes
    #: ``‖(W - Ŵ) Xᵀ‖² / ‖W Xᵀ‖²`` on the calibration inputs
    output_error: float
    #: bits per weight of the form (codes, scales, zero points, palettes)
    bits: float
    #: the weight's number of elements
    elements: int
    #: the names the model also knows this weight by (a head tied to the embeddings)
    aliases: tuple[str, ...] = ()

    def read_codes(self) -> LinearCodes | PaletteCodes:
        """The codes, in memory."""
        return self.codes.load() if isinstance(self.codes, SpilledCodes) else self.codes

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "form": self.config.describe(),
            "output_error": self.output_error,
            "bits_per_weight": self.bits,
            "elements": self.elements,
        }


@dataclass
class Calibration:
    """What :func:`calibrate` fitted: per weight, the chosen form and its codes; the
    samples it saw; the measured output error of the whole compressed model."""

    config: str
    weights: dict[str, FittedWeight] = field(default_factory=dict)
    samples: int = 0
    tokens: int = 0
    #: ``‖y_compressed - y_float‖² / ‖y_float‖²`` of the model's output on the measured
    #: samples (None: not measured)
    output_error: float | None = None
    #: the target of a :class:`~coreai_torch.compression.config.Mixed` configuration
    target_bpw: float | None = None
    #: what the output error was measured on (example inputs when there was no data)
    measured_on: str = "the calibration samples"
    #: why the output error was not measured (None: measured, or not asked for)
    not_measured: str | None = None
    #: the bits per weight of the chosen forms over every weight of the model, the ones not
    #: compressed (norms, biases) at their own precision
    planned_bpw: float | None = None
    #: weights the calibration could not fit and why (they are compressed without it)
    unfitted: list[tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0

    def lookup(self, name: str) -> FittedWeight | None:
        """The fitted weight a program's weight ``name`` stands for: the same name, or the
        one name that ends ``name``'s path (``model.model.x.weight`` is ``model.x.weight``
        of the model inside a wrapper)."""
        found = self._names().get(name)
        if found is not None:
            return found
        matches = {
            id(w): w
            for key, w in self._names().items()
            if name.endswith("." + key) or key.endswith("." + name)
        }
        return next(iter(matches.values())) if len(matches) == 1 else None

    def _names(self) -> dict[str, FittedWeight]:
        names = {}
        for w in self.weights.values():
            for key in (w.name, *w.aliases):
                names[key] = w
        return names

    @property
    def large_output_error(self) -> bool:
        return self.output_error is not None and self.output_error > LARGE_OUTPUT_ERROR

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "samples": self.samples,
            "tokens": self.tokens,
            "output_error": self.output_error,
            "target_bpw": self.target_bpw,
            "measured_on": self.measured_on,
            "not_measured": self.not_measured,
            "planned_bpw": self.planned_bpw,
            "weights": [w.to_dict() for w in self.weights.values()],
            "unfitted": [{"name": n, "reason": r} for n, r in self.unfitted],
            "seconds": self.seconds,
        }

    def __str__(self) -> str:
        lines = [
            f"calibrated {len(self.weights)} weight(s) ({self.config}) on {self.samples} "
            f"sample(s)"
            + (f", {self.tokens} tokens" if self.tokens else "")
            + f" in {self.seconds:.1f} s"
        ]
        if self.planned_bpw is not None:
            lines.append(
                f"  bits per weight: {self.planned_bpw:.3f}"
                + (f" (target {self.target_bpw:g})" if self.target_bpw is not None else "")
            )
        if self.output_error is not None:
            lines.append(
                f"  output error on {self.measured_on}: {self.output_error:.4f} "
                f"({_db(self.output_error)})" + ("  LARGE" if self.large_output_error else "")
            )
        elif self.not_measured is not None:
            lines.append(f"  output error: not measured: {self.not_measured}")
        for name, reason in self.unfitted:
            lines.append(f"  not calibrated: {name}: {reason}")
        return "\n".join(lines)


def _db(relative: float) -> str:
    """A relative error as an SNR in dB."""
    if relative <= 0:
        return "inf dB SNR"
    return f"{-10 * math.log10(relative):.1f} dB SNR"


# ----------------------------------------------------------------------------- samples ---


def as_batches(samples: Any) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """The model calls the samples stand for: a tensor (the first argument of one call), a
    tuple of arguments, a dict of keyword arguments, or a list of these (one call each)."""
    if isinstance(samples, (torch.Tensor, tuple, dict)):
        samples = [samples]
    if not isinstance(samples, (list, Sequence)) or not samples:
        raise CalibrationError(
            "calibration samples must be a tensor, a tuple of forward() arguments, a dict of "
            "keyword arguments, or a non-empty list of these"
        )
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    for sample in samples:
        if isinstance(sample, torch.Tensor):
            calls.append(((sample,), {}))
        elif isinstance(sample, tuple):
            calls.append((sample, {}))
        elif isinstance(sample, dict):
            calls.append(((), dict(sample)))
        else:
            raise CalibrationError(
                f"a calibration sample is a {type(sample).__name__}; use tensors, tuples of "
                "forward() arguments or dicts of keyword arguments"
            )
    return calls


def token_batches(
    sequences: Sequence[Sequence[int]] | torch.Tensor, vocab_size: int, *, length: int | None
) -> torch.Tensor:
    """Token-id sequences as one ``[samples, length]`` int64 batch, checked against the
    vocabulary: lists of ids are cut into pieces of ``length`` (default: the shortest
    sequence's length)."""
    if isinstance(sequences, torch.Tensor):
        if sequences.dim() != 2 or sequences.dtype not in (torch.int64, torch.int32):
            raise CalibrationError(
                f"calibration token ids must be an integer [samples, tokens] tensor, got "
                f"{tuple(sequences.shape)} {sequences.dtype}"
            )
        batch = sequences.to(torch.int64)
    else:
        rows = [list(s) for s in sequences]
        if not rows or any(not r for r in rows):
            raise CalibrationError("calibration token ids: give at least one non-empty sequence")
        for r, row in enumerate(rows):
            bad = [t for t in row if not isinstance(t, (int, np.integer))]
            if bad:
                raise CalibrationError(
                    f"calibration sequence {r} holds {type(bad[0]).__name__} values; token ids "
                    "are integers"
                )
        size = length or min(len(r) for r in rows)
        pieces = [r[i : i + size] for r in rows for i in range(0, len(r) - size + 1, size)]
        if not pieces:
            raise CalibrationError(
                f"no calibration sequence holds {size} tokens (the longest has "
                f"{max(len(r) for r in rows)})"
            )
        batch = torch.tensor(pieces, dtype=torch.int64)
    if batch.numel() == 0:
        raise CalibrationError("the calibration token ids are empty")
    low, high = int(batch.min()), int(batch.max())
    if low < 0 or high >= vocab_size:
        outside = low if low < 0 else high
        raise CalibrationError(
            f"calibration token id {outside} is outside the model's vocabulary (0 .. "
            f"{vocab_size - 1}): were the ids made with this model's tokenizer?"
        )
    return batch


# ---------------------------------------------------------------------------- the model ---


def find_blocks(model: nn.Module) -> nn.ModuleList | None:
    """The ``nn.ModuleList`` holding most of the model's parameters (a transformer's layers),
    if it has one holding at least half of them."""
    total = sum(p.numel() for p in model.parameters())
    best, size = None, 0
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 1:
            n = sum(p.numel() for p in module.parameters())
            if n > size:
                best, size = module, n
    return best if best is not None and size * 2 >= total else None


def fittable(module: nn.Module) -> bool:
    """Layers fitted with their inputs: ``nn.Linear`` and ungrouped ``nn.Conv2d``."""
    if isinstance(module, nn.Linear):
        return True
    return isinstance(module, nn.Conv2d) and module.groups == 1 and module.padding_mode == "zeros"


def _buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (b.float() if b.is_floating_point() else b)
        for name, b in module.named_buffers(remove_duplicate=False)
    }


def _call(
    module: nn.Module,
    params: dict[str, torch.Tensor],
    args: Any,
    kwargs: Any,
    *,
    grad: bool = False,
) -> Any:
    """``module(*args, **kwargs)`` with ``params`` in place of its parameters (and its
    floating buffers in float32); recorded for autograd with ``grad``."""
    with torch.set_grad_enabled(grad):
        return torch.func.functional_call(
            module, {**_buffers(module), **params}, args, kwargs, strict=False
        )


class _Stop(Exception):
    """Raised by a hook to end a forward pass early."""


#: the block classes whose forward returns a tuple (the model's layer loop takes ``[0]``):
#: a replayed block (:class:`_Replay`) answers in the same form
_TUPLE_BLOCKS: set[type] = set()


def _run_block(
    block: nn.Module, params: dict[str, torch.Tensor], args: Any, kwargs: Any, *, grad: bool = False
) -> torch.Tensor:
    """The first tensor ``block`` returns, called with ``params`` (see :func:`_call`)."""
    value = _call(block, params, args, kwargs, grad=grad)
    if isinstance(value, tuple):
        _TUPLE_BLOCKS.add(type(block))
    return _first_tensor(value)


def _first_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    out = getattr(value, "last_hidden_state", None)
    if isinstance(out, torch.Tensor):
        return out
    raise CalibrationError(
        f"a block of the model returned {type(value).__name__}; calibration follows blocks "
        "that return a tensor or a tuple starting with one"
    )


@contextlib.contextmanager
def _recording(
    modules: dict[str, nn.Module], sink: Callable[[str, nn.Module, torch.Tensor], None]
) -> Iterator[None]:
    """Call ``sink(name, module, input)`` whenever one of ``modules`` runs."""
    handles = [
        m.register_forward_pre_hook(lambda mod, args, name=name: sink(name, mod, args[0]))
        for name, m in modules.items()
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def layer_inputs(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The rows ``[samples, K]`` a layer's weight (``[out, K]`` flattened) multiplies."""
    if isinstance(module, nn.Conv2d):
        cols = F.unfold(
            x.float(), module.kernel_size, module.dilation, _conv_padding(module), module.stride
        )
        return cols.transpose(1, 2).reshape(-1, cols.shape[1])
    return x.reshape(-1, x.shape[-1]).float()


def _conv_padding(conv: nn.Conv2d) -> tuple[int, ...]:
    """The explicit padding of ``conv`` (``padding="valid"`` / ``"same"`` spelled out)."""
    if not isinstance(conv.padding, str):
        return conv.padding
    if conv.padding == "valid":
        return (0, 0)
    total = [d * (k - 1) for d, k in zip(conv.dilation, conv.kernel_size, strict=True)]
    if any(t % 2 for t in total):
        raise CalibrationError(
            f"a Conv2d with padding='same' and an even kernel {conv.kernel_size} pads one side "
            "more than the other, which calibration does not reproduce"
        )
    return tuple(t // 2 for t in total)


def _weight(module: nn.Module) -> torch.Tensor:
    """The ``weight`` of a fittable layer (a linear, convolution or embedding layer)."""
    return cast(torch.Tensor, module.weight)


# ------------------------------------------------------------------------------ fitting ---


def _reduced_block(module: nn.Module, form: LinearQuantization) -> int | None:
    """Columns of the flattened weight sharing a scale (None: per output channel)."""
    weight = _weight(module)
    k = weight[0].numel()
    if form.block_size is None or form.block_size >= weight.shape[1]:
        return k
    return form.block_size * (k // weight.shape[1])


#: rows of a weight fitted at a time (the temporaries of a 128k-row output head stay small;
#: forms fitted together share them, each form taking an equal part)
ROUNDED_ROWS = 4096
#: a weight's linear forms are fitted in one GPTQ run while their fitted copies (forms times
#: the weight's elements) are at most this many; a larger weight's one at a time
STACKED_ELEMENTS = 1 << 26

Fitted = tuple[LinearCodes | PaletteCodes, torch.Tensor] | str


def _linear_by_rows(
    w: torch.Tensor,
    grids: Sequence[fits.LinearGrid],
    h: fits.Hessian | None,
    method: str,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Per grid, ``(codes, fitted, scales, zero points)`` of ``w [N, K]`` on it (scales by
    :func:`~coreai_torch.compression.calibrated.linear_scales`), ``ROUNDED_ROWS //
    len(grids)`` rows at a time (rows are independent, in GPTQ too; GPTQ fits the grids of a
    piece in one run): codes in one byte each, the temporaries of one piece, so a tall weight
    costs its codes and its fitted copy."""
    n, k = w.shape
    importance = None if h is None or method == "rtn" else h.diagonal
    out = [
        (
            torch.empty(n, k, dtype=torch.int8 if grid.symmetric else torch.uint8),
            torch.empty(n, k),
            list[torch.Tensor](),
            list[torch.Tensor](),
        )
        for grid in grids
    ]
    step = max(1, ROUNDED_ROWS // len(grids))
    for first in range(0, n, step):
        rows = slice(first, min(first + step, n))
        part = w[rows]
        if method == "gptq":
            assert h is not None
            fitted = [
                (c, _dequantized(c, s, zp, grid.block), s, zp)
                for grid, (c, s, zp) in zip(
                    grids, fits.gptq_linear_grids(part, h, grids), strict=True
                )
            ]
        else:
            fitted = [_nearest(part, grid, importance) for grid in grids]
        for (c, q, s, zp), (codes, values, scales, zero_points) in zip(fitted, out, strict=True):
            codes[rows] = c.reshape(-1, k).to(codes.dtype)
            values[rows] = q.reshape(-1, k)
            scales.append(s)
            if zp is not None:
                zero_points.append(zp)
    return [
        (codes, values, torch.cat(scales), torch.cat(zero_points) if zero_points else None)
        for codes, values, scales, zero_points in out
    ]


def _dequantized(
    codes: torch.Tensor, s: torch.Tensor, zp: torch.Tensor | None, block: int
) -> torch.Tensor:
    """The values of ``codes [N, K]`` with scales (and zero points) ``[N, K // block]``."""
    offset = 0 if zp is None else zp.repeat_interleave(block, 1)
    return (codes - offset) * s.repeat_interleave(block, 1)


def _nearest(
    w: torch.Tensor, grid: fits.LinearGrid, importance: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(codes, values, scales, zero points)`` of ``w [N, K]`` rounded to the nearest on
    the grid :func:`~coreai_torch.compression.calibrated.linear_scales` chooses."""
    s, zp = fits.linear_scales(
        w,
        grid.bits,
        grid.block,
        symmetric=grid.symmetric,
        scale_dtype=grid.scale_dtype,
        importance=importance,
    )
    n, k = w.shape
    c, q = fits.quantize_values(
        w.reshape(n, k // grid.block, grid.block),
        s[..., None],
        None if zp is None else zp[..., None],
        grid.bits,
    )
    return c, q, s, zp


def fit_weight(
    module: nn.Module,
    weight: torch.Tensor,
    h: fits.Hessian | None,
    form: LinearQuantization | Palettization,
    scale_dtype: torch.dtype,
    *,
    method: str = "gptq",
) -> Fitted:
    """The codes of ``weight`` (the module's, float32, ``[out, in, ...]``) in ``form`` and
    the fitted weight (float32, the module's shape), or why ``form`` does not apply.
    ``method`` (:data:`METHODS`): ``"gptq"``, ``"awq"`` (activation-aware scales or
    weighted palettes, each weight rounded to the nearest) or ``"rtn"`` (what ``compress()``
    stores without calibration; ``h`` may then be None)."""
    return fit_forms(module, weight, h, [form], scale_dtype, method=method)[0]


def fit_forms(
    module: nn.Module,
    weight: torch.Tensor,
    h: fits.Hessian | None,
    forms: Sequence[LinearQuantization | Palettization],
    scale_dtype: torch.dtype,
    *,
    method: str = "gptq",
) -> list[Fitted]:
    """:func:`fit_weight` of ``weight`` in each of ``forms``, the same results: the linear
    forms of a weight up to :data:`STACKED_ELEMENTS` fitted elements in one GPTQ run."""
    if h is None and method != "rtn":
        raise ValueError(f"method={method!r} fits against the inputs' Hessian: none given")
    shape = weight.shape
    w = weight.reshape(shape[0], -1)
    n, k = w.shape
    results: list[Fitted | None] = [None] * len(forms)
    linear: list[tuple[int, LinearQuantization, fits.LinearGrid]] = []
    for i, form in enumerate(forms):
        if isinstance(form, Palettization):
            results[i] = _palettes(w, shape, h, form, scale_dtype, method)
            continue
        block = _reduced_block(module, form)
        assert block is not None
        if k % block:
            results[i] = (
                f"its input size {shape[1]} is not a multiple of block_size={form.block_size}"
            )
            continue
        grid = fits.LinearGrid(form.bits, block, form.symmetric, form.scale_dtype or scale_dtype)
        linear.append((i, form, grid))
    together = max(1, STACKED_ELEMENTS // max(1, w.numel()))
    for first in range(0, len(linear), together):
        stack = linear[first : first + together]
        fitted = _linear_by_rows(w, [grid for _, _, grid in stack], h, method)
        for (i, form, grid), (codes, values, s, zp) in zip(stack, fitted, strict=True):
            groups = [n, k // grid.block] + [1] * (len(shape) - 2)
            if len(shape) > 2:  # a convolution: blocks of input channels
                groups[1] = shape[1] // (grid.block // (k // shape[1]))
            result = LinearCodes(
                codes.reshape(shape).numpy(),  # int8 / uint8 already: not copied
                form.bits,
                s.reshape(groups).numpy(),
                None if zp is None else zp.reshape(groups).numpy().astype(np.int32),
                signed=form.symmetric,
            )
            results[i] = (result, values.reshape(shape))
    return [r for r in results if r is not None]


def _palettes(
    w: torch.Tensor,
    shape: torch.Size,
    h: fits.Hessian | None,
    form: Palettization,
    scale_dtype: torch.dtype,
    method: str,
) -> Fitted:
    """:func:`fit_weight` of ``w`` (the weight as ``[N, K]``, ``shape`` its own) in palettes."""
    n, k = w.shape
    group = form.group_size if form.group_size is not None and form.group_size < n else n
    if n % group:
        return f"its {n} output channels are not a multiple of group_size={group}"
    if method == "gptq":
        assert h is not None
        indices, palettes = fits.gptq_palettes(w, h, form.bits, group, iterations=form.iterations)
    else:
        importance = None if h is None or method == "rtn" else h.diagonal
        weights = torch.ones(k) if importance is None else importance
        palettes = fits.weighted_palettes(w, form.bits, group, weights, form.iterations)
        indices = fits.nearest_entries(w.reshape(n // group, group * k), palettes).reshape(n, k)
    fitted = palettes.repeat_interleave(group, 0).gather(1, indices)
    lut = palettes.to(scale_dtype).float()
    lut_array = lut.reshape(n // group, *[1] * (len(shape) - 1), 1 << form.bits, 1).numpy()
    palette_codes = PaletteCodes(
        indices.reshape(shape).numpy().astype(np.uint8), form.bits, lut_array
    )
    return palette_codes, fitted.reshape(shape)


def fit_in_pieces(
    module: nn.Module,
    weight: torch.Tensor,
    h: fits.Hessian,
    form: LinearQuantization | Palettization,
    scale_dtype: torch.dtype,
    *,
    method: str = "gptq",
) -> tuple[LinearCodes | PaletteCodes, float] | str:
    """:func:`fit_weight` of a tall weight (an output head over the vocabulary) read, fitted
    and measured :func:`_row_step` rows at a time from where the model holds it (its
    checkpoint, for a streamed model): its codes and output error, or why ``form`` does not
    apply.  Neither the weight nor its fitted copy is ever whole in float32 (rows are
    independent, in GPTQ too: the codes are :func:`fit_weight`'s)."""
    n = weight.shape[0]
    group = form.group_size if isinstance(form, Palettization) else None
    if group is not None and group < n and n % group:
        return f"its {n} output channels are not a multiple of group_size={group}"
    step = _row_step(module, form)
    pieces: list[LinearCodes | PaletteCodes] = []
    noise = signal = 0.0
    for first in range(0, n, step):
        rows = _read_rows(weight, first, step)
        out = fit_weight(module, rows, h, form, scale_dtype, method=method)
        if isinstance(out, str):
            return out
        codes, fitted = out
        count = rows.shape[0]
        more_noise, more_signal = fits.error_energies(
            rows.reshape(count, -1), fitted.reshape(count, -1), h
        )
        noise, signal = noise + more_noise, signal + more_signal
        pieces.append(codes)
        del rows, fitted
    return joined_rows(pieces), fits.relative(noise, signal)


def _candidates(config: CompressionConfig) -> list[LinearQuantization | Palettization]:
    if isinstance(config, Mixed):
        return list(config.forms)
    if isinstance(config, Pruning):
        raise CalibrationError(
            "calibration fits linear quantization and palettes; Pruning is data-free"
        )
    return [config]


def _form_for(
    config: CompressionConfig, name: str, module: nn.Module, head: bool
) -> CompressionConfig | None:
    """The form ``config`` gives the weight (None: left alone), as ``compress()`` chooses."""
    if isinstance(config, Mixed):
        return config if config.selects(name) else None
    if not config.selects(name) or _weight(module).numel() < config.min_elements:
        return None
    if head:
        override = config.output_head
        if override is False:
            return None
        return config if override is True else override
    return config


# ---------------------------------------------------------------------------- calibrate ---


@dataclass
class _Layer:
    """A fittable layer: its module, qualified weight name, aliases, whether it is the
    output head (its outputs are the model's)."""

    name: str
    module: nn.Module
    aliases: tuple[str, ...]
    head: bool


def _layers(model: nn.Module) -> dict[int, _Layer]:
    """Every fittable layer of the model by ``id(module)``, named by its weight."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    head_module = None
    getter = getattr(model, "get_output_embeddings", None)
    if callable(getter):
        with contextlib.suppress(Exception):
            head_module = getter()
    found = {}
    for module in model.modules():
        if fittable(module) and id(module) not in found:
            all_names = names.get(id(module.weight), [])
            if all_names:
                found[id(module)] = _Layer(
                    all_names[0], module, tuple(all_names[1:]), module is head_module
                )
    return found


def calibrate(
    model: nn.Module,
    samples: Any,
    config: CompressionConfig,
    *,
    scale_dtype: torch.dtype | None = None,
    method: str = "gptq",
    progress: Any = None,
) -> Calibration:
    """Fit the weights of ``model`` that ``config`` selects against the activations of
    ``samples`` (see the module documentation).  ``samples``: what the model is called with,
    a tensor (its first argument), a tuple of arguments, a dict of keyword arguments, or a
    list of these.  ``scale_dtype``: the precision of the program's scales and palettes
    (the program's weight type; default the model's).  ``method``: ``"gptq"`` (default),
    ``"awq"`` (activation-aware scales / weighted palettes, no error compensation) or
    ``"rtn"`` (the codes ``compress()`` fits without data, with their output error measured
    on the samples; :func:`measure` measures them without keeping codes).  The model is not
    modified."""
    if method not in METHODS:
        raise ValueError(f"calibrate(method=...) takes one of {', '.join(METHODS)}, got {method!r}")
    if not isinstance(config, (LinearQuantization, Palettization, Mixed, Pruning)):
        raise TypeError(
            "calibrate() takes a coreai_torch.compression LinearQuantization, Palettization or "
            f"Mixed configuration, got {type(config).__name__}"
        )
    _candidates(config)
    start = time.perf_counter()
    calls = as_batches(samples)
    dtype = scale_dtype or _model_dtype(model)
    result = Calibration(config.describe() + ("" if method == "gptq" else f", {method}"))
    result.samples = sum(_count(args, kwargs) for args, kwargs in calls)
    result.tokens = sum(_tokens(args, kwargs) for args, kwargs in calls)
    layers = _layers(model)
    listener = progress_events.resolve(progress)
    forms: dict[str, LinearQuantization | Palettization] = {}
    if isinstance(config, Mixed):
        with Workers():
            errors = _sensitivity(model, calls, layers, config, dtype, listener)
        forms = allocate(model, layers, errors, config, dtype)
        result.target_bpw = config.target_bpw
    else:
        for layer in layers.values():
            form = _form_for(config, layer.name, layer.module, layer.head)
            if isinstance(form, (LinearQuantization, Palettization)):
                forms[layer.name] = form

    spilling = Spilling()  # the codes of weights streamed from their checkpoint wait there

    def fit(
        layer: _Layer, weight: torch.Tensor, h: fits.Hessian | None
    ) -> torch.Tensor | FittedWeight | None:
        form = forms.get(layer.name)
        if form is None:
            return None
        if h is None:
            inputs = math.prod(weight.shape[1:])
            result.unfitted.append(
                (
                    layer.name,
                    f"its {inputs} inputs per output channel exceed MAX_HESSIAN_INPUTS="
                    f"{MAX_HESSIAN_INPUTS} (a {inputs}x{inputs} Hessian): compressed without "
                    "calibration",
                )
            )
            return None
        fitted: torch.Tensor | None = None
        if layer.head:  # a tall weight, perhaps still in its checkpoint: never whole
            out = fit_in_pieces(layer.module, weight, h, form, dtype, method=method)
            if isinstance(out, str):
                result.unfitted.append((layer.name, out))
                return None
            codes, error = out
        else:
            whole = fit_weight(layer.module, weight, h, form, dtype, method=method)
            if isinstance(whole, str):
                result.unfitted.append((layer.name, whole))
                return None
            codes, fitted = whole
            n = weight.shape[0]
            error = fits.output_error(weight.reshape(n, -1), fitted.reshape(n, -1), h)
        done = FittedWeight(
            layer.name,
            form,
            spilled(codes, spilling) if lazy.is_lazy(_weight(layer.module)) else codes,
            error,
            bits_per_weight(form, tuple(weight.shape), dtype),
            weight.numel(),
            layer.aliases,
        )
        result.weights[layer.name] = done
        return done if fitted is None else fitted

    # torch's kernels on one thread: the small kernels of the fits, split over threads,
    # wait at every call for a thread another process holds (1000x slower on a busy machine)
    with Workers():
        result.output_error = _walk(
            model,
            calls,
            layers,
            fit,
            listener,
            "calibrate",
            measure=True,
            sequential=method != "rtn",  # round-to-nearest codes do not depend on the inputs
        )
    return_freed_memory()  # the walk's temporaries, before the program is compressed
    result.planned_bpw = planned_bpw(model, result, dtype, config)
    result.seconds = time.perf_counter() - start
    return result


def _model_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _first(args: Any, kwargs: Any) -> torch.Tensor | None:
    return next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)


def _count(args: Any, kwargs: Any) -> int:
    first = _first(args, kwargs)
    return int(first.shape[0]) if first is not None and first.dim() > 0 else 1


def _tokens(args: Any, kwargs: Any) -> int:
    first = _first(args, kwargs)
    if first is None or first.is_floating_point() or first.dim() != 2:
        return 0
    return int(first.numel())


# ------------------------------------------------------------------------ the block walk ---

#: ``fit(layer, weight, Hessian) -> fitted weight`` (None: keep the weight), the weight in
#: float32, but an output head after the blocks as the model holds it (perhaps still in its
#: checkpoint: :func:`fit_in_pieces`), which may be answered with its codes
#: (:class:`FittedWeight`); the Hessian is None for a layer with more than
#: :data:`MAX_HESSIAN_INPUTS` inputs
Fit = Callable[[_Layer, torch.Tensor, "fits.Hessian | None"], "torch.Tensor | FittedWeight | None"]


class _Replay(nn.Module):
    """A block that returns the carried activations of the current call (and has the
    original block's attributes: a model's forward may read them, e.g. ``attention_type``)."""

    def __init__(
        self, outputs: list[Any], state: dict[str, int], advance: bool, original: nn.Module
    ) -> None:
        super().__init__()
        self.outputs, self.state, self.advance = outputs, state, advance
        object.__setattr__(self, "original", original)  # not a submodule: no parameters

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["original"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = self.outputs[self.state["call"]]
        if self.advance:
            self.state["call"] += 1
        return (out,) if type(self.__dict__["original"]) in _TUPLE_BLOCKS else out


@contextlib.contextmanager
def _replayed(blocks: nn.ModuleList, outputs: list[Any]) -> Iterator[None]:
    """Inside: every block returns the carried ``outputs`` (one per call, in order)."""
    saved = list(blocks)
    state = {"call": 0}
    for i in range(len(saved)):
        blocks[i] = _Replay(outputs, state, advance=i == len(saved) - 1, original=saved[i])
    try:
        yield
    finally:
        for i, block in enumerate(saved):
            blocks[i] = block


class _Inputs:
    """The inputs of the fittable layers of one stage, accumulated into Hessians; the
    forward pass is ended (:class:`_Stop`) once the layer ``stop_after`` has its inputs (the
    rest of the pass is not needed: the output head's outputs, the layers of a block after
    the group being fitted)."""

    def __init__(self, stop_after: str | None = None) -> None:
        self.hessians: dict[str, fits.Hessian] = {}
        #: layers with more inputs than :data:`MAX_HESSIAN_INPUTS` (no Hessian)
        self.too_large: set[str] = set()
        self.stop_after = stop_after

    def __call__(self, name: str, module: nn.Module, x: torch.Tensor) -> None:
        if math.prod(_weight(module).shape[1:]) > MAX_HESSIAN_INPUTS:
            self.too_large.add(name)
        else:
            rows = layer_inputs(module, x)
            self.hessians.setdefault(name, fits.Hessian(rows.shape[1])).add(rows)
        if name == self.stop_after:
            raise _Stop


def _parameters(
    module: nn.Module, outside: nn.Module | None = None, skip: set[int] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The module's parameters (those not in ``outside``, nor in ``skip`` by ``id``) in
    float32 (read now), each tied parameter under one name, and the name each parameter's
    names stand for."""
    inside = {id(p) for p in outside.parameters()} if outside is not None else set()
    inside |= skip or set()
    values: dict[str, torch.Tensor] = {}
    names: dict[str, str] = {}
    first: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in inside:
            continue
        if id(p) not in first:
            first[id(p)] = name
            values[name] = _float(lazy.materialize(p))
        names[name] = first[id(p)]
    return values, names


def _fit_stage(
    modules: dict[str, nn.Module],
    inputs: _Inputs,
    params: dict[str, torch.Tensor],
    names: dict[str, str],
    layers: dict[int, _Layer],
    fit: Fit,
    heads: dict[str, FittedWeight | None] | None = None,
) -> None:
    """Fit the stage's layers in place of their weights in ``params``; with ``heads``, the
    output head is fitted from its weight as the model holds it, and its codes (None: not
    fitted) are put in ``heads``.  Each Hessian is let go once its layer is fitted."""
    for local, module in modules.items():
        h = inputs.hessians.pop(local, None)
        if h is None and local not in inputs.too_large:
            continue  # not run by the samples
        layer = layers[id(module)]
        if heads is not None and layer.head:
            fitted = fit(layer, _weight(module), h)
            heads[layer.name] = fitted if isinstance(fitted, FittedWeight) else None
            continue
        key = names[f"{local}.weight" if local else "weight"]
        fitted = fit(layer, params[key], h)
        if isinstance(fitted, FittedWeight):
            codes = fitted.read_codes()
            fitted = torch.from_numpy(codes.dequantized()).reshape(params[key].shape)
        if fitted is not None:
            params[key] = fitted


def _walk(
    model: nn.Module,
    calls: list[tuple[Any, Any]],
    layers: dict[int, _Layer],
    fit: Fit,
    listener: Any,
    phase: str,
    *,
    measure: bool,
    sequential: bool = True,
) -> float | None:
    """Run the model stage by stage on ``calls``, calling ``fit`` on every fittable layer
    with its float32 weight and the Hessian of its inputs; the weight ``fit`` returns is
    used from then on (the activations carried to the next block are the fitted model's).
    With ``measure``, the float model's outputs of the first samples are carried too and
    the relative output error of the fitted model is returned.  With ``sequential``, the
    layers of a block are fitted in the order they run, a group of layers sharing an input at
    a time (attention's projections, then its output, ...), each group on the inputs the
    block's layers fitted before it give (GPTQ's "true sequential" order).

    Of a token embedding table before the blocks only the rows the samples look up are
    read; an output head after them is read a piece of rows at a time (by ``fit`` and the
    measurement): neither is ever whole in float32."""
    blocks = find_blocks(model)
    if blocks is None:
        return _walk_one_stage(model, calls, layers, fit, measure=measure)
    walk = functools.partial(
        _walk_blocks,
        model,
        blocks,
        calls,
        layers,
        fit,
        listener,
        phase,
        measure=measure,
        sequential=sequential,
    )
    heads = {id(_weight(layer.module)) for layer in layers.values() if _outer_head(blocks, layer)}
    embedding = _outer_embedding(model, blocks, layers)
    if embedding is None:
        return walk(skip=heads)
    table = embedding.weight
    ids = _looked_up(model, embedding, calls)
    rows = _table_rows(embedding, ids, None, lambda module, rows: rows)[0]
    with _looked_up_rows(embedding, ids, [rows]):
        return walk(skip={*heads, id(table)}, tables={_canonical_of(model, table): rows})


@contextlib.contextmanager
def _looked_up_rows(
    embedding: nn.Embedding, ids: torch.Tensor, tables: Sequence[torch.Tensor]
) -> Iterator[None]:
    """Inside: a lookup in one of ``tables`` (the rows ``ids`` of the embedding's table, in
    place of the table) looks up the row of each id; lookups in the whole table (the
    sensitivity pass's) are left alone."""

    def remap(module: nn.Module, args: Any) -> Any:
        if not any(module.weight is table for table in tables):
            return None
        return (torch.searchsorted(ids, args[0]), *args[1:])

    handle = embedding.register_forward_pre_hook(remap)
    try:
        yield
    finally:
        handle.remove()


def _input_groups(
    block: nn.Module,
    modules: dict[str, nn.Module],
    weights: dict[str, torch.Tensor],
    stream: list[tuple[Any, Any]],
) -> list[tuple[dict[str, nn.Module], str | None]]:
    """The block's fittable layers in the order they run on the stream's first call, grouped
    by the input they share, each group with the layer after which a pass can stop (None:
    a layer runs more than once per call, so every pass runs the whole block)."""
    seen: list[tuple[str, torch.Tensor]] = []
    with _recording(modules, lambda name, module, x: seen.append((name, x))):
        _call(block, weights, *stream[0])
    names = [name for name, _ in seen]
    groups: list[dict[str, nn.Module]] = []
    shared: torch.Tensor | None = None
    for name, x in seen:
        if any(name in group for group in groups):
            continue
        if groups and x is shared:
            groups[-1][name] = modules[name]
        else:
            groups.append({name: modules[name]})
        shared = x
    once = len(names) == len(set(names))
    return [(group, list(group)[-1] if once else None) for group in groups]


def _outer_head(blocks: nn.ModuleList, layer: _Layer) -> bool:
    return layer.head and not _inside(blocks, layer.module)


def _walk_one_stage(
    model: nn.Module,
    calls: list[tuple[Any, Any]],
    layers: dict[int, _Layer],
    fit: Fit,
    *,
    measure: bool,
) -> float | None:
    """:func:`_walk` of a model without blocks: every layer fitted on the float inputs."""
    params, names = _parameters(model)
    reference = dict(params)
    outer_modules = {n: m for n, m in model.named_modules() if id(m) in layers}
    inputs = _Inputs()
    with _recording(outer_modules, inputs):
        for args, kwargs in calls:
            _call(model, params, args, kwargs)
    _fit_stage(outer_modules, inputs, params, names, layers, fit)
    if not measure:
        return None
    measured = calls[:MEASURED_SAMPLES]
    f = [_output_tensor(_call(model, reference, a, k)) for a, k in measured]
    c = [_output_tensor(_call(model, params, a, k)) for a, k in measured]
    return _relative(f, c)


def _walk_blocks(
    model: nn.Module,
    blocks: nn.ModuleList,
    calls: list[tuple[Any, Any]],
    layers: dict[int, _Layer],
    fit: Fit,
    listener: Any,
    phase: str,
    *,
    measure: bool,
    sequential: bool,
    skip: set[int],
    tables: dict[str, torch.Tensor] | None = None,
) -> float | None:
    """:func:`_walk` of a model made of blocks, the weights ``skip`` (by ``id``) not read
    whole (``tables``: the rows of the embedding table the samples look up, by name)."""
    inside = {id(m) for m in blocks.modules()}
    params, names = _parameters(model, blocks, skip=skip)
    params.update(tables or {})
    reference = dict(params)
    outer_modules = {
        n: m for n, m in model.named_modules() if id(m) in layers and id(m) not in inside
    }
    # the layers before the blocks, fitted on the float inputs
    first_inputs = _Inputs()
    with _recording(outer_modules, first_inputs):
        _block_inputs(model, blocks, params, calls)
    before = {n: m for n, m in outer_modules.items() if n in first_inputs.hessians}
    _fit_stage(before, first_inputs, params, names, layers, fit)
    stream = _block_inputs(model, blocks, params, calls)
    floats = _block_inputs(model, blocks, reference, calls[:MEASURED_SAMPLES]) if measure else []
    total = len(blocks) + 1
    with progress_events.phase(listener, phase, total, "blocks") as advance:
        for index, block in enumerate(blocks):
            weights, local_names = _parameters(block)
            modules = {n: m for n, m in block.named_modules() if id(m) in layers}
            floats = [  # before the fit: each float weight is let go as it is fitted
                ((_run_block(block, weights, args, kwargs), *args[1:]), kwargs)
                for args, kwargs in floats
            ]
            groups = _input_groups(block, modules, weights, stream) if sequential else None
            for group, stop_after in groups or [(modules, None)]:
                inputs = _Inputs(stop_after)
                with _recording(group, inputs):
                    for args, kwargs in stream:
                        with contextlib.suppress(_Stop):
                            _call(block, weights, args, kwargs)
                _fit_stage(group, inputs, weights, local_names, layers, fit)
            stream = [
                ((_run_block(block, weights, args, kwargs), *args[1:]), kwargs)
                for args, kwargs in stream
            ]
            del weights, inputs
            return_freed_memory()  # the block's temporaries, between the codes that stay
            advance(index + 1, total)
        # the layers after the blocks (a norm, the output head), on the fitted stream
        after = {n: m for n, m in outer_modules.items() if n not in before}
        head = next((n for n, m in after.items() if layers[id(m)].head), None)
        last = _Inputs(head)
        with _recording(after, last), _replayed(blocks, [a[0] for a, _ in stream]):
            for args, kwargs in calls:
                with contextlib.suppress(_Stop):
                    _call(model, params, args, kwargs)
        heads: dict[str, FittedWeight | None] = {}
        _fit_stage(after, last, params, names, layers, fit, heads)
        advance(total, total)
    if not measure:
        return None
    return _measure(
        model,
        blocks,
        after,
        layers,
        calls[:MEASURED_SAMPLES],
        (params, reference),
        [a[0] for a, _ in stream[:MEASURED_SAMPLES]],
        [a[0] for a, _ in floats],
        heads,
    )


def _float(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.float() if t.is_floating_point() else t


def _float_args(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(
        a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args
    )


def _measure(
    model: nn.Module,
    blocks: nn.ModuleList,
    after: dict[str, nn.Module],
    layers: dict[int, _Layer],
    calls: list[tuple[Any, Any]],
    values: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
    fitted_outputs: list[torch.Tensor],
    float_outputs: list[torch.Tensor],
    heads: dict[str, FittedWeight | None],
) -> float:
    """``‖y_fitted - y_float‖² / ‖y_float‖²`` of the model's outputs for the measured calls
    (whose last block outputs are given; ``values`` the fitted and the float parameters);
    an output head is read and applied a piece of :func:`_row_step` output channels at a
    time (:func:`_head_error`), its fitted rows from its codes (``heads``)."""
    params, reference = values
    head = next((layers[id(m)] for m in after.values() if layers[id(m)].head), None)
    fitted = _outputs(model, blocks, params, calls, fitted_outputs, head)
    floats = _outputs(model, blocks, reference, calls, float_outputs, head)
    if head is None:
        return _relative(floats, fitted)
    found = heads.get(head.name)
    codes = found.read_codes() if found is not None else None

    def approximated(first: int, rows: torch.Tensor) -> torch.Tensor:
        if codes is None:
            return rows
        part = rows_of(codes, first, rows.shape[0]).dequantized()
        return torch.from_numpy(part).reshape(rows.shape)

    form = found.config if found is not None else None
    return _head_error(floats, fitted, _read_pieces(head.module, form, approximated))


def _canonical_of(model: nn.Module, target: torch.Tensor) -> str:
    """The first name of the parameter ``target`` (tied parameters have several)."""
    return next(n for n, p in model.named_parameters(remove_duplicate=False) if p is target)


def _relative(reference: list[torch.Tensor], fitted: list[torch.Tensor]) -> float:
    signal = sum(float((r.double() ** 2).sum()) for r in reference)
    noise = sum(
        float(((c.double() - r.double()) ** 2).sum())
        for r, c in zip(reference, fitted, strict=True)
    )
    return noise / signal if signal > 0 else 0.0


# ------------------------------------------------------------------ data-free measurement ---

#: float32 elements of a weight rounded at once by :func:`measure` (64 MB)
MEASURE_ELEMENTS = 1 << 24


def measure(
    model: nn.Module,
    samples: Any,
    config: LinearQuantization | Palettization,
    *,
    scale_dtype: torch.dtype | None = None,
    progress: Any = None,
) -> Calibration:
    """The relative output error of the whole model with every weight ``config`` selects
    rounded to the codes ``compress()`` stores without data (round to nearest), on the first
    :data:`MEASURED_SAMPLES` samples; no codes are kept.

    The float and the rounded model run block by block as in :func:`calibrate`, without
    Hessians; a large weight is rounded :data:`MEASURE_ELEMENTS` at a time; of the token
    embedding table only the rows the samples look up are read (and rounded), and the output
    head is read, rounded and applied a piece at a time.  Memory: one block's
    weights twice (float and rounded), never a whole table in float32; time: reading every
    weight once, rounding it once, two runs over the samples."""
    start = time.perf_counter()
    calls = as_batches(samples)[:MEASURED_SAMPLES]
    dtype = scale_dtype or _model_dtype(model)
    result = Calibration(config.describe() + ", rtn")
    result.samples = sum(_count(args, kwargs) for args, kwargs in calls)
    result.tokens = sum(_tokens(args, kwargs) for args, kwargs in calls)
    layers = _layers(model)
    forms: dict[int, LinearQuantization | Palettization] = {}
    for key, layer in layers.items():
        form = _form_for(config, layer.name, layer.module, layer.head)
        if isinstance(form, (LinearQuantization, Palettization)):
            forms[key] = form
    blocks = find_blocks(model)
    embedding = _outer_embedding(model, blocks, layers)
    if blocks is None or embedding is None:  # not a token model made of blocks
        # the calls as samples again (each call has either arguments or keyword arguments)
        measured = [kwargs if kwargs or not args else args for args, kwargs in calls]
        fallback = calibrate(model, measured, config, scale_dtype=dtype, method="rtn")
        fallback.weights = {}
        return fallback

    def rounded(module: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        form = forms.get(id(module))
        if form is None:
            return rows
        shape = rows.shape
        out = fit_weight(module, rows, None, form, dtype, method="rtn")
        return rows if isinstance(out, str) else out[1].reshape(shape)

    params, _ = _parameters(model, blocks, skip={id(embedding.weight), *_head_weights(layers)})
    name = _canonical_of(model, embedding.weight)
    ids = _looked_up(model, embedding, calls)
    tables = _table_rows(embedding, ids, forms.get(id(embedding)), rounded)
    listener = progress_events.resolve(progress)
    with _looked_up_rows(embedding, ids, tables):
        streams = [_block_inputs(model, blocks, {**params, name: table}, calls) for table in tables]
        with progress_events.phase(listener, "measure", len(blocks), "blocks") as advance:
            for index, block in enumerate(blocks):
                weights, local_names = _parameters(block)
                fitted = dict(weights)
                for local, module in block.named_modules():
                    if id(module) in forms:
                        weight_name = local_names[f"{local}.weight" if local else "weight"]
                        fitted[weight_name] = _by_rows(
                            weights[weight_name], forms[id(module)], rounded, module
                        )
                streams = [
                    [
                        ((_run_block(block, values, args, kwargs), *args[1:]), kwargs)
                        for args, kwargs in stream
                    ]
                    for values, stream in zip((weights, fitted), streams, strict=True)
                ]
                del weights, fitted
                advance(index + 1, len(blocks))
        head = next((layer for layer in layers.values() if layer.head), None)
        outputs = [
            _outputs(model, blocks, {**params, name: table}, calls, [a[0] for a, _ in stream], head)
            for table, stream in zip(tables, streams, strict=True)
        ]
    if head is None or _inside(blocks, head.module):
        result.output_error = _relative(outputs[0], outputs[1])
    else:
        module = head.module
        pieces = _read_pieces(
            module, forms.get(id(module)), lambda first, rows: rounded(module, rows)
        )
        result.output_error = _head_error(outputs[0], outputs[1], pieces)
    result.seconds = time.perf_counter() - start
    return result


def _outer_embedding(
    model: nn.Module, blocks: nn.ModuleList | None, layers: dict[int, _Layer]
) -> nn.Embedding | None:
    """The token embedding table before the blocks, if the model has one."""
    if blocks is None:
        return None
    getter = getattr(model, "get_input_embeddings", None)
    found = None
    if callable(getter):
        with contextlib.suppress(Exception):
            found = getter()
    if isinstance(found, nn.Embedding) and not _inside(blocks, found):
        return found
    return None


def _inside(blocks: nn.ModuleList, module: nn.Module) -> bool:
    return any(m is module for m in blocks.modules())


def _head_weights(layers: dict[int, _Layer]) -> set[int]:
    return {id(_weight(layer.module)) for layer in layers.values() if layer.head}


def _looked_up(model: nn.Module, embedding: nn.Embedding, calls: list[Any]) -> torch.Tensor:
    """The token ids the calls look up in the ``embedding`` table, sorted, each once."""
    seen: list[torch.Tensor] = []

    def hook(module: nn.Module, args: Any) -> None:
        seen.append(args[0])
        raise _Stop

    handle = embedding.register_forward_pre_hook(hook)
    try:
        for args, kwargs in calls:
            with contextlib.suppress(_Stop):
                _call(model, {}, args, kwargs)
    finally:
        handle.remove()
    ids: torch.Tensor = torch.unique(torch.cat([t.reshape(-1) for t in seen]))
    return ids


def _read_rows(weight: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """Rows ``first .. first + count`` of a weight in float32 (a streamed weight read alone
    when its checkpoint allows)."""
    if lazy.is_lazy(weight):
        rows = lazy.read_rows(weight, first, count)
        if rows is None:
            rows = lazy.materialize(weight)[first : first + count]
        return rows.float()
    return weight.detach()[first : first + count].float()


def _row_step(module: nn.Module, form: LinearQuantization | Palettization | None) -> int:
    """Rows of ``module``'s weight rounded at once: independent rows (a palette's group of
    output channels is one unit), about :data:`MEASURE_ELEMENTS` elements."""
    weight = _weight(module)
    n = weight.shape[0]
    unit = 1
    if isinstance(form, Palettization):
        unit = form.group_size if form.group_size is not None and form.group_size < n else n
    per_row = max(1, weight[0].numel())
    return max(unit, MEASURE_ELEMENTS // per_row // unit * unit)


def _by_rows(
    weight: torch.Tensor,
    form: LinearQuantization | Palettization,
    rounded: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    module: nn.Module,
) -> torch.Tensor:
    step = _row_step(module, form)
    if step >= weight.shape[0]:
        return rounded(module, weight)
    out = torch.empty_like(weight)
    for first in range(0, weight.shape[0], step):
        out[first : first + step] = rounded(module, weight[first : first + step])
    return out


def _table_rows(
    embedding: nn.Embedding,
    ids: torch.Tensor,
    form: LinearQuantization | Palettization | None,
    rounded: Callable[[nn.Module, torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The float and the rounded rows ``ids`` (sorted) of the embedding table: only the
    pieces of :func:`_row_step` rows holding them are read and rounded."""
    step = _row_step(embedding, form)
    floats, fitted = [], []
    for first in sorted({int(i) // step * step for i in ids}):
        rows = _read_rows(embedding.weight, first, step)
        wanted = ids[(ids >= first) & (ids < first + rows.shape[0])] - first
        floats.append(rows[wanted])
        fitted.append(rounded(embedding, rows)[wanted])
    return torch.cat(floats), torch.cat(fitted)


def _outputs(
    model: nn.Module,
    blocks: nn.ModuleList,
    values: dict[str, torch.Tensor],
    calls: list[Any],
    last_outputs: list[torch.Tensor],
    head: _Layer | None,
) -> list[torch.Tensor]:
    """The model's outputs for ``calls`` whose last block returned ``last_outputs`` (the
    output head's inputs when it has one outside the blocks)."""
    results: list[torch.Tensor] = []

    def stop(module: nn.Module, args: Any) -> None:
        results.append(args[0].float())
        raise _Stop

    handle = head.module.register_forward_pre_hook(stop) if head is not None else None
    try:
        with _replayed(blocks, last_outputs):
            for args, kwargs in calls:
                with contextlib.suppress(_Stop):
                    results.append(_first_tensor(_call(model, values, args, kwargs)).float())
    finally:
        if handle is not None:
            handle.remove()
    return results


def _head_error(
    floats: list[torch.Tensor],
    fitted: list[torch.Tensor],
    pieces: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
) -> float:
    """``‖y_fitted - y_float‖² / ‖y_float‖²`` of an output head's outputs for its inputs
    ``floats`` (the float model's) and ``fitted``, its weight given as ``pieces`` of output
    channels ``(float rows, fitted rows, bias or None)``: never the whole vocabulary at once."""
    signal = noise = 0.0
    for rows, approx, b in pieces:
        for xf, xc in zip(floats, fitted, strict=True):
            yf = xf @ rows.T
            yc = xc @ approx.T
            if b is not None:
                yf, yc = yf + b, yc + b
            signal += float((yf.double() ** 2).sum())
            noise += float(((yc - yf).double() ** 2).sum())
    return noise / signal if signal > 0 else 0.0


def _read_pieces(
    head: nn.Module,
    form: LinearQuantization | Palettization | None,
    approximated: Callable[[int, torch.Tensor], torch.Tensor],
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """The output head's weight read :func:`_row_step` rows at a time, with the rows that
    stand for them (``approximated(first row, rows)``): the pieces of :func:`_head_error`."""
    weight = _weight(head)
    bias = getattr(head, "bias", None)
    step = _row_step(head, form)
    for first in range(0, weight.shape[0], step):
        rows = _read_rows(weight, first, step)
        bias_rows = None if bias is None else _read_rows(bias, first, step)
        yield rows, approximated(first, rows), bias_rows


# ---------------------------------------------------------------------------- mixed bits ---

#: the seed of the labels the sensitivity pass draws from the model's own predictions
FISHER_SEED = 0


def _per_sample(calls: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """The calls split into one call per sample where every tensor argument has the batch as
    its first axis (the memory of a backward pass is then one sample's)."""
    out: list[tuple[Any, Any]] = []
    for args, kwargs in calls:
        n = _count(args, kwargs)
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        if n <= 1 or not all(t.dim() > 0 and t.shape[0] == n for t in tensors):
            out.append((args, kwargs))
            continue
        for i in range(n):

            def pick(a: Any, i: int = i) -> Any:
                return a[i : i + 1] if isinstance(a, torch.Tensor) else a

            out.append((tuple(pick(a) for a in args), {k: pick(v) for k, v in kwargs.items()}))
    return out


def _output_tensor(value: Any) -> torch.Tensor:
    """The model's main output: a tensor, the first of a tuple, logits or a last hidden state."""
    logits = getattr(value, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    return _first_tensor(value)


def _divergence(
    output: torch.Tensor, classes: int | None, generator: torch.Generator
) -> torch.Tensor:
    """A loss whose squared gradients estimate the Fisher information of the output (the
    curvature of the divergence from the float model's): the cross-entropy of labels drawn
    from the model's own predictions for logits over ``classes``, a Gaussian projection
    ``Σ r·y`` (the squared error's curvature) for any other output."""
    if classes is not None and output.shape[-1] == classes:
        logits = output.reshape(-1, classes).float()
        with torch.no_grad():
            labels = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)[:, 0]
        return F.cross_entropy(logits, labels, reduction="sum")
    r = torch.randn(output.shape, generator=generator)
    return (output.float() * r).sum()


@contextlib.contextmanager
def _output_gradients(
    modules: dict[str, nn.Module], layers: dict[int, _Layer], sums: dict[str, torch.Tensor]
) -> Iterator[None]:
    """While inside, the backward passes add each module's ``Σ (∂L/∂y)²`` per output channel
    to ``sums`` (by the layer's weight name)."""

    def on_forward(module: nn.Module, args: Any, output: Any) -> None:
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            return
        name = layers[id(module)].name
        axis = 1 if isinstance(module, nn.Conv2d) else output.dim() - 1

        def on_gradient(g: torch.Tensor) -> None:
            squares = g.detach().float() ** 2
            total = squares.sum(dim=[d for d in range(squares.dim()) if d != axis])
            sums[name] = sums[name] + total if name in sums else total

        output.register_hook(on_gradient)

    handles = [m.register_forward_hook(on_forward) for m in modules.values()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@dataclass
class _Fisher:
    """The sensitivity of the model's output to each layer's outputs (the diagonal of the
    Fisher information, ``Σ_t (∂L/∂y_tn)²`` over the calibration tokens, per output channel),
    and of the first block's input (for the embedding table, whose rows are looked up)."""

    outputs: dict[str, torch.Tensor]
    model: nn.Module
    blocks: nn.ModuleList | None = None
    calls: list[tuple[Any, Any]] = field(default_factory=list)
    params: dict[str, torch.Tensor] = field(default_factory=dict)
    #: per call, the float model's input of the first block and ``(∂L/∂x)²`` of it
    first_inputs: list[torch.Tensor] = field(default_factory=list)
    first_gradients: list[torch.Tensor] = field(default_factory=list)

    def score(self, layer: _Layer, d: torch.Tensor, h: fits.Hessian) -> float | None:
        """``Σ_n f_n (δ_n H δ_nᵀ) / T`` for the change ``d [N, K]`` of the layer's weight
        (``T`` the inputs ``H`` summed; about twice the increase of the loss summed over the
        tokens), plus the same for the looked-up rows of a table tied to it; None without a
        measured sensitivity."""
        f = self.outputs.get(layer.name)
        if f is None:
            return None
        per_row = h.row_energies(d)
        value = float((per_row * f.to(torch.float64)).sum()) / max(h.samples, 1)
        # a weight tied to a table looked up before the blocks is in ``params`` under its
        # first name (the layer's own); the lookups move with it
        tied = (
            [n for n in (layer.name, *layer.aliases) if n in self.params] if layer.aliases else []
        )
        if tied and self.blocks is not None and self.first_inputs:
            values = dict(self.params)
            table = values[tied[0]]
            values[tied[0]] = table - d.to(table.dtype).reshape(table.shape)
            moved = _block_inputs(self.model, self.blocks, values, self.calls)
            for (args, _), x, g in zip(moved, self.first_inputs, self.first_gradients, strict=True):
                value += float((g.double() * (args[0].double() - x.double()) ** 2).sum())
        return value


def _block_inputs(
    model: nn.Module, blocks: nn.ModuleList, values: dict[str, torch.Tensor], calls: list[Any]
) -> list[Any]:
    """The ``(args, kwargs)`` the first block is called with for each call (the model run
    with ``values`` as its parameters up to there)."""
    captured: list[tuple[Any, Any]] = []

    def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
        captured.append((_float_args(args), kwargs))
        raise _Stop

    handle = blocks[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for args, kwargs in calls:
            with contextlib.suppress(_Stop):
                _call(model, values, args, kwargs)
    finally:
        handle.remove()
    return captured


def segment_length(blocks: int) -> int:
    """Blocks per segment of the sensitivity pass's backward sweep: ``⌈√blocks⌉`` (the
    activations kept are then at most about ``2√blocks`` blocks' inputs)."""
    return max(1, math.isqrt(max(blocks - 1, 0)) + 1)


def _forward_block(block: nn.Module, stream: list[Any]) -> list[Any]:
    """The next block's calls: ``block`` (its weights read now) run on ``stream``."""
    weights, _ = _parameters(block)
    return [((_run_block(block, weights, a, k), *a[1:]), k) for a, k in stream]


def _fisher(model: nn.Module, calls: list[tuple[Any, Any]], layers: dict[int, _Layer]) -> _Fisher:
    """The output sensitivity of every fittable layer (:class:`_Fisher`): one forward and
    one backward pass over the calibration samples, block by block, a sample at a time.

    Memory is a few blocks' activations, not all of them: the forward pass keeps the
    activations entering every :func:`segment_length`-th block only; the backward sweep
    goes through the segments from the last, recomputes the inputs of the segment's blocks
    from the one kept, and runs each block's backward from the gradient of its output
    (the next block's input gradient).  Each block's weights are read three times (the
    forward pass, the recomputation, the backward); the sweep costs about two forward
    passes and one backward pass."""
    calls = _per_sample(calls)
    generator = torch.Generator().manual_seed(FISHER_SEED)
    head = next((layer for layer in layers.values() if layer.head), None)
    classes = int(_weight(head.module).shape[0]) if head is not None else None
    blocks = find_blocks(model)
    params, _ = _parameters(model, blocks)
    sums: dict[str, torch.Tensor] = {}
    if blocks is None:
        # the parameters are leaves that require gradients: the outputs' gradients need
        # a graph (the inputs may be token ids)
        params = {k: v.requires_grad_() if v.is_floating_point() else v for k, v in params.items()}
        modules = {layer.name: layer.module for layer in layers.values()}
        with _output_gradients(modules, layers, sums):
            for args, kwargs in calls:
                out = _output_tensor(_call(model, params, args, kwargs, grad=True))
                _divergence(out, classes, generator).backward()
        return _Fisher(sums, model)
    stream = _block_inputs(model, blocks, params, calls)
    first_inputs = [args[0] for args, _ in stream]
    step = segment_length(len(blocks))
    kept: dict[int, list[Any]] = {}
    for index, block in enumerate(blocks):
        if index % step == 0:
            kept[index] = stream
        stream = _forward_block(block, stream)
    inside = {id(m) for m in blocks.modules()}
    after = {n: m for n, m in model.named_modules() if id(m) in layers and id(m) not in inside}
    gradients: list[torch.Tensor] = []
    with _output_gradients(after, layers, sums):
        for (args, kwargs), (carried, _) in zip(calls, stream, strict=True):
            x = carried[0].detach().requires_grad_()
            with _replayed(blocks, [x]):
                out = _output_tensor(_call(model, params, args, kwargs, grad=True))
            _divergence(out, classes, generator).backward()
            gradients.append(x.grad if x.grad is not None else torch.zeros_like(x))
    del stream
    for start in reversed(sorted(kept)):
        entering = [kept.pop(start)]
        stop = min(start + step, len(blocks))
        for index in range(start, stop - 1):  # the segment's block inputs, recomputed
            entering.append(_forward_block(blocks[index], entering[-1]))
        for index in reversed(range(start, stop)):
            block = blocks[index]
            weights, _ = _parameters(block)
            modules = {n: m for n, m in block.named_modules() if id(m) in layers}
            with _output_gradients(modules, layers, sums):
                for j, (args, kwargs) in enumerate(entering.pop()):
                    x = args[0].detach().requires_grad_()
                    out = _run_block(block, weights, (x, *args[1:]), kwargs, grad=True)
                    out.backward(gradients[j])
                    gradients[j] = x.grad if x.grad is not None else torch.zeros_like(x)
            del weights
    return _Fisher(
        sums,
        model,
        blocks,
        calls,
        params,
        first_inputs,
        [g.detach() ** 2 for g in gradients],
    )


#: how the sensitivity pass fits each candidate form (:data:`METHODS`)
SENSITIVITY_METHOD = "gptq"


def _sensitivity(
    model: nn.Module,
    calls: list[tuple[Any, Any]],
    layers: dict[int, _Layer],
    config: Mixed,
    dtype: torch.dtype,
    listener: Any,
) -> dict[str, dict[int, float]]:
    """Per selected weight, the effect of each candidate form (by index in
    ``config.forms``; forms that do not apply are missing) on the model's output: the form
    fitted on the float model's activations, its change of the layer's outputs weighted by
    how much each output channel moves the model's output (:func:`_fisher`), so that one
    scale holds for every weight, the output head and a tied embedding table included.
    A layer the backward pass did not reach is measured by its relative output error."""
    fisher = _fisher(model, calls, layers)
    errors: dict[str, dict[int, float]] = {}

    def measure(layer: _Layer, weight: torch.Tensor, h: fits.Hessian | None) -> None:
        if h is None or not config.selects(layer.name) or weight.numel() < config.min_elements:
            return None
        weight = _float(lazy.materialize(weight))  # an output head is given as it is held
        n = weight.shape[0]
        found = errors.setdefault(layer.name, {})
        w = weight.reshape(n, -1)
        fitted_forms = fit_forms(
            layer.module, weight, h, config.forms, dtype, method=SENSITIVITY_METHOD
        )
        for i, out in enumerate(fitted_forms):
            if isinstance(out, str):
                continue
            fitted = out[1].reshape(n, -1)
            score = fisher.score(layer, w - fitted, h)
            found[i] = score if score is not None else fits.output_error(w, fitted, h)
        return None

    _walk(model, calls, layers, measure, listener, "sensitivity", measure=False, sequential=False)
    return errors


def _unique_parameters(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    seen: set[int] = set()
    out: list[tuple[str, torch.Tensor]] = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def _own_bits(p: torch.Tensor, dtype: torch.dtype) -> int:
    """Bits per element of a weight left as it is (floats in the program's precision)."""
    if p.is_floating_point():
        return torch.finfo(dtype).bits
    return p.element_size() * 8


def allocate(
    model: nn.Module,
    layers: dict[int, _Layer],
    errors: dict[str, dict[int, float]],
    config: Mixed,
    dtype: torch.dtype,
) -> dict[str, LinearQuantization | Palettization]:
    """The form of each weight: the least total error (the sum of the weights' errors, as
    :func:`_sensitivity` measures them) whose bits over every weight of the model are at most
    ``config.target_bpw`` (a Lagrangian search, then the budget left spent on the upgrades
    that buy the most error per bit).  Raises :class:`CalibrationError` when even the
    cheapest forms exceed the budget."""
    by_name = {layer.name: layer for layer in layers.values()}
    total_elements = 0
    fixed_bits = 0.0
    choices: dict[str, list[tuple[float, float, int]]] = {}  # name -> [(bits, error, form)]
    for name, p in _unique_parameters(model):
        total_elements += p.numel()
        layer = by_name.get(name)
        options = errors.get(name) if layer is not None else None
        if not options:
            fixed_bits += p.numel() * _fixed_bits(config, name, p, dtype)
            continue
        shape = tuple(p.shape)
        choices[name] = sorted(
            (bits_per_weight(config.forms[i], shape, dtype) * p.numel(), e, i)
            for i, e in options.items()
        )
    budget = config.target_bpw * total_elements - fixed_bits
    cheapest = sum(min(c[0] for c in options) for options in choices.values())
    if cheapest > budget:
        least = (cheapest + fixed_bits) / total_elements
        smallest = min(config.forms, key=lambda f: bits_per_weight(f, (4096, 4096), dtype))
        raise CalibrationError(
            f"target_bpw={config.target_bpw:g} is below what the forms allow: "
            f"{least:.3f} bits per weight with every weight in its cheapest form "
            f"({smallest.describe()}), the weights left as they are (norms, biases, small "
            "weights) included; raise target_bpw or add cheaper forms"
        )

    def pick(lam: float) -> dict[str, tuple[float, float, int]]:
        return {n: min(opts, key=lambda c: c[1] + lam * c[0]) for n, opts in choices.items()}

    low, high = 0.0, 1.0
    while sum(c[0] for c in pick(high).values()) > budget:
        high *= 4
        if high > 1e30:
            break
    for _ in range(100):
        mid = (low + high) / 2
        if sum(c[0] for c in pick(mid).values()) > budget:
            low = mid
        else:
            high = mid
    chosen = pick(high)
    spent = sum(c[0] for c in chosen.values())
    while True:  # spend what is left on the best upgrades that fit
        best = None
        for n, current in chosen.items():
            for option in choices[n]:
                extra = option[0] - current[0]
                gain = current[1] - option[1]
                if gain > 0 and 0 < extra <= budget - spent:
                    ratio = gain / extra
                    if best is None or ratio > best[0]:
                        best = (ratio, n, option)
        if best is None:
            break
        _, n, option = best
        spent += option[0] - chosen[n][0]
        chosen[n] = option
    return {n: config.forms[c[2]] for n, c in chosen.items()}


def _fixed_bits(config: Mixed, name: str, p: torch.Tensor, dtype: torch.dtype) -> float:
    """Bits per element of a weight the allocation does not choose for: the ``other``
    form for selected weights without calibration inputs (embedding lookups), its own
    precision for the rest."""
    if (
        p.is_floating_point()
        and p.dim() >= 2
        and p.numel() >= config.min_elements
        and config.selects(name)
        and config.other is not None
    ):
        return bits_per_weight(config.other, tuple(p.shape), dtype)
    return _own_bits(p, dtype)


def planned_bpw(
    model: nn.Module, calibration: Calibration, dtype: torch.dtype, config: CompressionConfig
) -> float:
    """Bits per weight over every weight of the model with the fitted forms."""
    total = bits = 0.0
    for name, p in _unique_parameters(model):
        total += p.numel()
        fitted = calibration.lookup(name)
        if fitted is not None:
            bits += fitted.bits * p.numel()
        elif isinstance(config, Mixed):
            bits += _fixed_bits(config, name, p, dtype) * p.numel()
        else:
            bits += _own_bits(p, dtype) * p.numel()
    return bits / total if total else 0.0
