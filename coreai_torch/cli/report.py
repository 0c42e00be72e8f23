"""A one-screen summary of a conversion: IO, ops, composites, weights and timings.

    timings = {}
    with timed(timings, "export"):
        ep = torch.export.export(model, args).run_decompositions(get_decomp_table())
    converter = TorchConverter().add_exported_program(ep)
    program = converter.to_coreai()
    with timed(timings, "optimize"):
        program.optimize()
    report = ConversionReport.build(converter, program, timings=timings)
    print(report)                  # or report.to_dict() for JSON

``to_coreai`` time and weight bytes come from the converter's last conversion.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

from coreai_torch._mlir import ir
from coreai_torch.frontend.signature import ProgramSignature
from coreai_torch.importer.graph import op_histogram

#: how many ops of the histogram the text report lists
TOP_OPS = 12

_DECL_NAME = re.compile(r'composite_declaration<"([^"]+)"')
_CALLEE = re.compile(r'@"?([^">\s]+)"?')


@contextlib.contextmanager
def timed(timings: dict[str, float], phase: str) -> Iterator[None]:
    """Add the seconds the block takes to ``timings[phase]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timings[phase] = timings.get(phase, 0.0) + time.perf_counter() - start


@dataclass
class TensorInfo:
    """One input, output or state: its name, shape (symbolic dims by name) and dtype."""

    name: str
    shape: tuple[int | str, ...]
    dtype: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    def __str__(self) -> str:
        shape = "(" + ", ".join(str(d) for d in self.shape) + ("," if len(self.shape) == 1 else "")
        return f"{self.name} {self.dtype}{shape})"


@dataclass
class EntryPointReport:
    """What one entry point takes, returns and contains."""

    name: str
    inputs: list[TensorInfo] = field(default_factory=list)
    outputs: list[TensorInfo] = field(default_factory=list)
    states: list[TensorInfo] = field(default_factory=list)
    #: FX ops (qualified name -> nodes; structural nodes like getitem are not listed)
    ops: Counter[str] = field(default_factory=Counter)
    #: FX call_function nodes of the graph (sub-graphs not included), as the progress counts
    fx_nodes: int = 0
    #: composite op name -> calls in this entry point's graph
    composites: Counter[str] = field(default_factory=Counter)
    #: Core AI ops of the graph (composite bodies not included), constants apart
    coreai_ops: int = 0
    coreai_constants: int = 0
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "inputs": [t.to_dict() for t in self.inputs],
            "outputs": [t.to_dict() for t in self.outputs],
            "states": [t.to_dict() for t in self.states],
            "fx_nodes": self.fx_nodes,
            "ops": dict(self.ops.most_common()),
            "composites": dict(self.composites.most_common()),
            "coreai_ops": self.coreai_ops,
            "coreai_constants": self.coreai_constants,
            "seconds": self.seconds,
        }

    def lines(self) -> list[str]:
        lines = [
            f"entry point '{self.name}': {self.fx_nodes} FX nodes, {len(self.ops)} ops -> "
            f"{self.coreai_ops} Core AI ops + {self.coreai_constants} constants, "
            f"lowered in {self.seconds:.3f} s"
        ]
        for title, items in (("inputs", self.inputs), ("outputs", self.outputs)):
            lines.extend(_wrap(f"  {title:<10} ", [str(t) for t in items] or ["-"]))
        if self.states:
            lines.extend(_wrap(f"  {'states':<10} ", [str(t) for t in self.states]))
        top = self.ops.most_common(TOP_OPS)
        more = len(self.ops) - len(top)
        ops = [f"{_short(op)} x{n}" for op, n in top] + ([f"... (+{more} more)"] if more else [])
        lines.extend(_wrap(f"  {'ops':<10} ", ops))
        if self.composites:
            comps = [f"{name} x{n}" for name, n in self.composites.most_common()]
            lines.extend(_wrap(f"  {'composites':<10} ", comps))
        return lines


