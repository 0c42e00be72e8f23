"""Control flow: ``torch.cond``, ``while_loop`` and ``scan`` as ``coreai.if`` / ``coreai.while``.

The branch / body functions of these higher-order ops are ``GraphModule``s referenced by
``get_attr`` nodes; their placeholders are the operands the op passes (weights used inside a
branch are lifted by torch.export into operands).  They are imported into the regions of the
Core AI op with the importer's ``lower_subgraph``, so nested control flow works the same way.

Core AI constraints handled here:

* ``coreai.if`` needs a 0-d ``i1`` condition; results are declared with PyTorch's result types
  and every branch casts what it yields to them (shapes may differ between branches).
* A result that neither branch computes itself (an operand passed through, or a value folded
  from constants) is turned into a select by the compiler, which the Core AI backend cannot
  lower.  Such results are selected with ``broadcasting_where`` outside the ``if``.
* ``coreai.while`` carries values of the types of its initial values: loop-carried values are
  declared with the join of the initial and PyTorch's result types (dynamic where they differ).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.fx

from coreai_torch import dtypes
from coreai_torch._mlir import cai, ir
from coreai_torch.errors import ConversionError, UnsupportedOpError
from coreai_torch.ir.values import cast, dim_size, dtype_of, filled_dynamic, index_value, rank_of
from coreai_torch.locations import describe
from coreai_torch.lowerings.helpers.operands import sym_scalar
from coreai_torch.lowerings.registry import raw_lowering

# ------------------------------------------------------------------------------ helpers ----


def subgraph_module(arg: Any) -> torch.fx.GraphModule:
    """The ``GraphModule`` a ``get_attr`` argument of a higher-order op refers to."""
    if isinstance(arg, torch.fx.GraphModule):
        return arg
    if not isinstance(arg, torch.fx.Node) or arg.op != "get_attr":
        raise ConversionError(f"expected a sub-graph (get_attr node), got {arg!r}")
    module: Any = arg.graph.owning_module
    for part in str(arg.target).split("."):
        module = getattr(module, part)
    if not isinstance(module, torch.fx.GraphModule):
        raise ConversionError(f"'{arg.target}' is a {type(module).__name__}, not a sub-graph")
    return module


def lower_subgraph(
    values_map: Any,
    gm: torch.fx.GraphModule,
    operands: Sequence[Any],
    outputs: Sequence[int] | None = None,
) -> list[ir.Value]:
    """Lower ``gm`` at the current insertion point with its placeholders bound to
    ``operands`` (see ``GraphImporter.lower_subgraph``)."""
    importer = getattr(values_map, "importer", None)
    if importer is None:
        raise ConversionError("control flow can only be lowered by the coreai-torch importer")
    return importer.lower_subgraph(gm, operands, outputs=outputs)


def subgraph_outputs(gm: torch.fx.GraphModule) -> list[Any]:
    """The values a sub-graph returns (a single returned value becomes a one-element list)."""
    returned = gm.graph.output_node().args[0]
    return list(returned) if isinstance(returned, (list, tuple)) else [returned]


def _operand_values(values_map: dict[str, ir.Value], args: torch.fx.node.Argument) -> list[Any]:
    """The values of a list of operands of a higher-order op (nodes and Python scalars)."""
    if not isinstance(args, (list, tuple)):
        raise ValueError(f"expected a list of operands, got {type(args).__name__}")
    return [values_map[a.name] if isinstance(a, torch.fx.Node) else a for a in args]


def _value_type(val: Any) -> ir.Type:
    """The Core AI type of an example value (tensor, SymInt, SymFloat or SymBool)."""
    if isinstance(val, torch.Tensor):
        return dtypes.tensor_type([d if isinstance(d, int) else None for d in val.shape], val.dtype)
    if isinstance(val, (bool, torch.SymBool)):
        return dtypes.tensor_type([], torch.bool)
    if isinstance(val, (int, torch.SymInt)):
        return dtypes.tensor_type([], torch.int32)
    if isinstance(val, (float, torch.SymFloat)):
        return dtypes.tensor_type([], torch.float32)
    raise ConversionError(f"control flow values of type {type(val).__name__} are not supported")


def _join(value_type: ir.Type, val: Any) -> ir.Type:
    """``value_type`` with the dims that differ from ``val``'s (or are dynamic) made dynamic."""
    expected = ir.RankedTensorType(_value_type(val))
    have = ir.RankedTensorType(value_type)
    if have.rank != expected.rank or have.element_type != expected.element_type:
        raise ConversionError(
            f"loop-carried value of type {have} does not match PyTorch's {expected}"
        )
    dims = []
    for i in range(have.rank):
        a = None if have.is_dynamic_dim(i) else have.shape[i]
        b = None if expected.is_dynamic_dim(i) else expected.shape[i]
        dims.append(a if a == b else None)
    return ir.RankedTensorType.get(
        [ir.ShapedType.get_dynamic_size() if d is None else d for d in dims],
        have.element_type,
    )


