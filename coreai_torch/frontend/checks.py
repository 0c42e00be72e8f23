"""Conversion-time checks of the element types a program computes with.

Complex numbers: the Core AI runtime stores ``complex64`` tensors, but coreai-torch's built-in
lowerings do not compute with them (and ``complex128`` has no Core AI type at all).  Instead of
failing deep inside a lowering, :func:`check_complex` lists every op that touches a complex
tensor, with its source line, and says what to do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch.export import ExportedProgram

from coreai_torch.errors import UnsupportedOpError
from coreai_torch.locations import describe, qualified_name


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _complex_dtypes(node: torch.fx.Node) -> set[torch.dtype]:
    values = _tensors(node.meta.get("val"))
    for arg in node.all_input_nodes:
        values += _tensors(arg.meta.get("val"))
    return {v.dtype for v in values if v.dtype.is_complex}


def check_complex(
    ep: ExportedProgram,
    entrypoint: str,
    *,
    user_lowered: Callable[[torch.fx.Node], bool] = lambda node: False,
) -> None:
    """Raise :class:`UnsupportedOpError` if the program computes with complex tensors.

    ``complex64`` values that only pass through (an input returned unchanged) and nodes
    ``user_lowered`` accepts (ops with a lowering registered on the converter) are accepted.
    """
    found: list[tuple[torch.fx.Node, set[torch.dtype]]] = []
    for _, gm in ep.graph_module.named_modules():
        if not isinstance(gm, torch.fx.GraphModule):
            continue
        for node in gm.graph.nodes:
            if node.op not in ("placeholder", "call_function"):
                continue
            kinds = _complex_dtypes(node)
            if not kinds:
                continue
            if node.op == "placeholder" and kinds == {torch.complex64}:
                continue  # the boundary itself is fine; the ops using it are checked
            if node.op == "call_function" and user_lowered(node):
                continue
            found.append((node, kinds))
    if not found:
        return
    lines = [
        f"entry point '{entrypoint}': {len(found)} node(s) compute with complex tensors, which "
        "coreai-torch's built-in lowerings do not support"
        + (
            " (complex128 has no Core AI type at all):"
            if any(torch.complex128 in kinds for _, kinds in found)
            else ":"
        )
    ]
    for node, kinds in found[:10]:
        names = ", ".join(sorted(str(k).removeprefix("torch.") for k in kinds))
        what = f"input '{node.name}'" if node.op == "placeholder" else describe(node)
        lines.append(f"  - {what} [{names}]")
    if len(found) > 10:
        lines.append(f"  ... and {len(found) - 10} more")
    if any(torch.complex128 in kinds for _, kinds in found):
        lines.append(
            "No lowering can handle complex128 values, since Core AI cannot hold them: pass "
            "complex data as real tensors with a trailing dimension of 2 (torch.view_as_real "
            "outside the model) and do the arithmetic on real and imaginary parts, or keep "
            "the complex math outside the model."
        )
    else:
        lines.append(
            "Keep complex data as real tensors with a trailing dimension of 2 (torch.view_as_real "
            "outside the model) and do the arithmetic on real and imaginary parts, or register "
            "a lowering for the op with converter.register_torch_lowering(...)."
        )
    raise UnsupportedOpError(
        "\n".join(lines),
        ops={qualified_name(n.target): [n] for n, _ in found if n.op == "call_function"},
    )
