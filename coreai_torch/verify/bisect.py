"""Find the first FX node whose converted value diverges from PyTorch.

    found = find_divergence(model, (x,))          # or an ExportedProgram; converter=... for
    print(found)                                  # a converter with your own lowerings

How: the nodes of the (decomposed) program are put in topological order and the search
bisects over prefixes of that order.  A *probe* converts the prefix ``nodes[:k+1]`` as its own
program whose outputs are every tensor the prefix computes that a later node (or the program's
output) still needs, runs it on the Core AI runtime and compares those tensors with PyTorch's
(computed by interpreting the same graph).  The first probe that disagrees after a probe that
agreed ends at the culprit: every input of node ``k`` matched one probe earlier, and its own
value does not.  That takes about log2(number of nodes) conversions.
"""

from __future__ import annotations

import contextlib
import copy
import math
import operator
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    OutputKind,
    OutputSpec,
    TensorArgument,
)

from coreai_torch.converter import TorchConverter
from coreai_torch.errors import ConversionError
from coreai_torch.frontend.export import decomposed, export_decomposed
from coreai_torch.locations import describe, module_path, qualified_name, user_frame
from coreai_torch.precision import from_spec
from coreai_torch.runtime import Session
from coreai_torch.verify.compare import OutputError, compare, half_tolerance

#: dtypes the Core AI runtime can return from a program
_RUNTIME_DTYPES = {
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
}


@dataclass
class Divergence:
    """The first node whose converted value differs from PyTorch's."""

    #: the FX node (of the decomposed program) that diverges
    node: torch.fx.Node
    #: how far its value is from PyTorch
    error: OutputError
    #: its tensor inputs and how far they were from PyTorch (all within tolerance)
    inputs: list[OutputError] = field(default_factory=list)
    #: number of prefix programs converted and run to find it
    probes: int = 0
    #: for a multi-result op: which of its results diverges
    result: int | None = None
    #: the precision the program was converted in (``"fp16"``/``"bf16"``; None: as exported)
    precision: str | None = None

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def op(self) -> str:
        return qualified_name(self.node.target)

    @property
    def source(self) -> str:
        """The user's source line that created the node (``file:line in fn: code``)."""
        frame = user_frame(self.node)
        return str(frame) if frame else ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.name,
            "op": self.op,
            "module": module_path(self.node),
            "source": self.source,
            "max_abs": self.error.max_abs,
            "max_rel": self.error.max_rel,
            "shape": list(self.error.shape),
            "dtype": self.error.dtype,
            "problem": self.error.problem,
            "inputs": [{"node": e.name, "max_abs": e.max_abs} for e in self.inputs],
            "probes": self.probes,
            "result": self.result,
            "precision": self.precision,
            "hint": self.hint,
        }

    @property
    def hint(self) -> str:
        """For a half-precision program: how to keep the diverging node in float32."""
        if self.precision is None:
            return ""
        op = self.op.rsplit(".", 1)[0]
        path = module_path(self.node)
        where = f" or keep_fp32_modules=[{path!r}] (its module)" if path else ""
        return (
            f"keep it in float32: TorchConverter(compute_precision=..., keep_fp32_ops={{{op!r}}})"
            f"{where}, or keep_fp32=<a predicate on the FX node>"
        )

    def __str__(self) -> str:
        e = self.error
        lines = [
            f"first diverging node: {describe(self.node)}",
            f"  {'value' if self.result is None else f'result {self.result}'} "
            f"{e.dtype} {e.shape}: max|err| {e.max_abs:.3e}, max rel {e.max_rel:.3e}"
            + (f" ({e.problem})" if e.problem else ""),
        ]
        if self.inputs:
            matched = ", ".join(f"{i.name} ({i.max_abs:.1e})" for i in self.inputs)
            lines.append(f"  its inputs match PyTorch: {matched}")
        lines.append(f"  found with {self.probes} probe conversion(s)")
        if self.hint:
            lines.append(f"  {self.precision} program: {self.hint}")
        return "\n".join(lines)


def find_divergence(
    model_or_ep: nn.Module | ExportedProgram,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None = None,
    *,
    converter: Any = None,
    atol: float = 1e-4,
    rtol: float = 1e-4,
    optimize: bool = True,
    log: Callable[[str], None] | None = None,
    precision: Any = None,
    tolerance: float | None = None,
) -> Divergence | None:
    """The first FX node (in topological order) whose value in the converted program is not
    within ``atol + rtol * |expected|`` of PyTorch's, or None when every output matches.

    ``model_or_ep`` is an ``nn.Module`` (exported and decomposed here) or an
    ``ExportedProgram`` (decomposed here if needed); ``converter`` supplies the lowerings
    (its own registrations and Metal kernels) and the precision policy (it is not modified).
    ``log`` receives one line per probe.

    Half precision: with ``precision`` (``"fp16"``, ``"bf16"``, a ``Precision``; default the
    converter's) the prefixes are converted in that precision and compared with PyTorch in
    float32; ``tolerance`` then replaces ``atol``/``rtol``: a value diverges when it
    overflows to inf/NaN or is off by more than ``tolerance * max(1, max|expected|)``
    (default: :data:`coreai_torch.verify.HALF_TOLERANCE` of the dtype).
    """
    if isinstance(model_or_ep, ExportedProgram):
        ep, _ = decomposed(model_or_ep)
    elif isinstance(model_or_ep, nn.Module):
        ep = export_decomposed(model_or_ep, args, kwargs)
    else:
        raise TypeError(
            "find_divergence() expects an nn.Module or a torch.export.ExportedProgram, got "
            f"{type(model_or_ep).__name__}"
        )
    search = _Search(ep, args, kwargs, converter, atol, rtol, optimize, log)
    search.set_precision(precision, tolerance)
    return search.run()


