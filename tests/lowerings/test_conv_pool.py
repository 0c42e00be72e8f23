"""Convolution and pooling on the runtime vs eager PyTorch: conv 1/2/3-D (stride, padding,
dilation, groups, transposed with output_padding), max pool (+indices), avg pool (ceil_mode,
count_include_pad, divisor_override), adaptive avg/max pool."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.helpers import check_module
from tests.lowerings.support import Fn, check_fn, fast_first

CONV2D = [
    dict(kernel_size=3),
    dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=(3, 2), dilation=(2, 1), padding=(2, 0)),
    dict(kernel_size=1, groups=2),
    dict(kernel_size=3, groups=4, padding="same", bias=False),  # depthwise
]


@pytest.mark.parametrize("dtype", fast_first(torch.float32, torch.float16))
def test_conv2d(dtype: torch.dtype) -> None:
    convs = nn.ModuleList(nn.Conv2d(4, 4, **kw) for kw in CONV2D).to(dtype).eval()
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    check_module(
        Fn(lambda x: [c(x) for c in convs]).to(dtype),
        (torch.randn(2, 4, 7, 8, dtype=dtype),),
        **tol,
    )


def test_conv1d_3d_transposed() -> None:
    c1 = nn.Conv1d(3, 4, 3, stride=2, padding=2, dilation=2)
    c1g = nn.Conv1d(4, 4, 2, groups=2)
    c3 = nn.Conv3d(2, 3, (2, 3, 3), stride=(1, 2, 1), padding=1)
    t1 = nn.ConvTranspose1d(3, 2, 3, stride=2, padding=1, output_padding=1)
    t2 = nn.ConvTranspose2d(
        4,
        6,
        (3, 2),
        stride=(2, 3),
        padding=(1, 0),
        output_padding=(1, 2),
        groups=2,
        dilation=(1, 2),
    )
    t3 = nn.ConvTranspose3d(2, 2, 2, stride=2)
    mod = Fn(lambda a, b, c, d: (c1(a), c1g(c1(a)), c3(b), c1(a[0]), t1(a), t2(c), t3(d)))
    mod.convs = nn.ModuleList([c1, c1g, c3, t1, t2, t3])
    args = (torch.randn(2, 3, 9), torch.randn(1, 2, 4, 6, 5), torch.randn(1, 4, 5, 4))
    check_module(mod.eval(), (*args, torch.randn(1, 2, 3, 2, 3)))


MAXPOOL = [
    dict(kernel_size=2),
    dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=3, stride=2, ceil_mode=True),
    dict(kernel_size=(2, 3), stride=1, dilation=(2, 1), padding=(1, 1)),
    dict(kernel_size=3, stride=2, padding=1, ceil_mode=True),
]


@pytest.mark.parametrize("dtype", fast_first(torch.float32, torch.int64))
def test_max_pool2d(dtype: torch.dtype) -> None:
    def f(x):
        outs = [F.max_pool2d(x, **kw) for kw in MAXPOOL] + [F.max_pool2d(x[0], 2)]
        return outs + [F.max_pool1d(x[0], 2)] if x.is_floating_point() else outs

    x = (
        torch.randn(1, 2, 7, 6)
        if dtype.is_floating_point
        else torch.randperm(84).reshape(1, 2, 7, 6)
    )
    check_fn(f, x.to(dtype))


def test_max_pool_indices_and_3d() -> None:
    def f(x, x3):
        outs = []
        for kw in MAXPOOL:
            outs += F.max_pool2d(x, return_indices=True, **kw)
        outs += F.max_pool1d(x[0], 3, 2, 1, return_indices=True)
        outs += F.max_pool3d(x3, 2, ceil_mode=True, return_indices=True)
        v, i = F.max_pool2d(x, 2, return_indices=True)
        outs.append(F.max_unpool2d(v, i, 2))
        outs += [
            F.max_pool3d(x3, 2),
            F.max_pool3d(x3, 3, 2, 1),
            F.max_pool3d(x3, (1, 2, 3), ceil_mode=True),
        ]
        return outs

    check_fn(f, torch.randn(1, 2, 7, 6), torch.randn(1, 2, 5, 6, 7))


AVGPOOL = [
    dict(kernel_size=2),
    dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=3, stride=2, padding=1, count_include_pad=False),
    dict(kernel_size=3, stride=2, ceil_mode=True),
    dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
    dict(kernel_size=3, stride=2, padding=1, ceil_mode=True),
    dict(kernel_size=(2, 3), padding=(1, 0), divisor_override=4),
]


def test_integer_conv_avg_pool() -> None:
    def f(x, w):
        return (
            F.conv2d(x, w, padding=1),
            F.conv_transpose2d(x, w, stride=2),
            F.avg_pool2d(x, 2),
            F.avg_pool2d(x, 3, 2, 1, count_include_pad=False),
        )

    check_fn(f, torch.randint(-9, 9, (1, 2, 5, 6)), torch.randint(-3, 3, (2, 2, 3, 3)))


def test_avg_pool() -> None:
    def f(x, x3):
        outs = [F.avg_pool2d(x, **kw) for kw in AVGPOOL]
        outs += [F.avg_pool1d(x[0], 3, 2, 1), F.avg_pool2d(x[0], 2)]
        outs += [
            F.avg_pool3d(x3, 2),
            F.avg_pool3d(x3, 3, 2, 1, ceil_mode=True, count_include_pad=False),
        ]
        return outs

    check_fn(f, torch.randn(1, 2, 7, 6), torch.randn(1, 2, 5, 4, 6))


def test_adaptive_pools() -> None:
    def f(x, x3, v):
        return (
            F.adaptive_avg_pool2d(x, 1),
            F.adaptive_avg_pool2d(x, (3, 2)),  # divisible
            F.adaptive_avg_pool2d(x, (4, 5)),  # overlapping windows
            F.adaptive_avg_pool2d(x, (None, 3)),
            F.adaptive_avg_pool1d(v, 4),
            F.adaptive_avg_pool3d(x3, (2, 3, 1)),
            F.adaptive_avg_pool3d(x3, 1),
            F.adaptive_max_pool2d(x, (3, 2)),
            *F.adaptive_max_pool2d(x, (4, 5), return_indices=True),
            F.adaptive_max_pool1d(v, 3),
            *F.adaptive_max_pool3d(x3, (2, 3, 2), return_indices=True),
        )

    check_fn(f, torch.randn(2, 3, 6, 6), torch.randn(1, 2, 4, 5, 6), torch.randn(1, 3, 7))


@pytest.mark.slow
@pytest.mark.parametrize("kw", MAXPOOL + [dict(kernel_size=4, stride=3, padding=2, ceil_mode=True)])
@pytest.mark.parametrize("size", [(5, 5), (8, 7), (9, 10)])
def test_pool_sweep(kw: dict, size: tuple[int, int]) -> None:
    avg = {k: v for k, v in kw.items() if k != "dilation"}

    def f(x):
        return (
            *F.max_pool2d(x, return_indices=True, **kw),
            F.avg_pool2d(x, **avg),
            F.avg_pool2d(x, count_include_pad=False, **avg),
        )

    check_fn(f, torch.randn(1, 2, *size))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision(dtype: torch.dtype) -> None:
    def f(x, g):
        w = torch.ones(2, 2, 3, 3, dtype=x.dtype) * 0.1
        return (
            F.conv2d(x, w, padding=1),
            F.conv_transpose2d(x, w, stride=2),
            F.max_pool2d(x, 2),
            F.avg_pool2d(x, 3, 2, 1),
            F.adaptive_avg_pool2d(x, (3, 5)),
            F.interpolate(x, scale_factor=2, mode="bilinear"),
            F.interpolate(x, scale_factor=2, mode="bicubic"),
            F.interpolate(x, scale_factor=2),
            F.pad(x, (1, 1, 1, 1), mode="reflect"),
            F.grid_sample(x, g, align_corners=False),
            x[:, :, torch.tensor([0, 2])],
            x.scatter_add(3, torch.zeros(1, 2, 4, 2, dtype=torch.long), x[..., :2]),
        )

    check_fn(
        f, torch.randn(1, 2, 4, 6).to(dtype), torch.rand(1, 3, 3, 2).to(dtype), atol=3e-2, rtol=3e-2
    )
