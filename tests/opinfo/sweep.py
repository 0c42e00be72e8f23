"""Run the OpInfo sweep from the command line.

    python -m tests.opinfo.sweep --jobs 2                 # full sweep -> tests/opinfo/results.json
    python -m tests.opinfo.sweep --ops add,mul -v         # a few entries, printed
    python -m tests.opinfo.sweep --report failures.md     # also write the failure report
    python -m tests.opinfo.sweep --check                  # recorded results vs expected_failures.py

The pytest suite (``tests/opinfo/test_opinfo.py``) runs the same tasks.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from tests.opinfo import catalog, results
from tests.opinfo.pool import WorkerPool


def task(op_id: str) -> dict[str, Any]:
    return {"op": op_id}


def run_sweep(
    ids: list[str], jobs: int, *, verbose: bool = False
) -> tuple[dict[str, dict[str, Any]], float]:
    start = time.monotonic()
    summaries: dict[str, dict[str, Any]] = {}
    with WorkerPool(jobs) as pool:
        for n, result in enumerate(pool.run(task(i) for i in ids), 1):
            summary = results.summarize(result)
            summaries[result["op"]] = summary
            if verbose:
                print(_line(n, len(ids), result["op"], summary), flush=True)
        restarts = pool.restarts
    if verbose:
        print(f"worker restarts: {restarts}")
    return summaries, time.monotonic() - start


def _line(n: int, total: int, op_id: str, summary: dict[str, Any]) -> str:
    parts = []
    for dtype, info in summary["dtypes"].items():
        parts.append(f"{dtype}={info['status']}{info['counts']}")
        for group in info["failures"][:2]:
            if group["status"] == "fail":
                parts.append(
                    f"\n      [{group['stage']}] x{group['count']} {group['reason'][:160]}"
                )
    if summary["left_out"]:
        parts.append(f"left out: {summary['left_out']}")
    parts += [f"\n      ERROR {e[:300]}" for e in summary["errors"]]
    parts += [f"\n      INCIDENT {e[:300]}" for e in summary["incidents"]]
    return f"[{n}/{total}] {op_id} ({summary['seconds']:.1f}s) " + " ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--ops", help="comma-separated OpInfo ids (default: every entry)")
    parser.add_argument("--out", type=Path, help="results file (default: full sweep only)")
    parser.add_argument("--report", type=Path, help="write the failure report (markdown) here")
    parser.add_argument(
        "--check",
        action="store_true",
        help="do not run: compare the recorded results with expected_failures.py",
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    if args.check:
        return check(args.out or results.RESULTS_FILE)

    all_ids = list(catalog.op_db_by_id())
    requested = args.ops.split(",") if args.ops else all_ids
    unknown = [i for i in requested if i not in catalog.op_db_by_id()]
    if unknown:
        parser.error(f"unknown OpInfo ids: {unknown}")
    ids = catalog.sweep_ids(requested)
    left_out = results.merge_left_out(requested)
    summaries, seconds = run_sweep(ids, args.jobs, verbose=args.verbose)
    out = args.out or (results.RESULTS_FILE if not args.ops else None)
    data = None
    if out is not None:
        data = results.write_results(summaries, left_out, seconds=seconds, jobs=args.jobs, path=out)
    else:
        data = {
            "meta": {"torch": "", "date": "", "seconds": seconds, "jobs": args.jobs},
            "totals": results.totals(summaries, left_out),
            "entries": summaries,
        }
    if args.report:
        args.report.write_text(results.failure_report(data))
    print(json.dumps(data["totals"], indent=1))
    print(f"{seconds:.0f} s")
    return 0


def check(path: Path) -> int:
    from tests.opinfo.expected_failures import EXPECTED_FAILURES

    data = results.load_results(path)
    if data is None:
        print(f"no results at {path}; run the sweep first")
        return 2
    failures, passes = results.expected_differences(data, EXPECTED_FAILURES)
    for line in failures:
        print(f"unexpected failure: {line}")
    for line in passes:
        print(f"unexpected pass (remove from expected_failures.py): {line}")
    print(f"{len(failures)} unexpected failure(s), {len(passes)} unexpected pass(es)")
    return 1 if failures or passes else 0


if __name__ == "__main__":
    sys.exit(main())
