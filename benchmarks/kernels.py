"""Throughput of single ops on the Core AI runtime against eager PyTorch.

A program of one convolution or one matrix multiplication has no IR to simplify, so the ratio
of its runtime latency to eager PyTorch's is the cost of the runtime's own kernels; the model
latencies of ``make bench`` are read against it.

The decode-shaped rows multiply one token by a 4096 x 4096 weight stored in each form a
program can hold it (float32; float16 / bfloat16 from ``compute_precision``, cast to float32
for the float32-accumulating matmul; int8 and int4 from ``compress()``): a decode step reads
every weight once, so these are what it pays per weight on this runtime.
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

DECODE_SHAPE = (4096, 4096)

#: weight form of the decode-shaped matmul -> (TorchConverter options, compress() spec or None)
WEIGHT_FORMS: dict[str, tuple[dict[str, Any], str | None]] = {
    "fp32": ({}, None),
    "fp16": ({"compute_precision": torch.float16}, None),
    "bf16": ({"compute_precision": torch.bfloat16}, None),
    "int8": ({}, "int8"),
    "int4 (blocks of 32)": ({}, "int4"),
}


def _decode_linear() -> tuple[nn.Module, torch.Tensor, int]:
    """One token through a :data:`DECODE_SHAPE` linear layer."""
    k, n = DECODE_SHAPE
    return nn.Linear(k, n, bias=False), torch.randn(1, 1, k), 2 * k * n


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
    from coreai_torch import TorchConverter, compression
    from coreai_torch.frontend.export import export_decomposed
    from coreai_torch.runtime import Session

    def runtime_seconds(
        module: nn.Module, x: torch.Tensor, options: dict, spec: str | None
    ) -> float:
        converter = TorchConverter(**options)
        program = converter.add_exported_program(export_decomposed(module, (x,))).to_coreai()
        if spec is not None:
            program.compress(compression.from_spec(spec))
        program = program.optimize()
        with Session(program) as session:
            feed = {session.descriptor().input_names[0]: x}
            return _median_seconds(lambda s=session, f=feed: s.run(f), runs)

    k, n = DECODE_SHAPE
    cases = [(name, build, {}, None) for name, build in KERNELS.items()]
    for form, (options, spec) in WEIGHT_FORMS.items():
        cases.append((f"matmul 1x{k} @ {k}x{n}, weight {form}", _decode_linear, options, spec))
    rows = []
    for name, build, options, spec in cases:
        torch.manual_seed(0)
        module, x, flops = build()
        module = module.eval()
        runtime = runtime_seconds(module, x, options, spec)
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
