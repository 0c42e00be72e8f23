"""FX graph -> one ``coreai.graph``: values, weights, states, locations and dispatch.

The importer walks an ``ExportedProgram``'s nodes in order and calls one lowering per node.
It owns everything around the rules: graph arguments and results (from the signature), weights
(zero-copy resources), state handles and tokens, the node's location (active while its rule
runs, so every op it builds points at the user's source line), and turning failures into
errors that name the node, the op and the source line.
"""

from __future__ import annotations

import inspect
import operator
import traceback
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
import torch.fx
from torch.export import ExportedProgram

from coreai_torch import dtypes
from coreai_torch._mlir import cai, ir
from coreai_torch.errors import (
    ConversionError,
    LoweringError,
    RuntimeHazardError,
    UnsupportedOpError,
)
from coreai_torch.frontend import hints
from coreai_torch.frontend.folding import fold_constants, frontier
from coreai_torch.frontend.half_precision import HalfWeights
from coreai_torch.frontend.signature import ProgramSignature
from coreai_torch.frontend.sizes import check_data_dependent_sizes
from coreai_torch.ir.weights import WeightStore
from coreai_torch.locations import (
    describe,
    location,
    named_location,
    qualified_name,
    user_frame,
)
from coreai_torch.lowerings.registry import (
    EMPTY_INPUT_OPS,
    EmptyTensor,
    LoweringOptions,
    LoweringTable,
    lowering_key,
)
from coreai_torch.precision.policy import FP32, Precision


class ValueMap(dict):
    """``values_map`` handed to lowerings: FX node name -> Core AI value.

    Multi-result nodes are stored as ``"name#0"``, ``"name#1"``, ...  ``importer`` gives
    built-in rules access to the importer (weights, sub-graphs).
    """

    def __init__(self, importer: GraphImporter) -> None:
        super().__init__()
        self.importer = importer


class Diagnostics:
    """Collects the MLIR diagnostics of a context instead of letting them hit stderr."""

    def __init__(self, context: ir.Context) -> None:
        self.messages: list[tuple[str, str]] = []
        self._handler = context.attach_diagnostic_handler(self._on_diagnostic)

    def _on_diagnostic(self, diagnostic: Any) -> bool:
        self.messages.append((str(diagnostic.location), str(diagnostic.message)))
        return True

    def take(self) -> list[tuple[str, str]]:
        messages, self.messages = self.messages, []
        return messages

    def detach(self) -> None:
        self._handler.detach()


@dataclass
class ProgramBuilder:
    """State shared by every graph of one ``to_coreai()`` call."""

    context: ir.Context
    module: ir.Module
    diagnostics: Diagnostics
    weights: WeightStore = field(default_factory=WeightStore)
    #: node name -> node, for mapping verifier locations back to the user's code
    nodes: dict[str, torch.fx.Node] = field(default_factory=dict)
    #: names of the public graphs built so far
    graph_names: list[str] = field(default_factory=list)
    #: receives per-node progress of each entry point (``coreai_torch.progress``), or None
    progress: Any = None
    #: evaluate input-independent nodes with PyTorch (``TorchConverter(fold_constants=...)``)
    fold_constants: bool = True
    #: whether a lowering registered on the converter (not a built-in one) ran
    ran_own_lowerings: bool = False
    #: the precision policy of the conversion (``TorchConverter(compute_precision=...)``)
    precision: Precision = FP32
    #: half-precision copies of the weights, shared by every graph of the program
    half_weights: HalfWeights = field(default_factory=HalfWeights)
    #: what lowerings follow (``LoweringContext.options``)
    options: LoweringOptions = field(default_factory=LoweringOptions)


# ------------------------------------------------------------------------------ analysis ----


def _graph_modules(ep: ExportedProgram) -> Iterable[torch.fx.GraphModule]:
    for _, module in ep.graph_module.named_modules():
        if isinstance(module, torch.fx.GraphModule):
            yield module


