"""``wrap_for_parametrization``: a decompression module as a weight parametrization."""

from __future__ import annotations

import functools
from typing import Any, TypeVar

import torch
from torch import nn

__all__ = ["wrap_for_parametrization"]

M = TypeVar("M", bound=nn.Module)


@functools.cache
def wrap_for_parametrization(cls: type[M]) -> type[M]:
    """A subclass of ``cls`` (same constructor) usable as a ``torch.nn.utils.parametrize``
    parametrization: ``forward(original)`` ignores ``original`` (the placeholder or dense
    tensor the parametrized weight keeps) and returns the decompressed weight."""

    def forward(self: nn.Module, original: torch.Tensor | None = None, *_: Any) -> torch.Tensor:
        return cls.forward(self)

    name = f"{cls.__name__}Parametrization"
    wrapped = type(
        name,
        (cls,),
        {"forward": forward, "__module__": __name__, "__qualname__": name, "__doc__": cls.__doc__},
    )
    globals().setdefault(name, wrapped)  # picklable by name (torch.save of a finalized model)
    return wrapped


def _predefine() -> None:
    """The parametrizations of the weight modules exist from import on (unpickling)."""
    from coreai_torch._compression import custom_layers

    for cls in (
        custom_layers.PalettizeModule,
        custom_layers.ScaledPalettizeModule,
        custom_layers.WeightDequantizeModule,
        custom_layers.SparseModule,
    ):
        wrap_for_parametrization(cls)


_predefine()
