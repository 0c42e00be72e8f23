"""``CoreAIModelForSpeechSeq2Seq`` (Whisper): Whisper's ``generate`` on the runtime equals the
Hugging Face model's token for token (greedy with each step's logits, language / task tokens,
batches, beam search, sampling with a seed), ``model(**inputs)`` returns the decoder logits,
the save / load round trip needs no torch weights, the ``automatic-speech-recognition``
pipeline runs it, and bad input raises before anything runs.

One export shared by the tests (module fixture, about 15 s): all slow.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from coreai_torch.hf import CoreAIModelForSpeechSeq2Seq
from tests.hf.support import (
    TOLERANCE,
    assert_streamed,
    check_generate,
    recording_binds,
    whisper,
    whisper_tokenizer,
)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("hf_whisper")]


def tone(seconds: float, hertz: float) -> np.ndarray:
    t = np.arange(int(16000 * seconds)) / 16000
    return (0.5 * np.sin(2 * np.pi * hertz * t)).astype(np.float32)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from transformers import AutoProcessor, WhisperFeatureExtractor, WhisperProcessor

    root = tmp_path_factory.mktemp("hf_whisper")
    torch.manual_seed(0)
    model = whisper()
    processor = WhisperProcessor(WhisperFeatureExtractor(), whisper_tokenizer(root / "hf"))
    model.save_pretrained(root / "hf")
    processor.save_pretrained(root / "hf")
    with recording_binds() as bound:
        coreai = CoreAIModelForSpeechSeq2Seq.from_pretrained(root / "hf", export=True)
    coreai.save_pretrained(root / "coreai")
    coreai.close()
    processor = AutoProcessor.from_pretrained(root / "coreai", local_files_only=True)
    return {
        "bound": bound,
        "model": model,
        "coreai": CoreAIModelForSpeechSeq2Seq.from_pretrained(root / "coreai"),
        "processor": processor,
        "features": torch.randn(3, 80, 3000),
        "root": root,
    }


def test_export_of_a_directory_streams_the_checkpoint(exported: dict[str, Any]) -> None:
    """Whisper's checkpoint holds the output projection only as the tied token embeddings."""
    assert_streamed(exported["bound"])


def test_greedy_generate_matches_transformers(exported: dict[str, Any]) -> None:
    """16 new tokens for two inputs, each step's logits within 1e-4; the decoder
    prompt of a language and task."""
    features = exported["features"]
    for row in (0, 2):
        inputs = {"input_features": features[row : row + 1]}
        check_generate(exported["coreai"], exported["model"], inputs)
    sequences = check_generate(
        exported["coreai"],
        exported["model"],
        {"input_features": features[1:2]},
        language="fr",
        task="translate",
    )
    assert sequences[0, :4].tolist() == [257, 259, 260, 265]  # <|sot|><|fr|><|translate|>...


def test_batch_beam_search_and_sampling_match_transformers(exported: dict[str, Any]) -> None:
    coreai, model, features = exported["coreai"], exported["model"], exported["features"]
    for args in (
        dict(max_new_tokens=16, min_new_tokens=16),  # a batch of three
        dict(max_new_tokens=12, num_beams=3),
    ):
        assert (
            coreai.generate(features, **args).tolist() == model.generate(features, **args).tolist()
        )
    args = dict(max_new_tokens=16, do_sample=True, top_k=50, temperature=0.7)
    torch.manual_seed(3)
    expected = model.generate(features[:1], **args)
    torch.manual_seed(3)
    assert coreai.generate(features[:1], **args).tolist() == expected.tolist()


def test_forward_returns_the_decoder_logits(exported: dict[str, Any]) -> None:
    features = exported["features"][:2]
    ids = torch.tensor([[257, 258, 261, 265, 40, 41, 42], [257, 259, 260, 265, 50, 51, 52]])
    with torch.no_grad():
        expected = exported["model"](input_features=features, decoder_input_ids=ids)
    out = exported["coreai"](input_features=features, decoder_input_ids=ids)
    tol = TOLERANCE * max(1.0, float(expected.logits.abs().max()))
    assert float((out.logits - expected.logits).abs().max()) <= tol
    hidden = expected.encoder_last_hidden_state
    assert float((out.encoder_last_hidden_state - hidden).abs().max()) <= TOLERANCE * max(
        1.0, float(hidden.abs().max())
    )


def test_pipeline_and_saved_directory(exported: dict[str, Any]) -> None:
    from transformers import pipeline

    names = {p.name for p in (exported["root"] / "coreai").iterdir()}
    assert {
        "model.aimodel",
        "config.json",
        "generation_config.json",
        "preprocessor_config.json",
        "vocab.json",
        "coreai_config.json",
    } <= names
    assert not [n for n in names if n.endswith((".safetensors", ".bin"))]
    meta = json.loads((exported["root"] / "coreai" / "coreai_config.json").read_text())
    assert meta["task"] == "automatic-speech-recognition" and meta["max_context"] == 64
    processor = exported["processor"]
    results = []
    for model in (exported["coreai"], exported["model"]):
        asr = pipeline(
            "automatic-speech-recognition",
            model=model,
            tokenizer=processor.tokenizer,
            feature_extractor=processor.feature_extractor,
        )
        # the pipeline's default: beam search with 5 beams
        results.append(asr(tone(3.0, 330), generate_kwargs={"max_new_tokens": 10}))
    assert results[0] == results[1]


def test_bad_input_raises_before_running(exported: dict[str, Any]) -> None:
    coreai = exported["coreai"]
    with pytest.raises(ValueError, match=r"\[batch, 80, 3000\]"):
        coreai(input_features=torch.randn(1, 80, 100), decoder_input_ids=torch.tensor([[257]]))
    with pytest.raises(ValueError, match=r"\[batch, 80, frames\]"):
        coreai.generate(torch.randn(1, 40, 3000))
    with pytest.raises(ValueError, match="max_context=64"):
        coreai.generate(exported["features"][:1], max_length=70)
    with pytest.raises(NotImplementedError, match="attentions"):
        coreai.generate(exported["features"][:1], return_token_timestamps=True)


def test_fp16_int4(tmp_path: Path) -> None:
    """fp16 + int4 weights: generation runs, the options are recorded, the round trip gives the
    same tokens."""
    torch.manual_seed(0)
    model = whisper()
    coreai = CoreAIModelForSpeechSeq2Seq.from_pretrained(
        model, export=True, precision="fp16", compress="int4", max_context=32
    )
    assert coreai.coreai_config["precision"] == "fp16" and coreai.max_context == 32
    features = torch.randn(1, 80, 3000)
    tokens = coreai.generate(features, max_new_tokens=12)
    coreai.save_pretrained(tmp_path)
    again = CoreAIModelForSpeechSeq2Seq.from_pretrained(tmp_path)
    assert again.generate(features, max_new_tokens=12).tolist() == tokens.tolist()