def find_unsupported(
    ep: ExportedProgram, lowerings: LoweringTable, folded: Iterable[str] = ()
) -> dict[str, list[torch.fx.Node]]:
    """Every op of the program (sub-graphs included) without a lowering, with its nodes.

    Nodes named in ``folded`` (computed by PyTorch at conversion time) need no lowering.
    """
    folded = set(folded)
    missing: dict[str, list[torch.fx.Node]] = {}
    for gm in _graph_modules(ep):
        for node in gm.graph.nodes:
            key = lowering_key(node)
            if (
                key is not None
                and key not in lowerings
                and (gm is not ep.graph_module or node.name not in folded)
            ):
                missing.setdefault(key, []).append(node)
    return missing


def unsupported_op_error(
    missing: dict[str, list[torch.fx.Node]], entrypoint: str
) -> UnsupportedOpError:
    total = sum(len(nodes) for nodes in missing.values())
    lines = [
        f"entry point '{entrypoint}': {len(missing)} op(s) have no Core AI lowering "
        f"({total} node(s)):"
    ]
    for key, nodes in sorted(missing.items(), key=lambda kv: -len(kv[1])):
        first = nodes[0]
        frame = user_frame(first)
        where = f"first at {frame}" if frame else "no source location recorded"
        lines.append(f"  - {key}  x{len(nodes)}  ({where}; node '{first.name}')")
    lines += hints.for_nodes(node for nodes in missing.values() for node in nodes)
    example = next(iter(missing))
    override = ", allow_override=True" if example.split("::")[0] in ("aten", "higher_order") else ""
    lines += [
        "Register a lowering for each of them on the converter before calling to_coreai():",
        f'    @converter.register_torch_lowering("{example}"{override})',
        "    def lower(values_map, node, loc):",
        "        x = coreai_torch.lowerings.get_operand(values_map, node, 0, loc)",
        "        return ...  # a Core AI value (or a list of values for multi-output ops)",
        "(with bind=True it takes the op's arguments by name instead, like the built-in "
        "lowerings: def lower(cx, x, ...); see docs/extending.md)",
    ]
    return UnsupportedOpError("\n".join(lines), ops=missing)


def _used_values(node: torch.fx.Node) -> list[Any]:
    """The example values of a node's results that something actually uses."""
    vals = node.meta.get("val")
    if not node.users:
        return []
    if isinstance(vals, (list, tuple)):
        used = {u.args[1] for u in node.users if u.target is operator.getitem}
        return [v for i, v in enumerate(vals) if i in used]
    return [vals]


def _is_empty(val: Any) -> bool:
    return isinstance(val, torch.Tensor) and any(isinstance(d, int) and d == 0 for d in val.shape)


def droppable_empty_nodes(ep: ExportedProgram) -> set[torch.fx.Node]:
    """Nodes with a zero-element result that conversion can drop entirely.

    A node qualifies when each of its users either qualifies too or takes it in an argument
    listed in :data:`EMPTY_INPUT_OPS` (e.g. an input of ``cat``).  Such nodes are not lowered;
    their consumers see an :class:`EmptyTensor`.
    """
    dropped: set[torch.fx.Node] = set()
    for gm in _graph_modules(ep):
        for node in reversed(list(gm.graph.nodes)):
            if node.op != "call_function" or not _is_empty(node.meta.get("val")):
                continue
            if node.users and all(_drops(user, node, dropped) for user in node.users):
                dropped.add(node)
    return dropped


def _drops(user: torch.fx.Node, node: torch.fx.Node, dropped: set[torch.fx.Node]) -> bool:
    if user in dropped:
        return True
    positions = EMPTY_INPUT_OPS.get(lowering_key(user) or "")
    if positions is None:
        return False
    for i, arg in enumerate(user.args):
        in_arg = arg is node or (isinstance(arg, (list, tuple)) and node in arg)
        if in_arg and i not in positions:
            return False
    return not any(v is node for v in user.kwargs.values())