class _Search:
    def __init__(
        self,
        ep: ExportedProgram,
        args: Sequence[Any],
        kwargs: Mapping[str, Any] | None,
        converter: Any,
        atol: float,
        rtol: float,
        optimize: bool,
        log: Callable[[str], None] | None,
    ) -> None:
        self.ep = ep
        self.flat_args = flat_user_args(ep, args, kwargs)
        self.converter = converter
        self.atol, self.rtol, self.optimize = atol, rtol, optimize
        self.log = log or (lambda _line: None)
        self.precision = getattr(converter, "precision", None)
        #: compare relative to each value's peak (half-precision programs), else None
        self.tolerance: float | None = None
        self.probes = 0
        self.nodes = [n for n in ep.graph.nodes if n.op == "call_function"]
        self.position = {n: i for i, n in enumerate(self.nodes)}
        # the last position at which each node's value is still needed (len = the output)
        self.last_use: dict[torch.fx.Node, int] = {}
        for node in self.nodes:
            uses = [self.position.get(u, len(self.nodes)) for u in node.users]
            self.last_use[node] = max(uses, default=-1)

    def set_precision(self, precision: Any, tolerance: float | None) -> None:
        if precision is not None:
            self.precision = from_spec(precision)
        if self.precision is not None and self.precision.is_half:
            self.tolerance = tolerance or half_tolerance(self.precision)
        elif tolerance is not None:
            self.tolerance = tolerance

    def compare(self, name: str, expected: Any, actual: Any) -> OutputError:
        if self.tolerance is None:
            return compare(name, expected, actual, atol=self.atol, rtol=self.rtol)
        peak = float(expected.detach().double().abs().max()) if expected.numel() else 0.0
        peak = peak if math.isfinite(peak) else 1.0
        return compare(name, expected, actual, atol=self.tolerance * max(1.0, peak), rtol=0.0)

    def frontier(self, k: int) -> list[torch.fx.Node]:
        """The tensors computed by ``nodes[:k+1]`` that something after ``k`` still needs."""
        return [n for n in self.nodes[: k + 1] if self.last_use[n] > k and _probeable(n)]

    def run(self) -> Divergence | None:
        last = len(self.nodes) - 1
        if last < 0:
            return None
        errors = self.probe(last)
        if all(e.ok for e in errors.values()):
            return None
        lo, hi, hi_errors = -1, last, errors
        lo_errors: dict[str, OutputError] = {}
        while hi - lo > 1:
            mid = (lo + hi) // 2
            errors = self.probe(mid)
            if all(e.ok for e in errors.values()):
                lo = mid
                lo_errors.update(errors)  # every value checked by a matching probe is right
            else:
                hi, hi_errors = mid, errors
        node = self.nodes[hi]
        culprit = hi_errors.get(node.name)
        if culprit is None or culprit.ok:  # e.g. a multi-result op: blame the first bad value
            culprit = next(e for e in hi_errors.values() if not e.ok)
            node = next(n for n in self.nodes if n.name == culprit.name)
        result = None
        if node.target is operator.getitem:
            node, result = node.args
        inputs = [lo_errors[a.name] for a in node.all_input_nodes if a.name in lo_errors]
        precision = self.precision
        name = precision.name if precision is not None and precision.is_half else None
        return Divergence(node, culprit, inputs, self.probes, result, name)

    def probe(self, k: int) -> dict[str, OutputError]:
        """Convert ``nodes[:k+1]`` with the frontier as outputs, run it, compare."""
        outputs = self.frontier(k)
        if not outputs:
            return {}
        self.probes += 1
        expected = self.reference(outputs)
        program_ep = prefix_program(self.ep, outputs)
        try:
            actual = self._run(program_ep)
        except ConversionError:
            raise
        except Exception as error:
            raise ConversionError(
                f"probe up to {describe(self.nodes[k])} failed: {type(error).__name__}: {error}"
            ) from error
        errors = {
            n.name: self.compare(n.name, expected[n.name], a)
            for n, a in zip(outputs, actual, strict=True)
        }
        bad = [e.name for e in errors.values() if not e.ok]
        self.log(
            f"probe {self.probes}: nodes 0..{k} ({self.nodes[k].name}), {len(outputs)} "
            f"value(s) checked: " + (f"{len(bad)} differ ({', '.join(bad[:4])})" if bad else "ok")
        )
        return errors

    def _run(self, program_ep: ExportedProgram) -> list[Any]:
        probe = TorchConverter()
        if self.converter is not None:  # share its lowerings and kernels, not its programs
            probe._lowerings = self.converter._lowerings
            probe._kernels = self.converter._kernels
        if self.precision is not None:
            probe.precision = self.precision
        probe.progress = False
        probe._check_selectors = False  # a prefix need not hold every selected node
        probe.check_range = False  # the divergence searched for is the one as converted
        with warnings.catch_warnings():  # the full conversion said it already
            warnings.simplefilter("ignore", RuntimeWarning)
            program = probe.add_exported_program(program_ep).to_coreai()
        if self.optimize:
            program.optimize()
        signature = program.signatures["main"]
        inputs, states = signature.feeds(self.flat_args)
        with Session(program) as session:
            out = session.run(inputs, state=states or None)
        return [out[o.name] for o in signature.outputs]

    def reference(self, wanted: list[torch.fx.Node]) -> dict[str, torch.Tensor]:
        """PyTorch's values of ``wanted``, interpreting the graph up to the last of them."""
        return interpret(self.ep, self.flat_args, wanted)


