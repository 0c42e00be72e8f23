"""Keep weights stored in their own (smaller) type, under their own name, through
``optimize()`` and saving.

Core AI constant-folds ``cast(constant)``, in the pre-compilation rewrite and when an asset is
serialised: a float16 weight read in float32 (16-bit products accumulate in float32,
:mod:`coreai_torch.lowerings.helpers.accumulation`), an int8 weight read as float, or the float16
scales of a compressed weight would be stored converted -- two to four times their size in the
asset.  It also folds ``transpose(constant)`` of float16 weights (and of the stacked weights of
mixture-of-experts layers) into anonymous copies: the weight then loses its name, so
``compress()`` no longer finds it, and conversion holds a second, transposed copy of it
(:mod:`coreai_torch.passes.pretranspose` stores such weights transposed by name instead,
made as the asset is written).

:func:`keeps_weight_casts` is a fold guard (:data:`coreai_torch._mlir.FOLD_GUARDS`, consulted
in every context the project creates) that leaves casts and transposes of weights (resource
constants) to run time, or to ``pretranspose``.

Weights whose data is made when the asset is written (transposed weights, lazy weights still in
their checkpoint, the codes of lazy compressed weights: ``WeightStore.pending``) hold
placeholders until then.  :func:`keeps_pending_weights` never lets Core AI fold an op reading
one (it would compute from the placeholder's bytes), and :func:`make_folded_weights` makes the
ones an op the rewrite folds reads before it runs, so ``optimize()`` folds what it folds for
weights in memory.
"""

from __future__ import annotations

from coreai_torch._mlir import FOLD_GUARDS, ir
from coreai_torch.ir.values import operation
from coreai_torch.ir.weights import WeightStore, is_pending, resource_name

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


#: ops that decompress compressed weights: Core AI does not fold them (the weights would be
#: stored decompressed)
_DECOMPRESSIONS = frozenset(
    {
        "coreai.dequantize",
        "coreai.blockwise_shift_scale",
        "coreai.lut_to_dense",
        "coreai.sparse_with_bitmask_to_dense",
    }
)


def _constant_operands(op: ir.Operation) -> list[ir.Operation] | None:
    """The constants ``op`` reads, if every operand is one (else None)."""
    constants = []
    for value in op.operands:
        owner = value.owner
        if isinstance(owner, ir.Block) or operation(owner).name != "coreai.constant":
            return None
        constants.append(operation(owner))
    return constants


def keeps_pending_weights(op: ir.Operation) -> bool:
    """False (do not fold) for an op reading a constant whose data is still a placeholder."""
    op = getattr(op, "operation", op)
    for value in op.operands:
        owner = value.owner
        if isinstance(owner, ir.Block):
            continue
        name = resource_name(operation(owner))
        if name is not None and is_pending(name):
            return False
    return True


def make_folded_weights(module: ir.Module, store: WeightStore) -> int:
    """Make now the pending weights of ``store`` that an op Core AI's rewrite folds reads (an
    op reading only constants, which the other fold guards let fold): a ``reshape`` of a lazy
    weight, say.  Returns how many were made."""
    pending = {entry.name: entry for entry in store.pending.values()}
    if not pending:
        return 0
    folded: set[str] = set()

    def visit(op: ir.Operation) -> ir.WalkResult:
        name = resource_name(op)
        if name in pending:
            for use in op.result.uses:
                user = operation(use.owner)
                if (
                    user.name not in _DECOMPRESSIONS
                    and user.results  # not the graph's output: a weight returned as it is
                    and _constant_operands(user) is not None
                    and keeps_weight_casts(user)
                ):
                    folded.add(name)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    if folded:
        store.materialize(folded)
    return len(folded)


FOLD_GUARDS.append(keeps_weight_casts)
FOLD_GUARDS.append(keeps_pending_weights)
