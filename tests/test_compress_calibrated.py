"""Calibrated compression: fits that minimise a layer's output error on calibration inputs
(GPTQ, activation-aware scales, weighted palettes), ``calibrate()`` block by block, the
bits allocation of ``Mixed``, and their errors.  Small synthetic layers and a small Llama
(random weights); the real-weight quality checks are in ``tests/test_compress_quality.py``.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn

from coreai_torch import compression, llm
from coreai_torch.bundles import function_signatures
from coreai_torch.compression import calibrated as fits
from coreai_torch.compression.calibration import CalibrationError, allocate, find_blocks
from coreai_torch.ir.compressed import LinearCodes
from coreai_torch.runtime import run_program
from tests.llm.support import causal_lm


def _inputs(samples: int, features: int, seed: int = 0) -> torch.Tensor:
    """Correlated inputs with a few large channels, as a transformer layer sees them."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(features, features, generator=g) / features**0.5
    x = torch.randn(samples, features, generator=g) @ (torch.eye(features) + mix)
    x[:, :4] *= 8.0  # outlier channels
    return x


def _hessian(x: torch.Tensor) -> fits.Hessian:
    h = fits.Hessian(x.shape[1])
    h.add(x)
    return h


def _rtn(w: torch.Tensor, bits: int, block: int, symmetric: bool = True) -> torch.Tensor:
    s, zp = fits.linear_scales(
        w, bits, block, symmetric=symmetric, scale_dtype=torch.float32, importance=None
    )
    n, k = w.shape
    blocks = w.reshape(n, k // block, block)
    return fits.quantize_values(blocks, s[..., None], None if zp is None else zp[..., None], bits)[
        1
    ].reshape(n, k)


def test_few_inputs_are_kept_and_give_the_hessians_errors() -> None:
    """Fewer inputs than the weight has columns are kept as they are (the data-free
    measurement of a 1B model's 8192-input weights on 128 tokens multiplies by them, not by
    an 8192² matrix); the errors, diagonal and matrix are the Hessian's either way."""
    x = _inputs(48, 128)
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(2)) * 0.05
    q = _rtn(w, 4, 32)
    few = fits.Hessian(128)
    few.add(x[:20])
    few.add(x[20:])
    assert few._matrix is None  # still the inputs
    error = fits.output_error(w, q, few)
    diagonal = few.diagonal
    expected = x.double().T @ x.double()
    direct = float(
        (((w - q).double() @ x.double().T) ** 2).sum() / ((w.double() @ x.double().T) ** 2).sum()
    )
    assert error == pytest.approx(direct, rel=1e-5)
    torch.testing.assert_close(diagonal.double(), expected.diagonal(), rtol=1e-5, atol=0)
    torch.testing.assert_close(
        few.matrix, expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max())
    )
    assert fits.output_error(w, q, few) == pytest.approx(direct, rel=1e-5)  # from H now
    many = fits.Hessian(16)  # more inputs than columns: summed into H as they come
    many.add(x[:, :16])
    assert many._matrix is not None
    assert float(many.row_energies(w[:, :16]).sum()) == pytest.approx(
        float(((w[:, :16].double() @ x[:, :16].double().T) ** 2).sum()), rel=1e-6
    )


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize(("bits", "block"), [(4, 32), (4, 128), (3, 32), (8, 128)])
def test_gptq_has_less_output_error_than_round_to_nearest(
    bits: int, block: int, symmetric: bool
) -> None:
    w = torch.randn(96, 128, generator=torch.Generator().manual_seed(1)) * 0.05
    h = _hessian(_inputs(1024, 128))
    rtn = fits.output_error(w, _rtn(w, bits, block, symmetric), h)
    codes, s, zp = fits.gptq_linear(
        w, h, bits, block, symmetric=symmetric, scale_dtype=torch.float32
    )
    offset = 0 if zp is None else zp.repeat_interleave(block, 1)
    gptq = fits.output_error(w, (codes - offset) * s.repeat_interleave(block, 1), h)
    assert gptq < 0.8 * rtn, (gptq, rtn)
    high = (1 << (bits - 1)) if symmetric else (1 << bits)
    assert int(codes.min()) >= (-high if symmetric else 0)
    assert int(codes.max()) <= high - 1
    assert torch.equal(codes, codes.round())


