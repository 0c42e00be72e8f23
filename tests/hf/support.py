"""Shared pieces of the ``coreai_torch.hf`` tests: the step-by-step comparison of a
``generate`` on the runtime with Hugging Face's, and model directories saved here.

Nothing is downloaded: models are built from config classes with random weights and saved
with ``save_pretrained`` into temporary directories; tokenizers are trained here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from coreai_torch.tensors import lazy
from coreai_torch.tensors.lazy import WeightSource


@contextlib.contextmanager
def recording_binds() -> Iterator[list[torch.nn.Module]]:
    """Record the modules bound to a checkpoint (``WeightSource.bind``) inside the block."""
    bound: list[torch.nn.Module] = []
    bind = WeightSource.bind

    def spy(self: WeightSource, module: torch.nn.Module) -> torch.nn.Module:
        bound.append(module)
        return bind(self, module)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(WeightSource, "bind", spy)
        yield bound


def assert_streamed(bound: list[torch.nn.Module]) -> None:
    """One module was bound to its checkpoint and every parameter of it is lazy (read from
    the checkpoint while the asset is written)."""
    (model,) = bound
    assert all(lazy.is_lazy(p) for p in model.parameters())


#: fp32 logits agree within this many times max(1, max|ref|) at every step.
TOLERANCE = 1e-4


def check_generate(
    ours: Any,
    reference: Any,
    inputs: dict[str, Any],
    new_tokens: int = 16,
    *,
    logits_rounding: float = 0.0,
    **kwargs: Any,
) -> torch.Tensor:
    """Greedy ``generate`` of ``ours`` equals ``reference.generate`` token for token, and each
    step's logits are within :data:`TOLERANCE` (plus ``logits_rounding``, relative: the
    rounding of a program's float16 logits); returns the sequences."""
    args = dict(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        **kwargs,
    )
    with torch.no_grad():
        expected = reference.generate(**inputs, **args)
    actual = ours.generate(**inputs, **args)
    assert len(actual.logits) == len(expected.logits) == new_tokens
    prompt = inputs["input_ids"].shape[1]
    for step, (a, e) in enumerate(zip(actual.logits, expected.logits, strict=True)):
        largest = max(1.0, float(e.abs().max()))
        tol = (TOLERANCE + logits_rounding) * largest
        err = float((a - e).abs().max())
        assert err <= tol, f"step {step}: max|err| {err:.3e} > {tol:.3e}"
        ours_tokens = actual.sequences[:, prompt + step]
        theirs = expected.sequences[:, prompt + step]
        if not torch.equal(ours_tokens, theirs):
            # only where rounded logits cannot tell the two best apart; compared up to there
            rows = torch.arange(len(e))
            margin = float((e[rows, theirs] - e[rows, ours_tokens]).abs().max())
            assert margin <= logits_rounding * largest, (
                f"step {step}: {ours_tokens.tolist()} != {theirs.tolist()} (logit margin "
                f"{margin:.3e})"
            )
            return actual.sequences
    assert actual.sequences.tolist() == expected.sequences.tolist()
    return actual.sequences


WORDS = (
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "a",
    "core",
    "ai",
    "program",
    "runs",
    "on",
    "device",
    "language",
    "models",
    "generate",
    "one",
    "token",
    "at",
    "time",
    "cache",
    "keeps",
    "keys",
    "and",
    "values",
    "of",
    "every",
    "layer",
)


def bert_tokenizer(directory: Any) -> Any:
    """A WordPiece tokenizer over :data:`WORDS` (a ``vocab.txt`` written to ``directory``)."""
    from pathlib import Path

    from transformers import BertTokenizerFast

    path = Path(directory) / "vocab.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    return BertTokenizerFast(vocab_file=str(path))


#: Whisper's special tokens, in id order after the 256 byte tokens.
WHISPER_SPECIALS = [
    "<|endoftext|>",
    "<|startoftranscript|>",
    "<|en|>",
    "<|fr|>",
    "<|translate|>",
    "<|transcribe|>",
    "<|startoflm|>",
    "<|startofprev|>",
    "<|nocaptions|>",
    "<|notimestamps|>",
]
#: no id after <|notimestamps|>: Whisper would read those as timestamps (and seek)
WHISPER_VOCAB = 256 + len(WHISPER_SPECIALS)