def coerce(value: ir.Value, target: ir.Type) -> ir.Value:
    """``value`` cast to exactly ``target`` (element type and static/dynamic dims)."""
    if value.type == target:
        return value
    target_t = ir.RankedTensorType(target)
    value = cast(value, dtypes.to_torch(target_t.element_type))
    if rank_of(value) != target_t.rank:
        value = cai.reshape(value, np.array(target_t.shape if target_t.rank else [], np.int32))
    return value if value.type == target else cai.cast(value, target_t)


def predicate(value: Any) -> ir.Value | bool:
    """A condition as a 0-d ``i1`` value (Python bools stay Python bools).

    The value is routed through ``not(not(c))``: the Core AI runtime loops forever on a
    ``coreai.while`` whose body branches on a condition computed by ``where`` -> comparison
    (observed with coreai-core 1.0.0b3); the double negation avoids the faulty pattern.
    """
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if not isinstance(value, ir.Value):
        return bool(value)
    value = sym_scalar(value)
    if dtype_of(value) != torch.bool:
        zero = cast(cai.constant(np.int32(0)), dtype_of(value))
        value = cai.not_equal(value, zero)
    return cai.not_(cai.not_(value))


def _results(op_results: Any) -> list[ir.Value]:
    if isinstance(op_results, ir.Value):
        return [op_results]
    return list(op_results)


def _unsupported(node: torch.fx.Node, why: str) -> UnsupportedOpError:
    return UnsupportedOpError(f"{describe(node)}: {why}")


def _meta_shape(out: Any) -> Any:
    val = out.meta.get("val") if isinstance(out, torch.fx.Node) else out
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


# ------------------------------------------------------------------------------- cond ------


@raw_lowering("higher_order::cond")
def lower_cond(
    values_map: dict[str, ir.Value], node: torch.fx.Node, loc: ir.Location
) -> list[ir.Value]:
    """``torch.cond(pred, true_fn, false_fn, operands)`` -> ``coreai.if``."""
    pred_arg, true_arg, false_arg, operand_args = node.args[:4]
    true_gm, false_gm = subgraph_module(true_arg), subgraph_module(false_arg)
    operands = _operand_values(values_map, operand_args)
    pred = predicate(values_map[pred_arg.name] if isinstance(pred_arg, torch.fx.Node) else pred_arg)
    if isinstance(pred, bool):
        return lower_subgraph(values_map, true_gm if pred else false_gm, operands)

    vals = node.meta["val"]
    vals = list(vals) if isinstance(vals, (list, tuple)) else [vals]
    types = [_value_type(v) for v in vals]

    branches = (true_gm, false_gm)
    computed = list(range(len(types)))
    if_op, if_results, yields = _build_if(values_map, pred, types, branches, operands, computed)
    # A result both branches merely pass through (or fold from constants) would become a
    # select the backend cannot lower: select those with broadcasting_where outside the if.
    selected = [
        k for i, k in enumerate(computed) if all(_region_invariant(y[i], if_op) for y in yields)
    ]
    results: list[ir.Value | None] = list(if_results)
    if selected:
        if_op.erase()
        true_outs, false_outs = subgraph_outputs(true_gm), subgraph_outputs(false_gm)
        for k in selected:
            if _meta_shape(true_outs[k]) != _meta_shape(false_outs[k]):
                raise _unsupported(
                    node,
                    f"result {k} is passed through (or constant) in both branches with "
                    "different shapes; Core AI cannot select between them",
                )
        picked = [
            [coerce(v, types[k]) for v, k in zip(vals, selected, strict=True)]
            for vals in (
                lower_subgraph(values_map, gm, operands, outputs=selected) for gm in branches
            )
        ]
        results = [None] * len(types)
        for k, a, b in zip(selected, *picked, strict=True):
            results[k] = a if a == b else cai.broadcasting_where(pred, a, b)
        computed = [k for k in computed if k not in selected]
        if computed:
            _, rebuilt, _ = _build_if(values_map, pred, types, branches, operands, computed)
            for k, value in zip(computed, rebuilt, strict=True):
                results[k] = value
    return results


