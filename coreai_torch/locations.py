"""Where an FX node came from in the user's code, as text and as an MLIR location."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch
import torch.fx

from coreai_torch._mlir import ir

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)\n(?P<code>.*)?')
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


@dataclass(frozen=True)
class SourceFrame:
    """One frame of the stack that produced an FX node."""

    file: str
    line: int
    function: str
    code: str

    def __str__(self) -> str:
        text = f"{self.file}:{self.line} in {self.function}"
        return f"{text}: {self.code}" if self.code else text


#: the file name of code FX generates (``<eval_with_key>.12``: a counter of this process)
_GENERATED = re.compile(r"^<eval_with_key>(\.\d+)?$")


def _frames(node: torch.fx.Node) -> list[SourceFrame]:
    trace = node.meta.get("stack_trace") or ""
    return [
        SourceFrame(
            _GENERATED.sub("<eval_with_key>", m["file"]),
            int(m["line"]),
            m["func"],
            (m["code"] or "").strip(),
        )
        for m in _FRAME.finditer(trace)
    ]


def user_frame(node: torch.fx.Node) -> SourceFrame | None:
    """The innermost frame of the user's own code (not inside torch, nor code FX generated)
    that created ``node``.  The same model gives the same frames in every conversion (the
    counter in the names of generated code is dropped), so its asset is the same too."""
    frames = _frames(node)
    for frame in reversed(frames):
        if not frame.file.startswith(_TORCH_DIR) and frame.file != "<eval_with_key>":
            return frame
    return frames[-1] if frames else None


def module_path(node: torch.fx.Node) -> str:
    """Dotted path of the innermost ``nn.Module`` the node was traced in ('' for the root)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, _cls = list(stack.values())[-1]
    return clean_module_path(str(path))


def clean_module_path(path: str) -> str:
    # torch.export writes paths like "L['self'].layers[0].attn" or "layers.0.attn".
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\._modules\['([^']+)'\]", r".\1", path)
    return path.strip(".")


def describe(node: torch.fx.Node) -> str:
    """A one-line description of a node for error messages: op, name, module and source."""
    parts = [f"node '{node.name}'"]
    if node.op == "call_function":
        parts.append(f"(op {qualified_name(node.target)})")
    path = module_path(node)
    if path:
        parts.append(f"in module '{path}'")
    frame = user_frame(node)
    parts.append(f"at {frame}" if frame else "(no source location recorded)")
    return " ".join(parts)


def qualified_name(target: object) -> str:
    """``namespace::op.overload`` for torch ops, ``module.function`` for Python callables."""
    if isinstance(target, torch._ops.OpOverload):
        namespace, name = target._schema.name.split("::", 1)
        return f"{namespace}::{name}.{target._overloadname}"
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order::{target.name()}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return f"{target._qualified_op_name}"
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__name__", None) or repr(target)
    return f"{module}.{name}" if module else name


def location(node: torch.fx.Node) -> ir.Location:
    """The MLIR location of a node: ``loc(fused<"node_name">["file.py":line:0])``.

    Core AI's pipeline and bytecode writer accept file, fused, debug-info and unknown
    locations (not name locations), so the node name rides as the fused location's metadata.
    """
    return named_location(node.name, user_frame(node))


def named_location(name: str, frame: SourceFrame | None = None) -> ir.Location:
    """A fused location tagged with ``name`` (and carrying the source frame, when known)."""
    inner = ir.Location.unknown() if frame is None else ir.Location.file(frame.file, frame.line, 0)
    return ir.Location.fused([inner], metadata=ir.StringAttr.get(name))


_LOCATION_NAME = re.compile(r'fused<"([^"]+)">')


def names_in_location(text: str) -> list[str]:
    """The node names mentioned by printed locations in ``text`` (in order, unique)."""
    return list(dict.fromkeys(_LOCATION_NAME.findall(text)))
