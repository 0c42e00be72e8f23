"""A decomposed program with its dynamic input sizes fixed, derived without tracing again.

An LLM's decode step is its prefill for one token: rather than exporting the model a second
time (the cost of ``torch.export`` and ``run_decompositions`` grows with the layers),
:func:`specialize` runs the prefill's graph over fake inputs of the decode's shapes.  Every
node gets the metadata of the new shapes, every symbolic size becomes its value, and the
checks on those sizes, now constants, are dropped.  The program computes what it computed for
those shapes; the converter sees static shapes, as in a program traced with them.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

aten = torch.ops.aten

#: checks on sizes that hold by construction once the sizes are constants
_SIZE_CHECKS = (
    aten._assert_scalar.default,
    aten.sym_constrain_range_for_size.default,
    aten.sym_constrain_range.default,
)


class SpecializationError(RuntimeError):
    """The program cannot be specialized (a node the walk does not handle, or sizes the
    program's guards rule out); trace the model with the new shapes instead."""


def specialize(ep: ExportedProgram, args: Sequence[torch.Tensor]) -> ExportedProgram:
    """``ep`` (decomposed, user inputs all tensors) for user inputs of exactly the shapes,
    strides and dtypes of ``args``: a new program sharing ``ep``'s weights and constants,
    with static shapes.  Raises :class:`SpecializationError` if it cannot."""
    user = [s for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    if len(user) != len(args):
        raise SpecializationError(f"the program takes {len(user)} inputs, {len(args)} given")
    _check_ranges(ep, user, args)
    fake_mode = FakeTensorMode()
    given = {spec.arg.name: arg for spec, arg in zip(user, args, strict=True)}
    graph = torch.fx.Graph()
    old_to_new: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in ep.graph.nodes:  # the same names, the graph signature still applies
        old_to_new[node] = graph.node_copy(node, old_to_new.__getitem__)
    values: dict[torch.fx.Node, Any] = {}

    def value(a: Any) -> Any:
        return values[a] if isinstance(a, torch.fx.Node) else a

    with fake_mode:
        for node in graph.nodes:
            if node.op == "placeholder":
                values[node] = _placeholder(node, given.get(node.name), fake_mode)
            elif node.op == "call_function":
                values[node] = _run(node, value)
            elif node.op == "output":
                continue
            else:
                raise SpecializationError(f"a {node.op} node ({node.name}) in the graph")
            node.meta["val"] = values[node]
            node.meta.pop("tensor_meta", None)
            node.meta.pop("unbacked_bindings", None)
    _fold_sizes(graph, values)
    root = torch.fx.GraphModule(ep.graph_module, graph)
    return ExportedProgram(
        root=root,
        graph=root.graph,
        graph_signature=ep.graph_signature,
        state_dict=ep.state_dict,
        range_constraints={},
        module_call_graph=ep.module_call_graph,
        constants=ep.constants,
        verifiers=ep.verifiers,
    )


def _check_ranges(ep: ExportedProgram, user: list[Any], args: Sequence[torch.Tensor]) -> None:
    """Each given size must be one the program was traced for (within its dimension's range)."""
    for spec, arg in zip(user, args, strict=True):
        node = next(n for n in ep.graph.nodes if n.op == "placeholder" and n.name == spec.arg.name)
        traced = node.meta.get("val")
        if not isinstance(traced, torch.Tensor) or not isinstance(arg, torch.Tensor):
            raise SpecializationError(f"input {spec.arg.name} is not a tensor")
        if traced.dim() != arg.dim() or traced.dtype != arg.dtype:
            raise SpecializationError(f"input {spec.arg.name}: a different rank or dtype")
        for size, wanted in zip(traced.shape, arg.shape, strict=True):
            if isinstance(size, int):
                if size != wanted:
                    raise SpecializationError(f"input {spec.arg.name}: static size {size}")
                continue
            bounds = ep.range_constraints.get(size.node.expr)
            if bounds is None or not bounds.lower <= wanted <= bounds.upper:
                raise SpecializationError(
                    f"input {spec.arg.name}: size {wanted} is outside the traced range"
                )


def _placeholder(node: torch.fx.Node, arg: torch.Tensor | None, fake_mode: FakeTensorMode) -> Any:
    if arg is not None:
        return fake_mode.from_tensor(arg)
    traced = node.meta.get("val")
    if not isinstance(traced, torch.Tensor):
        raise SpecializationError(f"placeholder {node.name} holds no tensor")
    if any(not isinstance(s, int) for s in (*traced.shape, *traced.stride())):
        raise SpecializationError(f"weight or state {node.name} has a symbolic size")
    return torch.empty_strided(
        tuple(traced.shape), tuple(traced.stride()), dtype=traced.dtype, device=traced.device
    )


def _run(node: torch.fx.Node, value: Any) -> Any:
    target = node.target
    if not (
        isinstance(target, torch._ops.OpOverload)
        or target is operator.getitem
        or getattr(target, "__module__", None) in ("_operator", "operator", "math")
        or target in (torch.sym_float, torch.sym_int, torch.sym_max, torch.sym_min)
    ):
        raise SpecializationError(f"node {node.name} calls {target}")
    args = torch.fx.node.map_aggregate(node.args, value)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, value)
    if target in _SIZE_CHECKS:
        if target is aten._assert_scalar.default and not args[0]:
            raise SpecializationError(f"the given sizes fail the program's check: {args[1]}")
        return None
    try:
        return cast("Callable[..., Any]", target)(*args, **kwargs)
    except Exception as error:
        raise SpecializationError(f"node {node.name} ({target}): {error}") from error


def _fold_sizes(graph: torch.fx.Graph, values: dict[torch.fx.Node, Any]) -> None:
    """Replace the uses of nodes that computed a size (now a plain number) by the number, and
    drop those nodes and the size checks."""
    for node in reversed(list(graph.nodes)):
        if node.op != "call_function":
            continue
        if node.target in _SIZE_CHECKS:
            graph.erase_node(node)
            continue
        number = values[node]
        if isinstance(number, (int, float, bool)):
            for user in list(node.users):
                _substitute(user, node, number)
            graph.erase_node(node)


def _substitute(user: torch.fx.Node, node: torch.fx.Node, number: float) -> None:
    """Pass ``number`` to ``user`` where it took ``node``."""

    def swap(a: torch.fx.Node) -> Any:
        return number if a is node else a

    user.args = torch.fx.node.map_arg(user.args, swap)
    user.kwargs = torch.fx.node.map_arg(user.kwargs, swap)