def _build_if(
    values_map: Any,
    pred: ir.Value,
    types: Sequence[ir.Type],
    branches: Sequence[torch.fx.GraphModule],
    operands: Sequence[Any],
    outputs: Sequence[int],
) -> tuple[ir.Operation, list[ir.Value], list[list[ir.Value]]]:
    """``coreai.if`` computing ``outputs`` of the two branches; returns the op, its results
    and the values each branch yields."""
    if_results, blocks = cai.if_([types[k] for k in outputs], pred)
    results = _results(if_results)
    yields = []
    for block, gm in zip(blocks, branches, strict=True):
        with block:
            outs = lower_subgraph(values_map, gm, operands, outputs=outputs)
            values = [coerce(v, types[k]) for v, k in zip(outs, outputs, strict=True)]
            cai.yield_(values)
        yields.append(values)
    return results[0].owner, results, yields


def _region_invariant(value: ir.Value, region_op: ir.Operation) -> bool:
    """Whether ``value`` is defined outside ``region_op`` or folds from constants (then the
    compiler hoists it out of the region)."""
    owner = value.owner
    if isinstance(owner, ir.Block):  # a block argument: of a region inside, or of an outer op
        parent = owner.owner.operation
        return parent != region_op.operation and not _inside(parent, region_op.operation)
    if not _inside(owner.operation, region_op.operation):
        return True
    return _folds(value, region_op.operation, depth=0)


def _folds(value: ir.Value, region_op: ir.Operation, depth: int) -> bool:
    """Whether ``value`` (inside ``region_op``) is computed from constants only."""
    owner = value.owner
    if not isinstance(owner, (ir.Operation, ir.OpView)) or depth > 32:
        return False
    op = owner.operation
    if op.name == "coreai.constant":
        return True
    if not _inside(op, region_op) or len(op.regions) > 0 or len(op.operands) == 0:
        return False
    return all(_folds(v, region_op, depth + 1) for v in op.operands)


def _inside(op: ir.Operation, region_op: ir.Operation) -> bool:
    parent = op.parent
    while parent is not None:
        if parent.operation == region_op:
            return True
        parent = parent.parent
    return False


# ------------------------------------------------------------------------- while_loop ------


@raw_lowering("higher_order::while_loop")
def lower_while_loop(
    values_map: dict[str, ir.Value], node: torch.fx.Node, loc: ir.Location
) -> list[ir.Value]:
    """``while_loop(cond_fn, body_fn, carried_inputs, additional_inputs)`` -> ``coreai.while``."""
    cond_arg, body_arg, carried_args, additional_args = node.args[:4]
    if node.kwargs.get("mutated_arg_indices"):
        raise _unsupported(node, "while_loop bodies that mutate their inputs are not supported")
    cond_gm, body_gm = subgraph_module(cond_arg), subgraph_module(body_arg)
    additional = _operand_values(values_map, additional_args)
    inits = [
        v if isinstance(v, ir.Value) else sym_scalar(v)
        for v in _operand_values(values_map, carried_args)
    ]
    vals = node.meta["val"]
    vals = list(vals) if isinstance(vals, (list, tuple)) else [vals]
    types = [_join(v.type, val) for v, val in zip(inits, vals, strict=True)]
    inits = [coerce(v, t) for v, t in zip(inits, types, strict=True)]
    return run_while(
        values_map,
        types,
        inits,
        lambda carried: lower_subgraph(values_map, cond_gm, [*carried, *additional])[0],
        lambda carried: lower_subgraph(values_map, body_gm, [*carried, *additional]),
    )


def run_while(
    values_map: Any,
    types: Sequence[ir.Type],
    inits: Sequence[ir.Value],
    cond: Any,
    body: Any,
) -> list[ir.Value]:
    """Emit ``coreai.while`` carrying ``inits`` (of ``types``); ``cond(carried)`` returns the
    continue-condition, ``body(carried)`` the next carried values.

    Values the body passes through unchanged are not carried: they are loop invariant, and
    carrying them makes the Core AI runtime loop forever when the body also branches.
    """
    n = len(inits)
    invariant: set[int] = set()
    while True:
        carried_at = [k for k in range(n) if k not in invariant]
        if not carried_at:
            return list(inits)

        def full(args: Sequence[ir.Value], carried_at: list[int] = carried_at) -> list[Any]:
            by_position = dict(zip(carried_at, args, strict=True))
            return [by_position.get(k, inits[k]) for k in range(n)]

        loop, (before, after) = cai.while_(
            [types[k] for k in carried_at], [inits[k] for k in carried_at]
        )
        with before:
            keep_going = predicate(cond(full(list(before.arguments))))
            if isinstance(keep_going, bool):
                keep_going = cai.constant(np.bool_(keep_going))
            cai.condition(keep_going, *before.arguments)
        with after:
            updated = body(full(list(after.arguments)))
            yields = [coerce(updated[k], types[k]) for k in carried_at]
            cai.yield_(yields)
        passed = {
            k
            for k, value, arg in zip(carried_at, yields, after.arguments, strict=True)
            if value == arg
        }
        results = _results(loop)
        if not passed:
            by_position = dict(zip(carried_at, results, strict=True))
            return [by_position.get(k, inits[k]) for k in range(n)]
        results[0].owner.operation.erase()
        invariant |= passed


