"""Weights enter the program as zero-copy resources over the tensors' own memory."""

from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn as nn

from coreai_torch import TorchConverter
from coreai_torch._mlir import clone_module
from coreai_torch.compression import LinearQuantization
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.passes.pretranspose import is_dynamic_gather, pretranspose_weights
from coreai_torch.program import AIProgram
from coreai_torch.runtime import run_program


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


class GatherAndLookup(nn.Module):
    """A table read by a run-time gather through its transpose (as gathered experts are) and
    by an embedding lookup with constant indices (which Core AI's rewrite folds)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(300, 64)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        columns = self.table.weight.t().index_select(0, idx)
        rows = self.table(torch.tensor([3, 17, 250]))
        return columns[:, :64] + rows


def test_before_the_rewrite_only_weights_read_by_run_time_gathers_are_stored_transposed() -> None:
    """A weight stored transposed before Core AI's rewrite holds a placeholder, so nothing the
    rewrite can fold may read it: not the constant-index lookup of the same table."""
    torch.manual_seed(0)
    model = GatherAndLookup().eval()
    idx = torch.tensor([5, 9, 1])
    ep = export_decomposed(model, (idx,))
    program = TorchConverter(fold_constants=False).add_exported_program(ep).to_coreai()
    store = program.weights
    assert store is not None
    module = program.structural_module
    with module.context:
        candidate = clone_module(module=module)
    # what optimize() does before the rewrite: the table has a reader the rewrite can fold
    assert pretranspose_weights(candidate, store, transposes_read_by=is_dynamic_gather) == []
    assert not store.pending

    program.optimize()
    assert "dense_resource<table.weight.T>" in program.to_mlir()  # after the rewrite
    (out,) = run_program(program, {"idx": idx}).values()
    np.testing.assert_allclose(out, model(idx).detach().numpy(), rtol=1e-6, atol=1e-6)


def _optimized_mlp() -> tuple[AIProgram, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 128)).eval()
    x = torch.randn(2, 256)
    ep = export_decomposed(model, (x,))
    return TorchConverter().add_exported_program(ep).to_coreai().optimize(), model, x


def test_transposed_weights_replaced_by_compressed_ones_are_dropped_never_made() -> None:
    program, _, _ = _optimized_mlp()
    store = program.weights
    assert store is not None
    entries = {e.name: e for e in store.pending.values()}
    assert set(entries) == {"0.weight.T", "2.weight.T"}  # placeholders, made when saved
    program.compress(LinearQuantization(bits=8, weights=r"^0\."))
    assert {e.name for e in store.pending.values()} == {"2.weight.T"}
    _ = program.mlir_module  # makes the transposed weights the program still reads
    assert not store.pending
    assert torch.equal(entries["2.weight.T"].placeholder, entries["2.weight.T"].view)
    dropped = entries["0.weight.T"]
    assert not torch.equal(dropped.placeholder, dropped.view)  # no dead copy made


def test_a_copy_keeps_the_transposed_weights_its_original_dropped() -> None:
    program, model, x = _optimized_mlp()
    store = program.weights
    assert store is not None
    duplicate = copy.deepcopy(program)  # shares the store
    program.compress(LinearQuantization(bits=8, weights=r"^0\."))
    _ = program.mlir_module
    assert {e.name for e in store.pending.values()} == {"0.weight.T"}  # the copy reads it
    (out,) = run_program(duplicate, {"input": x}).values()
    np.testing.assert_allclose(out, model(x).detach().numpy(), rtol=1e-5, atol=1e-5)
    assert not store.pending
