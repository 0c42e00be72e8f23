"""Encoder LMs (BERT-like; Hugging Face model classes from small configs, random weights)
match eager PyTorch on the Core AI runtime within 1e-4 × max(1, max|ref|).

Inputs carry a padding ``attention_mask`` (one sequence padded on the right) and, for BERT,
``token_type_ids``.  BERT is in the fast suite, the other encoders are slow.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

from tests.models.common import (
    SMALL_TRANSFORMER,
    Call,
    check_model,
    check_model_dynamic,
    redraw_weights,
)

VOCAB = 128
BATCH, SEQ = 2, 16


def encoder(config_name: str, model_name: str, attn: str = "sdpa", **overrides: Any) -> nn.Module:
    import transformers

    config = getattr(transformers, config_name)(
        **{
            "vocab_size": VOCAB,
            **SMALL_TRANSFORMER,
            "max_position_embeddings": 64,
            **overrides,
        }
    )
    config._attn_implementation = attn
    # MLM heads are tied to the token embeddings: keep those small so logits stay O(1).
    return redraw_weights(getattr(transformers, model_name)(config).eval(), embedding_std=0.3)


def padded_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (BATCH, SEQ))
    mask = torch.ones(BATCH, SEQ, dtype=torch.int64)
    mask[1, SEQ - 5 :] = 0
    ids[1, SEQ - 5 :] = 1  # the pad token
    return ids, mask


def test_bert() -> None:
    """BertModel: last hidden state and pooled output, with token types and padding."""
    model = encoder("BertConfig", "BertModel", pad_token_id=1)
    ids, mask = padded_inputs()
    types = torch.zeros_like(ids)
    types[:, SEQ // 2 :] = 1
    call = Call(
        model,
        lambda m, i, a, t: m(input_ids=i, attention_mask=a, token_type_ids=t, return_dict=False)[
            :2
        ],
    )
    check_model(call, (ids, mask, types))


def check_dynamic_sequence_length(model: nn.Module) -> None:
    """One program for every sequence length (``torch.export.Dim`` on the sequence axis), run
    at three lengths with a padded sequence."""
    call = Call(model, lambda m, i, a: m(input_ids=i, attention_mask=a, return_dict=False)[0])
    seq = torch.export.Dim("seq", min=2, max=32)
    runs = []
    for n in (12, 5, 20):
        ids, mask = torch.randint(3, VOCAB, (2, n)), torch.ones(2, n, dtype=torch.int64)
        mask[1, n // 2 :] = 0
        runs.append((ids, mask))
    check_model_dynamic(call, runs, (({1: seq}, {1: seq}),))


@pytest.mark.slow
def test_bert_dynamic_sequence_length() -> None:
    check_dynamic_sequence_length(encoder("BertConfig", "BertModel", pad_token_id=1))


MODELS = {
    # RoBERTa derives position ids from the pad token (cumsum over the mask).
    "roberta_mlm": ("RobertaConfig", "RobertaForMaskedLM", dict(pad_token_id=1)),
    "distilbert_mlm": (
        "DistilBertConfig",
        "DistilBertForMaskedLM",
        dict(dim=64, n_layers=2, n_heads=4, hidden_dim=128, pad_token_id=1),
    ),
    "bert_mlm": ("BertConfig", "BertForMaskedLM", dict(pad_token_id=1)),
    # Factorized embeddings and one layer's weights shared by all layers.
    "albert": ("AlbertConfig", "AlbertModel", dict(embedding_size=32, pad_token_id=1)),
    # Disentangled attention with relative-position buckets (eager attention only).
    "deberta_v2": (
        "DebertaV2Config",
        "DebertaV2Model",
        dict(
            attn="eager",
            relative_attention=True,
            position_buckets=8,
            pos_att_type=["p2c", "c2p"],
            pad_token_id=1,
        ),
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_encoder_lm(name: str) -> None:
    config_name, model_name, overrides = MODELS[name]
    model = encoder(config_name, model_name, **overrides)
    call = Call(model, lambda m, i, a: m(input_ids=i, attention_mask=a, return_dict=False)[0])
    check_model(call, padded_inputs())


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_encoder_lm_dynamic_sequence_length(name: str) -> None:
    config_name, model_name, overrides = MODELS[name]
    check_dynamic_sequence_length(encoder(config_name, model_name, **overrides))