def _textbook_gptq_linear(
    w: torch.Tensor, h: fits.Hessian, grid: fits.LinearGrid
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ as the paper writes it (rows as rows, one form, a fresh temporary per column):
    ``(codes, rounded weight)`` on the scales :func:`fits.linear_scales` chooses."""
    s, zp = fits.linear_scales(
        w,
        grid.bits,
        grid.block,
        symmetric=grid.symmetric,
        scale_dtype=grid.scale_dtype,
        importance=h.diagonal,
    )
    order, u, dead = h.factor(fits.DAMPING)
    scale = s.repeat_interleave(grid.block, 1)[:, order]
    zero = None if zp is None else zp.repeat_interleave(grid.block, 1)[:, order]
    part = w[:, order].clone()
    part[:, dead] = 0.0
    k = w.shape[1]
    q = torch.zeros_like(part)
    for start in range(0, k, fits.GPTQ_BLOCK):
        stop = min(start + fits.GPTQ_BLOCK, k)
        w1 = part[:, start:stop].clone()
        err1 = torch.zeros_like(w1)
        u1 = u[start:stop, start:stop]
        for i in range(stop - start):
            j = start + i
            column = w1[:, i]
            z = None if zero is None else zero[:, j]
            q[:, j] = fits.quantize_values(column, scale[:, j], z, grid.bits)[1]
            e = (column - q[:, j]) / u1[i, i]
            w1[:, i:] -= e[:, None] * u1[i, i:][None, :]
            err1[:, i] = e
        part[:, stop:] -= err1 @ u[start:stop, stop:]
    rounded = torch.empty_like(w)
    rounded[:, order] = q
    codes = torch.round(rounded / s.repeat_interleave(grid.block, 1))
    if zp is not None:
        codes += zp.repeat_interleave(grid.block, 1)
    return codes, rounded


def test_forms_fitted_in_one_gptq_run_have_the_codes_of_each_fitted_alone() -> None:
    """Mixed's sensitivity pass fits every candidate form of a weight in one GPTQ run (the
    rows of every form stacked, each on its own grid; symmetric codes as asymmetric ones
    around ``2^(b-1)``): the codes are bit for bit those of each form alone and of the
    textbook loop (every product and difference is the same float32 operation; the block
    update's matrix product sums the same 128 terms per element in the same order)."""
    w = torch.randn(72, 256, generator=torch.Generator().manual_seed(7)) * 0.05
    w[3, :40] *= 6.0  # a row whose int8 codes reach the ends of their range
    x = _inputs(640, 256, seed=8)
    x[:, 17] = 0.0  # an input that never sees a value (its weights are zeroed)
    h = _hessian(x)
    grids = [
        fits.LinearGrid(8, 256, True, torch.float16),
        fits.LinearGrid(4, 32, False, torch.float16),
        fits.LinearGrid(4, 64, False, torch.float32),
        fits.LinearGrid(4, 128, True, torch.float16),
        fits.LinearGrid(3, 32, True, torch.float32),
    ]
    together = fits.gptq_linear_grids(w, h, grids)
    for grid, (codes, s, zp) in zip(grids, together, strict=True):
        alone = fits.gptq_linear(
            w, h, grid.bits, grid.block, symmetric=grid.symmetric, scale_dtype=grid.scale_dtype
        )
        textbook, _ = _textbook_gptq_linear(w, h, grid)
        assert torch.equal(codes, alone[0]) and torch.equal(codes, textbook), grid
        assert torch.equal(s, alone[1])
        assert (zp is None) == grid.symmetric and (zp is None or torch.equal(zp, alone[2]))
        if grid.symmetric:
            assert int(codes.min()) >= -(1 << (grid.bits - 1))
            assert int(codes.max()) <= (1 << (grid.bits - 1)) - 1
        else:
            assert int(codes.min()) >= 0 and int(codes.max()) <= (1 << grid.bits) - 1


@pytest.mark.parametrize("stacked", [1 << 26, 96 * 128 * 2])
def test_fit_forms_gives_each_forms_fit_weight(
    stacked: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sensitivity pass fits all candidate forms of a weight at once (its linear forms in
    one GPTQ run, up to STACKED_ELEMENTS fitted elements, in pieces of ROUNDED_ROWS stacked
    rows): every result is fit_weight's for that form alone, a form that does not apply
    says why, palettes are fitted as alone."""
    from coreai_torch.compression import calibration

    monkeypatch.setattr(calibration, "STACKED_ELEMENTS", stacked)
    monkeypatch.setattr(calibration, "ROUNDED_ROWS", 128)
    w = torch.randn(96, 128, generator=torch.Generator().manual_seed(9)) * 0.05
    h = _hessian(_inputs(512, 128, seed=10))
    module = nn.Linear(128, 96, bias=False)
    forms = [
        *compression.MIXED_FORMS,
        compression.Palettization(bits=3, group_size=16),
        compression.LinearQuantization(bits=4, block_size=48),  # 128 inputs: does not apply
        compression.LinearQuantization(bits=4, block_size=32, scale_dtype=torch.float32),
    ]
    together = calibration.fit_forms(module, w, h, forms, torch.float16)
    assert len(together) == len(forms)
    for form, out in zip(forms, together, strict=True):
        alone = calibration.fit_weight(module, w, h, form, torch.float16)
        if isinstance(alone, str):
            assert out == alone and "block_size=48" in out
            continue
        assert not isinstance(out, str)
        (codes, fitted), (alone_codes, alone_fitted) = out, alone
        assert type(codes) is type(alone_codes)
        for field in ("codes", "scale", "zero_point", "lut", "indices"):
            if hasattr(codes, field):
                a, b = getattr(codes, field), getattr(alone_codes, field)
                assert (a is None and b is None) or np.array_equal(a, b), (form, field)
        assert torch.equal(fitted, alone_fitted), form


def test_forms_fitted_on_one_hessian_share_its_factorisation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Mixed fits every candidate form of a weight on the same Hessian: GPTQ factorises it
    once (per damping), with the codes of a fresh factorisation; new inputs refactorise."""
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(4)) * 0.05
    x = _inputs(512, 128)
    factorisations: list[int] = []
    inverse_cholesky = fits._inverse_cholesky
    monkeypatch.setattr(
        fits, "_inverse_cholesky", lambda *a: factorisations.append(1) or inverse_cholesky(*a)
    )
    shared = _hessian(x)
    forms = [(4, 32, False), (4, 64, True), (8, 128, True)]
    for bits, block, symmetric in forms:
        codes = fits.gptq_linear(
            w, shared, bits, block, symmetric=symmetric, scale_dtype=torch.float32
        )[0]
        fresh = fits.gptq_linear(
            w, _hessian(x), bits, block, symmetric=symmetric, scale_dtype=torch.float32
        )[0]
        assert torch.equal(codes, fresh)
    assert len(factorisations) == 1 + len(forms)  # the shared one once, each fresh one
    shared.add(x[:8])
    fits.gptq_linear(w, shared, 4, 32, symmetric=False, scale_dtype=torch.float32)
    assert len(factorisations) == 2 + len(forms)


@pytest.mark.parametrize("symmetric", [True, False])
def test_a_tall_weight_is_fitted_a_piece_of_rows_at_a_time(
    symmetric: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPTQ's rows are independent: a 128k-row output head is fitted :data:`ROUNDED_ROWS`
    rows at a time (whole-weight float32 temporaries of its codes and grids were the 1B
    calibration's excess memory), with the codes of fitting it whole."""
    from coreai_torch.compression import calibration

    w = torch.randn(80, 128, generator=torch.Generator().manual_seed(5)) * 0.05
    h = _hessian(_inputs(512, 128))
    form = compression.LinearQuantization(bits=4, block_size=32, symmetric=symmetric)
    module = nn.Linear(128, 80, bias=False)
    whole = calibration.fit_weight(module, w, h, form, torch.float32)
    pieces: list[int] = []
    gptq_linear_grids = fits.gptq_linear_grids
    monkeypatch.setattr(
        fits,
        "gptq_linear_grids",
        lambda part, *a, **k: pieces.append(len(part)) or gptq_linear_grids(part, *a, **k),
    )
    monkeypatch.setattr(calibration, "ROUNDED_ROWS", 32)
    chunked = calibration.fit_weight(module, w, h, form, torch.float32)
    assert pieces == [32, 32, 16]
    assert not isinstance(whole, str) and not isinstance(chunked, str)
    (codes, fitted), (chunked_codes, chunked_fitted) = whole, chunked
    assert np.array_equal(codes.codes, chunked_codes.codes)
    assert codes.codes.dtype == (np.int8 if symmetric else np.uint8)
    np.testing.assert_array_equal(codes.scale, chunked_codes.scale)
    torch.testing.assert_close(fitted, chunked_fitted, rtol=0, atol=1e-6)
    error = fits.output_error(w, fitted, h)
    monkeypatch.setattr(fits, "GPTQ_ROWS", 16)
    assert fits.output_error(w, fitted, h) == pytest.approx(error, rel=1e-9)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("pieces", [1 << 18, 200])
def test_the_ratio_search_in_pieces_gives_the_textbook_scales(
    symmetric: bool, pieces: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """linear_scales searches the clipping ratios SCALE_SEARCH_ELEMENTS weights at a time in
    one reused buffer: the scales and zero points are those of trying every ratio on the
    whole weight with fresh temporaries."""
    monkeypatch.setattr(fits, "SCALE_SEARCH_ELEMENTS", pieces)
    w = torch.randn(40, 192, generator=torch.Generator().manual_seed(11)) * 0.05
    w[5] = 0.0  # a zero block: scale 1
    importance = _hessian(_inputs(300, 192, seed=12)).diagonal
    for bits, block in [(4, 32), (8, 192), (3, 64)]:
        blocks = w.reshape(40, 192 // block, block)
        weight = importance.reshape(1, 192 // block, block)
        best = best_s = best_zp = None
        for ratio in fits.CLIP_RATIOS:
            if symmetric:
                top = (1 << (bits - 1)) - 1
                magnitude = torch.maximum(blocks.amax(-1), -blocks.amin(-1))[..., None]
                s = (magnitude * ratio / top).to(torch.float16).float()
                s[s == 0] = 1.0
                zp = None
            else:
                top = (1 << bits) - 1
                lo = blocks.amin(-1, keepdim=True).clamp(max=0) * ratio
                hi = blocks.amax(-1, keepdim=True).clamp(min=0) * ratio
                s = ((hi - lo) / top).to(torch.float16).float()
                s[s == 0] = 1.0
                zp = torch.round(-lo / s).clamp(0, top)
            q = fits.quantize_values(blocks, s, zp, bits)[1]
            err = ((blocks - q) ** 2 * weight).sum(-1, keepdim=True)
            if best is None:
                best, best_s, best_zp = err, s, zp
                continue
            better = err < best
            best = torch.where(better, err, best)
            best_s = torch.where(better, s, best_s)
            best_zp = None if zp is None else torch.where(better, zp, best_zp)
        s, zp = fits.linear_scales(
            w, bits, block, symmetric=symmetric, scale_dtype=torch.float16, importance=importance
        )
        assert torch.equal(s, best_s.squeeze(-1)), (bits, block)
        assert (zp is None) == symmetric
        assert zp is None or torch.equal(zp, best_zp.squeeze(-1))
        assert float(s[5].min()) == 1.0


_FACTOR_MEMORY = """
import resource, torch
from coreai_torch.compression import calibrated as fits
k = 4096
h = fits.Hessian(k)
g = torch.Generator().manual_seed(0)
for _ in range(3):
    h.add(torch.randn(2048, k, generator=g))
h.matrix
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
h.factor(fits.DAMPING)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) * 1024 / (k * k * 8))
"""


def test_gptq_factorises_a_large_hessian_with_few_copies_of_it() -> None:
    """The peak memory of factorising a ``K × K`` Hessian, in copies of it (float64): the
    8192-input Hessian of a 1B model's MLP is 0.5 GB a copy; the earlier factorisation made
    its permuted copy, a clone, an identity and the damped sum before factorising (4.4
    copies above the Hessian's own peak; now none: one permuted copy, factorised in place)."""
    out = subprocess.run(
        [sys.executable, "-c", _FACTOR_MEMORY], capture_output=True, text=True, check=True
    )
    copies = float(out.stdout.split()[-1])
    assert copies < 2.5, copies


_SUM_MEMORY = """
import resource, torch
from coreai_torch.compression import calibrated as fits
k = 8192
g = torch.Generator().manual_seed(0)
xs = [torch.randn(2048, k, generator=g) for _ in range(5)]
h = fits.Hessian(k)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for x in xs:
    h.add(x)
h.matrix
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) * 1024 / (k * k * 8))
"""


def test_a_large_hessian_is_summed_with_few_temporaries() -> None:
    """The peak memory of summing the 8192-input Hessian of a 1B model's MLP down-projection
    (0.5 GB in float64) from 10,240 inputs, in copies of it: the Hessian, the first 8,192
    inputs kept until it is formed (half a copy) and a piece of columns' products; the
    products summed whole were 1.5 copies more (float32, then float64): 3.05 copies, now 1.7."""
    out = subprocess.run(
        [sys.executable, "-c", _SUM_MEMORY], capture_output=True, text=True, check=True
    )
    copies = float(out.stdout.split()[-1])
    assert copies < 2.3, copies


def test_hessians_summed_a_piece_of_columns_at_a_time_are_the_whole_products(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x = _inputs(300, 40)
    monkeypatch.setattr(fits, "HESSIAN_COLUMNS", 7)
    h = _hessian(x)
    torch.testing.assert_close(h.matrix, (x.T @ x).double(), rtol=1e-6, atol=1e-6)


def test_activation_aware_scales_never_lose_to_round_to_nearest() -> None:
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    h = _hessian(_inputs(512, 256, seed=3))
    importance = h.diagonal
    s, _ = fits.linear_scales(
        w, 4, 32, symmetric=True, scale_dtype=torch.float32, importance=importance
    )
    blocks = w.reshape(64, 8, 32)
    clipped = fits.quantize_values(blocks, s[..., None], None, 4)[1].reshape(64, 256)
    weighted = lambda q: float(((w - q) ** 2 * importance).sum())  # noqa: E731
    assert weighted(clipped) <= weighted(_rtn(w, 4, 32))


def test_weighted_palettes_with_gptq_beat_plain_palettes() -> None:
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(4)) * 0.1
    h = _hessian(_inputs(1024, 128, seed=5))
    from coreai_torch.compression.fitting import kmeans_1d

    plain = torch.from_numpy(kmeans_1d(w.reshape(4, -1).numpy(), 8).astype(np.float32))
    nearest = fits.nearest_entries(w.reshape(4, -1), plain).reshape(64, 128)
    plain_error = fits.output_error(w, plain.repeat_interleave(16, 0).gather(1, nearest), h)
    indices, palettes = fits.gptq_palettes(w, h, 3, 16)
    fitted = palettes.repeat_interleave(16, 0).gather(1, indices)
    assert fits.output_error(w, fitted, h) < 0.8 * plain_error
    assert int(indices.max()) < 8


def test_weighted_kmeans_follows_the_weights() -> None:
    from coreai_torch.compression.fitting import kmeans_1d

    values = np.array([[0.0, 0.1, 1.0, 1.1, 5.0, 5.1]])
    heavy = np.array([[1.0, 1.0, 1.0, 1.0, 100.0, 1.0]])
    centroids = kmeans_1d(values, 2, weights=heavy)
    assert abs(centroids[0, 1] - (5.0 * 100 + 5.1) / 101) < 1e-9


# ---------------------------------------------------------------------------- allocation ---


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(256, 256, bias=False)
        self.small = nn.Linear(256, 64, bias=False)


def _layers(model: nn.Module) -> dict:
    from coreai_torch.compression.calibration import _layers as layers

    return layers(model)


def test_allocation_meets_the_budget_and_gives_bits_where_they_buy_most() -> None:
    model = _Two()
    forms = (
        compression.LinearQuantization(bits=8),
        compression.LinearQuantization(bits=4, block_size=32),
    )
    config = compression.Mixed(target_bpw=5.5, forms=forms)
    # the small layer is sensitive (its 4-bit error is large), the big one is not
    errors = {"big.weight": {0: 1e-5, 1: 1e-3}, "small.weight": {0: 1e-5, 1: 1e-1}}
    chosen = allocate(model, _layers(model), errors, config, torch.float16)
    assert chosen["small.weight"] == forms[0] and chosen["big.weight"] == forms[1]
    bits = sum(
        compression.bits_per_weight(chosen[n], tuple(p.shape), torch.float16) * p.numel()
        for n, p in model.named_parameters()
    )
    assert bits / sum(p.numel() for p in model.parameters()) <= 5.5
    # with room for everything, everything gets 8 bits
    roomy = allocate(
        model, _layers(model), errors, compression.Mixed(target_bpw=9, forms=forms), torch.float16
    )
    assert set(roomy.values()) == {forms[0]}


def test_a_budget_below_the_cheapest_forms_is_an_error() -> None:
    model = _Two()
    config = compression.Mixed(
        target_bpw=2.0, forms=(compression.LinearQuantization(bits=4, block_size=32),)
    )
    errors = {"big.weight": {0: 1e-3}, "small.weight": {0: 1e-3}}
    with pytest.raises(
        CalibrationError, match=r"target_bpw=2 is below what the forms allow: 4\.500"
    ):
        allocate(model, _layers(model), errors, config, torch.float16)


def test_bits_per_weight_counts_codes_scales_zero_points_and_palettes() -> None:
    lq = compression.LinearQuantization
    assert compression.bits_per_weight(lq(bits=4, block_size=32), (64, 128)) == 4.5
    assert compression.bits_per_weight(lq(bits=4, block_size=32, symmetric=False), (64, 128)) == (
        4 + 20 / 32
    )
    assert compression.bits_per_weight(lq(bits=8), (64, 128), torch.float32) == 8 + 32 / 128
    assert compression.bits_per_weight(lq(bits=3, block_size=32), (64, 128)) == 4.5  # 4-bit codes
    pal = compression.Palettization(bits=3, group_size=16)
    assert compression.bits_per_weight(pal, (64, 128)) == 3 + 8 * 16 / (16 * 128)
    conv = lq(bits=4, block_size=8)
    assert compression.bits_per_weight(conv, (16, 32, 3, 3)) == 4 + 16 / 72


# ------------------------------------------------------------------------------ presets ---


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("int4", "int4 blocks of 32, symmetric"),
        ("int4-asym", "int4 blocks of 32, asymmetric"),
        ("int4-g64", "int4 blocks of 64, symmetric"),
        ("int4-asym-g128", "int4 blocks of 128, asymmetric"),
        ("int4-pc", "int4 per channel, symmetric"),
        ("int8", "int8 per channel, symmetric"),
        ("int8-g32", "int8 blocks of 32, symmetric"),
        ("palette4", "4-bit palettes, groups of 16 channels"),
        ("palette4-pt", "4-bit palettes, one per weight"),
        ("palette3-g8", "3-bit palettes, groups of 8 channels"),
        ("mixed", "mixed, 4.5 bits per weight"),
    ],
)
def test_every_form_has_a_name(spec: str, expected: str) -> None:
    assert compression.from_spec(spec).describe().startswith(expected)


def test_presets_below_8_bits_keep_embeddings_and_head_in_int8() -> None:
    for spec in ("int4", "palette4", "int4-asym"):
        config = compression.from_spec(spec)
        assert config.embeddings == compression.SAFE_FORM
        assert config.output_head == compression.SAFE_FORM
    assert compression.from_spec("int8").embeddings is True


@pytest.mark.parametrize("spec", ["int4-pt", "palette4-asym", "int4-pc-g32", "mixed4", "int4-"])
def test_unknown_names_are_errors(spec: str) -> None:
    with pytest.raises(ValueError, match=spec.split("-")[0][:3]):
        compression.from_spec(spec)


# --------------------------------------------------------------------------- calibrate() ---


def test_blocks_are_the_largest_module_list() -> None:
    model = causal_lm("smollm")
    assert find_blocks(model) is model.model.layers
    assert find_blocks(nn.Sequential(nn.Linear(4, 4))) is None


def _fake_quantized(model: nn.Module, calibration: compression.Calibration) -> nn.Module:
    import copy

    twin = copy.deepcopy(model)
    params = dict(twin.named_parameters(remove_duplicate=False))
    for w in calibration.weights.values():
        params[w.name].data.copy_(
            torch.from_numpy(w.read_codes().dequantized()).reshape(params[w.name].shape)
        )
    return twin


def test_an_llm_is_calibrated_a_few_sequences_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The calibration sequences of an LLM export run :data:`CALL_TOKENS` tokens at a time
    (one call of 32 × 256 tokens held 3.5 GB of a 1B block's activations), with the codes of
    one call holding them all."""
    from coreai_torch.llm import calibration as llm_calibration

    model = causal_lm("smollm")
    ids = torch.randint(
        0, model.config.vocab_size, (6, 32), generator=torch.Generator().manual_seed(0)
    )
    config = compression.LinearQuantization(bits=4, block_size=32, min_elements=0)
    whole = compression.calibrate(model, {"input_ids": ids, "use_cache": False}, config)
    batches: list[int] = []
    handle = find_blocks(model)[0].register_forward_pre_hook(
        lambda module, args: batches.append(int(args[0].shape[0]))
    )
    monkeypatch.setattr(llm_calibration, "CALL_TOKENS", 64)
    try:
        pieces = llm_calibration.calibrated(model, ids, config, torch.float32)
    finally:
        handle.remove()
    assert batches and max(batches) == 2
    assert pieces.samples == whole.samples == 6 and pieces.weights.keys() == whole.weights.keys()
    for name, fitted in whole.weights.items():
        a, b = fitted.codes.codes.astype(int), pieces.weights[name].codes.codes.astype(int)
        assert np.mean(a != b) < 1e-3, name  # the same Hessians, summed in another order


@pytest.mark.parametrize("spec", ["int4-asym", "palette3"])
def test_calibrated_llm_export_runs_the_fitted_weights(spec: str) -> None:
    """The program stores exactly the calibrated codes: its logits are those of the PyTorch
    model with the fitted weights."""
    model = causal_lm("smollm")
    ids = torch.randint(
        0, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0)
    )
    config = compression.from_spec(spec)
    config = type(config)(**{**config.__dict__, "min_elements": 0})
    calibration = compression.calibrate(model, {"input_ids": ids, "use_cache": False}, config)
    assert calibration.weights and calibration.output_error is not None
    program = llm.export(model, max_context=16, compress=config, calibration=ids.tolist())
    _runs_the_fitted_weights(program, _fake_quantized(model, calibration), ids[:1, :8])


def test_the_codes_of_a_streamed_model_wait_on_disk_and_are_the_ones_stored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``calibrate()`` on a model streamed from its checkpoint keeps the codes it fits in a
    temporary file, not in memory (a 1B model's are 1.2 GB at a byte per weight), and reads
    the tied embedding table / output head a piece of rows at a time (the looked-up rows,
    then the head's pieces as they are fitted and measured: a 128k-row table whole in
    float32, and its fitted copy, were half a 1B calibration's peak); the codes are the
    in-memory model's, and the program compressed with them runs them."""
    import coreai_torch
    from coreai_torch.compression import apply, calibration
    from coreai_torch.compression.spilling import SpilledCodes
    from coreai_torch.tensors import lazy
    from tests.llm.support import save_model_dir

    model, _, model_dir = save_model_dir(tmp_path, tie_word_embeddings=True)  # tied: the
    # table stores the head's fitted codes, which the twin below has
    with coreai_torch.empty_parameters():
        streamed = type(model)(model.config).eval()
    coreai_torch.WeightSource(model_dir / "model.safetensors").bind(streamed)
    ids = torch.randint(
        0, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0)
    )
    config = compression.LinearQuantization(bits=4, block_size=32, min_elements=0)
    samples = {"input_ids": ids, "use_cache": False}
    in_memory = compression.calibrate(model, samples, config)
    table = streamed.get_input_embeddings().weight  # the output head's too
    read_whole: list[torch.Tensor] = []
    materialize = lazy.materialize

    def spied(tensor: torch.Tensor) -> torch.Tensor:
        if tensor is table:
            read_whole.append(tensor)
        return materialize(tensor)

    with monkeypatch.context() as patch:  # the table is read 16 rows at a time, never whole
        patch.setattr(lazy, "materialize", spied)
        patch.setattr(calibration, "MEASURE_ELEMENTS", 16 * model.config.hidden_size)
        on_disk = compression.calibrate(streamed, samples, config)
    assert not read_whole
    assert on_disk.weights.keys() == in_memory.weights.keys() and on_disk.weights
    for name, fitted in on_disk.weights.items():
        assert isinstance(fitted.codes, SpilledCodes), name
        codes, expected = fitted.read_codes(), in_memory.weights[name].codes
        assert isinstance(codes, LinearCodes) and isinstance(expected, LinearCodes)
        np.testing.assert_array_equal(codes.codes, expected.codes)
        np.testing.assert_array_equal(codes.scale, expected.scale)
    assert on_disk.output_error == pytest.approx(in_memory.output_error, rel=1e-6)
    twin = _fake_quantized(model, in_memory)
    program = llm.export(streamed, max_context=16, compress=config, calibration=ids.tolist())
    _runs_the_fitted_weights(program, twin, ids[:1, :8])
    # without room for compress()'s own spill file, the codes are read again from the
    # calibration's while the asset is written
    monkeypatch.setattr(apply.Spilling, "file_for", lambda self, nbytes: None)
    program = llm.export(streamed, max_context=16)
    program.compress(config, calibration=on_disk)
    _runs_the_fitted_weights(program, twin, ids[:1, :8])


def _runs_the_fitted_weights(program: Any, twin: nn.Module, prompt: torch.Tensor) -> None:
    """The program's logits for ``prompt`` are ``twin``'s (the model with fitted weights)."""
    main = function_signatures(program)["main"]
    states = {
        s.name: np.zeros([16 if d is None else d for d in s.shape], np.float32) for s in main.states
    }
    out = run_program(
        program,
        {
            "input_ids": prompt.numpy().astype(np.int32),
            "position_ids": np.arange(8, dtype=np.int32)[None],
        },
        entrypoint="main",
        state=states,
    )["logits"]
    with torch.no_grad():
        expected = twin(prompt).logits
    # the logits are float16 (the app's convention): rtol covers their rounding
    np.testing.assert_allclose(out.astype(np.float32), expected.numpy(), atol=2e-4, rtol=1e-3)


def test_mixed_export_meets_its_budget_and_reports_each_choice() -> None:
    model = causal_lm("smollm")
    ids = torch.randint(
        0, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1)
    )
    forms = (
        compression.LinearQuantization(bits=8),
        compression.LinearQuantization(bits=4, block_size=32, symmetric=False),
        compression.Palettization(bits=3, group_size=16),
    )
    config = compression.Mixed(target_bpw=6.0, forms=forms, min_elements=0)
    calibration = compression.calibrate(
        model, {"input_ids": ids, "use_cache": False}, config, scale_dtype=torch.float16
    )
    assert calibration.planned_bpw is not None and calibration.planned_bpw <= 6.0
    # the fitted codes stored in a program compressed after optimize() (llm.export's own
    # mixed path: test_from_pretrained_mixed_with_a_calibration_text_and_its_perplexity)
    program = llm.export(model, max_context=16, precision="fp16")
    report = program.compress(config, calibration=calibration)
    assert report.bits_per_weight is not None and report.bits_per_weight <= 6.0 + 1e-6
    assert all(w.output_error is not None for w in report.weights)
    assert len({w.form for w in report.weights}) >= 2
    assert "output error on the calibration samples" in str(report)


def test_bad_calibration_data_is_named() -> None:
    model = causal_lm("smollm")
    vocab = model.config.vocab_size
    with pytest.raises(
        CalibrationError, match=rf"token id {vocab} is outside the model's vocabulary"
    ):
        llm.export(model, max_context=16, compress="int4", calibration=[[1, 2, vocab, 3]])
    with pytest.raises(CalibrationError, match="integer \\[samples, tokens\\] tensor"):
        llm.export(model, max_context=16, compress="int4", calibration=torch.zeros(2, 3, 4))
    with pytest.raises(CalibrationError, match="there is no tokenizer"):
        llm.export(model, max_context=16, compress="int4", calibration=__file__)
    with pytest.raises(ValueError, match=r"needs? calibration|pass calibration="):
        llm.export(model, max_context=16, compress="mixed")
    with pytest.raises(ValueError, match="target_bpw= is the budget of compress='mixed'"):
        llm.export(model, max_context=16, compress="int4", target_bpw=4.5)
    with pytest.raises(CalibrationError, match="below what the forms allow"):
        llm.export(
            model, max_context=16, compress="mixed", target_bpw=1.0, calibration=[list(range(32))]
        )


def test_a_data_free_llm_export_measures_its_output_error_on_examples() -> None:
    """Without calibration data the export still measures what the compression did to the
    model's outputs (on example token ids): a destroyed model is flagged and warned about."""
    destroyed = compression.LinearQuantization(bits=2, min_elements=0)
    expected = r"example inputs of random token ids \(no calibration\) are off by"
    with pytest.warns(RuntimeWarning, match=expected):
        program = llm.export(causal_lm("smollm"), max_context=16, compress=destroyed)
    report = program.compression_report
    assert report is not None and report.large_output_error
    assert "example inputs" in str(report) and "LARGE" in str(report)


def test_a_data_free_export_of_a_large_model_says_it_was_not_measured(monkeypatch) -> None:
    """Above ``MEASURE_MAX_PARAMETERS`` the data-free measurement (about the cost of the
    compression again) is not run, and the report says so and how to measure instead."""
    from coreai_torch.llm import calibration

    model = causal_lm("smollm")
    monkeypatch.setattr(calibration, "MEASURE_MAX_PARAMETERS", 1000)
    report = llm.export(model, max_context=16, compress="int4").compression_report
    assert report is not None and report.output_error is None
    assert report.not_measured is not None and "coreai-torch eval perplexity" in str(report)
    assert "more than the 1e-06 B a data-free export measures" in report.not_measured


@pytest.mark.parametrize(("architecture", "tied"), [("llama", True), ("gemma2", False)])
@pytest.mark.parametrize("spec", ["int4", "palette4"])
def test_the_data_free_measurement_reads_the_tables_a_piece_at_a_time(
    architecture: str, tied: bool, spec: str, monkeypatch
) -> None:
    """``measure()`` (what a data-free LLM export runs) gives ``calibrate(method="rtn")``'s
    output error while it rounds weights a piece at a time and reads only the embedding rows
    the samples look up (a whole 128k-row table in float32 twice, 4 GB for an 8B model, is
    what it avoids); Gemma 2's decoder layers return tuples, which the replay keeps."""
    from coreai_torch.compression import calibration

    model = causal_lm(architecture, tie_word_embeddings=tied)
    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab // 4, (2, 24), generator=torch.Generator().manual_seed(0))
    samples = {"input_ids": tokens, "use_cache": False}
    config = compression.from_spec(spec)
    expected = compression.calibrate(model, samples, config, method="rtn").output_error
    table = model.get_input_embeddings().weight
    read: list[tuple[bool, int]] = []
    original = calibration._read_rows

    def recorded(weight: torch.Tensor, first: int, count: int) -> torch.Tensor:
        rows = original(weight, first, count)
        read.append((weight is table, rows.shape[0]))
        return rows

    monkeypatch.setattr(calibration, "_read_rows", recorded)
    monkeypatch.setattr(calibration, "MEASURE_ELEMENTS", 16 * model.config.hidden_size)
    measured = calibration.measure(model, samples, config)
    assert expected is not None and measured.output_error == pytest.approx(expected, rel=1e-9)
    assert not measured.weights and measured.tokens == tokens.numel()
    assert max(count for _, count in read) <= 16
    # the embedding: the pieces holding ids < vocab / 4; the head: every row, once
    table_rows = sum(count for is_table, count in read if is_table)
    assert table_rows <= vocab // 4 + 16 + (vocab if tied else 0)
    if not tied:
        assert sum(count for is_table, count in read if not is_table) == vocab


def test_the_data_free_measurement_of_a_model_whose_table_outweighs_its_blocks() -> None:
    """A model whose embedding table holds more than its decoder layers (no list of blocks
    with half the parameters) is measured in one stage, on the same samples as the
    calibration (it failed with a ``TypeError`` in ``embedding()``)."""
    from coreai_torch.compression import calibration

    model = causal_lm("llama", num_hidden_layers=2, vocab_size=4096)
    assert find_blocks(model) is None
    tokens = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(0))
    samples = {"input_ids": tokens, "use_cache": False}
    config = compression.from_spec("int4")
    expected = compression.calibrate(model, samples, config, method="rtn").output_error
    measured = calibration.measure(model, samples, config)
    assert expected is not None and measured.output_error == pytest.approx(expected, rel=1e-9)
    assert measured.output_error > 0 and not measured.weights


def test_a_layer_too_small_for_its_block_size_stays_uncompressed_and_is_named() -> None:
    model = nn.Sequential(nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 64))
    x = torch.randn(64, 48)
    config = compression.LinearQuantization(bits=4, block_size=32, min_elements=0)
    calibration = compression.calibrate(model, x, config)
    assert [name for name, _ in calibration.unfitted] == ["0.weight"]
    assert "input size 48 is not a multiple of block_size=32" in calibration.unfitted[0][1]
    assert "2.weight" in calibration.weights
    assert "not calibrated: 0.weight" in str(calibration)


# ------------------------------------------------- the acceptance call, on a small model ---


def test_from_pretrained_mixed_with_a_calibration_text_and_its_perplexity(tmp_path) -> None:
    """``CoreAIModelForCausalLM.from_pretrained(dir, export=True, precision="fp16",
    compress="mixed", target_bpw=..., calibration="calib.txt")`` on a streamed checkpoint,
    then ``coreai-torch eval perplexity`` against the PyTorch model."""

    from coreai_torch.cli.main import main
    from coreai_torch.hf import CoreAIModelForCausalLM
    from coreai_torch.llm.evaluate import perplexity
    from tests.llm.support import CORPUS, save_model_dir

    _, tokenizer, model_dir = save_model_dir(tmp_path)
    text = " ".join(CORPUS * 12)
    calib = tmp_path / "calib.txt"
    calib.write_text(text)
    model = CoreAIModelForCausalLM.from_pretrained(
        model_dir,
        export=True,
        precision="fp16",
        compress="mixed",
        target_bpw=7.0,
        calibration=str(calib),
        max_context=64,
    )
    assert model.coreai_config["compression"] == "mixed, 7 bits per weight"
    assert model.coreai_config["bits_per_weight"] <= 7.0
    out = tmp_path / "out"
    model.save_pretrained(out)
    result = perplexity(out, calib, reference=model_dir, window=32, tokenizer=tokenizer)
    assert result.tokens > 100 and result.reference is not None
    assert abs(result.relative) < 0.5  # random weights: only that both sides agree broadly
    # the bundle's own tokenizer/ is found
    assert (
        main(
            [
                "--json",
                "eval",
                "perplexity",
                str(out),
                "--text",
                str(calib),
                "--reference",
                str(model_dir),
                "--window",
                "32",
            ]
        )
        == 0
    )


def test_eval_perplexity_names_a_missing_text(tmp_path, capsys) -> None:
    from coreai_torch.cli.main import main

    assert main(["eval", "perplexity", str(tmp_path), "--text", str(tmp_path / "none.txt")]) == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize(
    "config",
    [
        compression.LinearQuantization(bits=4, block_size=32, min_elements=0),
        compression.LinearQuantization(bits=4, block_size=32, symmetric=False, min_elements=0),
        compression.LinearQuantization(bits=8, min_elements=0),
        compression.Palettization(bits=3, group_size=16, min_elements=0),
    ],
)
def test_rtn_calibration_stores_the_data_free_codes_and_measures_them(config) -> None:
    """``calibrate(method="rtn")`` fits what ``compress()`` fits without data (the program's
    outputs are the same), and measures its output error; GPTQ's is smaller."""
    from coreai_torch import TorchConverter, get_decomp_table

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)).eval()
    x = _inputs(256, 64, seed=7)
    ep = torch.export.export(model, (x[:8],)).run_decompositions(get_decomp_table())

    def run(calibration) -> np.ndarray:
        program = TorchConverter().add_exported_program(ep).to_coreai()
        program.compress(config, calibration=calibration)
        return next(iter(run_program(program, {"input": x[:8].numpy()}).values()))

    rtn = compression.calibrate(model, x, config, method="rtn")
    np.testing.assert_allclose(run(rtn), run(None), rtol=1e-5, atol=1e-5)
    gptq = compression.calibrate(model, x, config)
    assert rtn.output_error is not None and gptq.output_error is not None
    assert gptq.output_error < rtn.output_error
    expected = model(x[:8]).detach()
    with torch.no_grad():
        fitted = _fake_quantized(model, gptq)(x[:8])
    np.testing.assert_allclose(run(gptq), fitted.numpy(), rtol=1e-4, atol=1e-4)
    assert float(((fitted - expected) ** 2).sum()) > 0


