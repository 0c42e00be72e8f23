"""Weights stored in the layout the program reads them in.

``nn.Linear`` computes ``x @ W.T``.  Conversion keeps ``W`` zero-copy (a resource over the
parameter's memory), so the program holds ``transpose(constant W)`` and Core AI has no matmul
with a transposed operand: the runtime transposes every weight matrix on every call, which
dominates a decode step.  :func:`pretranspose_weights` (run by ``AIProgram.optimize()``)
replaces each such transpose by a constant holding the weight already transposed.

This is done only for a weight the program reads through that one transpose everywhere: the
asset then stores the transposed weight *instead of* the original, at the same size.  No copy
is made here either (:meth:`WeightStore.transposed`): the transposed data is produced while
the asset is written, or in place when something first reads the module's constants.  The one other
reader handled is an embedding lookup of the same matrix (an output projection tied to the
token embeddings, as in GPT-2): its rows are the columns of the transposed matrix, read with
``gather_along_axis``.  A weight read in any other way keeps its run-time transpose rather than
being stored twice.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import (
    Size,
    broadcast_dynamic,
    dim_size,
    i32,
    known_sizes,
    permutation,
    reshape_dynamic,
    shape_of,
    transpose,
)
from coreai_torch.ir.weights import WeightStore, resource_name


def is_row_lookup(op: ir.Operation, rank: int = 2) -> bool:
    """Whether ``op`` is ``gather_nd(table, indices[..., 1])``: rows of a 2-D table by index,
    as ``aten.embedding`` lowers (``rank=3``: matrices of a stack, the experts each token
    selected).  The indices' other dimensions may be dynamic (a prompt of any length)."""
    if op.name != "coreai.gather_nd":
        return False
    table, indices = (ir.RankedTensorType(v.type) for v in op.operands)
    return (
        table.rank == rank
        and indices.rank >= 1
        and not indices.is_dynamic_dim(indices.rank - 1)
        and indices.shape[-1] == 1
    )


@dataclass
class _Readers:
    """How a weight is read: per constant op, its transposes (by ``perm``) and row lookups."""

    perm: tuple[int, ...]
    #: (constant op, its transposes, its row lookups)
    constants: list[tuple[ir.Operation, list[ir.Operation], list[ir.Operation]]] = field(
        default_factory=list
    )


def _is_constant(value: ir.Value) -> bool:
    owner = value.owner
    return not isinstance(owner, ir.Block) and owner.operation.name == "coreai.constant"


def is_dynamic_gather(op: ir.Operation) -> bool:
    """Whether ``op`` is a gather whose indices are computed at run time: the rewrite cannot
    fold it, whatever its table holds."""
    return "gather" in op.name and not all(_is_constant(v) for v in op.operands[1:])


def _classify(
    ops: list[ir.Operation], transposes_read_by: Callable[[ir.Operation], bool] | None = None
) -> _Readers | None:
    """The readers of one weight's constant ops, if they allow storing it transposed.

    With ``transposes_read_by``, the transposes must be the only readers (no row lookups) and
    read only by ops it accepts."""
    perms: set[tuple[int, ...]] = set()
    constants = []
    for op in ops:
        transposes, lookups = [], []
        for use in op.result.uses:
            user = use.owner.operation
            if user.name == "coreai.transpose" and use.operand_number == 0:
                if transposes_read_by is not None and not all(
                    transposes_read_by(u.owner.operation) for u in user.result.uses
                ):
                    return None
                perm = permutation(user)
                if perm is None:
                    return None
                perms.add(perm)
                transposes.append(user)
            elif use.operand_number == 0 and is_row_lookup(user) and transposes_read_by is None:
                lookups.append(user)
            else:
                return None
        constants.append((op, transposes, lookups))
    if len(perms) != 1:
        return None
    (common,) = perms
    if common != (1, 0) and any(lookups for _, _, lookups in constants):
        return None
    return _Readers(common, constants)


