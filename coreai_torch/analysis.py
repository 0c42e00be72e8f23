"""What a program needs before converting it: its ops, and which of them have a lowering.

    report = coreai_torch.analyze(ep)              # or analyze(ep, converter=my_converter)
    print(report)                                  # histogram, supported / missing ops
    report.ok, report.missing, report.to_dict()

It is the importer's own analysis (``find_unsupported`` / ``op_histogram``), so what it calls
missing is exactly what ``to_coreai()`` would reject.  A lowering may still refuse particular
arguments of a supported op while converting.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch.fx
from torch.export import ExportedProgram

from coreai_torch.converter import TorchConverter
from coreai_torch.frontend import hints
from coreai_torch.frontend.export import (
    COMPOSITE_OPS,
    decomposed,
)
from coreai_torch.importer.graph import find_unsupported, op_histogram
from coreai_torch.locations import module_path, qualified_name, user_frame

#: ops kept whole by ``get_decomp_table()`` and converted as composite ops
COMPOSITE_OP_NAMES = frozenset(qualified_name(op) for op in COMPOSITE_OPS)


@dataclass
class MissingOp:
    """An op without a lowering: how often it occurs and where it first does."""

    op: str
    count: int
    node: str
    source: str
    module: str
    #: the project's known fix for it (:mod:`~coreai_torch.frontend.hints`), or ""
    hint: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "count": self.count,
            "node": self.node,
            "source": self.source,
            "module": self.module,
            "hint": self.hint,
        }


@dataclass
class OpSupportReport:
    """The ops of a program (sub-graphs included) and whether the converter lowers them."""

    #: qualified op name -> number of FX nodes
    histogram: Counter[str] = field(default_factory=Counter)
    #: ops without a lowering, most frequent first
    missing: list[MissingOp] = field(default_factory=list)
    #: the program had to be decomposed with ``get_decomp_table()`` first
    decomposed_here: bool = False

    @property
    def ok(self) -> bool:
        """Every op has a lowering."""
        return not self.missing

    @property
    def supported(self) -> list[str]:
        missing = {m.op for m in self.missing}
        return sorted(op for op in self.histogram if op not in missing)

    @property
    def composites(self) -> list[str]:
        """Ops that become composite ops (``layer_norm``, ``scaled_dot_product_attention``...)."""
        return sorted(op for op in self.histogram if op in COMPOSITE_OP_NAMES)

    def status(self, op: str) -> str:
        if any(m.op == op for m in self.missing):
            return "MISSING"
        return "composite" if op in COMPOSITE_OP_NAMES else "ok"

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "nodes": sum(self.histogram.values()),
            "ops": [
                {"op": op, "count": n, "status": self.status(op)}
                for op, n in self.histogram.most_common()
            ],
            "missing": [m.to_dict() for m in self.missing],
            "decomposed_here": self.decomposed_here,
        }

    def __str__(self) -> str:
        nodes = sum(self.histogram.values())
        lines = []
        if self.decomposed_here:
            lines.append("(not decomposed: analysed after run_decompositions(get_decomp_table()))")
        lines.append(
            f"{len(self.histogram)} op(s) in {nodes} node(s): {len(self.supported)} supported, "
            f"{len(self.missing)} missing"
        )
        width = max((len(op) for op in self.histogram), default=2)
        for op, n in sorted(self.histogram.items(), key=lambda kv: (-kv[1], kv[0])):
            lines.append(f"  {n:>6}  {op:<{width}}  {self.status(op)}")
        if self.missing:
            lines.append("missing:")
            for m in self.missing:
                where = f"first at {m.source}" if m.source else "no source location recorded"
                module = f" in module '{m.module}'" if m.module else ""
                lines.append(f"  {m.op}  x{m.count}  ({where}{module}; node '{m.node}')")
                if m.hint:
                    lines.append(f"      {m.hint}")
        return "\n".join(lines)


def _missing(nodes_by_op: dict[str, list[torch.fx.Node]]) -> list[MissingOp]:
    found = []
    for op, nodes in sorted(nodes_by_op.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        first = nodes[0]
        frame = user_frame(first)
        hint = next(iter(hints.for_nodes(nodes)), "")
        found.append(
            MissingOp(
                op, len(nodes), first.name, str(frame) if frame else "", module_path(first), hint
            )
        )
    return found


def analyze(ep: ExportedProgram, converter: Any = None) -> OpSupportReport:
    """The op histogram of ``ep`` and which ops ``converter`` (default: a fresh
    ``TorchConverter``, i.e. the built-in lowerings) has no lowering for.

    A program still in training IR is analysed after ``run_decompositions(get_decomp_table())``
    (``report.decomposed_here`` says so), as that is what the converter will see.
    """
    if not isinstance(ep, ExportedProgram):
        raise TypeError(
            f"analyze() expects a torch.export.ExportedProgram, got {type(ep).__name__}"
        )
    if converter is None:
        converter = TorchConverter()
    ep, decomposed_here = decomposed(ep)
    return OpSupportReport(
        histogram=op_histogram(ep),
        missing=_missing(find_unsupported(ep, converter.lowerings)),
        decomposed_here=decomposed_here,
    )
