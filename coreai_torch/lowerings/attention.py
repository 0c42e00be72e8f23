"""Attention: ``scaled_dot_product_attention`` (kept whole by ``get_decomp_table()``).

It is emitted as the ``scaled_dot_product_attention`` composite op: a private graph holding
the reference implementation below, marked with a composite declaration.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.fx

from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import (
    broadcast_dynamic,
    cast,
    constant,
    dim_size,
    dtype_of,
    known_sizes,
    rank_of,
    reshape,
    reshape_dynamic,
    shape_of,
    slice_dynamic,
    static_dim,
    transpose,
    unsqueeze,
)
from coreai_torch.lowerings.helpers.accumulation import accumulation_dtype
from coreai_torch.lowerings.helpers.arithmetic import neg_values
from coreai_torch.lowerings.helpers.composite import aten_composite
from coreai_torch.lowerings.registry import LoweringContext, lowering


def repeat_kv(x: ir.Value, groups: int) -> ir.Value:
    """(..., Hkv, L, D) -> (..., Hkv * groups, L, D), each head repeated ``groups`` times."""
    if groups == 1:
        return x
    shape = shape_of(x)
    static = known_sizes(shape)
    if static is None:  # dynamic batch / length: runtime shape operands
        sizes = [dim_size(x, d) for d in range(len(shape))]
        grouped = [*sizes[:-2], groups, *sizes[-2:]]
        expanded = broadcast_dynamic(
            unsqueeze(x, [len(shape) - 2]), grouped, [*shape[:-2], groups, *shape[-2:]]
        )
        count = static_dim(x, -3) * groups
        heads = [*sizes[:-3], count, *sizes[-2:]]
        return reshape_dynamic(expanded, heads, [*shape[:-3], count, *shape[-2:]])
    expanded = cai.broadcast_to(
        reshape(x, [*static[:-3], static[-3], 1, *static[-2:]]),
        np.array([*static[:-3], static[-3], groups, *static[-2:]], np.uint32),
    )
    return reshape(expanded, [*static[:-3], static[-3] * groups, *static[-2:]])


def _length(x: ir.Value, axis: int) -> ir.Value:
    """Size of ``x`` along ``axis`` as a 0-d ``si32`` value (static sizes fold)."""
    rank = rank_of(x)
    axis %= rank
    size = cai.slice_(cai.get_shape(x), [axis], [axis + 1], [1])
    return cai.shrink_dims(cai.cast(size, np.int32), [0])


def _causal_bias(q: ir.Value, k: ir.Value, dtype: torch.dtype) -> ir.Value:
    """``(L, S)`` additive mask: 0 where ``column <= row`` (PyTorch's top-left causal
    alignment), ``-inf`` elsewhere; built at run time when a length is dynamic."""
    lq, lk = shape_of(q)[-2], shape_of(k)[-2]
    if lq is not None and lk is not None:
        allowed = np.tril(np.ones((lq, lk), dtype=bool))
        return cast(cai.constant(np.where(allowed, 0.0, -np.inf).astype(np.float32)), dtype)
    zero, one = np.int32(0), np.int32(1)
    rows = cai.expand_dims(cai.range_(zero, _length(q, -2), one), [1])
    cols = cai.expand_dims(cai.range_(zero, _length(k, -2), one), [0])
    hidden = cai.broadcasting_greater(cols, rows)
    return cai.broadcasting_where(hidden, constant(float("-inf"), dtype), constant(0.0, dtype))


def attention_values(
    cx: LoweringContext,
    q: ir.Value,
    k: ir.Value,
    v: ir.Value,
    mask: ir.Value | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> ir.Value:
    """softmax(q k^T * scale + mask) v, with PyTorch's SDPA semantics.

    Batch dimensions broadcast (``q`` and ``k``/``v`` may differ in rank); rows that the mask
    hides completely give zeros, as in PyTorch (not NaN).  16-bit operands are computed in
    float32 and the result rounded once, like ATen's CPU kernels (unless the conversion
    asks for 16-bit products: :mod:`coreai_torch.lowerings.helpers.accumulation`).
    """
    result_dtype = dtype_of(q)
    dtype = accumulation_dtype(cx, result_dtype)
    if dtype != result_dtype:
        q, k, v = cast(q, dtype), cast(k, dtype), cast(v, dtype)
        if mask is not None and dtype_of(mask) != torch.bool:
            mask = cast(mask, dtype)
    q_shape, k_shape = shape_of(q), shape_of(k)
    if enable_gqa and min(len(q_shape), len(k_shape)) >= 3 and q_shape[-3] != k_shape[-3]:
        groups = static_dim(q, -3) // static_dim(k, -3)
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    scale = scale if scale is not None else 1.0 / math.sqrt(static_dim(q, -1))
    k_rank = len(k_shape)
    k_t = transpose(k, [*range(k_rank - 2), k_rank - 1, k_rank - 2])
    scores = cai.broadcasting_batch_matmul(q, k_t)
    scores = cai.broadcasting_mul(scores, constant(scale, dtype))
    last = np.int32(rank_of(scores) - 1)
    if is_causal:
        scores = cai.broadcasting_add(scores, _causal_bias(q, k, dtype))
    if mask is not None:
        if dtype_of(mask) == torch.bool:
            neg = cai.broadcasting_where(mask, constant(0.0, dtype), constant(float("-inf"), dtype))
            scores = cai.broadcasting_add(scores, neg)
        else:
            scores = cai.broadcasting_add(scores, cast(mask, dtype))
    probs = cai.softmax(scores, last)
    if mask is not None:  # a fully masked row: softmax gives NaN, PyTorch gives zeros
        hidden = cai.broadcasting_equal(
            cai.reduce_max(scores, np.array([last], np.int32)), constant(float("-inf"), dtype)
        )
        probs = cai.broadcasting_where(hidden, constant(0.0, dtype), probs)
    return cast(cai.broadcasting_batch_matmul(probs, v), result_dtype)


@lowering("aten::scaled_dot_product_attention.default")
def scaled_dot_product_attention(
    cx: LoweringContext,
    query: ir.Value,
    key: ir.Value,
    value: ir.Value,
    attn_mask: ir.Value | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> ir.Value:
    """The ``scaled_dot_product_attention`` composite op (attributes ``is_causal``,
    ``scale`` (left out when ``None``), ``enable_gqa``)."""
    if dropout_p != 0.0:
        raise cx.unsupported(
            f"dropout_p={dropout_p}: attention dropout is random and Core AI programs are "
            "deterministic; pass dropout_p=0.0 for inference (e.g. `dropout_p=self.dropout if "
            "self.training else 0.0`) and export the model in eval mode"
        )
    q_shape, k_shape = shape_of(query), shape_of(key)
    if enable_gqa and len(q_shape) >= 3 and None in (q_shape[-3], k_shape[-3]):
        raise cx.unsupported("grouped-query attention with a dynamic number of heads")
    return aten_composite(
        cx,
        "scaled_dot_product_attention",
        {"query": query, "key": key, "value": value, "attn_mask": attn_mask},
        {"is_causal": bool(is_causal), "scale": scale, "enable_gqa": bool(enable_gqa)},
        lambda query, key, value, attn_mask: attention_values(
            cx, query, key, value, attn_mask, is_causal, scale, enable_gqa
        ),
    )


@lowering("coreai_torch::rope.default")
def rope(cx: LoweringContext, input: ir.Value, cos: ir.Value, sin: ir.Value) -> ir.Value:
    """The ``rope`` composite op (attribute ``interleaved = false``), for the hand-written
    rotary embeddings :func:`~coreai_torch.frontend.fusions.fuse_patterns` finds:
    ``input * cos + cat(-input[..., h:], input[..., :h]) * sin``, the same ops in the same
    order as Hugging Face's ``apply_rotary_pos_emb``."""

    def body(input: ir.Value, cos: ir.Value, sin: ir.Value) -> ir.Value:
        axis = rank_of(input) - 1
        half = static_dim(input, axis) // 2
        first = slice_dynamic(input, axis, 0, half)
        second = neg_values(slice_dynamic(input, axis, half, None))
        rotated = cai.concat(np.int32(axis), [second, first])
        return cai.broadcasting_add(
            cai.broadcasting_mul(input, cos), cai.broadcasting_mul(rotated, sin)
        )

    return aten_composite(
        cx, "rope", {"input": input, "cos": cos, "sin": sin}, {"interleaved": False}, body
    )
