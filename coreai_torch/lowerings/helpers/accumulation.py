"""How products of 16-bit floats accumulate.

ATen multiplies float16/bfloat16 matrices with float32 accumulation and rounds each result
once.  Core AI's ``batch_matmul`` accumulates in its operands' type, and the Linux runtime
does so for float16 (sequentially: a dot product of 4096 terms of 0.1 gives 256) and for
batched bfloat16 products, so by default the lowerings multiply 16-bit operands in float32
and round the product once, like ATen.  ``TorchConverter(fp32_accumulation=False)`` emits
native 16-bit products instead (for runtimes whose half kernels accumulate in float32); rules
read the option from their context (``cx.options.fp32_accumulation``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from coreai_torch._mlir import ir
from coreai_torch.ir.values import cast, dtype_of
from coreai_torch.lowerings.registry import LoweringContext

_HALF = (torch.float16, torch.bfloat16)


def accumulation_dtype(cx: LoweringContext, dtype: torch.dtype) -> torch.dtype:
    """The dtype products of ``dtype`` operands are computed in."""
    if dtype in _HALF and cx.options.fp32_accumulation:
        return torch.float32
    return dtype


def accumulating(
    cx: LoweringContext,
    product: Callable[[ir.Value, ir.Value], ir.Value],
    a: ir.Value,
    b: ir.Value,
) -> ir.Value:
    """``product(a, b)`` computed in :func:`accumulation_dtype` and rounded to ``a``'s dtype."""
    dtype = dtype_of(a)
    compute = accumulation_dtype(cx, dtype)
    if compute == dtype:
        return product(a, b)
    return cast(product(cast(a, compute), cast(b, compute)), dtype)
