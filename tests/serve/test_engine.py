"""The server's parts without a network: the request queue (slots, waiting line, refusal),
text made from streamed tokens (stop strings across tokens, partial characters, the end of
sequence), and the HTTP answers to a full queue, a stopping server and a missing API key
(through ``httpx``'s ASGI transport)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

from coreai_torch.llm.text import TextStream
from coreai_torch.serve.app import ServerOptions, create_app
from coreai_torch.serve.engine import Engine
from coreai_torch.serve.queue import QueueFull, RequestQueue, ShuttingDown
from tests.serve.support import NAME, save_model

pytestmark = pytest.mark.xdist_group("serve_engine")


def test_queue_slots_waiting_line_and_refusal() -> None:
    async def main() -> None:
        queue = RequestQueue(concurrency=1, max_queue=1)
        release = asyncio.Event()
        order: list[str] = []

        async def hold(name: str) -> None:
            async with queue.slot():
                order.append(name)
                await release.wait()

        first = asyncio.ensure_future(hold("first"))
        await asyncio.sleep(0)
        second = asyncio.ensure_future(hold("second"))
        await asyncio.sleep(0)
        assert (queue.running, queue.waiting) == (1, 1)
        with pytest.raises(QueueFull):
            async with queue.slot():
                pass
        release.set()
        await asyncio.gather(first, second)
        assert order == ["first", "second"] and (queue.running, queue.waiting) == (0, 0)
        queue.close()
        with pytest.raises(ShuttingDown):
            async with queue.slot():
                pass

    asyncio.run(main())


class Letters:
    """A tokenizer whose token i is one character of ``ALPHABET`` (id 0: end of sequence;
    ids 8 and 9: the two UTF-8 bytes of 'é')."""

    ALPHABET = "\0abc def"
    eos_token_id = 0

    def decode(self, ids: list[int]) -> str:
        utf8 = {8: b"\xc3", 9: b"\xa9"}
        raw = b"".join(utf8[i] if i in utf8 else self.ALPHABET[i].encode() for i in ids)
        return raw.decode(errors="replace")


def run_text(tokens: list[int], stops: list[str]) -> tuple[list[str], bool]:
    text = TextStream(Letters(), {0}, stops)
    pieces = [text.push(t) for t in tokens]
    pieces.append(text.finish())
    return [p for p in pieces if p], text.stopped


def test_text_stream_holds_back_a_possible_stop_string() -> None:
    # "abc def": the stop "c d" spans three tokens; "c" and " " are held back meanwhile
    pieces, stopped = run_text([1, 2, 3, 4, 5, 6, 7], ["c d"])
    assert pieces == ["a", "b"] and stopped
    # a prefix of the stop string that does not go on is released
    pieces, stopped = run_text([1, 2, 3, 4, 1], ["c d"])
    assert "".join(pieces) == "abc a" and not stopped


def test_text_stream_waits_for_whole_characters_and_ends_at_eos() -> None:
    pieces, stopped = run_text([1, 8, 9, 2, 0, 3], [])
    assert pieces == ["a", "é", "b"] and stopped


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    from coreai_torch.llm.generate import Generator

    asset, hf = save_model(tmp_path_factory.mktemp("engine"))
    engine = Engine(Generator(asset, tokenizer=hf), NAME, concurrency=1, max_queue=0)
    yield engine
    engine.generator.close()


def _post(app: Any, body: dict, **headers: str) -> httpx.Response:
    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as client:
            return await client.post("/v1/completions", json=body, headers=headers)

    return asyncio.run(main())


BODY = {"model": NAME, "prompt": "the quick", "max_tokens": 4, "temperature": 0}


def test_full_queue_and_shutdown_are_refused_with_retry_after(engine: Engine) -> None:
    app = create_app(engine)

    async def while_busy() -> httpx.Response:
        async with engine.queue.slot():  # the one slot taken, no waiting line
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://s") as client:
                return await client.post("/v1/completions", json={**BODY, "stream": True})

    busy = asyncio.run(while_busy())
    assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
    assert busy.json()["error"]["code"] == "rate_limit_exceeded"
    assert _post(app, BODY).status_code == 200
    engine.queue.closed = True
    try:
        stopping = _post(app, BODY)
    finally:
        engine.queue.closed = False
    assert stopping.status_code == 503 and stopping.headers["retry-after"] == "1"


def test_api_key(engine: Engine) -> None:
    app = create_app(engine, ServerOptions(api_key="s3cret"))
    refused = _post(app, BODY)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert _post(app, BODY, authorization="Bearer wrong").status_code == 401
    assert _post(app, BODY, authorization="Bearer s3cret").status_code == 200


def test_non_local_bind_needs_a_flag(tmp_path: Path, capsys: Any) -> None:
    from coreai_torch.cli.main import main

    assert main(["serve", str(tmp_path / "m.aimodel"), "--host", "0.0.0.0"]) == 2
    assert "--allow-remote" in capsys.readouterr().err


def test_what_serve_loads(tmp_path: Path) -> None:
    """A Hugging Face directory (exported on the fly), a saved CoreAIModelForCausalLM
    directory, a bundle of ``llm.export`` and a bare asset (with its context) give the same
    generations; other inputs are clear errors."""
    import json

    from coreai_torch import llm
    from coreai_torch.hf import CoreAIModelForCausalLM
    from coreai_torch.serve.models import load_generator
    from tests.llm.support import causal_lm
    from tests.serve.support import CHAT_TEMPLATE, MAX_CONTEXT, tiny_tokenizer

    hf = tmp_path / "hf"
    causal_lm("llama").save_pretrained(hf)
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(hf)
    generator, name = load_generator(hf, max_context=MAX_CONTEXT)
    with generator:
        assert name == "hf" and generator.tokenizer is not None
        expected = list(generator.generate("the quick", max_new_tokens=5))
    with CoreAIModelForCausalLM.from_pretrained(hf, export=True, max_context=MAX_CONTEXT) as m:
        m.save_pretrained(tmp_path / "saved")
    generator, name = load_generator(tmp_path / "saved")
    with generator:
        assert name == "saved"
        assert list(generator.generate("the quick", max_new_tokens=5)) == expected
    bundle = tmp_path / "bundle"
    llm.export(hf, max_context=MAX_CONTEXT, bundle=bundle, name="chat")
    generator, name = load_generator(bundle)
    with generator:
        assert name == "chat"
        assert list(generator.generate("the quick", max_new_tokens=5)) == expected
    asset = bundle / "chat.aimodel"  # <name>.aimodel
    with pytest.raises(ValueError, match="pass max_context"):
        load_generator(asset, tokenizer=hf)
    generator, name = load_generator(asset, tokenizer=hf, max_context=MAX_CONTEXT)
    with generator:
        assert list(generator.generate("the quick", max_new_tokens=5)) == expected
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "coreai_config.json").write_text(json.dumps({"task": "text-generation"}))
    with pytest.raises(ValueError, match="earlier coreai-torch"):
        load_generator(earlier)
    with pytest.raises(FileNotFoundError, match="no such model"):
        load_generator(tmp_path / "missing")
    with pytest.raises(ValueError, match="already exported; precision apply only"):
        load_generator(tmp_path / "saved", precision="fp16")
    with pytest.raises(FileNotFoundError, match=r"neither an \.aimodel"):
        load_generator(tmp_path)


def test_unsampleable_logits_are_a_clear_server_error(engine: Engine, monkeypatch: Any) -> None:
    import numpy as np

    def nan_logits(outputs: dict) -> np.ndarray:
        return np.full(engine.generator.vocab_size, np.nan, np.float32)

    monkeypatch.setattr(engine.generator, "_step_logits", nan_logits)
    app = create_app(engine)
    failed = _post(app, BODY)
    assert failed.status_code == 500
    assert failed.json()["error"]["code"] == "generation_failed"
    assert "NaN" in failed.json()["error"]["message"]
    assert engine.generator.active_generations == 0
