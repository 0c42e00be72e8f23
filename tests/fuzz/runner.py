"""Run random programs through export -> convert -> optimize -> Core AI runtime -> compare.

    python -m tests.fuzz.runner --examples 30 --seed 0

Runs in its own process (the tests start it with ``subprocess``) so that a runtime abort
cannot take the test session down: each program is printed to stderr before it runs, so the
last one printed is the culprit of an abort.  Prints one JSON summary line to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
import warnings

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from coreai_torch import TorchConverter
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.verify import verify
from tests.fuzz.graphs import BatchModule, FuzzModule, Program, programs

ATOL = RTOL = 1e-3
#: float16 programs: PyTorch computes float16 ops in float32 and rounds once; Core AI rounds
#: every intermediate result to float16
HALF_ATOL = HALF_RTOL = 2e-2


def check_program(
    program: Program, *, atol: float | None = None, rtol: float | None = None
) -> str | None:
    """None when the converted program matches eager PyTorch, else a description."""
    return check_batch([program], atol=atol, rtol=rtol)


def check_batch(
    batch: list[Program], *, atol: float | None = None, rtol: float | None = None
) -> str | None:
    """Export, convert, optimize and run ``batch`` as one module; None when it all matches."""
    half = any(p.uses_half for p in batch)
    atol = atol if atol is not None else (HALF_ATOL if half else ATOL)
    rtol = rtol if rtol is not None else (HALF_RTOL if half else RTOL)
    model = BatchModule(batch).eval() if len(batch) > 1 else FuzzModule(batch[0]).eval()
    args = tuple(t for p in batch for t in p.example_inputs())
    try:
        ep = export_decomposed(model, args)
        converted = TorchConverter().add_exported_program(ep).to_coreai()
        converted.optimize()
        report = verify(model, args, program=converted, atol=atol, rtol=rtol)
    except Exception as error:  # every exception is a finding: these ops are all supported
        return f"{type(error).__name__}: {error}"[:3000]
    return None if report.ok else f"mismatch:\n{report}"


def run(examples: int, seed: int, max_steps: int, batch: int) -> dict:
    found: list[dict] = []
    count = 0

    @hypothesis_seed(seed)
    @settings(
        max_examples=max(1, examples // batch),
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(st.lists(programs(max_steps=max_steps), min_size=batch, max_size=batch))
    def one(group: list[Program]) -> None:
        nonlocal count
        first = count + 1
        count += len(group)
        for k, program in enumerate(group):
            print(f"--- program {first + k}\n{program}", file=sys.stderr, flush=True)
        if check_batch(group) is None:
            return
        for program in group:  # find the culprit(s), one program at a time
            problem = check_program(program)
            if problem is not None:
                found.append({"program": str(program), "repr": repr(program), "problem": problem})
                print(f"FAILED:\n{program}\n{problem}", file=sys.stderr, flush=True)

    one()
    return {"examples": count, "failures": found}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--examples", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8, help="programs per conversion")
    opts = parser.parse_args()
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    start = time.perf_counter()
    try:
        summary = run(opts.examples, opts.seed, opts.max_steps, opts.batch)
    except Exception:
        traceback.print_exc()
        raise
    summary["seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
