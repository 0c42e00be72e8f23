"""Weights read at conversion time and their compressed form: the tensor an argument holds
when it is a weight (a parameter, buffer or constant, possibly through ``_to_copy`` /
``clone``, or folded by PyTorch), a readable name for its compressed constants, and the
decompression of its codes, stored transposed when every reader transposes it (``nn.Linear``),
so that after ``optimize()`` the matmul reads the decompressed weight directly.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.fx

from coreai_torch._mlir import ir
from coreai_torch.ir import compressed
from coreai_torch.ir.values import transpose
from coreai_torch.lowerings.registry import LoweringContext

aten = torch.ops.aten

#: ops that pass a weight's values through unchanged (up to a dtype conversion)
_PASS_THROUGH = (
    aten._to_copy.default,
    aten.clone.default,
    aten.alias.default,
    aten.detach.default,
    aten.lift_fresh_copy.default,
)
_TRANSPOSES = (aten.permute.default, aten.t.default, aten.transpose.int)


def weight_tensor(cx: LoweringContext, arg: Any) -> torch.Tensor | None:
    """The tensor an argument of the node holds when it is a weight (a parameter, buffer or
    constant, possibly through ``_to_copy`` / ``clone``, or computed by PyTorch at conversion
    time), else None."""
    importer = cx.importer
    node = arg
    conversions: list[torch.dtype] = []
    while isinstance(node, torch.fx.Node):
        if node.name in importer.folded:
            tensor = importer.folded[node.name]
            break
        if node.op == "placeholder":
            tensor = importer.signature.weights.get(node.name)
            break
        if node.op != "call_function" or node.target not in _PASS_THROUGH:
            return None
        dtype = node.kwargs.get("dtype")
        if isinstance(dtype, torch.dtype):
            conversions.append(dtype)
        node = node.args[0]
    else:
        return None
    if not isinstance(tensor, torch.Tensor):
        return None
    tensor = tensor.detach()
    for dtype in reversed(conversions):
        tensor = tensor.to(dtype)
    return tensor


def weight_name(cx: LoweringContext, arg: Any) -> str:
    """A readable name for the compressed constants: the quantized weight's module path
    (``layers.0.mlp.up_proj.weight``), else the node's name."""
    importer = cx.importer
    node = arg
    while isinstance(node, torch.fx.Node) and node.op == "call_function" and node.args:
        node = node.args[0]
    if isinstance(node, torch.fx.Node) and node.op == "placeholder":
        target = importer.signature.weight_targets.get(node.name, node.name)
        # parametrized weights: ``fc.parametrizations.weight.original0`` (the dense tensor) or
        # ``fc.parametrizations.weight.0.indices`` (a parametrization's own tensor), nested
        # when torch.export unwraps a tensor subclass (``...0.parametrizations.data.original0``)
        pattern = r"(^|\.)parametrizations\.(\w+)\.(?:original\d+|\d+\.\w+)$"
        while (shorter := re.sub(pattern, r"\1\2", target)) != target:
            target = shorter
        return target
    return cx.node.name


def _read_transposed(node: torch.fx.Node) -> bool:
    """Whether every reader of a rank-2 value transposes it (``nn.Linear``'s ``permute``)."""
    if not node.users:
        return False
    for user in node.users:
        if user.target not in _TRANSPOSES or user.args[0] is not node:
            return False
        perm = user.args[1] if user.target is aten.permute.default else None
        if isinstance(perm, (list, tuple)) and list(perm) not in ([1, 0], [-1, -2]):
            return False
    return True


def emit_compressed(cx: LoweringContext, arg: Any, codes: Any, dtype: torch.dtype) -> ir.Value:
    """The decompression of ``codes`` (:class:`~coreai_torch.ir.compressed.LinearCodes`,
    ``PaletteCodes`` or ``SparseCodes``) of the weight ``arg``, stored transposed when every
    reader of the node transposes it."""
    store = cx.importer.builder.weights
    name = weight_name(cx, arg)
    if codes.ndim == 2 and _read_transposed(cx.node):
        transposed = compressed.decompression(store, name, codes.transposed(), dtype)
        return transpose(transposed.build(), [1, 0])
    return compressed.decompression(store, name, codes, dtype).build()
