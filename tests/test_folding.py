"""Conversion-time constant folding: input-independent values are computed by PyTorch."""

from __future__ import annotations

import torch
import torch.nn as nn

from coreai_torch import TorchConverter
from coreai_torch.verify import export_decomposed, verify


class MaskedScores(nn.Module):
    """Builds a causal mask and position ids from scratch, like Hugging Face decoders do."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        pos = torch.arange(t)
        mask = (pos[None, :] <= pos[:, None]).cumsum(-1) > 0
        scores = self.proj(x) @ x.transpose(1, 2)
        return scores.masked_fill(~mask, -1e4) + pos.float().sin()[None, :, None]


def _program(model: nn.Module, x: torch.Tensor, converter: TorchConverter | None = None):
    converter = converter or TorchConverter()
    return converter.add_exported_program(export_decomposed(model, (x,))).to_coreai()


def test_input_independent_subgraph_becomes_one_constant() -> None:
    model, x = MaskedScores().eval(), torch.randn(2, 8, 64)
    program = _program(model, x)
    text = str(program)
    for op in ("coreai.scan", "coreai.sin", "coreai.decomposable.broadcasting_greater"):
        assert op not in text  # cumsum / sin / compare of the mask are computed at conversion
    assert verify(model, (x,), program=program.optimize()).ok


def test_large_weights_are_not_copied_into_folded_transposes() -> None:
    model, x = MaskedScores().eval(), torch.randn(2, 8, 64)
    text = str(_program(model, x))
    assert "dense_resource<proj.weight>" in text  # the weight itself, transposed at run time
    assert "coreai.transpose" in text


def test_user_override_of_an_aten_op_is_not_folded_away() -> None:
    from coreai_torch._mlir import cai

    calls = []
    converter = TorchConverter()

    @converter.register_torch_lowering("aten::sin.default", allow_override=True)
    def my_sin(values_map, node, loc):
        calls.append(node.name)
        return cai.sin(values_map[node.args[0].name], loc=loc)

    model, x = MaskedScores().eval(), torch.randn(2, 8, 64)
    program = _program(model, x, converter)
    assert calls == ["sin"]
    assert "coreai.sin" in str(program)
    assert verify(model, (x,), program=program).ok
