"""``coreai_torch.llm`` end to end for one architecture (a Llama saved with
``save_pretrained``, with a tokenizer trained here): ``coreai-torch llm export`` writes one
program with ``prefill`` and ``decode`` sharing weights and the KV cache; greedy generation
on the runtime equals ``model.generate`` token for token; ``coreai-torch llm generate``
prints the text and the speeds; bad arguments raise before anything runs.

The other architectures are in ``test_architectures.py`` (slow).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from coreai_torch import TorchConverter, llm
from coreai_torch.cli import main
from tests.llm.support import (
    MAX_CONTEXT,
    PROMPTS,
    asset_bytes,
    causal_lm,
    check_generation,
    reference,
    save_model_dir,
)

# The tests share one export (module fixture): keep them on one xdist worker.
pytestmark = pytest.mark.xdist_group("llm_export")

# A wider Llama than the other tests' so the weights dominate the asset (size check).
WIDE = dict(hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A model directory (model + tokenizer) and the asset ``coreai-torch llm export``
    wrote from it."""
    root = tmp_path_factory.mktemp("llm")
    model, tokenizer, model_dir = save_model_dir(root, **WIDE)
    asset = root / "model.aimodel"
    code = main(["llm", "export", str(model_dir), "-o", str(asset), "--max-context", "64"])
    assert code == 0
    return {"model": model, "tokenizer": tokenizer, "dir": model_dir, "asset": asset}


def test_one_program_shares_weights_and_the_kv_cache(exported: dict[str, Any]) -> None:
    import coreai.authoring as ca

    model = exported["model"]
    with llm.Generator(exported["asset"]) as generator:
        session = generator.session
        assert sorted(session.model.function_names) == ["decode", "prefill"]
        layers = model.config.num_hidden_layers
        names = [f"layers.{i}.{kind}_cache" for i in range(layers) for kind in ("k", "v")]
        for entrypoint in ("prefill", "decode"):
            desc = session.descriptor(entrypoint)
            assert list(desc.input_names) == ["input_ids", "start_position"]
            assert list(desc.output_names) == ["logits"]
            assert list(desc.state_names) == names
        cache = session.descriptor("decode").state_descriptor("layers.1.v_cache")
        assert list(cache.shape) == [1, 2, MAX_CONTEXT, 32]  # (batch, kv heads, positions, dim)
        assert list(session.descriptor("prefill").input_descriptor("input_ids").shape) == [1, -1]
        assert list(session.descriptor("decode").input_descriptor("input_ids").shape) == [1, 1]
        assert generator.max_context == MAX_CONTEXT
    text = str(ca.AIModelAsset.load(exported["asset"]).program)
    found = set(re.findall(r'composite_declaration<"(\w+)"', text))
    assert {"rms_norm", "rope", "scaled_dot_product_attention"} <= found
    # Every weight is stored once for both entry points.
    weights = {id(p): p.numel() * p.element_size() for p in model.parameters()}
    weight_bytes = sum(weights.values())
    assert weight_bytes <= asset_bytes(exported["asset"]) <= 1.2 * weight_bytes


def test_greedy_generation_matches_transformers(exported: dict[str, Any]) -> None:
    """32 tokens after prompts of three lengths, token for token, and each step's logits."""
    tokenizer = exported["tokenizer"]
    lengths = [len(tokenizer.encode(p)) for p in PROMPTS]
    assert len(set(lengths)) == 3 and min(lengths) >= 1
    with llm.Generator(exported["asset"], tokenizer=exported["dir"]) as generator:
        for prompt in PROMPTS:
            check_generation(generator, exported["model"], tokenizer.encode(prompt))
        # a text prompt goes through the tokenizer; every prompt starts from an empty cache
        by_text = list(generator.generate(PROMPTS[1], max_new_tokens=8))
        assert by_text == reference(exported["model"], tokenizer.encode(PROMPTS[1]), 8).tokens
        stats = generator.stats
        assert stats.prompt_tokens == lengths[1] and stats.generated_tokens == 8
        assert stats.decode_steps == 7
        assert stats.prefill_tokens_per_second > 0 and stats.decode_tokens_per_second > 0
        assert "tokens/s" in str(stats)


