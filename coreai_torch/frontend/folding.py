"""Conversion-time constant folding, evaluated by PyTorch itself.

Nodes computed only from constants — creation ops (``arange``, ``full``), weights and lifted
constants, and other such nodes — are evaluated eagerly with PyTorch while converting, as long
as their results are small.  The converted graph then holds the result as one constant instead
of the ops that compute it (causal masks, rotary tables, position ids, ...): less work at run
time, and values bit-identical to PyTorch's.

Large results derived from weights (a transposed weight matrix, say) are *not* folded: that
would copy the weight at conversion time, which stays zero-copy.  ``AIProgram.optimize()``
stores weights read only transposed transposed instead (:mod:`coreai_torch.passes.pretranspose`).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from coreai_torch import dtypes
from coreai_torch.frontend.fusions import FUSED_OPS
from coreai_torch.tensors import lazy

#: Largest result (in elements, per tensor) that is folded.
FOLD_LIMIT = 1 << 16
#: Weights at least this large are only folded into much smaller results (a gather of a few
#: rows, a reduction), never into same-sized copies (transposes, casts, views).
LARGE_WEIGHT = 1 << 10


def _small_tensors(val: Any, limit: int) -> bool:
    vals = val if isinstance(val, (list, tuple)) else [val]
    return bool(vals) and all(
        isinstance(v, torch.Tensor)
        and all(isinstance(d, int) for d in v.shape)
        and 0 < v.numel() <= limit
        and dtypes.is_supported(v.dtype)
        and not v.dtype.is_complex
        for v in vals
    )


def _numel(val: Any) -> int:
    vals = val if isinstance(val, (list, tuple)) else [val]
    return sum(v.numel() for v in vals)


def _foldable_target(target: Any) -> bool:
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if target in FUSED_OPS:
        return True
    if target.namespace != "aten" or target._schema.is_mutable:
        return False
    return torch.Tag.nondeterministic_seeded not in target.tags


def fold_constants(
    graph: torch.fx.Graph,
    constants: dict[str, torch.Tensor],
    *,
    limit: int = FOLD_LIMIT,
    skip: Callable[[torch.fx.Node], bool] | None = None,
) -> dict[str, Any]:
    """``{node name: value}`` for every call node PyTorch can evaluate from ``constants``.

    ``constants`` maps placeholder names to the tensors they hold (weights, lifted constants).
    A node is folded when it is a deterministic, non-mutating ATen op (or ``getitem``), every
    input is a constant or a folded node, and each of its results has at most ``limit``
    elements.  Nodes PyTorch fails to evaluate, and those ``skip`` names, are left to their
    lowerings.
    """
    known: dict[str, Any] = dict(constants)
    #: largest weight (in elements) each known value is computed from
    weight_size: dict[str, int] = {name: t.numel() for name, t in constants.items()}
    folded: dict[str, Any] = {}
    for node in graph.nodes:
        if node.op != "call_function" or not _foldable_target(node.target):
            continue
        if skip is not None and skip(node):
            continue
        if not all(arg.name in known for arg in node.all_input_nodes):
            continue
        if not _small_tensors(node.meta.get("val"), limit):
            continue
        source = max((weight_size.get(a.name, 0) for a in node.all_input_nodes), default=0)
        if source >= LARGE_WEIGHT and 4 * _numel(node.meta["val"]) > source:
            continue
        args, kwargs = torch.fx.node.map_arg(
            (node.args, node.kwargs), lambda n: lazy.materialize(known[n.name])
        )
        try:
            with torch.no_grad():
                value = node.target(*args, **kwargs)
        except Exception:
            continue
        known[node.name] = value
        weight_size[node.name] = source
        folded[node.name] = value
    return folded


def frontier(graph: torch.fx.Graph, folded: dict[str, Any]) -> set[str]:
    """The folded nodes whose values something that is not folded (or the output) needs."""
    needed: set[str] = set()
    for node in graph.nodes:
        if node.name not in folded:
            needed.update(arg.name for arg in node.all_input_nodes if arg.name in folded)
    return needed
