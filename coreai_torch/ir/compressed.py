"""Compressed weights: bit-packing and the native decompression ops, with their operand rules.

Core AI stores a weight compressed and decompresses it in the graph.  This module is the one
place that builds those ops; the torchao / PT2E lowerings (``lowerings/quantized.py``) and
``AIProgram.compress()`` (``compression/apply.py``) both describe a weight as
:class:`LinearCodes` or :class:`PaletteCodes` (numpy arrays) and build its
:class:`Decompression` with :func:`decompression` (:func:`linear_decompression` /
:func:`palette_decompression`):

* linear quantization, ``(codes - zero_point) * scale``: ``coreai.dequantize`` for 8-bit data
  with one scale per tensor or per channel (the runtime's fastest form), otherwise
  ``coreai.blockwise_shift_scale`` (2-, 4- and 8-bit integers, float8; 1- and 3-bit codes are
  stored in 2 and 4 bits, 5- to 7-bit codes in 8);
* palettes: ``coreai.lut_to_dense`` (1, 2, 3, 4, 6 and 8-bit indices; 5- and 7-bit indices are
  stored in 6 and 8 bits with the palette padded).

What it guarantees (each verified on the runtime, see ``docs/compression.md``):

* sub-byte constants are bit-packed LSB first in row-major order (:func:`pack_bits`); the
  runtime reads one-byte-per-element buffers of those types as wrong values, with no error;
* every operand obeys the rules whose violation the runtime aborts on
  (:func:`decompression_problems`, also run on every converted program by ``to_coreai()``);
* a cast of compressed data is never constant-folded into a float weight, which would
  silently store the weight uncompressed (:mod:`coreai_torch.passes.weight_casts`, a fold guard).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import torch

from coreai_torch import dtypes
from coreai_torch._mlir import cai, ir
from coreai_torch.errors import RuntimeHazardError
from coreai_torch.ir.weights import INLINE_LIMIT, WeightStore

#: code bits -> the integer width ``blockwise_shift_scale`` / ``dequantize`` store them in
LINEAR_STORAGE_BITS = {1: 2, 2: 2, 3: 4, 4: 4, 5: 8, 6: 8, 7: 8, 8: 8}
#: index bits -> the width ``lut_to_dense`` stores them in
PALETTE_STORAGE_BITS = {1: 1, 2: 2, 3: 3, 4: 4, 5: 6, 6: 6, 7: 8, 8: 8}
#: float8 formats a weight may be stored in, by numpy dtype
FLOAT8_TYPES = {
    np.dtype(ml_dtypes.float8_e4m3fn): ir.Float8E4M3FNType,
    np.dtype(ml_dtypes.float8_e5m2): ir.Float8E5M2Type,
}
#: output dtypes of the decompression ops
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ------------------------------------------------------------------------- bit packing ---


def pack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    """``codes`` (integers) as the runtime's packed bitstream: row-major, element 0 in the
    low bits of byte 0, ``ceil(n * bits / 8)`` bytes (3- and 6-bit codes cross bytes)."""
    flat = np.ascontiguousarray(codes).reshape(-1).view(np.uint8)
    if bits == 8:
        return flat.copy()
    mask = np.uint8((1 << bits) - 1)
    if 8 % bits == 0:  # whole codes per byte: shift and OR the columns of a [bytes, k] view
        per_byte = 8 // bits
        padded = np.zeros(math.ceil(flat.size / per_byte) * per_byte, np.uint8)
        padded[: flat.size] = flat & mask
        lanes = padded.reshape(-1, per_byte)
        out = lanes[:, 0].copy()
        for i in range(1, per_byte):
            out |= lanes[:, i] << np.uint8(i * bits)
        return out
    out = np.zeros(math.ceil(flat.size * bits / 8), np.uint8)
    chunk = 1 << 20  # codes per step (a multiple of 8, so chunks start on byte boundaries)
    for start in range(0, flat.size, chunk):
        part = flat[start : start + chunk] & mask
        planes = (part[:, None] >> np.arange(bits, dtype=np.uint8)) & 1
        packed = np.packbits(planes.reshape(-1), bitorder="little")
        first = start * bits // 8
        out[first : first + packed.size] = packed
    return out


def unpack_bits(packed: np.ndarray, bits: int, count: int, *, signed: bool = False) -> np.ndarray:
    """The first ``count`` codes of a :func:`pack_bits` stream (int8 if ``signed``, else uint8)."""
    data = np.ascontiguousarray(packed).reshape(-1).view(np.uint8)
    if bits == 8:
        codes = data[:count].copy()
    else:
        planes = np.unpackbits(data, bitorder="little")[: count * bits].reshape(count, bits)
        weights = (1 << np.arange(bits)).astype(np.uint16)
        codes = (planes.astype(np.uint16) @ weights).astype(np.uint8)
    if not signed:
        return codes
    if bits == 8:
        return codes.view(np.int8)
    wide = codes.astype(np.int16)
    wide[wide >= 1 << (bits - 1)] -= 1 << bits
    return wide.astype(np.int8)


def integer_type(bits: int, signed: bool) -> ir.Type:
    return ir.IntegerType.get_signed(bits) if signed else ir.IntegerType.get_unsigned(bits)


def integer_bounds(dtype: torch.dtype) -> tuple[int, int] | None:
    """(min, max) of an integer torch dtype of at most 8 bits (``torch.int4``, ``torch.uint2``,
    ... included), else None."""
    match = re.fullmatch(r"torch\.(u?)int(\d+)", str(dtype))
    if match is None or int(match[2]) > 8:
        return None
    return code_range(int(match[2]), not match[1])


def code_range(bits: int, signed: bool) -> tuple[int, int]:
    """The smallest and largest ``bits``-bit integer."""
    return (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)


# ------------------------------------------------------------------- compressed weights ---


def _check_blocks(shape: Sequence[int], params: Sequence[int], what: str) -> None:
    if len(params) != len(shape) or any(
        p <= 0 or s % p for s, p in zip(shape, params, strict=True)
    ):
        raise ValueError(
            f"{what} of shape {tuple(params)} does not divide the weight's shape "
            f"{tuple(shape)} into blocks (same rank, each size a divisor)"
        )


def _expand(params: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    """Per-block parameters repeated to the weight's shape."""
    out = params
    for axis, (size, blocks) in enumerate(zip(shape, params.shape, strict=True)):
        if blocks != size:
            out = np.repeat(out, size // blocks, axis=axis)
    return out


@dataclass
class LinearCodes:
    """A linearly quantized weight, ``(codes - zero_point) * scale`` per block.

    ``scale`` and ``zero_point`` have the weight's rank; along each axis ``d`` one of their
    elements covers ``codes.shape[d] // scale.shape[d]`` weight elements (``[N, 1]``: one per
    row; ``[N, K // 32]``: blocks of 32 along each row).  ``codes`` holds one code per byte
    (int8 when ``signed``, else uint8), or float8 values (then ``bits`` is 8 and there is no
    zero point).
    """

    codes: np.ndarray
    bits: int
    scale: np.ndarray
    zero_point: np.ndarray | None = None
    signed: bool = True

    def __post_init__(self) -> None:
        if self.is_float8:
            self.bits, self.signed = 8, True
            if self.zero_point is not None and np.any(self.zero_point):
                raise ValueError("float8 weights have no zero point")
            self.zero_point = None
        elif self.bits not in LINEAR_STORAGE_BITS:
            raise ValueError(f"linear quantization needs 1 to 8 bits, got {self.bits}")
        _check_blocks(self.codes.shape, self.scale.shape, "the scale")
        if self.zero_point is not None:
            _check_blocks(self.codes.shape, self.zero_point.shape, "the zero point")
            if self.zero_point.shape != self.scale.shape:
                raise ValueError("the zero point and the scale must have the same shape")

    @property
    def ndim(self) -> int:
        return self.codes.ndim

    @property
    def is_float8(self) -> bool:
        return self.codes.dtype in FLOAT8_TYPES

    @property
    def storage_bits(self) -> int:
        return 8 if self.is_float8 else LINEAR_STORAGE_BITS[self.bits]

    @property
    def block_shape(self) -> tuple[int, ...]:
        return tuple(s // p for s, p in zip(self.codes.shape, self.scale.shape, strict=True))

    def dequantized(self) -> np.ndarray:
        """The float32 weight the codes stand for (computed as torchao does)."""
        values = self.codes.astype(np.float32)
        if self.zero_point is not None:
            values = values - _expand(self.zero_point.astype(np.float32), self.codes.shape)
        return values * _expand(self.scale.astype(np.float32), self.codes.shape)

    def transposed(self) -> LinearCodes:
        """The same weight transposed (rank 2)."""
        zp = None if self.zero_point is None else np.ascontiguousarray(self.zero_point.T)
        return LinearCodes(
            np.ascontiguousarray(self.codes.T),
            self.bits,
            np.ascontiguousarray(self.scale.T),
            zp,
            self.signed,
        )


@dataclass
class PaletteCodes:
    """A palettized weight: ``lut[group, indices]`` with ``lut`` of shape
    ``[*groups, 2**bits, 1]`` (``groups`` has the weight's rank; one palette per block of
    ``shape[d] // groups[d]`` elements along each axis ``d``)."""

    indices: np.ndarray
    bits: int
    lut: np.ndarray

    def __post_init__(self) -> None:
        if self.bits not in PALETTE_STORAGE_BITS:
            raise ValueError(f"palettes need 1 to 8 index bits, got {self.bits}")
        rank = self.indices.ndim
        if self.lut.ndim != rank + 2 or self.lut.shape[-2:] != (2**self.bits, 1):
            raise ValueError(
                f"a {self.bits}-bit palette of a rank-{rank} weight has shape "
                f"[*groups, {2**self.bits}, 1], got {tuple(self.lut.shape)}"
            )
        _check_blocks(self.indices.shape, self.lut.shape[:rank], "the palette groups")

    @property
    def ndim(self) -> int:
        return self.indices.ndim

    @property
    def storage_bits(self) -> int:
        return PALETTE_STORAGE_BITS[self.bits]

    def dequantized(self) -> np.ndarray:
        """The float32 weight the indices stand for."""
        rank = self.indices.ndim
        groups = self.lut.shape[:rank]
        flat_groups = np.zeros(self.indices.shape, np.int64)
        for axis in range(rank):
            block = self.indices.shape[axis] // groups[axis]
            position = np.arange(self.indices.shape[axis]) // block
            shape = [1] * rank
            shape[axis] = -1
            flat_groups = flat_groups * groups[axis] + position.reshape(shape)
        palettes = self.lut.reshape(-1, 2**self.bits).astype(np.float32)
        return palettes[flat_groups, self.indices.astype(np.int64)]

    def transposed(self) -> PaletteCodes:
        """The same weight transposed (rank 2)."""
        lut = np.ascontiguousarray(self.lut.transpose(1, 0, 2, 3))
        return PaletteCodes(np.ascontiguousarray(self.indices.T), self.bits, lut)


# ---------------------------------------------------------------------------- emitters ---


def _numpy_float(dtype: torch.dtype) -> type[np.generic]:
    if dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"compressed weights decompress to float32, float16 or bfloat16, not {dtype}"
        )
    return dtypes.to_numpy(dtype)


@dataclass
class Decompression:
    """How one compressed weight is decompressed: its constants (attributes, created once)
    and the op that expands them.  :meth:`build` emits them at the insertion point, once per
    graph that reads the weight, all graphs sharing the same stored bytes."""

    name: str
    op: Callable[..., ir.Value]
    #: the op's operands: a constant's attribute, or (attribute, element type) for a
    #: constant stored in another precision and cast (scales kept in float16)
    operands: list[ir.Attribute | tuple[ir.Attribute, ir.Type]]
    #: bytes of the resources created for the weight
    stored_bytes: int = 0

    def build(self) -> ir.Value:
        values = []
        for operand in self.operands:
            attr, cast_to = operand if isinstance(operand, tuple) else (operand, None)
            value = cai.ConstantOp(value=attr).result
            if cast_to is not None:
                shape = ir.RankedTensorType(value.type).shape
                value = cai.cast(value, ir.RankedTensorType.get(shape, cast_to))
            values.append(value)
        result = self.op(*values)
        op = result.owner.operation if isinstance(result.owner, ir.OpView) else result.owner
        problems = decompression_problems(op)
        if problems:
            op.erase()
            raise RuntimeHazardError(
                f"weight '{self.name}': {op.name} would abort the Core AI runtime: "
                + "; ".join(problems)
            )
        return result


class _Constants:
    """Creates the attributes of one weight's constants, counting the bytes stored."""

    def __init__(self, store: WeightStore, name: str) -> None:
        self.store = store
        self.name = name
        self.stored_bytes = 0

    def array(
        self, array: np.ndarray, suffix: str, element_type: ir.Type, packed_bits: int = 8
    ) -> ir.Attribute:
        """``array`` as a constant of ``element_type``: inline when tiny, else a resource of
        the store (bit-packed when ``packed_bits`` is below 8)."""
        ttype = ir.RankedTensorType.get(list(array.shape), element_type)
        if array.size < INLINE_LIMIT:
            if array.dtype in FLOAT8_TYPES or array.dtype == ml_dtypes.bfloat16:
                values = [ir.FloatAttr.get(element_type, float(v)) for v in array.reshape(-1)]
                return ir.DenseElementsAttr.get(values, type=ttype)
            return ir.DenseElementsAttr.get(np.ascontiguousarray(array), type=ttype)
        data = pack_bits(array, packed_bits) if packed_bits < 8 else array
        self.stored_bytes += data.nbytes
        return self.store.derived(data, f"{self.name}.{suffix}", ttype)

    @staticmethod
    def zeros(shape: Sequence[int], element_type: ir.Type) -> ir.Attribute:
        ttype = ir.RankedTensorType.get(list(shape), element_type)
        zero = (
            ir.IntegerAttr.get(element_type, 0)
            if ir.IntegerType.isinstance(element_type)
            else ir.FloatAttr.get(element_type, 0.0)
        )
        return ir.DenseElementsAttr.get_splat(ttype, zero)

    @staticmethod
    def index(values: int | Sequence[int], element_type: ir.Type) -> ir.Attribute:
        array = np.array(
            values, dtype=np.int16 if ir.IntegerType(element_type).width == 16 else np.int32
        )
        ttype = ir.RankedTensorType.get(list(array.shape), element_type)
        return ir.DenseElementsAttr.get(array, type=ttype)


def _channel_axis(shape: Sequence[int], params: Sequence[int]) -> int | str | None:
    """The one axis the parameters vary along (None: per tensor; "blocks": neither)."""
    varying = [a for a, p in enumerate(params) if p != 1]
    if not varying:
        return None
    if len(varying) == 1 and params[varying[0]] == shape[varying[0]]:
        return varying[0]
    return "blocks"


def linear_decompression(
    store: WeightStore,
    name: str,
    q: LinearCodes,
    dtype: torch.dtype,
    scale_dtype: torch.dtype | None = None,
) -> Decompression:
    """The constants of ``q`` (resources named ``name.*``) and the op that decompresses them
    to a ``dtype`` tensor.  Scales are stored in ``scale_dtype`` (default ``dtype``) and,
    when that differs, cast to ``dtype`` before the op (the runtime requires the scale's type
    to be the output's; the cast is never folded, see :mod:`coreai_torch.passes.weight_casts`)."""
    out_np = _numpy_float(dtype)
    out_type = dtypes.to_mlir(dtype)
    scale_np = _numpy_float(scale_dtype or dtype)
    bits = q.storage_bits
    if q.is_float8:
        data_type = FLOAT8_TYPES[q.codes.dtype].get()
    else:
        data_type = integer_type(bits, q.signed)
        low, high = code_range(q.bits, q.signed)
        if q.codes.size and (int(q.codes.min()) < low or int(q.codes.max()) > high):
            raise ValueError(
                f"weight '{name}': {q.bits}-bit {'signed' if q.signed else 'unsigned'} codes "
                f"must lie in [{low}, {high}], got [{int(q.codes.min())}, {int(q.codes.max())}]"
            )
    zero_point = q.zero_point if q.zero_point is not None and np.any(q.zero_point) else None
    offset2 = None
    if zero_point is not None:
        low, high = code_range(bits, q.signed)
        if int(zero_point.min()) < low or int(zero_point.max()) > high:
            # not representable in the data's type: subtract it after scaling instead
            offset2 = (-(zero_point.astype(np.float32) * q.scale.astype(np.float32))).astype(out_np)
            zero_point = None
    scale = q.scale.astype(scale_np)
    c = _Constants(store, name)

    def scale_operand(values: np.ndarray) -> ir.Attribute | tuple[ir.Attribute, ir.Type]:
        if scale_dtype is None or scale_dtype == dtype:
            return c.array(values, "scale", out_type)
        return c.array(values, "scale", dtypes.to_mlir(scale_dtype)), out_type

    data = c.array(q.codes, "codes", data_type, bits)
    axis = _channel_axis(q.codes.shape, q.scale.shape)
    if bits == 8 and axis != "blocks" and offset2 is None:
        # one scale per tensor or per channel: dequantize (1-D or 0-D parameters)
        scale_p = scale.reshape(-1 if axis is not None else ())
        si32 = ir.IntegerType.get_signed(32)
        operands = [
            data,
            scale_operand(scale_p),
            c.array(
                zero_point.reshape(scale_p.shape).astype(q.codes.dtype), "zero_point", data_type
            )
            if zero_point is not None
            else c.zeros(scale_p.shape, data_type),
            c.zeros(scale_p.shape, out_type),
            c.index(axis, si32) if axis is not None else c.index(list(range(q.ndim)), si32),
        ]
        op = cai.dequantize
    else:
        operands = [
            data,
            scale_operand(scale),
            c.array(zero_point.astype(q.codes.dtype), "zero_point", data_type, bits)
            if zero_point is not None
            else c.zeros(scale.shape, data_type),
            c.array(offset2, "offset", out_type)
            if offset2 is not None
            else c.zeros(scale.shape, out_type),
        ]
        op = cai.blockwise_shift_scale
    return Decompression(name, op, operands, c.stored_bytes)


def palette_decompression(
    store: WeightStore, name: str, p: PaletteCodes, dtype: torch.dtype
) -> Decompression:
    """The constants of ``p`` (resources named ``name.*``) and the ``lut_to_dense`` that
    decompresses them to a ``dtype`` tensor."""
    out_np = _numpy_float(dtype)
    bits = p.storage_bits
    lut = p.lut.astype(out_np)
    if bits != p.bits:  # stored in a wider index type: pad the palettes
        pad = [(0, 0)] * (lut.ndim - 2) + [(0, 2**bits - 2**p.bits), (0, 0)]
        lut = np.pad(lut, pad)
    if p.indices.size and int(p.indices.max()) >= 2**p.bits:
        raise ValueError(f"weight '{name}': {p.bits}-bit palette indices exceed {2**p.bits - 1}")
    c = _Constants(store, name)
    operands = [
        c.array(p.indices.astype(np.uint8), "indices", integer_type(bits, False), bits),
        c.array(lut, "palette", dtypes.to_mlir(dtype)),
        c.index(0, ir.IntegerType.get_signed(16)),
    ]
    return Decompression(name, cai.lut_to_dense, operands, c.stored_bytes)


def decompression(
    store: WeightStore, name: str, codes: LinearCodes | PaletteCodes, dtype: torch.dtype
) -> Decompression:
    """:func:`linear_decompression` or :func:`palette_decompression`, by the codes' kind."""
    if isinstance(codes, LinearCodes):
        return linear_decompression(store, name, codes, dtype)
    return palette_decompression(store, name, codes, dtype)


# ------------------------------------------------------------------------ operand rules ---


def _ranked(value: ir.Value) -> ir.RankedTensorType | None:
    return ir.RankedTensorType(value.type) if ir.RankedTensorType.isinstance(value.type) else None


def decompression_problems(op: ir.Operation) -> list[str]:
    """Why the runtime would abort on (or misread) this ``blockwise_shift_scale`` /
    ``dequantize`` op although it verifies; empty when it is safe or another op."""
    if op.name not in ("coreai.blockwise_shift_scale", "coreai.dequantize"):
        return []
    types = [_ranked(v) for v in op.operands[:4]]
    result = _ranked(op.results[0])
    if None in types or result is None:
        return []
    data, scale, offset1, offset2 = types
    problems = []
    if op.name == "coreai.dequantize":
        if max(scale.rank, offset1.rank, offset2.rank) > 1:
            problems.append(
                "dequantize takes 0-D (per tensor) or 1-D (per axis) scale and offsets; use "
                "blockwise_shift_scale for blocks"
            )
    else:
        problems += _blockwise_problems(data, scale, offset1, offset2, result)
    if offset1.element_type != data.element_type:
        problems.append(
            f"offset1 ({offset1.element_type}) must have the data's element type "
            f"{data.element_type}"
        )
    if offset2.element_type != result.element_type:
        problems.append(
            f"offset2 ({offset2.element_type}) must have the output's element type "
            f"{result.element_type}"
        )
    return problems


def _blockwise_problems(*types: ir.RankedTensorType) -> list[str]:
    data, scale, _, _, result = types
    problems = []
    ranks = [t.rank for t in types[:4]]
    if len(set(ranks)) != 1:
        problems.append(
            f"data, scale, offset1 and offset2 must all have the data's rank {data.rank}, got "
            f"ranks {ranks} (e.g. a rank-1 per-channel scale on rank-2 data: reshape it to "
            "[N, 1])"
        )
    elif (
        data.has_static_shape
        and scale.has_static_shape
        and any(s == 0 or d % s for d, s in zip(data.shape, scale.shape, strict=True))
    ):
        problems.append(
            f"the scale's shape {list(scale.shape)} must divide the data's shape {list(data.shape)}"
        )
    if not isinstance(scale.element_type, ir.Float8E8M0FNUType) and (
        scale.element_type != result.element_type
    ):
        problems.append(
            f"the scale's element type {scale.element_type} differs from the output's "
            f"{result.element_type} (they must be equal; cast the scale)"
        )
    return problems


# -------------------------------------------------------------------------- fold guard ---


def is_compressed_type(element_type: ir.Type) -> bool:
    """Integers of 1 to 8 bits (not ``i1`` booleans) and 8- or 4-bit floats."""
    if ir.IntegerType.isinstance(element_type):
        integer = ir.IntegerType(element_type)
        return integer.width <= 8 and not integer.is_signless
    return str(element_type).startswith(("f8", "f4"))
