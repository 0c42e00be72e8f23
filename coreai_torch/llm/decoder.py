"""A Hugging Face causal LM as the function ``main`` of Apple's app engines (the sequential
and pipelined engines of ``CoreAILanguageModels``; ``docs/bundles.md``)::

    main(input_ids: int32 [1, T], position_ids: int32 [1, P]) -> logits: float16 [1, T, vocab]
    states keyCache   [layers, 1, kv_heads, S, key_dim]      S of run-time size, >= P
           valueCache [layers, 1, kv_heads, S, value_dim]

The engines pass the ``T`` new tokens and every position so far, ``0 .. P-1``: the new tokens
sit at positions ``P-T .. P-1``.  Each layer attends to the rows ``0 .. P-T-1`` of its cache
followed by the new tokens' keys and values (causal, bottom-right aligned, within the sliding
window of the layers that have one, every mask built in the graph from ``position_ids``), and
one write per state puts the new rows at ``P-T .. P-1`` (a ``slice_update`` at a runtime
offset).  Rows ``>= P`` are never read: the engines grow the states by copying into memory
they do not zero.  Writing a position again (the engines re-feed the last token of a prompt
they have already processed) overwrites it.  The logits of every new token are returned, cast
to float16 in the graph (soft-capping, where the model has it, happens before).

With ``embeddings_input`` (the decoder of a vision-language bundle, ``CoreAISequentialVLMEngine``)
the first input is the token embeddings instead of the ids, float16 whatever the compute
precision (the app merges the image features into them as float16)::

    main(inputs_embeds: float16 [1, T, hidden], position_ids: int32 [1, P]) -> logits

The model runs through its own ``forward`` (Hugging Face's attention, masks, rotary
embeddings): the cache object it is given (a ``StateCache``) hands each layer its rows of
the states and records the new ones.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from coreai_torch.bundles.convention import INITIAL_KV_CAPACITY

#: names of the inputs, the output and the states of ``main`` (those of Apple's macOS exports)
INPUT_NAMES = ("input_ids", "position_ids")
#: the inputs of ``main`` with ``embeddings_input`` (Apple's VLM decoders)
EMBEDDINGS_INPUT_NAMES = ("inputs_embeds", "position_ids")
#: the dtype of the embeddings the VLM engine passes (it merges image features as float16)
EMBEDDINGS_DTYPE = torch.float16
OUTPUT_NAME = "logits"
STATE_NAMES = ("keyCache", "valueCache")
FUNCTION_NAME = "main"
#: the dimension of the states that grows (second-to-last)
SEQUENCE_DIM = 3

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class StateLayer:
    """One layer's view of the two states (``transformers``' cache-layer interface)."""

    is_compileable = True  # masks are always built, never left to SDPA's ``is_causal``
    is_sliding = False  # every layer sees all positions; windows are in the masks
    is_initialized = True

    def __init__(self, cache: Any, index: int) -> None:
        self.cache, self.index = cache, index

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        cache_kwargs: dict[str, Any] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of positions ``0 .. P-1``: the cached rows before the new
        tokens, then the new tokens' (recorded, written to the states at the end)."""
        cache = self.cache
        cache.record(key_states, value_states)
        keys = cache.key_cache[self.index, :, :, : cache.offset]
        values = cache.value_cache[self.index, :, :, : cache.offset]
        # stored in the states' dtype (the compute precision), attended in the model's
        keys = torch.cat([keys, key_states.to(keys.dtype)], dim=2)
        values = torch.cat([values, value_states.to(values.dtype)], dim=2)
        return keys.to(key_states.dtype), values.to(value_states.dtype)

    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[Any, int]:
        return self.cache.length, 0

    def get_seq_length(self) -> Any:
        return self.cache.offset

    def get_max_cache_shape(self) -> Any:
        return self.cache.length

    def reset(self) -> None:
        pass


@functools.cache
def _state_cache_class() -> type:
    from transformers.cache_utils import Cache, StaticCache

    class StateCache(StaticCache):  # type: ignore[misc]  # transformers is read as untyped
        """A ``transformers`` cache over the two states of ``main`` for one call: layer ``i``
        reads rows ``0 .. offset-1`` of ``key_cache[i]`` / ``value_cache[i]`` and returns them
        with the new tokens' keys and values (``length`` = ``P`` rows).  A ``StaticCache`` for
        the models that build their masks from a static cache's length (Qwen2-MoE, OLMoE)."""

        def __init__(self, layers: int) -> None:
            Cache.__init__(self, layers=[StateLayer(self, i) for i in range(layers)])
            self.bind(None, None, 0, 0)

        def bind(self, key_cache: Any, value_cache: Any, offset: Any, length: Any) -> None:
            self.key_cache, self.value_cache = key_cache, value_cache
            self.offset, self.length = offset, length
            self.new_keys: list[torch.Tensor] = []
            self.new_values: list[torch.Tensor] = []

        def record(self, keys: torch.Tensor, values: torch.Tensor) -> None:
            """Note a layer's new keys and values (written to the states after the model)."""
            self.new_keys.append(keys)
            self.new_values.append(values)

    return StateCache


