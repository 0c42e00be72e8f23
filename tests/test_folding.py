"""Conversion-time constant folding (input-independent values are computed by PyTorch) and
``optimize()`` storing weights transposed."""

from __future__ import annotations

import re

import numpy as np
import torch
import torch.nn as nn

from coreai_torch import TorchConverter
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.runtime import run_program
from coreai_torch.verify import verify


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


def test_folding_can_be_switched_off() -> None:
    model, x = MaskedScores().eval(), torch.randn(2, 8, 64)
    program = _program(model, x, TorchConverter(fold_constants=False))
    assert "coreai.scan" in str(program)  # the mask's cumsum is computed at run time
    assert verify(model, (x,), program=program.optimize()).ok


def _run(program, x: torch.Tensor):
    return next(iter(run_program(program, {"x": x}).values()))


def test_optimize_stores_weights_read_transposed_transposed_once() -> None:
    model, x = MaskedScores().eval(), torch.randn(2, 8, 64)
    program = _program(model, x)
    # conversion is zero-copy: the parameter itself, transposed at run time
    assert "dense_resource<proj.weight>" in str(program)
    assert "coreai.transpose" in str(program)
    runtime_transpose = _run(_program(model, x).optimize(transpose_weights=False), x)
    text = str(program.optimize())
    # optimize() stores the weight transposed, instead of (not next to) the original
    assert "dense_resource<proj.weight.T> : tensor<64x64xf32>" in text
    assert "dense_resource<proj.weight>" not in text
    (transposed,) = re.findall(r"coreai\.transpose (%\w+)", text)
    assert transposed == "%arg0"  # only the activation's x.transpose(1, 2) is left
    np.testing.assert_array_equal(_run(program, x), runtime_transpose)  # same numerics
    assert "proj.weight.T" in str(program.optimize())  # idempotent
    assert verify(model, (x,), program=program).ok


class TiedHead(nn.Module):
    """An output projection tied to the embedding table (GPT-2 style)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 32)
        self.proj = nn.Linear(32, 32, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.embed(ids))
        return h @ self.embed.weight.t()


def test_a_tied_embedding_table_is_stored_transposed_and_looked_up_by_column() -> None:
    model, ids = TiedHead().eval(), torch.randint(0, 100, (2, 5))
    converter = TorchConverter().add_exported_program(export_decomposed(model, (ids,)))
    program = converter.to_coreai().optimize()
    text = str(program)
    assert "dense_resource<embed.weight>" not in text and "coreai.gather_nd" not in text
    assert "dense_resource<embed.weight.T> : tensor<32x100xf32>" in text
    assert "coreai.gather_along_axis" in text
    reference = converter.to_coreai().optimize(transpose_weights=False)
    assert "coreai.gather_nd" in str(reference)
    (expected,) = run_program(reference, {"ids": ids}).values()
    (actual,) = run_program(program, {"ids": ids}).values()
    np.testing.assert_array_equal(actual, expected)


class BothWays(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + x @ self.proj.weight


def test_a_weight_also_read_directly_keeps_its_run_time_transpose() -> None:
    model, x = BothWays().eval(), torch.randn(2, 32)
    program = TorchConverter().add_exported_program(export_decomposed(model, (x,)))
    text = str(program.to_coreai().optimize())
    # stored once, transposed at run time, rather than stored twice
    assert "dense_resource<proj.weight>" in text and "proj.weight.T" not in text
    assert text.count("coreai.transpose") == 1


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
