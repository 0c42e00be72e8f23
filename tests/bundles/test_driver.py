"""The reference driver runs bundles as the app's engines do and matches eager PyTorch token
for token: the sequential and pipelined engines (prefill whole and chunked, decode with the
states carried, KV growth past 256 rows and up to a small max context into fresh memory full
of noise or NaN, prefix reuse), the static-shape engine (aligned batches, contexts 64 -> 128,
prompt_opt prefill), the tokenizer's stop set."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from coreai_torch.bundles import (
    Bundle,
    BundleError,
    PipelinedEngine,
    SequentialEngine,
    StaticShapeEngine,
    open_engine,
    write_llm_bundle,
)
from tests.bundles.support import ConventionLM, assert_doctor_clean

pytestmark = pytest.mark.xdist_group("bundles")

PROMPT = [5, 9, 13, 22, 40, 7, 61, 3]


def long_prompt(length: int) -> list[int]:
    return [(7 * i + 3) % 90 + 3 for i in range(length)]


@pytest.fixture(scope="module")
def bundles(
    tmp_path_factory: pytest.TempPathFactory, assets: Path, static_asset: Path, model_dirs: dict
) -> dict[str, Bundle]:
    root = tmp_path_factory.mktemp("driver")
    written = {
        "dynamic": write_llm_bundle(
            root / "dynamic", assets / "dynamic.aimodel", model_dir=model_dirs["qwen"]
        ),
        "small": write_llm_bundle(
            root / "small",
            assets / "dynamic.aimodel",
            model_dir=model_dirs["qwen"],
            max_context_length=300,
        ),
        "static": write_llm_bundle(
            root / "static", static_asset, model_dir=model_dirs["gemma"], max_context_length=128
        ),
    }
    for bundle in written.values():
        assert_doctor_clean(bundle.path)
    return {k: Bundle.load(b.path) for k, b in written.items()}


def check_tokens(
    lm: ConventionLM, engine: Any, prompt: list[int], new: int, **kwargs: Any
) -> list[int]:
    """The engine's greedy tokens equal eager PyTorch's, and each step's logits are within
    float16 rounding of eager's."""
    steps: list[np.ndarray] = []
    tokens = engine.generate(prompt, new, on_logits=steps.append, **kwargs)
    # the app generates at most max_context_length - len(prompt) tokens
    expected = lm.greedy(prompt, min(new, engine.language.max_context_length - len(prompt)))
    assert tokens == expected
    reference = lm.full_logits(prompt + tokens[:-1])[len(prompt) - 1 :].numpy()
    for step, (actual, ref) in enumerate(zip(steps, reference, strict=True)):
        error = float(np.abs(actual.astype(np.float32) - ref).max())
        assert error <= 1e-2 * max(1.0, float(np.abs(ref).max())), f"step {step}: {error}"
    return tokens


@pytest.mark.parametrize("engine_class", [SequentialEngine, PipelinedEngine])
@pytest.mark.parametrize("length", [1, 8, 40])
def test_engines_match_eager(
    lm: ConventionLM, bundles: dict, engine_class: type, length: int
) -> None:
    prompt = long_prompt(length)
    with engine_class(bundles["dynamic"], stop_token_ids=()) as engine:
        check_tokens(lm, engine, prompt, 12)
        assert engine.calls[-1] == ("main", 1, length + 11)  # decode: 1 new token, all positions


@pytest.mark.parametrize("fresh", ["noise", "nan"])
def test_sequential_growth_past_256_rows(lm: ConventionLM, bundles: dict, fresh: str) -> None:
    prompt = long_prompt(250)
    with SequentialEngine(bundles["dynamic"], stop_token_ids=(), fresh_memory=fresh) as engine:
        assert engine.capacity == 256
        check_tokens(lm, engine, prompt, 16)
        assert engine.capacity == 512  # doubled when the context passed 256


def test_chunked_prefill(lm: ConventionLM, bundles: dict) -> None:
    prompt = long_prompt(40)
    with SequentialEngine(bundles["dynamic"], stop_token_ids=(), chunk_threshold=16) as engine:
        check_tokens(lm, engine, prompt, 4)
        assert engine.calls[:3] == [("main", 16, 16), ("main", 16, 32), ("main", 8, 40)]
    with PipelinedEngine(bundles["dynamic"], stop_token_ids=(), chunk_threshold=16) as engine:
        check_tokens(lm, engine, prompt, 4)
        # warmup, then chunks while more than 16 remain, the rest in the call that samples
        assert engine.calls[:4] == [
            ("main", 1, 1),
            ("main", 16, 16),
            ("main", 16, 32),
            ("main", 8, 40),
        ]