def find_zero_size(
    ep: ExportedProgram, dropped: set[torch.fx.Node] | None = None
) -> list[torch.fx.Node]:
    """Nodes with a used (static) value of zero elements: the Core AI runtime aborts on those.

    Empty values that conversion drops (:func:`droppable_empty_nodes`) are not listed.
    """
    if dropped is None:
        dropped = droppable_empty_nodes(ep)
    found = []
    for gm in _graph_modules(ep):
        for node in gm.graph.nodes:
            if node.op in ("output", "get_attr") or node in dropped:
                continue
            if isinstance(node.meta.get("val"), (list, tuple)):
                empty_users = [
                    u for u in node.users if _is_empty(u.meta.get("val")) and u not in dropped
                ]
                if any(u.target is operator.getitem for u in empty_users):
                    found.append(node)
                continue
            if any(_is_empty(val) for val in _used_values(node)):
                found.append(node)
    return found


# ------------------------------------------------------------------------------- import -----


#: 0-d input types of dynamic Python scalars (what torch passes: int64, float64 as f32, bool)
_SYMBOLIC_INPUT_DTYPES = {
    torch.SymInt: torch.int64,
    torch.SymFloat: torch.float32,
    torch.SymBool: torch.bool,
}


def _val_type(val: Any) -> ir.Type:
    if type(val) in _SYMBOLIC_INPUT_DTYPES:
        return dtypes.tensor_type([], _SYMBOLIC_INPUT_DTYPES[type(val)])
    shape = [d if isinstance(d, int) else None for d in val.shape]
    return dtypes.tensor_type(shape, val.dtype)


