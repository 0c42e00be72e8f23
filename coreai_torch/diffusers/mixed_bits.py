"""Mixed-bit palettes for a denoiser: each layer's palette bits chosen by a quality budget, as
Apple's diffusion recipes do.

1. *Sensitivity*: every weight the recipe may compress is palettized alone, at each candidate
   bit width, in the PyTorch module (the others left as they are), and the denoiser's output on
   calibration inputs is compared with the uncompressed output: one PSNR per (layer, bits).
2. *Allocation* (:func:`allocate_bits`): starting from the most bits everywhere, the layer whose
   next lower width adds the least output noise per byte saved is lowered, while the summed
   noise stays within the budget (``target_psnr_db``); the choice is then checked with every
   layer palettized at once and widened back where the measured PSNR misses the target.
3. *Apply*: one ``program.compress(Palettization(bits=b, weights=...))`` per chosen width.

The allocation is its own function over plain numbers (sensitivities and sizes in, bits out),
so that a shared allocator can replace it without touching the measurement or the export.
Calibration reads the denoiser's weights into memory (one copy) and runs
``layers x len(candidate_bits) + 2`` forward passes of it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from coreai_torch.compression import Palettization
from coreai_torch.compression.fitting import kmeans_1d
from coreai_torch.tensors import lazy


@dataclass(frozen=True)
class MixedBitPalettes:
    """Per-layer palette bits for the denoiser (``compress=MixedBitPalettes(...)``).

    * ``target_psnr_db``: the lowest PSNR of the denoiser's output (against the uncompressed
      denoiser, on the calibration inputs) the choice may give;
    * ``candidate_bits``: the widths a layer may get (a layer below the lowest that still meets
      the budget keeps the widest);
    * ``min_elements``: smaller weights (and every bias and norm) stay uncompressed;
    * ``seed``: of the random calibration inputs (latents, text states, a mid-schedule step).

    Text encoders and the VAE stay uncompressed under this recipe.
    """

    target_psnr_db: float = 40.0
    candidate_bits: tuple[int, ...] = (8, 6, 4, 2)
    min_elements: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.candidate_bits or any(
            not isinstance(b, int) or not 1 <= b <= 8 for b in self.candidate_bits
        ):
            raise ValueError(
                f"candidate_bits takes widths from 1 to 8, got {self.candidate_bits!r}"
            )

    def describe(self) -> str:
        bits = "/".join(str(b) for b in sorted(self.candidate_bits, reverse=True))
        return f"mixed-bit palettes ({bits} bits, >= {self.target_psnr_db:g} dB)"

    def applies_to(self, role: str) -> bool:
        return role in ("unet", "transformer")

    def apply(
        self, program: Any, wrapper: nn.Module, args: Sequence[torch.Tensor]
    ) -> dict[str, Any]:
        """Measure, allocate and compress ``program`` (converted from ``wrapper``); returns the
        report (per layer: the PSNR at each width and the bits chosen)."""
        module = materialized(wrapper)
        with torch.no_grad():
            reference = module(*args)
            names = [
                name
                for name, p in module.named_parameters()
                if p.dim() >= 2 and p.numel() >= self.min_elements
            ]
            widths = sorted(set(self.candidate_bits), reverse=True)
            sensitivity: dict[str, dict[int, float]] = {}
            for name in names:
                parameter = module.get_parameter(name)
                original = parameter.data.clone()
                sensitivity[name] = {}
                for bits in widths:
                    parameter.data.copy_(palettized(original, bits))
                    sensitivity[name][bits] = output_psnr(module(*args), reference)
                parameter.data.copy_(original)
            sizes = {name: module.get_parameter(name).numel() for name in names}
            chosen = allocate_bits(sensitivity, sizes, self.target_psnr_db)
            achieved = self._measure(module, args, reference, chosen)
            while achieved < self.target_psnr_db and any(
                chosen[n] < widths[0] for n in chosen
            ):  # the noise did not add up as modelled: widen the noisiest layer and measure
                worst = min(
                    (n for n in chosen if chosen[n] < widths[0]),
                    key=lambda n: sensitivity[n][chosen[n]],
                )
                chosen[worst] = widths[widths.index(chosen[worst]) - 1]
                achieved = self._measure(module, args, reference, chosen)
        for bits in sorted(set(chosen.values())):
            selected = frozenset(n for n, b in chosen.items() if b == bits)
            program.compress(
                Palettization(
                    bits=bits,
                    weights=selected.__contains__,
                    min_elements=0,
                    embeddings=False,
                    output_head=False,
                )
            )
        compressed = sum(sizes[n] for n in chosen)
        return {
            "recipe": self.describe(),
            "target_psnr_db": self.target_psnr_db,
            "achieved_psnr_db": round(achieved, 2),
            "bits_per_compressed_weight": round(
                sum(sizes[n] * chosen[n] for n in chosen) / max(compressed, 1), 3
            ),
            "layers": {
                n: {
                    "bits": chosen[n],
                    "psnr_db": {str(b): round(v, 2) for b, v in sensitivity[n].items()},
                }
                for n in names
            },
        }

    @staticmethod
    def _measure(
        module: nn.Module,
        args: Sequence[torch.Tensor],
        reference: torch.Tensor,
        chosen: Mapping[str, int],
    ) -> float:
        saved = {}
        for name, bits in chosen.items():
            parameter = module.get_parameter(name)
            saved[name] = parameter.data.clone()
            parameter.data.copy_(palettized(saved[name], bits))
        try:
            return output_psnr(module(*args), reference)
        finally:
            for name, data in saved.items():
                module.get_parameter(name).data.copy_(data)


def materialized(module: nn.Module) -> nn.Module:
    """``module`` with every parameter bound to a checkpoint read into memory (in place)."""
    for owner in module.modules():
        for attr, parameter in owner._parameters.items():
            if parameter is not None and lazy.is_lazy(parameter):
                owner._parameters[attr] = nn.Parameter(
                    lazy.materialize(parameter).clone(), requires_grad=False
                )
    return module


def palettized(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """``weight`` with each value replaced by the nearest of ``2**bits`` k-means centroids (one
    palette per weight, as ``Palettization(group_size=None)`` fits it)."""
    values = weight.detach().float().reshape(1, -1).numpy()
    palette = kmeans_1d(values, 1 << bits)[0].astype(np.float32)
    boundaries = (palette[1:] + palette[:-1]) / 2
    index = np.searchsorted(boundaries, values[0])
    return torch.from_numpy(palette[index]).reshape(weight.shape).to(weight.dtype)


def output_psnr(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """PSNR (dB) of ``actual`` against ``reference``, the peak being ``reference``'s largest
    magnitude."""
    mse = float(torch.mean((actual.double() - reference.double()) ** 2))
    peak = float(reference.abs().max())
    return math.inf if mse == 0 else 10 * math.log10(peak * peak / mse)


def allocate_bits(
    sensitivity: Mapping[str, Mapping[int, float]],
    sizes: Mapping[str, int],
    target_psnr_db: float,
) -> dict[str, int]:
    """Bits per layer: lower the width of the layer that adds the least output noise (the
    noise powers ``10**(-psnr/10)`` of the layers are taken to add up) per bit saved, while the
    total noise stays within ``10**(-target_psnr_db/10)``.  ``sensitivity[layer][bits]`` is the
    output PSNR with that layer alone at that width; ``sizes[layer]`` its element count."""

    def noise(psnr: float) -> float:
        return 0.0 if math.isinf(psnr) else 10 ** (-psnr / 10)

    budget = 10 ** (-target_psnr_db / 10)
    widths = {n: sorted(s, reverse=True) for n, s in sensitivity.items()}
    chosen = {n: w[0] for n, w in widths.items()}
    total = sum(noise(sensitivity[n][chosen[n]]) for n in chosen)
    while True:
        best: tuple[float, str, int, float] | None = None
        for name, bits in chosen.items():
            lower = [b for b in widths[name] if b < bits]
            if not lower:
                continue
            added = noise(sensitivity[name][lower[0]]) - noise(sensitivity[name][bits])
            saved = sizes[name] * (bits - lower[0])
            cost = max(added, 0.0) / saved
            if total + added <= budget and (best is None or cost < best[0]):
                best = (cost, name, lower[0], added)
        if best is None:
            return chosen
        _, name, bits, added = best
        chosen[name] = bits
        total += added
