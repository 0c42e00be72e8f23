"""``coreai_torch.llm`` end to end for one architecture (a Llama saved with
``save_pretrained``, with a tokenizer trained here): ``coreai-torch llm export`` writes the
bundle the app loads, whose program is the function ``main`` of the app engines (int32 ids and
positions, float16 logits of every new token, two KV states that grow); the reference driver
(both dynamic engines, fresh memory full of noise or NaN, the states grown by copying, a
prompt re-fed from its last token) and ``llm.Generator`` generate what ``model.generate`` does,
token for token; ``coreai-torch llm generate`` prints the text and the speeds; bad arguments
raise before anything runs.

The other architectures are in ``test_architectures.py``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from coreai_torch import TorchConverter, bundles, llm
from coreai_torch.cli import main
from tests.bundles.support import assert_doctor_clean
from tests.llm.support import (
    MAX_CONTEXT,
    PROMPTS,
    asset_bytes,
    causal_lm,
    check_engine,
    check_generation,
    export_bundle,
    reference,
    save_model_dir,
)

# The tests share one export (module fixture): keep them on one xdist worker.
pytestmark = pytest.mark.xdist_group("llm_export")

# A wider Llama than the other tests' so the weights dominate the asset (size check).
WIDE = dict(hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A model directory (model + tokenizer) and the bundle ``coreai-torch llm export`` wrote
    from it."""
    root = tmp_path_factory.mktemp("llm")
    model, tokenizer, model_dir = save_model_dir(root, **WIDE)
    bundle = root / "TinyLlama"
    code = main(["llm", "export", str(model_dir), "-o", str(bundle), "--max-context", "64"])
    assert code == 0
    return {"model": model, "tokenizer": tokenizer, "dir": model_dir, "bundle": bundle}


def test_the_bundle_holds_main_in_the_app_engines_convention(exported: dict[str, Any]) -> None:
    import coreai.authoring as ca

    model, bundle = exported["model"], bundles.Bundle.load(exported["bundle"])
    manifest = json.loads((exported["bundle"] / "metadata.json").read_text())
    assert manifest["kind"] == "llm" and manifest["assets"] == {"main": "TinyLlama.aimodel"}
    language = bundle.language
    assert language.max_context_length == MAX_CONTEXT and language.vocab_size == 128
    assert bundle.structure == "dynamic"
    assert sorted(bundle.tokenizer.stop_token_ids) == [exported["tokenizer"].eos_token_id]
    # the Hugging Face configs ride along (the app ignores them)
    assert (exported["bundle"] / "config.json").is_file()
    asset = bundle.asset_path("main")
    main_fn = bundles.function_signatures(asset)["main"]
    assert list(bundles.function_signatures(asset)) == ["main"]
    layers = model.config.num_hidden_layers
    ids, positions = main_fn.inputs
    assert (ids.name, ids.dtype, ids.shape) == ("input_ids", "int32", (1, None))
    assert (positions.name, positions.dtype, positions.shape) == (
        "position_ids",
        "int32",
        (1, None),
    )
    (logits,) = main_fn.outputs
    assert (logits.name, logits.dtype, logits.shape) == ("logits", "float16", (1, None, 128))
    assert [(s.name, s.dtype, s.shape) for s in main_fn.states] == [
        (name, "float32", (layers, 1, 2, None, 32)) for name in ("keyCache", "valueCache")
    ]
    text = str(ca.AIModelAsset.load(asset).program)
    found = set(re.findall(r'composite_declaration<"(\w+)"', text))
    assert {"rms_norm", "rope", "scaled_dot_product_attention"} <= found
    # every weight is stored once
    weights = {id(p): p.numel() * p.element_size() for p in model.parameters()}
    weight_bytes = sum(weights.values())
    assert weight_bytes <= asset_bytes(asset) <= 1.2 * weight_bytes
    assert_doctor_clean(exported["bundle"])


