"""`make bench` workload: converting a 1.26B-parameter Llama to an asset (no run: the runtime
would take minutes), phase by phase, against the disk's write floor.

The model is a Hugging Face Llama with hidden 2048, 22 layers, MLP 5632, vocab 32000 and
full multi-head attention (1.26B parameters, 4.7 GiB in float32), with random weights.  In one
process, after export:

* the **write floor**: writing the asset's byte count (the weights' bytes, in 4 MiB blocks of
  random data) to the same directory, then ``fsync`` — the least time a conversion that writes
  the asset can take on this disk;
* ``to_coreai()``, ``optimize()`` and ``save_asset()``, timed, each with its peak RSS above the
  baseline (``benchmarks/memory.py``), plus what the save keeps outside this process: the
  serializer child's private memory (sampled) and its output waiting to be read
  (``coreai_torch.ir.saving.last_stats``); then the ``fsync`` of the asset (not part of
  ``save_asset``, which, like coreai-core, leaves the flushing to the kernel);
* the asset checked: its bytecode's SHA-256 recomputed from the file, read in blocks (no
  second copy of the asset in memory), must be the hash the asset records.

Targets: the whole conversion (``to_coreai`` + ``optimize`` + ``save_asset``) in at most 1.5×
the write floor; the process's peak memory, model included, at most 2.1× the float32 weight
bytes.  With ``--int4`` (needs ``coreai_torch.compression``, the compressed-weights work), the
program is compressed with ``LinearQuantization(bits=4)`` (before ``optimize()``) and the
memory target is 1.4×.

    python -m benchmarks.large [--layers 22] [--int4] [--dir DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

#: the issue's model: 1.26B parameters
HIDDEN, LAYERS, HEADS, MLP, VOCAB, TOKENS = 2048, 22, 32, 5632, 32000, 16
TIME_TARGET = 1.5
MEMORY_TARGET = 2.1
INT4_MEMORY_TARGET = 1.4
_BLOCK = 4 << 20


def write_floor(directory: Path, nbytes: int) -> float:
    """Seconds to write ``nbytes`` of random data to a new file in ``directory`` and fsync it."""
    block = np.random.default_rng(0).integers(0, 256, size=_BLOCK, dtype=np.uint8)
    path = directory / "write-floor.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        start = time.perf_counter()
        left = nbytes
        while left > 0:
            view = memoryview(block)[: min(left, _BLOCK)]
            while view:
                view = view[os.write(fd, view) :]
            left -= min(left, _BLOCK)
        os.fsync(fd)
        return time.perf_counter() - start
    finally:
        os.close(fd)
        path.unlink()


def hash_matches(asset: Path) -> bool:
    """Whether each bytecode file of ``asset`` (``<name>.mlirb``) has the SHA-256 its
    ``<name>.hash`` records, read in blocks and dropped from the page cache as it is read."""
    hashes = sorted(asset.glob("*.hash"))
    for recorded in hashes:
        digest = hashlib.sha256()
        fd = os.open(recorded.with_suffix(".mlirb"), os.O_RDONLY)
        try:
            offset = 0
            while block := os.pread(fd, _BLOCK, offset):
                digest.update(block)
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, offset, len(block), os.POSIX_FADV_DONTNEED)
                offset += len(block)
        finally:
            os.close(fd)
        if digest.digest() != recorded.read_bytes():
            return False
    return bool(hashes)


def _private_bytes(pid: int) -> int:
    """Private (unshared) memory of process ``pid``, 0 if it is gone."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0
    total = 0
    for line in text.splitlines():
        if line.startswith(("Private_Clean:", "Private_Dirty:")):
            total += int(line.split()[1]) * 1024
    return total


