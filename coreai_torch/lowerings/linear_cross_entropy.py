"""``F.linear_cross_entropy(..., options=...)``'s chunked custom ops
(``torch_nn::_linear_cross_entropy_batch_chunked`` and its ``_no_reduction`` form).

PyTorch computes the loss chunk by chunk over the batch to bound memory during training; the
value is the cross entropy of ``input @ linear_weightᵀ + linear_bias`` with integer targets:
``W[t] (logsumexp(z) - z[t])`` per sample (``W`` the class weights, 0 where the target is
``ignore_index``), summed, or divided by ``Σ W[t]`` for ``mean``.  Here it is one
computation over the whole batch in ``acc_dtype``.  The gradients the training op can also
return are not computed: a program that uses them is rejected.
"""

from __future__ import annotations

import torch

from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import (
    cast,
    constant,
    div,
    equal,
    i32,
    mul,
    pick,
    squeeze,
    sub,
    transpose,
    unsqueeze,
)
from coreai_torch.lowerings.registry import LoweringContext, lowering


def _per_sample(
    input: ir.Value,
    linear_weight: ir.Value,
    target: ir.Value,
    linear_bias: ir.Value | None,
    weight: ir.Value | None,
    ignore_index: int,
    dtype: torch.dtype,
) -> tuple[ir.Value, ir.Value]:
    """(loss, class weight) per sample, (N,) each; both 0 where the target is ignored."""
    logits = cai.batch_matmul(cast(input, dtype), transpose(cast(linear_weight, dtype), [1, 0]))
    if linear_bias is not None:
        logits = cai.broadcasting_add(logits, cast(linear_bias, dtype))
    shifted = cai.broadcasting_sub(logits, cai.reduce_max(logits, i32([1])))
    log_denominator = squeeze(cai.log(cai.reduce_sum(cai.exp(shifted), i32([1]))), [1])
    ignored = equal(target, constant(ignore_index, torch.int64))
    safe = cast(pick(ignored, 0, target, target), torch.int32)
    chosen = squeeze(cai.gather_along_axis(shifted, unsqueeze(safe, [1]), i32(1)), [1])
    if weight is None:
        class_weight = pick(ignored, 0.0, 1.0, chosen)
    else:
        class_weight = cai.gather_along_axis(cast(weight, dtype), safe, i32(0))
        class_weight = pick(ignored, 0.0, class_weight, chosen)
    return mul(class_weight, sub(log_denominator, chosen)), class_weight


def _reject_gradients(cx: LoweringContext) -> None:
    for user in cx.node.users:
        if getattr(user.target, "__name__", None) != "getitem" or user.args[1] != 0:
            raise cx.unsupported(
                "the gradients linear_cross_entropy's training op returns are not computed"
            )


@lowering("torch_nn::_linear_cross_entropy_batch_chunked.default")
def linear_cross_entropy(
    cx: LoweringContext,
    input: ir.Value,
    linear_weight: ir.Value,
    target: ir.Value,
    linear_bias: ir.Value | None,
    weight: ir.Value | None,
    reduction: str,
    ignore_index: int,
    label_smoothing: float,
    batch_chunk_size: int,
    acc_policy: str,
    acc_dtype: torch.dtype,
    allow_retain_graph: bool,
    compute_input_grad: bool,
    compute_linear_weight_grad: bool,
    compute_linear_bias_grad: bool,
) -> list[ir.Value | None]:
    """The mean or summed loss (the op's first result)."""
    _reject_gradients(cx)
    if label_smoothing != 0.0 or reduction not in ("mean", "sum"):
        raise cx.unsupported(f"reduction={reduction!r}, label_smoothing={label_smoothing}")
    losses, weights = _per_sample(
        input, linear_weight, target, linear_bias, weight, ignore_index, acc_dtype
    )
    total = squeeze(cai.reduce_sum(losses, i32([0])), [0])
    if reduction == "mean":
        total = div(total, squeeze(cai.reduce_sum(weights, i32([0])), [0]))
    return [cast(total, cx.out_dtype), None, None, None]


@lowering("torch_nn::_linear_cross_entropy_batch_chunked_no_reduction.default")
def linear_cross_entropy_no_reduction(
    cx: LoweringContext,
    input: ir.Value,
    linear_weight: ir.Value,
    target: ir.Value,
    linear_bias: ir.Value | None,
    weight: ir.Value | None,
    ignore_index: int,
    batch_chunk_size: int,
    acc_policy: str,
    acc_dtype: torch.dtype,
) -> ir.Value:
    """The per-sample loss (0 where the target is ``ignore_index``)."""
    losses, _ = _per_sample(
        input, linear_weight, target, linear_bias, weight, ignore_index, acc_dtype
    )
    return cast(losses, cx.out_dtype)
