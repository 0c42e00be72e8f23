"""The Hugging Face table of ``make bench``: the ``coreai_torch.hf`` classes on random-weight
models of realistic shapes, in float32 and in float16 with int4 weights.

* ``whisper``: Whisper tiny-shaped (d_model 384, 4 + 4 layers, 6 heads, 80 mel bins, 1500
  encoder positions, vocabulary 51865): encoder time for 30 s of audio, decoder tokens/s
  (a 4-token decoder prompt, then one token per step).
* ``embedding``: a MiniLM-shaped BERT (hidden 384, 6 layers, 12 heads, vocabulary 30522):
  sentences/s for a batch of 32 sentences of 128 tokens (forward + mean pooling).
* ``vlm``: a LLaVA-style model (a 4-layer CLIP vision tower on 224x224 images, 196 image
  tokens, and an 8-layer Llama decoder of hidden 512): prefill time of one image + 32 text
  tokens, decode tokens/s.

    python -m benchmarks.run --one-hf whisper:fp16+int4     # one row, as make bench runs it
"""

from __future__ import annotations

import statistics
import time
from typing import Any

#: form -> from_pretrained options
FORMS: dict[str, dict[str, Any]] = {
    "fp32": {},
    "fp16+int4": {"precision": "fp16", "compress": "int4"},
}
TASKS = ("whisper", "embedding", "vlm")
#: every row: "task:form"
ROWS = [f"{task}:{form}" for task in TASKS for form in FORMS]
DECODE_STEPS = 32
SENTENCES, SENTENCE_TOKENS = 32, 128
TEXT_TOKENS = 32


def _whisper() -> Any:
    import transformers

    config = transformers.WhisperConfig(
        vocab_size=51865,
        num_mel_bins=80,
        d_model=384,
        encoder_layers=4,
        decoder_layers=4,
        encoder_attention_heads=6,
        decoder_attention_heads=6,
        encoder_ffn_dim=1536,
        decoder_ffn_dim=1536,
        max_source_positions=1500,
        max_target_positions=448,
    )
    return transformers.WhisperForConditionalGeneration(config).eval()


def _embedding() -> Any:
    import transformers

    config = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=12,
        intermediate_size=1536,
        max_position_embeddings=512,
    )
    return transformers.BertModel(config, add_pooling_layer=False).eval()


def _vlm() -> Any:
    import transformers

    vision = transformers.CLIPVisionConfig(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        image_size=224,
        patch_size=16,
    )
    text = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=2048,
    )
    config = transformers.LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=31999, image_seq_length=196
    )
    config._attn_implementation = "sdpa"
    return transformers.LlavaForConditionalGeneration(config).eval()


