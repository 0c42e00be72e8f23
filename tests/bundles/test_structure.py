"""Reading an asset's functions without its weights (``ir.assets.structure_summary``), the
language block derived from a Hugging Face config, and the VLM engine's rules."""

from __future__ import annotations

import json
import tracemalloc
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import coreai_torch
from coreai_torch import TorchConverter
from coreai_torch._mlir import ca
from coreai_torch.bundles import (
    CallingConventionError,
    FunctionSignature,
    LanguageConfig,
    TensorSpec,
    VisionConfig,
    eos_token_ids,
    function_signatures,
    language_config_from_hf,
)
from coreai_torch.bundles.convention import check_vlm_assets
from coreai_torch.errors import InvalidAssetError
from coreai_torch.ir.assets import structure_summary, weightless_bytecode


def test_the_structure_is_read_without_the_weights(tmp_path: Path) -> None:
    module = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 8))
    ep = torch.export.export(module, (torch.zeros(2, 1024),)).run_decompositions(
        coreai_torch.get_decomp_table()
    )
    path = tmp_path / "m.aimodel"
    TorchConverter().add_exported_program(ep, input_names=["x"]).to_coreai().save_asset(path)
    bytecode = path / "main.mlirb"
    assert bytecode.stat().st_size > 4_000_000
    assert len(weightless_bytecode(bytecode)) < 8_000  # the weights' 4 MB are not in it
    tracemalloc.start()
    summary = structure_summary(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1_000_000
    full = ca.AIModelAsset.load(path).summary(include_statistics=False)
    assert summary.function_names == full.function_names == ["main"]
    assert summary.function_inputs("main") == full.function_inputs("main")
    assert summary.function_outputs("main") == full.function_outputs("main")
    assert function_signatures(path)["main"].inputs == (TensorSpec("x", "float32", (2, 1024)),)
    data = bytecode.read_bytes()
    bytecode.write_bytes(data[: len(data) // 2])  # truncated in the weights
    with pytest.raises(InvalidAssetError, match="truncated"):
        structure_summary(path)


def test_the_language_block_from_a_hugging_face_config() -> None:
    from transformers import Gemma3Config, LlamaConfig

    llama = LlamaConfig(vocab_size=320, max_position_embeddings=4096, eos_token_id=[2, 7])
    llama._name_or_path = "meta-llama/Llama-3.2-1B-Instruct"
    language = language_config_from_hf(llama)
    assert language == LanguageConfig(
        tokenizer="meta-llama/Llama-3.2-1B-Instruct", vocab_size=320, max_context_length=4096
    )
    assert language_config_from_hf(llama, max_context_length=1024).max_context_length == 1024
    assert eos_token_ids(llama) == [2, 7]
    gemma = Gemma3Config(text_config={"vocab_size": 512, "max_position_embeddings": 2048})
    assert language_config_from_hf(gemma).vocab_size == 512  # the text config's
    as_dict = language_config_from_hf(
        {"vocab_size": 64, "max_position_embeddings": 128}, tokenizer_id="x/y"
    )
    assert (as_dict.tokenizer, as_dict.vocab_size) == ("x/y", 64)


def test_eos_ids_of_config_and_generation_config(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 106]}))
    assert eos_token_ids(None, tmp_path) == [1, 106]
    from types import SimpleNamespace

    assert eos_token_ids(SimpleNamespace(eos_token_id=5), tmp_path) == [5, 1, 106]


# ----------------------------------------------------------------------------- VLM ---

VISION = VisionConfig(image_size=224, patch_size=14, image_token_count=64, image_token_id=90)
LANGUAGE = LanguageConfig("t", vocab_size=96, max_context_length=512)
DECODER = FunctionSignature(
    "main",
    (
        TensorSpec("inputs_embeds", "float16", (1, None, 32)),
        TensorSpec("position_ids", "int32", (1, None)),
    ),
    (TensorSpec("logits", "bfloat16", (1, None, 96)),),
    (
        TensorSpec("k_cache", "float16", (2, 1, 2, None, 8)),
        TensorSpec("v_cache", "float16", (2, 1, 2, None, 8)),
    ),
)
VISION_ASSET = {
    "main": FunctionSignature(
        "main",
        (TensorSpec("pixel_values", "float32", (1, 3, 224, 224)),),
        (TensorSpec("image_features", "float16", (1, 64, 32)),),
        (),
    )
}
EMBED = {
    "main": FunctionSignature(
        "main",
        (TensorSpec("input_ids", "int32", (1, None)),),
        (TensorSpec("embeddings", "float16", (1, None, 32)),),
        (),
    )
}
WHERE = {"main": "m", "vision": "v", "embedding": "e"}


def test_vlm_assets() -> None:
    check_vlm_assets({"main": DECODER}, VISION_ASSET, EMBED, LANGUAGE, VISION, where=WHERE)
    three = replace(DECODER, states=(*DECODER.states, TensorSpec("x", "float16", (4,))))
    with pytest.raises(CallingConventionError, match="the engines take exactly 2"):
        check_vlm_assets({"main": three}, VISION_ASSET, EMBED, LANGUAGE, VISION, where=WHERE)
    small = {
        "main": replace(
            VISION_ASSET["main"], inputs=(TensorSpec("p", "float32", (1, 3, 112, 112)),)
        )
    }
    with pytest.raises(CallingConventionError, match=r"float32 pixels \[1, 3, 224, 224\]"):
        check_vlm_assets({"main": DECODER}, small, EMBED, LANGUAGE, VISION, where=WHERE)
    with pytest.raises(CallingConventionError, match="runs 'embed_tokens' or 'main'"):
        check_vlm_assets(
            {"main": DECODER}, VISION_ASSET, {"embed": EMBED["main"]}, LANGUAGE, VISION, where=WHERE
        )
