"""Bitwise ops on integer and bool tensors: and/or/xor/not and shifts; ``hash_tensor``.

Shifts follow PyTorch: a shift by a negative amount or by at least the bit width gives 0 for
``<<`` and the sign fill for ``>>`` (``-5 >> 40 == -1``); ``>>`` is arithmetic for signed
types.  Core AI has no shift op, so shifts are multiplications / floor divisions by powers
of two (integer multiplication wraps like a shift).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import (
    cast,
    constant,
    dtype_of,
    i32,
    known_sizes,
    normalize_dims,
    rank_of,
    reshape,
    shape_of,
    static_dim,
    transpose,
)
from coreai_torch.lowerings.helpers.arithmetic import (
    gt,
    isnan_values,
    signbit_values,
)
from coreai_torch.lowerings.helpers.float_math import frexp_parts
from coreai_torch.lowerings.helpers.layout import slice_axis
from coreai_torch.lowerings.helpers.operands import (
    Operand,
    const_like,
    operand,
    uint64_bits,
)
from coreai_torch.lowerings.registry import LoweringContext, lowering


def _operands(cx: LoweringContext, a: Operand, b: Operand) -> tuple[ir.Value, ir.Value]:
    dtype = cx.out_dtype
    if dtype.is_floating_point:
        raise cx.unsupported(f"bitwise ops are not defined for {dtype}")
    return operand(a, dtype), operand(b, dtype)


def _bitwise(fn: Callable[[ir.Value, ir.Value], ir.Value]) -> Callable:
    def rule(cx: LoweringContext, self: Operand, other: Operand) -> ir.Value:
        return fn(*_operands(cx, self, other))

    return rule


for _name, _fn in {
    "and": cai.broadcasting_bitwise_and,
    "or": cai.broadcasting_bitwise_or,
    "xor": cai.broadcasting_bitwise_xor,
}.items():
    lowering(
        f"aten::bitwise_{_name}.Tensor",
        f"aten::bitwise_{_name}.Scalar",
        f"aten::bitwise_{_name}.Scalar_Tensor",
        f"aten::__{_name}__.Tensor",
        f"aten::__{_name}__.Scalar",
    )(_bitwise(_fn))


@lowering("aten::bitwise_not.default")
def bitwise_not(cx: LoweringContext, self: ir.Value) -> ir.Value:
    dtype = dtype_of(self)
    if dtype == torch.bool:
        return cai.not_(self)
    if dtype.is_floating_point:
        raise cx.unsupported(f"bitwise_not is not defined for {dtype}")
    all_ones = -1 if dtype.is_signed else torch.iinfo(dtype).max
    return cai.broadcasting_bitwise_xor(self, const_like(all_ones, self))


def _bits(dtype: torch.dtype) -> int:
    return torch.iinfo(dtype).bits


def _power_of_two(shift: ir.Value, limit: int) -> ir.Value:
    """``2 ** min(max(shift, 0), limit)`` in ``shift``'s dtype."""
    clamped = cai.broadcasting_minimum(
        cai.broadcasting_maximum(shift, const_like(0, shift)), const_like(limit, shift)
    )
    return cai.broadcasting_pow(const_like(2, shift), clamped)


def _out_of_range(shift: ir.Value, bits: int) -> ir.Value:
    return cai.broadcasting_or(
        gt(const_like(0, shift), shift), gt(shift, const_like(bits - 1, shift))
    )


def left_shift_values(x: ir.Value, shift: ir.Value) -> ir.Value:
    bits = _bits(dtype_of(x))
    shifted = cai.broadcasting_mul(x, _power_of_two(shift, bits - 1))
    return cai.broadcasting_where(_out_of_range(shift, bits), const_like(0, x), shifted)


def right_shift_values(x: ir.Value, shift: ir.Value) -> ir.Value:
    """Arithmetic shift = floor division by ``2**shift``, done in two steps so that the
    divisor stays positive (``2**(bits-1)`` overflows a signed type)."""
    dtype = dtype_of(x)
    bits = _bits(dtype)
    limit = bits - 1 if dtype.is_signed else bits
    clamped = cai.broadcasting_where(_out_of_range(shift, bits), const_like(limit, shift), shift)
    first = cai.broadcasting_minimum(clamped, const_like(bits - 2, shift))
    second = cai.broadcasting_sub(clamped, first)
    out = cai.broadcasting_floor_divide(x, _power_of_two(first, bits - 2))
    return cai.broadcasting_floor_divide(out, _power_of_two(second, 2))


def _shift_operands(cx: LoweringContext, a: Operand, b: Operand) -> tuple[ir.Value, ir.Value]:
    x, s = _operands(cx, a, b)
    if dtype_of(x) == torch.bool:
        raise cx.unsupported("shifts are not defined for bool tensors")
    return x, s


@lowering(
    "aten::bitwise_left_shift.Tensor",
    "aten::bitwise_left_shift.Tensor_Scalar",
    "aten::bitwise_left_shift.Scalar_Tensor",
    "aten::__lshift__.Tensor",
    "aten::__lshift__.Scalar",
)
def left_shift(cx: LoweringContext, self: Operand, other: Operand) -> ir.Value:
    return left_shift_values(*_shift_operands(cx, self, other))


