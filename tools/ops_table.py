"""``make ops-table``: the op coverage table (docs/ops.md), from the registry and the sweep.

    python -m tools.ops_table --write docs/ops.md   # regenerate the table
    python -m tools.ops_table                       # print it

The status of an op comes from the lowering registry (``BUILTIN_LOWERINGS.names()``) and from
``get_decomp_table()``; the dtypes it is verified with and its known failures come from the
OpInfo sweep's recorded results (:data:`RESULTS_FILE`, written by ``make test-all`` or
``python -m tests.opinfo.sweep``), which must exist (``--without-sweep`` renders the table
without them).  Nothing in the table is written by hand except the reasons in
:data:`KNOWN_GAPS`.  A development tool: it reads ``tests/`` and is not part of the package.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from coreai_torch.frontend.export import COMPOSITE_OPS, DECOMPOSITION_REPLACEMENTS, get_decomp_table
from coreai_torch.locations import qualified_name
from coreai_torch.lowerings import BUILTIN_LOWERINGS

ROOT = Path(__file__).resolve().parents[1]
#: The OpInfo sweep's recorded results (``tests/opinfo/results.py`` writes them).
RESULTS_FILE = ROOT / "tests" / "opinfo" / "results.json"

#: Ops the converter does not lower, with the reason.  The coverage test checks this table
#: against the registry both ways (a newly lowered op must be removed from it).
_COMPLEX = "complex numbers: Core AI has no complex dtype"
_DATA_DEPENDENT = "the output shape depends on the values, which Core AI programs cannot express"
_NOT_YET = "not lowered yet"

KNOWN_GAPS: dict[str, str] = {
    "aten::_conj.default": _COMPLEX,
    "aten::_conj_physical.default": _COMPLEX,
    "aten::_fft_c2c.default": f"{_COMPLEX} (FFT)",
    "aten::_fft_c2r.default": f"{_COMPLEX} (FFT)",
    "aten::_fft_r2c.default": f"{_COMPLEX} (FFT)",
    "aten::_to_sparse.default": "sparse tensors: Core AI has dense tensors only",
    "aten::_to_sparse.sparse_dim": "sparse tensors: Core AI has dense tensors only",
    "aten::_unique2.default": _DATA_DEPENDENT,
    "aten::bincount.default": _DATA_DEPENDENT,
    "aten::complex.default": _COMPLEX,
    "aten::linalg_eig.default": f"{_COMPLEX} (general eigenvalues are complex)",
    "aten::polar.default": _COMPLEX,
    "aten::repeat_interleave.Tensor": _DATA_DEPENDENT,
    "aten::resize.default": "resizing in place exposes uninitialised memory",
    "aten::resize_.default": "resizing in place exposes uninitialised memory",
    "aten::unique_consecutive.default": _DATA_DEPENDENT,
    "aten::unique_dim.default": _DATA_DEPENDENT,
    "aten::view_as_complex.default": _COMPLEX,
    "aten::view_as_real.default": _COMPLEX,
    "higher_order::with_effects": (
        "effectful ops (token inputs); get_decomp_table() keeps the linalg solvers whose "
        "error checks would add them"
    ),
}

#: Ops that decomposed programs contain besides Core ATen ops and composites (asserts,
#: symbolic sizes, aliases, copies and views), listed so that the table covers them even when
#: the sweep did not meet them.
PROGRAM_OPS = (
    "aten::_assert_scalar.default",
    "aten::_assert_tensor_metadata.default",
    "aten::_assert_async.msg",
    "aten::sym_constrain_range_for_size.default",
    "aten::alias.default",
    "aten::lift_fresh_copy.default",
    "aten::_to_copy.default",
    "aten::clone.default",
    "aten::copy.default",
    "aten::_local_scalar_dense.default",
    "aten::sym_size.int",
    "aten::sym_numel.default",
    "aten::sym_stride.int",
    "aten::sym_storage_offset.default",
    "aten::view.default",
    "aten::_unsafe_view.default",
    "aten::expand.default",
    "aten::permute.default",
    "aten::slice.Tensor",
    "aten::select.int",
    "aten::squeeze.dims",
    "aten::unsqueeze.default",
    "aten::as_strided.default",
    "aten::split_with_sizes.default",
    "higher_order::cond",
    "higher_order::while_loop",
    "higher_order::scan",
    "_operator.add",
    "_operator.sub",
    "_operator.mul",
    "_operator.floordiv",
    "_operator.mod",
    "_operator.eq",
    "_operator.ne",
    "_operator.lt",
    "_operator.le",
    "_operator.gt",
    "_operator.ge",
)

_RANDOM = re.compile(
    r"::(rand|randn|randint|randperm|bernoulli|normal|uniform|multinomial|poisson|exponential"
    r"|geometric|cauchy|log_normal|rrelu_with_noise)(_like)?[._]"
)


def left_out_reason(name: str) -> str | None:
    """Why an op is deliberately not converted (backward, random, dropout), or None."""
    if "backward" in name:
        return "backward op"
    if "dropout" in name:
        return "dropout"
    if _RANDOM.search(name):
        return "random numbers"
    return None


def core_aten_ops() -> list[str]:
    """Qualified names of every ATen overload tagged ``torch.Tag.core``.

    Enumerated from the dispatcher: iterating ``torch.ops.aten`` only lists the op packets
    loaded so far, which misses a few core ops depending on what has been imported.
    """
    names = set()
    for full in torch._C._dispatch_get_all_op_names():
        if not full.startswith("aten::"):
            continue
        base, _, overload = full.removeprefix("aten::").partition(".")
        op = getattr(getattr(torch.ops.aten, base), overload or "default")
        if torch.Tag.core in op.tags:
            names.add(qualified_name(op))
    return sorted(names)


def composite_ops() -> list[str]:
    return [qualified_name(op) for op in COMPOSITE_OPS]


# ------------------------------------------------------------------------------ status ----


@dataclass
class OpStatus:
    """What the converter does with one op, and what the sweep saw of it."""

    name: str
    status: str
    notes: list[str] = field(default_factory=list)
    verified: set[str] = field(default_factory=set)
    failing_entries: set[str] = field(default_factory=set)
    #: how many OpInfo entries use the op after decomposition
    entries: int = 0

    @property
    def supported(self) -> bool:
        return self.status in ("native", "composite", "decomposed")


def decomposed_ops() -> dict[str, str]:
    """Ops ``get_decomp_table()`` rewrites before conversion -> whose decomposition."""

    return {
        qualified_name(op): "coreai-torch" if op in DECOMPOSITION_REPLACEMENTS else "PyTorch"
        for op in get_decomp_table()
        if isinstance(op, torch._ops.OpOverload)
    }


def op_status(name: str, lowered: set[str], decomposed: dict[str, str]) -> OpStatus:
    """Status of ``name`` from the registry, the decomposition table and KNOWN_GAPS."""
    reason = left_out_reason(name)
    if reason:
        return OpStatus(name, "left out", [reason])
    if name in lowered:
        kind = "composite" if name in composite_ops() else "native"
        return OpStatus(name, kind)
    if name in decomposed:
        return OpStatus(name, "decomposed", [f"by {decomposed[name]}'s decomposition"])
    return OpStatus(name, "not supported", [KNOWN_GAPS.get(name, "no lowering")])


def collect(results: dict[str, Any] | None) -> dict[str, OpStatus]:
    """Every op of interest with its status and the sweep's evidence."""

    lowered = BUILTIN_LOWERINGS.names()
    decomposed = decomposed_ops()
    seen = _seen_ops(results)
    names = set(core_aten_ops()) | set(composite_ops()) | set(PROGRAM_OPS) | set(seen)
    names |= {n for n in lowered if "::" in n or n.startswith("_operator.")}
    table = {n: op_status(n, lowered, decomposed) for n in sorted(names)}
    for name, evidence in seen.items():
        status = table[name]
        status.verified |= evidence["verified"]
        status.entries = evidence["entries"] or 0
        status.failing_entries |= evidence["failing"]
    return table


