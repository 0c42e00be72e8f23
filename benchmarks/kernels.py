"""Throughput of single ops on the Core AI runtime against eager PyTorch.

A program of one convolution or one matrix multiplication has no IR to simplify, so the ratio
of its runtime latency to eager PyTorch's is the cost of the runtime's own kernels; the model
latencies of ``make bench`` are read against it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

#: name -> (module, example input, floating-point operations of one call)
KERNELS: dict[str, Callable[[], tuple[nn.Module, torch.Tensor, int]]] = {
    "conv 3x3, 64->64 ch, 56x56": lambda: (
        nn.Conv2d(64, 64, 3, padding=1, bias=False),
        torch.randn(1, 64, 56, 56),
        2 * 64 * 64 * 9 * 56 * 56,
    ),
    "matmul 128x1024 @ 1024x2816": lambda: (
        nn.Linear(1024, 2816, bias=False),
        torch.randn(1, 128, 1024),
        2 * 128 * 1024 * 2816,
    ),
}


def _median_seconds(call: Callable[[], Any], runs: int) -> float:
    call()  # warm-up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_kernels(runs: int) -> list[dict[str, Any]]:
    """Median latency and GFLOP/s of each kernel on the runtime and in eager PyTorch."""
    from coreai_torch import TorchConverter
    from coreai_torch.runtime import Session
    from coreai_torch.verify import export_decomposed

    rows = []
    for name, build in KERNELS.items():
        torch.manual_seed(0)
        module, x, flops = build()
        module = module.eval()
        program = TorchConverter().add_exported_program(export_decomposed(module, (x,)))
        program = program.to_coreai().optimize()
        with Session(program) as session:
            feed = {session.descriptor().input_names[0]: x}
            runtime = _median_seconds(lambda s=session, f=feed: s.run(f), runs)
        with torch.no_grad():
            eager = _median_seconds(lambda m=module, i=x: m(i), runs)
        rows.append(
            {
                "kernel": name,
                "runtime_ms": runtime * 1e3,
                "eager_ms": eager * 1e3,
                "runtime_gflops": flops / runtime / 1e9,
                "eager_gflops": flops / eager / 1e9,
            }
        )
    return rows


def kernel_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| kernel | runtime | eager | runtime / eager |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['kernel']} | {r['runtime_ms']:.1f} ms ({r['runtime_gflops']:.1f} GFLOP/s) | "
            f"{r['eager_ms']:.1f} ms ({r['eager_gflops']:.1f} GFLOP/s) | "
            f"{r['runtime_ms'] / r['eager_ms']:.1f}x |"
        )
    return "\n".join(lines)
