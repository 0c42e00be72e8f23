"""Sweep results: per-entry summaries, the results file and the failure report.

A dtype of an entry *passes* when every tested sample of that dtype passes, ignoring samples
``torch.export`` cannot export (``export-failed``: not a converter failure), samples the
converter rejects with its clear zero-element error (``rejected-empty``: the Core AI runtime
cannot execute zero-element tensors) and samples whose eager result is random (``random``, e.g.
dropout; out of scope).  An entry passes when its float32 samples pass.
"""

from __future__ import annotations

import json
import platform
import re
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

RESULTS_FILE = Path(__file__).with_name("results.json")

#: sample statuses that do not count against the converter
NEUTRAL = ("export-failed", "rejected-empty", "eager-failed", "random")


def dtype_status(counts: Counter[str], errors: list[str]) -> str:
    if errors or counts["fail"]:
        return "fail"
    if counts["pass"]:
        return "pass"
    if counts["export-failed"]:
        return "export-failed"
    return "untestable"


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Condense one entry's raw result (from the worker pool) into its summary."""
    by_dtype: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rec in result["records"]:
        by_dtype[rec["dtype"]].append(rec)
    dtypes: dict[str, Any] = {}
    names = list(result.get("plan") or {}) or sorted(by_dtype)
    for dtype in names:
        recs = sorted(by_dtype.get(dtype, []), key=lambda r: r["index"])
        counts = Counter(r["status"] for r in recs)
        groups: dict[tuple[str, str], dict[str, Any]] = {}
        for rec in recs:
            if rec["status"] == "pass":
                continue
            key = (rec["status"], rec["stage"], rec["reason"])
            group = groups.setdefault(
                key,
                {
                    "status": rec["status"],
                    "stage": rec["stage"],
                    "reason": rec["reason"],
                    "count": 0,
                    "example": f"#{rec['index']} {rec['desc']}".strip(),
                },
            )
            group["count"] += 1
        used = sorted({op for r in recs for op, _ in r["ops"]})
        passing = sorted({tuple(p) for r in recs if r["status"] == "pass" for p in r["ops"]})
        failing = sorted({op for r in recs if r["status"] == "fail" for op, _ in r["ops"]})
        plan = (result.get("plan") or {}).get(dtype, {})
        dtypes[dtype] = {
            "status": dtype_status(counts, result.get("errors", [])),
            "samples": plan.get("total", len(recs)),
            "tested": len(recs),
            "counts": dict(sorted(counts.items())),
            "failures": sorted(groups.values(), key=lambda g: (-g["count"], g["reason"])),
            "ops": used,
            "verified": [list(p) for p in passing],
            "failing_ops": failing,
        }
    return {
        "left_out": result.get("left_out"),
        "errors": result.get("errors", []),
        "incidents": result.get("incidents", []),
        "seconds": result.get("seconds", 0.0),
        "batches": result.get("batches", 0),
        "dtypes": dtypes,
    }


def entry_passes(summary: dict[str, Any]) -> bool:
    f32 = summary["dtypes"].get("float32")
    return summary["left_out"] is None and f32 is not None and f32["status"] == "pass"


def write_results(
    summaries: dict[str, dict[str, Any]],
    left_out: dict[str, str],
    *,
    seconds: float,
    jobs: int,
    path: Path = RESULTS_FILE,
) -> dict[str, Any]:
    """Write the results file read by ``python -m tools.ops_table``."""
    import torch

    from tests.opinfo import catalog

    entries = {k: _compact(summaries[k]) for k in sorted(summaries)}
    data = {
        "meta": {
            "torch": torch.__version__,
            "coreai_core": _version("coreai-core"),
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d"),
            "seconds": round(seconds, 1),
            "jobs": jobs,
            "float32_cap": catalog.FLOAT_CAP,
            "other_cap": catalog.OTHER_CAP,
        },
        "totals": totals(summaries, left_out),
        "left_out": dict(sorted(left_out.items())),
        "ops": op_evidence(summaries),
        "entries": entries,
    }
    path.write_text(_dumps(data))
    return data


_OP_NAME = re.compile(r"(?:aten|higher_order|prims|torch_nn)::[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)?")


def ops_named(text: str) -> list[str]:
    """Qualified op names mentioned in a failure reason."""
    return _OP_NAME.findall(text)


