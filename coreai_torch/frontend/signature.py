"""Graph signature -> the inputs, outputs, states and weights of a Core AI graph.

Placeholders are classified from ``ExportedProgram.graph_signature`` (never from their names):

* user inputs that are not mutated           -> graph inputs      (``input_names``)
* user outputs                               -> graph outputs     (``output_names``)
* mutated buffers, then mutated user inputs  -> states (handles)  (``state_names``)
* parameters, other buffers, constants       -> weights (resource constants)

Default names follow the FX graph (seed 000 "IO naming"): a placeholder's ``node.name`` for
inputs and states, the returned node's ``name`` for outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    ConstantArgument,
    InputKind,
    OutputKind,
    TensorArgument,
)

from coreai_torch.errors import InvalidSignatureError
from coreai_torch.frontend.sizes import InputSizes, input_sizes


@dataclass(frozen=True)
class GraphInput:
    """A non-state user input: placeholder ``node`` exposed as ``name``."""

    node: str
    name: str


@dataclass(frozen=True)
class GraphState:
    """A state: placeholder ``node`` read at the start, ``update`` written back at the end."""

    node: str
    name: str
    update: str
    kind: str  # "buffer" or "user_input"
    target: str  # buffer FQN or user input name


@dataclass(frozen=True)
class GraphOutput:
    """A user output: the value of FX node ``node`` (or a Python constant) exposed as ``name``."""

    node: str | None
    name: str
    constant: object = None


@dataclass
class ProgramSignature:
    """Everything the importer needs to know about a program's boundary."""

    inputs: list[GraphInput] = field(default_factory=list)
    states: list[GraphState] = field(default_factory=list)
    outputs: list[GraphOutput] = field(default_factory=list)
    #: placeholder name -> tensor (parameters, non-mutated buffers, lifted constants)
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    #: placeholder name -> FQN of the weight in the module ("fc.weight")
    weight_targets: dict[str, str] = field(default_factory=dict)
    #: user input placeholders that are not tensors (specialized away by torch.export)
    scalar_inputs: dict[str, object] = field(default_factory=dict)
    #: every user input placeholder, in the order of the flattened forward() arguments
    user_inputs: list[str] = field(default_factory=list)
    #: state name -> the buffer's value at export time (buffer states only)
    initial_states: dict[str, torch.Tensor] = field(default_factory=dict)
    #: symbolic sizes the runtime inputs determine (checked by ``runtime.Session``)
    sizes: InputSizes | None = None

    def feeds(self, flat_args: Sequence[Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Split flattened forward() arguments into runtime ``(inputs, states)`` by name."""
        by_node = dict(zip(self.user_inputs, flat_args, strict=True))
        inputs = {i.name: by_node[i.node] for i in self.inputs}
        states = {s.name: by_node[s.node] for s in self.states if s.kind == "user_input"}
        return inputs, states

    @property
    def io_names(self) -> list[str]:
        return (
            [s.name for s in self.states]
            + [i.name for i in self.inputs]
            + [o.name for o in self.outputs]
        )


def _check_names(
    names: Sequence[str] | None, expected: int, what: str, meaning: str, defaults: list[str]
) -> list[str] | None:
    if names is None:
        return None
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise InvalidSignatureError(
            f"{what} must be a sequence of strings, got {type(names).__name__} {names!r}"
        )
    names = list(names)
    for name in names:
        if not isinstance(name, str):
            raise InvalidSignatureError(
                f"{what} must contain only strings, got {type(name).__name__} {name!r}"
            )
        if not name:
            raise InvalidSignatureError(f"{what} contains an empty name: {names!r}")
    if len(names) != expected:
        raise InvalidSignatureError(
            f"{what} has {len(names)} name(s) but the program has {expected} {meaning}: "
            f"{defaults} (default names). Pass exactly {expected} name(s)."
        )
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise InvalidSignatureError(
                f"{what} contains '{name}' more than once: {names!r}; every input, output and "
                "state needs its own name"
            )
        seen.add(name)
    return names


def _unique(name: str, taken: set[str]) -> str:
    if name not in taken:
        return name
    k = 1
    while f"{name}_{k}" in taken:
        k += 1
    return f"{name}_{k}"


def analyze_signature(
    ep: ExportedProgram,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    state_names: Sequence[str] | None = None,
) -> ProgramSignature:
    """Classify the program's placeholders and outputs and apply the user's names."""
    sig = ep.graph_signature
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    output_node = next(n for n in ep.graph.nodes if n.op == "output")
    output_args = list(output_node.args[0])

    result = ProgramSignature()
    mutated_buffers = {  # buffer FQN -> mutation output node
        spec.target: output_args[i].name
        for i, spec in enumerate(sig.output_specs)
        if spec.kind == OutputKind.BUFFER_MUTATION
    }
    mutated_inputs = {  # user input name -> mutation output node
        spec.target: output_args[i].name
        for i, spec in enumerate(sig.output_specs)
        if spec.kind == OutputKind.USER_INPUT_MUTATION
    }
    for i, spec in enumerate(sig.output_specs):
        if spec.kind == OutputKind.PARAMETER_MUTATION:
            raise InvalidSignatureError(
                f"the program mutates parameter '{spec.target}' in place; Core AI models only "
                "update buffers and inputs. Register it as a buffer or avoid the in-place update."
            )
        if spec.kind in (
            OutputKind.LOSS_OUTPUT,
            OutputKind.GRADIENT_TO_PARAMETER,
            OutputKind.GRADIENT_TO_USER_INPUT,
        ):
            raise InvalidSignatureError(
                f"output {i} is a training output ({spec.kind.name}); export the model in "
                "inference mode (model.eval(), no joint/backward graph)."
            )

    buffer_states: list[GraphState] = []
    input_states: list[GraphState] = []
    plain_inputs: list[str] = []
    for spec in sig.input_specs:
        name = spec.arg.name
        if spec.kind == InputKind.USER_INPUT:
            result.user_inputs.append(name)
            node = placeholders[name]
            val = node.meta.get("val")
            if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                plain_inputs.append(name)  # a dynamic Python scalar: a 0-d runtime input
            elif not isinstance(val, torch.Tensor):
                result.scalar_inputs[name] = val
            elif name in mutated_inputs:
                input_states.append(
                    GraphState(name, name, mutated_inputs[name], "user_input", name)
                )
            else:
                plain_inputs.append(name)
        elif spec.kind == InputKind.BUFFER and spec.target in mutated_buffers:
            buffer_states.append(
                GraphState(name, name, mutated_buffers[spec.target], "buffer", spec.target)
            )
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            result.weights[name] = (
                ep.state_dict[spec.target]
                if spec.target in ep.state_dict
                else ep.constants[spec.target]
            )
            result.weight_targets[name] = spec.target
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            result.weights[name] = ep.constants[spec.target]
            result.weight_targets[name] = spec.target
        else:
            raise InvalidSignatureError(
                f"input '{name}' has kind {spec.kind.name}, which Core AI programs cannot "
                "represent (custom objects and effect tokens are not supported)."
            )

    user_outputs: list[tuple[str | None, object]] = []
    for i, spec in enumerate(sig.output_specs):
        if spec.kind != OutputKind.USER_OUTPUT:
            continue
        arg = output_args[i]
        if isinstance(arg, torch.fx.Node):
            user_outputs.append((arg.name, None))
        elif isinstance(spec.arg, ConstantArgument) or not isinstance(spec.arg, TensorArgument):
            user_outputs.append((None, arg))
        else:  # pragma: no cover - defensive
            user_outputs.append((None, arg))

    states = buffer_states + input_states
    given_states = _check_names(
        state_names,
        len(states),
        "state_names",
        "state(s) (mutated buffers, then mutated user inputs)",
        [s.name for s in states],
    )
    given_inputs = _check_names(
        input_names, len(plain_inputs), "input_names", "non-state user input(s)", plain_inputs
    )
    default_outputs = [node or f"output_{k}" for k, (node, _) in enumerate(user_outputs)]
    given_outputs = _check_names(
        output_names, len(user_outputs), "output_names", "user output(s)", default_outputs
    )

    # Names given by the user must not collide across inputs / outputs / states.
    groups = {
        "state_names": given_states or [],
        "input_names": given_inputs or [],
        "output_names": given_outputs or [],
    }
    owner: dict[str, str] = {}
    for what, names in groups.items():
        for name in names:
            if name in owner:
                raise InvalidSignatureError(
                    f"name '{name}' is used in both {owner[name]} and {what}; every input, "
                    "output and state of an entry point needs its own name."
                )
            owner[name] = what

    taken: set[str] = set(owner)

    def default(name: str, what: str) -> str:
        if name in owner:
            raise InvalidSignatureError(
                f"the default name '{name}' of one of the {what} collides with the name "
                f"'{name}' given in {owner[name]}; pass {what} explicitly as well."
            )
        name = _unique(name, taken)  # two defaults may coincide (`return x, x`)
        return name

    for k, state in enumerate(states):
        name = given_states[k] if given_states else default(state.name, "state_names")
        taken.add(name)
        result.states.append(GraphState(state.node, name, state.update, state.kind, state.target))
        if state.kind == "buffer":
            source = ep.state_dict if state.target in ep.state_dict else ep.constants
            result.initial_states[name] = source[state.target]
    for k, node_name in enumerate(plain_inputs):
        name = given_inputs[k] if given_inputs else default(node_name, "input_names")
        taken.add(name)
        result.inputs.append(GraphInput(node_name, name))
    for k, (output_node, constant) in enumerate(user_outputs):
        name = given_outputs[k] if given_outputs else default(default_outputs[k], "output_names")
        taken.add(name)
        result.outputs.append(GraphOutput(output_node, name, constant))
    result.sizes = input_sizes(ep, {i.node: i.name for i in result.inputs})
    return result
