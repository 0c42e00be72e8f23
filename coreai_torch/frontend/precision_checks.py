"""Checks of a half-precision conversion against the program it converts.

* :func:`check_selectors`: every name in ``keep_fp32_ops`` / ``keep_fp32_modules`` must match
  a node of the staged programs (a typo would silently leave the float32 island out); an
  unknown one is a ``ValueError`` listing the close matches (``difflib``).  A ``keep_fp32``
  predicate that selects no node gets a warning.
* :func:`range_policy`: the policy one staged program is converted with, extended with the
  nodes that must stay in float32 for its values to fit the half type:

  - weights whose values lie outside the half type's finite range (float16: beyond
    +-65504) would be stored as infinities: the nodes reading them compute in float32
    instead, so the weights stay float32 (a ``RuntimeWarning`` names them);
  - on sample inputs, the float32 program runs once in PyTorch, and each node whose value
    leaves the half type's range (infinities and the float type's extreme values, the
    ``finfo(dtype).min`` of masks, are not counted: the half type holds them as
    infinities), and the nodes reading it, compute in float32 (a
    ``RuntimeWarning`` names them and their source lines).  The samples are those given
    (``TorchConverter(check_range=...)``) or, by default, the example inputs the
    ``torch.export`` program carries, within a cost cap (:data:`AUTO_MAX_WEIGHT_BYTES`,
    :data:`AUTO_MAX_SECONDS`); ``check_range=False`` turns the check off.  What it did and
    the time it took: :class:`RangeCheck` (``TorchConverter.last_stats.range_checks``).

Neither can prove that other inputs stay in range; ``coreai_torch.verify.verify(model, args,
precision=...)`` checks a converted program against PyTorch on given inputs.
"""

from __future__ import annotations

import difflib
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.utils import _pytree as pytree

from coreai_torch.locations import clean_module_path, describe, qualified_name
from coreai_torch.precision.policy import Precision, in_modules
from coreai_torch.tensors import lazy

#: nodes listed per warning
SHOWN = 8
#: the default range check (on the exported program's example inputs) runs the float32
#: program only when its weights take at most this many bytes (a larger model is checked when
#: sample inputs are given: ``check_range=...``)
AUTO_MAX_WEIGHT_BYTES = 1 << 30
#: ... and gives up after this many seconds (the conversion goes on without it)
AUTO_MAX_SECONDS = 30.0


def _graph_nodes(ep: ExportedProgram) -> Iterable[torch.fx.Node]:
    for _, module in ep.graph_module.named_modules():
        if isinstance(module, torch.fx.GraphModule):
            yield from module.graph.nodes


# ------------------------------------------------------------------------------ selectors ---


def check_selectors(policy: Precision, programs: Sequence[ExportedProgram]) -> None:
    """``ValueError`` for ``keep_fp32_ops`` / ``keep_fp32_modules`` entries that match no node
    of ``programs``, with the closest op names / module paths and classes of the programs."""
    if not policy.is_half:
        return
    nodes = [n for ep in programs for n in _graph_nodes(ep) if n.op == "call_function"]
    problems: list[str] = []
    ops = {qualified_name(n.target) for n in nodes}
    packets = {op.rsplit(".", 1)[0] for op in ops}
    for op in sorted(policy.keep_fp32_ops):
        if op not in ops and op not in packets:
            close = difflib.get_close_matches(op, sorted(ops | packets), n=4, cutoff=0.6)
            exists = _op_exists(op)
            why = "no node of the program runs it (after decomposition)" if exists else "no such op"
            problems.append(
                f"keep_fp32_ops entry {op!r}: {why}; "
                + (
                    f"close matches: {', '.join(close)}"
                    if close
                    else "no op of the program is close"
                )
            )
    if policy.keep_fp32_modules:
        paths, classes = _module_names(nodes)
        for selector in policy.keep_fp32_modules:
            if not any(in_modules(n, (selector,)) for n in nodes):
                shown = (
                    f"{selector.__module__}.{selector.__qualname__}"
                    if isinstance(selector, type)
                    else selector
                )
                text = shown if isinstance(shown, str) else str(shown)
                candidates = sorted(paths | classes)
                close = difflib.get_close_matches(text, candidates, n=4, cutoff=0.6)
                if not close and isinstance(selector, str):
                    tail = selector.rsplit(".", 1)[-1]
                    close = [p for p in sorted(paths) if p.rsplit(".", 1)[-1] == tail][:4]
                problems.append(
                    f"keep_fp32_modules entry {text!r} matches no module the program's nodes "
                    "were traced in; "
                    + (
                        f"close matches: {', '.join(close)}"
                        if close
                        else f"its modules include {', '.join(sorted(paths)[:6]) or 'none'}"
                    )
                )
    if problems:
        raise ValueError(
            "the half-precision selectors name things the program does not have, so the "
            "float32 islands they ask for would be missing:\n"
            + "\n".join(f"  - {p}" for p in problems)
            + "\nUse op names as in the program ('aten::mm' or 'aten::mm.default'), module "
            "paths as in model.named_modules() (globs allowed) or class names."
        )
    if policy.keep_fp32 is not None and not any(policy.keep_fp32(n) for n in nodes):
        warnings.warn(
            "keep_fp32 (the predicate) selects no node of the program: it keeps nothing in float32",
            RuntimeWarning,
            stacklevel=4,
        )