def _seen_ops(results: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    seen: dict[str, dict[str, Any]] = {}
    for op, evidence in (results or {}).get("ops", {}).items():
        seen[op] = {
            "verified": set(evidence["verified"]),
            "failing": set(evidence["failing"]),
            "entries": evidence["entries"],
        }
    return seen


# ------------------------------------------------------------------------------ render ----

_DTYPE_ORDER = ["float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8"]
_DTYPE_ORDER += ["uint8", "bool"]


def _dtypes(values: Iterable[str]) -> str:
    known = [d for d in _DTYPE_ORDER if d in values]
    return ", ".join(known + sorted(set(values) - set(known) - {"-"}))


def _status_cell(status: OpStatus) -> str:
    return {"native": "✅ native", "composite": "✅ composite", "decomposed": "✅ decomposed"}.get(
        status.status, "❌ not supported" if status.status == "not supported" else "➖ left out"
    )


def _notes(status: OpStatus) -> str:
    notes = list(status.notes)
    if status.failing_entries:
        shown = ", ".join(f"`{e}`" for e in sorted(status.failing_entries)[:4])
        more = len(status.failing_entries) - 4
        notes.append(f"fails in {shown}" + (f" (+{more})" if more > 0 else ""))
    return "; ".join(notes)


def _op_table(statuses: Iterable[OpStatus]) -> list[str]:
    lines = ["| op | status | dtypes verified | notes |", "|---|---|---|---|"]
    for s in statuses:
        lines.append(f"| `{s.name}` | {_status_cell(s)} | {_dtypes(s.verified)} | {_notes(s)} |")
    return lines


def _count(statuses: Iterable[OpStatus]) -> str:
    counts: dict[str, int] = defaultdict(int)
    for s in statuses:
        counts[s.status] += 1
    order = ["native", "composite", "decomposed", "not supported", "left out"]
    return ", ".join(f"{counts[k]} {k}" for k in order if counts[k])


def _entry_rows(results: dict[str, Any]) -> list[str]:
    lines = ["| entry | float32 | int | bool | notes |", "|---|---|---|---|---|"]
    for entry, summary in results["entries"].items():
        cells = {"float32": "", "int": "", "bool": ""}
        notes = []
        for dtype, info in summary["dtypes"].items():
            column = "int" if dtype.startswith("int") else dtype
            mark = {"pass": "✅", "fail": "❌", "export-failed": "⛔"}.get(info["status"], "·")
            counts = info["counts"]
            passed, failed = counts.get("pass", 0), counts.get("fail", 0)
            cells[column] = f"{mark} {passed}/{passed + failed}"
            extra = [f"{int(n)} {label}" for key, label in _NEUTRAL if (n := counts.get(key))]
            if column == "int":
                extra.insert(0, dtype)
            if extra:
                cells[column] += f" ({', '.join(extra)})"
            fails = [g for g in info["failures"] if g["status"] == "fail"]
            if fails and not notes:
                notes.append(_short(fails[0]["reason"]))
            elif info["status"] == "export-failed" and not notes:
                notes.append(
                    "torch.export cannot export it: " + _short(info["failures"][0]["reason"])
                )
        if not summary["dtypes"]:
            notes.append("no float32, int or bool dtype on CPU")
        notes += [_short(e) for e in summary["errors"][:1]]
        if summary["left_out"]:
            notes.append(f"left out: {summary['left_out']}")
        row = f"| `{entry}` | {cells['float32']} | {cells['int']} | {cells['bool']} |"
        lines.append(f"{row} {'; '.join(notes)} |")
    return lines


_NEUTRAL = (
    ("rejected-empty", "empty"),
    ("export-failed", "not exportable"),
    ("random", "random"),
)


def _short(text: str, limit: int = 140) -> str:
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def render(results: dict[str, Any] | None) -> str:
    """The coverage document (Markdown)."""
    table = collect(results)
    core = [table[n] for n in core_aten_ops()]
    composites = [table[n] for n in composite_ops()]
    others = [s for n, s in table.items() if n not in set(core_aten_ops()) | set(composite_ops())]
    lines = [
        "# Op coverage",
        "",
        "Generated by `make ops-table` (`python -m tools.ops_table --write docs/ops.md`) "
        "from the lowering registry, `get_decomp_table()` and the OpInfo sweep's recorded "
        "results; do not edit by hand.",
        "",
        "Status: **native** — lowered by a coreai-torch rule; **composite** — kept by "
        "`get_decomp_table()` and lowered as one op; **decomposed** — `get_decomp_table()` "
        "rewrites it into other ops before conversion; **not supported** — conversion stops "
        "with the unsupported-op error; **left out** — backward, random-number and dropout ops "
        "are outside the scope of an inference converter.",
        "*dtypes verified* lists the input dtypes with which the op appeared in an OpInfo "
        "sample that matched PyTorch on the Core AI runtime.",
        "",
    ]
    if results:
        meta, totals = results["meta"], results["totals"]
        lines += [
            "## OpInfo sweep",
            "",
            f"`torch.testing._internal.common_methods_invocations.op_db` (torch {meta['torch']},"
            f" coreai-core {meta['coreai_core']}), run {meta['date']} in {meta['seconds']:.0f} s"
            f" on {meta['jobs']} worker(s); up to {meta['float32_cap']} float32 and "
            f"{meta['other_cap']} int/bool samples per entry.",
            "",
            f"- **{totals['float32_pass']}** of {totals['entries']} entries pass all their "
            f"float32 samples ({totals['left_out']} entries left out: backward, random, dropout)",
            f"- entries by float32 status: {_plain(totals['by_status'])}",
            f"- samples: {_plain(totals['samples'])}; process aborts: {totals['aborts']}",
            "",
        ]
    else:
        lines += [
            "Rendered without the OpInfo sweep's results (`--without-sweep`).",
            "",
        ]
    lines += [f"## Core ATen ops ({len(core)}: {_count(core)})", ""]
    lines += _op_table(core)
    lines += ["", f"## Composite ops kept by `get_decomp_table()` ({_count(composites)})", ""]
    lines += _op_table(composites)
    lines += [
        "",
        f"## Other ops in decomposed programs ({len(others)}: {_count(others)})",
        "",
        "Ops that `run_decompositions(get_decomp_table())` leaves in real programs besides "
        "Core ATen: asserts, symbolic sizes, aliases, copies, views, control flow, and ops "
        "without a PyTorch decomposition seen in the sweep.",
        "",
    ]
    lines += _op_table(others)
    if results:
        lines += [
            "",
            "## OpInfo entries",
            "",
            "✅ all tested samples pass · ❌ some fail · ⛔ torch.export cannot export any "
            "sample; `n/m` = passing/compared samples.  *empty*: zero-element samples the "
            "converter rejects with its clear error (the Core AI runtime cannot execute "
            "zero-element tensors); *not exportable*: samples torch.export cannot export; "
            "*random*: samples whose eager result is random (dropout). None of these counts "
            "as a failure.",
            "",
        ]
        lines += _entry_rows(results)
        left = results.get("left_out", {})
        if left:
            lines += ["", "Left out: " + ", ".join(f"`{k}` ({v})" for k, v in left.items())]
    return "\n".join(lines) + "\n"


def _plain(counts: dict[str, int]) -> str:
    return ", ".join(f"{v} {k}" for k, v in counts.items())


def load(path: Path) -> dict[str, Any]:
    """The sweep's results recorded in ``path`` (a ``FileNotFoundError`` naming it if absent)."""
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no OpInfo sweep results (run `make opinfo`, or pass --without-sweep to "
            "render the table without them)"
        )
    results: dict[str, Any] = json.loads(path.read_text())
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Generate the op coverage table.")
    parser.add_argument("--write", type=Path, help="write the Markdown table to this file")
    parser.add_argument("--results", type=Path, default=RESULTS_FILE, help="sweep results file")
    parser.add_argument(
        "--without-sweep", action="store_true", help="leave out the OpInfo sweep's sections"
    )
    args = parser.parse_args(argv)
    text = render(None if args.without_sweep else load(args.results))
    if args.write:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(text)
        print(f"wrote {args.write}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