class ChildMemory:
    """Largest private memory of this process's children, sampled every 50 ms."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        me = psutil.Process()
        while not self._stop.wait(0.05):
            for child in me.children():
                self.peak = max(self.peak, _private_bytes(child.pid))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def _available_memory() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def measure(layers: int = LAYERS, int4: bool = False, directory: str | None = None) -> dict:
    """Export, then time and measure the conversion of the benchmark Llama to an asset."""
    import torch

    from benchmarks.memory import PhaseMemory
    from benchmarks.models import llama
    from coreai_torch import TorchConverter
    from coreai_torch.frontend.export import export_decomposed
    from coreai_torch.ir import saving

    compress = None
    if int4:
        try:
            from coreai_torch.compression import LinearQuantization
        except ImportError:
            return {"model": "llama-1.26b-int4", "skipped": "needs coreai_torch.compression"}
        compress = LinearQuantization(bits=4)

    torch.manual_seed(0)
    model, args = llama(
        hidden=HIDDEN, layers=layers, heads=HEADS, mlp=MLP, vocab=VOCAB, tokens=TOKENS
    )
    weight_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    params = sum(t.numel() for t in model.state_dict().values())
    name = f"llama-{params / 1e9:.2f}b" + ("-int4" if int4 else "")
    result: dict[str, Any] = {"model": name, "weight_bytes": weight_bytes, "layers": layers}
    ep = export_decomposed(model, args)

    root = Path(directory) if directory else None
    with tempfile.TemporaryDirectory(dir=root, prefix="coreai-large-") as tmp:
        tmp_path = Path(tmp)
        result["write_floor_s"] = write_floor(tmp_path, weight_bytes)
        memory = PhaseMemory()
        result["baseline_rss"] = memory.baseline
        result["memory_method"] = memory.method
        times: dict[str, float] = {}
        with memory.phase("to_coreai"):
            start = time.perf_counter()
            program = TorchConverter().add_exported_program(ep).to_coreai()
            times["to_coreai"] = time.perf_counter() - start
        if compress is not None:  # before optimize(): no float transposes of those weights
            with memory.phase("compress"):
                start = time.perf_counter()
                program.compress(compress)
                times["compress"] = time.perf_counter() - start
        with memory.phase("optimize"):
            start = time.perf_counter()
            program.optimize()
            times["optimize"] = time.perf_counter() - start
        asset = tmp_path / "model.aimodel"
        children = ChildMemory()
        with memory.phase("save"):
            start = time.perf_counter()
            program.save_asset(asset)
            times["save"] = time.perf_counter() - start
        result["child_private"] = children.stop()
        stats = saving.last_stats
        result["save_streamed"] = stats.streamed
        result["save_buffered"] = stats.peak_buffered
        result["save_cpu"] = stats.cpu
        bytecode = asset / "main.mlirb"
        start = time.perf_counter()
        fd = os.open(bytecode, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        result["flush_s"] = time.perf_counter() - start
        with memory.phase("verify"):  # not part of the conversion
            start = time.perf_counter()
            result["hash_ok"] = hash_matches(asset)
            result["verify_s"] = time.perf_counter() - start
        result["verify_rss"] = memory.peaks.pop("verify")
        result["asset_bytes"] = sum(p.stat().st_size for p in asset.rglob("*") if p.is_file())
        shutil.rmtree(asset)
    result["times"] = times
    result["total_s"] = sum(times.values())
    result["peaks"] = dict(memory.peaks)
    extra = result["child_private"] + result["save_buffered"]
    result["peak_rss"] = memory.baseline + max(memory.peaks.values())
    result["peak_memory"] = memory.baseline + max(
        *memory.peaks.values(), memory.peaks["save"] + extra
    )
    result["targets"] = targets(result, int4)
    return result


def targets(r: dict[str, Any], int4: bool = False) -> dict[str, bool]:
    memory_target = INT4_MEMORY_TARGET if int4 else MEMORY_TARGET
    return {
        "time": r["total_s"] <= TIME_TARGET * r["write_floor_s"],
        "memory": r["peak_memory"] <= memory_target * r["weight_bytes"],
        "hash": r["hash_ok"],
    }


def _gb(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _x(n: float, weights: int) -> str:
    return f"{n / weights:.2f}×"


def table(r: dict[str, Any]) -> str:
    """The phases, the floor and the targets as markdown tables."""
    if "skipped" in r or "error" in r:
        return f"| {r['model']} | {r.get('skipped') or r.get('error')} |"
    w, times, peaks = r["weight_bytes"], r["times"], r["peaks"]
    lines = [
        f"{r['model']}: {_gb(w)} of float32 weights, asset {_gb(r['asset_bytes'])}; "
        f"model and exported program in memory: {_gb(r['baseline_rss'])} "
        f"({_x(r['baseline_rss'], w)}).",
        "",
        "| phase | time | peak RSS above the exported model |",
        "|---|---|---|",
    ]
    for phase, seconds in times.items():
        lines.append(f"| {phase} | {seconds:.2f} s | +{_x(peaks[phase], w)} |")
    cpu = ", ".join(f"{k} {v:.1f} s" for k, v in r["save_cpu"].items())
    lines += [
        f"| whole conversion | {r['total_s']:.2f} s | {_gb(r['peak_rss'])} "
        f"({_x(r['peak_rss'], w)}) |",
        f"| write floor ({_gb(w)} + fsync) | {r['write_floor_s']:.2f} s | |",
        f"| fsync of the asset after save | {r['flush_s']:.2f} s | |",
        "",
        f"save_asset beside this process: serializer child {r['child_private'] / 2**20:.0f} MB "
        f"private, its output waiting to be read at most {r['save_buffered'] / 2**20:.0f} MB "
        f"(streamed: {r['save_streamed']}); CPU: {cpu}.",
        "",
        "| target | measured | |",
        "|---|---|---|",
    ]
    t = r["targets"]
    memory_target = INT4_MEMORY_TARGET if r["model"].endswith("int4") else MEMORY_TARGET
    lines.append(
        f"| conversion ≤ {TIME_TARGET}× write floor | "
        f"{r['total_s'] / r['write_floor_s']:.2f}× | {'pass' if t['time'] else 'FAIL'} |"
    )
    lines.append(
        f"| peak memory (model, child, buffers) ≤ {memory_target}× weights | "
        f"{_x(r['peak_memory'], w)} | {'pass' if t['memory'] else 'FAIL'} |"
    )
    lines.append(
        f"| asset hash = SHA-256 of its bytecode, read back in blocks | "
        f"{'match' if t['hash'] else 'MISMATCH'} in {r['verify_s']:.2f} s, "
        f"+{_x(r['verify_rss'], w)} RSS | {'pass' if t['hash'] else 'FAIL'} |"
    )
    return "\n".join(lines)


def enough_memory(layers: int) -> tuple[bool, str]:
    """Whether this machine has the free memory the benchmark needs now (about 1.6× the
    weights: the model, its export and the conversion), and a message if not."""
    per_layer = 4 * HIDDEN * HIDDEN + 3 * HIDDEN * MLP
    weights = 4 * (layers * per_layer + 2 * VOCAB * HIDDEN)
    needed = int(1.6 * weights) + (1 << 30)
    available = _available_memory()
    if available and available < needed:
        return False, (
            f"needs {needed / 2**30:.1f} GiB of free memory, {available / 2**30:.1f} GiB available"
        )
    return True, ""


def measure_if_possible(
    layers: int = LAYERS, int4: bool = False, directory: str | None = None
) -> dict[str, Any]:
    """:func:`measure`, or a "skipped" result if the machine lacks the free memory now."""
    ok, why = enough_memory(layers)
    if not ok:
        return {"model": "llama-1.26b", "skipped": why}
    return measure(layers, int4, directory)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--int4", action="store_true")
    parser.add_argument("--dir", help="where to write (default: the temporary directory)")
    parser.add_argument("--json", action="store_true", help="print one RESULT line of JSON")
    opts = parser.parse_args(argv)
    result = measure_if_possible(opts.layers, opts.int4, opts.dir)
    if opts.json:
        print("RESULT " + json.dumps(result))
    else:
        print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
