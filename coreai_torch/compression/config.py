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

import re
from collections.abc import Callable
from dataclasses import dataclass

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
    embeddings: bool = True
    output_head: bool = True
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
        return f"int{self.bits} {blocks}, {kind}{scales}"


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
        return f"{self.bits}-bit palettes, {groups}"


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


CompressionConfig = LinearQuantization | Palettization | Pruning

#: the forms ``from_spec`` knows, for messages and the CLI's help
SPECS = (
    "int2 ... int8, palette1 ... palette8, sparse<percent> (e.g. int4, int8, palette4, sparse50)"
)


def from_spec(spec: str, block_size: int | None = None) -> CompressionConfig:
    """A configuration from a short name, as the CLI's ``--compress`` takes it.

    ``int8``: 8-bit, one scale per output channel (``block_size`` gives blocks instead);
    ``int4`` (and other ``int<bits>`` below 8): blocks of ``block_size`` (default 32);
    ``palette<bits>``: one palette per weight, or per ``block_size`` output channels;
    ``sparse<percent>``: magnitude pruning to that percentage of zeros.
    """
    sparse = (
        re.fullmatch(r"sparse([1-9][0-9]?)", spec.strip().lower())
        if isinstance(spec, str)
        else None
    )
    if sparse is not None:
        return Pruning(sparsity=int(sparse[1]) / 100)
    match = (
        re.fullmatch(r"(int|palette)([1-8])", spec.strip().lower())
        if isinstance(spec, str)
        else None
    )
    if match is None:
        raise ValueError(f"unknown compression {spec!r}; use one of {SPECS}")
    kind, bits = match[1], int(match[2])
    if kind == "palette":
        return Palettization(bits=bits, group_size=block_size)
    if bits == 8:
        return LinearQuantization(bits=8, block_size=block_size)
    return LinearQuantization(bits=bits, block_size=block_size or 32)
