"""Bit-packing of sub-byte integer codes, as Core AI stores them (coreai-opt's IR passes)."""

from __future__ import annotations

import numpy as np
import torch

from coreai_torch.ir.compressed import pack_bits

__all__ = ["pack_intx", "pack_uintx"]


def _codes(values: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu()
        values = values.to(torch.int16).numpy() if values.dtype == torch.bool else values.numpy()
    return np.ascontiguousarray(np.asarray(values)).astype(np.int64)


def _pack(values: torch.Tensor | np.ndarray, width: int, low: int, high: int) -> np.ndarray:
    if not 1 <= width <= 8:
        raise ValueError(f"sub-byte codes are 1 to 8 bits wide, got {width}")
    codes = _codes(values)
    if codes.size and (int(codes.min()) < low or int(codes.max()) > high):
        raise ValueError(
            f"{width}-bit codes must lie in [{low}, {high}], got [{int(codes.min())}, "
            f"{int(codes.max())}]"
        )
    return pack_bits((codes & ((1 << width) - 1)).astype(np.uint8), width)


def pack_intx(values: torch.Tensor | np.ndarray, width: int) -> np.ndarray:
    """Signed ``width``-bit codes packed LSB first, row-major (``ceil(n * width / 8)`` bytes)."""
    return _pack(values, width, -(1 << (width - 1)), (1 << (width - 1)) - 1)


def pack_uintx(values: torch.Tensor | np.ndarray, width: int) -> np.ndarray:
    """Unsigned ``width``-bit codes packed LSB first, row-major."""
    return _pack(values, width, 0, (1 << width) - 1)
