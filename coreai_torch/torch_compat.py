"""Everything that depends on the installed torch version, in one place.

coreai-torch supports the torch releases ``pyproject.toml`` admits (:data:`TESTED_TORCH`), each
verified by ``make test-compat`` (docs/compatibility.md).  Where releases differ in something
the converter relies on (export APIs, decomposition table entries, FX node metadata, warnings
from torch's own code), the difference is handled here, with a comment naming the version; the
rest of the package uses the result and never compares torch versions itself.
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.export import ExportedProgram

aten = torch.ops.aten

#: Oldest and newest torch minor release verified; pyproject.toml says ``torch>=2.12,<2.15``
#: (tests/test_torch_compat.py keeps the two in step).
TESTED_TORCH: tuple[tuple[int, int], tuple[int, int]] = ((2, 12), (2, 14))

#: Ops that a newer torch added to ``torch.export.default_decompositions()`` although the
#: converter lowers them natively.  ``get_decomp_table()`` keeps them whole on every version,
#: so a model converts to the same program whichever torch the user has.
#: - torch 2.14 decomposes ``linalg_vector_norm`` (``torch.norm``, ``F.normalize``) into
#:   abs/pow/sum; 2.12 and 2.13 keep it.
NATIVE_OPS_DECOMPOSED_BY_NEWER_TORCH: tuple[torch._ops.OpOverload, ...] = (
    aten.linalg_vector_norm.default,
)

#: Warnings torch raises from its own code, which users of the converter cannot act on.
#: - torch 2.12 deprecated ``isinstance(treespec, LeafSpec)`` (a FutureWarning) and its own
#:   ``ExportedProgram.run_decompositions()`` triggers it when it deep-copies the module call
#:   graph (still so in 2.13 and 2.14).
TORCH_INTERNAL_WARNINGS: tuple[tuple[type[Warning], str], ...] = (
    (FutureWarning, r".*isinstance\(treespec, LeafSpec\)"),
)


def torch_version(version: str | None = None) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string (default: the installed torch), e.g.
    ``"2.14.1+cu130"`` -> ``(2, 14)``, ``"2.15.0.dev20260101"`` -> ``(2, 15)``."""
    text = torch.__version__ if version is None else version
    match = re.match(r"(\d+)\.(\d+)", str(text))
    if match is None:
        raise ValueError(f"not a torch version: {text!r}")
    return int(match[1]), int(match[2])


#: torch 2.14 computes ``torch.combinations`` with ``nonzero_static`` (a fixed size), which
#: ``torch.export`` exports and the converter converts; 2.12 and 2.13 select the pairs with
#: ``masked_select``, whose size depends on the values: ``torch.export`` cannot export it.
EXPORTS_COMBINATIONS: bool = torch_version() >= (2, 14)


def untested_torch_message(version: str | None = None) -> str | None:
    """Why ``version`` (default: the installed torch) is outside :data:`TESTED_TORCH`, or None."""
    text = torch.__version__ if version is None else version
    oldest, newest = TESTED_TORCH
    if oldest <= torch_version(text) <= newest:
        return None
    return (
        f"coreai-torch is tested with torch {oldest[0]}.{oldest[1]} to {newest[0]}.{newest[1]}; "
        f"torch {text} is installed, conversion may fail or differ "
        "(`make test-compat TORCH=...` checks a version)"
    )


def warn_if_untested_torch() -> None:
    """A ``UserWarning`` when the installed torch is outside the tested range (called once, at
    import: pip keeps such a torch out, but ``--no-deps`` or a source checkout do not)."""
    message = untested_torch_message()
    if message is not None:
        warnings.warn(message, UserWarning, stacklevel=2)


def _lstm_layer_with_batch_shaped_states(one_layer_lstm: Callable[..., Any]) -> Callable[..., Any]:
    """torch 2.12's decomposition of ``aten.lstm.input`` (which ``torch.export`` also uses to
    trace the op's output shapes) squeezes each layer's final ``(1, batch, hidden)`` states
    on dimension 1 instead of 0: for a batch > 1 the exported program's ``h_n``/``c_n`` get
    an extra dimension that eager PyTorch does not have.  torch 2.13 squeezes dimension 0;
    this wrapper gives 2.12 the same result (shapes of a batch of 1 were already right)."""

    @functools.wraps(one_layer_lstm)
    def one_layer(*args: Any, **kwargs: Any) -> Any:
        out, (hx, cx) = one_layer_lstm(*args, **kwargs)
        if hx.dim() == 3:
            hx, cx = hx.squeeze(0), cx.squeeze(0)
        return out, (hx, cx)

    one_layer.backported = True  # type: ignore[attr-defined]
    return one_layer


def _backport_fixes() -> None:
    """Fixes of later torch releases applied to an older installed torch (at import)."""
    if torch_version() == (2, 12):
        from torch._decomp import decompositions

        if not getattr(decompositions.one_layer_lstm, "backported", False):
            decompositions.one_layer_lstm = _lstm_layer_with_batch_shaped_states(
                decompositions.one_layer_lstm
            )


def ignore_torch_internal_warnings() -> None:
    """Hide :data:`TORCH_INTERNAL_WARNINGS` for the rest of the process (the command line)."""
    for category, message in TORCH_INTERNAL_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


#: Loggers whose warnings at import time users of the command line cannot act on:
#: - ``torchao`` (imported by ``transformers``) reports each optional CUDA kernel library it
#:   cannot load on a CPU-only machine ("Failed to load ..._C_cutlass_90a.abi3.so");
#: - torch 2.13's ``torch.utils._pytree`` warns that ``register_constant()`` on an Enum (which
#:   torchao calls for its own enums) is deprecated.
IMPORT_NOISE_LOGGERS = ("torchao", "torch.utils._pytree")


def quiet_import_noise() -> None:
    """Raise :data:`IMPORT_NOISE_LOGGERS` to ERROR for the rest of the process (the command
    line, unless ``--debug``)."""
    import logging

    for name in IMPORT_NOISE_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def run_decompositions(ep: ExportedProgram, table: Mapping[Any, Any] | None) -> ExportedProgram:
    """``ep.run_decompositions(table)`` without :data:`TORCH_INTERNAL_WARNINGS`."""
    with warnings.catch_warnings():
        ignore_torch_internal_warnings()
        return ep.run_decompositions(table)


_backport_fixes()
