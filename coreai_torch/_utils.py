"""The import path the guides give for operand access in user lowerings
(``from coreai_torch._utils import get_operand, get_operands``); both live in, and are public
from, :mod:`coreai_torch.lowerings`."""

from __future__ import annotations

from coreai_torch.lowerings.registry import get_operand, get_operands

__all__ = ["get_operand", "get_operands"]
