"""The half-precision rewrite of a decomposed ``ExportedProgram`` (torch side, before import).

:func:`to_half` returns a new ``ExportedProgram`` that computes in the policy's half type: a
valid PyTorch program (it runs eagerly, and every node's ``meta["val"]`` is what PyTorch
computes), so the importer lowers it like any other and checks every lowering against it.

How each node is treated, walking the graph in order:

* **half**: a node that reads a half-precision activation (a floating user input, a state, the
  result of another half node) or a parameter computes in the half type; its other floating
  operands are cast to it, and ``dtype=torch.float32`` arguments (``_to_copy``, ``full_like``,
  dequantization ops' output dtypes) become the half type.
* **float32**: the fp32 islands (the policy's default ops and the attention scores from the
  matmul that computes them to their softmax) and the user's selections: half operands are
  cast up, the result stays float32 until a half node reads it.
* **as exported**: nodes that read no half activation and no parameter (position ids, rotary
  tables, masks built from integer inputs) compute as in the exported program, in float32.
* **weights**: floating parameters, buffers and constants are stored in the half type when a
  half node reads them (directly or through layout ops / dequantization) -- a copy made once
  per conversion (``HalfWeights``) and shared by every entry point -- and stay as they are
  otherwise.  Floating buffer states (KV caches) are stored in the half type.
* **composites**: a hand-written RMSNorm becomes ``aten.rms_norm`` on half operands (a
  weight computed from a parameter, Gemma's ``1 + w``, as exported in float32), whose
  lowering keeps the statistics and the product with the weight in float32; the other
  composite ops (``layer_norm``, ``group_norm``, attention, ...) take half operands and
  compute their reductions in float32.
* **boundary**: floating inputs and outputs keep the exported dtypes (cast at the edges)
  unless the policy's ``io_dtype`` asks for the half type.  Control-flow ops (``cond``,
  ``while_loop``, ...) run their bodies as exported, with operands cast back.
"""

from __future__ import annotations

import copy
import functools
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
import torch.fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    OutputKind,
    OutputSpec,
    TensorArgument,
)

from coreai_torch.frontend.export import RECURRENT_OPS
from coreai_torch.frontend.fusions import RMSNormMatch, find_rms_norms
from coreai_torch.frontend.signature import ProgramSignature, analyze_signature
from coreai_torch.precision.policy import Precision
from coreai_torch.tensors import lazy

aten = torch.ops.aten

# decisions
HALF, FP32, KEEP, WEIGHT, RMS, SKIP = "half", "fp32", "keep", "weight", "rms", "skip"

#: ops that only move or view data: a chain of them over a weight is "the weight"
_MATMULS = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default}
#: ops between an attention-score matmul and its softmax (scale, mask, soft-capping, views)
_SCORE_OPS = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.expand.default,
    aten.permute.default,
    aten.transpose.int,
    aten.t.default,
    aten.clone.default,
    aten.alias.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.slice.Tensor,
    aten.select.int,
    aten._to_copy.default,
    aten.mul.Tensor,
    aten.mul.Scalar,
    aten.div.Tensor,
    aten.div.Scalar,
    aten.add.Tensor,
    aten.add.Scalar,
    aten.sub.Tensor,
    aten.sub.Scalar,
    aten.where.self,
    aten.masked_fill.Scalar,
    aten.masked_fill.Tensor,
    aten.tanh.default,
}
_SOFTMAX = {aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default}
#: ops whose (float) result has their float operands' type, and the exported shape and strides
_FOLLOWS_OPERANDS = {
    *(_SCORE_OPS - {aten._to_copy.default}),
    *_MATMULS,
    aten.cat.default,
    aten.neg.default,
    aten.relu.default,
    aten.gelu.default,
    aten.silu.default,
    aten.sigmoid.default,
    aten.rsqrt.default,
    aten.sqrt.default,
    aten.embedding.default,
    aten.index.Tensor,
    aten.index_select.default,
    aten.gather.default,
    aten.constant_pad_nd.default,
    *RECURRENT_OPS,  # (without this, FakeTensor ran every time step of their decomposition)
}
_DTYPE_ARGS = ("dtype", "output_dtype", "out_dtype")
#: norm op -> positions of the parameters and running statistics it reads as exported
_NORM_PARAMETERS: dict[object, tuple[int, ...]] = {
    aten.layer_norm.default: (2, 3),
    aten.native_layer_norm.default: (2, 3),
    aten.group_norm.default: (2, 3),
    aten.native_group_norm.default: (1, 2),
    aten._native_batch_norm_legit_no_training.default: (1, 2, 3, 4),
    aten.instance_norm.default: (1, 2, 3, 4),
}


