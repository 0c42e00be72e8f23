"""``coreai-torch serve`` driven by real clients over loopback: the ``openai`` client and
``httpx``, streaming and not, concurrent clients returning what sequential generation returns,
a client that disconnects mid-stream, bad requests answered with OpenAI errors -- and no server
error or leaked generation state.  One server (a child process) is shared by the module; its
shutdown on SIGTERM is checked at the end.  The load run is slow (``test_load``)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from coreai_torch.llm.generate import Generator, decode
from tests.serve.support import MAX_CONTEXT, NAME, Server, save_model, start_server

pytestmark = pytest.mark.xdist_group("serve")

#: (messages, sampling) of the chat requests: greedy and seeded sampling
CHATS: list[tuple[str, dict[str, Any]]] = [
    ("the quick brown fox", {"temperature": 0}),
    ("language models", {"temperature": 0.8, "top_p": 0.9, "seed": 3}),
    ("a core ai program", {"temperature": 0}),
    ("the cache keeps", {"temperature": 1.0, "seed": 11}),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    asset, hf = save_model(tmp_path_factory.mktemp("serve"))
    generator = Generator(asset, tokenizer=hf)
    yield {"asset": asset, "hf": hf, "generator": generator}
    generator.close()


@pytest.fixture(scope="module")
def server(model: dict[str, Any]) -> Server:
    server = start_server([str(model["asset"]), "--tokenizer", str(model["hf"])])
    yield server
    code = server.stop()
    errors = "".join(server.stderr)
    assert code in (0, -15), errors  # -15: uvicorn re-raises SIGTERM after a clean shutdown
    assert "Traceback" not in errors and " 500 " not in errors, errors


def expected_text(model: dict[str, Any], content: str, sampling: dict[str, Any], n: int) -> str:
    """What sequential generation gives for one chat request (the reference)."""
    generator, tokenizer = model["generator"], model["generator"].tokenizer
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True
    )
    temperature = sampling.get("temperature", 1.0)
    tokens = list(
        generator.generate(
            list(ids),
            max_new_tokens=n,
            do_sample=temperature > 0,
            temperature=temperature or 1.0,
            top_p=sampling.get("top_p"),
            seed=sampling.get("seed"),
        )
    )
    return decode(tokenizer, [t for t in tokens if t != tokenizer.eos_token_id])


def chat_body(content: str, sampling: dict[str, Any], n: int = 12, **extra: Any) -> dict:
    return {
        "model": NAME,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": n,
        **sampling,
        **extra,
    }


def stream_text(client: httpx.Client, url: str, body: dict) -> tuple[str, str | None]:
    """The text and finish reason of a streamed chat request (server-sent events)."""
    text, finish = "", None
    with client.stream("POST", f"{url}/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["delta"].get("content", "")
            finish = choice["finish_reason"] or finish
    return text, finish


def health(server: Server) -> dict[str, Any]:
    return httpx.get(f"{server.base}/health").json()


def test_models_lists_the_served_model(server: Server) -> None:
    models = httpx.get(f"{server.url}/models").json()
    assert [m["id"] for m in models["data"]] == [NAME]


def test_openai_client_matches_sequential_generation(server: Server, model: dict[str, Any]) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    for content, sampling in CHATS[:2]:
        expected = expected_text(model, content, sampling, 12)
        reply = client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": content}], max_tokens=12, **sampling
        )
        assert reply.choices[0].message.content == expected
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert reply.usage.completion_tokens <= 12 and reply.usage.prompt_tokens > 0
        streamed = client.chat.completions.create(
            model=NAME,
            messages=[{"role": "user", "content": content}],
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            **sampling,
        )
        chunks = list(streamed)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    completion = client.completions.create(
        model=NAME, prompt="the quick brown", max_tokens=8, temperature=0
    )
    tokenizer = model["generator"].tokenizer
    ids = tokenizer.encode("the quick brown")
    tokens = list(model["generator"].generate(ids, max_new_tokens=8))
    assert completion.choices[0].text == decode(
        tokenizer, [t for t in tokens if t != tokenizer.eos_token_id]
    )


def test_concurrent_clients_match_sequential_generation(
    server: Server, model: dict[str, Any]
) -> None:
    expected = [expected_text(model, c, s, 12) for c, s in CHATS]

    def client_run(i: int) -> list[str]:
        with httpx.Client(timeout=120) as client:
            texts = []
            for k in range(3):
                content, sampling = CHATS[(i + k) % len(CHATS)]
                if (i + k) % 2:
                    texts.append(stream_text(client, server.url, chat_body(content, sampling))[0])
                else:
                    r = client.post(
                        f"{server.url}/chat/completions", json=chat_body(content, sampling)
                    )
                    assert r.status_code == 200, r.text
                    texts.append(r.json()["choices"][0]["message"]["content"])
            return texts

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(client_run, range(4)))
    for i, texts in enumerate(results):
        assert texts == [expected[(i + k) % len(CHATS)] for k in range(3)]
    state = health(server)
    assert state["running"] == state["waiting"] == state["active_generations"] == 0


def test_stop_strings_end_the_text(server: Server, model: dict[str, Any]) -> None:
    content, sampling = CHATS[0]
    full = expected_text(model, content, sampling, 12)
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), full
    r = httpx.post(
        f"{server.url}/chat/completions", json=chat_body(content, sampling, stop=[stop])
    ).json()
    assert r["choices"][0]["message"]["content"] == full[: full.find(stop)]
    assert r["choices"][0]["finish_reason"] == "stop"
    with httpx.Client() as client:
        assert stream_text(client, server.url, chat_body(content, sampling, stop=stop)) == (
            full[: full.find(stop)],
            "stop",
        )


def test_client_disconnecting_mid_stream_frees_the_generation(server: Server) -> None:
    body = chat_body("the quick brown fox", {"temperature": 0}, n=40, stream=True)
    interrupted = health(server)["interrupted"]
    with (
        httpx.Client() as client,
        client.stream("POST", f"{server.url}/chat/completions", json=body) as r,
    ):
        assert next(r.iter_lines()).startswith("data: ")  # the generation runs; then hang up
    deadline = time.monotonic() + 30
    while (state := health(server))["active_generations"] or state["running"]:
        assert time.monotonic() < deadline, state
        time.sleep(0.05)
    assert state["interrupted"] == interrupted + 1  # stopped before its 40 tokens
    r = httpx.post(f"{server.url}/chat/completions", json=chat_body("the", {"temperature": 0}))
    assert r.status_code == 200


@pytest.mark.parametrize(
    ("body", "status", "match"),
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, "must be a JSON object"),
        ({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404, "gpt-4"),
        ({"model": NAME}, 400, "'messages' must be a non-empty list"),
        (
            {"model": NAME, "messages": [{"role": "user", "content": "the " * 200}]},
            400,
            f"context holds {MAX_CONTEXT}",
        ),
        (
            {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 500},
            400,
            "exceeds this server's limit",
        ),
        (
            {"model": NAME, "messages": [{"role": "user", "content": "the"}], "max_tokens": 60},
            400,
            "context_length|positions",
        ),
        (
            {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "temperature": 3},
            400,
            "'temperature' must be a number in",
        ),
        (
            {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "n": 2},
            400,
            "'n' must be 1",
        ),
        (
            {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "tools": [{}]},
            400,
            "tool calls",
        ),
        (
            {"model": NAME, "messages": [{"role": "user", "content": "x" * (2 << 20)}]},
            413,
            "exceeds this server's limit",
        ),
    ],
    ids=[
        "malformed",
        "array",
        "unknown_model",
        "no_messages",
        "oversize_prompt",
        "max_tokens_limit",
        "prompt_plus_max_tokens",
        "temperature",
        "n",
        "tools",
        "too_large",
    ],
)
def test_bad_requests_get_openai_errors(server: Server, body: Any, status: int, match: str) -> None:
    import re

    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(
        f"{server.url}/chat/completions",
        content=content,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert re.search(match, f"{error['message']} {error['code']}"), error
    assert error["type"]