def _probeable(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return (
        isinstance(val, torch.Tensor)
        and val.dtype in _RUNTIME_DTYPES
        and not any(isinstance(d, int) and d == 0 for d in val.shape)
    )


def flat_user_args(
    ep: ExportedProgram, args: Sequence[Any], kwargs: Mapping[str, Any] | None
) -> list[Any]:
    """forward() arguments flattened in the order of the program's user inputs."""
    kwargs = dict(kwargs or {})
    in_spec = ep.call_spec.in_spec
    if kwargs and in_spec is not None and in_spec.num_children == 2:
        order = in_spec.child(1).context or []
        kwargs = {k: kwargs[k] for k in order if k in kwargs} | kwargs
    return pytree.tree_leaves((tuple(args), kwargs))


def _placeholder_values(ep: ExportedProgram, flat_args: Sequence[Any]) -> list[Any]:
    values, user = [], iter(flat_args)
    for spec in ep.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            value = next(user)
            values.append(value.detach().clone() if isinstance(value, torch.Tensor) else value)
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            source = ep.state_dict if spec.target in ep.state_dict else ep.constants
            values.append(source[spec.target])
        else:
            values.append(ep.constants[spec.target])
    return values


class _Recorder(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, wanted: set[str], stop: str) -> None:
        super().__init__(gm)
        self.wanted, self.stop = wanted, stop
        self.values: dict[str, Any] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        result = super().run_node(n)
        if n.name in self.wanted:
            self.values[n.name] = result.detach().clone()
        if n.name == self.stop:
            raise _Stop
        return result


class _Stop(Exception):
    pass


def interpret(
    ep: ExportedProgram, flat_args: Sequence[Any], wanted: Sequence[torch.fx.Node]
) -> dict[str, torch.Tensor]:
    """Run ``ep``'s graph in PyTorch and return the values of the ``wanted`` nodes."""
    if not wanted:
        return {}
    order = {n: i for i, n in enumerate(ep.graph.nodes)}
    stop = max(wanted, key=order.__getitem__).name
    recorder = _Recorder(ep.graph_module, {n.name for n in wanted}, stop)
    with torch.no_grad(), contextlib.suppress(_Stop):
        recorder.run(*_placeholder_values(ep, flat_args))
    return recorder.values


def prefix_program(ep: ExportedProgram, outputs: Sequence[torch.fx.Node]) -> ExportedProgram:
    """A copy of ``ep`` that returns ``outputs`` (nodes of ``ep``) and computes nothing else.

    Every placeholder stays (so the program takes the same inputs); mutations are dropped, so
    mutated buffers become ordinary buffers and mutated inputs ordinary inputs.
    """
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    wanted = set(outputs)
    last = max(i for i, n in enumerate(ep.graph.nodes) if n in wanted)
    for i, node in enumerate(ep.graph.nodes):
        if node.op == "placeholder" or (i <= last and node.op != "output"):
            env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output(tuple(env[n] for n in outputs))
    graph.eliminate_dead_code()
    module = torch.fx.GraphModule(ep.graph_module, graph)
    signature = ExportGraphSignature(
        input_specs=list(ep.graph_signature.input_specs),
        output_specs=[
            OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(env[n].name), None) for n in outputs
        ],
    )
    call_graph = copy.deepcopy(ep.module_call_graph)
    root = next((entry for entry in call_graph if entry.fqn == ""), None)
    if root is not None and root.signature is not None:  # ``.module()`` returns the new outputs
        root.signature.outputs = [TensorArgument(env[n].name) for n in outputs]
        root.signature.out_spec = pytree.tree_flatten(tuple(range(len(outputs))))[1]
    return ExportedProgram(
        root=module,
        graph=module.graph,
        graph_signature=signature,
        state_dict=ep.state_dict,
        range_constraints=ep.range_constraints,
        module_call_graph=call_graph,
        constants=ep.constants,
        verifiers=ep.verifiers,
    )
