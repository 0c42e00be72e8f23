"""Fitting codes against calibration activations: the layer's *output* error, not the weight's.

For a weight ``W [N, K]`` read as ``y = W x`` and the calibration inputs ``X [n, K]``, the
output error of an approximation ``Q`` is ``‖(W - Q) Xᵀ‖² = tr((W - Q) H (W - Q)ᵀ)`` with
``H = XᵀX`` (:class:`Hessian`, accumulated over the calibration batches).  The fits here
minimise it:

* :func:`linear_scales`: the scale (and zero point) of each block chosen among clipped ranges
  by the activation-weighted error ``Σ_k H_kk (w_k - q_k)²`` (AWQ's activation-aware range
  search; 1.0 is among the ratios, so it is never worse than round-to-nearest on that error);
* :func:`gptq`: error-compensating rounding (GPTQ, Frantar et al. 2022): the inputs are
  rounded one after another (most active first) and the error of each is spread over the
  inputs not rounded yet through the inverse Hessian, with the scales fixed beforehand by
  :func:`linear_scales`, or with fixed palettes (:func:`weighted_palettes`);
* :func:`weighted_palettes`: sensitivity-weighted k-means: every weight counts with the
  energy of the input it multiplies (``H_kk``).

Everything here is torch on the CPU, in float32 (float64 for the Cholesky factorisation).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from coreai_torch.compression.fitting import kmeans_1d

#: the fraction of ``mean(diag(H))`` added to ``H``'s diagonal (GPTQ's dampening)
DAMPING = 0.01
#: the range ratios :func:`linear_scales` tries (1.0 is round-to-nearest's range)
CLIP_RATIOS = tuple(1.0 - 0.025 * i for i in range(17))
#: inputs GPTQ rounds before it applies their error to the rest at once
GPTQ_BLOCK = 128
#: rows (output channels) GPTQ rounds at a time
GPTQ_ROWS = 8192


class Hessian:
    """``H = Σ xxᵀ`` over the calibration inputs of one weight (``K`` inputs), in float64
    (float32 sums of 10⁴ outer products lose digits the factorisation needs).

    While fewer than ``K`` inputs have been added, the inputs themselves are kept and ``H`` is
    formed only when :attr:`matrix` is read: the output error of a weight then costs
    ``N·K·n`` instead of ``N·K²`` (a data-free export measured on 128 tokens of a 1B model
    would otherwise multiply every 8192-input weight by an 8192² matrix)."""

    def __init__(self, inputs: int) -> None:
        self.inputs = inputs
        self.samples = 0
        self._rows: list[torch.Tensor] | None = []
        self._matrix: torch.Tensor | None = None
        #: GPTQ's factorisations by damping (every form fitted on this Hessian shares them)
        self._factors: dict[float, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def add(self, x: torch.Tensor) -> None:
        """Add the inputs ``x [..., K]`` (every leading index a sample)."""
        x = x.reshape(-1, x.shape[-1]).to(torch.float32)
        self.samples += x.shape[0]
        self._factors.clear()
        if self._rows is not None and self._matrix is None and self.samples <= self.inputs:
            self._rows.append(x.clone())
            return
        matrix = self.matrix  # forms H from the rows kept so far
        matrix += (x.T @ x).to(torch.float64)
        self._rows = None

    @property
    def matrix(self) -> torch.Tensor:
        """``H [K, K]`` in float64."""
        if self._matrix is None:
            self._matrix = torch.zeros(self.inputs, self.inputs, dtype=torch.float64)
            for x in self._rows or ():
                self._matrix += (x.T @ x).to(torch.float64)
        return self._matrix

    @matrix.setter
    def matrix(self, value: torch.Tensor) -> None:
        self._matrix, self._rows = value, None
        self._factors.clear()

    def factor(self, damping: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """GPTQ's ``(order, u, dead)``: the inputs by decreasing ``H_kk``, the upper
        Cholesky factor of the damped inverse Hessian in that order and the inputs that never
        saw a nonzero value (:func:`_inverse_cholesky`); computed once per damping."""
        if damping not in self._factors:
            order = torch.argsort(self.matrix.diagonal(), descending=True)
            u, dead = _inverse_cholesky(self.matrix, order, damping)
            self._factors[damping] = (order, u, dead)
        return self._factors[damping]

    @property
    def diagonal(self) -> torch.Tensor:
        """``H_kk`` in float32: each input's energy."""
        if self._matrix is None and self._rows is not None:
            energy = torch.zeros(self.inputs, dtype=torch.float64)
            for x in self._rows:
                energy += (x.to(torch.float64) ** 2).sum(0)
            return energy.to(torch.float32)
        return self.matrix.diagonal().to(torch.float32)

    def row_energies(self, d: torch.Tensor) -> torch.Tensor:
        """``‖d_n X‖²`` for every row ``d_n`` of ``d [N, K]`` (``d_n H d_nᵀ``), float64."""
        if self._rows is not None:
            total = torch.zeros(d.shape[0], dtype=torch.float64)
            d32 = d.to(torch.float32)
            for x in self._rows:
                total += ((d32 @ x.T).to(torch.float64) ** 2).sum(1)
            return total
        d64 = d.to(torch.float64)
        return ((d64 @ self.matrix) * d64).sum(1)


