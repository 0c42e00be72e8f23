"""``rewrite_recurrent``: nn.LSTM / GRU / RNN as ``scan`` loops, exact, with a dynamic length.

The runtime tests with several lengths are in tests/models/test_torch_nn.py; here: the rewrite
equals the module for every variant torch has (eager), a small program with no initial state
runs any length on the runtime, and the refusals."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from coreai_torch import UnsupportedModelError, rewrite_recurrent
from coreai_torch.rewrites.recurrent import ScanRecurrent
from tests.models.common import check_model_dynamic

VARIANTS = [
    (nn.LSTM, {}),
    (nn.LSTM, {"proj_size": 5}),
    (nn.GRU, {}),
    (nn.GRU, {"bias": False}),
    (nn.RNN, {}),
    (nn.RNN, {"nonlinearity": "relu"}),
]


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("cell, options", VARIANTS, ids=lambda v: getattr(v, "__name__", str(v)))
def test_rewrite_equals_the_module(
    cell: type[nn.RNNBase], options: dict, bidirectional: bool, batch_first: bool
) -> None:
    """Outputs and final states, batched and unbatched, with and without an initial state;
    the parameters are the module's own tensors under the same names."""
    torch.manual_seed(0)
    module = cell(
        8, 16, num_layers=2, batch_first=batch_first, bidirectional=bidirectional, **options
    )
    module.eval()
    scanned = rewrite_recurrent(copy.deepcopy(module))
    assert isinstance(scanned, ScanRecurrent)
    assert scanned.state_dict().keys() == module.state_dict().keys()
    x = torch.randn(3, 7, 8)
    with torch.no_grad():
        _, state = module(x)
        for args in [(x,), (x, state), (torch.randn(7, 8),)]:
            torch.testing.assert_close(scanned(*args), module(*args), rtol=1e-5, atol=1e-5)


class Tagger(nn.Module):
    """Embedding → GRU (no initial state) → per-token head: a sequence tagger."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.gru = nn.GRU(8, 12, batch_first=True)
        self.head = nn.Linear(12, 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(self.embed(tokens))[0])


def test_rewritten_tagger_runs_any_length_on_the_runtime() -> None:
    model = rewrite_recurrent(Tagger().eval())
    assert isinstance(model.gru, ScanRecurrent)
    runs = [(torch.randint(0, 50, (1, n)),) for n in (6, 1, 13)]
    check_model_dynamic(model, runs, ({1: torch.export.Dim("seq", max=32)},))


def test_training_mode_with_dropout_is_refused_before_anything_changes() -> None:
    model = nn.Sequential(nn.LSTM(4, 4, num_layers=2, dropout=0.1))
    with pytest.raises(UnsupportedModelError, match=r"training mode.*0.*model.eval\(\)"):
        rewrite_recurrent(model)
    assert isinstance(model[0], nn.LSTM)


def test_a_model_without_recurrent_modules_is_returned_unchanged() -> None:
    model = nn.Linear(3, 3)
    assert rewrite_recurrent(model) is model


def test_a_packed_sequence_is_refused_with_what_to_pass() -> None:
    scanned = rewrite_recurrent(nn.GRU(4, 4).eval())
    packed = nn.utils.rnn.pack_sequence([torch.randn(3, 4), torch.randn(2, 4)])
    with pytest.raises(TypeError, match="PackedSequence; pass a padded tensor"):
        scanned(packed)
