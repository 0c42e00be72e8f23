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
  :func:`gptq_linear_grids` rounds a weight on several linear grids in one run (the
  candidate forms of ``Mixed``);
* :func:`weighted_palettes`: sensitivity-weighted k-means: every weight counts with the
  energy of the input it multiplies (``H_kk``).

Everything here is torch on the CPU, in float32 (float64 for the Cholesky factorisation).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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
        _add_products(self.matrix, x)  # the matrix is formed from the rows kept so far
        self._rows = None

    @property
    def matrix(self) -> torch.Tensor:
        """``H [K, K]`` in float64."""
        if self._matrix is None:
            self._matrix = torch.zeros(self.inputs, self.inputs, dtype=torch.float64)
            for x in self._rows or ():
                _add_products(self._matrix, x)
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


#: columns of a Hessian summed at a time (:func:`_add_products`)
HESSIAN_COLUMNS = 1024


def _add_products(matrix: torch.Tensor, x: torch.Tensor) -> None:
    """``matrix += xᵀx`` (float32 products, summed in float64) a piece of
    :data:`HESSIAN_COLUMNS` columns at a time: the products of an 8192-input layer whole
    were 0.8 GB of temporaries (in float32, then in float64) beside its 0.5 GB Hessian."""
    for first in range(0, x.shape[1], HESSIAN_COLUMNS):
        columns = slice(first, first + HESSIAN_COLUMNS)
        matrix[:, columns] += (x.T @ x[:, columns]).to(torch.float64)


def output_error(w: torch.Tensor, q: torch.Tensor, h: Hessian) -> float:
    """``‖(W - Q) Xᵀ‖² / ‖W Xᵀ‖²``: the output error relative to the output's energy."""
    return relative(*error_energies(w, q, h))


def error_energies(w: torch.Tensor, q: torch.Tensor, h: Hessian) -> tuple[float, float]:
    """``(‖(W - Q) Xᵀ‖², ‖W Xᵀ‖²)``: the energies of the output error and of the output
    (summed over pieces of rows, they give :func:`output_error` of the whole)."""
    signal = noise = 0.0
    for first in range(0, w.shape[0], GPTQ_ROWS):  # the temporaries of a piece of rows
        part = w[first : first + GPTQ_ROWS].to(torch.float32)
        signal += float(h.row_energies(part).sum())
        noise += float(h.row_energies(part - q[first : first + GPTQ_ROWS].to(torch.float32)).sum())
    return noise, signal


def relative(noise: float, signal: float) -> float:
    """``noise / signal`` (0 for no noise, inf for noise without signal)."""
    return noise / signal if signal > 0 else (0.0 if noise == 0 else math.inf)


# ------------------------------------------------------------------------- linear grids ---


