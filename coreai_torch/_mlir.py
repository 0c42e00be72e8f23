"""The one place that imports coreai-core's MLIR layers.

``coreai.authoring`` must be imported before ``coreai._compiler.dialects.coreai`` (the other
order fails with a circular import), so every module of this package takes ``ca``, ``ir`` and
``cai`` from here.
"""

from __future__ import annotations

import coreai.authoring as ca
from coreai._compiler import ir
from coreai._compiler._mlir_libs._coreaiIR._bindings.compiler import (
    run_pre_compilation_rewrite,
)
from coreai._compiler._mlir_libs._coreaiIR._bindings.mlir import clone_module
from coreai._compiler.dialects import coreai as cai

__all__ = ["ca", "cai", "clone_module", "ir", "new_context", "run_pre_compilation_rewrite"]


def new_context() -> ir.Context:
    """A fresh MLIR context with the Core AI dialects registered."""
    return ca.Context()._mlir_context
