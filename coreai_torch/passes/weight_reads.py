"""How a program reads each weight: what ``compress()`` fits a weight's codes along.

A weight can be stored compressed when every reader takes it in the same orientation: the
output channel and the reduction axis follow from the reader, blocks run along the reduction
axis, and an axis the program selects at run time or batches over (the experts of a
mixture-of-experts layer) gets parameters of its own per index.  The readers, followed from
the weight's constants:

* a matmul (either operand), a convolution's kernel, an embedding lookup (``gather_nd`` of the
  rows of a matrix, or ``gather_along_axis`` of the columns of a table stored transposed);
* a batched matmul of a stack of matrices ``(experts, in, out)`` (every expert), or a
  ``gather_nd`` of the experts each token selected (``(experts, ...)`` indexed by a run-time
  ``[..., 1]`` tensor) whose result a matmul reads (through reshapes of the gathered batch);
* on the way: casts between float types (a half-precision weight read in float32: the float32
  accumulation of :mod:`coreai_torch.lowerings.helpers.accumulation`), multiplications by one (the
  guards of :mod:`coreai_torch.passes.safe_rewrite`) and transposes, whose axes are
  followed.  Transposes every reader goes through (``nn.Linear`` before ``optimize()``) are
  absorbed: the weight is stored transposed, so the readers get the decompressed weight
  directly.

Anything else (an elementwise op, a state, an output) cannot read a compressed weight: the
plan is then the reason why.
"""

from __future__ import annotations

from dataclasses import dataclass

from coreai_torch._mlir import ir
from coreai_torch.ir.checks import constant_values
from coreai_torch.ir.values import operation, permutation, shape_of, splat_value
from coreai_torch.passes.pretranspose import is_row_lookup

MATMULS = frozenset({"coreai.decomposable.broadcasting_batch_matmul", "coreai.batch_matmul"})
_CONVOLUTIONS = frozenset({"coreai.conv2d", "coreai.conv3d"})
#: ops a weight's reader result may pass through on its way to a program output (head)
_TO_OUTPUT = frozenset(
    {
        "coreai.reshape",
        "coreai.transpose",
        "coreai.cast",
        "coreai.slice",
        "coreai.expand_dims",
        "coreai.shrink_dims",
        "coreai.decomposable.broadcasting_add",
        "coreai.decomposable.broadcasting_mul",
    }
)
_ONLY = "only matmuls, convolutions, embedding lookups and expert gathers read compressed weights"


@dataclass(frozen=True)
class Read:
    """One reader of a weight, in the axes of the weight as stored."""

    #: "matmul", "convolution", "embedding" or "experts" (a stack of matrices, batched or
    #: gathered)
    kind: str
    channel: int
    reduction: int
    #: axes with parameters of their own per index (the experts)
    batch: tuple[int, ...]
    #: whether the result flows into a program output (an LLM's logits)
    head: bool


@dataclass
class Plan:
    """How one weight is compressed: in which layout, along which axes."""

    name: str
    constants: list[ir.Operation]
    #: the transposes the weight is read through, absorbed into a transposed layout
    transposes: list[ir.Operation]
    #: the permutation of the stored layout relative to the weight (identity: as it is)
    perm: tuple[int, ...]
    channel_axis: int
    reduction_axis: int
    batch_axes: tuple[int, ...]
    reader: str
    head: bool


def reaches_output(value: ir.Value, depth: int = 8) -> bool:
    """Whether ``value`` flows into a graph output through shape ops and bias adds."""
    if depth == 0:
        return False
    for use in value.uses:
        user = operation(use.owner)
        if user.name == "coreai.output":
            return True
        if user.name in _TO_OUTPUT and any(reaches_output(r, depth - 1) for r in user.results):
            return True
    return False


def _is_float(value: ir.Value) -> bool:
    element = ir.RankedTensorType(value.type).element_type
    return not ir.IntegerType.isinstance(element)


def _times_one(user: ir.Operation, value: ir.Value) -> bool:
    """Whether ``user`` multiplies ``value`` by a constant one, keeping its shape (the
    guards of :mod:`coreai_torch.passes.safe_rewrite`)."""
    if user.name != "coreai.decomposable.broadcasting_mul" or len(user.operands) != 2:
        return False
    other = user.operands[1] if user.operands[0] == value else user.operands[0]
    one = splat_value(other)
    return one is not None and float(one.value) == 1.0 and shape_of(user.result) == shape_of(value)


