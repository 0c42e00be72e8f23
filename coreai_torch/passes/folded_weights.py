"""Weights Core AI's rewrite computes from others keep a name, so ``compress()`` finds them.

The pre-compilation rewrite (``optimize()``) folds constant work on a weight into a new
weight -- batch norm's per-channel scale into the convolution's kernel -- held by an anonymous
resource (``dense_resource<resource_1234...>``) that the program's
:class:`~coreai_torch.ir.weights.WeightStore` does not know.  ``compress()`` after
``optimize()`` (the documented order) left such weights in float32 and listed the weights they
came from as no longer read.  :func:`note_weight_readers` records, before the rewrite, which
weight each convolution / matmul reads, by the op's location (the rewrite builds its ops with
the location of those it replaces); :func:`name_folded_weights`, after it, moves each anonymous
floating weight a convolution or matmul reads into the store, named after the weight its
reader read (``conv.weight.folded``), so that it is a weight like any other (compressed,
stored transposed, listed in the reports).
"""

from __future__ import annotations

from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import operation
from coreai_torch.ir.weights import WeightStore, resource_name, resource_tensor
from coreai_torch.locations import names_in_location

#: readers of a weight, and the operands a weight is read as
_READERS = {
    "coreai.conv2d": (1,),
    "coreai.conv3d": (1,),
    "coreai.batch_matmul": (0, 1),
    "coreai.decomposable.broadcasting_batch_matmul": (0, 1),
}
#: ops a weight may pass through on its way to its reader
_THROUGH = frozenset({"coreai.cast", "coreai.transpose", "coreai.reshape"})

#: (the FX nodes of the reader's location, reader, operand number) -> the weight's resource
#: name (the rewrite adds debug information to the locations of the ops it builds)
Readers = dict[tuple[tuple[str, ...], str, int], str]


def _reads(constant: ir.Operation) -> list[tuple[tuple[str, ...], str, int]]:
    """``(nodes, reader, operand)`` of the convolutions / matmuls reading ``constant``."""
    found, values = [], [constant.result]
    while values:
        value = values.pop()
        for use in value.uses:
            user = operation(use.owner)
            if user.name in _THROUGH and use.operand_number == 0:
                values.append(user.result)
            elif use.operand_number in _READERS.get(user.name, ()):
                nodes = tuple(names_in_location(str(user.location)))
                found.append((nodes, user.name, use.operand_number))
    return found


def _constants(module: ir.Module) -> list[ir.Operation]:
    found: list[ir.Operation] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if resource_name(op) is not None:
            found.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return found


#: the most ops a weight's expression (``w * 2``, casts, transposes) is looked through
_EXPRESSION_OPS = 32


def _weights_behind(value: ir.Value, store: WeightStore) -> list[str]:
    """The weights of ``store`` that ``value`` is computed from, largest first, when it is
    computed from constants only, by a short expression (``w * 2``, a cast, a transpose);
    else none."""
    found: dict[str, int] = {}
    pending, seen = [value], set[int]()
    while pending:
        owner = pending.pop().owner
        if isinstance(owner, ir.Block):
            return []  # reads a graph argument: an activation
        op = operation(owner)
        if hash(op) in seen:
            continue
        if len(op.regions) > 0 or len(seen) >= _EXPRESSION_OPS:
            return []
        seen.add(hash(op))
        name = resource_name(op)
        if name is not None and name in store.by_name:
            found[name] = store.by_name[name].numel()
        elif op.name != "coreai.constant":
            pending.extend(op.operands)
    return sorted(found, key=lambda n: -found[n])


def note_weight_readers(module: ir.Module, store: WeightStore) -> Readers:
    """Which weight of ``store`` each convolution / matmul of ``module`` reads (the largest
    its operand is computed from, when that takes only constants)."""
    readers: Readers = {}

    def visit(op: ir.Operation) -> ir.WalkResult:
        for number in _READERS.get(op.name, ()):
            weights = _weights_behind(op.operands[number], store)
            if weights:
                nodes = tuple(names_in_location(str(op.location)))
                readers.setdefault((nodes, op.name, number), weights[0])
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return readers


def name_folded_weights(module: ir.Module, store: WeightStore, readers: Readers) -> int:
    """Move the anonymous floating weights convolutions / matmuls read into ``store``, named
    after the weights ``readers`` (from :func:`note_weight_readers`) says their readers read.
    Returns how many constants were replaced."""
    made: dict[str, ir.Attribute] = {}  # anonymous resource -> the store's attribute
    replaced = 0
    for constant in _constants(module):
        anonymous = resource_name(constant)  # (every one of _constants has a resource)
        if anonymous is None or anonymous in store.by_name or anonymous in store.derived_by_name:
            continue
        reads = _reads(constant)
        element = ir.ShapedType(constant.result.type).element_type
        if not reads or not ir.FloatType.isinstance(element):
            continue
        with ir.InsertionPoint(constant), constant.location:
            if anonymous in made:
                value = cai.ConstantOp(value=made[anonymous]).result
            else:
                origin = next((readers[r] for r in reads if r in readers), None)
                node = (*reads[0][0], "weight")[0]
                base = origin.removesuffix(".T") if origin else node
                value = store.constant(resource_tensor(constant), f"{base}.folded")
                made[anonymous] = operation(value.owner).attributes["value"]
                name = resource_name(operation(value.owner))
                if origin is not None and name is not None:
                    store.folded[name] = origin
        constant.result.replace_all_uses_with(value)
        constant.erase()
        replaced += 1
    return replaced
