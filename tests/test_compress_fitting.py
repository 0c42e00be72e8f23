"""Linear quantization's fitting (``compression.fitting.quantize_linear``) gives the codes,
scales and zero points of the per-block formulas computed on the whole weight at once, bit for
bit, whatever the weight's layout (contiguous, transposed, strided), the size of its steps and
the number of threads fitting them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from coreai_torch.compression import fitting

#: (shape, parameters' shape): rows, columns, blocks along either axis, experts, per tensor
SHAPES = [
    ((64, 256), (64, 8)),
    ((256, 96), (8, 96)),
    ((5, 64, 96), (5, 64, 3)),
    ((3, 96, 32), (3, 3, 32)),
    ((48, 64), (1, 1)),
    ((33, 64), (33, 1)),
]


def _reference(
    weight: np.ndarray, params: tuple[int, ...], bits: int, symmetric: bool, dtype: torch.dtype
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The documented formulas, on the whole weight."""
    w = torch.from_numpy(np.ascontiguousarray(weight))
    split: list[int] = []
    for size, blocks in zip(w.shape, params, strict=True):
        split += [blocks, size // blocks]
    inner = tuple(range(1, 2 * w.dim(), 2))
    blocks = w.reshape(split)
    if symmetric:
        high = (1 << (bits - 1)) - 1
        scale = blocks.abs().amax(dim=inner, keepdim=True) / high
    else:
        high = (1 << bits) - 1
        low = blocks.amin(dim=inner, keepdim=True).clamp(max=0)
        scale = (blocks.amax(dim=inner, keepdim=True).clamp(min=0) - low) / high
    scale = scale.to(dtype).float()
    scale[scale == 0] = 1.0
    codes = torch.round(blocks / scale)
    zero_point = None
    if symmetric:
        codes = codes.clamp(-high - 1, high).to(torch.int8)
    else:
        zero_point = torch.round(-low / scale).clamp(0, high)
        codes = (codes + zero_point).clamp(0, high).to(torch.uint8)
        zero_point = zero_point.reshape(params).to(torch.int32).numpy()
    return codes.reshape(w.shape).numpy(), scale.reshape(params).numpy(), zero_point


def _layouts(weight: np.ndarray) -> dict[str, np.ndarray]:
    """The same values as a contiguous array, a transposed view and a strided view."""
    transposed = np.ascontiguousarray(np.moveaxis(weight, -1, 0))
    wide = np.zeros((*weight.shape[:-1], 2 * weight.shape[-1]), np.float32)
    wide[..., ::2] = weight
    return {
        "contiguous": weight,
        "transposed": np.moveaxis(transposed, 0, -1),
        "strided": wide[..., ::2],
    }


@pytest.mark.parametrize(("shape", "params"), SHAPES)
@pytest.mark.parametrize(("bits", "symmetric"), [(4, True), (8, True), (4, False), (3, True)])
@pytest.mark.parametrize("threads", [1, 2])
def test_quantize_linear_matches_the_formulas_in_every_layout_and_step(
    monkeypatch: pytest.MonkeyPatch,
    shape: tuple[int, ...],
    params: tuple[int, ...],
    bits: int,
    symmetric: bool,
    threads: int,
) -> None:
    torch.manual_seed(bits)
    weight = torch.randn(shape) * torch.rand(shape[0], *[1] * (len(shape) - 1)) ** 4
    weight[0] = 0  # all-zero blocks
    weight[1] *= 1e-7  # scales below float16's range
    weight = weight.numpy()
    monkeypatch.setattr(fitting, "LINEAR_CHUNK", 1000)  # many steps, a row or two each
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            codes, scale, zero_point = _reference(weight, params, bits, symmetric, dtype)
            for layout, view in _layouts(weight).items():
                fitted, snr = fitting.quantize_linear(
                    view, params, bits, symmetric=symmetric, scale_dtype=dtype
                )
                np.testing.assert_array_equal(fitted.codes, codes, err_msg=layout)
                np.testing.assert_array_equal(fitted.scale, scale, err_msg=layout)
                if zero_point is None:
                    assert fitted.zero_point is None
                else:
                    np.testing.assert_array_equal(fitted.zero_point, zero_point, err_msg=layout)
                assert snr > 0
    finally:
        torch.set_num_threads(before)


def test_an_error_in_a_fitting_thread_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken:
        shape, ndim = (64, 64), 2

        def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
            if index[0].start >= 32:
                raise OSError("the checkpoint went away")
            return np.ones((index[0].stop - index[0].start, 64), np.float32)

    monkeypatch.setattr(fitting, "LINEAR_CHUNK", 256)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(OSError, match="went away"):
            fitting.quantize_linear(Broken(), (64, 2), 4)  # type: ignore[arg-type]
    finally:
        torch.set_num_threads(before)
