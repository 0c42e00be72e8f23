"""A Hugging Face causal LM as the functions of the static-shape engine (the engine iOS apps
and the Neural Engine use, ``StaticShapeEngine`` of ``CoreAILanguageModels``;
``docs/bundles.md``)::

    load_embeddings() -> embedding_table [vocab, hidden]
    gather_embeddings_<Q>(in_new_token_ids: int32 [1, Q], embedding_table)
        -> out_transformer_input [1, Q, hidden]
    extend_<ctx>_<Q>(transformer_input [1, Q, hidden], position_ids: uint16 [1, Q])
        -> out_logits: float16 [1, Q, vocab]
    prompt_opt_<ctx>_<Q>: the same, for prefill chunks (the largest Q)
    states key_cache [layers, 1, kv_heads, ctx, key_dim], value_cache [..., ctx, value_dim]

for every cache length ``ctx`` of a ladder (256 doubling up to the maximum context) and query
length ``Q`` (8, 16, 64).  The engine runs ``load_embeddings`` once, gathers each batch's
embeddings, and passes the positions ``aligned .. aligned + Q - 1`` of a batch aligned down
to a multiple of ``Q`` (re-processing earlier tokens; the last ones may be padding), with a
prefix slice of one pair of cache buffers (fresh memory, not zeroed).  The function writes
the batch's keys and values at the rows of their positions and attends, causally and within
the sliding window of the layers that have one, from its positions (the masks are built in
the graph from ``position_ids``; the engine's ``causal_mask`` and step inputs are not
declared, so it does not pass them).  Rows past the batch's last position are zeroed before
attention reads them: they hold garbage, and a masked NaN would still reach the result.

One graph is traced with ``Q`` and ``ctx`` of run-time size and specialized into the static
functions (``AIProgram.set_static_shape_config``): every function reads the same weights,
stored once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn as nn

from coreai_torch.frontend.export import export_decomposed
from coreai_torch.llm.decoder import StateLayer, cache_dims, state_cache
from coreai_torch.tensors import lazy

LOAD_EMBEDDINGS = "load_embeddings"
GATHER = "gather_embeddings"
EXTEND = "extend"
PROMPT = "prompt_opt"
TABLE = "embedding_table"
STATE_NAMES = ("key_cache", "value_cache")
#: the query lengths the functions are made for (those of Apple's iOS exports)
QUERY_LENGTHS = (8, 16, 64)
#: the smallest cache length of the default ladder (it doubles up to the maximum context)
MIN_CONTEXT = 256
SEQUENCE_DIM = 3

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def ladder(max_context: int, contexts: Sequence[int] | None = None) -> list[int]:
    """The cache lengths of the functions: ``contexts``, else 256 doubling while below
    ``max_context``, then ``max_context`` (the engine allocates the caches from the function
    whose length is the maximum context)."""
    if contexts is not None:
        return sorted(set(contexts))
    lengths = []
    length = min(MIN_CONTEXT, max_context)
    while length < max_context:
        lengths.append(length)
        length *= 2
    return [*lengths, max_context]


def check_shapes(
    config: Any, max_context: int, contexts: Sequence[int], query_lengths: Sequence[int]
) -> None:
    """Refuse shapes the static-shape engine cannot run (``ValueError`` naming the fix)."""
    if not contexts or not query_lengths:
        raise ValueError("the static-shape functions need at least one context and query length")
    for value in (*contexts, *query_lengths):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"contexts and query lengths are ints >= 1, got {value!r}")
    if max(contexts) != max_context:
        raise ValueError(
            f"the largest context of {sorted(contexts)} must be max_context={max_context}: the "
            "engine allocates the caches from the function whose length is the bundle's "
            "maximum context"
        )
    for ctx in contexts:
        for q in query_lengths:
            if ctx % q:
                raise ValueError(
                    f"context {ctx} is not a multiple of the query length {q}: the engine "
                    "aligns each batch down to a multiple of Q, and a batch must end within "
                    "the cache; choose contexts that are multiples of every query length"
                )
    kv_heads, key_dim, value_dim = cache_dims(config)
    widest = max(config.num_hidden_layers, kv_heads, key_dim, value_dim)
    if min(contexts) <= widest and min(contexts) != widest:
        raise ValueError(
            f"context {min(contexts)} is smaller than another dimension of the caches "
            f"[{config.num_hidden_layers}, 1, {kv_heads}, ctx, {max(key_dim, value_dim)}]: the "
            "engine reads a function's cache length as the largest dimension of its key cache; "
            f"use contexts of at least {widest}"
        )


class LoadEmbeddings(nn.Module):
    """``load_embeddings``: the token-embedding table ``table`` (returned as it is: no op
    the pre-compilation rewrite would fold, so a table still in its checkpoint stays there
    until the asset is written)."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer(TABLE, table)  # as it is (a parameter would be a new tensor)

    def forward(self) -> torch.Tensor:
        return cast(torch.Tensor, getattr(self, TABLE))


