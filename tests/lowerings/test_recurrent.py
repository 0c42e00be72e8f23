"""Recurrent layers (``aten.lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu``): one
``coreai.while`` over time per layer, matching eager PyTorch on the runtime."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

from coreai_torch.errors import ConversionError
from coreai_torch.frontend.export import RECURRENT_OPS, get_decomp_table
from tests.helpers import check_module, convert


class Run(nn.Module):
    """Calls the recurrent module with the given initial state and returns every result."""

    def __init__(self, rnn: nn.RNNBase) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x: torch.Tensor, *state: torch.Tensor) -> Any:
        init = None if not state else state[0] if len(state) == 1 else tuple(state)
        out, last = self.rnn(x, init)
        return (out, *last) if isinstance(last, tuple) else (out, last)


def inputs(rnn: nn.RNNBase, steps: int, batch: int = 2, with_state: bool = True) -> tuple:
    x = torch.randn(batch, steps, rnn.input_size)
    if not rnn.batch_first:
        x = x.transpose(0, 1).contiguous()
    if not with_state:
        return (x,)
    layers = rnn.num_layers * (2 if rnn.bidirectional else 1)
    h = torch.randn(layers, batch, rnn.proj_size or rnn.hidden_size)
    if isinstance(rnn, nn.LSTM):
        return (x, h, torch.randn(layers, batch, rnn.hidden_size))
    return (x, h)


CASES = {
    "lstm": lambda: nn.LSTM(6, 8, num_layers=2, batch_first=True),
    "lstm_bidirectional_projection": lambda: nn.LSTM(
        6, 8, num_layers=2, batch_first=True, bidirectional=True, proj_size=3
    ),
    "lstm_time_major_no_bias": lambda: nn.LSTM(6, 8, bias=False),
    "gru_bidirectional": lambda: nn.GRU(6, 8, num_layers=2, bidirectional=True),
    "gru_no_bias": lambda: nn.GRU(6, 8, bias=False, batch_first=True),
    "rnn_tanh": lambda: nn.RNN(6, 8, num_layers=2, batch_first=True),
    "rnn_relu_bidirectional": lambda: nn.RNN(6, 8, nonlinearity="relu", bidirectional=True),
}


@pytest.mark.parametrize(
    "name",
    [
        "lstm",
        *(pytest.param(n, marks=pytest.mark.slow) for n in CASES if n != "lstm"),
    ],
)
def test_recurrent_matches_pytorch(name: str) -> None:
    rnn = CASES[name]().eval()
    check_module(Run(rnn), inputs(rnn, steps=5))


@pytest.mark.slow
@pytest.mark.parametrize("steps", [1, 2])
def test_short_sequences_and_default_state(steps: int) -> None:
    rnn = nn.GRU(6, 8, num_layers=2, batch_first=True, bidirectional=True).eval()
    check_module(Run(rnn), inputs(rnn, steps=steps, batch=1, with_state=False))


def test_one_loop_per_layer_whatever_the_length() -> None:
    """The IR has one ``coreai.while`` per layer and does not grow with the sequence."""
    rnn = nn.LSTM(6, 8, num_layers=2, batch_first=True, bidirectional=True).eval()
    texts = [str(convert(Run(rnn), inputs(rnn, steps=steps))) for steps in (2, 9)]
    for text in texts:
        assert text.count("coreai.while") == 2
    assert len(texts[0].splitlines()) == len(texts[1].splitlines())


def test_decomp_table_keeps_recurrent_ops() -> None:
    table = get_decomp_table()
    assert all(op not in table for op in RECURRENT_OPS)


def test_training_dropout_is_rejected() -> None:
    rnn = nn.LSTM(6, 8, num_layers=2, dropout=0.5, batch_first=True).train()
    with pytest.raises(ConversionError, match="dropout between recurrent layers"):
        convert(Run(rnn), inputs(rnn, steps=3))
