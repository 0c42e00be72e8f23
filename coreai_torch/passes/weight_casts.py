"""Keep weights stored in their own (smaller) type, under their own name, through
``optimize()`` and saving.

Core AI constant-folds ``cast(constant)``, in the pre-compilation rewrite and when an asset is
serialised: a float16 weight read in float32 (16-bit products accumulate in float32,
:mod:`coreai_torch.lowerings.accumulation`), an int8 weight read as float, or the float16
scales of a compressed weight would be stored converted -- two to four times their size in the
asset.  It also folds ``transpose(constant)`` of float16 weights (and of the stacked weights of
mixture-of-experts layers) into anonymous copies: the weight then loses its name, so
``compress()`` no longer finds it, and conversion holds a second, transposed copy of it
(:mod:`coreai_torch.passes.pretranspose` stores such weights transposed by name instead,
made as the asset is written).

:func:`keeps_weight_casts` is a fold guard (:data:`coreai_torch._mlir.FOLD_GUARDS`, consulted
in every context the project creates) that leaves casts and transposes of weights (resource
constants) to run time, or to ``pretranspose``.
"""

from __future__ import annotations

from coreai_torch._mlir import FOLD_GUARDS, ir

#: ops on a weight that are never folded into a new constant
_KEPT = frozenset({"coreai.cast", "coreai.transpose"})


def keeps_weight_casts(op: ir.Operation) -> bool:
    """False (do not fold) for a ``cast`` or ``transpose`` of a resource constant (a weight)."""
    op = getattr(op, "operation", op)
    if op.name not in _KEPT or not op.operands:
        return True
    source = op.operands[0].owner
    if isinstance(source, ir.Block):
        return True
    source = getattr(source, "operation", source)
    if source.name != "coreai.constant" or "value" not in source.attributes:
        return True
    return not ir.DenseResourceElementsAttr.isinstance(source.attributes["value"])


FOLD_GUARDS.append(keeps_weight_casts)