def _short(op: str) -> str:
    """``aten::addmm.default`` -> ``addmm``; other namespaces and overloads are kept."""
    namespace, _, rest = op.partition("::")
    if namespace == "aten" and rest.endswith(".default"):
        return rest[: -len(".default")]
    return rest if namespace == "aten" else op


def _wrap(prefix: str, items: list[str], width: int = 100) -> list[str]:
    """``items`` joined by commas after ``prefix``, wrapped (between items) at ``width``."""
    lines, line = [], prefix
    for i, item in enumerate(items):
        text = item + ("," if i < len(items) - 1 else "")
        if len(line) + len(text) + 1 > width and line.strip():
            lines.append(line.rstrip())
            line = " " * len(prefix)
        line += text + " "
    lines.append(line.rstrip())
    return lines


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"  # pragma: no cover


@dataclass
class ConversionReport:
    """The conversion of one or more entry points, on one screen."""

    entrypoints: list[EntryPointReport] = field(default_factory=list)
    #: bytes of the weights stored as resources (shared weights counted once)
    weight_bytes: int = 0
    #: number and bytes of the weight tensors (parameters, buffers, constants) of the programs
    weight_tensors: int = 0
    weight_total_bytes: int = 0
    #: phase -> seconds, in the order the phases ran (export, to_coreai, optimize, save, ...)
    timings: dict[str, float] = field(default_factory=dict)
    source: str = ""
    asset: str = ""
    asset_bytes: int = 0
    notes: list[str] = field(default_factory=list)
    #: what ``AIProgram.compress()`` did (a ``CompressionReport``), if it ran
    compression: Any = None

    @classmethod
    def build(
        cls,
        converter: Any,
        program: Any,
        *,
        timings: Mapping[str, float] | None = None,
        source: str = "",
        asset: str | Path | None = None,
        notes: list[str] | None = None,
    ) -> ConversionReport:
        """Describe ``program``, the result of ``converter.to_coreai()``.

        ``timings`` are the phases measured around it (``to_coreai`` is taken from the
        converter when absent); ``asset`` is the saved ``.aimodel``, if any.
        """
        stats = converter.last_stats
        graphs = _graph_summaries(program.structural_module)
        entrypoints = []
        weights: dict[int, torch.Tensor] = {}
        for name, signature in program.signatures.items():
            ep = getattr(program, "exported_programs", {}).get(name)
            if ep is None:
                ep = converter._staged[name].exported_program
            entry = _entrypoint(name, ep, signature, graphs)
            entry.seconds = stats.seconds.get(name, 0.0)
            entrypoints.append(entry)
            for tensor in signature.weights.values():
                weights.setdefault(id(tensor), tensor)
        checks = getattr(stats, "range_checks", {})
        notes = [*(notes or []), *(f"{n}: {c.describe()}" for n, c in checks.items())]
        phases = dict(timings or {})
        if "to_coreai" not in phases:
            phases["to_coreai"] = sum(stats.seconds.values()) + stats.verify_seconds
        asset_path = Path(asset) if asset is not None else None
        return cls(
            entrypoints=entrypoints,
            weight_bytes=stats.weight_bytes,
            weight_tensors=len(weights),
            weight_total_bytes=sum(t.numel() * t.element_size() for t in weights.values()),
            timings=phases,
            source=source,
            asset=str(asset_path) if asset_path else "",
            asset_bytes=_disk_size(asset_path) if asset_path else 0,
            notes=notes,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "entrypoints": [e.to_dict() for e in self.entrypoints],
            "weight_bytes": self.weight_bytes,
            "weight_tensors": self.weight_tensors,
            "weight_total_bytes": self.weight_total_bytes,
            "timings": dict(self.timings),
            "asset": self.asset,
            "asset_bytes": self.asset_bytes,
            "notes": list(self.notes),
            "compression": self.compression.to_dict() if self.compression else None,
        }

    def __str__(self) -> str:
        lines = ["coreai-torch conversion report"]
        if self.source:
            lines.append(f"source     {self.source}")
        lines += [f"note       {note}" for note in self.notes]
        for entry in self.entrypoints:
            lines += entry.lines()
        lines.append(
            f"weights    {self.weight_tensors} tensors, {_human_bytes(self.weight_total_bytes)} "
            f"({_human_bytes(self.weight_bytes)} as zero-copy resources)"
        )
        if self.compression is not None:
            lines.append(f"compressed {self.compression.summary()}")
        if self.timings:
            lines.append(
                "timings    " + " | ".join(f"{k} {v:.3f} s" for k, v in self.timings.items())
            )
        if self.asset:
            size = _human_bytes(self.asset_bytes)
            seconds = self.timings.get("save", 0.0)
            if seconds > 0:
                size += f", written at {_human_bytes(int(self.asset_bytes / seconds))}/s"
            lines.append(f"asset      {self.asset} ({size})")
        return "\n".join(lines)


