"""Symbolic sizes: ``sym_size``/``sym_numel``, Python arithmetic on SymInts, runtime asserts.

Programs exported with ``torch.export.Dim`` compute sizes at run time.  A SymInt node becomes a
0-d ``si32`` value (read from ``coreai.get_shape``), a SymFloat a 0-d ``f32`` value and a
SymBool a 0-d ``i1`` value; tensor ops receive those values in their size arguments (see
``values.shape_vector``).  Asserts on sizes (``_assert_scalar``, ``sym_constrain_range*``) are
checked by torch.export when the program is traced and emit nothing.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.fx

from coreai_torch._mlir import cai, ir
from coreai_torch.frontend.sizes import ItemGuard
from coreai_torch.ir.values import (
    cast,
    constant,
    dim_size,
    dtype_of,
    index_value,
    known_sizes,
    normalize_dim,
    rank_of,
    shape_of,
    size_product,
    squeeze,
)
from coreai_torch.locations import qualified_name
from coreai_torch.lowerings.helpers.operands import SymOperand, sym_scalar
from coreai_torch.lowerings.registry import LoweringContext, lowering, raw_lowering


def _numeric(*operands: SymOperand) -> list[ir.Value]:
    """Operands as 0-d values of one numeric dtype (f32 if any is a float, else si32)."""
    values = [sym_scalar(x) for x in operands]
    is_float = any(dtype_of(v).is_floating_point for v in values)
    return [cast(v, torch.float32 if is_float else torch.int32) for v in values]


def _sym_rule(*targets: Callable[..., Any]) -> Callable[[Callable], Callable]:
    """Register ``fn(*operands)`` for Python-level SymInt ops (operands resolved to values)."""

    def decorate(fn: Callable[..., ir.Value]) -> Callable[..., ir.Value]:
        def callback(values_map: dict[str, ir.Value], node: torch.fx.Node, loc: ir.Location):
            args = [_resolve(values_map, a) for a in node.args]
            return fn(*args)

        callback.__name__ = fn.__name__
        callback.__doc__ = fn.__doc__
        callback.__wrapped__ = fn  # type: ignore[attr-defined]
        raw_lowering(*[qualified_name(t) for t in targets])(callback)
        return fn

    return decorate


def _resolve(values_map: dict[str, ir.Value], arg: Any) -> Any:
    if isinstance(arg, torch.fx.Node):
        return values_map[arg.name]
    if isinstance(arg, (list, tuple)):
        return [_resolve(values_map, a) for a in arg]
    return arg


# ------------------------------------------------------------------------------- sizes -----


@lowering("aten::sym_size.int")
def sym_size(cx: LoweringContext, self: ir.Value, dim: int) -> ir.Value:
    return index_value(dim_size(self, dim))


@lowering("aten::sym_numel.default")
def sym_numel(cx: LoweringContext, self: ir.Value) -> ir.Value:
    return index_value(size_product([dim_size(self, d) for d in range(rank_of(self))]))


@lowering("aten::sym_stride.int")
def sym_stride(cx: LoweringContext, self: ir.Value, dim: int) -> ir.Value:
    """Strides of the contiguous layout (Core AI values have no other)."""
    d = normalize_dim(dim, rank_of(self))
    return index_value(size_product([dim_size(self, k) for k in range(d + 1, rank_of(self))]))


@lowering("aten::sym_storage_offset.default")
def sym_storage_offset(cx: LoweringContext, self: ir.Value) -> ir.Value:
    return index_value(0)


@lowering(
    "aten::_local_scalar_dense.default",
    "aten::item.default",
)
def item(cx: LoweringContext, self: ir.Value) -> ir.Value:
    """``tensor.item()``: the single element as a 0-d symbolic value."""
    sizes = known_sizes(shape_of(self))
    if sizes is None or math.prod(sizes) != 1:
        raise cx.unsupported("item() needs a tensor with exactly one element")
    value = squeeze(self, list(range(rank_of(self))))
    dtype = dtype_of(value)
    if dtype == torch.bool:
        return value
    if dtype.is_floating_point:
        return cast(value, torch.float32)
    value = cast(value, torch.int32)
    importer = cx.importer
    sizes = getattr(getattr(importer, "signature", None), "sizes", None)
    guard = sizes.guard(cx.node.name) if sizes is not None else None
    if guard is not None and cx.node.graph is importer.ep.graph:
        value = _range_guard(value, guard)
    return value


def _range_guard(value: ir.Value, guard: ItemGuard) -> ir.Value:
    """``value`` unchanged, but the runtime fails (recoverably) when it is outside the guard's
    range: it gathers from a ``guard.table``-entry table at 0 in range and at
    ``+-(table + 1) * excess`` otherwise (the excess computed in f32 and clamped to
    ``guard.most``, so that nothing overflows si32)."""
    step = guard.table + 1
    index = constant(0, torch.int32)
    as_float = cast(value, torch.float32)

    def excess(amount: ir.Value) -> ir.Value:
        amount = cai.broadcasting_maximum(amount, np.float32(1))
        return cast(cai.broadcasting_minimum(amount, np.float32(guard.most)), torch.int32)

    if guard.lower is not None:
        below = cai.broadcasting_greater(constant(guard.lower, torch.int32), value)
        amount = excess(cai.broadcasting_sub(np.float32(guard.lower), as_float))
        index = cai.broadcasting_where(below, cai.broadcasting_mul(amount, np.int32(-step)), index)
    if guard.upper is not None:
        above = cai.broadcasting_greater(value, constant(guard.upper, torch.int32))
        amount = excess(cai.broadcasting_sub(as_float, np.float32(guard.upper)))
        index = cai.broadcasting_where(above, cai.broadcasting_mul(amount, np.int32(step)), index)
    table = constant(np.arange(guard.table, dtype=np.int32), torch.int32)
    checked = cai.gather_nd(table, cai.expand_dims(index, np.array([0], np.int32)))
    return cai.broadcasting_add(value, checked)  # checked is 0 whenever the program goes on


@lowering(
    "aten::_assert_scalar.default",
    "aten::_assert_async.msg",
    "aten::_assert_async.default",
    "aten::sym_constrain_range.default",
    "aten::sym_constrain_range_for_size.default",
)
def runtime_assert(cx: LoweringContext, **_: object) -> None:
    """Checked by torch.export for every size the program accepts; nothing to emit."""
    return None


# -------------------------------------------------------------------------- arithmetic -----


@_sym_rule(operator.add, torch.sym_sum)
def sym_add(a: SymOperand, b: SymOperand | None = None) -> ir.Value:
    if isinstance(a, list):  # sym_sum(list)
        total = sym_scalar(a[0])
        for x in a[1:]:
            total = sym_add(total, x)
        return total
    x, y = _numeric(a, b)
    return cai.add(x, y)


def _binary(op: Callable[[ir.Value, ir.Value], ir.Value]) -> Callable[..., ir.Value]:
    def rule(a: SymOperand, b: SymOperand) -> ir.Value:
        return op(*_numeric(a, b))

    rule.__name__ = f"sym_{op.__name__.rstrip('_')}"
    return rule


# Binary ops that map one to one (operands promoted to one dtype first).
for _target, _op in {
    operator.sub: cai.sub,
    operator.mul: cai.mul,
    operator.pow: cai.pow_,
    torch.sym_max: cai.maximum,
    torch.sym_min: cai.minimum,
    operator.eq: cai.equal,
    operator.ne: cai.not_equal,
    operator.gt: cai.greater,
}.items():
    _sym_rule(_target)(_binary(_op))


@_sym_rule(operator.neg)
def sym_neg(a: SymOperand) -> ir.Value:
    x = _numeric(a)[0]
    return cai.sub(cast(cai.constant(np.int32(0)), dtype_of(x)), x)


@_sym_rule(operator.abs)
def sym_abs(a: SymOperand) -> ir.Value:
    return cai.abs_(_numeric(a)[0])


def _nonzero_divisor(b: ir.Value) -> ir.Value:
    """Integer division by zero kills the Core AI runtime; divide by 1 instead (PyTorch
    raises ZeroDivisionError there, so no correct result exists)."""
    zero = cast(cai.constant(np.int32(0)), dtype_of(b))
    one = cast(cai.constant(np.int32(1)), dtype_of(b))
    return cai.where(cai.equal(b, zero), one, b)


def _divisor(b_operand: SymOperand, b: ir.Value) -> ir.Value:
    if isinstance(b_operand, ir.Value) and not dtype_of(b).is_floating_point:
        return _nonzero_divisor(b)
    if not isinstance(b_operand, ir.Value) and b_operand == 0:
        raise ZeroDivisionError("symbolic size divided by the constant 0")
    return b


@_sym_rule(operator.floordiv)
def sym_floordiv(a: SymOperand, b: SymOperand) -> ir.Value:
    x, y = _numeric(a, b)
    return cai.floor_divide(x, _divisor(b, y))


@_sym_rule(operator.mod)
def sym_mod(a: SymOperand, b: SymOperand) -> ir.Value:
    """Python's modulo (the result takes the sign of the divisor)."""
    x, y = _numeric(a, b)
    y = _divisor(b, y)
    r = cai.modulo(x, y)
    zero = cast(cai.constant(np.int32(0)), dtype_of(r))
    fix = cai.and_(
        cai.not_equal(r, zero),
        cai.not_equal(cai.greater(zero, r), cai.greater(zero, y)),
    )
    return cai.where(fix, cai.add(r, y), r)