def _op_exists(name: str) -> bool:
    namespace, _, rest = name.partition("::")
    packet_name, _, overload = rest.partition(".")
    packet = getattr(getattr(torch.ops, namespace, None), packet_name, None)
    if packet is None:
        return False
    return not overload or overload in packet.overloads() or overload == "default"


def _module_names(nodes: Iterable[torch.fx.Node]) -> tuple[set[str], set[str]]:
    paths: set[str] = set()
    classes: set[str] = set()
    for node in nodes:
        for path, cls in (node.meta.get("nn_module_stack") or {}).values():
            clean = clean_module_path(str(path))
            if clean:
                paths.add(clean)
            name = cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"
            classes.add(name.rsplit(".", 1)[-1])
    return paths, classes


# ----------------------------------------------------------------------------------- range ---


@dataclass
class RangeCheck:
    """The activation range check of one entry point: on which inputs, how long it took, what
    it found, or why it did not run."""

    #: "sample inputs" (``check_range=...``) or "example inputs" (the exported program's)
    inputs: str
    #: the inputs (None: the check does not run)
    args: Any = None
    #: the most seconds it may take (None: no limit)
    budget: float | None = None
    seconds: float = 0.0
    #: nodes whose values left the half type's range (they compute in float32)
    overflowing: int = 0
    #: why it did not run, or stopped early (None: it ran)
    skipped: str | None = None

    def describe(self) -> str:
        """One line for the conversion report."""
        if self.skipped is not None:
            return f"range check on the {self.inputs}: not run ({self.skipped})"
        found = (
            f"{self.overflowing} node(s) overflowed, kept in float32"
            if self.overflowing
            else "every value fits"
        )
        return f"range check on the {self.inputs}: {self.seconds:.2f} s, {found}"


def plan_range_check(
    check_range: Any, ep: ExportedProgram, entrypoint: str, entrypoints: Sequence[str]
) -> RangeCheck | None:
    """What the range check of ``entrypoint`` runs on: the sample inputs ``check_range``
    gives, or (``check_range=None``) the example inputs of ``ep`` within the cost cap; None
    when it is off (``check_range=False``)."""
    if check_range is False:
        return None
    if check_range is not None and check_range is not True:
        return RangeCheck("sample inputs", sample_args_for(check_range, entrypoint, entrypoints))
    capped = check_range is None  # True: the example inputs, whatever it costs
    check = RangeCheck("example inputs", budget=AUTO_MAX_SECONDS if capped else None)
    example = getattr(ep, "example_inputs", None)
    weights = [tensor for _, tensor in _weight_placeholders(ep).values()]
    size = sum(t.numel() * t.element_size() for t in weights)
    if example is None:
        check.skipped = "the exported program has none; pass check_range=sample_inputs"
    elif capped and any(lazy.is_lazy(t) for t in weights):
        check.skipped = "the weights are still in their checkpoint; pass check_range=sample_inputs"
    elif capped and size > AUTO_MAX_WEIGHT_BYTES:
        check.skipped = (
            f"{size / 2**20:.0f} MB of weights, more than the {AUTO_MAX_WEIGHT_BYTES / 2**20:.0f} "
            "MB the default check runs; pass check_range=sample_inputs to run it"
        )
    else:
        args, kwargs = example
        check.args = (*args, kwargs) if kwargs else tuple(args)
    return check