# ------------------------------------------------------------------------------- scan ------


@raw_lowering("higher_order::scan")
def lower_scan(
    values_map: dict[str, ir.Value], node: torch.fx.Node, loc: ir.Location
) -> list[ir.Value]:
    """``scan(combine_fn, init, xs, additional_inputs)`` -> ``coreai.while`` over dim 0 of
    ``xs``; the stacked outputs are written into preallocated buffers with ``scatter_nd``."""
    combine_arg, init_args, xs_args, additional_args = node.args[:4]
    inits = [
        v if isinstance(v, ir.Value) else sym_scalar(v)
        for v in _operand_values(values_map, init_args)
    ]
    xs = _operand_values(values_map, xs_args)
    additional = _operand_values(values_map, additional_args)
    return scan_loop(values_map, node, subgraph_module(combine_arg), inits, xs, additional)


@raw_lowering("higher_order::map_impl")
def lower_map(
    values_map: dict[str, ir.Value], node: torch.fx.Node, loc: ir.Location
) -> list[ir.Value]:
    """``map(f, xs, *args)``: a scan without carried values."""
    body_arg, xs_args, pos_args = node.args[:3]
    xs = _operand_values(values_map, xs_args)
    additional = _operand_values(values_map, pos_args)
    return scan_loop(values_map, node, subgraph_module(body_arg), [], xs, additional)


def scan_loop(
    values_map: Any,
    node: torch.fx.Node,
    body_gm: torch.fx.GraphModule,
    inits: Sequence[ir.Value],
    xs: Sequence[ir.Value],
    additional: Sequence[Any],
) -> list[ir.Value]:
    """Loop over dim 0 of ``xs``: ``body_gm(*carries, *slices, *additional)`` returns the
    next carries and this step's outputs; returns the final carries and the stacked outputs."""
    vals = node.meta["val"]
    vals = list(vals) if isinstance(vals, (list, tuple)) else [vals]
    n_carry = len(inits)
    carry_types = [_join(v.type, val) for v, val in zip(inits, vals[:n_carry], strict=True)]
    if not xs:
        raise _unsupported(node, "a scan needs at least one input to scan over")

    steps = dim_size(xs[0], 0)
    length = index_value(steps)
    buffers = []
    for val in vals[n_carry:]:
        shape = list(val.shape)
        if not all(isinstance(d, int) for d in shape[1:]):
            raise _unsupported(
                node, "scan outputs whose per-step shape is dynamic are not supported"
            )
        buffers.append(filled_dynamic([steps, *shape[1:]], 0, val.dtype))
    buffer_types = [b.type for b in buffers]
    counter_type = dtypes.tensor_type([], torch.int32)
    types = [counter_type, *carry_types, *buffer_types]
    zero = cai.constant(np.int32(0))
    inits = [zero, *(coerce(v, t) for v, t in zip(inits, carry_types, strict=True)), *buffers]

    def cond(carried: list[ir.Value]) -> ir.Value:
        return cai.greater(length, carried[0])

    def body(carried: list[ir.Value]) -> list[ir.Value]:
        i = carried[0]
        position = cai.reshape(i, np.array([1], np.int32))
        slices = [cai.gather_nd(x, position) for x in xs]
        outs = lower_subgraph(
            values_map, body_gm, [*carried[1 : 1 + n_carry], *slices, *additional]
        )
        new_carries = outs[:n_carry]
        written = []
        for buffer, y in zip(carried[1 + n_carry :], outs[n_carry:], strict=True):
            update = cai.expand_dims(cast(y, dtype_of(buffer)), np.array([0], np.int32))
            index = cai.reshape(i, np.array([1, 1], np.int32))
            written.append(cai.scatter_nd(buffer, index, update))
        step = cai.add(i, cai.constant(np.int32(1)))
        return [step, *new_carries, *written]

    results = run_while(values_map, types, inits, cond, body)
    return results[1:]
