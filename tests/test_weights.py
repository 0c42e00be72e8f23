"""Weights enter the program as zero-copy resources over the tensors' own memory."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn

from coreai_torch import TorchConverter
from coreai_torch.runtime import run_program
from coreai_torch.verify import export_decomposed


def test_weights_are_resources_over_the_tensor_memory() -> None:
    model = nn.Linear(64, 32, bias=False).eval()
    x = torch.randn(3, 64)
    program = TorchConverter().add_exported_program(export_decomposed(model, (x,))).to_coreai()
    assert "dense_resource<" in program.to_mlir()
    before = run_program(program, {"input": x})
    # No copy was taken: a change to the parameter's memory is what the saved program holds.
    with torch.no_grad():
        model.weight.mul_(-2.0)
    after = run_program(program, {"input": x})
    (name,) = before
    np.testing.assert_allclose(after[name], -2.0 * before[name], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(after[name], model(x).detach().numpy(), rtol=1e-5, atol=1e-5)


def test_a_weight_used_by_two_entry_points_is_stored_once() -> None:
    model = nn.Linear(64, 64).eval()
    converter = TorchConverter()
    for name, batch in (("one", 1), ("four", 4)):
        ep = export_decomposed(model, (torch.randn(batch, 64),))
        converter.add_exported_program(ep, entrypoint_name=name)
    text = converter.to_coreai().to_mlir()
    resources = {
        line.split("dense_resource<")[1].split(">")[0]
        for line in text.splitlines()
        if "dense_resource<" in line
    }
    assert resources == {"weight", "bias"}  # not weight_1 / bias_1 for the second entry point


class SequenceFirstLinear(nn.Module):
    """``nn.Linear`` on a transposed 3-D input: ``torch.matmul`` expands the weight to a batch
    of copies for ``bmm`` (as ``nn.MultiheadAttention``'s packed input projection does)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x.transpose(0, 1))


def test_a_weight_expanded_for_a_batch_matmul_is_stored_once_transposed() -> None:
    """The matmul broadcasts the weight itself (no batch of copies folded into the asset), and
    optimize() stores it transposed under its own name; the numbers stay right (a rewrite
    fold of a transposed weight's placeholder once gave garbage here)."""
    model = SequenceFirstLinear().eval()
    x = torch.randn(2, 10, 64)
    ep = export_decomposed(model, (x,))
    assert any(n.target == torch.ops.aten.expand.default for n in ep.graph.nodes)
    program = TorchConverter().add_exported_program(ep).to_coreai().optimize()
    text = program.to_mlir()
    assert "dense_resource<proj.weight.T> : tensor<64x96xf32>" in text
    assert "dense_resource<resource_" not in text  # no anonymous (folded) copy of a weight
    (out,) = run_program(program, {"x": x}).values()
    np.testing.assert_allclose(out, model(x).detach().numpy(), rtol=1e-5, atol=1e-5)