def test_eval_cosine_of_an_embedding_model(tmp_path) -> None:
    """``coreai-torch eval cosine`` compares a Core AI feature-extraction model's sentence
    embeddings with the PyTorch model's."""
    from coreai_torch.cli.main import main
    from coreai_torch.hf.feature_extraction import CoreAIModelForFeatureExtraction
    from coreai_torch.llm.evaluate import cosine
    from tests.hf.test_feature_extraction import SENTENCES, save

    model, _, directory = save("bert", tmp_path)
    exported = CoreAIModelForFeatureExtraction.from_pretrained(directory, export=True)
    exported.save_pretrained(tmp_path / "coreai")
    exported.close()
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(SENTENCES))
    result = cosine(tmp_path / "coreai", texts, reference=model)
    assert len(result.values) == len(SENTENCES) and result.minimum > 0.999
    argv = ["eval", "cosine", str(tmp_path / "coreai"), "--text", str(texts)]
    assert main(["--json", *argv, "--reference", str(directory)]) == 0


@pytest.mark.parametrize(
    "config",
    [
        compression.LinearQuantization(bits=4, block_size=8, min_elements=0),
        compression.Palettization(bits=3, group_size=8, min_elements=0),
    ],
)
def test_calibrated_convolutions(config) -> None:
    """Convolution kernels are fitted on their unfolded inputs (a block spans
    ``block_size × kh × kw``); the program computes the fitted model."""
    from coreai_torch import TorchConverter, get_decomp_table

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 16, 3, stride=2)
    ).eval()
    x = torch.randn(8, 16, 12, 12)
    x[:, :2] *= 6
    ep = torch.export.export(model, (x[:2],)).run_decompositions(get_decomp_table())
    gptq = compression.calibrate(model, x, config)
    rtn = compression.calibrate(model, x, config, method="rtn")
    assert set(gptq.weights) == {"0.weight", "2.weight"}
    assert gptq.output_error < rtn.output_error
    program = TorchConverter().add_exported_program(ep).to_coreai()
    report = program.compress(config, calibration=gptq)
    assert {w.reader for w in report.weights} == {"convolution"}
    out = next(iter(run_program(program, {"input": x[:2].numpy()}).values()))
    with torch.no_grad():
        expected = _fake_quantized(model, gptq)(x[:2])
    np.testing.assert_allclose(out, expected.numpy(), rtol=1e-4, atol=1e-4)