@_sym_rule(operator.truediv)
def sym_truediv(a: SymOperand, b: SymOperand) -> ir.Value:
    x, y = (cast(v, torch.float32) for v in _numeric(a, b))
    return cai.divide(x, y)


@_sym_rule(torch.sym_float)
def sym_float(a: SymOperand) -> ir.Value:
    return cast(sym_scalar(a), torch.float32)


@_sym_rule(torch._sym_sqrt)  # type: ignore[attr-defined]  # not in torch's stubs
def sym_sqrt(a: SymOperand) -> ir.Value:
    return cai.sqrt(cast(sym_scalar(a), torch.float32))


def _to_int(x: ir.Value, rounding: str) -> ir.Value:
    if not dtype_of(x).is_floating_point:
        return cast(x, torch.int32)
    if rounding == "floor":
        x = cai.floor_divide(x, cai.constant(np.float32(1)))
    elif rounding == "ceil":
        neg = cai.sub(cai.constant(np.float32(0)), x)
        x = cai.sub(cai.constant(np.float32(0)), cai.floor_divide(neg, cai.constant(np.float32(1))))
    return cast(x, torch.int32)  # casts truncate toward zero


@_sym_rule(torch.sym_int, math.trunc)
def sym_int(a: SymOperand) -> ir.Value:
    return _to_int(sym_scalar(a), "trunc")