class GatherEmbeddings(nn.Module):
    """``gather_embeddings_<Q>``: the rows of the table for the batch's tokens, scaled as the
    model's embedding module scales them (Gemma 3), in ``dtype`` (the decoder's input's)."""

    def __init__(self, scale: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.scale = scale
        self.dtype = dtype

    def forward(self, in_new_token_ids: torch.Tensor, embedding_table: torch.Tensor) -> Any:
        rows = nn.functional.embedding(in_new_token_ids.to(torch.int64), embedding_table)
        rows = rows if self.scale is None else rows * self.scale.to(rows.dtype)
        return rows.to(self.dtype)


class _BatchLayer(StateLayer):
    """One layer's view of a static cache: the batch's rows written at their positions,
    every row returned, those past the batch zeroed."""

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        cache_kwargs: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self.cache
        cache.record(key_states, value_states)
        out = []
        for states, new in ((cache.key_cache, key_states), (cache.value_cache, value_states)):
            rows = states[self.index].index_copy(2, cache.rows, new.to(states.dtype))
            rows = torch.where(cache.written, rows, torch.zeros((), dtype=rows.dtype))
            out.append(rows.to(new.dtype))  # stored in the states' dtype, attended in the model's
        return out[0], out[1]


class StaticDecoder(nn.Module):
    """``extend_<ctx>_<Q>`` / ``prompt_opt_<ctx>_<Q>`` (see the module documentation)."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model
        layers = model.config.get_text_config().num_hidden_layers
        self.cache = state_cache(layers)
        self.cache.layers = [_BatchLayer(self.cache, i) for i in range(layers)]

    def forward(
        self,
        transformer_input: torch.Tensor,
        position_ids: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
    ) -> torch.Tensor:
        context = key_cache.shape[SEQUENCE_DIM]
        positions = position_ids[0].to(torch.int64)
        cache = self.cache
        cache.bind(key_cache, value_cache, 0, context)
        # the rows the batch writes (one per token) and those holding data (up to its last)
        cache.rows = positions
        cache.written = (torch.arange(context) <= positions[-1]).view(1, 1, context, 1)
        try:
            out = self.model(
                inputs_embeds=transformer_input,
                position_ids=positions[None],
                cache_position=positions,
                past_key_values=cache,
                attention_mask=None,
                use_cache=True,
                logits_to_keep=0,
            )
            for states, new in ((key_cache, cache.new_keys), (value_cache, cache.new_values)):
                states.index_copy_(SEQUENCE_DIM, positions, torch.stack(new).to(states.dtype))
        finally:
            cache.bind(None, None, 0, 0)
        logits: torch.Tensor = out.logits.to(torch.float16)
        return logits


def stage(
    converter: Any,
    model: PreTrainedModel,
    max_context: int,
    states: torch.dtype,
    contexts: Sequence[int] | None,
    query_lengths: Sequence[int] | None,
) -> dict[str, dict[str, dict[str, tuple[int, ...]]]]:
    """Trace the functions (``Q`` and ``ctx`` of run-time size, the caches of ``states``) and
    stage them on ``converter``; returns the static shapes of each entry point, for
    ``AIProgram.set_static_shape_config`` once the program is converted."""
    config = model.config.get_text_config()
    contexts = ladder(max_context, contexts)
    queries = sorted(set(query_lengths or QUERY_LENGTHS))
    check_shapes(config, max_context, contexts, queries)
    embeddings = model.get_input_embeddings()
    table = embeddings.weight
    hidden = table.shape[1]
    kv_heads, key_dim, value_dim = cache_dims(config)
    layers = config.num_hidden_layers
    batch = torch.export.Dim("batch", min=1, max=max(queries))
    length = torch.export.Dim("context", min=2, max=max(contexts))

    # a table still in its checkpoint stays there: cast as it is read, when the asset is written
    load = export_decomposed(LoadEmbeddings(lazy.converted(table, states)).eval(), ())
    converter.add_exported_program(load, output_names=[TABLE], entrypoint_name=LOAD_EMBEDDINGS)
    ids = torch.zeros(1, 2, dtype=torch.int32)
    gather = export_decomposed(
        GatherEmbeddings(getattr(embeddings, "embed_scale", None), model.dtype).eval(),
        (ids, torch.zeros(table.shape, dtype=states)),
        dynamic_shapes=({1: batch}, None),
    )
    converter.add_exported_program(
        gather,
        input_names=["in_new_token_ids", TABLE],
        output_names=["out_transformer_input"],
        entrypoint_name=GATHER,
    )
    dtype = model.dtype
    args = (
        torch.zeros(1, 2, hidden, dtype=dtype),
        torch.arange(2, dtype=torch.int32).to(torch.uint16)[None],
        torch.zeros(layers, 1, kv_heads, 8, key_dim, dtype=states),
        torch.zeros(layers, 1, kv_heads, 8, value_dim, dtype=states),
    )
    dynamic = ({1: batch}, {1: batch}, {SEQUENCE_DIM: length}, {SEQUENCE_DIM: length})
    extend = export_decomposed(StaticDecoder(model).eval(), args, dynamic_shapes=dynamic)
    for name in (EXTEND, PROMPT):
        converter.add_exported_program(
            extend,
            input_names=["transformer_input", "position_ids"],
            output_names=["out_logits"],
            state_names=list(STATE_NAMES),
            entrypoint_name=name,
        )

    def functions(qs: Sequence[int]) -> dict[str, dict[str, tuple[int, ...]]]:
        return {
            f'"{ctx}_{q}"': {
                "transformer_input": (1, q, hidden),
                "position_ids": (1, q),
                STATE_NAMES[0]: (layers, 1, kv_heads, ctx, key_dim),
                STATE_NAMES[1]: (layers, 1, kv_heads, ctx, value_dim),
            }
            for ctx in contexts
            for q in qs
        }

    return {
        GATHER: {f'"{q}"': {"in_new_token_ids": (1, q)} for q in queries},
        EXTEND: functions(queries),
        PROMPT: functions(queries[-1:]),
    }