def test_a_layer_with_too_many_inputs_for_a_hessian_is_named(monkeypatch) -> None:
    from coreai_torch.compression import calibration as calibrate_module

    monkeypatch.setattr(calibrate_module, "MAX_HESSIAN_INPUTS", 50)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16))
    config = compression.LinearQuantization(bits=4, block_size=16, min_elements=0)
    calibration = compression.calibrate(model, torch.randn(32, 64), config)
    assert list(calibration.weights) == ["2.weight"]
    ((name, reason),) = calibration.unfitted
    assert name == "0.weight" and "64 inputs per output channel exceed" in reason


@pytest.mark.parametrize("layers", [1, 5])
def test_sensitivity_pass_keeps_few_activations_and_equals_one_whole_backward(
    layers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mixed's output sensitivities: those of the block-by-block pass (activations kept every
    ⌈√blocks⌉ blocks, the others recomputed) equal those of one backward pass through the
    whole model with the same labels; the blocks run forward once, then again for all but
    each segment's last block."""
    from coreai_torch.compression import calibration as cal

    model = causal_lm("smollm", num_hidden_layers=layers)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=g)
    found = cal._layers(model)
    calls = cal.as_batches({"input_ids": ids, "use_cache": False})
    forwards: list[int] = []
    run_block = cal._forward_block
    monkeypatch.setattr(cal, "_forward_block", lambda b, s: forwards.append(1) or run_block(b, s))
    fisher = cal._fisher(model, calls, found)
    if layers == 1:  # no list of blocks: one backward through the model (it used to fail)
        assert cal.find_blocks(model) is None and not forwards
    else:  # the first forward pass, then again all but each segment's last block
        step = cal.segment_length(layers)
        assert step == 3
        assert len(forwards) == layers + layers - -(-layers // step)

    expected: dict[str, torch.Tensor] = {}
    generator = torch.Generator().manual_seed(cal.FISHER_SEED)
    modules = {layer.name: layer.module for layer in found.values()}
    with cal._output_gradients(modules, found, expected):
        for args, kwargs in cal._per_sample(calls):
            out = cal._output_tensor(model(*args, **kwargs))
            cal._divergence(out, model.config.vocab_size, generator).backward()
    model.zero_grad()
    reached = {name for name in expected if name in fisher.outputs}
    assert len(reached) == len(found)  # the tied head under the embedding's name
    for name in reached:
        torch.testing.assert_close(fisher.outputs[name], expected[name], rtol=1e-4, atol=1e-9)


def test_a_blocks_layers_are_fitted_in_order_on_the_inputs_of_those_fitted_before() -> None:
    """GPTQ's true-sequential order: a block's layers are fitted a group sharing an input at
    a time (q/k/v, o, gate/up, down), and a group's Hessians are those of its inputs with
    the layers before it fitted (here: attention's projections halved, which o_proj sees)."""
    import copy

    from coreai_torch import progress
    from coreai_torch.compression import calibration as cal

    model = causal_lm("smollm")
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator())
    calls = cal.as_batches({"input_ids": ids, "use_cache": False})
    projections = ("q_proj.weight", "k_proj.weight", "v_proj.weight")
    order: list[str] = []
    hessians: dict[str, torch.Tensor] = {}

    def fit(layer: Any, weight: torch.Tensor, h: Any) -> torch.Tensor | None:
        order.append(layer.name)
        hessians[layer.name] = h.matrix.clone()
        return weight * 0.5 if layer.name.endswith(projections) else None

    listener = progress.resolve(None)
    cal._walk(model, calls, cal._layers(model), fit, listener, "test", measure=False)
    first = "model.layers.0."
    local = ["self_attn." + p for p in (*projections, "o_proj.weight")]
    local += ["mlp." + p for p in ("gate_proj.weight", "up_proj.weight", "down_proj.weight")]
    assert [n for n in order if n.startswith(first)] == [first + n for n in local]

    twin = copy.deepcopy(model)
    attention = twin.model.layers[0].self_attn
    inputs: list[torch.Tensor] = []
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            getattr(attention, name).weight.mul_(0.5)
        attention.o_proj.register_forward_pre_hook(lambda m, a: inputs.append(a[0]))
        twin(ids, use_cache=False)
    x = torch.cat(inputs).reshape(-1, model.config.hidden_size)
    found = hessians[first + "self_attn.o_proj.weight"]
    torch.testing.assert_close(found, (x.T @ x).double(), rtol=1e-5, atol=1e-6)
    # without the order, o_proj's inputs are the float attention's
    hessians.clear()
    cal._walk(
        model, calls, cal._layers(model), fit, listener, "test", measure=False, sequential=False
    )
    assert not torch.allclose(hessians[first + "self_attn.o_proj.weight"], found, rtol=1e-3)


