"""find_divergence: the first FX node whose converted value differs from PyTorch."""

from __future__ import annotations

import torch
import torch.nn as nn

from coreai_torch import TorchConverter
from coreai_torch._mlir import cai
from coreai_torch._utils import get_operand
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.verify import find_divergence
from coreai_torch.verify.bisect import Divergence, prefix_program


class TwoBranches(nn.Module):
    """relu sits in one of two branches, behind a linear layer, and feeds a layer norm."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.other = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor, *, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        side = torch.tanh(self.other(x)) + bias
        h = self.fc(x)
        h = torch.relu(h)  # the line the wrong lowering below breaks
        return self.norm(h + side) * 2, side


def wrong_relu_converter() -> TorchConverter:
    converter = TorchConverter()

    @converter.register_torch_lowering("aten::relu.default", allow_override=True)
    def abs_instead_of_relu(values_map, node, loc):
        return cai.abs_(get_operand(values_map, node, 0, loc))

    return converter


def test_points_at_the_node_of_a_wrong_user_lowering() -> None:
    model = TwoBranches().eval()
    args, kwargs = (torch.randn(2, 8),), {"bias": torch.randn(8)}
    lines: list[str] = []
    found = find_divergence(model, args, kwargs, converter=wrong_relu_converter(), log=lines.append)

    assert isinstance(found, Divergence)
    assert found.name == "relu" and found.op == "aten::relu.default"
    assert found.source.startswith(__file__) and "torch.relu(h)" in found.source
    assert found.error.max_abs > 0.1 and not found.error.ok
    assert [i.name for i in found.inputs] == ["addmm_1"] and found.inputs[0].ok
    assert found.probes == len(lines) and 2 <= found.probes <= 6, lines
    text = str(found)
    assert "first diverging node: node 'relu' (op aten::relu.default)" in text
    assert "torch.relu(h)" in text and "max|err|" in text
    assert found.to_dict()["node"] == "relu"


def test_no_divergence_with_the_built_in_lowerings_and_from_an_exported_program() -> None:
    model = TwoBranches().eval()
    args, kwargs = (torch.randn(2, 8),), {"bias": torch.randn(8)}
    ep = torch.export.export(model, args, kwargs)  # training IR: decomposed by find_divergence
    assert find_divergence(ep, args, kwargs) is None


def test_prefix_program_returns_the_requested_nodes_and_keeps_every_input() -> None:
    model = TwoBranches().eval()
    args, kwargs = (torch.randn(2, 8),), {"bias": torch.randn(8)}
    ep = export_decomposed(model, args, kwargs)
    relu = next(n for n in ep.graph.nodes if n.name == "relu")
    prefix = prefix_program(ep, [relu])
    names = [n.name for n in prefix.graph.nodes if n.op == "call_function"]
    assert names[-1] == "relu" and "tanh" not in names
    assert [s.arg.name for s in prefix.graph_signature.input_specs] == [
        s.arg.name for s in ep.graph_signature.input_specs
    ]
    out = prefix.module()(*args, **kwargs)
    expected = torch.relu(model.fc(args[0]))
    torch.testing.assert_close(out[0] if isinstance(out, tuple) else out, expected)


def test_a_wrong_multi_result_lowering_is_reported_at_the_op_with_the_result_index() -> None:
    class Split(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            a, b = torch.exp(x).split(4, dim=-1)
            return a * 2 + b.sin()

    key = "aten::split_with_sizes.default"
    converter = TorchConverter()
    builtin = converter.lowerings.get(key)

    @converter.register_torch_lowering(key, allow_override=True)
    def swapped(values_map, node, loc):
        return list(reversed(list(builtin(values_map, node, loc))))

    found = find_divergence(Split(), (torch.randn(2, 8),), converter=converter)
    assert found is not None and found.op == key and found.result == 0
    assert [i.name for i in found.inputs] == ["exp"]
    assert "result 0 float32 (2, 4)" in str(found)
