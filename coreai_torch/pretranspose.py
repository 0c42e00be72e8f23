"""Weights stored in the layout the program reads them in.

``nn.Linear`` computes ``x @ W.T``.  Conversion keeps ``W`` zero-copy (a resource over the
parameter's memory), so the program holds ``transpose(constant W)`` and Core AI has no matmul
with a transposed operand: the runtime transposes every weight matrix on every call, which
dominates a decode step.  :func:`pretranspose_weights` (run by ``AIProgram.optimize()``)
replaces each such transpose by a constant holding the weight already transposed.

The transposed copy is made there, not at conversion (``to_coreai()`` stays zero-copy), and
only for a weight that is read through that one transpose everywhere in the program: the asset
then stores the transposed weight *instead of* the original, at the same size.  A weight that
is also read directly (e.g. an embedding table tied to the output projection) keeps its
run-time transpose rather than being stored twice.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

from coreai_torch._mlir import cai, ir
from coreai_torch.weights import WeightStore

_RESOURCE = re.compile(r'^dense_resource<"?([^">]+)"?>')


def _resource_name(op: ir.Operation) -> str | None:
    """The resource name of a ``coreai.constant dense_resource<name>``, else None."""
    if op.name != "coreai.constant":
        return None
    value = op.attributes["value"]
    if not ir.DenseResourceElementsAttr.isinstance(value):
        return None
    match = _RESOURCE.match(str(value))
    return match[1] if match else None


def _permutation(op: ir.Operation) -> tuple[int, ...] | None:
    """The constant permutation of a ``coreai.transpose``, else None."""
    source = op.operands[1].owner
    if isinstance(source, ir.Block) or source.operation.name != "coreai.constant":
        return None
    value = source.operation.attributes["value"]
    if not ir.DenseIntElementsAttr.isinstance(value):
        return None
    return tuple(int(v) for v in ir.DenseIntElementsAttr(value))


@dataclass
class _Transposed:
    """A weight read only through transposes by ``perm``: its constant ops and their users."""

    perm: tuple[int, ...]
    uses: list[tuple[ir.Operation, list[ir.Operation]]] = field(default_factory=list)


def _weight_transposes(module: ir.Module, store: WeightStore) -> dict[str, _Transposed]:
    """The weights of ``store`` that ``module`` reads only through transposes by one
    permutation, by resource name."""
    constants: dict[str, list[ir.Operation]] = defaultdict(list)

    def visit(op: ir.Operation) -> ir.WalkResult:
        name = _resource_name(op)
        if name is not None and name in store.by_name:
            constants[name].append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    found = {}
    for name, ops in constants.items():
        perms: set[tuple[int, ...] | None] = set()
        uses = []
        for op in ops:
            users = []
            for use in op.result.uses:
                user = use.owner.operation
                ok = user.name == "coreai.transpose" and use.operand_number == 0
                perms.add(_permutation(user) if ok else None)
                users.append(user)
            uses.append((op, users))
        if len(perms) == 1 and None not in perms:
            found[name] = _Transposed(perms.pop(), uses)  # type: ignore[arg-type]
    return found


def pretranspose_weights(module: ir.Module, store: WeightStore) -> list[str]:
    """Replace ``transpose(constant W)`` by a constant holding ``W`` transposed, for every
    weight of ``store`` that the program reads only through one such transpose.

    Returns the names of the weights now stored transposed (as ``<name>.T``).
    """
    done = []
    with module.context, ir.Location.unknown():
        for name, found in _weight_transposes(module, store).items():
            attr = store.transposed(name, found.perm)
            if attr is None:
                continue
            for const, transposes in found.uses:
                with ir.InsertionPoint(const), const.location:
                    replacement = cai.ConstantOp(value=attr).result
                for transpose in transposes:
                    perm = transpose.operands[1].owner.operation
                    transpose.result.replace_all_uses_with(replacement)
                    transpose.erase()
                    if not list(perm.result.uses):
                        perm.erase()
                const.erase()
            done.append(name)
    return done
