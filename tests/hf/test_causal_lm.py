"""``CoreAIModelForCausalLM``: ``generate`` equals the Hugging Face model's token for token
(greedy, sampling with a seed, EOS, left-padded batches), ``model(**inputs)`` returns the
usual logits (the program's float16 logits, as float32), ``save_pretrained`` writes the bundle
Apple's app runtimes load and ``from_pretrained`` loads it back without torch weights, the
``text-generation`` pipeline runs it, and bad input raises before anything runs.

One Llama export is shared by the fast tests (module fixture); Qwen2 and the precision /
compression options are slow.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from coreai_torch import bundles
from coreai_torch.errors import BundleError, InvalidAssetError, UnsupportedModelError
from coreai_torch.hf import CoreAIModelForCausalLM
from tests.bundles.support import assert_doctor_clean
from tests.hf.support import TOLERANCE, assert_streamed, recording_binds
from tests.hf.support import check_generate as check_generate_logits
from tests.llm.support import HALF_LOGITS, PROMPTS, causal_lm, tiny_tokenizer

pytestmark = pytest.mark.xdist_group("hf_causal_lm")

MAX_CONTEXT = 64


def check_generate(ours: Any, reference: Any, inputs: dict[str, Any], **kwargs: Any) -> Any:
    """``tests.hf.support.check_generate`` with the float16 logits' rounding allowed."""
    return check_generate_logits(ours, reference, inputs, logits_rounding=HALF_LOGITS, **kwargs)


def tokenizer() -> Any:
    tok = tiny_tokenizer()
    tok.pad_token = "<unk>"
    tok.padding_side = "left"
    return tok


def encode(tok: Any, text: str | list[str]) -> dict[str, torch.Tensor]:
    return dict(tok(text, return_tensors="pt", padding=True, return_token_type_ids=False))


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A Llama and its tokenizer saved in a directory, exported, saved and loaded back."""
    root = tmp_path_factory.mktemp("hf_llama")
    model, tok = causal_lm("llama"), tokenizer()
    model.save_pretrained(root / "hf")
    tok.save_pretrained(root / "hf")
    with recording_binds() as bound:
        exported = CoreAIModelForCausalLM.from_pretrained(
            root / "hf", export=True, max_context=MAX_CONTEXT
        )
    exported.save_pretrained(root / "coreai")
    exported.close()
    loaded = CoreAIModelForCausalLM.from_pretrained(root / "coreai")
    return {"model": model, "tokenizer": tok, "root": root, "coreai": loaded, "bound": bound}


def test_export_of_a_directory_streams_the_checkpoint(llama: dict[str, Any]) -> None:
    """The weights of an exported directory stay in its checkpoint (lazy tensors read while
    the asset is written), as with ``llm.export(model_dir)``."""
    assert_streamed(llama["bound"])


def test_greedy_generate_matches_transformers(llama: dict[str, Any]) -> None:
    """16 new tokens after prompts of three lengths; each step's logits within 1e-4."""
    for prompt in PROMPTS:
        check_generate(llama["coreai"], llama["model"], encode(llama["tokenizer"], prompt))


def test_left_padded_batch_matches_transformers(llama: dict[str, Any]) -> None:
    inputs = encode(llama["tokenizer"], PROMPTS)
    assert (inputs["attention_mask"] == 0).any()
    check_generate(llama["coreai"], llama["model"], inputs)


def test_sampling_with_a_seed_and_eos(llama: dict[str, Any]) -> None:
    inputs = encode(llama["tokenizer"], PROMPTS[1])
    args = dict(max_new_tokens=16, do_sample=True, top_k=20, top_p=0.9, temperature=0.8)
    # the program's logits are float16: the reference samples from its logits rounded so
    half_logits = llama["model"].lm_head.register_forward_hook(lambda m, i, out: out.half().float())
    try:
        torch.manual_seed(7)
        expected = llama["model"].generate(**inputs, **args)
    finally:
        half_logits.remove()
    torch.manual_seed(7)
    actual = llama["coreai"].generate(**inputs, **args)
    assert actual.tolist() == expected.tolist()
    # generation stops after the end-of-sequence token: a greedy token before any near tie
    # the float16 logits resolve otherwise (test_greedy_generate_matches_transformers)
    prompt = inputs["input_ids"].shape[1]
    greedy = llama["coreai"].generate(**inputs, max_new_tokens=16, do_sample=False)[0, prompt:]
    reference = llama["model"].generate(**inputs, max_new_tokens=16, do_sample=False)[0, prompt:]
    agree = int((greedy != reference).long().cumsum(0).eq(0).sum())
    assert agree >= 1
    eos = int(greedy[agree - 1])
    stopped = llama["coreai"].generate(**inputs, max_new_tokens=16, eos_token_id=eos)
    expected = llama["model"].generate(**inputs, max_new_tokens=16, eos_token_id=eos)
    assert stopped.tolist() == expected.tolist()
    assert stopped.shape[1] <= prompt + agree