class GraphImporter:
    """Builds one public ``coreai.graph`` from a decomposed ``ExportedProgram``."""

    def __init__(
        self,
        builder: ProgramBuilder,
        ep: ExportedProgram,
        signature: ProgramSignature,
        lowerings: LoweringTable,
        name: str,
    ) -> None:
        self.builder = builder
        self.ep = ep
        self.signature = signature
        self.lowerings = lowerings
        self.name = name
        self.placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
        #: zero-element nodes that are not lowered (their consumers drop them)
        self.dropped = droppable_empty_nodes(ep)
        #: nodes PyTorch evaluates at conversion time, and those of them emitted as constants
        self.folded = (
            fold_constants(
                ep.graph,
                signature.weights,
                skip=lambda node: lowerings.is_own_node(node) or node in self.dropped,
            )
            if builder.fold_constants
            else {}
        )
        self.fold_frontier = frontier(ep.graph, self.folded)

        #: placeholders read by something that is not folded away
        self.read = {
            arg.name
            for node in ep.graph.nodes
            if node.name not in self.folded
            for arg in node.all_input_nodes
        }

    # -- public -------------------------------------------------------------------------------

    def run(self) -> None:
        sig = self.signature
        missing = find_unsupported(self.ep, self.lowerings, self.folded)
        if missing:
            raise unsupported_op_error(missing, self.name)
        zero = find_zero_size(self.ep, self.dropped)
        if zero:
            listed = "\n".join(f"  - {describe(n)}" for n in zero[:10])
            raise RuntimeHazardError(
                f"entry point '{self.name}': {len(zero)} value(s) have zero elements, which the "
                f"Core AI runtime cannot execute:\n{listed}\nRemove the empty tensors from the "
                "model (or export with sizes > 0)."
            )
        check_data_dependent_sizes(self.ep, self.name)

        state_types = [
            cai.HandleType.get(_val_type(self.placeholders[s.node].meta["val"])) for s in sig.states
        ]
        input_types = [_val_type(self.placeholders[i.node].meta["val"]) for i in sig.inputs]
        arg_names = [s.name for s in sig.states] + [i.name for i in sig.inputs]
        with named_location(self.name), ir.InsertionPoint(self.builder.module.body):
            graph = cai.GraphOp(self.name, state_types + input_types, [], input_names=arg_names)
        values = ValueMap(self)
        with graph.block:
            handles = graph.arguments[: len(sig.states)]
            tokens = []
            for state, handle in zip(sig.states, handles, strict=True):
                with location(self.placeholders[state.node]):
                    value, token = cai.read_handle(handle, cai.create_token())
                values[state.node] = value
                tokens.append(token)
            for inp, arg in zip(sig.inputs, graph.arguments[len(sig.states) :], strict=True):
                if isinstance(self.placeholders[inp.node].meta.get("val"), torch.SymInt):
                    with location(self.placeholders[inp.node]):  # sizes are 0-d si32 inside
                        arg = cai.cast(arg, dtypes.tensor_type([], torch.int32))
                values[inp.node] = arg
            with named_location("weights"):
                for name, tensor in sig.weights.items():
                    if name in self.read:
                        values[name] = self.builder.weights.constant(
                            tensor, sig.weight_targets.get(name, name)
                        )

            progress = self.builder.progress
            if progress is not None:
                total = sum(1 for n in self.ep.graph.nodes if n.op == "call_function")
                progress.start(self.name, total)
            self.lower_nodes(self.ep.graph.nodes, values, progress)
            output_node = self.ep.graph.output_node()
            if progress is not None:
                progress.finish(self.name)

            outputs: list[tuple[str, ir.Value]] = []
            with location(output_node):
                for out in sig.outputs:
                    outputs.append((out.name, self._output_value(out, values)))
                for state, handle, token in zip(sig.states, handles, tokens, strict=True):
                    update = self._state_update(values[state.update], handle)
                    outputs.append((state.name, cai.write_handle(handle, update, token)))
                graph.outputs_spec = outputs
            _erase_unused_constants(graph.operation.regions[0].blocks[0])
        self.builder.graph_names.append(self.name)

    def lower_nodes(
        self, nodes: Iterable[torch.fx.Node], values: ValueMap, progress: Any = None
    ) -> None:
        """Lower call_function nodes in order into the current insertion point.

        Placeholders must already be in ``values``.  ``progress``
        (a ``coreai_torch.progress.ConversionProgress``) hears of every lowered node.
        """
        for node in nodes:
            self.builder.nodes.setdefault(node.name, node)
            if node.op == "placeholder":
                if (
                    any(not self._is_folded(user) for user in node.users)
                    and node.name not in values
                    and node.name not in self.signature.scalar_inputs
                ):
                    raise ConversionError(f"internal error: no value for {describe(node)}")
            elif node.op in ("output", "get_attr"):
                continue  # sub-graphs and constants are fetched by the rules that use them
            elif node.op == "call_function":
                if self._is_folded(node):
                    self._emit_folded(node, values)
                else:
                    self.lower_node(node, values)
                if progress is not None:
                    progress.advance(self.name)
            else:
                raise ConversionError(f"{describe(node)}: FX op '{node.op}' is not supported")

    def lower_subgraph(
        self,
        gm: torch.fx.GraphModule,
        operands: Sequence[Any],
        outputs: Sequence[int] | None = None,
    ) -> list[ir.Value]:
        """Lower sub-graph ``gm`` (a branch or loop body of a higher-order op) at the current
        insertion point, its placeholders bound to ``operands``.

        Returns the values of its outputs -- only those listed in ``outputs`` when given, and
        then only the nodes they depend on are lowered.  Python scalars among the operands or
        outputs become 0-d constants (int ``si32``, float ``f32``, bool ``i1``, as symbolic
        sizes are).  Higher-order ops inside ``gm`` lower their own sub-graphs the same way.
        """
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(operands):
            raise ConversionError(
                f"sub-graph takes {len(placeholders)} operand(s) but {len(operands)} were given"
            )
        values = ValueMap(self)
        for node, operand in zip(placeholders, operands, strict=True):
            values[node.name] = operand if isinstance(operand, ir.Value) else _scalar(operand)
        returned = gm.graph.output_node().args[0]
        results = list(returned) if isinstance(returned, (list, tuple)) else [returned]
        if outputs is not None:
            results = [results[i] for i in outputs]
        needed: set[torch.fx.Node] = set()
        stack = [r for r in results if isinstance(r, torch.fx.Node)]
        while stack:
            node = stack.pop()
            if node not in needed:
                needed.add(node)
                stack.extend(node.all_input_nodes)
        self.lower_nodes([n for n in gm.graph.nodes if n in needed], values)
        return [values[r.name] if isinstance(r, torch.fx.Node) else _scalar(r) for r in results]

    def lower_node(self, node: torch.fx.Node, values: ValueMap) -> None:
        if node in self.dropped:
            val = node.meta["val"]
            values[node.name] = EmptyTensor(list(val.shape), val.dtype)
            return
        if node.target is operator.getitem:
            source, index = cast("tuple[torch.fx.Node, int]", node.args)
            result_key = f"{source.name}#{index}"
            if result_key not in values:
                raise LoweringError(
                    f"the lowering of '{lowering_key(source)}' gave no value for result {index} "
                    f"of {describe(source)}, which {describe(node)} uses"
                )
            values[node.name] = values[result_key]
            return
        key = qualified_name(node.target)  # a call_function node (lowering_key's key)
        rule = self.lowerings.get(key)
        if rule is None:  # a sub-graph op found late; report it the same way
            raise unsupported_op_error({key: [node]}, self.name)
        loc = location(node)
        self.builder.diagnostics.take()
        own = self.lowerings.is_own(key)
        if own:
            self.builder.ran_own_lowerings = True
            block = ir.InsertionPoint.current.block
            start = len(block.operations)
        try:
            with loc:
                result = rule(values, node, loc)
        except ConversionError as error:
            if own:
                _drop_foreign_uses(block, start, None)
            hint = hints.for_node(node)
            if node.name in str(error) and (hint is None or hint in str(error)):
                raise
            message = str(error) if node.name in str(error) else f"{describe(node)}: {error}"
            raise type(error)(hints.with_hint(message, hint)) from error
        except Exception as error:
            if own:
                _drop_foreign_uses(block, start, None)
            details = "; ".join(msg for _, msg in self.builder.diagnostics.take())
            reason = f"{type(error).__name__}: {error}" + (f" ({details})" if details else "")
            raise LoweringError(
                f"lowering failed for {describe(node)}: {reason}{_raised_in(rule, error)}"
            ) from error
        if own and _drop_foreign_uses(block, start, result):
            fn = inspect.unwrap(rule)
            code = getattr(fn, "__code__", None)
            where = f" at {code.co_filename}:{code.co_firstlineno}" if code else ""
            raise LoweringError(
                f"the lowering of '{key}' ({getattr(fn, '__qualname__', fn)}{where}) used a Core "
                f"AI value created during an earlier to_coreai() call (or for another graph) for "
                f"{describe(node)}; a value belongs to the conversion and graph that built it. "
                "Build values anew every time the lowering runs instead of keeping them between "
                "calls (keep numpy arrays and call cai.constant(...) each time), then call "
                "to_coreai() again."
            )
        self._store_result(node, key, result, values)

    # -- helpers ------------------------------------------------------------------------------

    def _is_folded(self, node: torch.fx.Node) -> bool:
        """Whether PyTorch computed ``node`` at conversion time.  Folding covers the top-level
        graph only: a node of a sub-graph (a branch or loop body) may have the name of a folded
        top-level node and is still lowered."""
        return node.graph is self.ep.graph and node.name in self.folded

    def _emit_folded(self, node: torch.fx.Node, values: ValueMap) -> None:
        """A node PyTorch evaluated at conversion time: a constant, if anything needs it."""
        if node.name not in self.fold_frontier:
            return
        value = self.folded[node.name]
        with location(node):
            if isinstance(value, (list, tuple)):
                for i, item in enumerate(value):
                    values[f"{node.name}#{i}"] = self.builder.weights.constant(item, node.name)
            else:
                values[node.name] = self.builder.weights.constant(value, node.name)

    def _store_result(self, node: torch.fx.Node, key: str, result: Any, values: ValueMap) -> None:
        """Check what a lowering returned and record it (``"name#i"`` for multi-result ops)."""
        val: Any = node.meta.get("val")
        multi = isinstance(val, (list, tuple))
        if result is None:
            if node.users:
                raise LoweringError(
                    f"the lowering of '{key}' returned None for {describe(node)}; it must "
                    "return a Core AI value (or a list of values for multi-output ops)"
                )
            return
        result = _as_value(result)
        if isinstance(result, (list, tuple, ir.OpResultList)):
            results = [_as_value(item) for item in result]
            expected = len(val) if multi else 1
            if len(results) != expected:
                raise LoweringError(
                    f"the lowering of '{key}' returned {len(results)} value(s) for "
                    f"{describe(node)}, but the op has {expected} result(s)"
                )
            if not multi:
                self._check(node, key, results[0], val)
                values[node.name] = results[0]
                return
            for i, item in enumerate(results):
                if item is None:
                    continue
                self._check(node, key, item, val[i])
                values[f"{node.name}#{i}"] = item
            return
        if multi and len(val) != 1:
            raise LoweringError(
                f"the lowering of '{key}' returned one value for {describe(node)}, but the "
                f"op has {len(val)} results; return a list of values"
            )
        self._check(node, key, result, val[0] if multi else val)
        values[node.name] = result
        if multi:
            values[f"{node.name}#0"] = result

    def _check(self, node: torch.fx.Node, key: str, value: Any, val: Any) -> None:
        if not isinstance(value, ir.Value):
            raise LoweringError(
                f"the lowering of '{key}' returned {type(value).__name__} for {describe(node)}; "
                "it must return Core AI values (coreai._compiler.ir.Value)"
            )
        if not isinstance(val, torch.Tensor) or not ir.RankedTensorType.isinstance(value.type):
            return
        got = ir.RankedTensorType(value.type)
        expected_dtype = val.dtype
        try:
            got_dtype = dtypes.to_torch(got.element_type)
        except TypeError:
            got_dtype = None
        expected_shape = [d if isinstance(d, int) else None for d in val.shape]
        got_shape = [None if got.is_dynamic_dim(i) else got.shape[i] for i in range(got.rank)]
        shapes_agree = len(got_shape) == len(expected_shape) and all(
            a is None or b is None or a == b for a, b in zip(got_shape, expected_shape, strict=True)
        )
        if got_dtype != expected_dtype or not shapes_agree:
            raise LoweringError(
                f"the lowering of '{key}' produced {got} for {describe(node)}, but PyTorch "
                f"computes {tuple(expected_shape)} {expected_dtype}"
            )

    def _output_value(self, out: Any, values: ValueMap) -> ir.Value:
        if out.node is not None:
            return values[out.node]
        constant = out.constant
        if isinstance(constant, torch.Tensor):
            return self.builder.weights.constant(constant, out.name)
        if isinstance(constant, (bool, int, float)):
            dtype = (
                torch.bool
                if isinstance(constant, bool)
                else (torch.int64 if isinstance(constant, int) else torch.float32)
            )
            return cai.constant(
                torch.tensor(constant, dtype=dtype).numpy(), dtype=dtypes.to_mlir(dtype)
            )
        raise ConversionError(
            f"output '{out.name}' is a Python {type(constant).__name__} ({constant!r}); Core AI "
            "programs can only return tensors (and numbers): return it from a wrapper outside "
            "the exported module instead"
        )

    def _state_update(self, update: ir.Value, handle: ir.Value) -> ir.Value:
        inner = cai.HandleType(handle.type).inner_type
        if update.type != inner:
            update = cai.cast(update, ir.RankedTensorType(inner))
        return update


