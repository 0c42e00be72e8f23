"""What ``AIProgram.compress()`` checks before it changes a weight.

A NaN or an infinity in a weight does not stay where it is once the weight is compressed: a
palette fitted around a NaN turns most of the weight's entries into NaN, and an infinite value
makes a quantization scale infinite (its whole block or channel becomes NaN).  So weights
holding non-finite values are refused before anything is changed
(:class:`~coreai_torch.errors.NonFiniteWeightError`, naming each weight, how many values and
where), or, with ``non_finite="keep"`` in the configuration, left uncompressed with the reason
in the report.

Degenerate finite weights (all zeros, constant, fewer distinct values than a palette has
entries) need nothing here: the fits reproduce them exactly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from coreai_torch.errors import NonFiniteWeightError
from coreai_torch.tensors import lazy

#: elements checked at a time (the bool mask of a chunk is what is held)
CHUNK_ELEMENTS = 1 << 24
#: positions shown per weight
SHOWN_POSITIONS = 5


def non_finite(tensor: torch.Tensor) -> tuple[int, int, list[tuple[int, ...]]]:
    """``(NaN count, infinity count, first positions)`` of ``tensor``'s non-finite values,
    read in chunks of rows."""
    flat = tensor.detach().reshape(-1) if tensor.is_contiguous() else None
    nan = inf = 0
    positions: list[tuple[int, ...]] = []
    total = tensor.numel()
    for start in range(0, total, CHUNK_ELEMENTS):
        if flat is not None:
            chunk = flat[start : start + CHUNK_ELEMENTS]
        else:
            chunk = tensor.detach().reshape(-1)[start : start + CHUNK_ELEMENTS]
        finite = torch.isfinite(chunk)
        if bool(finite.all()):
            continue
        bad = (~finite).nonzero().reshape(-1)
        nans = int(torch.isnan(chunk[bad]).sum())
        nan += nans
        inf += bad.numel() - nans
        for index in bad[: max(0, SHOWN_POSITIONS - len(positions))].tolist():
            positions.append(tuple(int(i) for i in _unravel(start + index, tensor.shape)))
    return nan, inf, positions


def _unravel(index: int, shape: torch.Size) -> list[int]:
    out = []
    for size in reversed(shape):
        out.append(index % size)
        index //= size
    return out[::-1]


def _describe(name: str, tensor: torch.Tensor, nan: int, inf: int, positions: list) -> str:
    counts = ", ".join(
        text for count, text in ((nan, f"{nan} NaN"), (inf, f"{inf} infinite")) if count
    )
    shown = ", ".join(str(list(p)) for p in positions)
    more = ", ..." if nan + inf > len(positions) else ""
    return f"{name} {tuple(tensor.shape)}: {counts} value(s) of {tensor.numel()}, at {shown}{more}"


def check_finite(
    weights: Iterable[tuple[str, torch.Tensor]], non_finite_policy: str
) -> dict[str, str]:
    """The ``(name, tensor)`` weights holding NaN or infinite values, each with the reason the
    report gives for leaving it uncompressed (``non_finite_policy="keep"``); with ``"error"``
    (the default) raises :class:`NonFiniteWeightError` listing every such weight instead."""
    found: dict[str, str] = {}
    for name, tensor in weights:
        if lazy.is_lazy(tensor):  # read once for its statistics; again only if it has any
            stats = lazy.statistics(tensor)
            if not stats.nan and not stats.inf:
                continue
            tensor = lazy.materialize(tensor)
        nan, inf, positions = non_finite(tensor)
        if nan or inf:
            found[name] = _describe(name, tensor, nan, inf, positions)
    if found and non_finite_policy == "error":
        listed = "\n".join(f"  - {text}" for text in found.values())
        raise NonFiniteWeightError(
            f"compress(): {len(found)} weight(s) hold NaN or infinite values, which compression "
            "would spread over their channel, block or palette (PyTorch keeps them where they "
            f"are):\n{listed}\nFix the weights (a NaN usually comes from training or loading), "
            "or keep these weights uncompressed with non_finite='keep' in the configuration "
            "(e.g. LinearQuantization(..., non_finite='keep'))."
        )
    return {
        name: f"holds {text.split(': ', 1)[1]}; kept as it is (non_finite='keep')"
        for name, text in found.items()
    }


def check_scale_range(
    weights: Iterable[tuple[str, torch.Tensor]],
    bits: int,
    symmetric: bool,
    scale_dtype: torch.dtype | None,
) -> None:
    """``ValueError`` for weights whose quantization scales would overflow ``scale_dtype``
    (the block would decompress to NaN: ``0 * inf``)."""
    if scale_dtype is None or scale_dtype == torch.float32:
        return
    high = (1 << (bits - 1)) - 1 if symmetric else (1 << bits) - 1
    limit = torch.finfo(scale_dtype).max * high / (1 if symmetric else 2)
    found = []
    for name, tensor in weights:
        if lazy.is_lazy(tensor):
            stats = lazy.statistics(tensor)
            largest = math.inf if stats.inf else stats.finite_peak
        else:
            largest = float(tensor.detach().abs().amax()) if tensor.numel() else 0.0
        if largest > limit:
            found.append(f"{name} (largest magnitude {largest:.4g})")
    if found:
        kind = str(scale_dtype).removeprefix("torch.")
        raise ValueError(
            f"compress(): the int{bits} scales of {', '.join(found)} would exceed {kind}'s "
            f"largest value {torch.finfo(scale_dtype).max:.6g} (weights above {limit:.4g} "
            f"cannot be scaled in {kind}) and decompress to NaN; use scale_dtype=torch.float32 "
            "or torch.bfloat16, or leave these weights out (weights=...)"
        )