def _timed(fn: Any, runs: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _decode_rate(model: Any, first: dict[str, Any], runs: int, key: str) -> tuple[float, float]:
    """Median prefill seconds and decode tokens/s: ``model(**first)`` then DECODE_STEPS
    one-token calls on the returned cache."""
    import torch

    prefills, rates = [], []
    for _ in range(runs + 1):
        start = time.perf_counter()
        out = model(**first, logits_to_keep=1) if key == "input_ids" else model(**first)
        prefills.append(time.perf_counter() - start)
        token = out.logits[:, -1:].argmax(-1)
        cache = out.past_key_values
        extra = {k: v for k, v in first.items() if k in ("encoder_outputs",)}
        start = time.perf_counter()
        for _ in range(DECODE_STEPS):
            step = model(**{key: token}, past_key_values=cache, **extra)
            token = step.logits[:, -1:].argmax(-1).to(torch.int64)
        rates.append(DECODE_STEPS / (time.perf_counter() - start))
    return statistics.median(prefills[1:]), statistics.median(rates[1:])


def measure_hf(spec: str, runs: int) -> dict[str, Any]:
    """Export, save, load and time one row (``task:form``)."""
    import tempfile
    from pathlib import Path

    import torch

    from coreai_torch import hf

    task, form = spec.split(":")
    torch.manual_seed(0)
    build = {"whisper": _whisper, "embedding": _embedding, "vlm": _vlm}[task]
    cls = {
        "whisper": hf.CoreAIModelForSpeechSeq2Seq,
        "embedding": hf.CoreAIModelForFeatureExtraction,
        "vlm": hf.CoreAIModelForImageTextToText,
    }[task]
    model = build()
    result: dict[str, Any] = {"row": spec, "task": task, "form": form}
    result["weight_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    options = dict(FORMS[form])
    if task == "vlm":
        options["max_context"] = 512
    start = time.perf_counter()
    exported = cls.from_pretrained(model, export=True, **options)
    result["export_s"] = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as tmp:
        exported.save_pretrained(tmp)
        exported.close()
        result["asset_bytes"] = sum(
            f.stat().st_size for f in Path(tmp).rglob("*") if ".aimodel" in str(f) and f.is_file()
        )
        coreai = cls.from_pretrained(tmp)
        if task == "whisper":
            features = torch.randn(1, 80, 3000)
            result["encoder_s"] = _timed(lambda: coreai.encode(features), runs)
            encoded = coreai.get_encoder()(features)
            with torch.no_grad():
                expected = model.model.encoder(features).last_hidden_state
            result["max_abs_err"] = float((encoded.last_hidden_state - expected).abs().max())
            result["max_ref"] = float(expected.abs().max())
            prompt = torch.tensor([[50258, 50259, 50359, 50363]])
            first = {"decoder_input_ids": prompt, "encoder_outputs": encoded}
            result["prefill_s"], result["decode_tokens_per_s"] = _decode_rate(
                coreai, first, runs, "decoder_input_ids"
            )
        elif task == "embedding":
            ids = torch.randint(1000, 30000, (SENTENCES, SENTENCE_TOKENS))
            mask = torch.ones_like(ids)

            def embed() -> torch.Tensor:
                hidden = coreai(input_ids=ids, attention_mask=mask).last_hidden_state
                return hf.pool(hidden, mask)

            result["batch_s"] = _timed(embed, runs)
            result["sentences_per_s"] = SENTENCES / result["batch_s"]
            with torch.no_grad():
                expected = hf.pool(
                    model(input_ids=ids, attention_mask=mask).last_hidden_state, mask
                )
            cosine = torch.nn.functional.cosine_similarity(embed(), expected)
            result["min_cosine"] = float(cosine.min())
        else:
            image_tokens = coreai.coreai_config["image_tokens"]
            ids = torch.randint(100, 31000, (1, image_tokens + TEXT_TOKENS))
            ids[0, 1 : 1 + image_tokens] = model.config.image_token_id
            ids[0, 0] = 1
            first = {"input_ids": ids, "pixel_values": torch.randn(1, 3, 224, 224)}
            result["image_s"] = _timed(lambda: coreai.image_features(first["pixel_values"]), runs)
            result["prefill_s"], result["decode_tokens_per_s"] = _decode_rate(
                coreai, first, runs, "input_ids"
            )
            result["prompt_tokens"] = ids.shape[1]
        coreai.close()
    return result


def hf_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of :func:`measure_hf` results."""
    lines = [
        "| model | form | export | asset | measurements |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r.get('row', r.get('model'))} | failed: {r['error']} ||||")
            continue
        if r["task"] == "whisper":
            what = (
                f"encoder {1000 * r['encoder_s']:.0f} ms (30 s of audio; max abs err "
                f"{r['max_abs_err']:.1e}, max ref {r['max_ref']:.1f}); decoder "
                f"{r['decode_tokens_per_s']:.1f} tokens/s"
            )
            name = "Whisper tiny-shaped (39M)"
        elif r["task"] == "embedding":
            what = (
                f"{r['sentences_per_s']:.1f} sentences/s ({SENTENCES} x {SENTENCE_TOKENS} "
                f"tokens, mean pooling; min cosine vs fp32 eager {r['min_cosine']:.6f})"
            )
            name = "MiniLM-shaped BERT (22M)"
        else:
            what = (
                f"image features {1000 * r['image_s']:.0f} ms; prefill of one image + "
                f"{TEXT_TOKENS} tokens ({r['prompt_tokens']} positions) "
                f"{1000 * r['prefill_s']:.0f} ms; decode {r['decode_tokens_per_s']:.1f} tokens/s"
            )
            name = "LLaVA-style (CLIP 4 layers + Llama 8 layers)"
        lines.append(
            f"| {name} | {r['form']} | {r['export_s']:.1f} s | "
            f"{r['asset_bytes'] / 2**20:.1f} MiB ({100 * r['asset_bytes'] / r['weight_bytes']:.0f}"
            f"% of fp32) | {what} |"
        )
    return "\n".join(lines)
