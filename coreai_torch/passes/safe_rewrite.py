"""Guards that keep Core AI's pre-compilation rewrite numerics-preserving.

The rewrite (``run_pre_compilation_rewrite``, run by ``AIProgram.optimize()``) folds
``(conv(x) - C1) * C2`` with constants ``C1``/``C2`` into ``conv'(x) + C1 * C2`` — the sign of
the folded shift is wrong (it should be ``- C1 * C2``).  The same happens for ``(conv(x) - C1) /
C2``, ``C2 * (conv(x) - C1)`` and a scalar ``C1``.  The additive form ``(conv(x) + C) * C2`` is
folded correctly, so before the rewrite runs, :func:`protect_from_misfolds` turns every
floating-point ``A - C`` with a constant ``C`` that feeds a multiplication or division into the
exactly equivalent ``A + (-1 * C)`` (``a - c`` and ``a + (-c)`` agree bit for bit in IEEE
arithmetic, signed zeros and NaN included).  The rewrite then folds ``-1 * C`` itself.

The other guards below keep reshapes in place where the rewrite would move them wrongly, and
keep a convolution whose result is scaled per channel *and* read elsewhere from being
duplicated (:func:`_protect_shared_convolutions`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import numpy as np

from coreai_torch import dtypes
from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import constant, greater, reshape

_SUB_OPS = frozenset({"coreai.decomposable.broadcasting_sub", "coreai.sub"})
_SCALING_OPS = frozenset(
    {
        "coreai.decomposable.broadcasting_mul",
        "coreai.mul",
        "coreai.decomposable.broadcasting_divide",
        "coreai.divide",
    }
)


def _owner(value: ir.Value) -> ir.Operation | None:
    owner = value.owner
    if isinstance(owner, ir.Block):
        return None
    return owner.operation if isinstance(owner, ir.OpView) else owner


class _ConstantAnalysis:
    """Which values are computed from constants only (no graph argument, no region).

    Filled in one pass over the ops in program order (definitions come before uses), so that
    long dependency chains cost no recursion.
    """

    def __init__(self, ops: list[ir.Operation]) -> None:
        self._constant: set[int] = set()
        for op in ops:
            if op.name == "coreai.constant" or (
                len(op.regions) == 0
                and len(op.operands) > 0
                and all(self(operand) for operand in op.operands)
            ):
                self._constant.add(hash(op))

    def __call__(self, value: ir.Value) -> bool:
        op = _owner(value)
        return op is not None and hash(op) in self._constant


def _candidates(
    ops: list[ir.Operation], names: Collection[str]
) -> tuple[list[ir.Operation], Callable[[ir.Value], bool]]:
    """The ops of ``ops`` named in ``names``, and which values of ``ops`` are constant (the
    analysis runs only when there are candidates)."""
    candidates = [op for op in ops if op.name in names]
    return candidates, (_ConstantAnalysis(ops) if candidates else lambda _: False)


def _is_float(value: ir.Value) -> bool:
    if not ir.ShapedType.isinstance(value.type):
        return False
    element = ir.ShapedType(value.type).element_type
    return any(
        kind.isinstance(element) for kind in (ir.F16Type, ir.BF16Type, ir.F32Type, ir.F64Type)
    )


def _feeds_scaling(op: ir.Operation) -> bool:
    return any(use.owner.name in _SCALING_OPS for use in op.result.uses)


def _minus_one(like: ir.Value) -> ir.Value:
    element = ir.ShapedType(like.type).element_type
    return constant(-1.0, dtypes.to_torch(element))


def protect_from_misfolds(module: ir.Module) -> int:
    """Put the patterns the rewrite folds wrongly into equivalent forms it folds correctly.

    Returns the number of rewritten ops.
    """
    return sum(guard(module, _all_ops(module)) for guard in _GUARDS)


def _all_ops(module: ir.Module) -> list[ir.Operation]:
    ops: list[ir.Operation] = []

    def collect(op: ir.Operation) -> ir.WalkResult:
        ops.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(collect)
    return ops


def _protect_constant_shifts(module: ir.Module, ops: list[ir.Operation]) -> int:
    """``A - C`` (float, ``C`` constant, feeding a mul/div) -> ``A + (-1 * C)``."""
    candidates, is_constant = _candidates(ops, _SUB_OPS)
    rewritten = 0
    with module.context:
        for op in candidates:
            lhs, rhs = op.operands[0], op.operands[1]
            if not (_is_float(op.result) and is_constant(rhs) and not is_constant(lhs)):
                continue
            if not _feeds_scaling(op):
                continue
            with ir.InsertionPoint(op), op.location:
                minus_one = _minus_one(rhs)
                negated = cai.broadcasting_mul(rhs, minus_one)
                added = cai.broadcasting_add(lhs, negated)
            if added.type != op.result.type:  # keep the program's types exactly as they were
                for value in (added, negated, minus_one):
                    made = _owner(value)  # the op just built above
                    if made is not None:
                        made.erase()
                continue
            op.result.replace_all_uses_with(added)
            op.erase()
            rewritten += 1
    return rewritten


# ---------------------------------------------------------------------------------------------
# The rewrite also moves a reshape feeding a matmul operand behind the matmul
# (matmul(A, reshape(B)) -> reshape(matmul(A, B))) when B's sizes merely happen to line up,
# e.g. B: 1x1x4x4x6 reshaped to 1x4x24: it then contracts over the wrong dimension.  Moving a
# reshape through a matmul is only valid when it leaves the matrix dimensions alone (the last
# two of the right operand, the last of the left one); for every other reshape a `* 1` between
# the reshape and the matmul keeps the rewrite from touching it (the compiler drops the `* 1`).
# Even a valid move aborts the process (LLVM ERROR "Failed to infer result type(s)" for a
# broadcasting op) when an elementwise op uses the matmul's result together with a value whose
# shape does not broadcast to the matmul's shape after the move, e.g. x: 2x7x64 reshaped to
# 14x64, times W, times another 14x48 value (SwiGLU experts on flattened tokens): the same
# `* 1` keeps those reshapes in place too.

_MATMUL_OPS = frozenset({"coreai.batch_matmul", "coreai.decomposable.broadcasting_batch_matmul"})


def _static_shape(value: ir.Value) -> list[int] | None:
    if not ir.RankedTensorType.isinstance(value.type):
        return None
    t = ir.RankedTensorType(value.type)
    return list(t.shape) if t.has_static_shape else None


def _reshape_changes_matrix_dims(reshape: ir.Operation, operand_index: int) -> bool:
    before, after = _static_shape(reshape.operands[0]), _static_shape(reshape.result)
    if before is None or after is None:
        return True
    kept = 1 if operand_index == 0 else 2
    return before[-kept:] != after[-kept:]


#: Elementwise ops with several tensor operands (the rewrite re-infers their types after a move).
_ELEMENTWISE_PREFIX = "coreai.decomposable.broadcasting_"
_ELEMENTWISE_OPS = frozenset(
    f"coreai.{n}" for n in ("add", "sub", "mul", "divide", "maximum", "minimum", "pow", "where")
)


def _moved_matmul_shape(
    matmul: ir.Operation, reshape: ir.Operation, index: int
) -> list[int] | None:
    """The matmul's result shape once the rewrite moved ``reshape`` (its operand ``index``)
    behind it (the matmul then reads the reshape's input); ``None`` if not static or if the
    batch dimensions would not broadcast."""
    shapes = [_static_shape(v) for v in matmul.operands]
    shapes[index] = _static_shape(reshape.operands[0])
    a, b = shapes
    if a is None or b is None or len(a) < 2 or len(b) < 2:
        return None
    try:
        batch = np.broadcast_shapes(tuple(a[:-2]), tuple(b[:-2]))
    except ValueError:  # batch dimensions that no longer line up
        return None
    return [*batch, a[-2], b[-1]]


def _broadcasts_to(shape: list[int] | None, target: list[int]) -> bool:
    if shape is None:
        return False
    try:
        return list(np.broadcast_shapes(tuple(shape), tuple(target))) == target
    except ValueError:
        return False


def _move_breaks_users(matmul: ir.Operation, reshape: ir.Operation, index: int) -> bool:
    """Whether an elementwise op combines the matmul's result with another operand (the result
    again included) that does not broadcast to the matmul's shape after the move: the rewrite
    aborts then.  Scalars and bias-like operands are fine."""
    moved = _moved_matmul_shape(matmul, reshape, index)
    if moved is None:
        return True
    if moved == _static_shape(matmul.result):
        return False
    for use in matmul.result.uses:
        user = use.owner
        name = user.name
        if name == "coreai.decomposable.broadcasting_batch_matmul" or not (
            name.startswith(_ELEMENTWISE_PREFIX) or name in _ELEMENTWISE_OPS
        ):
            continue
        for number, operand in enumerate(user.operands):
            if number == use.operand_number:
                continue
            if operand == matmul.result or not _broadcasts_to(_static_shape(operand), moved):
                return True
    return False


def _protect_reshaped_matmul_operands(module: ir.Module, ops: list[ir.Operation]) -> int:
    protected = 0
    with module.context:
        for op in ops:
            if op.name not in _MATMUL_OPS:
                continue
            for index in (0, 1):
                source = _owner(op.operands[index])
                if source is None or source.name != "coreai.reshape":
                    continue
                if not (
                    _reshape_changes_matrix_dims(source, index)
                    or _move_breaks_users(op, source, index)
                ):
                    continue
                value = op.operands[index]
                element = ir.ShapedType(value.type).element_type
                with ir.InsertionPoint(op), op.location:
                    one = constant(1, dtypes.to_torch(element))
                    op.operands[index] = cai.broadcasting_mul(value, one)
                protected += 1
    return protected


def _adds_leading_unit_dims(reshape: ir.Operation) -> int:
    """How many leading unit dimensions ``reshape`` puts before its input's (unchanged)
    dimensions; 0 when it does something else."""
    source, result = reshape.operands[0].type, reshape.result.type
    if not (ir.RankedTensorType.isinstance(source) and ir.RankedTensorType.isinstance(result)):
        return 0
    before, after = list(ir.RankedTensorType(source).shape), list(ir.RankedTensorType(result).shape)
    lead = len(after) - len(before)
    if lead <= 0 or any(d != 1 for d in after[:lead]):
        return 0
    dynamic = ir.ShapedType.get_dynamic_size()
    differ = [(b, a) for b, a in zip(before, after[lead:], strict=True) if a != b]
    # a size known in the input and run-time in the result is the same size only when the
    # element count fixes it (one such dimension, every other size known); a run-time input
    # size against a known result size is a regrouping ([1, ?, 8, 16] -> [1, ?, 8, 8, 16])
    if differ and (len(differ) > 1 or differ[0][1] != dynamic or dynamic in before):
        return 0
    if sum(d == dynamic for d in before) > 1 or (dynamic in before and dynamic not in after):
        return 0  # several run-time sizes: the reshape may regroup them
    return lead


def _protect_unit_dim_reshapes_of_broadcast_operands(
    module: ir.Module, ops: list[ir.Operation]
) -> int:
    """The rewrite moves ``reshape(r, [1, -1, D])`` (leading unit dimensions) behind an
    elementwise op that broadcasts it against an operand with a run-time batch size
    (``x[B, T, D] + reshape(r[T, D])`` becomes ``reshape(x + r, [1, -1, D])``, whose result is
    ``[1, B*T, D]``); the equivalent ``expand_dims`` is left alone."""
    protected = 0
    with module.context:
        for op in ops:
            if not (op.name.startswith(_ELEMENTWISE_PREFIX) or op.name in _ELEMENTWISE_OPS):
                continue
            if op.name == "coreai.decomposable.broadcasting_batch_matmul":
                continue
            for index, operand in enumerate(list(op.operands)):
                source = _owner(operand)
                if source is None or source.name != "coreai.reshape":
                    continue
                lead = _adds_leading_unit_dims(source)
                if not lead:
                    continue
                with ir.InsertionPoint(op), op.location:
                    expanded = cai.expand_dims(source.operands[0], np.arange(lead, dtype=np.int32))
                op.operands[index] = expanded
                protected += 1
    return protected


# ---------------------------------------------------------------------------------------------
# The rewrite folds a per-channel scale of a convolution's result (a `mul` / `divide` by a
# constant of the result's rank, [1, C, 1, 1]: batch norm, PReLU's slope) into the kernel:
# conv(x, W) * s -> conv(x, W * s).  It does so even when the convolution's result is read by
# other ops too (PReLU: where(y > 0, y, y * slope)), and the convolution then runs twice, the
# second time on an anonymous scaled copy of its kernel (a larger asset, and a weight
# `compress()` does not know by name).  A scale of one rank less ([C, 1, 1], which broadcasts
# the same) is left alone, so such scales lose their leading unit dimension; a scale that is
# the convolution's only reader is still folded.

_CONVOLUTIONS = frozenset({"coreai.conv2d", "coreai.conv3d"})
_DIVIDE_OPS = frozenset({"coreai.decomposable.broadcasting_divide", "coreai.divide"})
_BIAS_OPS = frozenset({"coreai.decomposable.broadcasting_add", "coreai.add", *_SUB_OPS})


def _scaled_convolution_is_shared(value: ir.Value, is_constant: Callable[[ir.Value], bool]) -> bool:
    """Whether ``value`` is a convolution's result (through constant bias adds) that some op
    other than the one scaling it reads on the way."""
    uses = 0
    while True:
        uses += len(list(value.uses)) - 1  # readers besides the next op of the chain
        op = _owner(value)
        if op is None:
            return False
        if op.name in _CONVOLUTIONS:
            return uses > 0
        if op.name not in _BIAS_OPS:
            return False
        lhs, rhs = op.operands[0], op.operands[1]
        if is_constant(rhs) and not is_constant(lhs):
            value = lhs
        elif is_constant(lhs) and not is_constant(rhs):
            value = rhs
        else:
            return False


def _protect_shared_convolutions(module: ir.Module, ops: list[ir.Operation]) -> int:
    """``conv(x) * s`` (``s`` a constant ``[1, C, 1, 1]``, the convolution's result read
    elsewhere too) -> ``conv(x) * reshape(s, [C, 1, 1])``, which the rewrite does not fold
    into a second convolution."""
    candidates, is_constant = _candidates(ops, _SCALING_OPS)
    protected = 0
    with module.context:
        for op in candidates:
            for index in (0, 1):
                scale, scaled = op.operands[index], op.operands[1 - index]
                if index == 0 and op.name in _DIVIDE_OPS:
                    continue  # s / conv(x) is not a scale of the convolution
                if not (is_constant(scale) and not is_constant(scaled)):
                    continue
                shape = _static_shape(scale)
                if shape is None or len(shape) < 2 or shape[0] != 1:
                    continue
                if len(shape) != len(_static_shape(scaled) or []):
                    continue
                if not _scaled_convolution_is_shared(scaled, is_constant):
                    continue
                with ir.InsertionPoint(op), op.location:
                    op.operands[index] = reshape(scale, shape[1:])
                protected += 1
    return protected


_GUARDS = (
    _protect_constant_shifts,
    _protect_reshaped_matmul_operands,
    _protect_unit_dim_reshapes_of_broadcast_operands,
    _protect_shared_convolutions,
)


# ---------------------------------------------------------------------------------------------
# The runtime's compiler treats cast(cast(x: float -> si32/si64) -> float) as the identity: it
# drops the truncation toward zero (x.to(torch.int64).float() returns x unchanged).  8- and
# 16-bit intermediates are not affected.  Truncating explicitly first makes the folded and the
# unfolded program agree.

_WIDE_INTS = (32, 64)


def _float_type(t: ir.Type) -> bool:
    element = ir.ShapedType(t).element_type if ir.ShapedType.isinstance(t) else t
    return any(k.isinstance(element) for k in (ir.F16Type, ir.BF16Type, ir.F32Type, ir.F64Type))


def _wide_int_type(t: ir.Type) -> bool:
    if not ir.ShapedType.isinstance(t):
        return False
    element = ir.ShapedType(t).element_type
    return ir.IntegerType.isinstance(element) and ir.IntegerType(element).width in _WIDE_INTS


def _trunc(x: ir.Value) -> ir.Value:
    """``x`` rounded toward zero: ``where(x < 0, -floor(-x), floor(x))``."""

    dtype = dtypes.to_torch(ir.ShapedType(x.type).element_type)
    one, zero, minus_one = (constant(v, dtype) for v in (1.0, 0.0, -1.0))
    floor = cai.broadcasting_floor_divide(x, one)
    negated = cai.broadcasting_mul(x, minus_one)
    ceil = cai.broadcasting_mul(cai.broadcasting_floor_divide(negated, one), minus_one)
    return cai.broadcasting_where(cai.broadcasting_greater(zero, x), ceil, floor)


_EQUALITY_OPS = {
    "coreai.decomposable.broadcasting_equal": False,
    "coreai.equal": False,
    "coreai.decomposable.broadcasting_not_equal": True,
    "coreai.not_equal": True,
}


def _ordered(x: ir.Value) -> ir.Value:
    """``not isnan(x)`` from ordered comparisons only: ``x > -inf or inf > x``."""

    return cai.broadcasting_or(greater(x, float("-inf")), greater(float("inf"), x))


def _exact_equal(a: ir.Value, b: ir.Value) -> ir.Value:
    """``a == b`` (IEEE: false with NaN) through ``greater``, which Core AI folds exactly."""
    both_ordered = cai.broadcasting_and(_ordered(a), _ordered(b))
    neither_greater = cai.not_(
        cai.broadcasting_or(cai.broadcasting_greater(a, b), cai.broadcasting_greater(b, a))
    )
    return cai.broadcasting_and(both_ordered, neither_greater)


def _protect_constant_comparisons(module: ir.Module) -> int:
    """Core AI's constant folder compares floats with a tolerance: ``2.5 == inf``,
    ``1e38 == inf`` and ``1.0 == 1.0000001`` all fold to true (the runtime's kernels compare
    exactly).  Float ``==``/``!=`` whose operands are both constant are rewritten into ordered
    ``>`` comparisons, which it folds exactly.  Returns the number of comparisons rewritten."""
    candidates, is_constant = _candidates(_all_ops(module), _EQUALITY_OPS)
    rewritten = 0
    with module.context:
        for op in candidates:
            a, b = op.operands[0], op.operands[1]
            if not (_is_float(a) and _is_float(b) and is_constant(a) and is_constant(b)):
                continue
            with ir.InsertionPoint(op), op.location:
                exact = _exact_equal(a, b)
                if _EQUALITY_OPS[op.name]:
                    exact = cai.not_(exact)
            op.result.replace_all_uses_with(exact)
            op.erase()
            rewritten += 1
    return rewritten


#: Ops whose results are not determined by their operands and attributes alone.
_OPS_WITH_EFFECTS = frozenset(
    {
        "coreai.create_token",
        "coreai.read_handle",
        "coreai.write_handle",
        "coreai.join_token",
        "coreai.invoke",
        "coreai.metal4_kernel",
    }
)


def _merge_identical_scans(module: ir.Module) -> int:
    """The runtime's compiler mishandles two scans that compute the same thing (same combiner,
    operands computed the same way) over an operand with a dynamic dim: a consumer of one of
    them fails with ``Expected operands to be tensors`` or aborts the process (SIGILL).
    Hugging Face decoders with two kinds of attention mask (Gemma 2) compute the same
    ``cumsum`` twice.  Values are numbered by how they are computed (a graph argument, and
    the results of ops with regions or effects, are their own number), and each scan that
    repeats an earlier scan of its block is replaced by it.  Returns the number merged."""
    numbers: dict[ir.Value, int] = {}
    interned: dict[tuple, int] = {}
    first_scan: dict[tuple, ir.Operation] = {}
    merged = 0

    def number(value: ir.Value) -> int:
        found = numbers.get(value)
        return found if found is not None else interned.setdefault(("value", value), len(interned))

    for op in _all_ops(module):
        if len(op.regions) > 0 or op.name in _OPS_WITH_EFFECTS:
            continue
        attributes = tuple(str(op.attributes[i]) for i in range(len(op.attributes)))
        key = (op.name, attributes, tuple(number(v) for v in op.operands), hash(op.block))
        if op.name == "coreai.scan":
            earlier = first_scan.setdefault(key, op)
            if earlier is not op:
                for mine, theirs in zip(op.results, earlier.results, strict=True):
                    mine.replace_all_uses_with(theirs)
                op.erase()
                merged += 1
                continue
        for index, result in enumerate(op.results):
            numbers[result] = interned.setdefault((*key, index), len(interned))
    return merged


def protect_from_runtime_misfolds(module: ir.Module) -> int:
    """Put patterns the runtime's compiler folds wrongly into forms it folds correctly:
    float comparisons of constants (see :func:`_protect_constant_comparisons`), identical
    scans (:func:`_merge_identical_scans`), and explicit truncation before
    ``float -> si32/si64`` casts whose result is cast back to a float type.
    Returns the number of ops protected."""
    protected = _protect_constant_comparisons(module) + _merge_identical_scans(module)
    casts: list[ir.Operation] = []

    def collect(op: ir.Operation) -> ir.WalkResult:
        if op.name == "coreai.cast":
            casts.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(collect)
    with module.context:
        for op in casts:
            source = op.operands[0]
            if not (_float_type(source.type) and _wide_int_type(op.result.type)):
                continue
            if not any(
                use.owner.name == "coreai.cast" and _float_type(use.owner.result.type)
                for use in op.result.uses
            ):
                continue
            with ir.InsertionPoint(op), op.location:
                op.operands[0] = _trunc(source)
            protected += 1
    return protected