def test_cli_generate_prints_the_text_then_the_speeds(
    exported: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    tokenizer = exported["tokenizer"]
    args = ["llm", "generate", str(exported["asset"]), "--tokenizer", str(exported["dir"])]
    assert main([*args, "--prompt", PROMPTS[1], "--max-new-tokens", "8"]) == 0
    text, speeds = capsys.readouterr().out.splitlines()
    expected = reference(exported["model"], tokenizer.encode(PROMPTS[1]), 8).tokens
    assert text == tokenizer.decode(expected)
    assert re.match(r"prefill: \d+ tokens in .* tokens/s\); decode: 7 tokens in ", speeds)
    # token ids in, token ids out (no tokenizer)
    assert main(["--json", *args[:3], "--prompt", "5,6,7", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert f'"tokens": {reference(exported["model"], [5, 6, 7], 3).tokens}'.replace(
        " ", ""
    ) in out.replace(" ", "").replace("\n", "")


def test_generation_stops_after_the_end_of_sequence_token(exported: dict[str, Any]) -> None:
    model, ids = exported["model"], [5, 6, 7]
    eos = reference(model, ids, 8).tokens[4]
    expected = reference(model, ids, 8, eos_token_id=eos).tokens
    assert expected[-1] == eos and len(expected) <= 5
    with llm.Generator(exported["asset"], tokenizer=exported["tokenizer"]) as generator:
        assert list(generator.generate(ids, 8, eos_token_id=eos)) == expected
        # the tokenizer's end-of-sequence token is the default; an empty list disables it
        default = list(generator.generate(ids, 8))
        tokenizer_eos = exported["tokenizer"].eos_token_id
        assert default == reference(model, ids, 8, eos_token_id=tokenizer_eos).tokens
        assert len(list(generator.generate(ids, 8, eos_token_id=[]))) == 8


def test_sampling_is_seeded(exported: dict[str, Any]) -> None:
    with llm.Generator(exported["asset"]) as generator:
        prompt = [5, 6, 7]

        def run(**options: Any) -> list[int]:
            return list(generator.generate(prompt, max_new_tokens=12, do_sample=True, **options))

        first = run(seed=1, temperature=1.5)
        assert run(seed=1, temperature=1.5) == first
        assert any(run(seed=s, temperature=1.5) != first for s in range(2, 6))
        greedy = list(generator.generate(prompt, max_new_tokens=12))
        assert run(seed=3, top_k=1) == greedy
        assert run(seed=3, top_p=1e-9) == greedy


def test_bad_arguments_raise_before_anything_runs(exported: dict[str, Any]) -> None:
    with llm.Generator(exported["asset"]) as generator:
        with pytest.raises(ValueError, match="the prompt is empty"):
            generator.generate([])
        with pytest.raises(ValueError, match=r"needs a context of 65 positions.*max_context=64"):
            generator.generate(list(range(40)), max_new_tokens=26)
        with pytest.raises(ValueError, match="a text prompt needs a tokenizer"):
            generator.generate("hello")
        with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
            generator.generate([1], max_new_tokens=0)
        with pytest.raises(ValueError, match="top_p"):
            generator.generate([1], do_sample=True, top_p=1.5)
        # the longest context fits exactly
        assert len(list(generator.generate(list(range(40)), max_new_tokens=25))) == 25


def test_sample_restricts_to_top_k_and_top_p() -> None:
    from coreai_torch.llm.generate import sample

    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    rng = np.random.default_rng(0)
    draws = [sample(logits, rng, top_k=2) for _ in range(400)]
    assert set(draws) == {0, 1}
    draws = [sample(logits, rng, top_p=0.8) for _ in range(400)]
    assert set(draws) == {0, 1}  # 0.5 + 0.3 reaches 0.8
    draws = [sample(logits, rng, top_p=0.81) for _ in range(400)]
    assert set(draws) == {0, 1, 2}
    draws = [sample(logits, rng) for _ in range(4000)]
    assert abs(draws.count(0) / 4000 - 0.5) < 0.05


def test_export_rejects_what_it_cannot_export(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(llm.UnsupportedModelError, match="model type 'gpt2' is not supported"):
        llm.export(gpt2)
    with pytest.raises(llm.UnsupportedModelError, match="not a Hugging Face transformers"):
        llm.export(torch.nn.Linear(2, 2))
    with pytest.raises(FileNotFoundError, match=r"no config.json.*never downloads"):
        llm.export(tmp_path / "missing")
    with pytest.raises(TypeError, match="expects a transformers causal LM"):
        llm.export(42)  # type: ignore[arg-type]
    model = causal_lm("llama")
    with pytest.raises(llm.UnsupportedModelError, match="LlamaModel has no language-model head"):
        llm.export(model.model)
    model.model.save_pretrained(tmp_path / "base")
    with pytest.raises(llm.UnsupportedModelError, match="holds a LlamaModel, not a causal LM"):
        llm.export(tmp_path / "base")
    with pytest.raises(ValueError, match=r"precision='fp8'\): unknown precision"):
        llm.export(model, precision="fp8")
    with pytest.raises(ValueError, match="compute_precision must be one of"):
        llm.export(model, precision=torch.float64)
    with pytest.raises(TypeError, match=r"llm.export\(precision=...\) takes"):
        llm.export(model, precision=16)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"compress='int9'\): unknown compression"):
        llm.export(model, compress="int9")
    with pytest.raises(TypeError, match=r"llm.export\(compress=...\) takes"):
        llm.export(model, compress=4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_context must be an int >= 2"):
        llm.export(model, max_context=1)
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        llm.export(model, max_context=4096)
    gpt2.save_pretrained(tmp_path / "gpt2")
    code = main(["llm", "export", str(tmp_path / "gpt2"), "-o", str(tmp_path / "g.aimodel")])
    assert code == 2


def test_a_generator_needs_a_program_from_llm_export() -> None:
    from coreai_torch.frontend.export import export_decomposed

    ep = export_decomposed(torch.nn.Linear(2, 2).eval(), (torch.randn(1, 2),))
    program = TorchConverter().add_exported_program(ep).to_coreai()
    with pytest.raises(ValueError, match="a Generator needs 'prefill' and 'decode'"):
        llm.Generator(program)
    with pytest.raises(FileNotFoundError, match=r"no such \.aimodel"):
        llm.Generator("missing.aimodel")


def test_llm_export_progress_shows_every_phase_of_a_streamed_export(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """``--progress``: loading (the checkpoint bound, nothing read), tracing, lowering,
    optimizing and writing (where a streamed model's weights are read) each move the bar."""
    _, _, model_dir = save_model_dir(tmp_path)
    asset = tmp_path / "model.aimodel"
    args = ["llm", "export", str(model_dir), "-o", str(asset), "--max-context", "32"]
    assert main([*args, "--progress"]) == 0
    err = capsys.readouterr().err
    for phase in ("load", "trace", "lowering prefill", "lowering decode", "optimize", "save"):
        assert phase in err, (phase, err)
    assert main([*args, "--no-progress"]) == 0
    assert "trace" not in capsys.readouterr().err


def test_a_dense_model_is_traced_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode step is the prefill's graph specialized to one token, not a second trace;
    where the graph cannot be specialized, the decode step is traced."""
    import importlib

    from coreai_torch.frontend import specialize

    exporting = importlib.import_module("coreai_torch.llm.export")
    traced: list[tuple[int, ...]] = []
    trace = exporting.trace_cached

    def counted(wrapper: torch.nn.Module, args: tuple, dynamic_shapes: Any) -> Any:
        traced.append(tuple(args[0].shape))
        return trace(wrapper, args, dynamic_shapes)

    monkeypatch.setattr(exporting, "trace_cached", counted)
    model = causal_lm("llama")
    program = llm.export(model, max_context=MAX_CONTEXT)
    assert traced == [(1, 2)]
    ids = [5, 6, 7]
    with llm.Generator(program) as generator:
        check_generation(generator, model, ids, 4)

    def refuse(*args: Any) -> Any:
        raise specialize.SpecializationError("not this graph")

    monkeypatch.setattr(exporting, "specialize", refuse)
    traced.clear()
    program = llm.export(model, max_context=MAX_CONTEXT)
    assert traced == [(1, 2), (1, 1)]
    with llm.Generator(program) as generator:
        check_generation(generator, model, ids, 4)
