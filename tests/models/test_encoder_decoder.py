"""Encoder-decoder models (T5, BART, Whisper; Hugging Face model classes from small configs,
random weights) match eager PyTorch on the Core AI runtime within 1e-4 × max(1, max|ref|).

Each runs the full encoder + decoder (teacher forcing, no cache) and returns the logits and
the encoder's last hidden state.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

from tests.models.common import Call, check_model, check_model_dynamic, redraw_weights

VOCAB = 128


def seq2seq(config_name: str, model_name: str, **config: Any) -> nn.Module:
    import transformers

    cfg = getattr(transformers, config_name)(vocab_size=VOCAB, use_cache=False, **config)
    cfg._attn_implementation = "eager" if config_name == "T5Config" else "sdpa"
    # The LM heads are tied to the token embeddings: keep those small so logits stay O(1).
    return redraw_weights(getattr(transformers, model_name)(cfg).eval(), embedding_std=0.3)


def logits_and_encoder(m: nn.Module, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if args[0].is_floating_point():  # Whisper: log-mel features
        names = ("input_features", "decoder_input_ids")
    else:
        names = ("input_ids", "attention_mask", "decoder_input_ids")
    out = m(**dict(zip(names, args, strict=True)), use_cache=False, return_dict=True)
    return out.logits, out.encoder_last_hidden_state


def text_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    return ids, mask, torch.randint(3, VOCAB, (2, 8))


#: Encoder and decoder sizes of the BART-style configs (BART, Whisper).
BART_LIKE = dict(
    d_model=64,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=128,
    decoder_ffn_dim=128,
)


def t5() -> nn.Module:
    return seq2seq(
        "T5Config",
        "T5ForConditionalGeneration",
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        decoder_start_token_id=0,
        pad_token_id=0,
    )


def bart() -> nn.Module:
    return seq2seq(
        "BartConfig",
        "BartForConditionalGeneration",
        **BART_LIKE,
        max_position_embeddings=64,
    )


def whisper() -> nn.Module:
    return seq2seq(
        "WhisperConfig",
        "WhisperForConditionalGeneration",
        num_mel_bins=16,
        **BART_LIKE,
        max_source_positions=16,
        max_target_positions=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
        begin_suppress_tokens=None,
    )


@pytest.mark.slow
def test_t5() -> None:
    check_model(Call(t5(), logits_and_encoder), text_inputs())


@pytest.mark.slow
def test_bart() -> None:
    check_model(Call(bart(), logits_and_encoder), text_inputs())


@pytest.mark.slow
def test_whisper() -> None:
    """Encoder (two strided conv1d + sinusoidal positions) and decoder, 32 feature frames."""
    features = torch.randn(2, 16, 32)
    check_model(Call(whisper(), logits_and_encoder), (features, torch.randint(3, VOCAB, (2, 8))))


@pytest.mark.slow
@pytest.mark.parametrize("build", [t5, bart], ids=["t5", "bart"])
def test_seq2seq_dynamic_lengths(build) -> None:
    """One program for every source and target length (two ``torch.export.Dim``s)."""
    src, tgt = torch.export.Dim("src", min=2, max=32), torch.export.Dim("tgt", min=2, max=32)
    runs = []
    for s, t in ((12, 8), (5, 3), (20, 14)):
        ids = torch.randint(3, VOCAB, (2, s))
        mask = torch.ones_like(ids)
        mask[1, s // 2 :] = 0
        runs.append((ids, mask, torch.randint(3, VOCAB, (2, t))))
    check_model_dynamic(Call(build(), logits_and_encoder), runs, (({1: src}, {1: src}, {1: tgt}),))


@pytest.mark.slow
def test_whisper_dynamic_decoder_length() -> None:
    """Whisper's encoder takes a fixed number of frames; the decoder length is dynamic."""
    tgt = torch.export.Dim("tgt", min=2, max=32)
    runs = [(torch.randn(2, 16, 32), torch.randint(3, VOCAB, (2, t))) for t in (8, 3, 14)]
    check_model_dynamic(Call(whisper(), logits_and_encoder), runs, ((None, {1: tgt}),))
