"""``get_decomp_table()`` and the check that a program was decomposed."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.export import ExportedProgram

from coreai_torch.errors import NotDecomposedError
from coreai_torch.frontend import hints
from coreai_torch.torch_compat import NATIVE_OPS_DECOMPOSED_BY_NEWER_TORCH, run_decompositions

aten = torch.ops.aten

#: ATen ops the converter lowers as composite ops, so decomposition must keep them.
COMPOSITE_OPS: tuple[torch._ops.OpOverload, ...] = (
    aten.layer_norm.default,
    aten.rms_norm.default,
    aten.instance_norm.default,
    aten.group_norm.default,
    aten.pixel_shuffle.default,
    aten.scaled_dot_product_attention.default,
)


#: ATen ops lowered natively to better Core AI IR than PyTorch's decompositions give (e.g.
#: ``pad`` modes and ``interpolate`` instead of index arithmetic and gathers).
NATIVE_OPS: tuple[torch._ops.OpOverload, ...] = (
    *(
        getattr(aten, f"{kind}_pad{k}d").default
        for kind in ("reflection", "replication")
        for k in (1, 2, 3)
    ),
    *(getattr(aten, f"upsample_nearest{k}d").vec for k in (1, 3)),
    *(getattr(aten, f"_upsample_nearest_exact{k}d").vec for k in (1, 2, 3)),
    aten.upsample_linear1d.vec,
    aten.upsample_trilinear3d.vec,
    aten.upsample_bicubic2d.vec,
    aten._upsample_bilinear2d_aa.vec,
    aten._upsample_bicubic2d_aa.vec,
    aten.roll.default,
    aten.select_scatter.default,
    # solvers whose decompositions add error checks as effects (token inputs) to the program
    aten.linalg_cholesky.default,
    aten.linalg_inv.default,
    aten.linalg_solve.default,
    aten.linalg_lu_factor.default,
    aten.linalg_ldl_factor.default,
    aten.linalg_tensorinv.default,
    # constants computed by PyTorch itself at conversion time
    aten.linspace.default,
    aten.logspace.default,
    aten.eye.default,
    aten.eye.m,
    # decomposed only by newer torch releases (see torch_compat)
    *NATIVE_OPS_DECOMPOSED_BY_NEWER_TORCH,
)


def _adaptive_avg_pool2d(x: torch.Tensor, output_size: list[int]) -> torch.Tensor:
    # ATen rewrites a (1, 1) output to `mean` before export sees it; keep the pooling op so
    # that one lowering (built-in or a user's override) handles every output size.
    pooled: torch.Tensor = aten._adaptive_avg_pool2d.default(x, output_size)
    return pooled


#: Recurrent layers, lowered as one loop over time per layer (lowerings/recurrent.py) instead
#: of PyTorch's decomposition, which unrolls every time step.
RECURRENT_OPS: tuple[torch._ops.OpOverload, ...] = (
    aten.lstm.input,
    aten.gru.input,
    aten.rnn_tanh.input,
    aten.rnn_relu.input,
)


#: Quantization ops lowered to Core AI's compressed weights (lowerings/quantized.py), by
#: (namespace, name): they exist only once torchao is imported, which the converter never
#: does itself (torchao is optional).
QUANTIZATION_OPS: tuple[tuple[str, str], ...] = (
    ("torchao", "dequantize_affine"),
    ("quant", "dequantize_codebook"),
)


def _registered(namespace: str, name: str) -> torch._ops.OpOverload | None:
    """``torch.ops.<namespace>.<name>.default`` if a library registered it, else None."""
    try:
        op: torch._ops.OpOverload = getattr(getattr(torch.ops, namespace), name).default
        return op
    except (AttributeError, RuntimeError):
        return None


#: Decompositions that replace PyTorch's own for these ops.
DECOMPOSITION_REPLACEMENTS: dict[torch._ops.OpOverload, Callable[..., Any]] = {
    aten.adaptive_avg_pool2d.default: _adaptive_avg_pool2d,
}


def get_decomp_table() -> dict[torch._ops.OperatorBase, Callable[..., Any]]:
    """PyTorch's default decomposition table minus the ops lowered as composite ops (and the
    ops lowered natively, see ``NATIVE_OPS``; torchao's dequantization ops when torchao is
    loaded, see ``QUANTIZATION_OPS``).

    Use it with ``ExportedProgram.run_decompositions()``; every call returns a fresh copy, so
    mutating it affects nobody else.
    """
    table = dict(torch.export.default_decompositions().items())
    for op in (*COMPOSITE_OPS, *NATIVE_OPS):
        table.pop(op, None)
    for op in RECURRENT_OPS:
        table.pop(op, None)
    for namespace, name in QUANTIZATION_OPS:
        registered = _registered(namespace, name)
        if registered is not None:
            table.pop(registered, None)
    table.update(DECOMPOSITION_REPLACEMENTS)
    return table


def check_decomposed(ep: ExportedProgram) -> None:
    """Raise :class:`NotDecomposedError` if ``run_decompositions()`` was not called on ``ep``."""
    dialects = {getattr(v, "dialect", None) for v in getattr(ep, "verifiers", [])}
    if "TRAINING" in dialects:
        raise NotDecomposedError(
            "the exported program has not been decomposed: it is still in torch.export's "
            "training IR. Call run_decompositions() with the converter's table first:\n"
            "    ep = torch.export.export(model, args).run_decompositions("
            "coreai_torch.get_decomp_table())\n"
            "(with add_pytorch_module, do this inside export_fn)."
        )


def export_decomposed(
    model: nn.Module,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None = None,
    *,
    dynamic_shapes: Any = None,
    strict: bool = False,
) -> ExportedProgram:
    """``torch.export`` + ``run_decompositions(get_decomp_table())`` in one call.  A failure
    with a known fix in the project (:mod:`~coreai_torch.frontend.hints`) carries it as a
    note."""
    try:
        ep = torch.export.export(
            model, tuple(args), dict(kwargs or {}), dynamic_shapes=dynamic_shapes, strict=strict
        )
    except Exception as error:
        hints.add_note(error, hints.for_export_failure(model, error))
        raise
    return run_decompositions(ep, get_decomp_table())


def is_decomposed(ep: ExportedProgram) -> bool:
    """Whether ``run_decompositions()`` was called on ``ep`` (it is no longer training IR)."""
    try:
        check_decomposed(ep)
    except NotDecomposedError:
        return False
    return True


def decomposed(ep: ExportedProgram) -> tuple[ExportedProgram, bool]:
    """``ep`` decomposed with ``get_decomp_table()`` unless it already is; and whether it had
    to be."""
    if is_decomposed(ep):
        return ep, False
    return run_decompositions(ep, get_decomp_table()), True
