"""``llm.Generator`` in async code and threads: ``astream`` yields what ``generate`` does, the
sync API works inside a running event loop, concurrent generations on one generator each
return what they return alone, and a generation stopped early (a cancelled task, ``break``)
frees its state."""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from coreai_torch import llm
from tests.llm.support import causal_lm

pytestmark = pytest.mark.xdist_group("llm_generator_async")

#: (prompt, sampling arguments): greedy and seeded sampling
REQUESTS: list[tuple[list[int], dict[str, Any]]] = [
    ([1, 2, 3], {}),
    ([5, 9], {"do_sample": True, "temperature": 0.9, "top_p": 0.9, "seed": 1}),
    ([7, 7, 7, 7, 7], {}),
    ([4], {"do_sample": True, "top_k": 5, "seed": 2}),
    ([11, 3, 8], {"do_sample": True, "seed": 3}),
    ([2, 6], {}),
]


@pytest.fixture(scope="module")
def generator(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path: Path = tmp_path_factory.mktemp("gen_async") / "model.aimodel"
    llm.export(causal_lm("llama"), max_context=32).save_asset(path)
    with llm.Generator(path, max_context=32) as generator:
        yield generator


@pytest.fixture(scope="module")
def sequential(generator: Any) -> list[list[int]]:
    return [list(generator.generate(p, max_new_tokens=12, **kw)) for p, kw in REQUESTS]


def test_astream_yields_what_generate_does(generator: Any, sequential: list) -> None:
    async def stream(prompt: list[int], kwargs: dict) -> list[int]:
        return [token async for token in generator.astream(prompt, max_new_tokens=12, **kwargs)]

    for (prompt, kwargs), expected in zip(REQUESTS, sequential, strict=True):
        assert asyncio.run(stream(prompt, kwargs)) == expected
    assert generator.active_generations == 0


def test_generate_inside_a_running_event_loop(generator: Any, sequential: list) -> None:
    async def cell() -> list[int]:  # a notebook cell: the kernel's loop is running
        prompt, kwargs = REQUESTS[0]
        return list(generator.generate(prompt, max_new_tokens=12, **kwargs))

    assert asyncio.run(cell()) == sequential[0]


def test_concurrent_astreams_equal_sequential(generator: Any, sequential: list) -> None:
    async def stream(prompt: list[int], kwargs: dict) -> list[int]:
        return [token async for token in generator.astream(prompt, max_new_tokens=12, **kwargs)]

    async def main() -> list[list[int]]:
        return list(await asyncio.gather(*(stream(p, kw) for p, kw in REQUESTS * 2)))

    assert asyncio.run(main()) == sequential * 2
    assert generator.active_generations == 0


def test_threads_sharing_one_generator_equal_sequential(generator: Any, sequential: list) -> None:
    def run(i: int) -> list[int]:
        prompt, kwargs = REQUESTS[i % len(REQUESTS)]
        return list(generator.generate(prompt, max_new_tokens=12, **kwargs))

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run, range(12)))
    assert results == [sequential[i % len(REQUESTS)] for i in range(12)]
    assert generator.active_generations == 0


def test_interleaved_sync_iterators_keep_their_own_cache(generator: Any, sequential: list) -> None:
    a = generator.generate(REQUESTS[0][0], max_new_tokens=12)
    b = generator.generate(REQUESTS[2][0], max_new_tokens=12)
    pairs = list(zip(a, b, strict=True))
    assert [x for x, _ in pairs] == sequential[0]
    assert [y for _, y in pairs] == sequential[2]


def test_cancelled_stream_frees_its_state(generator: Any) -> None:
    seen: list[int] = []
    during: list[int] = []

    async def consume() -> None:
        async for token in generator.astream([1, 2, 3], max_new_tokens=30):
            seen.append(token)
            during.append(generator.active_generations)
            await asyncio.sleep(0.01)

    async def main() -> None:
        task = asyncio.ensure_future(consume())
        while len(seen) < 3:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert during[0] == 1 and 3 <= len(seen) < 30
    assert generator.active_generations == 0


def test_break_out_of_a_stream_frees_its_state(generator: Any) -> None:
    async def main() -> list[int]:
        tokens = []
        async with contextlib.aclosing(generator.astream([1, 2], max_new_tokens=30)) as stream:
            async for token in stream:
                tokens.append(token)
                if len(tokens) == 2:
                    break
        return tokens

    assert len(asyncio.run(main())) == 2
    assert generator.active_generations == 0
    partial = generator.generate([1, 2], max_new_tokens=30)
    next(partial)
    assert generator.active_generations == 1
    partial.close()
    assert generator.active_generations == 0


def test_bad_arguments_raise_when_astream_is_called(generator: Any) -> None:
    with pytest.raises(ValueError, match="the prompt is empty"):
        generator.astream([])
    with pytest.raises(ValueError, match="max_context=32"):
        generator.astream([1] * 30, max_new_tokens=10)
