"""Resampling on the runtime vs eager PyTorch: interpolate in every mode (nearest,
nearest-exact, (bi/tri)linear with and without align_corners, bicubic, antialias, area),
by size and by scale factor, and grid_sample."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.lowerings.support import check_fn, fast_first


def _interpolations(mode: str, x: torch.Tensor, **kw: object) -> list[torch.Tensor]:
    k = x.dim() - 2
    return [
        F.interpolate(x, scale_factor=2, mode=mode, **kw),
        F.interpolate(x, scale_factor=0.5, mode=mode, **kw),
        F.interpolate(x, scale_factor=1.7, mode=mode, **kw),
        F.interpolate(x, size=(7, 5, 3)[:k], mode=mode, **kw),
        F.interpolate(x, size=(2, 9, 1)[:k], mode=mode, **kw),
    ]


@pytest.mark.parametrize("dtype", fast_first(torch.float32, torch.int64))
def test_nearest(dtype: torch.dtype) -> None:
    def f(x1, x2, x3):
        return [
            y
            for mode in ("nearest", "nearest-exact")
            for x in (x1, x2, x3)
            for y in _interpolations(mode, x)
        ]

    if dtype.is_floating_point:
        check_fn(f, torch.randn(1, 2, 6), torch.randn(1, 2, 4, 6), torch.randn(1, 1, 4, 4, 6))
    else:  # PyTorch has integer nearest kernels for uint8 2-D only
        x = torch.randint(0, 200, (1, 2, 4, 6)).to(torch.uint8)
        check_fn(lambda x: [F.interpolate(x, scale_factor=2), F.interpolate(x, size=(3, 5))], x)


@pytest.mark.parametrize("align_corners", fast_first(False, True))
def test_linear_modes(align_corners: bool) -> None:
    def f(x1, x2, x3):
        out = _interpolations("linear", x1, align_corners=align_corners)
        out += _interpolations("bilinear", x2, align_corners=align_corners)
        out += _interpolations("trilinear", x3, align_corners=align_corners)
        return out

    check_fn(f, torch.randn(1, 2, 6), torch.randn(2, 2, 4, 6), torch.randn(1, 1, 4, 4, 6))


@pytest.mark.slow
def test_bilinear_float16() -> None:
    check_fn(
        lambda x: _interpolations("bilinear", x),
        torch.randn(1, 2, 4, 6, dtype=torch.float16),
        atol=1e-2,
        rtol=1e-2,
    )


@pytest.mark.parametrize("align_corners", fast_first(False, True))
def test_bicubic_antialias_area(align_corners: bool) -> None:
    def f(x):
        out = _interpolations("bicubic", x, align_corners=align_corners)
        out += [
            F.interpolate(
                x, size=(3, 4), mode="bilinear", antialias=True, align_corners=align_corners
            )
        ]
        out += [
            F.interpolate(
                x, size=(5, 2), mode="bicubic", antialias=True, align_corners=align_corners
            )
        ]
        out += [
            F.interpolate(x, size=(3, 4), mode="area"),
            F.interpolate(x, scale_factor=0.5, mode="area"),
        ]
        return out

    check_fn(f, torch.randn(1, 2, 8, 7))


@pytest.mark.parametrize("align_corners", fast_first(False, True))
def test_grid_sample(align_corners: bool) -> None:
    def f(x, g, x3, g3):
        outs = []
        for mode in ("bilinear", "nearest", "bicubic"):
            for padding_mode in ("zeros", "border", "reflection"):
                kw = dict(mode=mode, padding_mode=padding_mode, align_corners=align_corners)
                outs.append(F.grid_sample(x, g, **kw))
                if mode != "bicubic":  # PyTorch has no 3-D bicubic sampling
                    outs.append(F.grid_sample(x3, g3, **kw))
        return outs

    grid = torch.rand(2, 3, 5, 2) * 2.6 - 1.3  # some points outside [-1, 1]
    grid3 = torch.rand(1, 2, 3, 2, 3) * 2.6 - 1.3
    check_fn(f, torch.randn(2, 3, 4, 6), grid, torch.randn(1, 2, 3, 4, 5), grid3)


def test_pixel_unshuffle() -> None:
    check_fn(lambda x: (F.pixel_unshuffle(x, 2), F.pixel_unshuffle(x, 1)), torch.randn(1, 2, 4, 6))