@pytest.mark.parametrize("variant", ["pipelined", "sequential"])
@pytest.mark.parametrize("fresh_memory", ["noise", "nan"])
def test_the_reference_driver_generates_what_transformers_does(
    exported: dict[str, Any], variant: str, fresh_memory: str
) -> None:
    """The app's engines on prompts of three lengths; the rows of the states past the
    positions hold noise or NaN (memory the app never zeroes), which must not matter."""
    tokenizer = exported["tokenizer"]
    with bundles.open_engine(
        exported["bundle"], variant, stop_token_ids=[], fresh_memory=fresh_memory
    ) as engine:
        for prompt in PROMPTS:
            check_engine(engine, exported["model"], tokenizer.encode(prompt))


def test_states_grown_by_copying_and_a_rewritten_position(tmp_path: Path) -> None:
    """A context beyond the engines' first 256 rows: the sequential engine doubles its states
    mid-generation, copying the rows it holds into memory full of NaN; a prompt the history
    already holds is re-fed from its last token (its position written again); a conversation
    that goes on feeds only its new tokens.  Each time the tokens are ``model.generate``'s."""
    model = causal_lm("llama", max_position_embeddings=512)
    bundle, _ = export_bundle(model, tmp_path, max_context=320)
    prompt = list(range(3, 43))  # 40 tokens, 240 generated: 280 positions
    with bundles.open_engine(
        bundle, "sequential", stop_token_ids=[], fresh_memory="nan", chunk_threshold=16
    ) as engine:
        first = check_engine(engine, model, prompt, 240)
        assert engine.capacity == 320  # grown from 256, up to the context
        assert [c[1] for c in engine.calls[:3]] == [16, 16, 8]  # the prompt in chunks
        calls = len(engine.calls)
        assert check_engine(engine, model, prompt, 8) == first[:8]
        assert engine.calls[calls][1:] == (1, len(prompt))  # the last prompt token again
        turn = [*prompt, *first[:20], 7, 9]
        check_engine(engine, model, turn, 8)
    assert_doctor_clean(bundle)


