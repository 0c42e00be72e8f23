"""Where compressed weights are decompressed: the placement passes of compressed weights.

Run after ``compress()`` and by ``optimize()`` (for models quantized with torchao), in the
order :mod:`coreai_torch.passes.pipeline` gives:

* :func:`scales_after_matmul`: an 8-bit weight with one scale per output channel read by a
  float32 matmul becomes ``cast -> matmul -> scale``, the runtime's fastest form;
* :func:`decompress_to_float32`: a half-precision decompression read only by casts to float32
  (the float32 accumulation of matmuls) decompresses to float32 directly;
* :func:`lookups_before_decompression`: lookups of compressed tables (embeddings, the experts
  each token selected) gather the compressed rows before decompressing them.
"""

from __future__ import annotations

import numpy as np
import torch

from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import (
    cast,
    constant_values,
    i32,
    operation,
    reshape_dynamic,
    shape_of,
    splat_value,
    static_shape_of,
)
from coreai_torch.passes.pretranspose import is_row_lookup, lookup_batch
from coreai_torch.passes.weight_reads import MATMULS

# ------------------------------------------------------------ int8 cast -> matmul -> scale ---


def _splat_zero(value: ir.Value) -> bool:
    splat = splat_value(value)
    return splat is not None and float(splat.value) == 0.0


def _erase_with_constants(op: ir.Operation) -> None:
    """Erase ``op`` (no longer used) and the constants only it read."""
    sources = [o.owner for o in op.operands if not isinstance(o.owner, ir.Block)]
    op.erase()
    for source in map(operation, sources):
        if source.name == "coreai.constant" and not list(source.result.uses):
            source.erase()


def _right_operand_of_matmuls(value: ir.Value) -> list[ir.Operation] | None:
    """The matmuls reading ``value``, if every use is the right operand of one."""
    users = [operation(u.owner) for u in value.uses]
    if not users or any(
        u.name not in MATMULS or u.operands[1] != value or u.operands[0] == value for u in users
    ):
        return None
    return users


def _float32_casts(op: ir.Operation) -> list[ir.Operation] | None:
    """The casts to float32 reading the half-precision result of ``op``, if they are all its
    readers (a half weight read by the float32 accumulation of matmuls)."""
    element = ir.RankedTensorType(op.result.type).element_type
    if not isinstance(element, (ir.F16Type, ir.BF16Type)):
        return None
    casts = [operation(u.owner) for u in op.result.uses]
    if not casts or any(
        c.name != "coreai.cast"
        or not isinstance(ir.RankedTensorType(c.result.type).element_type, ir.F32Type)
        for c in casts
    ):
        return None
    return casts


def _float32_matmuls(op: ir.Operation) -> tuple[list[ir.Operation], list[ir.Operation]] | None:
    """The float32 matmuls reading the decompressed weight ``op`` as right operand: directly
    (a float32 weight), or each through a cast to float32 (a half weight read by the float32
    accumulation of :mod:`coreai_torch.lowerings.helpers.accumulation`); with those casts."""
    element = ir.RankedTensorType(op.result.type).element_type
    if isinstance(element, ir.F32Type):
        matmuls = _right_operand_of_matmuls(op.result)
        return None if matmuls is None else (matmuls, [])
    casts = _float32_casts(op)
    if casts is None:
        return None
    matmuls = []
    for c in casts:
        found = _right_operand_of_matmuls(c.result)
        if found is None:
            return None
        matmuls += found
    return matmuls, casts


def scales_after_matmul(module: ir.Module) -> int:
    """``matmul(x, dequantize(q, scale, 0, 0, axis=1))`` with 8-bit ``q`` [K, N] read by a
    float32 matmul becomes ``matmul(x, cast(q)) * scale``: the runtime multiplies N scales
    into the result instead of dequantizing K·N weights (exact up to rounding: the scale is
    constant along the reduction).  A half-precision weight the matmul reads through a cast
    to float32 (float32 accumulation) is rewritten the same way, its scales cast to float32
    (the matmul's result is then exact in the scale, where the weight was rounded to the
    half type before).  Returns how many decompressions were rewritten."""
    candidates: list[ir.Operation] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name == "coreai.dequantize":
            candidates.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    done = 0
    for op in candidates:
        data, scale, offset1, offset2, axis = op.operands
        out = ir.RankedTensorType(op.result.type)
        axis_value = constant_values(axis)
        if (
            out.rank != 2
            or ir.RankedTensorType(scale.type).rank != 1
            or axis_value is None
            or axis_value.size != 1
            or int(axis_value[0]) % 2 != 1
            or not (_splat_zero(offset1) and _splat_zero(offset2))
        ):
            continue
        found = _float32_matmuls(op)
        if found is None:
            continue
        matmuls, casts = found
        with ir.InsertionPoint(op), op.location:
            weight, scale32 = cast(data, torch.float32), cast(scale, torch.float32)
        for matmul in matmuls:
            with ir.InsertionPoint(matmul), matmul.location:
                product = cai.broadcasting_batch_matmul(matmul.operands[0], weight)
                scaled = cai.broadcasting_mul(product, scale32)  # [N] along the last axis
            matmul.result.replace_all_uses_with(scaled)
            matmul.erase()
        for c in casts:
            c.erase()
        _erase_with_constants(op)
        done += 1
    return done


