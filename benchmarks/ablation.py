"""IR ablation: what each IR simplification buys in runtime latency.

One exported program is converted into several variants, each with one simplification switched
off (``TorchConverter(fold_constants=..., aten_composites=...)``,
``optimize(transpose_weights=...)``, no ``optimize()`` at all).  All variants are loaded at
once and called in interleaved rounds (the order rotating every round), so load on the machine
hits every variant alike; the table reports the median and minimum per variant.
"""

from __future__ import annotations

import re
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

#: (variant, converter options, optimize(): None = not called, else its options)
VARIANTS: list[tuple[str, dict[str, bool], dict[str, bool] | None]] = [
    ("full", {}, {}),
    ("no weight pre-transpose", {}, {"transpose_weights": False}),
    ("no ATen composites", {"aten_composites": False}, {}),
    ("no conversion-time folding", {"fold_constants": False}, {}),
    ("no optimize()", {}, None),
    ("none of them", {"fold_constants": False, "aten_composites": False}, None),
]

_OP = re.compile(r"= (coreai\.[a-z_.0-9]+)")


def ir_stats(program: Any) -> dict[str, int]:
    """Op counts of a program's IR (every graph, composite bodies once)."""
    ops = Counter(_OP.findall(str(program)))
    return {
        "ops": sum(ops.values()),
        "transpose": ops["coreai.transpose"],
        "reshape": ops["coreai.reshape"],
        "cast": ops["coreai.cast"],
        "invoke": ops["coreai.invoke"],
    }


@dataclass
class _Variant:
    name: str
    program: Any
    session: Any
    times: list[float]


def measure_ablation(ep: Any, args: tuple, runs: int) -> list[dict[str, Any]]:
    """Convert ``ep`` in every variant and time them in ``runs`` interleaved rounds."""
    from coreai_torch import TorchConverter
    from coreai_torch.runtime import Session
    from coreai_torch.verify import run_entrypoint

    variants = []
    try:
        for name, options, optimize in VARIANTS:
            program = TorchConverter(**options).add_exported_program(ep).to_coreai()
            if optimize is not None:
                program.optimize(**optimize)
            session = Session(program)
            session.open()
            variants.append(_Variant(name, program, session, []))
            run_entrypoint(session, program, args)  # warm-up
        for round_ in range(runs):
            shift = round_ % len(variants)
            for v in variants[shift:] + variants[:shift]:
                start = time.perf_counter()
                run_entrypoint(v.session, v.program, args)
                v.times.append(time.perf_counter() - start)
    finally:
        for v in variants:
            v.session.close()
    rows = []
    full = statistics.median(variants[0].times)
    for v in variants:
        median = statistics.median(v.times)
        rows.append(
            {
                "variant": v.name,
                **ir_stats(v.program),
                "median_ms": median * 1000,
                "min_ms": min(v.times) * 1000,
                "delta_vs_full": median / full - 1,
            }
        )
    return rows


def ablation_table(results: list[dict[str, Any]]) -> str:
    """The ablation rows of every model as one Markdown table."""
    lines = [
        "| model | IR variant | ops | transposes | reshapes | casts | invokes | latency "
        "(median) | latency (min) | Δ median vs full |",
        "|" + "---|" * 10,
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['model']} | failed: {r['error'][:80]} |" + " |" * 8)
            continue
        for row in r["ablation"]:
            lines.append(
                f"| {r['model']} | {row['variant']} | {row['ops']} | {row['transpose']} | "
                f"{row['reshape']} | {row['cast']} | {row['invoke']} | "
                f"{row['median_ms']:.1f} ms | {row['min_ms']:.1f} ms | "
                f"{100 * row['delta_vs_full']:+.0f}% |"
            )
    return "\n".join(lines)
