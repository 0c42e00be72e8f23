"""Custom Metal kernels: ``TorchMetalKernel`` and ``MetalParameter``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from coreai_torch.errors import ConversionError


def register_kernels(converter: Any, kernels: Sequence[Any]) -> None:
    raise ConversionError("custom Metal kernels are not supported yet")
