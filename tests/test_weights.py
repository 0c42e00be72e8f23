"""Weights enter the program as zero-copy resources over the tensors' own memory."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from safetensors.torch import save_file

from coreai_torch import TorchConverter
from coreai_torch._mlir import clone_module, ir
from coreai_torch.compression import LinearQuantization
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.ir.weights import PendingLazy, resource_name
from coreai_torch.passes.pretranspose import is_dynamic_gather, pretranspose_weights
from coreai_torch.program import AIProgram
from coreai_torch.runtime import run_program
from coreai_torch.tensors import lazy


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


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))


def _constant_data(module: ir.Module) -> dict[str, np.ndarray]:
    """Resource name -> float32 data of every weight constant, read through MLIR the way
    outside tools read it (coreai-core's ``copy_constant_value_to_array``)."""
    from coreai._compiler._mlir_libs._coreaiIR import _bindings

    found: dict[str, np.ndarray] = {}

    def visit(op: ir.Operation) -> ir.WalkResult:
        name = resource_name(op)
        if name is not None:
            ttype = ir.RankedTensorType(op.result.type)
            data = np.zeros(math.prod(ttype.shape) * 4, np.uint8)
            _bindings.compiler.copy_constant_value_to_array(constant_op=op, destination=data)
            found[name] = data.view(np.float32).reshape(ttype.shape)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return found


def test_outside_code_reading_the_module_sees_the_data_of_lazy_weights(tmp_path: Path) -> None:
    """``program._module`` (what coreai-core's own methods and outside tools, e.g. coreai-opt's
    passes, read) makes the data of the lazy weights the program still reads from their
    checkpoint; the program's own structural reads leave them pending."""
    torch.manual_seed(0)
    model = _mlp().eval()
    save_file(model.state_dict(), str(tmp_path / "model.safetensors"))
    with lazy.empty_parameters():
        streamed = _mlp()
    lazy.WeightSource(tmp_path).bind(streamed).eval()
    x = torch.randn(2, 64)
    program = TorchConverter().add_exported_program(export_decomposed(streamed, (x,))).to_coreai()
    program.optimize()
    store = program.weights
    assert store is not None
    pending = {e.name: e for e in store.pending.values()}
    assert set(pending) == {"0.weight.T", "0.bias", "2.weight.T"}  # 2.bias is folded in
    assert all(isinstance(e, PendingLazy) for e in pending.values())
    # reading the program's structure, printing it or copying it keeps them in the checkpoint
    _ = program.function_names, str(program), program.verify()
    duplicate = copy.deepcopy(program)
    assert set(pending) == {e.name for e in store.pending.values()}

    data = _constant_data(program._module._mlir_module)  # as an outside tool reads it
    assert not store.pending
    np.testing.assert_array_equal(data["0.weight.T"], model[0].weight.detach().T.numpy())
    np.testing.assert_array_equal(data["2.weight.T"], model[2].weight.detach().T.numpy())
    with torch.no_grad():
        expected = model(x).numpy()
    for candidate in (program, duplicate):
        (out,) = run_program(candidate, {"input": x}).values()
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