def _extremes(blocks: torch.Tensor, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The range of each block ``[..., B]`` (the last axis) the grids scale: ``(-m, m)``
    with ``m`` the largest magnitude (symmetric), else ``(min(low, 0), max(high, 0))``."""
    if symmetric:
        magnitude = torch.maximum(blocks.amax(-1, keepdim=True), -blocks.amin(-1, keepdim=True))
        return -magnitude, magnitude
    return blocks.amin(-1, keepdim=True).clamp(max=0), blocks.amax(-1, keepdim=True).clamp(min=0)


def _grid(
    extremes: tuple[torch.Tensor, torch.Tensor],
    bits: int,
    symmetric: bool,
    ratio: float,
    scale_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale (and zero point) of each block with its range (:func:`_extremes`) scaled by
    ``ratio``, the formulas of round-to-nearest (``fitting.quantize_linear``)."""
    if symmetric:
        high = (1 << (bits - 1)) - 1
        s = extremes[1] * ratio / high
        zp = None
    else:
        high = (1 << bits) - 1
        lo = extremes[0] * ratio
        s = (extremes[1] * ratio - lo) / high
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


#: elements of the weight :func:`linear_scales` searches the ratios of at a time, in one
#: buffer reused from ratio to ratio (measured: 1 MiB pieces search 6x faster than whole
#: weights with fresh temporaries, and faster than smaller pieces, whose steps cost more)
SCALE_SEARCH_ELEMENTS = 1 << 18


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
    if importance is None:
        s, zp = _grid(_extremes(blocks, symmetric), bits, symmetric, 1.0, scale_dtype)
        return s.squeeze(-1), None if zp is None else zp.squeeze(-1)
    weight = importance.reshape(1, k // block, block)
    best_s = torch.empty(n, k // block, 1)
    best_zp = None if symmetric else torch.empty(n, k // block, 1)
    step = max(1, SCALE_SEARCH_ELEMENTS // k)
    scratch = torch.empty(min(step, n), k // block, block)
    for first in range(0, n, step):
        rows = slice(first, min(first + step, n))
        part = blocks[rows]
        extremes = _extremes(part, symmetric)
        buffer = scratch[: part.shape[0]]
        best = None
        for ratio in CLIP_RATIOS:
            s, zp = _grid(extremes, bits, symmetric, ratio, scale_dtype)
            err = _weighted_error(part, s, zp, bits, weight, buffer)
            if best is None:
                best = err
                best_s[rows] = s
                if best_zp is not None and zp is not None:
                    best_zp[rows] = zp
                continue
            better = err < best
            torch.where(better, err, best, out=best)
            torch.where(better, s, best_s[rows], out=best_s[rows])
            if best_zp is not None and zp is not None:
                torch.where(better, zp, best_zp[rows], out=best_zp[rows])
    return best_s.squeeze(-1), None if best_zp is None else best_zp.squeeze(-1)


def _weighted_error(
    blocks: torch.Tensor,
    s: torch.Tensor,
    zp: torch.Tensor | None,
    bits: int,
    weight: torch.Tensor,
    buffer: torch.Tensor,
) -> torch.Tensor:
    """``Σ weight (w - q)²`` per block of ``blocks`` rounded to the grid ``s`` / ``zp``
    (:func:`quantize_values`, the same operations) in ``buffer`` (its shape)."""
    q = torch.div(blocks, s, out=buffer).round_()
    if zp is None:
        high = (1 << (bits - 1)) - 1
        q.clamp_(-high - 1, high).mul_(s)
    else:
        q.add_(zp).clamp_(0, (1 << bits) - 1).sub_(zp).mul_(s)
    d = torch.sub(blocks, q, out=buffer)
    return d.mul_(d).mul_(weight).sum(-1, keepdim=True)


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
    column of input ``k`` of the rows ``rows`` to its grid (``column`` contiguous, a copy it
    may round in place).  Rows are independent: they are rounded :data:`GPTQ_ROWS` at a time (the
    memory of a 128k-row output head stays small).  Returns the rounded weight."""
    order, u, dead = h.factor(damping)
    unordered = torch.argsort(order)
    out = torch.empty_like(w)
    for first in range(0, w.shape[0], GPTQ_ROWS):
        rows = slice(first, min(first + GPTQ_ROWS, w.shape[0]))
        part = w[rows].T.contiguous()[order]  # [K, rows]: an input's column is contiguous
        part[dead] = 0.0
        out[rows] = _gptq_rows(part, u, order, rows, quantize).index_select(0, unordered).T
    return out


def _gptq_rows(
    w: torch.Tensor,
    u: torch.Tensor,
    order: torch.Tensor,
    rows: slice,
    quantize: Callable[[torch.Tensor, int, slice], torch.Tensor],
) -> torch.Tensor:
    """GPTQ on ``w [K, R]`` (the rows of the weight transposed, inputs in ``order``;
    modified), ``u`` the upper Cholesky factor of the inverse Hessian in that order; returns
    the rounded rows, transposed.  Every product and difference is the textbook loop's
    (``w1[:, i:] -= e[:, None] * u1[i, i:]`` on the rows), in buffers reused from column to
    column."""
    k, r = w.shape
    q = torch.empty_like(w)
    err = torch.empty(GPTQ_BLOCK, r)
    product = torch.empty(GPTQ_BLOCK, r)
    inputs = order.tolist()
    for start in range(0, k, GPTQ_BLOCK):
        stop = min(start + GPTQ_BLOCK, k)
        w1 = w[start:stop]  # this block's columns (not read again once rounded)
        u1 = u[start:stop, start:stop]
        for i in range(stop - start):
            rounded = q[start + i]
            found = quantize(rounded.copy_(w1[i]), inputs[start + i], rows)
            if found is not rounded:
                rounded.copy_(found)
            e = torch.sub(w1[i], rounded, out=err[i]).div_(u1[i, i])
            later = torch.mul(u1[i, i + 1 :, None], e, out=product[: stop - start - i - 1])
            w1[i + 1 :] -= later
        w[stop:] -= u[start:stop, stop:].T @ err[: stop - start]
    return q


@dataclass(frozen=True)
class LinearGrid:
    """A linear form's grid: ``bits``-bit codes with a scale (and, unless ``symmetric``, a
    zero point) per ``block`` inputs of a row, scales rounded to ``scale_dtype``."""

    bits: int
    block: int
    symmetric: bool
    scale_dtype: torch.dtype


def gptq_linear_grids(
    w: torch.Tensor, h: Hessian, grids: Sequence[LinearGrid], *, damping: float = DAMPING
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """:func:`gptq_linear` of ``w [N, K]`` on each of ``grids``, in one GPTQ run: the grids
    share the Hessian and its factor and GPTQ's rows are independent, so the rows of every
    grid are stacked (``[len(grids)·N, K]``) and each rounded on its own grid (symmetric
    ``b``-bit codes as asymmetric ones with the zero point ``2^(b-1)`` on ``[0, 2^b - 1]``:
    the same values).  The codes are those of fitting each grid alone (the column loop's
    Python steps are shared: a small weight's forms cost little more than one)."""
    n, k = w.shape
    fitted = [
        linear_scales(
            w,
            g.bits,
            g.block,
            symmetric=g.symmetric,
            scale_dtype=g.scale_dtype,
            importance=h.diagonal,
        )
        for g in grids
    ]
    # per input (a row here) and stacked row: its scale and zero point; per row: its top code
    scale = torch.empty(k, len(grids) * n)
    zero = torch.empty(k, len(grids) * n)
    top = torch.empty(len(grids) * n)
    for i, (g, (s, zp)) in enumerate(zip(grids, fitted, strict=True)):
        stacked = slice(i * n, (i + 1) * n)
        scale[:, stacked] = s.T.repeat_interleave(g.block, 0)
        zero[:, stacked] = (1 << (g.bits - 1)) if zp is None else zp.T.repeat_interleave(g.block, 0)
        top[stacked] = (1 << g.bits) - 1

    def quantize(column: torch.Tensor, index: int, rows: slice) -> torch.Tensor:
        s, z = scale[index, rows], zero[index, rows]
        codes = column.div_(s).round_().add_(z).clamp_(min=0)
        return torch.minimum(codes, top[rows], out=codes).sub_(z).mul_(s)

    rounded = gptq(w.repeat(len(grids), 1), h, quantize, damping=damping)
    out = []
    for i, (g, (s, zp)) in enumerate(zip(grids, fitted, strict=True)):
        codes = torch.round(rounded[i * n : (i + 1) * n] / s.repeat_interleave(g.block, 1))
        if zp is not None:
            codes += zp.repeat_interleave(g.block, 1)
        out.append((codes, s, zp))
    return out


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
    grid = LinearGrid(bits, block, symmetric, scale_dtype)
    return gptq_linear_grids(w, h, [grid], damping=damping)[0]


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
