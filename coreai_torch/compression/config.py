"""Post-training weight compression: the configurations ``AIProgram.compress()`` takes.

    from coreai_torch import compression
    program = TorchConverter().add_exported_program(ep).to_coreai().optimize()
    report = program.compress(compression.LinearQuantization(bits=4, block_size=32))
    print(report)          # per weight: form, bits, bytes before/after, SNR

Every form (``LinearQuantization``, ``Palettization``, ``Pruning``) chooses the weights to
compress the same way (keyword-only options):

* ``weights``: a regular expression searched in each weight's name (``"mlp|attn"``), or a
  predicate ``fn(name) -> bool``; None selects every weight;
* ``min_elements``: smaller weights stay as they are (biases and norms always do);
* ``embeddings`` / ``output_head``: whether embedding tables (read by a row lookup) and the
  output projection (a matmul whose result is a program output, e.g. an LLM's logits) are
  compressed too.

And they share two safety options:

* ``non_finite``: a selected weight holding NaN or infinite values makes ``compress()`` raise
  ``NonFiniteWeightError`` before anything changes (``"error"``, the default; compression
  would spread the value over a channel, block or palette), or is kept uncompressed
  (``"keep"``, listed in the report with the count and positions);
* ``min_snr_db``: the report flags compressed weights whose reconstruction SNR is below this
  (default 10 dB; None: no flag).

The compression itself lives in :mod:`coreai_torch.compression.apply`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

WeightFilter = str | Callable[[str], bool] | None

#: what ``non_finite=`` accepts
NON_FINITE_POLICIES = ("error", "keep")
#: scale precisions ``LinearQuantization(scale_dtype=...)`` accepts
SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True, kw_only=True)
class _Selection:
    weights: WeightFilter = None
    min_elements: int = 4096
    embeddings: bool | LinearQuantization | Palettization = True
    output_head: bool | LinearQuantization | Palettization = True
    non_finite: str = "error"
    min_snr_db: float | None = 10.0

    def __post_init__(self) -> None:
        if self.non_finite not in NON_FINITE_POLICIES:
            raise ValueError(
                f"non_finite= takes 'error' (refuse weights with NaN/inf) or 'keep' (leave "
                f"them uncompressed), got {self.non_finite!r}"
            )
        if self.min_snr_db is not None and not isinstance(self.min_snr_db, (int, float)):
            raise TypeError(f"min_snr_db= takes a number of dB or None, got {self.min_snr_db!r}")
        if self.weights is not None and not (
            isinstance(self.weights, str) or callable(self.weights)
        ):
            raise TypeError(
                f"weights= takes a regular expression or a predicate fn(name) -> bool, got "
                f"{type(self.weights).__name__}"
            )
        if isinstance(self.weights, str):
            try:
                re.compile(self.weights)
            except re.error as error:
                raise ValueError(
                    f"weights={self.weights!r} is not a regular expression: {error}"
                ) from None
        if self.min_elements < 0:
            raise ValueError(f"min_elements must be >= 0, got {self.min_elements}")
        for option in ("embeddings", "output_head"):
            value = getattr(self, option)
            if not isinstance(value, (bool, LinearQuantization, Palettization)):
                raise TypeError(
                    f"{option}= takes True (compressed like the rest), False (left as it is) "
                    f"or a LinearQuantization / Palettization (its own form), got {value!r}"
                )

    def _kept(self) -> str:
        """What the description says of the embedding tables and the output head when they
        have a form of their own."""
        if isinstance(self.embeddings, bool) and isinstance(self.output_head, bool):
            return ""
        parts = []
        for what, option in (("embeddings", self.embeddings), ("head", self.output_head)):
            if option is False:
                parts.append(f"{what} uncompressed")
            elif option is not True:
                parts.append(f"{what} {option.describe()}")
        return " (" + "; ".join(parts) + ")"

    def form_for(self, reader: str, head: bool) -> Any:
        """The form of a weight read by ``reader`` (``"embedding"``, ...) that is (or is
        not) the output head: this configuration, another one, or None (left alone)."""
        for applies, option in ((head, self.output_head), (reader == "embedding", self.embeddings)):
            if applies and option is not True:
                return None if option is False else option
        return self

    def selects(self, name: str) -> bool:
        """Whether the name filter (``weights=``) selects weight ``name``."""
        if self.weights is None:
            return True
        if isinstance(self.weights, str):
            return re.search(self.weights, name) is not None
        return bool(self.weights(name))


@dataclass(frozen=True, kw_only=True)
class LinearQuantization(_Selection):
    """Integer codes with one scale per block: ``w ≈ (q - zero_point) * scale``.

    * ``bits``: 2 to 8 (3 is stored in 4 bits, 5 to 7 in 8);
    * ``block_size``: weights along the input (reduction) axis that share a scale; None
      gives one scale per output channel;
    * ``symmetric``: ``scale = max|w| / (2**(bits-1) - 1)`` and no zero point; else
      unsigned codes with ``scale = (max - min) / (2**bits - 1)`` and a zero point (both
      over the block, the range widened to include 0);
    * ``scale_dtype``: the scales' precision (float32, float16 or bfloat16); None keeps the
      weight's own.  A scale precision other than the weight's makes the runtime decompress
      in the scale's precision and cast.

    8-bit per-channel weights of a float32 program are read as ``cast -> matmul -> scale``.
    """

    bits: int = 8
    block_size: int | None = None
    symmetric: bool = True
    scale_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.bits, int) or not 2 <= self.bits <= 8:
            raise ValueError(f"LinearQuantization(bits=...) takes 2 to 8 bits, got {self.bits!r}")
        if self.block_size is not None and (
            not isinstance(self.block_size, int) or self.block_size < 1
        ):
            raise ValueError(
                f"block_size must be a positive integer or None, got {self.block_size!r}"
            )
        if self.scale_dtype is not None and self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(
                f"scale_dtype must be torch.float32, torch.float16 or torch.bfloat16, got "
                f"{self.scale_dtype}"
            )

    def describe(self) -> str:
        blocks = f"blocks of {self.block_size}" if self.block_size else "per channel"
        kind = "symmetric" if self.symmetric else "asymmetric"
        scales = (
            f", {str(self.scale_dtype).removeprefix('torch.')} scales" if self.scale_dtype else ""
        )
        return f"int{self.bits} {blocks}, {kind}{scales}{self._kept()}"


@dataclass(frozen=True, kw_only=True)
class Palettization(_Selection):
    """Each weight replaced by ``bits``-bit indices into palettes of ``2**bits`` values,
    fitted by weighted k-means.

    * ``bits``: 1 to 8 (5 is stored in 6 bits, 7 in 8);
    * ``group_size``: output channels sharing one palette; None gives one palette per
      weight;
    * ``iterations``: the most k-means (Lloyd) iterations per palette.
    """

    bits: int = 4
    group_size: int | None = None
    iterations: int = 100

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.bits, int) or not 1 <= self.bits <= 8:
            raise ValueError(f"Palettization(bits=...) takes 1 to 8 bits, got {self.bits!r}")
        if self.group_size is not None and (
            not isinstance(self.group_size, int) or self.group_size < 1
        ):
            raise ValueError(
                f"group_size must be a positive integer or None, got {self.group_size!r}"
            )
        if self.iterations < 1:
            raise ValueError(f"iterations must be >= 1, got {self.iterations}")

    def describe(self) -> str:
        groups = f"groups of {self.group_size} channels" if self.group_size else "one per weight"
        return f"{self.bits}-bit palettes, {groups}{self._kept()}"


@dataclass(frozen=True, kw_only=True)
class Pruning(_Selection):
    """Magnitude pruning: the ``sparsity`` fraction of each weight's elements with the
    smallest magnitude become zeros, and the weight is stored sparse: the kept values (in the
    weight's own type) and a 1-bit mask.

    * ``sparsity``: the fraction of zeros, between 0 and 1 (0.5 stores about 0.53x of a
      float32 weight: half the values plus one bit per element).
    """

    sparsity: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.sparsity, (int, float)) or not 0 < self.sparsity < 1:
            raise ValueError(
                f"Pruning(sparsity=...) takes a fraction in (0, 1), got {self.sparsity!r}"
            )

    def describe(self) -> str:
        return f"{self.sparsity:.0%} sparse (magnitude)"


#: code widths as stored: linear codes of 3 bits take 4, of 5 to 7 take 8; palette indices
#: of 5 bits take 6, of 7 take 8 (the widths Core AI has)
LINEAR_STORAGE = {1: 2, 2: 2, 3: 4, 4: 4, 5: 8, 6: 8, 7: 8, 8: 8}
PALETTE_STORAGE = {1: 1, 2: 2, 3: 3, 4: 4, 5: 6, 6: 6, 7: 8, 8: 8}


def bits_per_weight(
    config: LinearQuantization | Palettization | Pruning,
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float16,
) -> float:
    """Bits per element of a ``shape`` weight (``[out, in, ...]``) stored in ``config``'s
    form in a program whose weights are ``dtype``: codes, scales, zero points, palettes."""
    float_bits = torch.finfo(dtype).bits
    out = shape[0]
    per_row = math.prod(shape[1:])
    if isinstance(config, LinearQuantization):
        code = LINEAR_STORAGE[config.bits]
        scale = torch.finfo(config.scale_dtype).bits if config.scale_dtype else float_bits
        spatial = per_row // shape[1]
        block = (
            per_row
            if config.block_size is None or config.block_size >= shape[1]
            else config.block_size * spatial
        )
        return code + (scale + (0 if config.symmetric else code)) / block
    if isinstance(config, Palettization):
        group = out if config.group_size is None else min(config.group_size, out)
        return PALETTE_STORAGE[config.bits] + (1 << config.bits) * float_bits / (group * per_row)
    return (1 - config.sparsity) * float_bits + 1


#: the forms :class:`Mixed` chooses among by default: int8 per channel and asymmetric int4 in
#: blocks of 32, 64 and 128.  On SmolLM2-135M at 4.5 bits per weight these give perplexity
#: +8.5 % where adding the symmetric int4 forms gives +11.3 % (the sensitivity pass scores a
#: symmetric form's effect lower than it turns out) and costs 7/4 of the sensitivity pass's
#: fits; palettes are left out: a 4-bit palette per 16 output channels has ten times the
#: output error of asymmetric int4 in blocks of 64 at about the same size
#: (docs/choosing_compression.md); pass ``forms=`` to add them (or cheaper ones).
MIXED_FORMS: tuple[LinearQuantization | Palettization, ...] = (
    LinearQuantization(bits=8),
    LinearQuantization(bits=4, block_size=32, symmetric=False),
    LinearQuantization(bits=4, block_size=64, symmetric=False),
    LinearQuantization(bits=4, block_size=128, symmetric=False),
)


@dataclass(frozen=True, kw_only=True)
class Mixed(_Selection):
    """A form per weight, chosen to meet a budget of bits per weight with the least output
    error on calibration data (``compression.calibrate``; ``target_bpw`` counts every
    weight of the model, the embedding and the output head included, and those left as
    they are at their own precision).

    * ``target_bpw``: the budget, in bits per weight;
    * ``forms``: the forms to choose among (default :data:`MIXED_FORMS`: int8 per channel,
      asymmetric int4 in blocks of 32, 64 and 128);
    * ``other``: the form of the selected weights the calibration measures no inputs of
      (an embedding table not tied to the output head); None leaves them as they are.
    """

    target_bpw: float = 4.5
    forms: tuple[LinearQuantization | Palettization, ...] = MIXED_FORMS
    other: LinearQuantization | Palettization | None = LinearQuantization(bits=8)
    min_elements: int = 4096

    def __post_init__(self) -> None:
        super().__post_init__()
        if (
            isinstance(self.target_bpw, bool)
            or not isinstance(self.target_bpw, (int, float))
            or not self.target_bpw > 0
        ):
            raise ValueError(f"target_bpw must be a positive number, got {self.target_bpw!r}")
        if not self.forms or not all(
            isinstance(f, (LinearQuantization, Palettization)) for f in self.forms
        ):
            raise ValueError(
                "Mixed(forms=...) takes a non-empty tuple of LinearQuantization / Palettization"
            )

    def describe(self) -> str:
        return f"mixed, {self.target_bpw:g} bits per weight"


CompressionConfig = LinearQuantization | Palettization | Pruning | Mixed

#: the forms ``from_spec`` knows, for messages and the CLI's help
SPECS = (
    "int2 ... int8 (int4: blocks of 32; add -asym for zero points, -g<N> for blocks of N, "
    "-pc for one scale per output channel), palette1 ... palette8 (one palette per 16 output "
    "channels; -g<N> for N, -pt for one per weight), sparse<percent>, mixed (with a bits per "
    "weight budget and calibration data); e.g. int4, int4-asym, int8, palette4, mixed"
)

#: the form of the embedding tables and the output head in the named presets (int8 per
#: channel: what Apple's recipes keep them at; 4-bit tables cost real models their quality)
SAFE_FORM = LinearQuantization(bits=8)


def from_spec(
    spec: str, block_size: int | None = None, *, target_bpw: float | None = None
) -> CompressionConfig:
    """A configuration from a short name, as the CLI's ``--compress`` takes it.

    ``int8``: 8-bit, one scale per output channel; ``int4`` (and other ``int<bits>`` below
    8): blocks of 32 inputs; ``-asym`` adds zero points (unsigned codes), ``-g<N>`` sets the
    block size, ``-pc`` one scale per output channel.  ``palette<bits>``: one palette per 16
    output channels (``-g<N>``: per N, ``-pt``: one per weight).  ``sparse<percent>``:
    magnitude pruning to that percentage of zeros.  ``mixed``: a form per weight to a budget
    of ``target_bpw`` bits per weight (default 4.5; needs calibration data).
    ``block_size`` overrides the block size (int) or output channels per palette.

    Presets keep the embedding tables and the output head in int8 per channel
    (:data:`SAFE_FORM`) when they compress the rest to fewer bits.
    """
    text = spec.strip().lower() if isinstance(spec, str) else None
    if text == "mixed":
        return Mixed(target_bpw=4.5 if target_bpw is None else target_bpw)
    sparse = re.fullmatch(r"sparse([1-9][0-9]?)", text) if text is not None else None
    if sparse is not None:
        return Pruning(sparsity=int(sparse[1]) / 100)
    match = (
        re.fullmatch(r"(int|palette)([1-8])((?:-(?:asym|pc|pt|g[1-9][0-9]*))*)", text)
        if text is not None
        else None
    )
    if match is None:
        raise ValueError(f"unknown compression {spec!r}; use one of {SPECS}")
    kind, bits = match[1], int(match[2])
    options = [o for o in match[3].split("-") if o]
    if len(set(o[0] for o in options)) != len(options) and not all(
        o in ("asym", "pc", "pt") for o in options
    ):
        raise ValueError(f"{spec!r} names a block size twice")
    group = next((int(o[1:]) for o in options if o.startswith("g")), None)
    if block_size is not None:
        group = block_size
    if kind == "palette":
        if "asym" in options or "pc" in options:
            raise ValueError(f"{spec!r}: -asym and -pc apply to int<bits>, not to palettes")
        group_size = None if "pt" in options else (group or 16)
        return _safe(Palettization(bits=bits, group_size=group_size), bits)
    if "pt" in options:
        raise ValueError(f"{spec!r}: -pt applies to palettes (one per weight)")
    if "pc" in options and group is not None:
        raise ValueError(f"{spec!r}: -pc (per output channel) and a block size exclude each other")
    block = None if "pc" in options else group if group is not None else (None if bits == 8 else 32)
    config = LinearQuantization(bits=bits, block_size=block, symmetric="asym" not in options)
    return _safe(config, bits)


def _safe(
    config: LinearQuantization | Palettization, bits: int
) -> LinearQuantization | Palettization:
    """``config`` with the embedding tables and the output head at :data:`SAFE_FORM` when
    it has fewer bits."""
    if bits >= 8:
        return config
    return dataclasses.replace(config, embeddings=SAFE_FORM, output_head=SAFE_FORM)