def test_forward_returns_every_position_logits(llama: dict[str, Any]) -> None:
    inputs = encode(llama["tokenizer"], PROMPTS[2])
    with torch.no_grad():
        expected = llama["model"](**inputs).logits
    out = llama["coreai"](**inputs)
    assert out.logits.shape == expected.shape
    tol = (TOLERANCE + HALF_LOGITS) * max(1.0, float(expected.abs().max()))
    assert float((out.logits - expected).abs().max()) <= tol
    # the returned cache continues the sequence: the next token's logits
    nxt = expected[:, -1:].argmax(-1)
    step = llama["coreai"](input_ids=nxt, past_key_values=out.past_key_values)
    with torch.no_grad():
        ids = torch.cat([inputs["input_ids"], nxt], 1)
        ref = llama["model"](input_ids=ids).logits[:, -1:]
    assert float((step.logits - ref).abs().max()) <= tol


def test_saved_directory_is_a_bundle(llama: dict[str, Any]) -> None:
    """The bundle the app loads (manifest, tokenizer/, the asset), the Hugging Face configs
    and coreai_config.json beside it; no torch weights; ``coreai doctor`` finds nothing."""
    out = llama["root"] / "coreai"
    names = {p.name for p in out.iterdir()}
    assert {
        "metadata.json",
        "tokenizer",
        "coreai.aimodel",  # <name>.aimodel, the name the directory's
        "config.json",
        "generation_config.json",
        "coreai_config.json",
    } <= names
    assert not [n for n in names if n.endswith((".safetensors", ".bin", ".pt"))]
    meta = json.loads((out / "coreai_config.json").read_text())
    assert meta["task"] == "text-generation" and meta["max_context"] == MAX_CONTEXT
    assert meta["precision"] == "fp32" and meta["compression"] is None
    bundle = bundles.Bundle.load(out)
    assert bundle.language.max_context_length == MAX_CONTEXT
    assert list(bundles.function_signatures(bundle.asset_path("main"))) == ["main"]
    assert_doctor_clean(out)
    # saved again from the loaded bundle: the same bundle
    llama["coreai"].save_pretrained(llama["root"] / "again")
    assert (llama["root"] / "again" / "metadata.json").is_file()
    assert_doctor_clean(llama["root"] / "again")


def test_text_generation_pipeline(llama: dict[str, Any]) -> None:
    from transformers import AutoTokenizer, pipeline

    tok = AutoTokenizer.from_pretrained(llama["root"] / "coreai" / "tokenizer")
    args = dict(max_new_tokens=8, do_sample=False)
    ours = pipeline("text-generation", model=llama["coreai"], tokenizer=tok)(PROMPTS[1], **args)
    # what generate gives (which test_greedy_generate_matches_transformers compares with the
    # PyTorch model's, near ties of the float16 logits allowed)
    inputs = encode(tok, PROMPTS[1])
    ids = llama["coreai"].generate(**inputs, **args)[0]
    assert ours == [{"generated_text": tok.decode(ids, skip_special_tokens=True)}]


def test_bad_input_raises_before_running(llama: dict[str, Any], tmp_path: Path) -> None:
    model, tok = llama["coreai"], llama["tokenizer"]
    inputs = encode(tok, PROMPTS[2])
    with pytest.raises(ValueError, match="max_context=64"):
        model.generate(**inputs, max_new_tokens=60)
    with pytest.raises(NotImplementedError, match="'group_beam_search' is not supported"):
        model.generate(**inputs, num_beams=2, num_beam_groups=2, max_new_tokens=4)
    right = encode(tok, PROMPTS)
    right["attention_mask"] = right["attention_mask"].flip(1)
    with pytest.raises(ValueError, match="padding_side='left'"):
        model(**right)
    with pytest.raises(FileNotFoundError, match="never downloads"):
        CoreAIModelForCausalLM.from_pretrained("meta-llama/Llama-3.2-1B", export=True)
    with pytest.raises(FileNotFoundError, match="export=True"):
        CoreAIModelForCausalLM.from_pretrained(llama["root"] / "hf", export=False)
    with pytest.raises(ValueError, match="already exported"):
        CoreAIModelForCausalLM.from_pretrained(llama["root"] / "coreai", max_context=32)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        CoreAIModelForCausalLM.from_pretrained(llama["root"] / "hf", export=True, max_context=10**6)


def test_damaged_or_earlier_saved_directory_is_refused(
    llama: dict[str, Any], tmp_path: Path
) -> None:
    """A bundle's asset is checked before the runtime reads it; a manifest naming a missing
    asset names it; a directory of the earlier format names the way to a bundle."""
    import shutil

    out = tmp_path / "coreai"
    shutil.copytree(llama["root"] / "coreai", out)
    bytecode = out / "coreai.aimodel" / "main.mlirb"
    bytecode.write_bytes(bytecode.read_bytes()[:1000])
    with pytest.raises(InvalidAssetError, match=r"main\.mlirb"):
        CoreAIModelForCausalLM.from_pretrained(out)
    shutil.rmtree(out / "coreai.aimodel")
    with pytest.raises(BundleError, match=r"coreai\.aimodel"):
        CoreAIModelForCausalLM.from_pretrained(out)
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    shutil.copy(out / "config.json", earlier)
    (earlier / "coreai_config.json").write_text(
        json.dumps({"task": "text-generation", "assets": {"model": "model.aimodel"}})
    )
    with pytest.raises(ValueError, match=r"earlier coreai-torch.*save_pretrained"):
        CoreAIModelForCausalLM.from_pretrained(earlier)