def _reads(value: ir.Value, axes: tuple[int, ...], gathered: tuple[int, ...]) -> list[Read] | str:
    """The readers of ``value``, whose axis ``i`` is the stored weight's axis ``axes[i]`` (-1:
    not an axis of the weight, e.g. the tokens of a gather); ``gathered``: the weight's axes
    a run-time gather indexed on the way."""
    reads: list[Read] = []
    for use in value.uses:
        found = _read(operation(use.owner), use.operand_number, value, axes, gathered)
        if isinstance(found, str):
            return found
        reads += found
    return reads


def _read(
    user: ir.Operation,
    position: int,
    value: ir.Value,
    axes: tuple[int, ...],
    gathered: tuple[int, ...],
) -> list[Read] | str:
    name, rank = user.name, len(axes)
    plain = not gathered and axes == tuple(range(rank))
    if (position == 0 and name == "coreai.cast" and _is_float(user.result)) or _times_one(
        user, value
    ):
        return _reads(user.result, axes, gathered)
    if position == 0 and name == "coreai.transpose":
        perm = permutation(user)
        if perm is None:
            return "read by a transpose whose permutation is not constant"
        return _reads(user.result, tuple(axes[p] for p in perm), gathered)
    if position == 0 and name == "coreai.reshape" and gathered:
        old, new = shape_of(value), shape_of(user.result)
        if len(new) >= 2 and old[-2:] == new[-2:] and all(a < 0 for a in axes[:-2]):
            return _reads(user.result, (-1,) * (len(new) - 2) + axes[-2:], gathered)
    if name in MATMULS and position in (0, 1) and rank >= 2:
        channel, reduction = (axes[-1], axes[-2]) if position == 1 else (axes[-2], axes[-1])
        batch = tuple(sorted({a for a in axes[:-2] if a >= 0} | set(gathered)))
        if channel >= 0 and reduction >= 0:
            kind = "experts" if batch else "matmul"
            return [Read(kind, channel, reduction, batch, reaches_output(user.result))]
    if name in _CONVOLUTIONS and position == 1 and rank >= 3 and plain:
        return [Read("convolution", 0, 1, (), False)]
    if position == 0 and rank == 2 and not gathered and is_row_lookup(user):
        return [Read("embedding", axes[0], axes[1], (), False)]
    if name == "coreai.gather_along_axis" and position == 0 and rank == 2 and not gathered:
        axis = constant_values(user.operands[2])
        if axis is not None and axis.size == 1 and int(axis[0]) % 2 == 1:
            return [Read("embedding", axes[1], axes[0], (), False)]
    if (
        position == 0
        and rank == 3
        and not gathered
        and is_row_lookup(user, rank=3)
        and axes[0] >= 0
    ):
        lookups = len(shape_of(user.operands[1])) - 1
        return _reads(user.result, (-1,) * lookups + axes[1:], (axes[0],))
    return f"read by {name} ({_ONLY})"


def _absorbed_transposes(constants: list[ir.Operation]) -> tuple[list[ir.Operation], tuple]:
    """The transposes every use of the weight goes through, and their common permutation
    (none when some use reads the weight otherwise)."""
    transposes, perms = [], set()
    for const in constants:
        for use in const.result.uses:
            user = operation(use.owner)
            if user.name != "coreai.transpose" or use.operand_number != 0:
                return [], ()
            perm = permutation(user)
            if perm is None:
                return [], ()
            transposes.append(user)
            perms.add(perm)
    if len(perms) != 1:
        return [], ()
    return transposes, perms.pop()


def read_plan(name: str, constants: list[ir.Operation], rank: int) -> Plan | str:
    """How weight ``name`` (read through ``constants``) can be compressed, or why not."""
    transposes, perm = _absorbed_transposes(constants)
    identity = tuple(range(rank))
    starts = [t.result for t in transposes] if transposes else [c.result for c in constants]
    reads: list[Read] = []
    for start in starts:
        found = _reads(start, identity, ())
        if isinstance(found, str):
            return found
        reads += found
    if not reads:
        return "not read"
    if len({(r.channel, r.reduction, r.batch) for r in reads}) != 1:
        return "its readers disagree on which axis holds the output channels"
    kinds = {r.kind for r in reads}
    first = reads[0]
    return Plan(
        name,
        constants,
        transposes,
        perm if transposes else identity,
        first.channel,
        first.reduction,
        first.batch,
        next(k for k in ("embedding", "experts", "convolution", "matmul") if k in kinds),
        any(r.head for r in reads),
    )
