"""``frontend.specialize``: a decomposed program with its dynamic sizes fixed, without tracing
the model again (how ``llm.export`` derives the decode step from the prefill)."""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch
import torch.nn as nn

from coreai_torch import TorchConverter
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.frontend.specialize import SpecializationError, specialize
from coreai_torch.verify import verify


class Positions(nn.Module):
    """Reads its sequence length (positions, a reshape by it, a slice of a table) and writes a
    buffer in place at those positions, as a KV-cache update does."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.table = nn.Parameter(torch.randn(16, 8))
        self.register_buffer("cache", torch.zeros(1, 16, 8))

    def forward(self, x: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        positions = start + torch.arange(length)
        h = self.proj(x) + self.table[positions]
        self.cache.index_copy_(1, positions, h)
        halves = h.reshape(1, length, 2, 4).sum(-1)
        return halves + self.cache[:, :length, :2]


def _dynamic(model: nn.Module) -> torch.export.ExportedProgram:
    length = torch.export.Dim("length", min=1, max=12)
    args = (torch.randn(1, 3, 8), torch.tensor([2]))
    return export_decomposed(model, args, dynamic_shapes=({1: length}, None))


def _convert(ep: torch.export.ExportedProgram) -> object:
    return TorchConverter().add_exported_program(ep, state_names=["cache"]).to_coreai()


@pytest.mark.parametrize("length", [1, 5, 12])
def test_a_specialized_program_runs_and_matches_pytorch(length: int) -> None:
    torch.manual_seed(0)
    model = Positions().eval()
    args = (torch.randn(1, length, 8), torch.tensor([12 - length]))
    program = _convert(specialize(_dynamic(model), args))
    text = str(program)
    assert f"tensor<1x{length}x8xf32>" in text
    assert "?" not in re.sub(r"//.*", "", text)  # every shape static
    report = verify(model, args, program=program, atol=1e-5, rtol=1e-5)
    assert report.ok, report


def test_it_is_the_program_a_trace_with_those_shapes_gives() -> None:
    model = Positions().eval()
    args = (torch.randn(1, 1, 8), torch.tensor([4]))
    traced = export_decomposed(model, args)
    derived = specialize(_dynamic(model), args)

    def ops(ep: torch.export.ExportedProgram) -> Counter[str]:
        return Counter(str(n.target) for n in ep.graph.nodes if n.op == "call_function")

    assert ops(derived) == ops(traced)
    assert derived.graph_signature.buffers_to_mutate == traced.graph_signature.buffers_to_mutate
    assert derived.state_dict.keys() == traced.state_dict.keys()


def test_the_weights_are_shared_not_copied() -> None:
    ep = _dynamic(Positions().eval())
    derived = specialize(ep, (torch.randn(1, 1, 8), torch.tensor([0])))
    assert all(derived.state_dict[k] is v for k, v in ep.state_dict.items())
    assert ep.range_constraints  # the original program is left as it was
    assert not derived.range_constraints


def test_sizes_the_program_was_not_traced_for_are_refused() -> None:
    ep = _dynamic(Positions().eval())
    with pytest.raises(SpecializationError, match="outside the traced range"):
        specialize(ep, (torch.randn(1, 13, 8), torch.tensor([0])))
    with pytest.raises(SpecializationError, match="static size 1"):
        specialize(ep, (torch.randn(2, 3, 8), torch.tensor([0])))
    with pytest.raises(SpecializationError, match="rank or dtype"):
        specialize(ep, (torch.randn(1, 3, 8).double(), torch.tensor([0])))
    with pytest.raises(SpecializationError, match="takes 2 inputs"):
        specialize(ep, (torch.randn(1, 3, 8),))


def test_a_graph_it_cannot_walk_is_refused() -> None:
    class Branches(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cond(x.sum() > 0, lambda t: t + 1, lambda t: t - 1, (x,))

    length = torch.export.Dim("length", min=1, max=8)
    ep = export_decomposed(Branches(), (torch.randn(1, 3),), dynamic_shapes=({1: length},))
    with pytest.raises(SpecializationError):
        specialize(ep, (torch.randn(1, 2),))
