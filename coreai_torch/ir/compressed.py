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
  stored in 6 and 8 bits with the palette padded), scalar or vector palettes, float or 8-bit
  integer palettes, optionally scaled per block after the lookup (``blockwise_shift_scale``);
* sparse weights (:class:`SparseCodes`): the kept values and a bit mask,
  ``coreai.build_sparse_with_bitmask`` + ``coreai.sparse_with_bitmask_to_dense``.

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
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import TypeAlias, overload

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
#: FP4 (E2M1) codes, stored packed two per byte (``blockwise_shift_scale`` only)
FLOAT4 = np.dtype(ml_dtypes.float4_e2m1fn)
#: power-of-two scales of MX formats, kept in this type (no cast: the runtime takes them for
#: any output type)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
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
    if 8 % bits == 0 and sys.byteorder == "little":
        return _pack_words(flat, bits)
    out = np.zeros(math.ceil(flat.size * bits / 8), np.uint8)
    chunk = 1 << 20  # codes per step (a multiple of 8, so chunks start on byte boundaries)
    for start in range(0, flat.size, chunk):
        part = flat[start : start + chunk] & mask
        planes = (part[:, None] >> np.arange(bits, dtype=np.uint8)) & 1
        packed = np.packbits(planes.reshape(-1), bitorder="little")
        first = start * bits // 8
        out[first : first + packed.size] = packed
    return out


#: integer type holding the bytes of ``8 // bits`` codes, by code bits
_WORDS = {4: torch.int16, 2: torch.int32, 1: torch.int64}