#: ops without effects that a graph may be left holding unused
_DEAD_IF_UNUSED = frozenset({"coreai.constant", "coreai.cast"})


def _erase_unused_constants(block: ir.Block) -> None:
    """Erase constants (and casts of them) nothing reads: e.g. the original tensors of a
    weight a lowering stored compressed (``lowerings/quantized.py``), which would otherwise
    be saved in the asset of an unoptimized program."""
    for op in reversed(list(block.operations)):
        operation = op.operation
        if operation.name in _DEAD_IF_UNUSED and not any(
            list(result.uses) for result in operation.results
        ):
            operation.erase()


def _enclosing_graph(op: Any) -> ir.Operation | None:
    """The ``coreai.graph`` op that contains ``op`` (or is it), None outside any graph."""
    op = op.operation if op is not None else None
    while op is not None and op.name != "coreai.graph":
        parent = op.parent
        op = parent.operation if parent is not None else None
    return op


def _graph_of(value: ir.Value) -> ir.Operation | None:
    """The ``coreai.graph`` a value is defined in (a block argument's: its block's)."""
    owner = value.owner
    return _enclosing_graph(owner.owner if isinstance(owner, ir.Block) else owner)


def _drop_foreign_uses(block: ir.Block, start: int, result: Any) -> bool:
    """Whether a user lowering used values of another graph (of an earlier conversion, or
    another entry point): as operands of the ops it added to ``block`` after position
    ``start``, or in ``result``.  Those ops are erased so that no op of this module keeps
    using another graph's values (the converter keeps the modules of earlier conversions
    alive, so the check never touches freed IR)."""
    graph = _enclosing_graph(block.owner)
    ops = block.operations  # indexing walks the block in C; no Python object per old op
    added = [ops[i] for i in range(start, len(ops))]
    operands: list[ir.Value] = []

    def collect(op: ir.Operation) -> ir.WalkResult:
        operands.extend(op.operands)
        return ir.WalkResult.ADVANCE

    for op in added:
        op.operation.walk(collect)
    returned = result if isinstance(result, (list, tuple, ir.OpResultList)) else [result]
    values = [v for v in map(_as_value, returned) if isinstance(v, ir.Value)]
    foreign = any(_graph_of(v) != graph for v in operands + values)
    if foreign:
        for op in reversed(added):
            op.operation.erase()
    return foreign