def test_wrong_task_and_unsupported_architecture(tmp_path: Path) -> None:
    import transformers

    bert = transformers.BertModel(
        transformers.BertConfig(
            vocab_size=32,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
        )
    )
    bert.save_pretrained(tmp_path / "bert")
    with pytest.raises(UnsupportedModelError, match="--task feature-extraction"):
        CoreAIModelForCausalLM.from_pretrained(tmp_path / "bert", export=True)
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2)
    )
    gpt2.save_pretrained(tmp_path / "gpt2")
    with pytest.raises(UnsupportedModelError, match="'gpt2' is not supported"):
        CoreAIModelForCausalLM.from_pretrained(tmp_path / "gpt2", export=True)


@pytest.mark.slow
def test_qwen2_and_default_max_context(tmp_path: Path) -> None:
    """Qwen2 with max_context left to the model's own limit (64 positions here)."""
    model, tok = causal_lm("qwen2", max_position_embeddings=64), tokenizer()
    model.save_pretrained(tmp_path / "hf")
    coreai = CoreAIModelForCausalLM.from_pretrained(tmp_path / "hf", export=True)
    assert coreai.max_context == 64
    for prompt in PROMPTS:
        check_generate(coreai, model, encode(tok, prompt), new_tokens=20)
    check_generate(coreai, model, encode(tok, PROMPTS), new_tokens=16)


@pytest.mark.slow
def test_fp16_int4_export_generates(tmp_path: Path) -> None:
    """fp16 + int4: the options are recorded and generation runs (tokens are compared with the
    fp32 model only loosely: the first tokens agree)."""
    model, tok = causal_lm("llama"), tokenizer()
    coreai = CoreAIModelForCausalLM.from_pretrained(
        model, export=True, max_context=MAX_CONTEXT, precision="fp16", compress="int4"
    )
    assert coreai.coreai_config["precision"] == "fp16"
    assert "int4" in coreai.coreai_config["compression"]
    inputs = encode(tok, PROMPTS[1])
    out = coreai.generate(**inputs, max_new_tokens=16, do_sample=False)
    assert out.shape == (1, inputs["input_ids"].shape[1] + 16)
    with pytest.raises(ValueError, match=r"pass save_pretrained.*tokenizer="):
        coreai.save_pretrained(tmp_path / "out")  # a model instance: no tokenizer beside it
    coreai.save_pretrained(tmp_path / "out", tokenizer=tok)
    again = CoreAIModelForCausalLM.from_pretrained(tmp_path / "out")
    assert again.generate(**inputs, max_new_tokens=16, do_sample=False).tolist() == out.tolist()


# ------------------------------------------------------------- async code and threads ---


def _greedy(model: Any, inputs: dict[str, torch.Tensor]) -> list[int]:
    return model.generate(**inputs, max_new_tokens=8, do_sample=False)[0].tolist()


def test_generate_in_a_running_loop_from_threads_and_awaited(llama: dict[str, Any]) -> None:
    """Inside a running event loop (a notebook), from four threads at once and awaited with
    ``agenerate``, one model returns what it returns alone (each call its own cache)."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    model, tok = llama["coreai"], llama["tokenizer"]
    inputs = [encode(tok, prompt) for prompt in PROMPTS]
    expected = [_greedy(model, x) for x in inputs]

    async def cell() -> list[int]:
        return _greedy(model, inputs[0])

    assert asyncio.run(cell()) == expected[0]
    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(lambda i: _greedy(model, inputs[i % 3]), range(8))) == [
            expected[i % 3] for i in range(8)
        ]

    async def awaited() -> list[list[int]]:
        calls = [model.agenerate(**x, max_new_tokens=8, do_sample=False) for x in inputs]
        return [out[0].tolist() for out in await asyncio.gather(*calls)]

    assert asyncio.run(awaited()) == expected
    logits = model(**inputs[1]).logits
    awaited_logits = asyncio.run(model.acall(**inputs[1])).logits
    assert torch.equal(logits, awaited_logits)


def test_cancelled_agenerate_stops_the_generation(llama: dict[str, Any]) -> None:
    import asyncio

    from transformers import StoppingCriteria

    model, tok = llama["coreai"], llama["tokenizer"]
    steps: list[int] = []

    class Count(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            steps.append(input_ids.shape[1])
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    async def main() -> None:
        task = asyncio.ensure_future(
            model.agenerate(
                **encode(tok, PROMPTS[0]), max_new_tokens=40, stopping_criteria=[Count()]
            )
        )
        while len(steps) < 2:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert 2 <= len(steps) < 40  # stopped early ...
    done = len(steps)
    time.sleep(0.2)
    assert len(steps) == done  # ... and the generating thread had ended when it raised
