"""What ``compress()`` checks before it changes a weight
(``coreai_torch.compression.checks``): non-finite weights are refused (or kept uncompressed on
request), degenerate finite weights are reproduced exactly, scales that would overflow their
dtype are refused, and the report flags weights with a low SNR."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn as nn

from coreai_torch import compression
from coreai_torch.errors import NonFiniteWeightError
from coreai_torch.runtime import run_program
from coreai_torch.verify import VerifyReport
from tests.helpers import run_advice
from tests.test_compress import convert

N = 64
CONFIGS = {
    "int8": compression.LinearQuantization(bits=8, min_elements=0),
    "int4_blocks": compression.LinearQuantization(bits=4, block_size=32, min_elements=0),
    "uint8": compression.LinearQuantization(bits=8, symmetric=False, min_elements=0),
    "palette4": compression.Palettization(bits=4, min_elements=0),
    "palette2_groups": compression.Palettization(bits=2, group_size=16, min_elements=0),
}


def _model(weight: torch.Tensor, second: torch.Tensor | None = None) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(N, N), nn.Linear(N, N)).eval()
    with torch.no_grad():
        model[0].weight.copy_(weight)
        if second is not None:
            model[1].weight.copy_(second)
    return model


def _run(model: nn.Module, config: compression.CompressionConfig, x: torch.Tensor) -> tuple:
    program = convert(model, (x,))
    report = program.compress(config)
    (out,) = run_program(program, {"input": x}).values()
    return out, report


def _with(value: float, *positions: tuple[int, int]) -> torch.Tensor:
    torch.manual_seed(1)
    weight = torch.randn(N, N) * 0.1
    for row, column in positions:
        weight[row, column] = value
    return weight


@pytest.mark.parametrize("name", ["int8", "palette4"])
def test_non_finite_weights_are_refused_with_name_counts_and_positions(name: str) -> None:
    model = _model(_with(float("nan"), (5, 7), (9, 1)), _with(float("inf"), (0, 3)))
    program = convert(model, (torch.randn(2, N),))
    with pytest.raises(NonFiniteWeightError) as info:
        program.compress(CONFIGS[name])
    message = str(info.value)
    assert "2 weight(s) hold NaN or infinite values" in message
    assert "0.weight (64, 64): 2 NaN value(s) of 4096, at [5, 7], [9, 1]" in message
    assert "1.weight (64, 64): 1 infinite value(s) of 4096, at [0, 3]" in message
    assert "non_finite='keep'" in message
    # nothing was changed: the program still runs exactly as PyTorch does
    x = torch.randn(2, N)
    (out,) = run_program(program, {"input": x}).values()
    np.testing.assert_allclose(out, model(x).detach().numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["int8", "palette4"])
def test_non_finite_weights_can_be_kept_uncompressed(name: str) -> None:
    """The NaN stays in its own output channel, as in PyTorch (compressed, a palette built
    around it turned almost every output into NaN)."""
    nan_model = nn.Sequential(nn.Linear(N, N), nn.Linear(N, 8)).eval()
    torch.manual_seed(2)
    with torch.no_grad():
        nan_model[0].weight.copy_(_with(float("nan"), (5, 7)))
    x = torch.randn(3, N)
    config = dataclasses.replace(CONFIGS[name], non_finite="keep")
    program = convert(nan_model[0], (x,))
    report = program.compress(config)
    assert not report.weights
    assert report.skipped == [
        ("weight", "holds 1 NaN value(s) of 4096, at [5, 7]; kept as it is (non_finite='keep')")
    ]
    (out,) = run_program(program, {"input": x}).values()
    expected = nan_model[0](x).detach().numpy()
    np.testing.assert_array_equal(np.isnan(out), np.isnan(expected))
    assert np.isnan(out).sum() == 3  # column 5 of each row
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5, equal_nan=True)


DEGENERATE = {
    "zeros": lambda: torch.zeros(N, N),
    "constant": lambda: torch.full((N, N), 0.37),
    "negative_constant": lambda: torch.full((N, N), -2.5),
    "one_nonzero_row": lambda: torch.zeros(N, N).index_fill_(0, torch.tensor([3]), 1.5),
    "three_values": lambda: (torch.randint(-1, 2, (N, N)) * 0.5).float(),
}


@pytest.mark.parametrize(
    ("kind", "config"),
    # three values are not on asymmetric int8's grid (-0.5 is not a multiple of 1/255)
    [(k, c) for k in DEGENERATE for c in CONFIGS if (k, c) != ("three_values", "uint8")],
)
def test_degenerate_weights_are_reproduced_exactly(kind: str, config: str) -> None:
    torch.manual_seed(3)
    model = _model(DEGENERATE[kind](), torch.randn(N, N) * 0.1)
    x = torch.randn(3, N)
    out, report = _run(model, dataclasses.replace(CONFIGS[config], weights=r"^0\."), x)
    assert [w.name for w in report.weights] == ["0.weight"]
    assert report.weights[0].snr_db > 100 and not report.low_snr
    expected = model(x).detach().numpy()
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(out, expected, rtol=0, atol=2e-6 * scale)


def test_low_snr_weights_are_flagged() -> None:
    torch.manual_seed(4)
    model = _model(torch.randn(N, N), torch.randn(N, N))
    x = torch.randn(2, N)
    program = convert(model, (x,))
    report = program.compress(compression.Palettization(bits=1, min_elements=0))
    assert [w.name for w in report.low_snr] == ["0.weight", "1.weight"]
    assert all(3 < w.snr_db < 5 for w in report.weights)  # 1-bit palettes of N(0, 1): 4.4 dB
    text = str(report)
    assert text.count("  LOW") == 2
    assert "2 weight(s) below 10 dB SNR (LOW): 0.weight, 1.weight" in text
    (checked,) = run_advice(text, model=model, args=(x,), program=program)
    assert isinstance(checked, VerifyReport) and not checked.ok  # 1-bit weights: far off
    assert report.to_dict()["low_snr"] == ["0.weight", "1.weight"]
    _, report = _run(model, compression.Palettization(bits=1, min_elements=0, min_snr_db=None), x)
    assert not report.low_snr and "LOW" not in str(report)
    _, report = _run(model, compression.LinearQuantization(bits=8, min_elements=0), x)
    assert not report.low_snr  # int8: ~40 dB


def test_the_snr_of_tiny_and_huge_weights_is_measured() -> None:
    """Σw² left float32's range: the report said inf dB (1e-30 weights) or nan (1e30)."""
    for magnitude in (1e-30, 1e30):
        torch.manual_seed(5)
        model = _model(torch.randn(N, N) * magnitude)
        _, report = _run(model, CONFIGS["int8"], torch.randn(2, N))
        assert 40 < report.weights[0].snr_db < 50, (magnitude, report.weights[0].snr_db)


def test_scales_that_overflow_their_dtype_are_refused() -> None:
    model = _model(_with(1e6, (2, 2)))
    program = convert(model, (torch.randn(2, N),))
    config = compression.LinearQuantization(bits=4, min_elements=0, scale_dtype=torch.float16)
    with pytest.raises(
        ValueError,
        match=r"int4 scales of 0\.weight \(largest magnitude 1e\+06\) would exceed float16's "
        r"largest value 65504.*scale_dtype=torch\.float32",
    ):
        program.compress(config)


def test_options_are_validated() -> None:
    with pytest.raises(ValueError, match=r"non_finite= takes 'error'.*or 'keep'.*got 'ignore'"):
        compression.LinearQuantization(non_finite="ignore")
    with pytest.raises(TypeError, match=r"min_snr_db= takes a number of dB or None"):
        compression.Palettization(min_snr_db="10")  # type: ignore[arg-type]