def _scalar(value: object) -> ir.Value:
    """A Python scalar as a 0-d constant (bool ``i1``, int ``si32``, float ``f32``)."""
    if isinstance(value, bool):
        return cai.constant(np.bool_(value))
    if isinstance(value, int):
        return cai.constant(np.int32(value))
    if isinstance(value, float):
        return cai.constant(np.float32(value))
    raise ConversionError(f"sub-graph operand {value!r} is neither a tensor nor a scalar")


def _as_value(value: Any) -> Any:
    """Unwrap what op builders may return: a facade value or a single-result op."""
    if isinstance(value, ir.Value):
        return value
    to_mlir = getattr(value, "_to_mlir", None)
    if callable(to_mlir):
        return to_mlir()
    if isinstance(value, ir.OpView) and len(value.results) == 1:
        return value.result
    return value


def _raised_in(rule: Any, error: BaseException) -> str:
    """`` (raised in lower_x at file.py:12)``: the innermost line of the lowering itself."""
    fn = inspect.unwrap(rule)
    code = getattr(fn, "__code__", None)
    if code is None:
        return ""
    frames = traceback.extract_tb(error.__traceback__)
    own = [f for f in frames if f.filename == code.co_filename]
    if not own:
        return ""
    frame = own[-1]
    where = f"{frame.filename}:{frame.lineno}: {frame.line}"
    return f" (raised in lowering {fn.__qualname__} at {where})"


def op_histogram(ep: ExportedProgram) -> Counter[str]:
    """How often each op occurs in the program (sub-graphs included)."""
    counts: Counter[str] = Counter()
    for gm in _graph_modules(ep):
        for node in gm.graph.nodes:
            key = lowering_key(node)
            if key:
                counts[key] += 1
    return counts
