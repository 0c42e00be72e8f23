"""Externalized submodules as private graphs: the lowering of ``coreai_torch::externalized``.

The torch side (:mod:`coreai_torch.frontend.externalize`) keeps each externalized submodule a
single op of the exported program and exports it on its own; here that program is lowered
into a private ``noinline`` graph (a composite op for an ``ExternalizeSpec`` with
``composite_op_name``) and each call becomes a ``coreai.invoke`` of it.  Identical graphs are
emitted once; externalized modules may contain other externalized modules.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind, TensorArgument

from coreai_torch import dtypes
from coreai_torch._mlir import ir
from coreai_torch.errors import (
    ConversionError,
    ExternalizationError,
    RuntimeHazardError,
    UnsupportedOpError,
)
from coreai_torch.frontend.externalize import (
    ExternalizationPlan,
    ExternalizedCall,
    ExternalizedModule,
    SubProgram,
    call_for_key,
)
from coreai_torch.frontend.fusions import fuse_patterns
from coreai_torch.frontend.half_precision import rewrite_program
from coreai_torch.frontend.signature import ProgramSignature
from coreai_torch.importer.graph import (
    GraphImporter,
    ValueMap,
    find_unsupported,
    find_zero_size,
    unsupported_op_error,
)
from coreai_torch.ir import composite
from coreai_torch.locations import describe
from coreai_torch.lowerings.registry import raw_lowering

_LOCAL = threading.local()


def import_externalized(plans: Sequence[ExternalizationPlan], importer: GraphImporter) -> None:
    """Run ``importer`` on a staged program whose externalized calls lower to private graphs
    (``plans``: the staged program's externalization plan)."""
    (plan,) = plans
    with plan.installed():
        importer.run()


# ------------------------------------------------------------------------------ lowering ---


def _graph_for(
    call: ExternalizedCall, importer: Any, operands: Sequence[Any], results: Sequence[Any]
) -> tuple[str, list[int]]:
    """Build (once per conversion) the private graph of ``call``.

    ``operands`` are the op's operand values and ``results`` the example values of its
    results (their dtypes are the graph's in a half-precision conversion).  Returns the graph's
    name and, for each graph argument, the index of the op operand feeding it.
    """
    memo = composite.graphs().memo
    found = memo.get(("externalized", call.key))
    if found is not None:
        return found

    target = call.target
    spec = target.spec
    with target.plan.installed():
        sub = call.program()
    ep = sub.ep
    label = target.path or type(target.module).__name__
    missing = find_unsupported(ep, importer.lowerings)
    if missing:
        error = unsupported_op_error(missing, "")
        raise UnsupportedOpError(
            str(error).replace("entry point ''", f"externalized module {target.label}", 1),
            ops=error.ops,
        )
    zero = find_zero_size(ep)
    if zero:
        listed = "\n".join(f"  - {describe(n)}" for n in zero[:10])
        raise RuntimeHazardError(
            f"externalized module {target.label}: {len(zero)} value(s) have zero elements, "
            f"which the Core AI runtime cannot execute:\n{listed}"
        )

    n_slots = len(call.input_names)
    mutated_state = {ref for kind, ref in call.mutated if kind == "state"}
    # graph arguments: (name, operand index)
    arguments: list[tuple[str, int]] = [(n, i) for i, n in enumerate(call.input_names)]
    state_index = {name: n_slots + i for i, name in enumerate(target.state_names)}
    for name in target.state_names:
        if spec.is_composite or name in mutated_state:
            arguments.append((name, state_index[name]))
    names = _unique_names([n for n, _ in arguments])
    arg_position = {index: k for k, (_, index) in enumerate(arguments)}
    precision = importer.builder.precision
    if precision.is_half:
        ep = _in_precision(sub, call, importer, arguments, operands, results)
    ep = fuse_patterns(ep, importer.lowerings.is_free_of_own_rules)

    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    slot_types = [_placeholder_type(placeholders[p]) for p in sub.user_inputs]
    types: list[ir.Type] = []
    for _, index in arguments:
        if index < n_slots:
            types.append(slot_types[index])
        else:
            t = target.state_tensor(target.state_names[index - n_slots])
            dtype = dtypes.dtype_of(operands[index]) if precision.is_half else t.dtype
            types.append(dtypes.tensor_type(list(t.shape), dtype))

    def body(*args: ir.Value) -> list[ir.Value]:
        sub_importer = GraphImporter(
            importer.builder, ep, ProgramSignature(), importer.lowerings, label
        )
        values = ValueMap(sub_importer)
        for slot, ph in enumerate(sub.user_inputs):
            values[ph] = args[arg_position[slot]]
        updates: dict[tuple[str, Any], str] = {}
        output_nodes = list(next(n for n in ep.graph.nodes if n.op == "output").args[0])
        for spec_in in ep.graph_signature.input_specs:
            ph = spec_in.arg.name
            if spec_in.kind in (InputKind.PARAMETER, InputKind.BUFFER):
                local = _local_name(spec_in.target)
                index = state_index.get(local)
                if index is not None and index in arg_position:
                    values[ph] = args[arg_position[index]]
                elif placeholders[ph].users:
                    tensor = (
                        target.state_tensor(local)
                        if index is not None
                        else ep.state_dict.get(spec_in.target, ep.constants.get(spec_in.target))
                    )
                    stored = placeholders[ph].meta["val"].dtype  # a half-precision copy?
                    tensor = importer.builder.half_weights.get(tensor, stored)
                    with ir.Location.unknown():
                        values[ph] = importer.builder.weights.constant(
                            tensor, ".".join(x for x in (target.path, local) if x)
                        )
            elif spec_in.kind == InputKind.CONSTANT_TENSOR:
                if placeholders[ph].users:
                    values[ph] = importer.builder.weights.constant(
                        ep.constants[spec_in.target], f"{label}.{spec_in.target}"
                    )
            elif spec_in.kind != InputKind.USER_INPUT:
                raise ExternalizationError(
                    f"externalized module {target.label} has an input of kind "
                    f"{spec_in.kind.name}, which Core AI graphs cannot represent"
                )
        outputs: list[ir.Value] = []
        for i, spec_out in enumerate(ep.graph_signature.output_specs):
            node = output_nodes[i]
            if spec_out.kind == OutputKind.USER_OUTPUT:
                if isinstance(spec_out.arg, TensorArgument):
                    outputs.append(node.name)
            elif spec_out.kind == OutputKind.BUFFER_MUTATION:
                updates[("state", _local_name(spec_out.target))] = node.name
            elif spec_out.kind == OutputKind.USER_INPUT_MUTATION:
                updates[("arg", sub.user_inputs.index(spec_out.target))] = node.name
            else:
                raise ExternalizationError(
                    f"externalized module {target.label} has an output of kind "
                    f"{spec_out.kind.name}, which Core AI graphs cannot represent"
                )
        with _building(sub.owner, target):
            sub_importer.lower_nodes(ep.graph.nodes, values)
        if len(outputs) != call.num_outputs or set(updates) != set(call.mutated):
            raise ExternalizationError(
                f"the export of {target.label} on its own does not match its call in the "
                f"model ({len(outputs)} vs {call.num_outputs} outputs, mutations "
                f"{sorted(map(str, updates))} vs {sorted(map(str, call.mutated))})"
            )
        return [values[n] for n in outputs] + [values[updates[m]] for m in call.mutated]

    output_names = list(call.output_names) + [
        f"{names[arg_position[state_index[ref]]] if kind == 'state' else call.input_names[ref]}_out"
        for kind, ref in call.mutated
    ]
    if spec.is_composite:
        name = ".".join(x for x in (target.path, spec.composite_op_name) if x)
    else:
        name = target.path or type(target.module).__name__
    graph = composite.build_graph(
        name,
        types,
        names,
        body,
        op_name=spec.composite_op_name,
        op_attrs=target.op_attrs() if spec.is_composite else None,
        output_names=_unique_names(output_names),
        # seed 004: a composite op is a private graph, a simple boundary a plain noinline one
        private=spec.is_composite,
    )
    found = (graph, [index for _, index in arguments])
    memo[("externalized", call.key)] = found
    return found


def _placeholder_type(node: torch.fx.Node) -> ir.Type:
    val = node.meta["val"]
    return dtypes.tensor_type([d if isinstance(d, int) else None for d in val.shape], val.dtype)


def _local_name(fqn: str) -> str:
    return fqn[len("target.") :] if fqn.startswith("target.") else fqn


def _unique_names(names: list[str]) -> list[str]:
    seen: set[str] = set()
    result = []
    for name in names:
        candidate, k = name, 1
        while candidate in seen:
            candidate = f"{name}_{k}"
            k += 1
        seen.add(candidate)
        result.append(candidate)
    return result


def _remap(call: ExternalizedCall) -> ExternalizedCall:
    """``call`` as made by the instance whose graph is being built.

    A program exported once serves every identically configured instance; the externalized
    calls nested in it belong to the exported instance and are redirected here to the
    matching submodules of the instance being converted.
    """
    stack = getattr(_LOCAL, "owners", None)
    if not stack:
        return call
    owner, target = stack[-1]
    if owner is target:
        return call
    prefix = f"{owner.path}." if owner.path else ""
    path = call.target.path
    if path != owner.path and not path.startswith(prefix):
        return call
    relative = path[len(prefix) :] if path != owner.path else ""
    module = target.module.get_submodule(relative) if relative else target.module
    counterpart = target.plan.by_module.get(id(module))
    if counterpart is None or type(counterpart.module) is not type(call.target.module):
        raise ExternalizationError(
            f"internal error: no counterpart of {call.target.label} in {target.label}"
        )
    return counterpart.counterpart(call)


@contextmanager
def _building(owner: ExternalizedModule, target: ExternalizedModule) -> Iterator[None]:
    if not hasattr(_LOCAL, "owners"):
        _LOCAL.owners = []
    _LOCAL.owners.append((owner, target))
    try:
        yield
    finally:
        _LOCAL.owners.pop()


def _lower_externalized(
    values_map: dict[str, ir.Value], node: torch.fx.Node, loc: ir.Location
) -> list[ir.Value]:
    """Lowering of ``coreai_torch::externalized``: invoke the call's private graph."""
    # (operands, call key): the op's schema (coreai_torch/frontend/externalize.py)
    operand_nodes = cast("list[torch.fx.Node | None]", node.args[0])
    call = _remap(call_for_key(cast(str, node.args[1])))
    importer = getattr(values_map, "importer", None)
    if importer is None:
        raise ConversionError("externalized modules can only be lowered by TorchConverter")
    values = [values_map[n.name] if n is not None else None for n in operand_nodes]
    graph, operand_indices = _graph_for(call, importer, values, node.meta["val"])
    return composite.call_graph(graph, [values[i] for i in operand_indices])


def _in_precision(
    sub: SubProgram,
    call: ExternalizedCall,
    importer: Any,
    arguments: Sequence[tuple[str, int]],
    operands: Sequence[Any],
    results: Sequence[Any],
) -> ExportedProgram:
    """The sub-program of ``call`` rewritten to the conversion's precision: its arguments
    typed like the operands the caller passes, its results like the caller expects."""

    policy = importer.builder.precision
    ep = sub.ep
    target = call.target
    n_slots = len(call.input_names)
    fed = {index for _, index in arguments}
    state_index = {name: n_slots + i for i, name in enumerate(target.state_names)}
    inputs: dict[str, torch.dtype] = {}
    for spec in ep.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            index = sub.user_inputs.index(spec.arg.name)
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            index = state_index.get(_local_name(spec.target), -1)
        else:
            continue
        if index in fed and operands[index] is not None:
            dtype = dtypes.dtype_of(operands[index])
            if dtype.is_floating_point:
                inputs[spec.arg.name] = dtype
    position = {ref: call.num_outputs + k for k, ref in enumerate(call.mutated)}
    outputs: list[torch.dtype | None] = []
    user = 0
    for spec in ep.graph_signature.output_specs:
        if spec.kind == OutputKind.USER_OUTPUT and isinstance(spec.arg, TensorArgument):
            k, user = user, user + 1
        elif spec.kind == OutputKind.BUFFER_MUTATION:
            k = position[("state", _local_name(spec.target))]
        elif spec.kind == OutputKind.USER_INPUT_MUTATION:
            k = position[("arg", sub.user_inputs.index(spec.target))]
        else:
            outputs.append(None)
            continue
        val = results[k]
        floating = isinstance(val, torch.Tensor) and val.dtype.is_floating_point
        outputs.append(val.dtype if floating else None)
    return rewrite_program(
        ep,
        policy,
        importer.builder.half_weights,
        inputs=inputs,
        flows={name for name, dtype in inputs.items() if dtype == policy.compute},
        outputs=outputs,
        usable=importer.lowerings.is_free_of_own_rules,
    )


def _register() -> None:
    raw_lowering("coreai_torch::externalized.default")(_lower_externalized)


_register()
