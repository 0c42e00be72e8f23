"""Helpers shared by the lowering rules beyond the IR value helpers of
:mod:`coreai_torch.ir.values`: PyTorch's type promotion for mixed operands, and per-element
loops (series, continued fractions) for special functions.

Rules run with the node's location active (the importer enters it), so the ops built here
carry the user's source line without passing ``loc=`` around.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch._prims_common as prims

from coreai_torch._mlir import cai, ir
from coreai_torch.ir.composite import emit_composite
from coreai_torch.ir.values import Scalar, as_value, cast, constant, dtype_of, i32, rank_of, squeeze
from coreai_torch.locations import module_path
from coreai_torch.lowerings.registry import LoweringContext


def uint64_bits(x: ir.Value) -> ir.Value:
    """An int64 value as the uint64 with the same bits (``-1`` -> ``2**64 - 1``), as PyTorch
    converts; Core AI's cast saturates negative values to 0."""
    negative = cai.broadcasting_greater(constant(0, torch.int64), x)
    shifted = cai.broadcasting_where(
        negative, cai.broadcasting_sub(x, constant(-(2**63), torch.int64)), x
    )
    u = cast(shifted, torch.uint64)
    return cai.broadcasting_where(
        negative, cai.broadcasting_add(u, constant(2**63, torch.uint64)), u
    )


def _fake(x: ir.Value | Scalar) -> Any:
    if isinstance(x, ir.Value):
        return torch.empty([1] * rank_of(x), dtype=dtype_of(x), device="meta")
    return x


def result_dtype(
    *operands: ir.Value | Scalar,
    kind: prims.ELEMENTWISE_TYPE_PROMOTION_KIND = prims.ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT,
) -> torch.dtype:
    """PyTorch's type promotion over tensors (Core AI values) and Python scalars."""
    fakes = [_fake(x) for x in operands if x is not None]
    _, dtype = prims.elementwise_dtypes(*fakes, type_promotion_kind=kind)
    return dtype


def promote(*operands: ir.Value | Scalar, dtype: torch.dtype | None = None) -> list[ir.Value]:
    """Operands converted to one dtype (PyTorch's promotion unless ``dtype`` is given)."""
    target = dtype or result_dtype(*operands)
    return [as_value(x, target) for x in operands]


def to_float(value: ir.Value, dtype: torch.dtype | None = None) -> ir.Value:
    """Integer/bool values become float (``dtype`` or float32); floats are left alone."""
    current = dtype_of(value)
    if current.is_floating_point and dtype is None:
        return value
    return cast(value, dtype or torch.float32)


def any_element(mask: ir.Value) -> ir.Value:
    """0-d bool: is any element of ``mask`` true."""
    rank = rank_of(mask)
    if rank == 0:
        return mask
    return squeeze(cai.any_(mask, i32(list(range(rank)))), list(range(rank)))


def elementwise_loop(
    live: ir.Value,
    values: Sequence[ir.Value],
    step: Any,
    limit: int,
) -> list[ir.Value]:
    """An iteration that each element runs on its own (series, continued fractions,
    recurrences), as one ``coreai.while`` over all elements.

    ``step(i, values)`` (``i`` = 0, 1, ... a 0-d ``si32``) returns the next values and a mask
    of the elements that continue after this step; elements that are not live keep their
    values.  The loop ends when no element is live or after ``limit`` steps.  ``live`` and
    every value have the full (broadcast) shape.
    """
    i0 = cai.constant(np.int32(0))
    bound = cai.constant(np.int32(limit))
    types = [i0.type, live.type, *(v.type for v in values)]
    loop, (before, after) = cai.while_(types, [i0, live, *values])
    with before:
        i, alive = before.arguments[:2]
        go = cai.broadcasting_and(any_element(alive), cai.broadcasting_greater(bound, i))
        # double negation: see control_flow.predicate (a runtime loop-condition fault)
        cai.condition(cai.not_(cai.not_(go)), *before.arguments)
    with after:
        i, alive, *current = after.arguments
        updated, keep = step(i, list(current))
        cai.yield_(
            [
                cai.add(i, cai.constant(np.int32(1))),
                cai.broadcasting_and(alive, keep),
                *(
                    cai.broadcasting_where(alive, new, old)
                    for new, old in zip(updated, current, strict=True)
                ),
            ]
        )
    return list(loop)[2:]


def aten_composite(
    cx: LoweringContext,
    op_name: str,
    inputs: Mapping[str, ir.Value | None],
    op_attrs: Mapping[str, Any],
    body: Callable[..., ir.Value],
) -> ir.Value:
    """Emit an ATen op as composite op ``op_name`` (named after the op it preserves).

    ``inputs`` are the op's tensor arguments by schema name (``None`` ones are left out of
    the composite); ``body(**inputs)`` emits the reference implementation from the graph
    arguments.  The graph is named after the node's module path and ``op_name``.  With
    ATen composites switched off (``TorchConverter(aten_composites=False)``, read from
    ``cx.options``) the body is emitted inline.
    """
    if not cx.options.aten_composites:
        return body(**inputs)

    present = [(name, value) for name, value in inputs.items() if value is not None]

    def build(*args: ir.Value) -> ir.Value:
        values: dict[str, ir.Value | None] = dict.fromkeys(inputs)
        values.update(zip((name for name, _ in present), args, strict=True))
        return body(**values)

    path = module_path(cx.node)
    (result,) = emit_composite(
        op_name,
        [value for _, value in present],
        build,
        input_names=[name for name, _ in present],
        op_attrs=op_attrs,
        name=f"{path}.{op_name}" if path else op_name,
    )
    return result