def _pack_words(flat: np.ndarray, bits: int) -> np.ndarray:
    """:func:`pack_bits` for codes that fill whole bytes (1, 2, 4 bits): the ``8 // bits``
    codes of each output byte read as one little-endian word, each code shifted into place
    with one shift and mask per code over the words (torch's vectorised kernels), a
    cache-sized step at a time."""
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    codes = torch.from_numpy(flat if flat.flags.writeable else flat.copy())
    if flat.size % per_byte:
        codes = torch.cat([codes, codes.new_zeros(per_byte - flat.size % per_byte)])
    words = codes.view(_WORDS[bits])
    packed = torch.empty(words.numel(), dtype=torch.uint8)
    step = min(words.numel(), 1 << 18)
    out, shifted = torch.empty(step, dtype=words.dtype), torch.empty(step, dtype=words.dtype)
    for first in range(0, words.numel(), step):
        part = words[first : first + step]
        word, temporary = out[: part.numel()], shifted[: part.numel()]
        torch.bitwise_and(part, mask, out=word)
        for i in range(1, per_byte):  # code i: bits 8i.. of the word -> bits i*bits..
            torch.bitwise_right_shift(part, i * (8 - bits), out=temporary)
            word |= temporary.bitwise_and_(mask << (i * bits))
        packed[first : first + step].copy_(word)
    return packed.numpy()


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
    """A linearly quantized weight, ``(codes - zero_point) * scale + offset`` per block.

    ``scale``, ``zero_point`` and ``offset`` have the weight's rank; along each axis ``d`` one
    of their elements covers ``codes.shape[d] // scale.shape[d]`` weight elements (``[N, 1]``:
    one per row; ``[N, K // 32]``: blocks of 32 along each row).  ``codes`` holds one code per
    byte (int8 when ``signed``, else uint8), or float8 / FP4 (``ml_dtypes.float4_e2m1fn``)
    values (then ``bits`` is their width and there is no zero point).  ``offset`` (float, added
    after scaling) is the min-value formulation's ``minval`` (with ``zero_point`` the smallest
    code).  ``scale`` may be ``float8_e8m0fnu`` (MX scales, stored as they are).
    """

    codes: np.ndarray
    bits: int
    scale: np.ndarray
    zero_point: np.ndarray | None = None
    signed: bool = True
    offset: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.is_float:
            self.bits, self.signed = (4 if self.codes.dtype == FLOAT4 else 8), True
            if self.zero_point is not None and np.any(self.zero_point):
                raise ValueError("float8 / float4 weights have no zero point")
            self.zero_point = None
        elif self.bits not in LINEAR_STORAGE_BITS:
            raise ValueError(f"linear quantization needs 1 to 8 bits, got {self.bits}")
        _check_blocks(self.codes.shape, self.scale.shape, "the scale")
        if self.zero_point is not None:
            _check_blocks(self.codes.shape, self.zero_point.shape, "the zero point")
            if self.zero_point.shape != self.scale.shape:
                raise ValueError("the zero point and the scale must have the same shape")
        if self.offset is not None and self.offset.shape != self.scale.shape:
            raise ValueError("the offset and the scale must have the same shape")

    @property
    def ndim(self) -> int:
        return self.codes.ndim

    @property
    def is_float8(self) -> bool:
        return self.codes.dtype in FLOAT8_TYPES

    @property
    def is_float(self) -> bool:
        """float8 or FP4 codes."""
        return self.is_float8 or self.codes.dtype == FLOAT4

    @property
    def storage_bits(self) -> int:
        if self.is_float:
            return self.bits
        return LINEAR_STORAGE_BITS[self.bits]

    @property
    def block_shape(self) -> tuple[int, ...]:
        return tuple(s // p for s, p in zip(self.codes.shape, self.scale.shape, strict=True))

    def dequantized(self) -> np.ndarray:
        """The float32 weight the codes stand for (computed as torchao does)."""
        values = self.codes.astype(np.float32)
        if self.zero_point is not None:
            values = values - _expand(self.zero_point.astype(np.float32), self.codes.shape)
        values = values * _expand(self.scale.astype(np.float32), self.codes.shape)
        if self.offset is not None:
            values = values + _expand(self.offset.astype(np.float32), self.codes.shape)
        return values

    def transposed(self) -> LinearCodes:
        """The same weight transposed (rank 2)."""
        return LinearCodes(
            _t(self.codes),
            self.bits,
            _t(self.scale),
            _t(self.zero_point),
            self.signed,
            _t(self.offset),
        )


@overload
def _t(array: np.ndarray) -> np.ndarray: ...
@overload
def _t(array: None) -> None: ...
def _t(array: np.ndarray | None) -> np.ndarray | None:
    return None if array is None else np.ascontiguousarray(array.T)


@dataclass
class PaletteCodes:
    """A palettized weight: ``lut[group, indices]`` with ``lut`` of shape
    ``[*groups, 2**bits, V]`` (``groups`` has the weight's rank; one palette per block of
    ``indices.shape[d] // groups[d]`` indices along each axis ``d``).

    ``V > 1`` (vector palettes): each index stands for ``V`` consecutive weights along
    ``vector_axis`` (the indices are ``V`` times shorter there).  The palettes are float, or
    8-bit integers (a quantized palette, read as integers unless scaled); ``scale`` /
    ``zero_point`` (the weight's rank, one element per block of the weight) map the looked-up
    values to ``(value - zero_point) * scale`` (a float palette may have a ``scale`` too:
    per-channel scales of a shared palette)."""

    indices: np.ndarray
    bits: int
    lut: np.ndarray
    vector_axis: int = 0
    scale: np.ndarray | None = None
    zero_point: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.bits not in PALETTE_STORAGE_BITS:
            raise ValueError(f"palettes need 1 to 8 index bits, got {self.bits}")
        rank = self.indices.ndim
        if self.lut.ndim != rank + 2 or self.lut.shape[-2] != 2**self.bits:
            raise ValueError(
                f"a {self.bits}-bit palette of a rank-{rank} weight has shape "
                f"[*groups, {2**self.bits}, vector], got {tuple(self.lut.shape)}"
            )
        if not 0 <= self.vector_axis < rank:
            raise ValueError(f"vector_axis {self.vector_axis} is not an axis of the indices")
        _check_blocks(self.indices.shape, self.lut.shape[:rank], "the palette groups")
        if self.scale is not None:
            _check_blocks(self.shape, self.scale.shape, "the scale")
            if self.zero_point is not None and self.zero_point.shape != self.scale.shape:
                raise ValueError("the zero point and the scale must have the same shape")

    @property
    def ndim(self) -> int:
        return self.indices.ndim

    @property
    def vector(self) -> int:
        return int(self.lut.shape[-1])

    @property
    def integer_lut(self) -> bool:
        return self.lut.dtype in (np.dtype(np.int8), np.dtype(np.uint8))

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's shape."""
        shape = list(self.indices.shape)
        shape[self.vector_axis] *= self.vector
        return tuple(shape)

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
        palettes = self.lut.reshape(-1, 2**self.bits, self.vector).astype(np.float32)
        values = palettes[flat_groups, self.indices.astype(np.int64)]  # [*indices, V]
        values = np.moveaxis(values, -1, self.vector_axis + 1).reshape(self.shape)
        if self.scale is not None:
            if self.zero_point is not None:
                values = values - _expand(self.zero_point.astype(np.float32), self.shape)
            values = values * _expand(self.scale.astype(np.float32), self.shape)
        return values

    def transposed(self) -> PaletteCodes:
        """The same weight transposed (rank 2)."""
        lut = np.ascontiguousarray(self.lut.transpose(1, 0, 2, 3))
        return PaletteCodes(
            np.ascontiguousarray(self.indices.T),
            self.bits,
            lut,
            1 - self.vector_axis if self.vector > 1 else 0,
            _t(self.scale),
            _t(self.zero_point),
        )


def rows_of(
    codes: LinearCodes | PaletteCodes, first: int, count: int
) -> LinearCodes | PaletteCodes:
    """The codes of rows ``first .. first + count`` of the weight (along its first axis):
    ``first`` a multiple of the rows each scale / palette covers."""
    rows = codes.codes.shape[0] if isinstance(codes, LinearCodes) else codes.indices.shape[0]
    stop = min(first + count, rows)

    def cut(name: str, array: np.ndarray) -> np.ndarray:
        per = rows // array.shape[0]  # rows of the weight one element covers
        if first % per:
            raise ValueError(f"row {first} is inside a block of {per} rows of {name}")
        return array[first // per : -(-stop // per)]

    return _arrays_changed(codes, cut)


def joined_rows(pieces: Sequence[LinearCodes | PaletteCodes]) -> LinearCodes | PaletteCodes:
    """The codes of consecutive pieces of rows (:func:`rows_of`) as those of the whole."""
    if len(pieces) == 1:
        return pieces[0]
    return _arrays_changed(
        pieces[0], lambda name, _: np.concatenate([getattr(p, name) for p in pieces])
    )


def _arrays_changed(
    codes: LinearCodes | PaletteCodes, change: Callable[[str, np.ndarray], np.ndarray]
) -> LinearCodes | PaletteCodes:
    """``codes`` with each array field (not a scalar one) replaced by ``change(name, array)``."""
    values = {f.name: getattr(codes, f.name) for f in fields(codes)}
    for name, value in values.items():
        if isinstance(value, np.ndarray) and value.ndim:
            values[name] = change(name, value)
    return type(codes)(**values)


@dataclass
class SparseCodes:
    """A sparse weight: the ``values`` (1-D, float) at the positions ``mask`` (bool, the
    weight's shape) holds, in row-major order; zeros elsewhere."""

    mask: np.ndarray
    values: np.ndarray

    def __post_init__(self) -> None:
        self.mask = np.asarray(self.mask, dtype=bool)
        kept = int(self.mask.sum())
        if self.values.ndim != 1 or self.values.size != kept:
            raise ValueError(
                f"the mask keeps {kept} values, but {self.values.size} are given "
                f"(shape {tuple(self.values.shape)})"
            )

    @property
    def ndim(self) -> int:
        return self.mask.ndim

    def dequantized(self) -> np.ndarray:
        out = np.zeros(self.mask.shape, np.float32)
        out[self.mask] = self.values.astype(np.float32)
        return out

    def transposed(self) -> SparseCodes:
        """The same weight transposed (rank 2)."""
        dense = np.zeros(self.mask.shape, self.values.dtype)
        dense[self.mask] = self.values
        mask = np.ascontiguousarray(self.mask.T)
        return SparseCodes(mask, np.ascontiguousarray(dense.T[mask]))


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
    operands: list[Operand]
    #: bytes of the resources created for the weight
    stored_bytes: int = 0
    #: ops applied to the result in turn, ``op(result, *operands)`` (a palette's scale)
    stages: list[tuple[Callable[..., ir.Value], list[Operand]]] = field(default_factory=list)

    def build(self) -> ir.Value:
        result = self._apply(self.op, [], self.operands)
        for op, operands in self.stages:
            result = self._apply(op, [result], operands)
        return result

    def _apply(
        self, fn: Callable[..., ir.Value], first: list[ir.Value], operands: list
    ) -> ir.Value:
        values = list(first)
        for operand in operands:
            attr, cast_to = operand if isinstance(operand, tuple) else (operand, None)
            value = cai.ConstantOp(value=attr).result
            if cast_to is not None:
                shape = ir.RankedTensorType(value.type).shape
                value = cai.cast(value, ir.RankedTensorType.get(shape, cast_to))
            values.append(value)
        result = fn(*values)
        check_decompression(result, f"weight '{self.name}'")
        return result


#: an operand of a decompression op: a constant's attribute, or (attribute, element type)
Operand: TypeAlias = ir.Attribute | tuple[ir.Attribute, ir.Type]


def check_decompression(result: ir.Value, what: str) -> None:
    """Raise (erasing the op) if the op making ``result`` would abort the runtime."""
    op = result.owner.operation if isinstance(result.owner, ir.OpView) else result.owner
    problems = decompression_problems(op)
    if problems:
        name = op.name
        op.erase()
        raise RuntimeHazardError(
            f"{what}: {name} would abort the Core AI runtime: " + "; ".join(problems)
        )


#: numpy dtypes whose inline constants are built from Python floats
_FLOAT_ATTR_TYPES = (*FLOAT8_TYPES, FLOAT4, E8M0, np.dtype(ml_dtypes.bfloat16))


def _uniform(array: np.ndarray) -> bool:
    """Whether every element of ``array`` equals the first (a splat)."""
    flat = array.reshape(-1)
    if flat.dtype in _FLOAT_ATTR_TYPES:
        flat = flat.view(np.uint8)
    if not flat.size or not np.all(flat[:256] == flat[0]):  # most arrays differ early
        return False
    return bool(np.all(flat == flat[0]))


def splat_attr(ttype: ir.RankedTensorType, value: object) -> ir.Attribute:
    """A splat attribute of ``ttype`` holding ``value``."""
    element = ttype.element_type
    if ir.IntegerType.isinstance(element):
        attr = ir.IntegerAttr.get(element, int(value))  # type: ignore[call-overload]
    else:
        attr = ir.FloatAttr.get(element, float(value))  # type: ignore[arg-type]
    return ir.DenseElementsAttr.get_splat(ttype, attr)


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
        if array.size and (array.size < INLINE_LIMIT or _uniform(array)):
            if _uniform(array):
                return splat_attr(ttype, array.reshape(-1)[0])
            if array.dtype in _FLOAT_ATTR_TYPES:
                values = [ir.FloatAttr.get(element_type, float(v)) for v in array.reshape(-1)]
                return ir.DenseElementsAttr.get(values, type=ttype)
            return ir.DenseElementsAttr.get(np.ascontiguousarray(array), type=ttype)
        data = pack_bits(array, packed_bits) if packed_bits < 8 else array
        self.stored_bytes += data.nbytes
        return self.store.derived(data, f"{self.name}.{suffix}", ttype)

    @staticmethod
    def zeros(shape: Sequence[int], element_type: ir.Type) -> ir.Attribute:
        return splat_attr(ir.RankedTensorType.get(list(shape), element_type), 0)

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
    elif q.codes.dtype == FLOAT4:
        data_type = ir.Float4E2M1FNType.get()
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
    if q.offset is not None and np.any(q.offset):  # the min-value formulation's minval
        added = q.offset.astype(np.float32)
        offset2 = (added if offset2 is None else offset2.astype(np.float32) + added).astype(out_np)
    mx_scale = q.scale.dtype == E8M0
    scale = q.scale if mx_scale else q.scale.astype(scale_np)
    c = _Constants(store, name)

    def scale_operand(values: np.ndarray) -> ir.Attribute | tuple[ir.Attribute, ir.Type]:
        if mx_scale:  # power-of-two scales, read as they are whatever the output type
            return c.array(values, "scale", ir.Float8E8M0FNUType.get())
        if scale_dtype is None or scale_dtype == dtype:
            return c.array(values, "scale", out_type)
        return c.array(values, "scale", dtypes.to_mlir(scale_dtype)), out_type

    data = c.array(q.codes, "codes", data_type, bits)
    axis = _channel_axis(q.codes.shape, q.scale.shape)
    if bits == 8 and axis != "blocks" and offset2 is None and not mx_scale:
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
            c.index(axis, si32) if isinstance(axis, int) else c.index(list(range(q.ndim)), si32),
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
    decompresses them to a ``dtype`` tensor (followed by a ``blockwise_shift_scale`` when the
    palette is scaled).  ``dtype`` is the palette's own integer type for an unscaled integer
    palette."""
    bits = p.storage_bits
    if p.integer_lut:
        lut = p.lut
        lut_type = integer_type(8, p.lut.dtype == np.dtype(np.int8))
        if p.scale is None:
            out_np, out_type = None, lut_type
        else:
            out_np, out_type = _numpy_float(dtype), dtypes.to_mlir(dtype)
    else:
        out_np, out_type = _numpy_float(dtype), dtypes.to_mlir(dtype)
        lut = p.lut.astype(out_np)
        lut_type = out_type
    if bits != p.bits:  # stored in a wider index type: pad the palettes
        pad = [(0, 0)] * (lut.ndim - 2) + [(0, 2**bits - 2**p.bits), (0, 0)]
        lut = np.pad(lut, pad)
    if p.indices.size and int(p.indices.max()) >= 2**p.bits:
        raise ValueError(f"weight '{name}': {p.bits}-bit palette indices exceed {2**p.bits - 1}")
    c = _Constants(store, name)
    operands: list[Operand] = [
        c.array(p.indices.astype(np.uint8), "indices", integer_type(bits, False), bits),
        c.array(lut, "palette", lut_type),
        c.index(p.vector_axis, ir.IntegerType.get_signed(16)),
    ]
    stages: list[tuple[Callable[..., ir.Value], list[Operand]]] = []
    if p.scale is not None:
        shape = p.scale.shape
        zero_point = (
            c.array(p.zero_point.astype(p.lut.dtype), "zero_point", lut_type)
            if p.zero_point is not None and p.integer_lut
            else c.zeros(shape, lut_type)
        )
        scale = c.array(p.scale.astype(out_np), "scale", out_type)
        offset2 = c.zeros(shape, out_type)
        if p.zero_point is not None and not p.integer_lut and np.any(p.zero_point):
            offset = -(p.zero_point.astype(np.float32) * p.scale.astype(np.float32))
            offset2 = c.array(offset.astype(out_np), "offset", out_type)
        stages.append((cai.blockwise_shift_scale, [scale, zero_point, offset2]))
    return Decompression(name, cai.lut_to_dense, operands, c.stored_bytes, stages)


def sparse_decompression(
    store: WeightStore, name: str, s: SparseCodes, dtype: torch.dtype
) -> Decompression:
    """The constants of ``s`` (the kept values and the bit mask, ``name.values`` /
    ``name.mask``) and the ops that decompress them to a ``dtype`` tensor."""
    out_np = _numpy_float(dtype)
    out_type = dtypes.to_mlir(dtype)
    c = _Constants(store, name)
    if not s.values.size:  # nothing kept (a zero-element constant would abort the runtime)
        return Decompression(name, lambda v: v, [c.zeros(s.mask.shape, out_type)])
    operands: list[Operand] = [
        c.array(s.values.astype(out_np), "values", out_type),
        c.array(s.mask.astype(np.uint8), "mask", ir.IntegerType.get_unsigned(1), 1),
    ]

    def densify(values: ir.Value, mask: ir.Value) -> ir.Value:
        return cai.sparse_with_bitmask_to_dense(cai.build_sparse_with_bitmask(values, mask))

    return Decompression(name, densify, operands, c.stored_bytes)


def decompression(
    store: WeightStore,
    name: str,
    codes: LinearCodes | PaletteCodes | SparseCodes,
    dtype: torch.dtype,
) -> Decompression:
    """The decompression of ``codes``, by their kind."""
    if isinstance(codes, LinearCodes):
        return linear_decompression(store, name, codes, dtype)
    if isinstance(codes, SparseCodes):
        return sparse_decompression(store, name, codes, dtype)
    return palette_decompression(store, name, codes, dtype)


# ------------------------------------------------------------------------ operand rules ---


def _ranked(value: ir.Value) -> ir.RankedTensorType | None:
    return ir.RankedTensorType(value.type) if ir.RankedTensorType.isinstance(value.type) else None


def decompression_problems(op: ir.Operation) -> list[str]:
    """Why the runtime would abort on (or misread) this ``blockwise_shift_scale`` /
    ``dequantize`` op although it verifies; empty when it is safe or another op."""
    if op.name not in ("coreai.blockwise_shift_scale", "coreai.dequantize"):
        return []
    data, scale, offset1, offset2 = (_ranked(v) for v in op.operands[:4])
    result = _ranked(op.results[0])
    if data is None or scale is None or offset1 is None or offset2 is None or result is None:
        return []
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
    if isinstance(data.element_type, ir.Float4E2M1FNType) and not isinstance(
        scale.element_type, (ir.Float8E8M0FNUType, ir.F16Type, ir.BF16Type, ir.Float8E4M3FNType)
    ):
        problems.append(
            f"float4 data needs an f8E8M0FNU, f16, bf16 or f8E4M3FN scale, not {scale.element_type}"
        )
    elif not isinstance(scale.element_type, ir.Float8E8M0FNUType) and (
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