# ------------------------------------------------------------------------------- helpers ---


def _disk_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return 0


def _shape(val: Any) -> tuple[int | str, ...]:
    return tuple(d if isinstance(d, int) else str(d) for d in val.shape)


def _info(name: str, val: Any) -> TensorInfo:
    if isinstance(val, torch.Tensor):
        return TensorInfo(name, _shape(val), str(val.dtype).removeprefix("torch."))
    return TensorInfo(name, (), type(val).__name__)


def _entrypoint(
    name: str, ep: ExportedProgram, signature: ProgramSignature, graphs: dict[str, _Graph]
) -> EntryPointReport:
    nodes = {n.name: n for n in ep.graph.nodes}
    entry = EntryPointReport(name, ops=op_histogram(ep))
    entry.fx_nodes = sum(1 for n in ep.graph.nodes if n.op == "call_function")
    entry.inputs = [_info(i.name, nodes[i.node].meta.get("val")) for i in signature.inputs]
    entry.states = [_info(s.name, nodes[s.node].meta.get("val")) for s in signature.states]
    for out in signature.outputs:
        if out.node is not None:
            entry.outputs.append(_info(out.name, nodes[out.node].meta.get("val")))
        else:
            entry.outputs.append(_info(out.name, out.constant))
    graph = graphs.get(name)
    if graph is not None:
        entry.coreai_ops = graph.ops
        entry.coreai_constants = graph.constants
        for callee, n in graph.calls.items():
            decl = graphs.get(callee)
            if decl is not None and decl.composite:
                entry.composites[decl.composite] += n
    return entry


@dataclass
class _Graph:
    ops: int = 0
    constants: int = 0
    composite: str = ""
    calls: Counter[str] = field(default_factory=Counter)


_STRUCTURE = {"coreai.graph", "coreai.output"}


def _graph_summaries(module: ir.Module) -> dict[str, _Graph]:
    """Per ``coreai.graph``: op counts, the graphs it invokes, its composite op name."""
    graphs: dict[str, _Graph] = {}
    for op in module.body.operations:
        operation = op.operation
        if operation.name != "coreai.graph":
            continue
        summary = _Graph()
        attrs = operation.attributes
        if "composite_decl" in attrs:
            found = _DECL_NAME.search(str(attrs["composite_decl"]))
            summary.composite = found.group(1) if found else "?"

        def visit(inner: ir.Operation, summary: _Graph = summary) -> ir.WalkResult:
            if inner.name == "coreai.constant":
                summary.constants += 1
            elif inner.name not in _STRUCTURE:
                summary.ops += 1
                if inner.name == "coreai.invoke":
                    callee = _CALLEE.search(str(inner.attributes["callee"]))
                    if callee:
                        summary.calls[callee.group(1)] += 1
            return ir.WalkResult.ADVANCE

        operation.walk(visit)
        graphs[ir.StringAttr(attrs["sym_name"]).value] = summary
    return graphs
