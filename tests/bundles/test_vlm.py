"""Vision-language bundles (kind ``vlm``): what ``CoreAIModelForImageTextToText.save_pretrained``
writes (manifest, ``vision`` block, three assets, tokenizer), ``coreai doctor`` on it, the
reference VLM driver against ``transformers`` greedy generation, loading the bundle back, and
bad input at export and at load.

One float32 export of a small random-weight LLaVA (CLIP tower, Llama decoder) is shared by the
module (about 20 s); float16, another decoder family and the CLI are slow.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from coreai_torch.bundles import (
    Bundle,
    BundleError,
    Manifest,
    VisionConfig,
    VisionLanguageEngine,
    open_engine,
    preprocess_image,
    write_vlm_bundle,
)
from coreai_torch.hf import CoreAIModelForCausalLM, CoreAIModelForImageTextToText
from coreai_torch.hf.image_text_to_text import vision_block
from tests.bundles.support import assert_doctor_clean
from tests.hf.support import TOLERANCE, llava, llava_processor
from tests.llm.support import HALF_LOGITS

pytestmark = pytest.mark.xdist_group("vlm_bundle")

NEW_TOKENS = 12
#: float32 compute: the embeddings and image features cross the assets as float16 (the app's
#: contract) and the logits are float16 -- their rounding, relative to the largest logit
FP32_TOLERANCE = TOLERANCE + 2 * HALF_LOGITS
#: float16 compute (measured: at most 1.2e-3 relative on these models, as in float32)
FP16_TOLERANCE = 5e-3


def picture(height: int, width: int, seed: int) -> Any:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def export(root: Path, decoder: str = "llama", **options: Any) -> dict[str, Any]:
    """A LLaVA with ``decoder`` saved to ``root/hf``, exported, saved as a bundle to
    ``root/bundle``."""
    processor = llava_processor(root / "hf")
    model = llava(processor.tokenizer.convert_tokens_to_ids("<image>"), decoder)
    model.save_pretrained(root / "hf")
    exported = CoreAIModelForImageTextToText.from_pretrained(
        root / "hf", export=True, max_context=64, **options
    )
    exported.save_pretrained(root / "bundle")
    exported.close()
    return {"model": model, "processor": processor, "bundle": root / "bundle", "root": root}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return export(tmp_path_factory.mktemp("vlm_llama"))


def prompt(case: dict[str, Any], text: str, image: Any) -> dict[str, torch.Tensor]:
    return dict(case["processor"](images=image, text=text, return_tensors="pt"))


def reference(case: dict[str, Any], inputs: dict[str, torch.Tensor]) -> tuple[list[int], Any]:
    """``transformers``' greedy tokens (no stop) and each step's logits."""
    with torch.no_grad():
        out = case["model"].generate(
            **inputs,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    prompt_length = inputs["input_ids"].shape[1]
    return out.sequences[0, prompt_length:].tolist(), [s[0] for s in out.logits]


def assert_same_greedy(
    ours: list[int], logits: list[np.ndarray], theirs: list[int], expected: list[Any], tol: float
) -> None:
    """Token for token, each step's logits within ``tol`` (relative to the largest); a token
    may differ only where the reference's two candidates are closer than the tolerance, and
    the comparison ends there."""
    assert len(ours) == len(theirs) == NEW_TOKENS
    for step, (a, e) in enumerate(zip(logits, expected, strict=True)):
        e = e.float().numpy()
        bound = tol * max(1.0, float(np.abs(e).max()))
        err = float(np.abs(a.astype(np.float32) - e).max())
        assert err <= bound, f"step {step}: max|err| {err:.3e} > {bound:.3e}"
        if ours[step] != theirs[step]:
            margin = abs(float(e[theirs[step]] - e[ours[step]]))
            assert margin <= 2 * bound, f"step {step}: {ours[step]} != {theirs[step]}"
            return
    assert ours == theirs


def drive(bundle: Path, inputs: dict[str, torch.Tensor], **image: Any) -> tuple[list[int], Any]:
    logits: list[np.ndarray] = []
    with VisionLanguageEngine(bundle, stop_token_ids=()) as engine:
        if not image:
            image = {"pixel_values": inputs["pixel_values"].numpy()}
        tokens = engine.generate(
            inputs["input_ids"][0].tolist(), NEW_TOKENS, on_logits=logits.append, **image
        )
    return tokens, logits


# ------------------------------------------------------------------------------- layout ---


def test_bundle_layout_manifest_and_doctor(llama: dict[str, Any]) -> None:
    bundle_dir = llama["bundle"]
    bundle = Bundle.load(bundle_dir)
    assert bundle.kind == "vlm" and bundle.structure == "dynamic"
    manifest = json.loads((bundle_dir / "metadata.json").read_text())
    assert manifest["assets"] == {
        "main": "bundle.aimodel",
        "embedding": "embedding.aimodel",
        "vision": "vision.aimodel",
    }
    config = llama["model"].config
    assert manifest["language"]["vocab_size"] == config.text_config.vocab_size
    assert manifest["language"]["max_context_length"] == 64
    # from the config (sizes, image token) and the CLIP image processor (the rest)
    assert manifest["vision"] == {
        "image_size": 32,
        "patch_size": 8,
        "image_token_count": 16,
        "image_token_id": config.image_token_id,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "rescale_factor": 1.0,
        "image_strategy": "center_crop",
    }
    main = bundle.required_signatures("main")["main"]
    assert [(t.name, t.dtype, t.shape) for t in main.inputs] == [
        ("inputs_embeds", "float16", (1, None, 64)),
        ("position_ids", "int32", (1, None)),
    ]
    assert [s.name for s in main.states] == ["keyCache", "valueCache"]
    assert main.outputs[0].dtype == "float16"
    vision = bundle.required_signatures("vision")["main"]
    assert (vision.inputs[0].dtype, vision.inputs[0].shape) == ("float32", (1, 3, 32, 32))
    assert (vision.outputs[0].dtype, vision.outputs[0].shape) == ("float16", (1, 16, 64))
    embedding = bundle.required_signatures("embedding")["main"]
    assert (embedding.inputs[0].dtype, embedding.outputs[0].dtype) == ("int32", "float16")
    for role in ("main", "embedding", "vision"):
        assert bundle.asset_metadata(role).producer
    assert (bundle_dir / "tokenizer" / "preprocessor_config.json").is_file()
    assert_doctor_clean(bundle_dir)


def test_decoder_holds_no_embedding_table_of_its_own(llama: dict[str, Any]) -> None:
    """Each asset stores its own weights once: the decoder takes embeddings (no table but
    the output head), the embedding asset the table, the vision asset the tower."""

    def size(role: str) -> int:
        path = Bundle.load(llama["bundle"]).asset_path(role)
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())

    model = llama["model"]
    table = model.get_input_embeddings().weight.numel() * 4
    text = sum(p.numel() for p in model.model.language_model.parameters()) * 4
    head = model.lm_head.weight.numel() * 4
    image = sum(p.numel() for p in model.model.vision_tower.parameters()) * 4
    image += sum(p.numel() for p in model.model.multi_modal_projector.parameters()) * 4
    assert table <= size("embedding") < table + 50_000
    assert text - table + head - 50_000 < size("main") < text - table + head + 50_000
    assert size("vision") < image + 50_000  # the tower's unused last layer is left out


# ------------------------------------------------------------------- the reference driver ---


def test_driver_matches_transformers_greedy_fp32(llama: dict[str, Any]) -> None:
    for text, image in (
        ("user: <image> the quick brown fox", picture(40, 48, 0)),
        ("<image> a", picture(32, 32, 1)),
    ):
        inputs = prompt(llama, text, image)
        theirs, expected = reference(llama, inputs)
        ours, logits = drive(llama["bundle"], inputs)
        assert_same_greedy(ours, logits, theirs, expected, tol=FP32_TOLERANCE)


@pytest.mark.parametrize("fresh_memory", ["noise", "nan"])
def test_kv_states_grow_into_uninitialised_memory(
    llama: dict[str, Any], monkeypatch: pytest.MonkeyPatch, fresh_memory: str
) -> None:
    """States starting at 8 rows (instead of 256) grow 8 -> 16 -> 32 -> 64 by the Swift copy
    rule into memory holding noise or NaN: the rows past the positions are never read."""
    from coreai_torch.bundles import driver

    monkeypatch.setattr(driver, "INITIAL_KV_CAPACITY", 8)
    inputs = prompt(llama, "user: <image> the quick brown fox", picture(40, 48, 10))
    theirs, expected = reference(llama, inputs)
    logits: list[np.ndarray] = []
    with VisionLanguageEngine(
        llama["bundle"], stop_token_ids=(), fresh_memory=fresh_memory
    ) as engine:
        assert engine.capacity == 8
        ours = engine.generate(
            inputs["input_ids"][0].tolist(),
            NEW_TOKENS,
            pixel_values=inputs["pixel_values"].numpy(),
            on_logits=logits.append,
        )
        assert engine.capacity == 64
    assert_same_greedy(ours, logits, theirs, expected, tol=FP32_TOLERANCE)


def test_driver_builds_the_apps_prompt(llama: dict[str, Any]) -> None:
    """The app's prompt (the chat template on ``"<image>\\n<text>"``, the image token expanded)
    is the processor's for the same text: generation from it, with the image preprocessed per
    the vision block, matches ``transformers``."""
    image = picture(40, 48, 9)
    with VisionLanguageEngine(llama["bundle"], stop_token_ids=()) as engine:
        ids = engine.prompt_tokens("the quick")
        logits: list[np.ndarray] = []
        ours = engine.generate(ids, NEW_TOKENS, image=image, on_logits=logits.append)
    message = [{"role": "user", "content": "<image>\nthe quick"}]
    text = llama["processor"].apply_chat_template(
        message, add_generation_prompt=True, tokenize=False
    )
    inputs = prompt(llama, text, image)
    assert inputs["input_ids"][0].tolist() == ids
    theirs, expected = reference(llama, inputs)
    assert_same_greedy(ours, logits, theirs, expected, tol=FP32_TOLERANCE)


def test_driver_preprocesses_like_the_image_processor(llama: dict[str, Any]) -> None:
    vision = Bundle.load(llama["bundle"]).vision
    assert vision is not None
    processor = llama["processor"].image_processor
    for image in (picture(32, 32, 2), picture(40, 48, 3), picture(36, 54, 4)):
        ours = preprocess_image(image, vision)
        theirs = processor(image, return_tensors="np")["pixel_values"]
        assert ours.shape == theirs.shape == (1, 3, 32, 32)
        assert float(np.abs(ours - theirs).max()) < 1e-5
    # the app rounds the scaled edge (64 * 32 / 36 = 56.9 -> 57 rows), Hugging Face truncates
    # it (56): the same picture, resampled one row apart
    tall = picture(64, 36, 4)
    ours, theirs = preprocess_image(tall, vision), processor(tall, return_tensors="np")
    assert float(np.abs(ours - theirs["pixel_values"]).mean()) < 1.0
    inputs = prompt(llama, "user: <image> the", picture(40, 48, 3))
    from_image, _ = drive(llama["bundle"], inputs, image=picture(40, 48, 3))
    from_pixels, _ = drive(llama["bundle"], inputs)
    assert from_image == from_pixels


def test_stretch_and_pad_strategies() -> None:
    from PIL import Image

    base = VisionConfig(
        image_size=8, patch_size=4, image_token_count=4, image_token_id=1, rescale_factor=1.0
    )
    base = VisionConfig(**{**base.__dict__, "image_mean": (0.5,) * 3, "image_std": (0.25,) * 3})
    wide = picture(4, 16, 5)
    stretched = preprocess_image(
        wide, VisionConfig(**{**base.__dict__, "image_strategy": "stretch"})
    )
    resized = np.asarray(wide.resize((8, 8), Image.Resampling.BICUBIC), np.float32) / 255
    assert np.allclose(stretched[0], ((resized - 0.5) / 0.25).transpose(2, 0, 1), atol=1e-6)
    padded = preprocess_image(wide, VisionConfig(**{**base.__dict__, "image_strategy": "pad"}))
    # the 16x4 image becomes 8x2, centred: rows 0-2 and 5-7 are black, (0 - 0.5) / 0.25
    assert np.allclose(padded[0, :, :3], -2.0) and np.allclose(padded[0, :, 5:], -2.0)
    assert not np.allclose(padded[0, :, 3:5], -2.0)


def test_text_only_prompt_is_prefilled_in_chunks(llama: dict[str, Any]) -> None:
    """Without an image the engine prefills as the sequential engine: chunks of
    ``prefill_chunk_size`` past the threshold, each token embedded by the embedding asset."""
    ids = llama["processor"].tokenizer("the quick brown fox jumps over the lazy dog")["input_ids"]
    logits: list[np.ndarray] = []
    with VisionLanguageEngine(llama["bundle"], chunk_threshold=4, stop_token_ids=()) as engine:
        engine.prefill_chunk_size = 3
        ours = engine.generate(ids, NEW_TOKENS, on_logits=logits.append)
        chunks = -(-len(ids) // 3)
        sizes = [n for _, n, _ in engine.calls]
        assert sizes[:chunks] == [3] * (chunks - 1) + [len(ids) - 3 * (chunks - 1)]
        assert sizes[chunks:] == [1] * (NEW_TOKENS - 1)
    inputs = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids))}
    theirs, expected = reference(llama, inputs)
    assert_same_greedy(ours, logits, theirs, expected, tol=FP32_TOLERANCE)


def test_driver_refuses_a_prompt_without_the_placeholders(llama: dict[str, Any]) -> None:
    with (
        VisionLanguageEngine(llama["bundle"]) as engine,
        pytest.raises(BundleError, match=r"holds 1 image placeholder tokens .* 16 features"),
    ):
        engine.generate([5, llama["model"].config.image_token_id, 6], 2, image=picture(8, 8, 0))
    with pytest.raises(BundleError, match="VisionLanguageEngine"):
        open_engine(llama["bundle"], "sequential")
    from coreai_torch.llm import Generator

    with pytest.raises(ValueError, match="vision-language bundle"):
        Generator(llama["bundle"])


# ------------------------------------------------------------------------------- loading ---


def test_from_pretrained_runs_the_bundle(llama: dict[str, Any]) -> None:
    from tests.hf.support import check_generate

    model = CoreAIModelForImageTextToText.from_pretrained(llama["bundle"])
    assert model.coreai_config["vision"]["image_token_count"] == 16
    inputs = prompt(llama, "user: <image> the quick", picture(36, 32, 6))
    check_generate(model, llama["model"], inputs, logits_rounding=2 * HALF_LOGITS)
    with pytest.raises(ValueError, match="load it with CoreAIModelForImageTextToText"):
        CoreAIModelForCausalLM.from_pretrained(llama["bundle"])


def test_the_earlier_format_names_the_export_command(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "coreai_config.json").write_text(
        json.dumps({"task": "image-text-to-text", "assets": {"model": "model.aimodel"}})
    )
    with pytest.raises(ValueError, match="coreai-torch export --task image-text-to-text"):
        CoreAIModelForImageTextToText.from_pretrained(tmp_path)


# ----------------------------------------------------------------------------- bad input ---


def copy_bundle(llama: dict[str, Any], target: Path, edit: Any = None) -> Path:
    shutil.copytree(llama["bundle"], target)
    if edit is not None:
        manifest = json.loads((target / "metadata.json").read_text())
        edit(manifest)
        (target / "metadata.json").write_text(json.dumps(manifest))
    return target


def test_bad_bundles_are_refused_at_load(llama: dict[str, Any], tmp_path: Path) -> None:
    missing_asset = copy_bundle(llama, tmp_path / "a")
    shutil.rmtree(missing_asset / "vision.aimodel")
    with pytest.raises(BundleError, match="asset 'vision' not found"):
        Bundle.load(missing_asset)
    unnamed = copy_bundle(llama, tmp_path / "b", lambda m: m["assets"].pop("vision"))
    with pytest.raises(BundleError, match=r"assets\.vision is missing"):
        CoreAIModelForImageTextToText.from_pretrained(unnamed)
    for key in ("image_size", "patch_size", "image_token_count", "image_token_id"):
        no_key = copy_bundle(llama, tmp_path / key, lambda m, k=key: m["vision"].pop(k))
        with pytest.raises(BundleError, match=f"vision.{key} is missing"):
            Bundle.load(no_key)
    out_of_vocab = copy_bundle(
        llama, tmp_path / "c", lambda m: m["vision"].update(image_token_id=4096)
    )
    with pytest.raises(BundleError, match="image_token_id = 4096 is not a token id"):
        Bundle.load(out_of_vocab)
    # in the vocabulary, but not a token of the tokenizer (its 128 ids hold no 200)
    vocab = json.loads((llama["bundle"] / "metadata.json").read_text())["language"]["vocab_size"]
    unknown = vocab - 1
    no_token = copy_bundle(
        llama, tmp_path / "d", lambda m: m["vision"].update(image_token_id=unknown)
    )
    with pytest.raises(BundleError, match=f"image_token_id = {unknown} is not a token of"):
        Bundle.load(no_token)
    list_only = copy_bundle(llama, tmp_path / "f")
    template = list_only / "tokenizer" / "chat_template.jinja"
    template.write_text(template.read_text().replace("m['content'] is string", "false"))
    with pytest.raises(BundleError, match="does not render the image token '<image>'"):
        Bundle.load(list_only)
    no_block = copy_bundle(llama, tmp_path / "e", lambda m: m.pop("vision"))
    with pytest.raises(BundleError, match="vision is missing"):
        Bundle.load(no_block)


def test_bad_bundles_are_refused_at_export(llama: dict[str, Any], tmp_path: Path) -> None:
    bundle = Bundle.load(llama["bundle"])
    assets = {role: bundle.asset_path(role) for role in ("main", "embedding", "vision")}
    vision = bundle.manifest.vision_config()
    options = {"config": llama["model"].config, "tokenizer": llama["bundle"] / "tokenizer"}
    with pytest.raises(BundleError, match=r"\['vision'\] not given"):
        without = {k: v for k, v in assets.items() if k != "vision"}
        write_vlm_bundle(tmp_path / "a", without, vision, **options)
    wrong = VisionConfig(**{**vision.__dict__, "image_token_id": 10_000})
    with pytest.raises(BundleError, match="image_token_id = 10000 is not a token id"):
        write_vlm_bundle(tmp_path / "b", assets, wrong, **options)
    fewer = VisionConfig(**{**vision.__dict__, "image_token_count": 9})
    with pytest.raises(BundleError, match=r"16 image tokens but vision\.image_token_count is 9"):
        write_vlm_bundle(tmp_path / "c", assets, fewer, **options)
    unknown = llama["model"].config.text_config.vocab_size - 1
    not_a_token = VisionConfig(**{**vision.__dict__, "image_token_id": unknown})
    with pytest.raises(BundleError, match="is not a token of"):
        write_vlm_bundle(tmp_path / "d", assets, not_a_token, **options)
    list_only = "{% for m in messages %}{% for c in m['content'] %}{{ c['text'] }}{% endfor %}"
    list_only += "</s>{% endfor %}"
    with pytest.raises(BundleError, match="would otherwise ignore the image"):
        write_vlm_bundle(tmp_path / "e", assets, vision, **options, chat_template=list_only)
    assert not [p for p in tmp_path.iterdir() if p.name in "abcde"]


def test_vision_block_is_derived_from_the_processor(llama: dict[str, Any]) -> None:
    config = llama["model"].config
    settings = llama["processor"].image_processor.to_dict()
    assert vision_block(config, 16, None).to_json() == {
        "image_size": 32,
        "patch_size": 8,
        "image_token_count": 16,
        "image_token_id": config.image_token_id,
    }
    plain = {**settings, "do_center_crop": False, "size": {"height": 32, "width": 32}}
    plain.update(do_normalize=False, do_rescale=False)
    block = vision_block(config, 16, plain)
    assert (block.image_strategy, block.rescale_factor) == ("stretch", 255.0)
    assert (block.image_mean, block.image_std) == ((0.0,) * 3, (1.0,) * 3)
    assert vision_block(config, 16, {**settings, "do_pad": True}).image_strategy == "pad"
    with pytest.raises(BundleError, match="makes 48x48 images but the vision tower takes 32x32"):
        vision_block(config, 16, {**settings, "crop_size": {"height": 48, "width": 48}})
    with pytest.raises(BundleError, match="image_std must not hold 0"):
        Manifest.from_json(
            {
                **json.loads((llama["bundle"] / "metadata.json").read_text()),
                "vision": {**vision_block(config, 16, settings).to_json(), "image_std": [1, 0, 1]},
            }
        )


# ----------------------------------------------------------------------------------- slow ---


@pytest.mark.slow
def test_fp16_bundle_within_tolerance(llama: dict[str, Any], tmp_path: Path) -> None:
    exported = CoreAIModelForImageTextToText.from_pretrained(
        llama["model"], export=True, max_context=64, precision="fp16", processor=llama["processor"]
    )
    exported.save_pretrained(tmp_path / "fp16", tokenizer=llama["root"] / "hf")
    exported.close()
    assert_doctor_clean(tmp_path / "fp16")
    inputs = prompt(llama, "user: <image> the quick brown fox", picture(40, 48, 7))
    theirs, expected = reference(llama, inputs)
    ours, logits = drive(tmp_path / "fp16", inputs)
    assert_same_greedy(ours, logits, theirs, expected, tol=FP16_TOLERANCE)


@pytest.mark.slow
def test_qwen2_decoder_bundle(tmp_path: Path) -> None:
    case = export(tmp_path, "qwen2")
    assert_doctor_clean(case["bundle"])
    inputs = prompt(case, "user: <image> over the lazy dog", picture(48, 40, 8))
    theirs, expected = reference(case, inputs)
    ours, logits = drive(case["bundle"], inputs)
    assert_same_greedy(ours, logits, theirs, expected, tol=FP32_TOLERANCE)


@pytest.mark.slow
def test_cli_export_writes_a_vlm_bundle(llama: dict[str, Any], tmp_path: Path) -> None:
    from coreai_torch.cli import main

    out = tmp_path / "cli"
    task = ["export", "--task", "image-text-to-text", str(llama["root"] / "hf")]
    assert main([*task, "-o", str(out), "--max-context", "48"]) == 0
    assert Bundle.load(out).kind == "vlm"
    assert_doctor_clean(out)