def state_cache(layers: int) -> Any:
    """A ``StateCache`` of ``layers`` layers (the class is made once, when first needed:
    ``transformers`` is imported only then)."""
    return _state_cache_class()(layers)


class Decoder(nn.Module):
    """``main`` (see the module documentation): ``forward(input_ids, position_ids, key_cache,
    value_cache) -> logits``, the caches updated in place; with ``embeddings_input`` the first
    input is the float16 token embeddings ``[1, T, hidden]``."""

    def __init__(self, model: PreTrainedModel, *, embeddings_input: bool = False) -> None:
        super().__init__()
        self.model = model
        self.embeddings_input = embeddings_input
        self.cache = state_cache(model.config.get_text_config().num_hidden_layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
    ) -> torch.Tensor:
        new, total = input_ids.shape[1], position_ids.shape[1]
        if self.embeddings_input:  # the new tokens' embeddings, in the model's dtype
            fed = {"inputs_embeds": input_ids.to(self.model.dtype)}
        else:
            fed = {"input_ids": input_ids}
        torch._check(new <= total)
        torch._check(total <= key_cache.shape[SEQUENCE_DIM])
        torch._check(total <= value_cache.shape[SEQUENCE_DIM])
        offset = total - new
        # the new tokens' positions, as a tensor of their own (a view of position_ids would
        # make export guard on its strides)
        positions = position_ids[0, offset:].unsqueeze(0)
        cache = self.cache
        cache.bind(key_cache, value_cache, offset, total)
        try:
            out = self.model(
                **fed,
                position_ids=positions,
                cache_position=positions[0],
                past_key_values=cache,
                attention_mask=None,
                use_cache=True,
                logits_to_keep=0,
            )
            key_cache[:, :, :, offset:total] = torch.stack(cache.new_keys).to(key_cache.dtype)
            value_cache[:, :, :, offset:total] = torch.stack(cache.new_values).to(value_cache.dtype)
        finally:
            cache.bind(None, None, 0, 0)
        logits: torch.Tensor = out.logits.to(torch.float16)
        return logits


def example_inputs(
    config: Any,
    dtype: torch.dtype,
    tokens: int = 3,
    positions: int = 5,
    capacity: int = 8,
    *,
    embeddings_input: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Inputs to trace :class:`Decoder` with (``tokens`` new of ``positions``, states of
    ``capacity`` rows of ``dtype``; ``embeddings_input``: embeddings instead of ids)."""
    layers, (kv_heads, key_dim, value_dim) = config.num_hidden_layers, cache_dims(config)
    first = (
        torch.zeros(1, tokens, config.hidden_size, dtype=EMBEDDINGS_DTYPE)
        if embeddings_input
        else torch.zeros(1, tokens, dtype=torch.int32)
    )
    return (
        first,
        torch.arange(positions, dtype=torch.int32)[None],
        torch.zeros(layers, 1, kv_heads, capacity, key_dim, dtype=dtype),
        torch.zeros(layers, 1, kv_heads, capacity, value_dim, dtype=dtype),
    )


def dynamic_shapes(max_context: int) -> tuple[dict[int, Any], ...]:
    """``T`` and ``P`` up to ``max_context``, the states' rows up to twice that, or the
    engines' first capacity if larger (the pipelined engine starts at 256 rows whatever the
    context, and doubles its capacity until it holds the context)."""
    tokens = torch.export.Dim("tokens", min=1, max=max_context)
    positions = torch.export.Dim("positions", min=1, max=max_context)
    rows = max(2 * max_context, 2 * INITIAL_KV_CAPACITY)
    capacity = torch.export.Dim("capacity", min=2, max=rows)
    return ({1: tokens}, {1: positions}, {SEQUENCE_DIM: capacity}, {SEQUENCE_DIM: capacity})


def cache_dims(config: Any) -> tuple[int, int, int]:
    """``(kv_heads, key_dim, value_dim)`` of each layer's cache: grouped-query attention's
    key/value heads; DeepSeek's multi-head latent attention caches every head's full key
    (``qk_nope_head_dim + qk_rope_head_dim``) and value (``v_head_dim``), as Hugging Face's
    attention computes them."""
    heads = config.num_attention_heads
    if getattr(config, "qk_nope_head_dim", None) is not None:
        return heads, config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return kv_heads, head_dim, head_dim
