"""``program.compress(compression.Pruning(...))``: magnitude pruning, the weights stored sparse
(kept values + a 1-bit mask: ``build_sparse_with_bitmask`` + ``sparse_with_bitmask_to_dense``)."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

from coreai_torch import TorchConverter, compression
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.ir.weights import PendingDerived
from coreai_torch.runtime import Session
from coreai_torch.tensors import lazy
from tests.helpers import asset_bytes


class _Model(nn.Module):
    """An embedding table, two linear layers and a head tied to the table."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(128, 64)
        self.up, self.down = nn.Linear(64, 256), nn.Linear(256, 64)
        self.head = nn.Linear(64, 128, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        return self.head(x + self.down(torch.relu(self.up(x))))


def _pruned(model: nn.Module, sparsity: float) -> nn.Module:
    """The model with each matrix's smallest-magnitude fraction set to zero."""
    pruned = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in pruned.parameters():
            if parameter.dim() == 2:
                magnitude = parameter.abs().reshape(-1)
                drop = int(magnitude.numel() * sparsity)
                threshold = magnitude.kthvalue(drop).values
                parameter.masked_fill_(parameter.abs() <= threshold, 0.0)
    return pruned


def _run(program, ids: torch.Tensor) -> np.ndarray:
    with Session(program) as session:
        (out,) = session.run({"ids": ids.numpy()}).values()
    return out


@pytest.mark.parametrize("optimize_first", [False, True], ids=["compress_first", "optimize_first"])
@pytest.mark.parametrize("sparsity", [0.5, 0.75])
def test_pruning_matches_the_pruned_model(sparsity: float, optimize_first: bool) -> None:
    model = _Model().eval()
    ids = torch.randint(0, 128, (1, 12))
    program = TorchConverter().add_exported_program(export_decomposed(model, (ids,))).to_coreai()
    fp32 = asset_bytes(program)
    if optimize_first:
        program.optimize()
    report = program.compress(compression.Pruning(sparsity=sparsity, min_elements=1024))
    if not optimize_first:
        program.optimize()
    names = sorted(w.name for w in report.weights)
    assert len(names) == 3 and {"down.weight", "up.weight"} < set(names)  # + the tied table
    assert all(w.form == f"{sparsity:.0%} sparse (magnitude)" for w in report.weights)
    with torch.no_grad():
        expected = _pruned(model, sparsity)(ids).numpy()
    np.testing.assert_allclose(_run(program, ids), expected, rtol=1e-5, atol=1e-5)
    text = program.to_mlir()
    assert text.count("coreai.sparse_with_bitmask_to_dense") >= 3
    assert "up.weight.mask" in text
    # kept values + one bit per element; the biases stay as they are
    assert asset_bytes(program) < (1 - sparsity + 1 / 32 + 0.05) * fp32


def test_pruning_a_half_precision_program() -> None:
    model = _Model().eval()
    ids = torch.randint(0, 128, (1, 12))
    ep = export_decomposed(model, (ids,))
    program = TorchConverter(compute_precision=torch.float16).add_exported_program(ep).to_coreai()
    program.compress(compression.Pruning(min_elements=1024))
    program.optimize()
    with torch.no_grad():
        expected = _pruned(model, 0.5)(ids).numpy()
    out = _run(program, ids).astype(np.float32)
    assert np.abs(out - expected).max() <= 1e-2 * max(1.0, float(np.abs(expected).max()))
    assert "dense_resource<up.weight.values> : tensor<8192xf16>" in program.to_mlir()


def test_pruned_weights_are_not_compressed_again() -> None:
    model = _Model().eval()
    ids = torch.randint(0, 128, (1, 12))
    program = TorchConverter().add_exported_program(export_decomposed(model, (ids,))).to_coreai()
    program.compress(compression.Pruning(min_elements=1024))
    again = program.compress(compression.LinearQuantization(bits=8, min_elements=1024))
    assert not again.weights
    assert {reason for _, reason in again.skipped} == {"already compressed"}


def test_pruning_configuration() -> None:
    assert compression.from_spec("sparse50") == compression.Pruning(sparsity=0.5)
    assert compression.from_spec("sparse75").describe() == "75% sparse (magnitude)"
    with pytest.raises(ValueError, match=r"fraction in \(0, 1\), got 1\.5"):
        compression.Pruning(sparsity=1.5)
    with pytest.raises(ValueError, match="unknown compression 'sparse'"):
        compression.from_spec("sparse")


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))


def test_pruning_lazy_weights_keeps_no_sparse_data(tmp_path: Path) -> None:
    """Weights still in their checkpoint are read once to be pruned; the kept values and the
    mask wait in a temporary file until the asset is written instead of being held."""
    torch.manual_seed(0)
    model = _mlp().eval()
    save_file(model.state_dict(), str(tmp_path / "model.safetensors"))
    with lazy.empty_parameters():
        streamed = _mlp()
    lazy.WeightSource(tmp_path).bind(streamed).eval()
    x = torch.randn(3, 64)
    program = TorchConverter().add_exported_program(export_decomposed(streamed, (x,))).to_coreai()
    report = program.compress(compression.Pruning(min_elements=1024))
    assert sorted(w.name for w in report.weights) == ["0.weight", "2.weight"]
    deferred = {
        entry.name
        for entry in program.weights.pending.values()
        if isinstance(entry, PendingDerived)
    }
    assert {"0.weight.values", "0.weight.mask", "2.weight.values", "2.weight.mask"} <= deferred
    program.optimize().save_asset(tmp_path / "m.aimodel")
    with Session(str(tmp_path / "m.aimodel")) as session:
        (out,) = session.run({"input": x.numpy()}).values()
    with torch.no_grad():
        expected = _pruned(model, 0.5)(x).numpy()
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
