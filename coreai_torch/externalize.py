"""Externalization: marked submodules become private graphs called with ``coreai.invoke``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from coreai_torch.errors import ConversionError


@dataclass
class ExternalizeSpec:
    """Which submodule class to externalize, and as which composite op.

    ``target_class``: the ``nn.Module`` subclass to match (every instance is externalized).
    ``composite_op_name``: if set, the graph is marked as this named composite op.
    ``composite_attrs``: instance attribute names recorded as the composite op's attributes.
    """

    target_class: type
    composite_op_name: str | None = None
    composite_attrs: list[str] | None = None


@contextmanager
def prepare_externalization(module: nn.Module, specs: list | None) -> Iterator[list[Any]]:
    """Validate ``externalize_modules`` and yield the externalization plan for ``export_fn``."""
    if not specs:
        yield []
        return
    raise ConversionError("externalize_modules is not supported yet")


def import_externalized(builder: Any, staged: Any, lowerings: Any) -> None:
    raise ConversionError("externalize_modules is not supported yet")
