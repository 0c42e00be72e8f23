"""Keep weights stored in their own (smaller) type through ``AIProgram.optimize()``.

Core AI's pre-compilation rewrite constant-folds ``cast(constant)``: a float16 weight read in
float32 (16-bit products accumulate in float32, :mod:`coreai_torch.lowerings.accumulation`)
or an int8 weight read as float would be stored converted, in float32 -- twice or four times
its size in the asset.  :func:`keep_weight_casts` installs a folding hook on the program's
context that leaves casts of weights (resource constants) to run time.
"""

from __future__ import annotations

from typing import Any

from coreai_torch._mlir import ir

try:
    from coreai._compiler._mlir_libs._coreaiIR._bindings.mlir.dialects.coreai import (
        register_should_const_folding_hook,
    )
except ImportError:  # pragma: no cover - every supported coreai-core has it
    register_should_const_folding_hook = None


def _reads_weight(op: Any) -> bool:
    """Whether ``op`` is a cast of a resource constant (a weight)."""
    op = op.operation if hasattr(op, "operation") else op
    if op.name != "coreai.cast" or len(op.operands) != 1:
        return False
    source = op.operands[0].owner
    if isinstance(source, ir.Block):
        return False
    source = source.operation if hasattr(source, "operation") else source
    if source.name != "coreai.constant" or "value" not in source.attributes:
        return False
    return ir.DenseResourceElementsAttr.isinstance(source.attributes["value"])


def keep_weight_casts(context: ir.Context) -> None:
    """Make the rewrite leave ``cast(weight)`` unfolded in ``context``'s programs."""
    if register_should_const_folding_hook is not None:
        register_should_const_folding_hook(
            callable=lambda op: not _reads_weight(op), context=context
        )
