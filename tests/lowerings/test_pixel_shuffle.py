"""``pixel_shuffle`` on the Core AI runtime vs eager PyTorch (the ``pixel_shuffle`` composite op
and its inline form): upscale factors, batch dims, dtypes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from coreai_torch import TorchConverter
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.verify import verify
from tests.lowerings.support import Fn, check_fn, rand

#: (input shape, upscale factor): 2x, 3x, batch dims, factor 1
CASES = [((1, 4, 3, 5), 2), ((2, 18, 2, 2), 3), ((3, 2, 8, 2, 2), 2), ((4, 1, 1), 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32])
def test_pixel_shuffle(dtype: torch.dtype) -> None:
    def f(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(F.pixel_shuffle(x, factor) for x, (_, factor) in zip(xs, CASES, strict=True))

    check_fn(f, *(rand(*shape, dtype=dtype) for shape, _ in CASES), atol=0, rtol=0)


def test_pixel_shuffle_inline_without_composites() -> None:
    model, args = Fn(lambda x: F.pixel_shuffle(x, 2)).eval(), (torch.randn(2, 8, 3, 3),)
    program = TorchConverter(aten_composites=False).add_exported_program(
        export_decomposed(model, args)
    )
    converted = program.to_coreai()
    assert "composite" not in str(converted)
    assert verify(model, args, program=converted.optimize(), atol=0, rtol=0).ok
