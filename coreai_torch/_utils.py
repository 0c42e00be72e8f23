"""Operand access for lowering functions (``register_torch_lowering`` callbacks).

``get_operand(values_map, node, index, loc)`` returns the Core AI value of ``node.args[index]``:
the value of an FX node, or a constant for a Python scalar, typed like the tensors it meets
(a ``0.5`` next to ``float16`` tensors becomes a ``float16`` constant).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.fx

from coreai_torch import dtypes
from coreai_torch._mlir import cai, ir
from coreai_torch.errors import LoweringError
from coreai_torch.locations import describe


def _scalar_dtype(node: torch.fx.Node, value: bool | int | float) -> torch.dtype:
    """The dtype a Python scalar operand should take inside ``node``."""
    tensor_dtypes = [
        a.meta["val"].dtype
        for a in node.all_input_nodes
        if isinstance(a.meta.get("val"), torch.Tensor)
    ]
    out = node.meta.get("val")
    if isinstance(out, torch.Tensor):
        tensor_dtypes.append(out.dtype)
    for dtype in tensor_dtypes:
        if isinstance(value, bool) and dtype == torch.bool:
            return dtype
        if isinstance(value, int) and not isinstance(value, bool) and not dtype.is_complex:
            return dtype
        if isinstance(value, float) and dtype.is_floating_point:
            return dtype
    if isinstance(value, bool):
        return torch.bool
    if isinstance(value, int):
        return torch.int64
    return torch.get_default_dtype()


def get_operand(
    values_map: dict[str, ir.Value], node: torch.fx.Node, index: int, loc: ir.Location | None = None
) -> ir.Value:
    """The Core AI value of positional argument ``index`` of ``node``."""
    if index >= len(node.args):
        raise LoweringError(
            f"{describe(node)} has {len(node.args)} positional argument(s); index {index} "
            "is out of range"
        )
    arg: Any = node.args[index]
    if isinstance(arg, torch.fx.Node):
        try:
            return values_map[arg.name]
        except KeyError:
            raise LoweringError(
                f"operand {index} of {describe(node)} ('{arg.name}') has no Core AI value yet"
            ) from None
    if isinstance(arg, (bool, int, float)):
        dtype = _scalar_dtype(node, arg)
        with loc or ir.Location.unknown():
            return cai.constant(np.array(arg, dtype=dtypes.to_numpy(dtype)))
    raise LoweringError(
        f"operand {index} of {describe(node)} is a {type(arg).__name__} ({arg!r}), not a tensor "
        "or a scalar; read it from node.args directly"
    )


def get_operands(
    values_map: dict[str, ir.Value],
    node: torch.fx.Node,
    indices: Sequence[int],
    loc: ir.Location | None = None,
) -> list[ir.Value]:
    """``[get_operand(values_map, node, i, loc) for i in indices]``."""
    return [get_operand(values_map, node, i, loc) for i in indices]
