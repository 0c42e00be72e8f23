"""``AIProgram.compress(config)``: store a converted program's weights compressed.

Each float weight the configuration selects is fitted (:mod:`coreai_torch.quantize`) and its
constant replaced by compressed constants and the op that decompresses them
(:mod:`coreai_torch.compressed`), in the program's own precision (a float16 program gets
float16 scales and palettes).  What a weight can be compressed as depends on what reads it:

* a matmul (either operand), a convolution's kernel or an embedding lookup (``gather_nd`` of
  rows, or ``gather_along_axis`` of the columns of a table stored transposed): the output
  channel and the reduction axis follow from the reader, blocks run along the reduction
  axis and palettes are shared by groups of output channels;
* a weight read only through a transpose (``nn.Linear`` before ``optimize()``) is stored
  transposed instead, so the reader gets the decompressed weight directly;
* anything else (an elementwise op, a state, an output) keeps the weight as it is, and the
  report says why.

Weights already compressed (by an earlier ``compress()`` or because the model was
quantized with torchao) are listed as such and left alone: compressing twice would compound
the error.  8-bit weights with one scale per output channel read by a float32 matmul are
finally rewritten into ``cast -> matmul -> scale`` (:func:`scales_after_matmul`), the
runtime's fastest form, and embedding lookups of compressed tables gather the compressed
rows before decompressing them (:func:`lookups_before_decompression`).  ``optimize()`` runs
both too (for models quantized with torchao).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from coreai_torch import compressed, dtypes
from coreai_torch._mlir import cai, ir
from coreai_torch.compression import CompressionConfig, LinearQuantization, Palettization
from coreai_torch.hazards import _constant_values
from coreai_torch.lowerings.common import cast, reshape, shape_of
from coreai_torch.passes.pretranspose import is_row_lookup, weight_constants
from coreai_torch.quantize import palettize, quantize_linear
from coreai_torch.weights import WeightStore, resource_name

_MATMULS = frozenset({"coreai.decomposable.broadcasting_batch_matmul", "coreai.batch_matmul"})
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
_DECOMPRESSORS = frozenset(
    {"coreai.blockwise_shift_scale", "coreai.dequantize", "coreai.lut_to_dense"}
)
#: derived constants holding a compressed weight's codes (see compressed.Decompression)
_CODES = re.compile(r"^(.*)\.(?:codes|indices)(?:_\d+)?$")


def _operation(owner: Any) -> ir.Operation:
    return owner.operation if isinstance(owner, ir.OpView) else owner


# -------------------------------------------------------------------------------- report ---


@dataclass
class CompressedWeight:
    """One weight as ``compress()`` stored it."""

    name: str
    form: str
    bits: int
    shape: tuple[int, ...]
    bytes_before: int
    bytes_after: int
    #: reconstruction signal-to-noise ratio, 10·log10(Σw² / Σ(w - ŵ)²), in dB
    snr_db: float
    #: what reads it: "matmul", "convolution" or "embedding"
    reader: str

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "shape": list(self.shape)}


@dataclass
class CompressionReport:
    """What ``AIProgram.compress()`` did: the compressed weights, the weights it left alone
    (with the reason), and the bytes before and after."""

    config: str
    weights: list[CompressedWeight] = field(default_factory=list)
    #: (weight name, why it was not compressed)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def bytes_before(self) -> int:
        return sum(w.bytes_before for w in self.weights)

    @property
    def bytes_after(self) -> int:
        return sum(w.bytes_after for w in self.weights)

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "weights": [w.to_dict() for w in self.weights],
            "skipped": [{"name": n, "reason": r} for n, r in self.skipped],
            "bytes_before": self.bytes_before,
            "bytes_after": self.bytes_after,
            "seconds": self.seconds,
        }

    def summary(self) -> str:
        """One line: how many weights, bytes before -> after."""
        ratio = self.bytes_after / self.bytes_before if self.bytes_before else 1.0
        return (
            f"{len(self.weights)} weight(s) ({self.config}): "
            f"{_mb(self.bytes_before)} -> {_mb(self.bytes_after)} ({ratio:.3f}x)"
            + (f", {len(self.skipped)} left as they were" if self.skipped else "")
        )

    def __str__(self) -> str:
        lines = [f"compressed {self.summary()} in {self.seconds:.2f} s"]
        if self.weights:
            width = max(len(w.name) for w in self.weights)
            form = max(len(w.form) for w in self.weights)
            lines.append(
                f"  {'weight':<{width}}  {'shape':<12} {'form':<{form}} {'before':>10} "
                f"{'after':>10}  {'SNR':>8}"
            )
            for w in self.weights:
                shape = "x".join(map(str, w.shape))
                lines.append(
                    f"  {w.name:<{width}}  {shape:<12} {w.form:<{form}} "
                    f"{_mb(w.bytes_before):>10} {_mb(w.bytes_after):>10}  {w.snr_db:5.1f} dB"
                )
        if self.skipped:
            lines.append("  left as they were:")
            lines += [f"    {name}: {reason}" for name, reason in self.skipped]
        return "\n".join(lines)


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f} MB" if n >= 2**20 else f"{n / 2**10:.1f} KB"


# ------------------------------------------------------------------------------- readers ---


@dataclass
class _Plan:
    """How one weight is compressed: in which layout, along which axes."""

    name: str
    constants: list[ir.Operation]
    #: the transposes the weight is read through, absorbed into a transposed layout
    transposes: list[ir.Operation]
    #: the permutation of the stored layout relative to the weight (identity: as it is)
    perm: tuple[int, ...]
    channel_axis: int
    reduction_axis: int
    reader: str
    head: bool


def _reader(use: ir.OpOperand, rank: int) -> tuple[str, int, int] | str:
    """``(kind, channel axis, reduction axis)`` of one reader of a weight value (axes of the
    value as read), or why it cannot read a compressed weight."""
    user = _operation(use.owner)
    name, position = user.name, use.operand_number
    if name in _MATMULS and rank == 2 and position in (0, 1):
        return ("matmul", 1, 0) if position == 1 else ("matmul", 0, 1)
    if name in _CONVOLUTIONS and position == 1 and rank >= 3:
        return ("convolution", 0, 1)
    if position == 0 and rank == 2 and is_row_lookup(user):
        return ("embedding", 0, 1)
    if name == "coreai.gather_along_axis" and position == 0 and rank == 2:
        axis = _constant_values(user.operands[2])
        if axis is not None and axis.size == 1 and int(axis[0]) % 2 == 1:
            return ("embedding", 1, 0)
    return (
        f"read by {name} (only matmuls, convolutions and embedding lookups read compressed weights)"
    )


def _reaches_output(value: ir.Value, depth: int = 8) -> bool:
    """Whether ``value`` flows into a graph output through shape ops and bias adds."""
    if depth == 0:
        return False
    for use in value.uses:
        user = _operation(use.owner)
        if user.name == "coreai.output":
            return True
        if user.name in _TO_OUTPUT and any(_reaches_output(r, depth - 1) for r in user.results):
            return True
    return False


def _swap(op: ir.Operation) -> bool:
    """Whether ``op`` is a transpose swapping the two axes of a matrix."""
    if op.name != "coreai.transpose":
        return False
    perm = _constant_values(op.operands[1])
    return perm is not None and perm.tolist() == [1, 0]


def _plan(name: str, constants: list[ir.Operation], rank: int) -> _Plan | str:
    """How weight ``name`` (read through ``constants``) can be compressed, or why not."""
    transposes = []
    direct = []
    for const in constants:
        for use in const.result.uses:
            user = _operation(use.owner)
            (transposes if rank == 2 and _swap(user) else direct).append(use)
    through_transposes = bool(transposes) and not direct
    if through_transposes:
        uses = [u for t in transposes for u in t.owner.result.uses]
        perm: tuple[int, ...] = (1, 0)
    else:
        uses, perm = direct + transposes, tuple(range(rank))
    axes = set()
    kinds = set()
    head = False
    for use in uses:
        user = _operation(use.owner)
        if not through_transposes and rank == 2 and _swap(user):
            inner = [_reader(u, rank) for u in user.result.uses]
            if any(isinstance(r, str) for r in inner) or not inner:
                return next((r for r in inner if isinstance(r, str)), "read by an unused transpose")
            found = [(k, 1 - c, 1 - r) for k, c, r in inner]  # type: ignore[misc]
            head = head or any(_reaches_output(u.owner.result) for u in user.result.uses)
        else:
            found = [_reader(use, rank)]
            if isinstance(found[0], str):
                return found[0]
            head = head or (found[0][0] == "matmul" and _reaches_output(user.result))
        for kind, channel, reduction in found:  # type: ignore[misc]
            kinds.add(kind)
            axes.add((channel, reduction))
    if not uses:
        return "not read"
    if len(axes) != 1:
        return "its readers disagree on which axis holds the output channels"
    channel, reduction = axes.pop()
    reader = "embedding" if "embedding" in kinds else kinds.pop()
    return _Plan(
        name,
        constants,
        [_operation(t.owner) for t in transposes] if through_transposes else [],
        perm,
        channel,
        reduction,
        reader,
        head,
    )


def _selected(config: CompressionConfig, plan: _Plan) -> str | None:
    """Why the configuration leaves a compressible weight alone (None: it compresses it)."""
    if plan.reader == "embedding" and not config.embeddings:
        return "an embedding table (embeddings=False)"
    if plan.head and not config.output_head:
        return "the output head (output_head=False)"
    return None


# ---------------------------------------------------------------------------- fitting ---


def _fit(
    config: CompressionConfig, weight: np.ndarray, plan: _Plan, dtype: torch.dtype
) -> tuple[Any, str] | str:
    """The codes of ``weight`` (in the stored layout) and their SNR in dB, or why the
    configuration cannot be applied to it."""
    shape = weight.shape
    channels, reduced = shape[plan.channel_axis], shape[plan.reduction_axis]
    if isinstance(config, LinearQuantization):
        params = [1] * weight.ndim
        params[plan.channel_axis] = channels
        block = config.block_size
        if block is not None and block < reduced:
            if reduced % block:
                return f"its input size {reduced} is not a multiple of block_size={block}"
            params[plan.reduction_axis] = reduced // block
        scale_dtype = dtypes.to_numpy(config.scale_dtype or dtype)
        return quantize_linear(
            weight, params, config.bits, symmetric=config.symmetric, scale_dtype=scale_dtype
        )
    group = config.group_size
    if group is not None and group < channels and channels % group:
        return f"its {channels} output channels are not a multiple of group_size={group}"
    group = None if group is None or group >= channels else group
    return palettize(weight, plan.channel_axis, group, config.bits, config.iterations)


def _as_float32(tensor: torch.Tensor, perm: tuple[int, ...]) -> np.ndarray:
    """The weight as float32 numpy in the stored layout: a (strided) view of a float32
    weight, a converted copy of a float16 / bfloat16 one."""
    t = tensor.detach()
    if t.dtype != torch.float32:
        t = t.float()
    return t.permute(perm).numpy()


# ------------------------------------------------------------------------------- rewrite ---


def _replace(plan: _Plan, decompression: compressed.Decompression) -> None:
    """Replace the weight's constants (and the transposes absorbed into the stored layout)
    by the decompression, built once per constant (per graph)."""
    for const in plan.constants:
        with ir.InsertionPoint(const), const.location:
            value = decompression.build()
        if plan.transposes:
            for transpose in [_operation(u.owner) for u in const.result.uses]:
                perm = _operation(transpose.operands[1].owner)
                transpose.result.replace_all_uses_with(value)
                transpose.erase()
                if not list(perm.result.uses):
                    perm.erase()
        else:
            const.result.replace_all_uses_with(value)
        const.erase()


def _already_compressed(module: ir.Module, store: WeightStore) -> list[str]:
    """Names of the weights the module reads compressed: the derived constants holding
    their codes (``<weight>.codes``) or palette indices (``<weight>.indices``)."""
    names: dict[str, None] = {}

    def visit(op: ir.Operation) -> ir.WalkResult:
        name = resource_name(op)
        if name is not None and name in store.derived_by_name:
            match = _CODES.match(name)
            if match:
                names[match[1]] = None
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return list(names)


def display_name(resource: str) -> str:
    """A weight's name as users know it (``fc.weight``, not ``fc.weight.T``, the resource
    ``optimize()`` stores it transposed in)."""
    return resource.removesuffix(".T")


def compress(program: Any, config: CompressionConfig) -> CompressionReport:
    """Compress the weights of ``program`` (an ``AIProgram`` from ``TorchConverter``) that
    ``config`` selects; returns the report.  Modifies the program in place."""
    from coreai_torch.program import _verify

    if not isinstance(config, (LinearQuantization, Palettization)):
        raise TypeError(
            "compress() takes a coreai_torch.compression.LinearQuantization or Palettization, "
            f"got {type(config).__name__}"
        )
    store = getattr(program, "weights", None)
    if store is None:
        raise ValueError(
            "compress() needs a program converted by TorchConverter (its weights are not known)"
        )
    start = time.perf_counter()
    report = CompressionReport(config.describe())
    module = program.structural_module  # reads weights from the store, never constant data
    with module.context, ir.Location.unknown():
        for name in _already_compressed(module, store):
            report.skipped.append((display_name(name), "already compressed"))
        for resource, constants in weight_constants(module, store).items():
            name = display_name(resource)
            tensor = store.by_name[resource]
            element = ir.RankedTensorType(constants[0].result.type).element_type
            dtype = dtypes.to_torch(element) if not ir.IntegerType.isinstance(element) else None
            if dtype not in compressed.FLOAT_DTYPES or tensor.dim() < 2:
                continue  # integer tables, biases, norms: never compressed
            if tensor.numel() < config.min_elements or not config.selects(name):
                continue
            plan = _plan(name, constants, tensor.dim())
            reason = plan if isinstance(plan, str) else _selected(config, plan)
            if reason is not None:
                report.skipped.append((name, reason))
                continue
            weight = _as_float32(tensor, plan.perm)
            fitted = _fit(config, weight, plan, dtype)
            if isinstance(fitted, str):
                report.skipped.append((name, fitted))
                continue
            codes, snr = fitted
            decompression = (
                compressed.linear_decompression(
                    store, name, codes, dtype, getattr(config, "scale_dtype", None)
                )
                if isinstance(codes, compressed.LinearCodes)
                else compressed.palette_decompression(store, name, codes, dtype)
            )
            _replace(plan, decompression)
            report.weights.append(
                CompressedWeight(
                    name,
                    config.describe(),
                    config.bits,
                    tuple(tensor.shape)[:: -1 if resource.endswith(".T") else 1],
                    tensor.numel() * tensor.element_size(),
                    decompression.stored_bytes,
                    snr,
                    plan.reader,
                )
            )
        scales_after_matmul(module)
        lookups_before_decompression(module)
    _verify(module, "after compress()")
    report.seconds = time.perf_counter() - start
    return report


# ------------------------------------------------------------ int8 cast -> matmul -> scale ---


def _splat_zero(value: ir.Value) -> bool:
    if isinstance(value.owner, ir.Block):
        return False
    op = _operation(value.owner)
    if op.name != "coreai.constant":
        return False
    attr = op.attributes["value"]
    if not ir.DenseElementsAttr.isinstance(attr) or not ir.DenseElementsAttr(attr).is_splat:
        return False
    splat = ir.DenseElementsAttr(attr).get_splat_value()
    return float(splat.value) == 0.0


def scales_after_matmul(module: ir.Module) -> int:
    """``matmul(x, dequantize(q, scale, 0, 0, axis=1))`` with 8-bit ``q`` [K, N] and float32
    output becomes ``matmul(x, cast(q)) * scale``: the runtime multiplies N scales into the
    result instead of dequantizing K·N weights (exact up to rounding: the scale is constant
    along the reduction).  Returns how many decompressions were rewritten."""
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
        axis_value = _constant_values(axis)
        if (
            out.rank != 2
            or not isinstance(out.element_type, ir.F32Type)
            or ir.RankedTensorType(scale.type).rank != 1
            or axis_value is None
            or axis_value.size != 1
            or int(axis_value[0]) % 2 != 1
            or not (_splat_zero(offset1) and _splat_zero(offset2))
        ):
            continue
        users = [_operation(u.owner) for u in op.result.uses]
        if not users or any(
            u.name not in _MATMULS or u.operands[1] != op.result or u.operands[0] == op.result
            for u in users
        ):
            continue
        for matmul in users:
            with ir.InsertionPoint(matmul), matmul.location:
                product = cai.broadcasting_batch_matmul(
                    matmul.operands[0], cast(data, torch.float32)
                )
                scaled = cai.broadcasting_mul(product, scale)  # [N] along the last axis
            matmul.result.replace_all_uses_with(scaled)
            matmul.erase()
        op.erase()
        done += 1
    return done


# ------------------------------------------------- embedding lookups of compressed tables ---

#: element widths ``gather_nd`` reads correctly when they are stored packed (2-bit data
#: verifies but is read wrong; 1-, 3- and 6-bit data do not verify)
_GATHERABLE_BITS = (4, 8)


def _gatherable(value: ir.Value) -> bool:
    element = ir.RankedTensorType(value.type).element_type
    if ir.IntegerType.isinstance(element):
        return ir.IntegerType(element).width in _GATHERABLE_BITS
    return str(element).startswith("f8")


def _splat(value: ir.Value) -> ir.Attribute | None:
    if isinstance(value.owner, ir.Block):
        return None
    op = _operation(value.owner)
    attr = op.attributes["value"] if op.name == "coreai.constant" else None
    if attr is None or not ir.DenseElementsAttr.isinstance(attr):
        return None
    dense = ir.DenseElementsAttr(attr)
    return dense.get_splat_value() if dense.is_splat else None


def _rows(value: ir.Value, rows: int, ids: ir.Value) -> ir.Value | None:
    """Per-row parameters gathered by ``ids`` (``[n, 1]``), kept as they are when they do
    not vary along the rows, None when rows share them in blocks."""
    shape = shape_of(value)
    if not shape or shape[0] == 1:
        return value
    if shape[0] != rows:
        return None
    count = shape_of(ids)[0]
    splat = _splat(value)
    if splat is not None:  # zero offsets: the same splat, one row per id
        ttype = ir.RankedTensorType.get([count, *shape[1:]], splat.type)
        return cai.ConstantOp(value=ir.DenseElementsAttr.get_splat(ttype, splat)).result
    if len(shape) == 1:  # dequantize's 1-D per-row parameters
        return reshape(cai.gather_nd(reshape(value, [rows, 1]), ids), [count])
    return cai.gather_nd(value, ids)


def _lookup(decompress: ir.Operation, ids: ir.Value) -> ir.Value | None:
    """``decompress`` applied to the rows ``ids`` (``[n, 1]`` si32) of its table only."""
    rows = shape_of(decompress.result)[0]
    if decompress.name == "coreai.dequantize":
        data, scale, offset1, offset2, axis = decompress.operands
        along = _constant_values(axis)
        params = [scale, offset1, offset2]
        if along is not None and along.size == 1 and int(along[0]) == 0:
            params = [_rows(v, rows, ids) for v in params]  # type: ignore[misc]
        return cai.dequantize(cai.gather_nd(data, ids), *params, axis)
    if decompress.name == "coreai.blockwise_shift_scale":
        data, *params = decompress.operands
        gathered = [_rows(v, rows, ids) for v in params]
        if any(v is None for v in gathered):
            return None
        return cai.blockwise_shift_scale(cai.gather_nd(data, ids), *gathered)
    if decompress.name == "coreai.lut_to_dense":
        indices, lut, axis = decompress.operands
        groups = shape_of(lut)[0]
        if groups not in (1, rows):
            size = rows // groups
            ids_type = ir.RankedTensorType(ids.type)
            divisor = cai.constant(np.full([1, 1], size, np.int32), dtype=ids_type.element_type)
            lut = cai.gather_nd(lut, cai.broadcasting_floor_divide(ids, divisor))
        elif groups == rows:
            lut = cai.gather_nd(lut, ids)
        return cai.lut_to_dense(cai.gather_nd(indices, ids), lut, axis)
    return None


def lookups_before_decompression(module: ir.Module) -> int:
    """``gather_nd(decompress(table), ids)`` (an embedding lookup of a compressed ``[V, D]``
    table) becomes ``decompress(gather_nd(table, ids))``: only the rows looked up are
    decompressed, not the whole table on every call.  For 4- and 8-bit data (what
    ``gather_nd`` reads correctly).  Returns how many lookups were rewritten."""
    lookups: list[ir.Operation] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name == "coreai.gather_nd" and is_row_lookup(op):
            source = op.operands[0].owner
            if not isinstance(source, ir.Block) and _operation(source).name in _DECOMPRESSORS:
                lookups.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    done = 0
    for op in lookups:
        decompress = _operation(op.operands[0].owner)
        table = ir.RankedTensorType(decompress.result.type)
        if table.rank != 2 or not _gatherable(decompress.operands[0]):
            continue
        out_shape = shape_of(op.result)
        count = int(np.prod(out_shape[:-1]))
        with ir.InsertionPoint(op), op.location:
            ids = reshape(op.operands[1], [count, 1])
            rows = _lookup(decompress, ids)
            if rows is None:
                continue
            value = reshape(rows, out_shape)
        op.result.replace_all_uses_with(value)
        op.erase()
        if not list(decompress.result.uses):
            sources = [o.owner for o in decompress.operands if not isinstance(o.owner, ir.Block)]
            decompress.erase()
            for source in map(_operation, sources):
                if source.name == "coreai.constant" and not list(source.result.uses):
                    source.erase()
        done += 1
    return done