def test_greedy_generation_matches_transformers(exported: dict[str, Any]) -> None:
    """32 tokens after prompts of three lengths, token for token, and each step's logits."""
    tokenizer = exported["tokenizer"]
    lengths = [len(tokenizer.encode(p)) for p in PROMPTS]
    assert len(set(lengths)) == 3 and min(lengths) >= 1
    with llm.Generator(exported["bundle"]) as generator:  # its own tokenizer
        assert generator.max_context == MAX_CONTEXT
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
    args = ["llm", "generate", str(exported["bundle"])]
    assert main([*args, "--prompt", PROMPTS[1], "--max-new-tokens", "8"]) == 0
    text, speeds = capsys.readouterr().out.splitlines()
    expected = reference(exported["model"], tokenizer.encode(PROMPTS[1]), 8).tokens
    assert text == tokenizer.decode(expected)
    assert re.match(r"prefill: \d+ tokens in .* tokens/s\); decode: 7 tokens in ", speeds)
    # token ids in, token ids out (no tokenizer)
    assert main(["--json", *args, "--prompt", "5,6,7", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert f'"tokens": {reference(exported["model"], [5, 6, 7], 3).tokens}'.replace(
        " ", ""
    ) in out.replace(" ", "").replace("\n", "")


def test_generation_stops_after_the_end_of_sequence_token(exported: dict[str, Any]) -> None:
    model, ids = exported["model"], [5, 6, 7]
    eos = reference(model, ids, 8).tokens[4]
    expected = reference(model, ids, 8, eos_token_id=eos).tokens
    assert expected[-1] == eos and len(expected) <= 5
    with llm.Generator(exported["bundle"]) as generator:
        assert list(generator.generate(ids, 8, eos_token_id=eos)) == expected
        # the bundle's stop tokens are the default; an empty list disables them
        default = list(generator.generate(ids, 8))
        tokenizer_eos = exported["tokenizer"].eos_token_id
        assert default == reference(model, ids, 8, eos_token_id=tokenizer_eos).tokens
        assert len(list(generator.generate(ids, 8, eos_token_id=[]))) == 8


def test_sampling_is_seeded(exported: dict[str, Any]) -> None:
    with llm.Generator(exported["bundle"]) as generator:
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
    with llm.Generator(exported["bundle"]) as generator:
        with pytest.raises(ValueError, match="the prompt is empty"):
            generator.generate([])
        with pytest.raises(ValueError, match=r"needs a context of 65 positions.*max_context=64"):
            generator.generate(list(range(40)), max_new_tokens=26)
        with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
            generator.generate([1], max_new_tokens=0)
        with pytest.raises(ValueError, match="top_p"):
            generator.generate([1], do_sample=True, top_p=1.5)
        # the longest context fits exactly
        assert len(list(generator.generate(list(range(40)), max_new_tokens=25))) == 25
    # a bare asset has neither a tokenizer nor a recorded context
    with llm.Generator(exported["bundle"] / "TinyLlama.aimodel") as generator:
        assert generator.max_context is None and generator.state_bytes is None
        with pytest.raises(ValueError, match="a text prompt needs a tokenizer"):
            generator.generate("hello")


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
    with pytest.raises(ValueError, match="engine must be one of"):
        llm.export(model, engine="metal")
    with pytest.raises(ValueError, match=r"contexts=...\) shapes the static-shape functions"):
        llm.export(model, contexts=[256])
    with pytest.raises(ValueError, match="a bundle embeds the model's tokenizer"):
        llm.export(model, bundle=tmp_path / "b")
    with pytest.raises(ValueError, match="a bundle is a directory"):
        llm.export(model, bundle=tmp_path / "b.aimodel", tokenizer=tmp_path)
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError, match="pass overwrite=True"):
        llm.export(model, bundle=tmp_path / "taken", tokenizer=tmp_path)
    gpt2.save_pretrained(tmp_path / "gpt2")
    code = main(["llm", "export", str(tmp_path / "gpt2"), "-o", str(tmp_path / "g")])
    assert code == 2
    _, _, model_dir = save_model_dir(tmp_path)
    code = main(["llm", "export", str(model_dir), "-o", str(tmp_path / "g.aimodel")])
    assert code == 2


def test_a_generator_needs_main_in_the_app_engines_convention() -> None:
    from coreai_torch.frontend.export import export_decomposed

    ep = export_decomposed(torch.nn.Linear(2, 2).eval(), (torch.randn(1, 2),))
    program = TorchConverter().add_exported_program(ep).to_coreai()
    with pytest.raises(bundles.CallingConventionError, match="main"):
        llm.Generator(program)
    # the earlier prefill/decode format gets the command that makes a bundle instead
    converter = TorchConverter()
    for name in ("prefill", "decode"):
        converter.add_exported_program(ep, entrypoint_name=name)
    with pytest.raises(ValueError, match=r"earlier prefill/decode format.*bundle="):
        llm.Generator(converter.to_coreai())
    with pytest.raises(FileNotFoundError, match=r"no such \.aimodel"):
        llm.Generator("missing.aimodel")


def test_llm_export_progress_shows_every_phase_of_a_streamed_export(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """``--progress``: loading (the checkpoint bound, nothing read), tracing, lowering,
    optimizing and writing (where a streamed model's weights are read) each move the bar."""
    _, _, model_dir = save_model_dir(tmp_path)
    args = ["llm", "export", str(model_dir), "-o", str(tmp_path / "b"), "--max-context", "32"]
    assert main([*args, "--progress"]) == 0
    err = capsys.readouterr().err
    for phase in ("load", "trace", "lowering main", "optimize", "save"):
        assert phase in err, (phase, err)
    assert main([*args, "--no-progress", "--overwrite"]) == 0
    assert "trace" not in capsys.readouterr().err