@_sym_rule(math.floor)
def sym_floor(a: SymOperand) -> ir.Value:
    return _to_int(sym_scalar(a), "floor")


@_sym_rule(math.ceil)
def sym_ceil(a: SymOperand) -> ir.Value:
    return _to_int(sym_scalar(a), "ceil")


# --------------------------------------------------------------------------- booleans ------


@_sym_rule(operator.lt)
def sym_lt(a: SymOperand, b: SymOperand) -> ir.Value:
    x, y = _numeric(a, b)
    return cai.greater(y, x)


@_sym_rule(operator.ge)
def sym_ge(a: SymOperand, b: SymOperand) -> ir.Value:
    x, y = _numeric(a, b)
    return cai.or_(cai.greater(x, y), cai.equal(x, y))


@_sym_rule(operator.le)
def sym_le(a: SymOperand, b: SymOperand) -> ir.Value:
    x, y = _numeric(a, b)
    return cai.or_(cai.greater(y, x), cai.equal(x, y))


def _bool(x: SymOperand) -> ir.Value:
    value = sym_scalar(x)
    if dtype_of(value) == torch.bool:
        return value
    return cai.not_equal(value, cast(cai.constant(np.int32(0)), dtype_of(value)))


@_sym_rule(operator.and_)
def sym_and(a: SymOperand, b: SymOperand) -> ir.Value:
    return cai.and_(_bool(a), _bool(b))


@_sym_rule(operator.or_)
def sym_or(a: SymOperand, b: SymOperand) -> ir.Value:
    return cai.or_(_bool(a), _bool(b))


@_sym_rule(operator.not_, torch.sym_not)
def sym_not(a: SymOperand) -> ir.Value:
    return cai.not_(_bool(a))


@_sym_rule(torch.sym_ite)
def sym_ite(b: SymOperand, t: SymOperand, f: SymOperand) -> ir.Value:
    x, y = _numeric(t, f) if dtype_of(sym_scalar(t)) != torch.bool else (_bool(t), _bool(f))
    return cai.where(_bool(b), x, y)