def output_error(w: torch.Tensor, q: torch.Tensor, h: Hessian) -> float:
    """``‖(W - Q) Xᵀ‖² / ‖W Xᵀ‖²``: the output error relative to the output's energy."""
    signal = noise = 0.0
    for first in range(0, w.shape[0], GPTQ_ROWS):  # the temporaries of a piece of rows
        part = w[first : first + GPTQ_ROWS].to(torch.float32)
        signal += float(h.row_energies(part).sum())
        noise += float(h.row_energies(part - q[first : first + GPTQ_ROWS].to(torch.float32)).sum())
    return noise / signal if signal > 0 else (0.0 if noise == 0 else math.inf)


# ------------------------------------------------------------------------- linear grids ---


def _grid(
    blocks: torch.Tensor, bits: int, symmetric: bool, ratio: float, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (and zero point) of each block ``[..., B]`` (the last axis) with its range
    scaled by ``ratio``, the formulas of round-to-nearest (``fitting.quantize_linear``)."""
    if symmetric:
        high = (1 << (bits - 1)) - 1
        magnitude = torch.maximum(blocks.amax(-1, keepdim=True), -blocks.amin(-1, keepdim=True))
        s = magnitude * ratio / high
        zp = None
    else:
        high = (1 << bits) - 1
        lo = blocks.amin(-1, keepdim=True).clamp(max=0) * ratio
        hi = blocks.amax(-1, keepdim=True).clamp(min=0) * ratio
        s = (hi - lo) / high
    s = s.to(scale_dtype).float()
    s[s == 0] = 1.0
    if not symmetric:
        zp = torch.round(-lo / s).clamp_(0, high)
    return s, zp


def quantize_values(
    w: torch.Tensor, s: torch.Tensor, zp: torch.Tensor | None, bits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, w rounded to the grid)`` of ``w`` with the broadcastable ``s`` / ``zp``."""
    if zp is None:
        high = (1 << (bits - 1)) - 1
        codes = torch.round(w / s).clamp_(-high - 1, high)
        return codes, codes * s
    high = (1 << bits) - 1
    codes = (torch.round(w / s) + zp).clamp_(0, high)
    return codes, (codes - zp) * s


def linear_scales(
    w: torch.Tensor,
    bits: int,
    block: int,
    *,
    symmetric: bool,
    scale_dtype: torch.dtype,
    importance: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scales ``[N, K // block]`` (and zero points) of ``w [N, K]``: per block, the range
    ratio of :data:`CLIP_RATIOS` with the least ``Σ importance_k (w_k - q_k)²`` (without
    ``importance``: round-to-nearest's full range)."""
    n, k = w.shape
    blocks = w.reshape(n, k // block, block)
    ratios = CLIP_RATIOS if importance is not None else (1.0,)
    best_s, best_zp = _grid(blocks, bits, symmetric, 1.0, scale_dtype)
    if importance is None:
        return best_s.squeeze(-1), None if best_zp is None else best_zp.squeeze(-1)
    weight = importance.reshape(1, k // block, block)
    _, q = quantize_values(blocks, best_s, best_zp, bits)
    best = ((blocks - q) ** 2 * weight).sum(-1, keepdim=True)
    for ratio in ratios[1:]:
        s, zp = _grid(blocks, bits, symmetric, ratio, scale_dtype)
        _, q = quantize_values(blocks, s, zp, bits)
        err = ((blocks - q) ** 2 * weight).sum(-1, keepdim=True)
        better = err < best
        best = torch.where(better, err, best)
        best_s = torch.where(better, s, best_s)
        if zp is not None:
            assert best_zp is not None
            best_zp = torch.where(better, zp, best_zp)
    return best_s.squeeze(-1), None if best_zp is None else best_zp.squeeze(-1)


# ----------------------------------------------------------------------------------- GPTQ ---


def _inverse_cholesky(
    matrix: torch.Tensor, order: torch.Tensor, damping: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The upper Cholesky factor of ``(H + λI)⁻¹`` (float32) with the inputs of ``H``
    (``matrix``, float64) permuted to ``order``, ``λ = damping · mean(diag H)``, and the
    inputs that never saw a nonzero value (``H_kk = 1`` for them: their weights do not
    matter, and are zeroed).  The factorisations run in place on one permuted copy of ``H``
    (0.5 GB for the 8192 inputs of a 1B model's MLP down projection)."""
    info = torch.empty((), dtype=torch.int32)
    for attempt in range(6):
        work = matrix[order[:, None], order]
        diagonal = work.diagonal()
        dead = diagonal == 0
        diagonal[dead] = 1.0
        diagonal += damping * 10**attempt * float(diagonal.mean())
        torch.linalg.cholesky_ex(work, out=(work, info))
        if int(info) != 0:
            continue
        torch.cholesky_inverse(work, out=work)
        torch.linalg.cholesky_ex(work, upper=True, out=(work, info))
        if int(info) == 0:
            return work.to(torch.float32), dead
    raise ValueError("the calibration inputs' Hessian is not positive definite")


def gptq(
    w: torch.Tensor,
    h: Hessian,
    quantize: Callable[[torch.Tensor, int, slice], torch.Tensor],
    *,
    damping: float = DAMPING,
) -> torch.Tensor:
    """GPTQ's error-compensating rounding of ``w [N, K]`` (float32, not modified): the inputs
    are rounded in the order of decreasing ``H_kk``; ``quantize(column, k, rows)`` rounds the
    column of input ``k`` of the rows ``rows`` to its grid.  Rows are independent: they are
    rounded :data:`GPTQ_ROWS` at a time (the memory of a 128k-row output head stays small).
    Returns the rounded weight."""
    order, u, dead = h.factor(damping)
    out = torch.empty_like(w)
    for first in range(0, w.shape[0], GPTQ_ROWS):
        rows = slice(first, min(first + GPTQ_ROWS, w.shape[0]))
        part = w[rows][:, order].clone()
        part[:, dead] = 0.0
        out[rows, order] = _gptq_rows(part, u, order, rows, quantize)
    return out


def _gptq_rows(
    w: torch.Tensor,
    u: torch.Tensor,
    order: torch.Tensor,
    rows: slice,
    quantize: Callable[[torch.Tensor, int, slice], torch.Tensor],
) -> torch.Tensor:
    """GPTQ on ``w`` (rows of the weight, inputs in ``order``; modified), ``u`` the upper
    Cholesky factor of the inverse Hessian in that order; returns the rounded rows."""
    k = w.shape[1]
    q = torch.zeros_like(w)
    for start in range(0, k, GPTQ_BLOCK):
        stop = min(start + GPTQ_BLOCK, k)
        w1 = w[:, start:stop].clone()
        err1 = torch.zeros_like(w1)
        u1 = u[start:stop, start:stop]
        for i in range(stop - start):
            column = w1[:, i]
            rounded = quantize(column, int(order[start + i]), rows)
            q[:, start + i] = rounded
            e = (column - rounded) / u1[i, i]
            w1[:, i:] -= e[:, None] * u1[i, i:][None, :]
            err1[:, i] = e
        w[:, stop:] -= err1 @ u[start:stop, stop:]
    return q


def gptq_linear(
    w: torch.Tensor,
    h: Hessian,
    bits: int,
    block: int,
    *,
    symmetric: bool,
    scale_dtype: torch.dtype,
    damping: float = DAMPING,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(codes [N, K], scales [N, K // block], zero points or None)`` of ``w [N, K]``: the
    scales chosen by :func:`linear_scales` (activation-weighted), then GPTQ rounding."""
    k = w.shape[1]
    s, zp = linear_scales(
        w, bits, block, symmetric=symmetric, scale_dtype=scale_dtype, importance=h.diagonal
    )
    column_block = torch.arange(k) // block

    def quantize(column: torch.Tensor, index: int, rows: slice) -> torch.Tensor:
        b = int(column_block[index])
        return quantize_values(column, s[rows, b], None if zp is None else zp[rows, b], bits)[1]

    rounded = gptq(w, h, quantize, damping=damping)
    scale = s.repeat_interleave(block, 1)
    if zp is None:
        codes = torch.round(rounded / scale)
    else:
        codes = torch.round(rounded / scale) + zp.repeat_interleave(block, 1)
    return codes, s, zp


# ------------------------------------------------------------------------------ palettes ---


def weighted_palettes(
    w: torch.Tensor, bits: int, group: int, importance: torch.Tensor, iterations: int = 100
) -> torch.Tensor:
    """Palettes ``[N // group, 2**bits]`` (sorted) of ``w [N, K]``, one per ``group`` rows,
    fitted by k-means where weight ``w_nk`` counts ``importance_k`` times."""
    n, k = w.shape
    rows = w.reshape(n // group, group * k).numpy()
    weights = importance.clamp(min=0).repeat(group).numpy()
    weights = np.broadcast_to(weights / max(float(weights.mean()), 1e-30), rows.shape)
    return torch.from_numpy(kmeans_1d(rows, 1 << bits, iterations, weights).astype(np.float32))


def nearest_entries(values: torch.Tensor, palettes: torch.Tensor) -> torch.Tensor:
    """Indices of the nearest entry of each row's sorted palette (``values [R, ...]``,
    ``palettes [R, E]``)."""
    boundaries = (palettes[:, 1:] + palettes[:, :-1]) / 2
    flat = values.reshape(values.shape[0], -1).contiguous()
    return torch.searchsorted(boundaries.contiguous(), flat).reshape(values.shape)


def gptq_palettes(
    w: torch.Tensor,
    h: Hessian,
    bits: int,
    group: int,
    *,
    iterations: int = 100,
    damping: float = DAMPING,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices [N, K], palettes [N // group, 2**bits])`` of ``w [N, K]``: palettes by
    :func:`weighted_palettes`, indices by GPTQ rounding to the nearest entry."""
    n, k = w.shape
    palettes = weighted_palettes(w, bits, group, h.diagonal, iterations)
    row_palettes = palettes.repeat_interleave(group, 0)

    def quantize(column: torch.Tensor, index: int, rows: slice) -> torch.Tensor:
        entries = row_palettes[rows]
        found = nearest_entries(column[:, None], entries)[:, 0]
        return entries.gather(1, found[:, None])[:, 0]

    rounded = gptq(w, h, quantize, damping=damping)
    indices = nearest_entries(rounded.reshape(n // group, group * k), palettes)
    return indices.reshape(n, k), palettes
