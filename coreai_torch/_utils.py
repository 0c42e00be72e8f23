"""Operand access for lowering functions (``register_torch_lowering`` callbacks).

``get_operand(values_map, node, index, loc)`` returns the Core AI value of ``node.args[index]``:
the value of an FX node, or a constant for a Python scalar, typed like the tensors it meets
(a ``0.5`` next to ``float16`` tensors becomes a ``float16`` constant).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from coreai_torch._mlir import ir
from coreai_torch.errors import LoweringError
from coreai_torch.ir.values import constant
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


_MISSING = object()


def _argument(node: torch.fx.Node, index: int) -> Any:
    """``node.args[index]``, or the keyword / schema default for that position."""
    if index < len(node.args):
        return node.args[index]
    schema = getattr(node.target, "_schema", None)
    if schema is not None and index < len(schema.arguments):
        argument = schema.arguments[index]
        if argument.name in node.kwargs:
            return node.kwargs[argument.name]
        if argument.has_default_value():
            return argument.default_value
    return _MISSING


def _value_of(values_map: dict[str, ir.Value], node: torch.fx.Node, index: int, arg: Any) -> Any:
    if isinstance(arg, torch.fx.Node):
        try:
            return values_map[arg.name]
        except KeyError:
            raise LoweringError(
                f"operand {index} of {describe(node)} ('{arg.name}') has no Core AI value yet"
            ) from None
    if isinstance(arg, (bool, int, float)):
        return constant(arg, _scalar_dtype(node, arg))
    if isinstance(arg, (list, tuple)) and all(isinstance(a, torch.fx.Node) for a in arg):
        return [_value_of(values_map, node, index, a) for a in arg]
    kind = "list" if isinstance(arg, (list, tuple)) else type(arg).__name__
    raise LoweringError(
        f"operand {index} of {describe(node)} is a {kind} ({arg!r}), not a tensor or a "
        "scalar; read it from node.args directly"
    )


def get_operand(
    values_map: dict[str, ir.Value], node: torch.fx.Node, index: int, loc: ir.Location | None = None
) -> ir.Value:
    """The Core AI value of positional argument ``index`` of ``node``.

    A tensor argument gives its value from ``values_map``; a Python scalar becomes a constant
    of the dtype of the tensors around it (``0.5`` next to ``float16`` tensors is a ``float16``
    constant); a list of tensors gives a list of values.  An argument passed by keyword or left
    at its default is found through the op's schema.
    """
    arg = _argument(node, index)
    if arg is _MISSING:
        raise LoweringError(
            f"{describe(node)} has {len(node.args)} positional argument(s); index {index} "
            "is out of range"
        )
    if loc is None:
        loc = ir.Location.current or ir.Location.unknown()
    with loc:
        return _value_of(values_map, node, index, arg)


def get_operands(
    values_map: dict[str, ir.Value],
    node: torch.fx.Node,
    indices: Sequence[int],
    loc: ir.Location | None = None,
) -> list[ir.Value]:
    """``[get_operand(values_map, node, i, loc) for i in indices]``."""
    return [get_operand(values_map, node, i, loc) for i in indices]
