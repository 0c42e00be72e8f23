"""The server table of ``make bench``: ``coreai-torch serve`` on the benchmark LLM (the 0.27B
Llama of ``benchmarks/llm.py``, float32, max_context 512) driven by 1, 4 and 8 concurrent
``httpx`` clients over loopback, next to ``llm.Generator`` on the same asset alone.

Each request is a completion of a 32-token prompt (token ids) with 16 new tokens, greedy.  Per
level: generated tokens per second over the whole run, requests per second, and the p50 / p95
latency of a request (sent to last byte).

    python -m benchmarks.run --one-server llama     # as make bench runs it
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

PROMPT_TOKENS = 32
NEW_TOKENS = 16
LEVELS = (1, 4, 8)
#: requests per client at each level
REQUESTS_PER_CLIENT = 3


def measure_server(name: str, runs: int) -> dict[str, Any]:
    """Export the benchmark LLM, measure the Generator alone, then the server at each level."""
    import torch

    from benchmarks.llm import MAX_CONTEXT, _model
    from coreai_torch import llm

    model = _model(name)
    prompt = torch.randint(0, model.config.vocab_size, (PROMPT_TOKENS,)).tolist()
    program = llm.export(model, max_context=MAX_CONTEXT)
    del model
    result: dict[str, Any] = {"model": name, "levels": []}
    with tempfile.TemporaryDirectory() as tmp:
        asset = Path(tmp) / "bench.aimodel"
        program.save_asset(asset)
        del program
        with llm.Generator(asset, max_context=MAX_CONTEXT) as generator:
            list(generator.generate(prompt, max_new_tokens=2))  # warm-up
            seconds, decode = [], []
            for _ in range(max(runs, 3)):
                start = time.perf_counter()
                list(generator.generate(prompt, max_new_tokens=NEW_TOKENS, eos_token_id=[]))
                seconds.append(time.perf_counter() - start)
                decode.append(generator.stats.decode_tokens_per_second)
        result["generator_request_s"] = statistics.median(seconds)
        result["generator_tokens_per_s"] = NEW_TOKENS / statistics.median(seconds)
        result["generator_decode_tokens_per_s"] = statistics.median(decode)
        process, url = _start(asset, concurrency=max(LEVELS), max_context=MAX_CONTEXT)
        try:
            _requests(url, prompt, clients=2, per_client=1)  # warm-up
            for clients in LEVELS:
                start = time.perf_counter()
                latencies = _requests(url, prompt, clients, REQUESTS_PER_CLIENT)
                wall = time.perf_counter() - start
                ordered = sorted(latencies)
                print(f"   {clients} client(s): {wall:.1f} s", file=sys.stderr, flush=True)
                result["levels"].append(
                    {
                        "clients": clients,
                        "requests": len(latencies),
                        "tokens_per_s": len(latencies) * NEW_TOKENS / wall,
                        "requests_per_s": len(latencies) / wall,
                        "p50_s": statistics.median(ordered),
                        "p95_s": ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))],
                    }
                )
        finally:
            process.terminate()
            process.wait(60)
    return result


def _start(asset: Path, concurrency: int, max_context: int) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "coreai_torch.cli.main",
            "serve",
            str(asset),
            "--max-context",
            str(max_context),
            "--port",
            "0",
            "--concurrency",
            str(concurrency),
            "--model-name",
            "bench",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    if " at http://" not in line:
        process.kill()
        raise RuntimeError(f"the server did not start: {line!r}")
    return process, line.split(" at ", 1)[1].split()[0]


def _requests(url: str, prompt: list[int], clients: int, per_client: int) -> list[float]:
    """``clients`` threads, each sending ``per_client`` requests in turn; every latency."""
    import httpx

    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": NEW_TOKENS,
        "temperature": 0,
    }

    def client(_: int) -> list[float]:
        latencies = []
        with httpx.Client(timeout=3600) as http:
            for _ in range(per_client):
                start = time.perf_counter()
                r = http.post(f"{url}/completions", json=body)
                r.raise_for_status()
                assert r.json()["usage"]["completion_tokens"] == NEW_TOKENS
                latencies.append(time.perf_counter() - start)
        return latencies

    with ThreadPoolExecutor(clients) as pool:
        return [t for times in pool.map(client, range(clients)) for t in times]


def server_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of :func:`measure_server` results."""
    lines = [
        "| serving | requests | generated tokens/s | requests/s | p50 latency | p95 latency |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| failed: {r['error']} ||||||")
            continue
        lines.append(
            f"| llm.Generator alone (decode {r['generator_decode_tokens_per_s']:.1f} tokens/s) "
            f"| 1 at a time | {r['generator_tokens_per_s']:.1f} | "
            f"{1 / r['generator_request_s']:.2f} | {r['generator_request_s']:.2f} s | |"
        )
        for level in r["levels"]:
            lines.append(
                f"| server, {level['clients']} client(s) | {level['requests']} | "
                f"{level['tokens_per_s']:.1f} | {level['requests_per_s']:.2f} | "
                f"{level['p50_s']:.2f} s | {level['p95_s']:.2f} s |"
            )
    return "\n".join(lines)