def whisper_tokenizer(directory: Any) -> Any:
    """A byte-level ``WhisperTokenizer`` (one token per byte, no merges) with Whisper's
    special tokens at ids 256.. (files written to ``directory``)."""
    import json
    from pathlib import Path

    from transformers import WhisperTokenizer
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    symbols = sorted(bytes_to_unicode().values(), key=lambda c: ord(c))
    vocab = {s: i for i, s in enumerate([*symbols, *WHISPER_SPECIALS])}
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n")
    return WhisperTokenizer(
        str(directory / "vocab.json"),
        str(directory / "merges.txt"),
        additional_special_tokens=WHISPER_SPECIALS[1:],
    )


def whisper(**overrides: Any) -> Any:
    """A small random-weight ``WhisperForConditionalGeneration`` with Whisper's 80 mel bins
    and 1500 encoder positions (30 s of audio), and a multilingual generation config over
    :func:`whisper_tokenizer`'s ids."""
    import transformers
    from transformers import GenerationConfig

    from tests.models.common import redraw_weights

    ids = {name: 256 + i for i, name in enumerate(WHISPER_SPECIALS)}
    config = transformers.WhisperConfig(
        vocab_size=WHISPER_VOCAB,
        num_mel_bins=80,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_source_positions=1500,
        max_target_positions=64,
        pad_token_id=ids["<|endoftext|>"],
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|endoftext|>"],
        decoder_start_token_id=ids["<|startoftranscript|>"],
        begin_suppress_tokens=None,
        suppress_tokens=None,
        **overrides,
    )
    config._attn_implementation = "sdpa"
    model = transformers.WhisperForConditionalGeneration(config).eval()
    redraw_weights(model, embedding_std=0.3)
    # as a real checkpoint's generation_config.json (not derived from the model config, whose
    # reload drops the Whisper-specific keys)
    model.generation_config = GenerationConfig(
        decoder_start_token_id=ids["<|startoftranscript|>"],
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|endoftext|>"],
        pad_token_id=ids["<|endoftext|>"],
        no_timestamps_token_id=ids["<|notimestamps|>"],
        is_multilingual=True,
        lang_to_id={"<|en|>": ids["<|en|>"], "<|fr|>": ids["<|fr|>"]},
        task_to_id={"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]},
        suppress_tokens=[],
        begin_suppress_tokens=[ids["<|endoftext|>"]],
        max_initial_timestamp_index=50,
        max_length=64,
    )
    return model


def llava_processor(directory: Any) -> Any:
    """A ``LlavaProcessor`` over the trained tokenizer with an ``<image>`` token and a CLIP
    image processor for 32x32 images (16 image tokens of 8x8 patches), saved in
    ``directory``."""
    from transformers import CLIPImageProcessor, LlavaProcessor

    from tests.llm.support import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.pad_token = "<unk>"
    tokenizer.padding_side = "left"
    tokenizer.model_input_names = ["input_ids", "attention_mask"]
    tokenizer.init_kwargs["model_input_names"] = tokenizer.model_input_names  # saved with it
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
        ),
        tokenizer=tokenizer,
        patch_size=8,
        vision_feature_select_strategy="default",
        image_token="<image>",
        num_additional_image_tokens=1,
        chat_template=(
            "{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}"
            "{{ m['content'] }}{% else %}{% for c in m['content'] %}"
            "{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}"
            "{% endfor %}{% endif %}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}"
        ),
    )
    processor.save_pretrained(directory)
    return processor


def llava(image_token_id: int, decoder: str = "llama", **overrides: Any) -> Any:
    """A small random-weight ``LlavaForConditionalGeneration``: a 2-layer CLIP vision tower
    (32x32 images, 8x8 patches), a projector and a 2-layer ``decoder`` (an architecture of
    ``tests.llm.support.ARCHITECTURES``)."""
    import transformers

    from tests.llm.support import causal_lm

    text = causal_lm(decoder).config
    vision = transformers.CLIPVisionConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
    )
    config = transformers.LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_token_id,
        image_seq_length=16,
        **overrides,
    )
    config._attn_implementation = "sdpa"
    from tests.models.common import redraw_weights

    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    redraw_weights(model)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model