#: operands of each decompression op that have the output's element type
_OUTPUT_TYPED = {
    "coreai.blockwise_shift_scale": (1, 3),  # scale, offset2
    "coreai.dequantize": (1, 3),
    "coreai.lut_to_dense": (1,),  # the palettes
}


def decompress_to_float32(module: ir.Module) -> int:
    """A compressed weight decompressed to the half type and only read through casts to
    float32 (the float32 accumulation of a half-precision program's matmuls) is decompressed
    to float32 directly: its scales, offsets or palettes (small) are cast instead of the
    whole weight.  The weight is then exactly the stored codes times float32 parameters
    (before: rounded to the half type), and the runtime skips a half-precision pass over
    every weight on every call.  Returns how many decompressions were rewritten."""
    candidates: list[tuple[ir.Operation, list[ir.Operation]]] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name in _OUTPUT_TYPED:
            data = ir.RankedTensorType(op.operands[0].type).element_type
            casts = _float32_casts(op) if ir.IntegerType.isinstance(data) else None
            if casts is not None:
                candidates.append((op, casts))
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    for op, casts in candidates:
        operands = list(op.operands)
        with ir.InsertionPoint(op), op.location:
            for index in _OUTPUT_TYPED[op.name]:
                operands[index] = cast(operands[index], torch.float32)
            shape = ir.RankedTensorType(op.result.type).shape
            result_type = ir.RankedTensorType.get(shape, ir.F32Type.get())
            clone = ir.Operation.create(
                op.name,
                results=[result_type],
                operands=operands,
                attributes={a.name: a.attr for a in op.attributes},
            )
        for c in casts:
            c.result.replace_all_uses_with(clone.result)
            c.erase()
        _erase_with_constants(op)
    return len(candidates)


# ------------------------------------------------- embedding lookups of compressed tables ---

#: element widths ``gather_nd`` reads correctly when they are stored packed (2-bit data
#: verifies but is read wrong; 1-, 3- and 6-bit data do not verify)
_GATHERABLE_BITS = (4, 8)


def _gatherable(value: ir.Value) -> bool:
    element = ir.RankedTensorType(value.type).element_type
    if ir.IntegerType.isinstance(element):
        return ir.IntegerType(element).width in _GATHERABLE_BITS
    return str(element).startswith("f8")


def _rows(value: ir.Value, ids: ir.Value) -> ir.Value:
    """Per-row parameters gathered by ``ids`` (``[n, 1]``), kept as they are when they do
    not vary along the rows.  Never a reshape of a stored constant (Core AI folds it into an
    anonymous copy)."""
    shape = shape_of(value)
    if not shape or shape[0] == 1:
        return value
    count = shape_of(ids)[0]
    splat = splat_value(value)
    if splat is not None and count is not None:  # zero offsets: the same splat per id
        ttype = ir.RankedTensorType.get([count, *shape[1:]], splat.type)
        return cai.ConstantOp(value=ir.DenseElementsAttr.get_splat(ttype, splat)).result
    return cai.gather_nd(value, ids)  # 1-D (dequantize's per-row parameters): [n]


def _dequantize_axis(decompress: ir.Operation) -> int | None:
    """The axis a ``dequantize`` has parameters along (None: one per tensor)."""
    along = constant_values(decompress.operands[4])
    rank = ir.RankedTensorType(decompress.result.type).rank
    return int(along[0]) % rank if along is not None and along.size == 1 else None


