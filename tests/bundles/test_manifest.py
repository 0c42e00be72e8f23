"""``metadata.json``: parsed and written with the Swift decoders' rules (``ModelBundle``,
``LanguageBundle``, ``LanguageConfig``, ``VisionConfig``, ``PipelineDescriptor``)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from coreai_torch.bundles import (
    BundleError,
    DiffusionConfig,
    LanguageConfig,
    Manifest,
    SchedulerDefaults,
    VisionConfig,
)

#: what Apple's exporter writes for an LLM (P/export/bundle.py), compression "none" -> null
APPLE_LLM: dict[str, Any] = {
    "metadata_version": "0.2",
    "kind": "llm",
    "name": "Qwen3-0.6B",
    "assets": {"main": "Qwen3-0.6B.aimodel"},
    "language": {
        "tokenizer": "Qwen/Qwen3-0.6B",
        "vocab_size": 151936,
        "max_context_length": 40960,
        "embedded_tokenizer": True,
        "function_map": {"main": ["main"]},
    },
    "source": {"model_definition": "torch", "hf_model_id": "Qwen/Qwen3-0.6B"},
    "compression": None,
    "compilation": {"date": "2026-08-21T10:00:00+00:00", "targets": []},
}

#: Apple's VLM text bundle after the vision export patched it (P/vlm/export.py)
APPLE_VLM: dict[str, Any] = {
    "metadata_version": "0.2",
    "kind": "vlm",
    "name": "Qwen3-VL-2B",
    "assets": {
        "main": "Qwen3-VL-2B.aimodel",
        "embedding": "embed.aimodel",
        "vision": "vision.aimodel",
    },
    "language": {
        "tokenizer": "Qwen/Qwen3-VL-2B-Instruct",
        "vocab_size": 151936,
        "max_context_length": 4096,
        "embedded_tokenizer": True,
        "function_map": {"main": ["main"]},
    },
    "vision": {
        "image_size": 448,
        "patch_size": 16,
        "image_token_count": 196,
        "image_token_id": 151655,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "rescale_factor": 0.00392156862745098,
        "image_strategy": "center_crop",
        "include_image_info": False,
        "max_video_frames": 8,
        "tokens_per_frame": 196,
        "temporal_patch_size": 2,
    },
    "source": {"hf_model_id": "Qwen/Qwen3-VL-2B-Instruct", "model_definition": "torch"},
}

#: Apple's diffusion exporter (P/diffusion/pipeline.py, SD 1.5)
APPLE_DIFFUSION: dict[str, Any] = {
    "metadata_version": "0.2",
    "kind": "diffusion",
    "name": "stable-diffusion-v1-5",
    "assets": {
        "text_encoder": "TextEncoder.aimodel",
        "unet": "Unet.aimodel",
        "vae_decoder": "VAEDecoder.aimodel",
        "vae_encoder": "VAEEncoder.aimodel",
    },
    "diffusion": {
        "type": "stable-diffusion",
        "prediction_type": "epsilon",
        "encoder_scale_factor": 0.18215,
        "decoder_scale_factor": 0.18215,
        "decoder_shift_factor": 0.0,
        "image_size": 512,
        "default_guidance_scale": 7.5,
        "default_steps": 50,
        "scheduler": {
            "training_steps": 1000,
            "beta_start": 0.00085,
            "beta_end": 0.012,
            "beta_schedule": "scaled_linear",
        },
    },
    "source": {"model_definition": "torch", "hf_model_id": "runwayml/stable-diffusion-v1-5"},
    "compression": None,
    "compilation": {"date": "2026-08-21T10:00:00+00:00", "targets": []},
}


@pytest.mark.parametrize(
    "data", [APPLE_LLM, APPLE_VLM, APPLE_DIFFUSION], ids=["llm", "vlm", "diffusion"]
)
def test_apple_exporter_manifests_parse_and_round_trip(data: dict[str, Any]) -> None:
    manifest = Manifest.from_json(copy.deepcopy(data))
    assert manifest.kind == data["kind"] and manifest.assets == data["assets"]
    written = manifest.to_json()
    expected = {k: v for k, v in data.items() if v is not None}  # null optional: absent
    assert written == expected
    assert Manifest.from_json(json.loads(manifest.dumps())) == manifest


def test_typed_blocks_read_the_swift_fields() -> None:
    llm = Manifest.from_json(APPLE_LLM)
    assert llm.language == LanguageConfig(
        tokenizer="Qwen/Qwen3-0.6B", vocab_size=151936, max_context_length=40960
    )
    assert llm.language.main_function == "main"
    vlm = Manifest.from_json(APPLE_VLM)
    assert vlm.vision.image_token_id == 151655 and vlm.vision.image_strategy == "center_crop"
    assert vlm.vision.extra == {"temporal_patch_size": 2}  # not read by Swift, kept
    diffusion = Manifest.from_json(APPLE_DIFFUSION).diffusion
    assert diffusion.scheduler == SchedulerDefaults()
    assert diffusion.type == "stable-diffusion" and diffusion.image_size == 512


def test_function_map_names_the_function_the_engines_load() -> None:
    language = LanguageConfig("t", 10, 64, function_map={"main": ("decode_step", "other")})
    assert language.main_function == "decode_step"
    assert LanguageConfig("t", 10, 64, function_map=None).main_function == "main"
    assert "function_map" not in LanguageConfig("t", 10, 64, function_map=None).to_json()


def _with(data: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    data = copy.deepcopy(data)
    *parents, key = path.split(".")
    holder = data
    for parent in parents:
        holder = holder[parent]
    if value is _DELETE:
        del holder[key]
    else:
        holder[key] = value
    return data


_DELETE = object()


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("metadata_version", _DELETE, "metadata_version is absent (read as '0.1')"),
        ("metadata_version", "0.1", "metadata_version is '0.1'"),
        ("metadata_version", 0.2, "metadata_version must be a string"),
        ("kind", "chat", "kind must be one of"),
        ("name", _DELETE, "name is missing"),
        ("name", None, "name is null"),
        ("assets", _DELETE, "assets is missing"),
        ("assets.main", 3, "assets.main must be a string"),
        ("assets.main", _DELETE, "assets.main is missing"),
        ("assets.main", "../elsewhere.aimodel", "must be a path inside the bundle"),
        ("user_data", {"a": 1}, "user_data.a must be a string"),
        ("language", _DELETE, "language is missing"),
        ("language.tokenizer", _DELETE, "language.tokenizer is missing"),
        ("language.vocab_size", 151936.0, "write 151936, not 151936.0"),
        ("language.vocab_size", "151936", "language.vocab_size must be an integer"),
        ("language.vocab_size", True, "language.vocab_size must be an integer"),
        ("language.max_context_length", 0, "must be positive"),
        ("language.embedded_tokenizer", "yes", "language.embedded_tokenizer must be true or false"),
        (
            "language.function_map",
            {"main": "main"},
            "language.function_map.main must be a JSON array",
        ),
        ("language.states", {"keyCache": "growing"}, "language.states.keyCache must be one of"),
        ("language.prefill_chunk_size", 2048, "exceeds language.prefill_chunk_threshold"),
    ],
)
def test_llm_manifest_errors_name_the_key(path: str, value: Any, message: str) -> None:
    data = APPLE_LLM
    if path == "language.prefill_chunk_size":
        data = _with(data, "language.prefill_chunk_threshold", 1024)
    with pytest.raises(BundleError, match=r"metadata\.json") as error:
        Manifest.from_json(_with(data, path, value))
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("vision", _DELETE, "vision is missing"),
        ("assets.embedding", _DELETE, "assets.embedding is missing"),
        ("vision.image_token_id", 2**31, "out of range"),
        ("vision.image_mean", [0.5, "x", 0.5], "vision.image_mean[1] must be a finite number"),
        ("vision.image_strategy", "fill", "vision.image_strategy must be one of"),
    ],
)
def test_vlm_manifest_errors(path: str, value: Any, message: str) -> None:
    with pytest.raises(BundleError) as error:
        Manifest.from_json(_with(APPLE_VLM, path, value))
    assert message in str(error.value)


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("diffusion", _DELETE, "diffusion is missing"),
        ("diffusion.type", "sdxl", "diffusion.type must be one of"),
        ("diffusion.prediction_type", "sample", "diffusion.prediction_type must be one of"),
        (
            "diffusion.scheduler.beta_schedule",
            _DELETE,
            "diffusion.scheduler.beta_schedule is missing",
        ),
        ("diffusion.image_size", 512.0, "diffusion.image_size must be an integer"),
        ("assets.unet", None, "assets.unet must be a string"),
    ],
)
def test_diffusion_manifest_errors(path: str, value: Any, message: str) -> None:
    with pytest.raises(BundleError) as error:
        Manifest.from_json(_with(APPLE_DIFFUSION, path, value))
    assert message in str(error.value)


def test_manifest_built_in_code_is_validated_with_the_same_rules() -> None:
    with pytest.raises(BundleError, match=r"language\.vocab_size must be an integer"):
        Manifest("llm", "m", {"main": "m.aimodel"}, LanguageConfig("t", 10.0, 64)).validate()
    with pytest.raises(BundleError, match="language is missing"):
        Manifest("llm", "m", {"main": "m.aimodel"}).validate()
    with pytest.raises(BundleError, match="not plain JSON"):
        Manifest(
            "llm", "m", {"main": "m.aimodel"}, LanguageConfig("t", 10, 64), source={"x": {1, 2}}
        ).validate()
    vision = VisionConfig(image_size=448, patch_size=16, image_token_count=196, image_token_id=7)
    assert vision.to_json() == {
        "image_size": 448,
        "patch_size": 16,
        "image_token_count": 196,
        "image_token_id": 7,
    }
    assert DiffusionConfig().to_json() == {}


def test_unknown_keys_are_kept() -> None:
    data = _with(APPLE_LLM, "language.future_key", {"a": 1})
    data["top_level_extra"] = [1, 2]
    del data["compression"]  # null: written as absent
    assert Manifest.from_json(data).to_json() == data
