"""Per-element loops: an iteration each element runs on its own (series, continued fractions,
recurrences), as one ``coreai.while`` over all elements.

Rules run with the node's location active (the importer enters it), so the ops built here
carry the user's source line without passing ``loc=`` around.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import i32, rank_of, squeeze


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
