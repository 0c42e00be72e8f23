"""The one place that imports coreai-core's MLIR layers.

``coreai.authoring`` must be imported before ``coreai._compiler.dialects.coreai`` (the other
order fails with a circular import), so every module of this package takes ``ca``, ``ir`` and
``cai`` from here.
"""

from __future__ import annotations

from collections.abc import Callable

import coreai.authoring as ca
from coreai._compiler import ir
from coreai._compiler._mlir_libs._coreaiIR._bindings.compiler import (
    run_pre_compilation_rewrite,
    serialize_module_to_bytecode,
)
from coreai._compiler._mlir_libs._coreaiIR._bindings.mlir import clone_module
from coreai._compiler._mlir_libs._coreaiIR._bindings.mlir.dialects.coreai import (
    register_should_const_folding_hook,
)
from coreai._compiler.dialects import coreai as cai

__all__ = [
    "FOLD_GUARDS",
    "ca",
    "cai",
    "clone_module",
    "ir",
    "new_context",
    "run_pre_compilation_rewrite",
    "serialize_module_to_bytecode",
]

#: Predicates ``guard(op) -> bool`` asked before Core AI constant-folds ``op`` (in
#: ``optimize()``'s rewrite and when an asset is saved): any guard returning False keeps the
#: op.  They must not raise (an exception would abort the rewrite).  Modules append theirs
#: at import time, e.g. :func:`coreai_torch.passes.weight_casts.keeps_weight_casts`.
FOLD_GUARDS: list[Callable[[ir.Operation], bool]] = []


def _should_fold(op: ir.Operation) -> bool:
    try:
        return all(guard(op) for guard in FOLD_GUARDS)
    except Exception:  # a guard bug must not abort the rewrite; folding is always correct
        return True


def new_context() -> ir.Context:
    """A fresh MLIR context with the Core AI dialects registered and :data:`FOLD_GUARDS`
    consulted before constant folding."""
    context = ca.Context()._mlir_context
    register_should_const_folding_hook(callable=_should_fold, context=context)
    return context