def test_chunking_follows_the_environment(bundles: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COREAI_CHUNK_THRESHOLD", "100")
    with SequentialEngine(bundles["dynamic"], stop_token_ids=()) as engine:
        assert (engine.chunk_threshold, engine.prefill_chunk_size) == (100, 100)
    monkeypatch.delenv("COREAI_CHUNK_THRESHOLD")
    with SequentialEngine(bundles["dynamic"], stop_token_ids=()) as engine:
        assert (engine.chunk_threshold, engine.prefill_chunk_size) == (1024, 512)


def test_small_max_context_caps_growth_and_generation(lm: ConventionLM, bundles: dict) -> None:
    prompt = long_prompt(250)
    with SequentialEngine(bundles["small"], stop_token_ids=(), fresh_memory="nan") as engine:
        tokens = check_tokens(lm, engine, prompt, 80)
        assert len(tokens) == 50  # max_context_length - prompt
        assert engine.capacity == 300  # 256, then doubled but capped at the maximum
    with PipelinedEngine(bundles["small"], stop_token_ids=()) as engine:
        assert len(engine.generate(prompt, 80)) == 50
        assert engine.capacity == 512  # grown before the prompt to what it needs, doubling


def test_prefix_reuse_and_rewind(lm: ConventionLM, bundles: dict) -> None:
    with SequentialEngine(bundles["dynamic"], stop_token_ids=()) as engine:
        first = engine.generate(PROMPT, 6)
        follow_up = PROMPT + first + [11, 12]
        calls = len(engine.calls)
        second = engine.generate(follow_up, 6)
        assert second == lm.greedy(follow_up, 6)
        # only the last generated token (never processed) and the new ones are fed
        assert engine.calls[calls] == ("main", 3, len(follow_up))
        calls = len(engine.calls)
        again = engine.generate(follow_up, 6)  # fully cached: re-fed from its last token
        assert again == second and engine.calls[calls] == ("main", 1, len(follow_up))
        other = [9, 9] + PROMPT
        assert engine.generate(other, 6) == lm.greedy(other, 6)  # diverged: full reset
        assert engine.calls[-6] == ("main", len(other), len(other))


def test_stop_tokens(lm: ConventionLM, bundles: dict) -> None:
    expected = lm.greedy(PROMPT, 12)
    with SequentialEngine(bundles["dynamic"]) as engine:
        assert engine.stop_token_ids == bundles["dynamic"].tokenizer.stop_token_ids
    stop = expected[4]
    for engine_class in (SequentialEngine, PipelinedEngine, StaticShapeEngine):
        bundle = bundles["static" if engine_class is StaticShapeEngine else "dynamic"]
        with engine_class(bundle, stop_token_ids=[stop]) as engine:
            tokens = engine.generate(PROMPT, 12)
        assert tokens == expected[: expected.index(stop) + 1]


@pytest.mark.parametrize("fresh", ["noise", "nan"])
def test_static_shape_engine(lm: ConventionLM, bundles: dict, fresh: str) -> None:
    prompt = long_prompt(40)
    with StaticShapeEngine(bundles["static"], stop_token_ids=(), fresh_memory=fresh) as engine:
        check_tokens(lm, engine, prompt, 40)
    graphs = [call[0] for call in engine.calls]
    assert graphs[:3] == ["prompt_opt_64_16", "prompt_opt_64_16", "extend_64_16"]
    assert "extend_64_4" in graphs and "extend_128_4" in graphs  # the context grew past 64
    # decode batches are aligned down to a multiple of 4 and re-process earlier tokens
    assert ("extend_64_4", 2, 42) in engine.calls


def test_open_engine_picks_the_apps_engine(bundles: dict) -> None:
    with open_engine(bundles["dynamic"]) as engine:
        assert type(engine) is PipelinedEngine
    with open_engine(bundles["static"]) as engine:
        assert type(engine) is StaticShapeEngine
    with open_engine(bundles["dynamic"], "sequential") as engine:
        assert type(engine) is SequentialEngine
    with pytest.raises(ValueError, match="variant must be"):
        open_engine(bundles["dynamic"], "fast")


def test_generation_past_the_context_is_refused(bundles: dict) -> None:
    with (
        PipelinedEngine(bundles["small"], stop_token_ids=()) as engine,
        pytest.raises(BundleError, match="context length exceeded"),
    ):
        engine.generate(long_prompt(300), 4)
