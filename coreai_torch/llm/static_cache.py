"""The prefill/decode program of a causal LM with a static KV cache (the vision-language
decoder's, ``CoreAIModelForImageTextToText``)::

    prefill(inputs_embeds | input_ids [1, T], start_position: int64 [1]) -> logits
    decode(input_ids: int64 [1, 1], start_position: int64 [1]) -> logits
    states: layers.{i}.k_cache, layers.{i}.v_cache   [1, kv_heads, max_context, head_dim]

The tokens are written to cache positions ``start_position .. start_position + T - 1`` and
attend to every cached position before them (within the sliding window where the model has
one).  The cache is ``transformers``' own ``StaticLayer`` (the ``StaticCache`` layer of
Hugging Face's ExecuTorch recipes) registered as buffers; the program is traced non-strict,
the cache layers pointed at the buffers in each call so that the writes reach the tensors
export traces with.  Language models for the app engines use :mod:`coreai_torch.llm.decoder`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from coreai_torch.frontend.export import export_decomposed
from coreai_torch.llm.decoder import cache_dims

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class CachedCausalLM(nn.Module):
    """``(input_ids [1, T], start_position [1]) -> logits`` with the KV cache in buffers
    ``layers.{i}.k_cache`` / ``layers.{i}.v_cache`` (``transformers``' ``StaticLayer``s of
    ``max_context`` positions), written in place at ``start_position .. + T - 1``."""

    def __init__(
        self, model: PreTrainedModel, max_context: int, *, all_logits: bool = False
    ) -> None:
        super().__init__()
        from transformers.cache_utils import Cache, StaticCache, StaticLayer

        self.model = model
        self.all_logits = all_logits
        config = model.config.get_text_config()
        kv_heads, key_dim, value_dim = cache_dims(config)
        # A StaticCache (Qwen2-MoE and OLMoE build their masks from the cache's length only
        # for one) whose every layer keeps all positions: StaticCache(config) would give
        # sliding-window layers a StaticSlidingWindowLayer, whose update branches in Python on
        # how many tokens it has seen (a program right only for the call it was traced with);
        # here the sliding window is part of the attention mask.
        self.cache = StaticCache.__new__(StaticCache)
        Cache.__init__(
            self.cache, layers=[StaticLayer(max_context) for _ in range(config.num_hidden_layers)]
        )
        self.cache.early_initialization(1, kv_heads, key_dim, model.dtype, torch.device("cpu"))
        for layer in self.cache.layers:
            layer.values = layer.values.new_zeros(1, kv_heads, max_context, value_dim)
        self.layers = nn.ModuleList(_CacheBuffers(layer) for layer in self.cache.layers)

    def forward(self, input_ids: torch.Tensor, start_position: torch.Tensor) -> torch.Tensor:
        return self.logits(start_position, input_ids=input_ids)

    def logits(self, start_position: torch.Tensor, **tokens: torch.Tensor) -> torch.Tensor:
        """The model's logits for ``tokens`` (``input_ids=`` or ``inputs_embeds=``, one
        prompt of T tokens) written to the cache at ``start_position .. + T - 1``."""
        # The cache layers write the module's buffers themselves: a non-strict export swaps
        # the buffers for the tensors it traces with, which the layers must then see too.
        for layer, buffers in zip(self.cache.layers, self.layers, strict=True):
            layer.keys, layer.values = buffers.k_cache, buffers.v_cache
        (prompt,) = tokens.values()
        positions = start_position + torch.arange(prompt.shape[1])
        out = self.model(
            **tokens,
            position_ids=positions[None],
            cache_position=positions,
            past_key_values=self.cache,
            attention_mask=None,
            use_cache=True,
            logits_to_keep=0 if self.all_logits else 1,
        )
        logits: torch.Tensor = out.logits
        return logits


class _CacheBuffers(nn.Module):
    """One layer's cache tensors as buffers ``k_cache`` / ``v_cache`` (the same tensors the
    cache layer updates in place, so export records the writes as state updates)."""

    def __init__(self, layer: Any) -> None:
        super().__init__()
        self.register_buffer("k_cache", layer.keys, persistent=False)
        self.register_buffer("v_cache", layer.values, persistent=False)


def cache_state_names(ep: torch.export.ExportedProgram) -> list[str]:
    """The states' names: the cache buffers' paths (``layers.3.k_cache``), in state order."""
    from torch.export.graph_signature import InputKind

    mutated = set(ep.graph_signature.buffers_to_mutate.values())
    return [
        spec.target
        for spec in ep.graph_signature.input_specs
        if spec.kind == InputKind.BUFFER and spec.target in mutated
    ]


def token_args(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Example ``(input_ids [1, tokens], start_position [1])`` to trace an entry point with."""
    return torch.zeros(1, tokens, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)


def trace_cached(
    wrapper: CachedCausalLM, args: tuple[torch.Tensor, ...], dynamic_shapes: Any
) -> torch.export.ExportedProgram:
    """Export (decomposed) a module that writes the KV cache of its ``cache`` attribute in
    place (:class:`CachedCausalLM` and modules like it), traced non-strict as the module
    documentation explains; the cache is reset afterwards."""
    try:
        return export_decomposed(wrapper, args, dynamic_shapes=dynamic_shapes, strict=False)
    finally:
        wrapper.cache.reset()  # tracing does not write, but start from a clean cache anyway