def range_policy(
    ep: ExportedProgram,
    policy: Precision,
    sample_args: Sequence[Any] | None = None,
    *,
    check: RangeCheck | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Precision:
    """``policy`` extended with the nodes of ``ep`` that must compute in float32 for their
    weights (and, with ``sample_args`` or ``check.args``, their values) to fit
    ``policy.compute``.  ``check`` receives the time the values took (and why they were not
    checked); ``progress(nodes run, nodes)`` follows the run."""
    if not policy.is_half:
        return policy
    if check is not None and check.args is not None:
        sample_args = check.args
    limit = torch.finfo(policy.compute).max
    keep: dict[str, str] = {}  # node name -> why
    weights = _overflowing_weights(ep, limit)
    if weights:
        readers = _readers(ep, set(weights))
        for node in readers:
            keep[node.name] = "reads a weight beyond the range"
        listed = ", ".join(
            f"{target} (largest magnitude {peak:.4g})" for target, peak in weights.values()
        )
        warnings.warn(
            f"{len(weights)} weight(s) hold values beyond {policy.name}'s largest finite value "
            f"{limit:.6g} and would be stored as infinities: {listed}. They stay in float32, "
            f"and the {len(readers)} node(s) reading them compute in float32 "
            f"({_shown(readers)}). Their results may still overflow where they meet "
            f"{policy.name} values: check with coreai_torch.verify.verify(model, args, "
            f"precision={policy.name!r}), or convert with check_range=sample_inputs",
            RuntimeWarning,
            stacklevel=4,
        )
    if sample_args is not None:
        check = check or RangeCheck("sample inputs", sample_args)
        start = time.perf_counter()
        try:
            overflowing = _overflowing_nodes(ep, sample_args, limit, check.budget, progress)
        except _Unchecked as reason:  # (only the default check on example inputs stops)
            overflowing, check.skipped = [], str(reason)
        check.seconds = time.perf_counter() - start
        check.overflowing = len(overflowing)
        if overflowing:
            readers = [u for n in overflowing for u in n.users if u.op == "call_function"]
            chosen = list(dict.fromkeys([*overflowing, *readers]))
            for node in chosen:
                keep.setdefault(node.name, "overflows")
            warnings.warn(
                f"check_range: {len(overflowing)} node(s) computed values beyond "
                f"{policy.name}'s largest finite value {limit:.6g} on the {check.inputs}; they "
                f"and the nodes reading them ({len(chosen)} in all) compute in float32:\n"
                + "\n".join(f"  - {describe(n)}" for n in overflowing[:SHOWN])
                + (
                    f"\n  ... and {len(overflowing) - SHOWN} more"
                    if len(overflowing) > SHOWN
                    else ""
                )
                + "\nTo choose them yourself, convert with keep_fp32_ops / keep_fp32_modules "
                "(and check_range=False to skip this run). Other inputs may overflow "
                "elsewhere: check with "
                f"coreai_torch.verify.verify(model, args, precision={policy.name!r})",
                RuntimeWarning,
                stacklevel=4,
            )
    if not keep:
        return policy
    user = policy.keep_fp32
    names = frozenset(keep)

    def keep_fp32(node: torch.fx.Node) -> bool:
        return node.name in names or (user is not None and bool(user(node)))

    return replace(policy, keep_fp32=keep_fp32)


def _shown(nodes: Sequence[torch.fx.Node]) -> str:
    names = ", ".join(n.name for n in nodes[:SHOWN])
    return names + (", ..." if len(nodes) > SHOWN else "")


def _weight_placeholders(ep: ExportedProgram) -> dict[str, tuple[str, torch.Tensor]]:
    """placeholder name -> (FQN, tensor) of the program's floating weights."""
    found = {}
    kinds = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
    for spec in ep.graph_signature.input_specs:
        if spec.kind not in kinds or spec.target is None:
            continue
        source = ep.state_dict if spec.target in ep.state_dict else ep.constants
        tensor = source.get(spec.target)
        if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32:
            found[spec.arg.name] = (spec.target, tensor)
    return found


def _overflowing_weights(ep: ExportedProgram, limit: float) -> dict[str, tuple[str, float]]:
    """placeholder name -> (FQN, largest finite magnitude) of weights with finite values
    beyond ``limit``."""
    found = {}
    for name, (target, tensor) in _weight_placeholders(ep).items():
        if tensor.numel() == 0:
            continue
        peak = lazy.statistics(tensor).finite_peak  # a lazy weight is read once
        if peak > limit:
            found[name] = (target, peak)
    return found


def _readers(ep: ExportedProgram, placeholders: set[str]) -> list[torch.fx.Node]:
    """The nodes that read the weights ``placeholders``, directly or through nodes computed
    from weights only (layout changes, dequantization)."""
    derived = _weight_derived(ep)
    tainted: set[torch.fx.Node] = set()
    readers: list[torch.fx.Node] = []
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            if node.name in placeholders:
                tainted.add(node)
        elif node.op == "call_function" and any(a in tainted for a in node.all_input_nodes):
            if node in derived:
                tainted.add(node)
            else:
                readers.append(node)
    return readers


class _Unchecked(Exception):
    """The values could not be checked within the budget (the reason is the message)."""


class _RangeRecorder(torch.fx.Interpreter):
    """Runs the graph, noting the largest finite magnitude of each floating result; stops
    (:class:`_Unchecked`) once it has run longer than ``budget`` seconds."""

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        budget: float | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        super().__init__(gm)
        self.peaks: dict[torch.fx.Node, float] = {}
        self.deadline = None if budget is None else time.perf_counter() + budget
        self.budget = budget
        self.progress = progress
        self.total = len(gm.graph.nodes)
        self.done = 0

    def run_node(self, n: torch.fx.Node) -> Any:
        if self.deadline is not None and time.perf_counter() > self.deadline:
            raise _Unchecked(
                f"stopped after {self.budget:g} s, at node {self.done} of {self.total}; pass "
                "check_range=sample_inputs to run it whole"
            )
        self.done += 1
        if self.progress is not None:
            self.progress(self.done, self.total)
        result = super().run_node(n)
        if n.op == "call_function":
            peak = 0.0
            for value in pytree.tree_leaves(result):
                if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel():
                    peak = max(peak, _largest_magnitude(value.detach()))
            self.peaks[n] = peak
        return result


def _largest_magnitude(value: torch.Tensor) -> float:
    """The largest magnitude among ``value``'s finite elements but the float type's extremes:
    ``torch.finfo(dtype).min`` is the "minus infinity" of attention masks, which the half
    type holds as an infinity, meaning the same (an overflow there changes nothing)."""
    magnitude = value.abs()
    counted = torch.isfinite(magnitude) & (magnitude < torch.finfo(value.dtype).max)
    return float(torch.where(counted, magnitude, 0).amax().float())


def _overflowing_nodes(
    ep: ExportedProgram,
    sample_args: Sequence[Any],
    limit: float,
    budget: float | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[torch.fx.Node]:
    """The nodes whose float32 values on ``sample_args`` exceed ``limit``, in graph order.

    With a ``budget`` (the default check), inputs that do not fit the program and a run
    longer than ``budget`` seconds raise :class:`_Unchecked`."""
    flat = pytree.tree_leaves(tuple(sample_args))
    user = [s for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    if len(flat) != len(user) and budget is not None:
        raise _Unchecked(f"{len(flat)} example input value(s) for {len(user)} program input(s)")
    if len(flat) != len(user):
        raise ValueError(
            f"check_range: the program takes {len(user)} input value(s) "
            f"({', '.join(s.arg.name for s in user)}); the sample inputs have {len(flat)}"
        )
    values, given = [], iter(flat)
    for spec in ep.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            value = next(given)
            values.append(value.detach().clone() if isinstance(value, torch.Tensor) else value)
        else:
            source = ep.state_dict if spec.target in ep.state_dict else ep.constants
            values.append(source[spec.target])
    recorder = _RangeRecorder(ep.graph_module, budget, progress)
    with torch.no_grad():
        recorder.run(*values)
    derived = _weight_derived(ep)  # weights (and their layout changes): checked as weights
    return [n for n, peak in recorder.peaks.items() if peak > limit and n not in derived]


def _weight_derived(ep: ExportedProgram) -> set[torch.fx.Node]:
    """The nodes computed from weights only."""
    kinds = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)
    weights = {s.arg.name for s in ep.graph_signature.input_specs if s.kind in kinds}
    derived: set[torch.fx.Node] = set()
    for node in ep.graph.nodes:
        if (node.op == "placeholder" and node.name in weights) or (
            node.op == "call_function"
            and node.all_input_nodes
            and all(a in derived for a in node.all_input_nodes)
        ):
            derived.add(node)
    return derived


def sample_args_for(check_range: Any, entrypoint: str, entrypoints: Sequence[str]) -> Any:
    """The sample inputs ``check_range`` gives for ``entrypoint`` (None: none)."""
    if check_range is None:
        return None
    if isinstance(check_range, Mapping):
        return check_range.get(entrypoint)
    if len(entrypoints) > 1:
        raise ValueError(
            f"check_range: the converter has {len(entrypoints)} entry points "
            f"({', '.join(entrypoints)}); give the sample inputs per entry point as a dict "
            "{entrypoint: (args...)}"
        )
    return check_range
