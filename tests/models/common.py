"""Shared pieces of the model-family tests: weight re-drawing, tensor-in/tensor-out wrappers
and the model tolerance rule ``|err| <= 1e-4 * max(1, max|ref|)``.

Every model is built from a small config with random weights; nothing is downloaded.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from coreai_torch import TorchConverter
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.verify import VerifyReport, eager_outputs, verify
from tests.helpers import check_module

# Model classes are built from configs only; make any attempt to reach the hub fail loudly.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

#: The size of every transformer stack in the model tests (BERT/ViT/CLIP-style config names).
SMALL_TRANSFORMER = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128
)

#: The relative tolerance of the model tests: 1e-4 of the largest reference magnitude (≥ 1).
MODEL_TOLERANCE = 1e-4

_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def redraw_weights(model: nn.Module, gain: float = 1.0, embedding_std: float = 1.0) -> nn.Module:
    """Re-draw every parameter so activations stay O(1) through the network.

    Matrices and convolution kernels get ``N(0, gain² / fan_in)`` (``fan_in`` = all dimensions
    but the first), embedding tables ``N(0, embedding_std²)``, vectors (biases, norm scales)
    draws around their usual values, and batch-norm statistics non-trivial values — the
    default Hugging Face init (std 0.02) makes attention almost uniform, which hides bugs.
    """
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    norm_params = {
        id(p)
        for m in model.modules()
        if isinstance(m, _NORMS) or "norm" in type(m).__name__.lower()
        for p in m.parameters(recurse=False)
    }
    with torch.no_grad():
        for name, p in model.named_parameters():
            if id(p) in embeddings:
                p.normal_(0.0, embedding_std)
            elif id(p) in norm_params:
                if name.endswith("bias"):
                    p.uniform_(-0.2, 0.2)
                else:
                    p.uniform_(0.5, 1.5)
            elif p.dim() >= 2:
                p.normal_(0.0, gain / math.sqrt(p[0].numel()))
            elif p.dim() == 1:
                p.uniform_(-0.2, 0.2)
            else:
                p.normal_(0.0, 1.0)
        for m in model.modules():
            if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 1.5)
    return model


class Call(nn.Module):
    """``forward(*tensors)`` calls ``fn(model, *tensors)`` and returns only tensors.

    Lets a test export a Hugging Face model whose forward takes keyword arguments and returns
    a ``ModelOutput``: ``Call(model, lambda m, ids: m(input_ids=ids, return_dict=False)[0])``.
    """

    def __init__(self, model: nn.Module, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.model = model
        self.fn = fn

    def forward(self, *args: torch.Tensor) -> Any:
        return self.fn(self.model, *args)


def model_tolerance(reference: Sequence[Any]) -> float:
    """``1e-4 * max(1, max|ref|)`` over all floating-point reference outputs."""
    peak = max(
        (float(r.detach().abs().max()) for r in reference if torch.is_floating_point(r)),
        default=0.0,
    )
    return MODEL_TOLERANCE * max(1.0, peak)


def check_model(
    model: nn.Module,
    args: Sequence[Any],
    *,
    min_peak: float | None = 1.0,
) -> VerifyReport:
    """Convert ``model`` and check it on the runtime with the model tolerance rule.

    ``min_peak`` guards the test itself: the largest reference magnitude must exceed it, so
    outputs are not trivially small (``None`` for outputs that are bounded, e.g. probabilities).
    """
    model = model.eval()
    reference = [r for r in eager_outputs(model, args) if isinstance(r, torch.Tensor)]
    peak = max(float(r.detach().abs().max()) for r in reference if torch.is_floating_point(r))
    assert math.isfinite(peak), "reference output is not finite"
    if min_peak is not None:
        assert peak > min_peak, f"reference outputs too small to test (max|ref| = {peak:.3g})"
    tol = model_tolerance(reference)
    report = check_module(model, args, atol=tol, rtol=0.0)
    print(f"max|ref| {peak:.3g}  max|err| {report.max_abs:.3e}  tolerance {tol:.3e}")
    record_errors(peak, report.max_abs, tol)
    return report


def check_model_dynamic(
    model: nn.Module, runs: Sequence[Sequence[Any]], dynamic_shapes: Any
) -> list[VerifyReport]:
    """Export ``model`` once with ``dynamic_shapes`` (example: ``runs[0]``), convert it, and
    check every argument tuple of ``runs`` on the runtime with the model tolerance rule."""
    model = model.eval()
    ep = export_decomposed(model, runs[0], dynamic_shapes=dynamic_shapes)
    program = TorchConverter().add_exported_program(ep).to_coreai()
    program.optimize()
    reports = []
    for args in runs:
        tol = model_tolerance([r for r in eager_outputs(model, args) if torch.is_tensor(r)])
        report = verify(model, args, program=program, atol=tol, rtol=0.0)
        shapes = [tuple(a.shape) for a in args]
        assert report.ok, f"mismatch for inputs of shapes {shapes}:\n{report}"
        print(f"shapes {shapes}  max|err| {report.max_abs:.3e}  tolerance {tol:.3e}")
        reports.append(report)
    return reports


def record_errors(peak: float, max_abs: float, tol: float) -> None:
    """Append the errors to the JSON-lines file named by ``COREAI_MODEL_ERRORS`` (if set)."""
    path = os.environ.get("COREAI_MODEL_ERRORS")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        row = {"test": test, "max_ref": peak, "max_err": max_abs, "tolerance": tol}
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def flat_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a nested output (tuples, lists, dicts, ModelOutputs)."""
    return [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]
