"""``CoreAIModelForImageTextToText`` (LLaVA with a CLIP vision tower and a Llama decoder):
``generate`` equals the Hugging Face model's token for token (one image, a left-padded batch
of two prompts with an image each), each step's logits within 1e-4 plus the rounding of the
float16 embeddings and logits the vision-language bundle's assets exchange,
``model(**inputs)``, the save / load round trip through the bundle, the
``image-text-to-text`` pipeline and bad input (the bundle itself: ``tests/bundles/test_vlm.py``).

One export shared by the tests (module fixture, about 25 s): all slow.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from coreai_torch.errors import UnsupportedModelError
from coreai_torch.hf import CoreAIModelForImageTextToText
from tests.bundles.support import assert_doctor_clean
from tests.hf.support import (
    TOLERANCE,
    assert_streamed,
    llava,
    llava_processor,
    recording_binds,
)
from tests.hf.support import check_generate as check_generate_logits
from tests.llm.support import HALF_LOGITS

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("hf_llava")]

#: the float16 logits' rounding and that of the float16 embeddings the decoder is fed
HALF_EMBEDDINGS_AND_LOGITS = 2 * HALF_LOGITS


def check_generate(ours: Any, reference: Any, inputs: dict[str, Any], **kwargs: Any) -> Any:
    """``tests.hf.support.check_generate`` with the float16 rounding allowed."""
    return check_generate_logits(
        ours, reference, inputs, logits_rounding=HALF_EMBEDDINGS_AND_LOGITS, **kwargs
    )


def image(height: int, width: int, seed: int) -> Any:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("hf_llava")
    processor = llava_processor(root / "hf")
    model = llava(processor.tokenizer.convert_tokens_to_ids("<image>"))
    model.save_pretrained(root / "hf")
    with recording_binds() as bound:
        coreai = CoreAIModelForImageTextToText.from_pretrained(
            root / "hf", export=True, max_context=64
        )
    coreai.save_pretrained(root / "coreai")
    coreai.close()
    return {
        "bound": bound,
        "model": model,
        "processor": processor,
        "coreai": CoreAIModelForImageTextToText.from_pretrained(root / "coreai"),
        "root": root,
    }


def test_export_of_a_directory_streams_the_checkpoint(exported: dict[str, Any]) -> None:
    """LLaVA's checkpoint names its tensors as earlier releases of the class did
    (``language_model.model.*``); they are renamed as ``from_pretrained`` does."""
    assert_streamed(exported["bound"])


def test_generate_with_one_image_matches_transformers(exported: dict[str, Any]) -> None:
    processor = exported["processor"]
    for text, picture in (
        ("user: <image> the quick brown fox", image(40, 48, 0)),
        ("<image>", image(32, 32, 1)),
    ):
        inputs = dict(processor(images=picture, text=text, return_tensors="pt"))
        check_generate(exported["coreai"], exported["model"], inputs)


def test_padded_batch_and_forward_match_transformers(exported: dict[str, Any]) -> None:
    inputs = dict(
        exported["processor"](
            images=[image(40, 48, 2), image(64, 32, 3)],
            text=["user: <image> the", "user: <image> language models generate one token"],
            return_tensors="pt",
            padding=True,
        )
    )
    assert (inputs["attention_mask"] == 0).any()
    check_generate(exported["coreai"], exported["model"], inputs)
    with torch.no_grad():
        expected = exported["model"](**inputs).logits
    out = exported["coreai"](**inputs).logits
    real = inputs["attention_mask"].bool()
    tol = (TOLERANCE + HALF_EMBEDDINGS_AND_LOGITS) * max(1.0, float(expected.abs().max()))
    assert float((out - expected)[real].abs().max()) <= tol


def test_pipeline_and_saved_directory(exported: dict[str, Any]) -> None:
    from transformers import AutoProcessor, pipeline

    out = exported["root"] / "coreai"
    names = {p.name for p in out.iterdir()}
    assert {"metadata.json", "coreai.aimodel", "embedding.aimodel", "vision.aimodel"} <= names
    assert {"config.json", "tokenizer"} <= names
    assert not [p for p in out.rglob("*") if p.name.endswith((".safetensors", ".bin"))]
    assert_doctor_clean(out)
    # the processor's files are saved beside the tokenizer's
    processor = AutoProcessor.from_pretrained(out / "tokenizer", local_files_only=True)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": image(40, 40, 4)},
                {"type": "text", "text": "a"},
            ],
        }
    ]
    results = [
        pipeline("image-text-to-text", model=model, processor=processor)(
            text=messages, max_new_tokens=8, do_sample=False
        )[0]["generated_text"][-1]
        for model in (exported["coreai"], exported["model"])
    ]
    assert results[0] == results[1]


def test_bad_input_raises_before_running(exported: dict[str, Any], tmp_path: Path) -> None:
    coreai, processor = exported["coreai"], exported["processor"]
    inputs = dict(processor(images=image(32, 32, 5), text="<image> the", return_tensors="pt"))
    with pytest.raises(ValueError, match=r"pixel_values must be \[images, 3, 32, 32\]"):
        coreai(input_ids=inputs["input_ids"], pixel_values=torch.randn(1, 3, 64, 64))
    with pytest.raises(ValueError, match="no pixel_values"):
        coreai(input_ids=inputs["input_ids"])
    with pytest.raises(ValueError, match="need 32"):
        coreai(
            input_ids=inputs["input_ids"], pixel_values=inputs["pixel_values"].repeat(2, 1, 1, 1)
        )
    with pytest.raises(ValueError, match="max_context=64"):
        coreai.generate(**inputs, max_new_tokens=60)
    import transformers

    from tests.llm.support import causal_lm

    config = transformers.LlavaConfig(
        vision_config=exported["model"].config.vision_config,
        text_config=transformers.GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=128),
    )
    transformers.LlavaForConditionalGeneration(config).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(UnsupportedModelError, match="'gpt2' text decoder"):
        CoreAIModelForImageTextToText.from_pretrained(tmp_path / "gpt2", export=True)
    causal_lm("llama").save_pretrained(tmp_path / "llama")
    with pytest.raises(UnsupportedModelError, match="--task text-generation"):
        CoreAIModelForImageTextToText.from_pretrained(tmp_path / "llama", export=True)


def test_fp16_int4(exported: dict[str, Any], tmp_path: Path) -> None:
    coreai = CoreAIModelForImageTextToText.from_pretrained(
        exported["model"], export=True, max_context=48, precision="fp16", compress="int4"
    )
    assert coreai.coreai_config["precision"] == "fp16"
    inputs = dict(
        exported["processor"](images=image(32, 32, 6), text="<image> a", return_tensors="pt")
    )
    tokens = coreai.generate(**inputs, max_new_tokens=12, do_sample=False)
    coreai.save_pretrained(tmp_path, tokenizer=exported["root"] / "hf")
    again = CoreAIModelForImageTextToText.from_pretrained(tmp_path)
    assert again.generate(**inputs, max_new_tokens=12, do_sample=False).tolist() == tokens.tolist()


@pytest.mark.parametrize("decoder", ["qwen2", "mistral"])
def test_other_text_decoders(exported: dict[str, Any], decoder: str) -> None:
    processor = exported["processor"]
    model = llava(processor.tokenizer.convert_tokens_to_ids("<image>"), decoder)
    coreai = CoreAIModelForImageTextToText.from_pretrained(model, export=True, max_context=48)
    inputs = dict(processor(images=image(36, 32, 7), text="<image> the quick", return_tensors="pt"))
    check_generate(coreai, model, inputs)