def test_a_tied_heads_sensitivity_looks_up_the_whole_table_inside_the_walk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sensitivity of a tied head's forms counts the lookups in the table they move; the
    walk reads only the looked-up rows of the table (its lookups remapped to them), and the
    score, which looks up in the whole table, is the same inside the walk as outside it."""
    from coreai_torch.compression import calibration as cal

    model = causal_lm("smollm")
    assert model.config.tie_word_embeddings
    ids = torch.randint(
        model.config.vocab_size // 2,
        model.config.vocab_size,
        (2, 12),
        generator=torch.Generator().manual_seed(0),
    )
    calls = cal.as_batches({"input_ids": ids, "use_cache": False})
    forms = (compression.LinearQuantization(bits=8), compression.Palettization(bits=2))
    config = compression.Mixed(target_bpw=6.0, forms=forms, min_elements=0)
    recorded: list[tuple[Any, ...]] = []
    score = cal._Fisher.score

    def spied(self: Any, layer: Any, d: torch.Tensor, h: Any) -> float | None:
        value = score(self, layer, d, h)
        if layer.aliases:
            recorded.append((self, layer, d.clone(), h, value))
        return value

    monkeypatch.setattr(cal._Fisher, "score", spied)
    cal._sensitivity(model, calls, cal._layers(model), config, torch.float32, None)
    assert len(recorded) == len(forms)
    for fisher, layer, d, h, value in recorded:
        assert value == pytest.approx(score(fisher, layer, d, h), rel=1e-9)
        # the lookups' term is counted (it was not: the tied name was looked for among the
        # aliases only)
        untied = dataclasses.replace(layer, aliases=())
        assert value > score(fisher, untied, d, h) * 1.01


def test_the_snr_of_fitted_codes_reads_a_table_a_piece_of_rows_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The report's SNR of calibrated codes compares the weight with its codes a piece of
    rows at a time (the whole 128k-row table in float32, its dequantized copy and its error
    in float64 made the compress phase of the calibrated 1B export its peak), with the
    value of comparing them whole."""
    from coreai_torch.compression import apply
    from coreai_torch.ir.compressed import LinearCodes

    rng = np.random.default_rng(0)
    w = rng.standard_normal((1000, 64)).astype(np.float32)
    reads: list[int] = []
    for zero_point in (None, rng.integers(0, 16, (1000, 2)).astype(np.int32)):
        signed = zero_point is None
        codes = LinearCodes(
            rng.integers(-8, 8, (1000, 64)).astype(np.int8)
            if signed
            else rng.integers(0, 16, (1000, 64)).astype(np.uint8),
            4,
            rng.random((1000, 2)).astype(np.float32) * 0.3 + 0.01,
            zero_point,
            signed=signed,
        )
        whole = apply._snr_db(w, codes)
        reads.clear()

        class Rows:
            """A weight that gives rows only (as a streamed one does)."""

            shape = w.shape

            def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
                reads.append(index[0].stop - index[0].start)
                return w[index]

            def __array__(self, *args: object, **kwargs: object) -> np.ndarray:
                raise AssertionError("the whole weight was read")

        monkeypatch.setattr(apply, "SNR_ELEMENTS", 96 * 64)
        assert apply._snr_db(Rows(), codes) == pytest.approx(whole, rel=1e-12)
        assert sum(reads) == 1000 and max(reads) == 96