def _version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "?"


def _compact(summary: dict[str, Any]) -> dict[str, Any]:
    """An entry's summary without its per-op lists (those go to the ``ops`` section)."""
    dtypes = {}
    for dtype, info in summary["dtypes"].items():
        kept = {k: v for k, v in info.items() if k not in ("ops", "verified", "failing_ops")}
        kept["failures"] = [
            {**g, "reason": _clip(g["reason"], 240), "example": _clip(g["example"], 100)}
            for g in info["failures"]
        ]
        dtypes[dtype] = kept
    return {**summary, "dtypes": dtypes}


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def op_evidence(summaries: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per ATen op: the input dtypes of passing samples that use it, how many entries use it,
    and the entries with a failure whose reason names it."""
    ops: dict[str, dict[str, Any]] = defaultdict(
        lambda: {"verified": set(), "entries": 0, "failing": set()}
    )
    for entry, summary in summaries.items():
        used: set[str] = set()
        for info in summary["dtypes"].values():
            used.update(info["ops"])
            for op, dtype in info["verified"]:
                ops[op]["verified"].add(dtype)
            for group in info["failures"]:
                if group["status"] == "fail":
                    for op in ops_named(group["reason"]):
                        ops[op]["failing"].add(entry)
        for op in used:
            ops[op]["entries"] += 1
    return {
        op: {
            "verified": sorted(ops[op]["verified"]),
            "entries": ops[op]["entries"],
            "failing": sorted(ops[op]["failing"]),
        }
        for op in sorted(ops)
    }


def _dumps(data: dict[str, Any]) -> str:
    """JSON with one line per op and per entry (readable diffs, moderate size)."""
    lines = ["{"]
    sections = list(data.items())
    for i, (key, value) in enumerate(sections):
        comma = "," if i + 1 < len(sections) else ""
        if key in ("ops", "entries"):
            lines.append(f"  {json.dumps(key)}: {{")
            items = list(value.items())
            for j, (name, item) in enumerate(items):
                end = "," if j + 1 < len(items) else ""
                lines.append(f"    {json.dumps(name)}: {json.dumps(item)}{end}")
            lines.append(f"  }}{comma}")
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)}{comma}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def totals(entries: dict[str, dict[str, Any]], left_out: dict[str, str]) -> dict[str, Any]:
    counts: Counter[str] = Counter()
    samples: Counter[str] = Counter()
    for summary in entries.values():
        if summary["left_out"]:
            counts["left out (detected)"] += 1
            continue
        f32 = summary["dtypes"].get("float32")
        counts[f"float32 {f32['status']}" if f32 else "no float32"] += 1
        for info in summary["dtypes"].values():
            samples.update(info["counts"])
    return {
        "entries": len(entries) + len(left_out),
        "left_out": len(left_out) + counts.pop("left out (detected)", 0),
        "float32_pass": sum(entry_passes(s) for s in entries.values()),
        "by_status": dict(sorted(counts.items())),
        "samples": dict(sorted(samples.items())),
        "aborts": sum(
            1
            for s in entries.values()
            for info in s["dtypes"].values()
            for g in info["failures"]
            if g["stage"] == "abort"
            for _ in range(g["count"])
        ),
    }


def failure_report(data: dict[str, Any], owners: dict[str, str] | None = None) -> str:
    """Markdown: failing entries grouped by the ATen op (or stage) that breaks them."""
    by_cause: dict[str, list[str]] = defaultdict(list)
    for op_id, summary in data["entries"].items():
        for dtype, info in summary["dtypes"].items():
            for group in info["failures"]:
                if group["status"] != "fail":
                    continue
                cause = _cause(group)
                by_cause[cause].append(
                    f"`{op_id}` [{dtype}] x{group['count']} ({group['stage']}): "
                    f"{group['reason'][:220]} — e.g. {group['example'][:120]}"
                )
        for error in summary["errors"]:
            by_cause["sweep errors"].append(f"`{op_id}`: {error[:300]}")
    lines = [
        "# OpInfo sweep failures",
        "",
        f"torch {data['meta']['torch']}, run {data['meta']['date']} "
        f"({data['meta']['seconds']:.0f} s on {data['meta']['jobs']} worker(s)).",
        "",
        f"Entries whose float32 samples all pass: **{data['totals']['float32_pass']}** "
        f"of {data['totals']['entries']} ({data['totals']['left_out']} left out).",
        f"Sample statuses: {data['totals']['samples']}; aborts: {data['totals']['aborts']}.",
        "",
    ]
    for cause, items in sorted(by_cause.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        owner = f" — {owners[cause]}" if owners and cause in owners else ""
        lines += [f"## {cause} ({len(items)}){owner}", ""]
        lines += [f"- {item}" for item in sorted(items)]
        lines.append("")
    return "\n".join(lines)


def _cause(group: dict[str, Any]) -> str:
    reason = group["reason"]
    if reason.startswith("UnsupportedOpError: no lowering for "):
        return "missing lowering: " + reason.removeprefix("UnsupportedOpError: no lowering for ")
    for token in reason.replace(",", " ").replace(":", " ").split():
        if token.startswith(("aten::", "higher_order::")):
            return f"{token} ({group['stage']})"
    return f"stage: {group['stage']}"


def empty_result(op_id: str) -> dict[str, Any]:
    """The raw result of an entry that has nothing to run (no dtype the sweep tests)."""
    return {"op": op_id, "left_out": None, "plan": {}, "records": [], "errors": []}


def load_results(path: Path = RESULTS_FILE) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def merge_left_out(ids: Iterable[str]) -> dict[str, str]:
    from tests.opinfo import catalog

    return {i: r for i in ids if (r := catalog.left_out_reason(i))}


def failure_reason(info: dict[str, Any], limit: int = 110) -> str:
    """One short reason for a dtype that does not pass (for ``expected_failures.py``)."""
    if info["status"] == "export-failed":
        first = info["failures"][0]["reason"] if info["failures"] else ""
        return _clip(f"torch.export cannot export it ({first})", limit)
    fails = [g for g in info["failures"] if g["status"] == "fail"] or info["failures"]
    if not fails:
        return info["status"]
    missing = sorted(
        {
            op.strip()
            for g in fails
            if g["reason"].startswith("UnsupportedOpError: no lowering for ")
            for op in g["reason"].removeprefix("UnsupportedOpError: no lowering for ").split(",")
        }
    )
    if missing and all(g["reason"].startswith("UnsupportedOpError: no lowering") for g in fails):
        return _clip("no lowering for " + ", ".join(missing), limit)
    top = max(fails, key=lambda g: g["count"])
    prefix = {"compare": "mismatch: ", "abort": "runtime abort: ", "timeout": "timeout: "}
    return _clip(prefix.get(top["stage"], "") + top["reason"], limit)


def expected_entries(data: dict[str, Any]) -> dict[str, str | dict[str, str]]:
    """What ``EXPECTED_FAILURES`` would say for these results: every swept dtype that fails."""
    table: dict[str, str | dict[str, str]] = {}
    for op_id, summary in data["entries"].items():
        if summary["left_out"]:
            continue
        failing = {
            dtype: failure_reason(info)
            for dtype, info in summary["dtypes"].items()
            if info["status"] != "pass"
        }
        if not failing:
            continue
        reasons = set(failing.values())
        table[op_id] = (
            reasons.pop()
            if len(reasons) == 1 and len(failing) == len(summary["dtypes"])
            else failing
        )
    return table


def expected_differences(
    data: dict[str, Any], table: dict[str, str | dict[str, str]]
) -> tuple[list[str], list[str]]:
    """``(unexpected failures, unexpected passes)`` of recorded results against ``table``."""
    actual = expected_entries(data)
    failures, passes = [], []
    for op_id, summary in data["entries"].items():
        if summary["left_out"]:
            continue
        got, want = actual.get(op_id), table.get(op_id)
        for dtype in summary["dtypes"]:
            fails = got is not None and (isinstance(got, str) or dtype in got)
            expected = want is not None and (isinstance(want, str) or dtype in want)
            if fails and not expected:
                reason = got if isinstance(got, str) else got[dtype]  # type: ignore[index]
                failures.append(f"{op_id} [{dtype}]: {reason}")
            elif expected and not fails:
                passes.append(f"{op_id} [{dtype}]")
    return failures, passes