@lowering(
    "aten::bitwise_right_shift.Tensor",
    "aten::bitwise_right_shift.Tensor_Scalar",
    "aten::bitwise_right_shift.Scalar_Tensor",
    "aten::__rshift__.Tensor",
    "aten::__rshift__.Scalar",
)
def right_shift(cx: LoweringContext, self: Operand, other: Operand) -> ir.Value:
    return right_shift_values(*_shift_operands(cx, self, other))


# ---------------------------------------------------------------------------- hash_tensor ---

_INT64_MIN = -(2**63)


def float64_bits(x: ir.Value) -> ir.Value:
    """The IEEE-754 double bit pattern of float ``x`` (upcast), as int64.

    Sign, exponent field and fraction come from ``frexp``; subnormal doubles are handled,
    NaN becomes the positive quiet NaN (its sign and payload cannot be read in Core AI).
    """
    v = cast(x, torch.float64)
    mantissa, exponent, finite_nonzero = frexp_parts(cai.abs_(v))
    field = cai.broadcasting_add(exponent, const_like(1022.0, v))  # biased exponent
    normal = gt(field, const_like(0.0, v))
    fraction = cai.broadcasting_mul(
        cai.broadcasting_sub(
            cai.broadcasting_mul(mantissa, const_like(2.0, v)), const_like(1.0, v)
        ),
        const_like(2.0**52, v),
    )
    # subnormal doubles: a 2^1074 = m 2^(e + 1074), e + 1074 in [1, 52] (a runtime power of
    # two: the compiler folds a product of two constant scales into an overflowing one)
    tiny = cai.broadcasting_mul(
        mantissa,
        cai.broadcasting_pow(
            const_like(2.0, v), cai.broadcasting_add(exponent, const_like(1074.0, v))
        ),
    )
    fraction = cai.broadcasting_where(normal, fraction, tiny)
    field = cai.broadcasting_where(normal, field, const_like(0.0, v))
    zero = const_like(0.0, v)
    nan = isnan_values(v)
    finite = cai.broadcasting_equal(cai.broadcasting_sub(v, v), zero)
    special_field = cai.broadcasting_where(finite, zero, const_like(2047.0, v))  # 0, inf, NaN
    field = cai.broadcasting_where(finite_nonzero, field, special_field)
    fraction = cai.broadcasting_where(finite_nonzero, fraction, zero)
    fraction = cai.broadcasting_where(nan, const_like(2.0**51, v), fraction)
    bits = cai.broadcasting_add(
        cai.broadcasting_mul(cast(field, torch.int64), constant(2**52, torch.int64)),
        cast(fraction, torch.int64),
    )
    negative = cai.broadcasting_and(signbit_values(v), cai.not_(nan))
    return cai.broadcasting_where(
        negative, cai.broadcasting_add(bits, constant(_INT64_MIN, torch.int64)), bits
    )


def xor_reduce_last(x: ir.Value) -> ir.Value:
    """XOR over the (static) last axis, by halving: (..., L) -> (..., 1)."""
    axis = rank_of(x) - 1
    length = static_dim(x, -1)
    while length > 1:
        half = length // 2
        folded = cai.broadcasting_bitwise_xor(
            slice_axis(x, axis, 0, half), slice_axis(x, axis, half, 2 * half)
        )
        if length % 2:
            folded = cai.concat(i32(axis), [folded, slice_axis(x, axis, 2 * half, length)])
        x, length = folded, half + length % 2
    return x


@lowering("aten::hash_tensor.default")
def hash_tensor(
    cx: LoweringContext,
    self: ir.Value,
    dim: Sequence[int] = (),
    keepdim: bool = False,
    mode: int = 0,
) -> ir.Value:
    """Mode 0: the XOR of the elements' 64-bit patterns (floats upcast to float64, integers
    to int64 / uint64), as uint64."""
    if mode != 0:
        raise cx.unsupported(f"hash_tensor mode={mode} (only mode 0, xor, exists)")
    shape = known_sizes(shape_of(self))
    if shape is None:
        raise cx.unsupported("hash_tensor needs static shapes")
    dtype = dtype_of(self)
    if dtype.is_floating_point:
        bits = float64_bits(self)
    elif dtype == torch.uint64:
        bits = self
    else:
        bits = cast(self, torch.int64)
    rank = len(shape)
    axes = normalize_dims(dim, rank)
    kept = [d for d in range(rank) if d not in axes]
    if rank:
        bits = transpose(bits, [*kept, *axes])
        size = int(np.prod([shape[d] for d in axes], dtype=np.int64))
        bits = xor_reduce_last(reshape(bits, [*(shape[d] for d in kept), size]))
    out_shape = (
        [1 if d in axes else shape[d] for d in range(rank)] if keepdim else [shape[d] for d in kept]
    )
    bits = reshape(bits, out_shape)
    return bits if dtype_of(bits) == torch.uint64 else uint64_bits(bits)