class HalfWeights:
    """Half-precision copies of a conversion's weights: each made once, shared by every entry
    point (and every externalized module) that reads the same tensor."""

    def __init__(self) -> None:
        self._copies: dict[tuple, torch.Tensor] = {}
        #: bytes of the copies made
        self.bytes = 0

    def get(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if tensor.dtype == dtype:
            return tensor
        key = (*lazy.key(tensor), dtype)
        found = self._copies.get(key)
        if found is None:
            with torch.no_grad():  # of a lazy tensor: lazy too (cast when the data is read)
                found = tensor.detach().to(dtype).contiguous()
            self._copies[key] = found
            self.bytes += found.numel() * found.element_size()
        return found


def _val(node: object) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _is_float(node: object) -> bool:
    val = _val(node)
    return isinstance(val, torch.Tensor) and val.dtype.is_floating_point


def _tensor_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    return [a for a in node.all_input_nodes if isinstance(_val(a), torch.Tensor)]


class _Analysis:
    """Decides, on the exported graph, how each node computes (see the module docstring)."""

    def __init__(
        self,
        ep: ExportedProgram,
        policy: Precision,
        inputs: Mapping[str, torch.dtype],
        flows: set[str],
        usable: Callable[[torch.fx.Node], bool],
    ) -> None:
        self.ep = ep
        self.policy = policy
        self.nodes = list(ep.graph.nodes)
        specs = {s.arg.name: s for s in ep.graph_signature.input_specs}
        weight_kinds = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
        #: parameters and other weights (placeholders the caller does not feed)
        self.params = {
            n for n, s in specs.items() if s.kind == InputKind.PARAMETER and n not in inputs
        }
        self.weights = {n for n, s in specs.items() if s.kind in weight_kinds and n not in inputs}
        #: placeholders whose values start the half-precision flow
        self.flows = flows
        self.decision: dict[torch.fx.Node, str] = {}
        #: weight placeholders stored in the half type
        self.half_weights: set[str] = set()
        self.rms = (
            find_rms_norms(ep.graph, lambda n: usable(n) and not policy.selects(n))
            if policy.fp32_islands
            else {}
        )
        self.absorbed = {n for match in self.rms.values() for n in match.absorbed}
        self._weight_derived()
        self.score_nodes = self._attention_scores() if policy.fp32_islands else set()
        self._decide()
        self._resolve_weights()

    # -- structure ----------------------------------------------------------------------------

    def _weight_derived(self) -> None:
        """Nodes computed only from weights (layout ops, dequantization), and from params."""
        derived: set[torch.fx.Node] = set()
        from_param: set[torch.fx.Node] = set()
        flow: set[torch.fx.Node] = set()  # depends on a float input, state or parameter
        for node in self.nodes:
            if node.op == "placeholder":
                if node.name in self.weights:
                    derived.add(node)
                if node.name in self.params:
                    from_param.add(node)
                if _is_float(node) and (node.name in self.params or node.name in self.flows):
                    flow.add(node)
                continue
            if node.op != "call_function":
                continue
            inputs = _tensor_inputs(node)
            if any(a in flow for a in node.all_input_nodes):
                flow.add(node)
            if (
                inputs
                and isinstance(node.target, torch._ops.OpOverload)
                and all(a in derived for a in inputs)
                and torch.Tag.nondeterministic_seeded not in node.target.tags
            ):
                derived.add(node)
                if any(a in from_param for a in inputs):
                    from_param.add(node)
        self.derived, self.from_param, self.flow = derived, from_param, flow

    def _attention_scores(self) -> set[torch.fx.Node]:
        """The nodes from each softmax back to the activation x activation matmul computing
        its logits (scale, mask, soft-capping and views in between)."""
        found: set[torch.fx.Node] = set()
        for node in self.nodes:
            if node.op != "call_function" or node.target not in _SOFTMAX:
                continue
            chain: list[torch.fx.Node] = []
            current = node.args[0]
            while isinstance(current, torch.fx.Node) and current.op == "call_function":
                if current.target in _MATMULS:
                    with_bias = current.target in (aten.addmm.default, aten.baddbmm.default)
                    a, b = current.args[1:3] if with_bias else current.args[:2]
                    if a not in self.derived and b not in self.derived:
                        found.update([*chain, current])
                    break
                if current.target not in _SCORE_OPS:
                    break
                chain.append(current)
                candidates = [
                    a
                    for a in _tensor_inputs(current)
                    if a in self.flow and a not in self.derived and _is_float(a)
                ]
                if not candidates:
                    break
                current = max(candidates, key=lambda a: _numel(_val(a)))
        return found

    # -- decisions ----------------------------------------------------------------------------

    def _drives_half(self, node: torch.fx.Node) -> bool:
        """Whether a float input of ``node`` is a half activation or a parameter."""
        for a in _tensor_inputs(node):
            if not _is_float(a):
                continue
            if a in self.from_param or self.decision.get(a) in (HALF, RMS):
                return True
            if a.op == "placeholder" and a.name in self.flows:
                return True
            if a.target is operator.getitem and (
                self.decision.get(cast(torch.fx.Node, a.args[0])) in (HALF, RMS)
            ):
                return True
        return False

    def _decide(self) -> None:
        policy = self.policy
        for node in self.nodes:
            if node.op != "call_function":
                continue
            target = node.target
            if target is aten._assert_tensor_metadata.default or node in self.absorbed:
                self.decision[node] = SKIP
            elif node in self.rms and self._drives_half(self.rms[node].input):
                self.decision[node] = RMS
            elif node in self.derived:
                self.decision[node] = WEIGHT
            elif target is operator.getitem:
                self.decision[node] = self.decision.get(node.args[0], KEEP)
            elif not isinstance(target, torch._ops.OpOverload):
                self.decision[node] = KEEP  # control flow, symbolic size arithmetic
            elif (
                policy.selects(node) or policy.is_default_island(node) or (node in self.score_nodes)
            ):
                self.decision[node] = FP32
            elif self._drives_half(node):
                self.decision[node] = HALF
            else:
                self.decision[node] = KEEP
        for node, match in self.rms.items():  # a chain that is not replaced is lowered as is
            if self.decision.get(node) != RMS:
                for n in [*match.absorbed, node]:
                    if self.decision.get(n) == SKIP and n.target is not (
                        aten._assert_tensor_metadata.default
                    ):
                        self.decision[n] = self._plain(n)

    def _plain(self, node: torch.fx.Node) -> str:
        if self.policy.selects(node) or self.policy.is_default_island(node):
            return FP32
        return HALF if self._drives_half(node) else KEEP

    def _resolve_weights(self) -> None:
        """Weight-derived nodes compute in the half type when a half node reads them."""
        wants_half: set[torch.fx.Node] = set()
        for node in reversed(self.nodes):
            decision = self.decision.get(node)
            if decision == WEIGHT:
                self.decision[node] = HALF if node in wants_half else KEEP
                decision = self.decision[node]
            if decision in (HALF, RMS):
                operands = _half_operands(node)
                if decision == RMS:  # a computed weight is read as exported (float32)
                    operands = [a for a in operands if a is not _computed_weight(self.rms[node])]
                for a in operands:
                    if (a in self.derived and _is_float(a)) or (
                        a.op == "placeholder" and a.name in self.weights
                    ):
                        wants_half.add(a)
        self.half_weights = {
            n.name for n in self.nodes if n.op == "placeholder" and n in wants_half and _is_float(n)
        }


def _computed_weight(match: RMSNormMatch) -> torch.fx.Node | None:
    """The weight of a hand-written RMSNorm when an op computes it (Gemma's ``1 + w``)."""
    weight = match.weight
    return weight if weight is not None and weight.op != "placeholder" else None


def _half_operands(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The tensor operands a half node reads in the half type: all but the parameters and
    running statistics of norms (PyTorch's norms take them in float32 with 16-bit inputs, and
    their lowerings compute in float32; a variance of 1e5 overflows float16)."""
    kept = _NORM_PARAMETERS.get(node.target, ())
    skip = {node.args[i] for i in kept if i < len(node.args)}
    return [a for a in _tensor_inputs(node) if a not in skip]


def _numel(val: Any) -> int:
    if not isinstance(val, torch.Tensor):
        return 0
    total = 1
    for d in val.shape:
        total *= d if isinstance(d, int) else 1 << 20  # a dynamic size counts as large
    return total


def _retarget_dtypes(node: torch.fx.Node, args: list, kwargs: dict, half: torch.dtype) -> bool:
    """Make a half node's float32 result-dtype arguments ``half`` (in ``args``/``kwargs``, in
    place): ``dtype=torch.float32`` (``_to_copy``, ``full_like``, ...) and the output dtype of
    dequantization ops (``output_dtype``/``out_dtype``, whose default means float32).
    Returns whether anything changed."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return False
    produces_float32 = _dtype_of(node) == torch.float32
    changed = False
    for i, argument in enumerate(target._schema.arguments):
        if argument.name not in _DTYPE_ARGS or "ScalarType" not in str(argument.type):
            continue
        positional = not argument.kwarg_only and i < len(args)
        value = args[i] if positional else kwargs.get(argument.name)
        defaulted = value is None and argument.name != "dtype" and produces_float32
        if value == torch.float32 or defaulted:
            if positional:
                args[i] = half
            else:
                kwargs[argument.name] = half
            changed = True
    return changed


class _Rewriter:
    def __init__(
        self,
        ep: ExportedProgram,
        analysis: _Analysis,
        policy: Precision,
        input_dtype: Callable[[torch.fx.Node], torch.dtype],
    ) -> None:
        self.ep = ep
        self.analysis = analysis
        self.half = policy.compute
        self.input_dtype = input_dtype
        self.graph = torch.fx.Graph()
        self.env: dict[torch.fx.Node, torch.fx.Node] = {}
        self.casts: dict[tuple[torch.fx.Node, torch.dtype], torch.fx.Node] = {}
        #: names of the exported nodes, which casts must not take
        self.reserved = {n.name for n in ep.graph.nodes}
        self.fake_mode = detect_fake_mode(
            [n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder"]
        )

    # -- helpers ------------------------------------------------------------------------------

    def fake(self, fn: Callable[[], Any]) -> Any:
        if self.fake_mode is None:
            return fn()
        with self.fake_mode:
            return fn()

    def cast(self, value: torch.fx.Node, dtype: torch.dtype, at: torch.fx.Node) -> torch.fx.Node:
        """``value`` (a node of the new graph) as ``dtype``: a ``_to_copy`` placed before the
        node being built and attributed to ``at`` (its consumer in the exported program)."""
        val = _val(value)
        if not isinstance(val, torch.Tensor) or val.dtype == dtype:
            return value
        key = (value, dtype)
        found = self.casts.get(key)
        if found is None:
            name = f"{value.name}_{str(dtype).removeprefix('torch.')}"
            while name in self.reserved:
                name += "_"
            found = self.graph.create_node(
                "call_function", aten._to_copy.default, (value,), {"dtype": dtype}, name
            )
            for k in ("stack_trace", "nn_module_stack", "source_fn_stack"):
                if k in at.meta:
                    found.meta[k] = at.meta[k]
            found.meta["val"] = self.fake(lambda: val.to(dtype))
            self.casts[key] = found
        return found

    def operand(self, arg: torch.fx.Node, decision: str, at: torch.fx.Node) -> torch.fx.Node:
        new = self.env[arg]
        val = _val(new)
        if not isinstance(val, torch.Tensor) or not val.dtype.is_floating_point:
            return new
        if decision == HALF:
            return self.cast(new, self.half, at)
        if decision == FP32:
            return self.cast(new, torch.float32, at) if val.dtype == self.half else new
        original = _val(arg)
        return self.cast(new, original.dtype, at) if isinstance(original, torch.Tensor) else new

    # -- the walk -----------------------------------------------------------------------------

    def run(self) -> torch.fx.Graph:
        for node in self.ep.graph.nodes:
            if node.op == "placeholder":
                self.placeholder(node)
            elif node.op == "get_attr":
                self.env[node] = self.named(
                    self.graph.node_copy(node, lambda a: self.env[a]), node.name
                )
            elif node.op == "call_function":
                decision = self.analysis.decision.get(node, KEEP)
                if decision == SKIP:
                    continue
                if decision == RMS:
                    self.rms_norm(node)
                else:
                    self.call(node, decision)
            elif node.op == "output":
                self.output_node = node
            else:  # pragma: no cover - decomposed programs have no other node kinds
                self.env[node] = self.graph.node_copy(node, lambda a: self.env[a])
        return self.graph

    def named(self, new: torch.fx.Node, name: str) -> torch.fx.Node:
        """``new`` named exactly ``name`` (FX would avoid builtins such as ``input``)."""
        if new.name != name:
            new.name = name
            self.graph._graph_namespace._rename_object(new, name)
            if new.op == "placeholder":
                new.target = name
        return new

    def placeholder(self, node: torch.fx.Node) -> None:
        new = self.named(self.graph.node_copy(node), node.name)
        val = _val(node)
        if isinstance(val, torch.Tensor) and val.dtype.is_floating_point:
            dtype = self.input_dtype(node)
            if dtype != val.dtype:
                new.meta.pop("tensor_meta", None)
                new.meta["val"] = self.fake(lambda: val.to(dtype))
        self.env[node] = new

    def call(self, node: torch.fx.Node, decision: str) -> None:
        mapped: dict[torch.fx.Node, torch.fx.Node] = {}
        kept = _NORM_PARAMETERS.get(node.target, ()) if decision == HALF else ()

        def operand(a: torch.fx.Node, how: str = decision) -> torch.fx.Node:
            mapped[a] = self.operand(a, how, node)
            return mapped[a]

        args = []
        for i, arg in enumerate(node.args):
            how = KEEP if i in kept else decision
            args.append(torch.fx.node.map_arg(arg, functools.partial(operand, how=how)))
        kwargs = dict(torch.fx.node.map_arg(node.kwargs, operand))
        retargeted = decision == HALF and _retarget_dtypes(node, args, kwargs, self.half)
        new = self.graph.create_node("call_function", node.target, tuple(args), kwargs, node.name)
        self.named(new, node.name)
        new.meta = copy.copy(node.meta)
        if node.target is operator.getitem:
            source, index = cast("tuple[torch.fx.Node, int]", new.args)
            new.meta["val"] = source.meta["val"][index]
        elif retargeted or any(_dtype_of(m) != _dtype_of(a) for a, m in mapped.items()):
            new.meta.pop("tensor_meta", None)
            val = self.retyped(node, decision)
            if val is None:
                try:
                    val = self.propagate(new)
                except Exception:  # PyTorch cannot run the op in 16 bits: compute as exported
                    if decision == KEEP:
                        raise
                    self.graph.erase_node(new)
                    self.call(node, KEEP)
                    return
            new.meta["val"] = val
        self.env[node] = new

    def retyped(self, node: torch.fx.Node, decision: str) -> Any:
        """The new example value of a half node whose op computes in its operands' type,
        made without running the op (the exported value in the half type), or None."""
        val = _val(node)
        values = list(val) if isinstance(val, (tuple, list)) else [val]  # recurrent ops: several
        if (
            decision != HALF
            or node.target not in _FOLLOWS_OPERANDS
            or not all(
                isinstance(v, torch.Tensor)
                and v.dtype == torch.float32
                and all(isinstance(d, int) for d in (*v.shape, *v.stride()))
                for v in values
            )
        ):
            return None
        retyped = [
            FakeTensor(
                self.fake_mode,
                torch.empty_strided(v.shape, v.stride(), dtype=self.half, device="meta"),
                v.device,
            )
            for v in values
        ]
        return type(val)(retyped) if isinstance(val, (tuple, list)) else retyped[0]

    def propagate(self, node: torch.fx.Node) -> Any:
        def value(a: torch.fx.Node) -> Any:
            if a.op == "get_attr":
                return getattr(self.ep.graph_module, cast(str, a.target))
            return a.meta["val"]

        args = torch.fx.node.map_arg(node.args, value)
        kwargs = torch.fx.node.map_arg(node.kwargs, value)
        target = cast("Callable[..., Any]", node.target)  # a call_function node's op
        return self.fake(lambda: target(*args, **kwargs))

    def rms_norm(self, node: torch.fx.Node) -> None:
        match = self.analysis.rms[node]
        x = self.cast(self.env[match.input], self.half, node)
        # a weight computed from a parameter (Gemma's ``1 + w``) as exported, in float32: the
        # lowering multiplies in float32, and ``1 + w`` rounded to float16 loses half an ulp;
        # a parameter in the half type, as the eager half model multiplies by it
        weight = match.weight
        if weight is not None:
            how = KEEP if weight is _computed_weight(match) else HALF
            weight = self.operand(weight, how, node)
        new = self.graph.create_node(
            "call_function",
            aten.rms_norm.default,
            (x, list(match.normalized_shape), weight, match.eps),
            {},
            node.name,
        )
        self.named(new, node.name)
        new.meta = copy.copy(node.meta)
        new.meta["val"] = self.propagate(new)
        self.env[node] = new

    def finish(self, output_dtypes: list[torch.dtype | None]) -> None:
        """The output node: value ``i`` cast to ``output_dtypes[i]`` (None: as it is)."""
        node = self.output_node
        values = []
        for arg, dtype in zip(node.args[0], output_dtypes, strict=True):
            if isinstance(arg, torch.fx.Node):
                new = self.env[arg]
                values.append(self.cast(new, dtype, node) if dtype is not None else new)
            else:
                values.append(arg)
        out = self.graph.output(tuple(values))
        out.meta = copy.copy(node.meta)


def _dtype_of(node: object) -> torch.dtype | None:
    val = _val(node)
    return val.dtype if isinstance(val, torch.Tensor) else None


def rewrite_program(
    ep: ExportedProgram,
    policy: Precision,
    weights: HalfWeights,
    *,
    inputs: Mapping[str, torch.dtype],
    flows: set[str],
    outputs: list[torch.dtype | None],
    usable: Callable[[torch.fx.Node], bool] = lambda node: True,
) -> ExportedProgram:
    """``ep`` rewritten to compute in ``policy.compute`` (see the module docstring).

    ``inputs`` gives the dtype of every placeholder the caller feeds (user inputs, states,
    and for an externalized module the weights passed to it); the other parameters, buffers
    and constants are weights, stored in the half type where half nodes read them (copies
    from ``weights``).  ``flows`` names the fed placeholders that start the half-precision
    flow.  ``outputs[i]`` is the dtype of output ``i`` (None: as computed).  ``usable(node)``
    says whether a node may be absorbed into a composite op (False where the user registered
    their own lowering for its op).
    """
    analysis = _Analysis(ep, policy, inputs, flows, usable)

    def input_dtype(node: torch.fx.Node) -> torch.dtype:
        if node.name in inputs:
            return inputs[node.name]
        return policy.compute if node.name in analysis.half_weights else _val(node).dtype

    rewriter = _Rewriter(ep, analysis, policy, input_dtype)
    rewriter.run()
    rewriter.finish(outputs)
    graph = rewriter.graph

    returned = list(cast("Sequence[torch.fx.Node | None]", graph.output_node().args[0]))
    output_specs = [
        OutputSpec(
            spec.kind,
            TensorArgument(value.name) if isinstance(value, torch.fx.Node) else spec.arg,
            spec.target,
        )
        for spec, value in zip(ep.graph_signature.output_specs, returned, strict=True)
    ]
    graph_signature = ExportGraphSignature(
        input_specs=list(ep.graph_signature.input_specs), output_specs=output_specs
    )
    stored = _stored_weights(ep, inputs, analysis.half_weights, policy, weights)
    return ExportedProgram(
        root=ep.graph_module,  # its sub-graphs (control flow) are the new program's too
        graph=graph,
        graph_signature=graph_signature,
        state_dict={k: stored.get(k, v) for k, v in ep.state_dict.items()},
        range_constraints=ep.range_constraints,
        module_call_graph=copy.deepcopy(ep.module_call_graph),
        constants={k: stored.get(k, v) for k, v in ep.constants.items()},
        verifiers=ep.verifiers,
    )


def to_half(
    ep: ExportedProgram,
    signature: ProgramSignature,
    policy: Precision,
    weights: HalfWeights,
    *,
    usable: Callable[[torch.fx.Node], bool] = lambda node: True,
) -> tuple[ExportedProgram, ProgramSignature]:
    """A staged program (``ep`` and its ``signature``) rewritten to compute in
    ``policy.compute``: floating inputs, outputs and mutated inputs keep their dtypes (or
    take ``policy.io_dtype``), floating buffer states are stored in the half type.  Returns
    the new program and its signature (same names)."""
    io = policy.io_dtype

    def boundary(dtype: torch.dtype) -> torch.dtype:
        return io if io is not None and dtype == torch.float32 else dtype

    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    inputs: dict[str, torch.dtype] = {}
    flows: set[str] = set()
    fed = [(i.node, False) for i in signature.inputs] + [
        (s.node, s.kind == "buffer") for s in signature.states
    ]
    for name, buffer in fed:
        val = _val(placeholders[name])
        if isinstance(val, torch.Tensor) and val.dtype.is_floating_point:
            inputs[name] = policy.compute if buffer else boundary(val.dtype)
            if val.dtype != torch.float64:
                flows.add(name)
    outputs: list[torch.dtype | None] = []
    output_args = list(ep.graph.output_node().args[0])
    for spec, arg in zip(ep.graph_signature.output_specs, output_args, strict=True):
        dtype = _dtype_of(arg)
        if dtype is None or not dtype.is_floating_point:
            outputs.append(None)
        elif spec.kind == OutputKind.BUFFER_MUTATION:
            outputs.append(policy.compute)
        else:  # user outputs and mutated user inputs: the boundary dtype
            outputs.append(boundary(dtype))
    new_ep = rewrite_program(
        ep, policy, weights, inputs=inputs, flows=flows, outputs=outputs, usable=usable
    )
    new_signature = analyze_signature(
        new_ep,
        input_names=[i.name for i in signature.inputs],
        output_names=[o.name for o in signature.outputs],
        state_names=[s.name for s in signature.states],
    )
    return new_ep, new_signature


def _stored_weights(
    ep: ExportedProgram,
    inputs: Mapping[str, torch.dtype],
    half_weights: set[str],
    policy: Precision,
    weights: HalfWeights,
) -> dict[str, torch.Tensor]:
    """FQN -> the copy of every weight (and fed buffer) held in another dtype."""
    stored: dict[str, torch.Tensor] = {}
    for spec in ep.graph_signature.input_specs:
        name = spec.arg.name
        dtype = inputs.get(name, policy.compute if name in half_weights else None)
        if dtype is None or spec.target is None or spec.kind == InputKind.USER_INPUT:
            continue
        source = ep.state_dict if spec.target in ep.state_dict else ep.constants
        tensor = source.get(spec.target)
        if isinstance(tensor, torch.Tensor) and tensor.dtype.is_floating_point:
            copy_ = weights.get(tensor, dtype)
            if isinstance(tensor, torch.nn.Parameter):  # the program's state dict holds these
                copy_ = torch.nn.Parameter(copy_, requires_grad=False)
            stored[spec.target] = copy_
    return stored