def weight_constants(module: ir.Module, store: WeightStore) -> dict[str, list[ir.Operation]]:
    """The ``coreai.constant`` ops of every weight of ``store`` in ``module`` (one per graph
    that reads it), by resource name."""
    constants: dict[str, list[ir.Operation]] = defaultdict(list)

    def visit(op: ir.Operation) -> ir.WalkResult:
        name = resource_name(op)
        if name is not None and name in store.by_name:
            constants[name].append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return constants


def _weight_readers(
    module: ir.Module,
    store: WeightStore,
    transposes_read_by: Callable[[ir.Operation], bool] | None = None,
) -> dict[str, _Readers]:
    """The weights of ``store`` that can be stored transposed, by resource name."""
    found = {}
    for name, ops in weight_constants(module, store).items():
        readers = _classify(ops, transposes_read_by)
        if readers is not None:
            found[name] = readers
    return found


def lookup_batch(indices: ir.Value) -> tuple[list[Size], list[int | None], int | None]:
    """The dimensions of a row lookup's indices but the last (the lookup's batch), as the
    sizes :func:`reshape_dynamic` takes (run-time values only when more than one of them is
    dynamic), as a shape (None: dynamic), and their number of rows (None: dynamic)."""
    batch = shape_of(indices)[:-1]
    known = known_sizes(batch)
    count = None if known is None else math.prod(known)
    if batch.count(None) <= 1:
        return [-1 if d is None else d for d in batch], batch, count
    return [dim_size(indices, axis) for axis in range(len(batch))], batch, count


def _lookup_columns(transposed: ir.Value, lookup: ir.Operation) -> ir.Value:
    """``gather_nd(W, indices)`` computed from ``W.T``: gather the columns, transpose them
    (the number of indices may be dynamic: shapes then come from the indices at run time)."""
    sizes, batch, count = lookup_batch(lookup.operands[1])
    width = shape_of(transposed)[0]
    flat = reshape_dynamic(lookup.operands[1], [1, -1], [1, count])
    columns = cai.gather_along_axis(
        transposed, broadcast_dynamic(flat, [width, -1], [width, count]), i32(1)
    )
    return reshape_dynamic(transpose(columns, [1, 0]), [*sizes, width], [*batch, width])


def _erase_transpose(op: ir.Operation, replacement: ir.Value) -> None:
    perm = op.operands[1].owner.operation
    op.result.replace_all_uses_with(replacement)
    op.erase()
    if not list(perm.result.uses):
        perm.erase()


def pretranspose_weights(
    module: ir.Module,
    store: WeightStore,
    *,
    transposes_read_by: Callable[[ir.Operation], bool] | None = None,
) -> list[str]:
    """Store every weight of ``store`` that ``module`` reads only through one transpose (and
    row lookups) transposed: ``transpose(constant W)`` becomes ``constant W.T``.

    ``transposes_read_by`` limits this to weights read only through transposes, which only
    the ops it accepts read (no row lookups either).  The new constants hold placeholders
    until the asset is written (:meth:`WeightStore.transposed`), so before Core AI's rewrite
    only weights read by nothing it can fold may be stored transposed (run-time gathers,
    :func:`is_dynamic_gather`): a fold (of a lookup with constant indices, say) would compute
    from the placeholder's bytes.

    Returns the names of the weights now stored transposed (as ``<name>.T``).
    """
    done = []
    with module.context, ir.Location.unknown():
        for name, readers in _weight_readers(module, store, transposes_read_by).items():
            attr = store.transposed(name, readers.perm)
            if attr is None:
                continue
            for const, transposes, lookups in readers.constants:
                with ir.InsertionPoint(const), const.location:
                    replacement = cai.ConstantOp(value=attr).result
                for op in transposes:
                    _erase_transpose(op, replacement)
                for lookup in lookups:
                    with ir.InsertionPoint(lookup), lookup.location:
                        lookup.result.replace_all_uses_with(_lookup_columns(replacement, lookup))
                    lookup.erase()
                const.erase()
            done.append(name)
    return done
