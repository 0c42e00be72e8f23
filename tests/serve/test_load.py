"""The load run: 8 concurrent clients x 20 requests (chat and completions, streamed and not,
greedy and seeded sampling) against one ``coreai-torch serve``; every answer equals sequential
generation, no request fails, and afterwards no generation state is held and the server's RSS
is back to its level after a warm-up round."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import psutil
import pytest

from coreai_torch.llm.generate import Generator
from tests.serve.support import save_model, start_server
from tests.serve.test_server import CHATS, chat_body, expected_text, stream_text

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("serve_load")]

CLIENTS, REQUESTS = 8, 20
#: RSS the server may keep above its level after the warm-up (allocator slack)
RSS_SLACK = 24 << 20


def test_eight_clients_twenty_requests_each(tmp_path: Any) -> None:
    asset, hf = save_model(tmp_path)
    with Generator(asset, tokenizer=hf) as generator:
        model = {"generator": generator}
        expected = [expected_text(model, c, s, 16) for c, s in CHATS]
    server = start_server([str(asset), "--tokenizer", str(hf), "--concurrency", "4"])
    process = psutil.Process(server.process.pid)
    try:

        def client_run(i: int, requests: int) -> list[tuple[int, str]]:
            results = []
            with httpx.Client(timeout=300) as client:
                for k in range(requests):
                    which = (i + k) % len(CHATS)
                    content, sampling = CHATS[which]
                    body = chat_body(content, sampling, n=16)
                    if k % 2:
                        text = stream_text(client, server.url, body)[0]
                    else:
                        r = client.post(f"{server.url}/chat/completions", json=body)
                        assert r.status_code == 200, r.text
                        text = r.json()["choices"][0]["message"]["content"]
                    results.append((which, text))
            return results

        with ThreadPoolExecutor(CLIENTS) as pool:  # warm-up: every code path once
            list(pool.map(lambda i: client_run(i, 2), range(CLIENTS)))
        baseline = process.memory_info().rss
        start = time.perf_counter()
        with ThreadPoolExecutor(CLIENTS) as pool:
            runs = list(pool.map(lambda i: client_run(i, REQUESTS), range(CLIENTS)))
        seconds = time.perf_counter() - start
        for results in runs:
            assert len(results) == REQUESTS
            for which, text in results:
                assert text == expected[which]
        state = httpx.get(f"{server.base}/health").json()
        assert state["running"] == state["waiting"] == state["active_generations"] == 0
        grown = process.memory_info().rss - baseline
        print(
            json.dumps(
                {
                    "requests": CLIENTS * REQUESTS,
                    "seconds": round(seconds, 2),
                    "rss_growth_mib": round(grown / 2**20, 1),
                }
            )
        )
        assert grown < RSS_SLACK, f"RSS grew {grown / 2**20:.1f} MiB over the load run"
    finally:
        code = server.stop()
    errors = "".join(server.stderr)
    assert code in (0, -15) and "Traceback" not in errors, errors
