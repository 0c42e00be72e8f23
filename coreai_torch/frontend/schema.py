"""FX nodes read against their op's schema: the arguments of a node by name."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx


def bind_arguments(node: torch.fx.Node) -> dict[str, Any]:
    """The node's arguments by schema name, defaults filled in (FX nodes left as nodes)."""
    if not isinstance(node.target, torch._ops.OpOverload):
        raise TypeError(f"node {node.name} calls {node.target}, which has no ATen schema")
    schema = node.target._schema
    bound: dict[str, Any] = {}
    positional = list(node.args)
    for i, arg in enumerate(schema.arguments):
        if i < len(positional) and not arg.kwarg_only:
            bound[arg.name] = positional[i]
        elif arg.name in node.kwargs:
            bound[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
        else:
            bound[arg.name] = None
    return bound