def _palette_rows(indices: ir.Value, lut: ir.Value, ids: ir.Value) -> ir.Value:
    """``lut_to_dense`` of the rows ``ids`` of a table, as gathers (the runtime's
    ``lut_to_dense`` takes indices of a static shape only): the palettes of the rows looked
    up, flattened per row, read at each gathered index plus the offset of its palette along
    the other axes (no reshape of a stored constant, which Core AI folds into a copy)."""
    shape = static_shape_of(indices)  # stored tables: static shapes
    rest, rank = shape[1:], len(shape)
    *groups, entries, _ = static_shape_of(lut)
    codes = cai.gather_nd(indices, ids)
    si32 = ir.IntegerType.get_signed(32)
    flat = cai.cast(codes, ir.RankedTensorType.get(ir.RankedTensorType(codes.type).shape, si32))
    stride = entries
    for axis in reversed(range(1, rank)):
        if groups[axis] > 1:
            along = [1] * rank
            along[axis] = shape[axis]
            block = shape[axis] // groups[axis]
            positions = np.arange(shape[axis], dtype=np.int32) // block * stride
            flat = cai.broadcasting_add(flat, cai.constant(positions.reshape(along)))
        stride *= groups[axis]
    row_palette = cai.broadcasting_floor_divide(ids, cai.constant(np.int32(shape[0] // groups[0])))
    palettes = reshape_dynamic(cai.gather_nd(lut, row_palette), [-1, stride], [None, stride])
    size = int(np.prod(rest))
    values = cai.gather_along_axis(
        palettes, reshape_dynamic(flat, [-1, size], [None, size]), i32(1)
    )
    return reshape_dynamic(values, [-1, *rest], [None, *rest])


def _lookup(decompress: ir.Operation, ids: ir.Value) -> ir.Value:
    """``decompress`` applied to the rows ``ids`` (``[n, 1]`` si32) of its table only.
    For a dynamic number of ids: ``lut_to_dense`` becomes a gather of palette entries and
    ``dequantize`` (whose parameters must have a static shape) ``blockwise_shift_scale``."""
    rows = static_shape_of(decompress.result)[0]  # a stored table: static
    dynamic = shape_of(ids)[0] is None
    data, *params = decompress.operands
    if decompress.name == "coreai.lut_to_dense":
        lut, axis = params
        if dynamic:
            return _palette_rows(data, lut, ids)
        groups = static_shape_of(lut)[0]
        if groups not in (1, rows):
            size = rows // groups
            ids_type = ir.RankedTensorType(ids.type)
            divisor = cai.constant(np.full([1, 1], size, np.int32), dtype=ids_type.element_type)
            lut = cai.gather_nd(lut, cai.broadcasting_floor_divide(ids, divisor))
        elif groups == rows:
            lut = cai.gather_nd(lut, ids)
        return cai.lut_to_dense(cai.gather_nd(data, ids), lut, axis)
    if decompress.name == "coreai.dequantize":
        if _dequantize_axis(decompress) == 0:
            params[:3] = [_rows(v, ids) for v in params[:3]]
            if dynamic:  # dequantize's parameters must have a static shape
                column = [-1] + [1] * (len(shape_of(data)) - 1)
                per_row = [reshape_dynamic(v, column, [None, *column[1:]]) for v in params[:3]]
                return cai.blockwise_shift_scale(cai.gather_nd(data, ids), *per_row)
        return cai.dequantize(cai.gather_nd(data, ids), *params)
    gathered = [_rows(v, ids) for v in params]
    return cai.blockwise_shift_scale(cai.gather_nd(data, ids), *gathered)


def _lookup_is_possible(decompress: ir.Operation, dynamic: bool) -> bool:
    """Whether the rows of the table ``decompress`` makes can be decompressed alone (looked
    up by a ``dynamic`` number of ids or not): 4- or 8-bit data, parameters per row or
    shared by all rows (not by blocks of rows)."""
    if decompress.name not in _DECOMPRESSORS:  # (may have several results: read_handle)
        return False
    table = ir.RankedTensorType(decompress.result.type)
    if table.rank not in (2, 3) or not _gatherable(decompress.operands[0]):
        return False
    if any(  # gather_nd does not read e8m0 (MX) scales
        isinstance(ir.RankedTensorType(v.type).element_type, ir.Float8E8M0FNUType)
        for v in decompress.operands[1:]
        if ir.RankedTensorType.isinstance(v.type)
    ):
        return False
    if decompress.name == "coreai.blockwise_shift_scale":
        rows = table.shape[0]
        return all(shape_of(v)[0] in (1, rows) for v in decompress.operands[1:])
    if decompress.name == "coreai.lut_to_dense":
        return not dynamic or shape_of(decompress.operands[1])[-1] == 1  # a value per entry
    # dequantize: per row, or (parameters of a static shape) a static number of rows
    return _dequantize_axis(decompress) == 0 or not dynamic


def lookups_before_decompression(module: ir.Module) -> int:
    """``gather_nd(decompress(table), ids)`` (an embedding lookup of a compressed ``[V, D]``
    table, or the experts each token selected from a compressed ``[E, K, N]`` stack) becomes
    ``decompress(gather_nd(table, ids))``: only the rows looked up are decompressed (and
    read), not the whole table on every call.  For 4- and 8-bit data (what ``gather_nd``
    reads correctly); the number of ids may be dynamic (a prompt of any length), the shapes
    are then taken from the ids at run time.  Returns how many lookups were rewritten."""
    lookups: list[ir.Operation] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if is_row_lookup(op) or is_row_lookup(op, rank=3):
            source = op.operands[0].owner
            dynamic = not ir.RankedTensorType(op.operands[1].type).has_static_shape
            if not isinstance(source, ir.Block) and _lookup_is_possible(operation(source), dynamic):
                lookups.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    for op in lookups:
        decompress = operation(op.operands[0].owner)
        with ir.InsertionPoint(op), op.location:
            sizes, batch, count = lookup_batch(op.operands[1])
            rows = _lookup(decompress, reshape_dynamic(op.operands[1], [-1, 1], [count, 1]))
            rest = shape_of(op.result)[len(batch) :]
            value = reshape_dynamic(rows, [*sizes, *rest], shape_of(op.result))
        op.result.replace_all_uses_with(value)
        op.erase()
        if not list(decompress.result.uses):
            _erase_with_constants(decompress)
    return len(lookups)


_DECOMPRESSORS = frozenset(
    {"coreai.blockwise_shift_scale", "coreai.dequantize", "coreai.lut_to_dense"}
)
