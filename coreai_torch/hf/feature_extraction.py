"""``CoreAIModelForFeatureExtraction``: an encoder-only model (BERT, RoBERTa / XLM-R,
DistilBERT, ModernBERT, …) on the Core AI runtime, for the ``feature-extraction`` pipeline
and sentence embeddings (:func:`pool`).

The program has one entry point with a dynamic batch and sequence length::

    forward(input_ids [B, T], attention_mask [B, T][, token_type_ids [B, T]])
        -> last_hidden_state [B, T, hidden][, pooler_output [B, hidden]]

``token_type_ids`` is an input of models that have token types (BERT), ``pooler_output`` an
output of models that have a pooler.  Padded positions are masked out of the attention, so
padding never changes a real token's embedding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Self

import numpy as np
import torch
import torch.nn as nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPooling

from coreai_torch.hf.base import (
    CoreAIModel,
    checked_config,
    load_for_export,
)
from coreai_torch.hf.tasks import FEATURE_EXTRACTION_TYPES
from coreai_torch.tensors import lazy

#: pooling strategies of :func:`pool`
POOLING = ("mean", "cls", "last")


def pool(
    last_hidden_state: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    strategy: str = "mean",
    normalize: bool = True,
) -> torch.Tensor:
    """Sentence embeddings ``[batch, hidden]`` from token embeddings ``[batch, tokens,
    hidden]``: ``"mean"`` over the tokens the mask keeps, ``"cls"`` the first token,
    ``"last"`` the last token the mask keeps (left or right padding); L2-normalised with
    ``normalize``."""
    if strategy not in POOLING:
        raise ValueError(f"pooling strategy must be one of {', '.join(POOLING)}, got {strategy!r}")
    if last_hidden_state.dim() != 3:
        shape = list(last_hidden_state.shape)
        raise ValueError(f"last_hidden_state must be [batch, tokens, hidden], got {shape}")
    batch, tokens, _ = last_hidden_state.shape
    if attention_mask is None:
        attention_mask = torch.ones(batch, tokens, dtype=torch.int64)
    if list(attention_mask.shape) != [batch, tokens]:
        raise ValueError(
            f"attention_mask must be [batch, tokens] = [{batch}, {tokens}], got "
            f"{list(attention_mask.shape)}"
        )
    mask = attention_mask.to(last_hidden_state.dtype)
    if strategy == "mean":
        summed = (last_hidden_state * mask[..., None]).sum(1)
        out = summed / mask.sum(1, keepdim=True).clamp(min=1)
    elif strategy == "cls":
        out = last_hidden_state[:, 0]
    else:
        positions = torch.arange(tokens).expand(batch, tokens)
        last = torch.where(attention_mask.bool(), positions, -1).max(1).values.clamp(min=0)
        out = last_hidden_state[torch.arange(batch), last]
    if normalize:
        out = torch.nn.functional.normalize(out, p=2, dim=-1)
    return out


class _Encoder(nn.Module):
    """``(input_ids, attention_mask[, token_type_ids]) -> (last_hidden_state[, pooler])``."""

    def __init__(self, model: nn.Module, token_types: bool, pooler: bool) -> None:
        super().__init__()
        self.model = model
        self.token_types = token_types
        self.pooler = pooler

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        kwargs = {"token_type_ids": token_type_ids} if self.token_types else {}
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        if self.pooler:
            return out.last_hidden_state, out.pooler_output
        return (out.last_hidden_state,)


def load_encoder(model_or_dir: PreTrainedModel | Path, who: str) -> PreTrainedModel:
    """The base encoder (``AutoModel``) of a model instance or a local directory, its model
    type checked before any weight is read."""
    config = checked_config(model_or_dir, FEATURE_EXTRACTION_TYPES, who)
    if isinstance(model_or_dir, nn.Module):
        base = getattr(model_or_dir, "base_model", model_or_dir)
        return base.eval()
    from transformers import AutoModel

    return load_for_export(AutoModel, config, model_or_dir)


def _uses_token_types(model: nn.Module) -> bool:
    embeddings = getattr(model, "embeddings", None)
    return getattr(embeddings, "token_type_embeddings", None) is not None


def export_encoder(
    model: nn.Module, max_length: int, precision: Any = None, compress: Any = None
) -> tuple[Any, dict[str, Any]]:
    """The ``AIProgram`` of an encoder (entry point ``forward``, dynamic batch and length)
    and what it takes and returns."""
    from coreai_torch.converter import TorchConverter
    from coreai_torch.frontend.export import export_decomposed
    from coreai_torch.llm.export import (
        compression_config,
        precision_policy,
        traceable_attention,
    )

    policy = precision_policy(precision)
    compression = compression_config(compress)
    token_types = _uses_token_types(model)
    pooler = getattr(model, "pooler", None) is not None
    wrapper = _Encoder(model, token_types, pooler).eval()
    batch = torch.export.Dim("batch", min=1, max=1024)
    tokens = torch.export.Dim("tokens", min=1, max=max_length)
    ids = torch.ones(2, 8, dtype=torch.int64)
    args: tuple[torch.Tensor, ...] = (ids, torch.ones_like(ids))
    inputs = ["input_ids", "attention_mask"]
    if token_types:
        args += (torch.zeros_like(ids),)
        inputs.append("token_type_ids")
    outputs = ["last_hidden_state", *(["pooler_output"] if pooler else [])]
    dims = tuple({0: batch, 1: tokens} for _ in args)
    # lazy.tracing(): a streamed model's weights are lazy, traced without recording
    with traceable_attention(model), torch.no_grad(), lazy.tracing():
        ep = export_decomposed(wrapper, args, dynamic_shapes=dims)
    converter = TorchConverter(compute_precision=policy)
    converter.add_exported_program(
        ep, input_names=inputs, output_names=outputs, entrypoint_name="forward"
    )
    program = converter.to_coreai()
    if compression is not None:
        program.compress(compression)
    meta = {
        "inputs": inputs,
        "outputs": outputs,
        "max_length": max_length,
        "precision": policy.name,
        "compression": compression.describe() if compression is not None else None,
    }
    return program.optimize(), meta


class CoreAIModelForFeatureExtraction(CoreAIModel):
    """An encoder-only model exported to a Core AI program (dynamic batch and sequence
    length) and run on the Core AI runtime::

        model = CoreAIModelForFeatureExtraction.from_pretrained("bert_dir", export=True)
        out = model(**tokenizer(sentences, padding=True, return_tensors="pt"))
        embeddings = model.pool(out.last_hidden_state, inputs["attention_mask"], "mean")
        pipeline("feature-extraction", model=model, tokenizer=tokenizer)

    ``model(**inputs)`` returns ``BaseModelOutputWithPooling`` (``last_hidden_state``, and
    ``pooler_output`` for models with a pooler).
    """

    task = "feature-extraction"
    pool = staticmethod(pool)

    @classmethod
    def _export_model(
        cls,
        source: PreTrainedModel | Path,
        *,
        max_context: int | None,
        precision: Any,
        compress: Any,
        max_length: int | None = None,
    ) -> Self:
        from coreai_torch.hf.causal_lm import describe_options

        describe_options(precision, compress)  # bad options fail before loading
        if max_context is not None:
            raise ValueError(
                f"{cls.__name__} has no KV cache: max_context does not apply (max_length sets "
                "the longest sequence)"
            )
        encoder = load_encoder(source, cls.__name__)
        limit = _position_limit(encoder.config)
        if max_length is None:
            max_length = limit
        if not isinstance(max_length, int) or not 1 <= max_length <= limit:
            raise ValueError(
                f"max_length must be an int in [1, {limit}] (the model's "
                f"max_position_embeddings), got {max_length!r}"
            )
        program, meta = export_encoder(encoder, max_length, precision, compress)
        return cls._from_programs(encoder, {"model": program}, meta, source)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> BaseModelOutputWithPooling | tuple:
        """Token embeddings of ``input_ids`` (``[batch, tokens]``)."""
        unknown = [k for k, v in kwargs.items() if v is not None and k != "position_ids"]
        if unknown or kwargs.get("position_ids") is not None:
            raise NotImplementedError(
                f"{type(self).__name__}.forward takes input_ids, attention_mask and "
                f"token_type_ids; not {', '.join(unknown or ['position_ids'])}"
            )
        if input_ids is None or input_ids.dim() != 2 or 0 in input_ids.shape:
            raise ValueError("input_ids must be a non-empty [batch, tokens] tensor of token ids")
        batch, tokens = input_ids.shape
        limit = self.coreai_config["max_length"]
        if tokens > limit:
            raise ValueError(
                f"{tokens} tokens exceed the longest sequence the model was exported for "
                f"(max_length={limit}); truncate the input (truncation=True, max_length={limit})"
            )
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        feeds = {"input_ids": input_ids, "attention_mask": attention_mask}
        if "token_type_ids" in self.coreai_config["inputs"]:
            feeds["token_type_ids"] = (
                token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
            )
        elif token_type_ids is not None and bool(token_type_ids.any()):
            raise ValueError(f"a '{self.config.model_type}' model has no token types")
        for name, value in feeds.items():
            if list(value.shape) != [batch, tokens]:
                raise ValueError(
                    f"{name} must be [batch, tokens] = [{batch}, {tokens}] like input_ids, got "
                    f"{list(value.shape)}"
                )
        arrays = {k: np.ascontiguousarray(v.numpy(), np.int64) for k, v in feeds.items()}
        out = self._run("model", "forward", arrays)
        result = BaseModelOutputWithPooling(
            **{
                k: torch.from_numpy(np.asarray(out[k], np.float32))
                for k in self.coreai_config["outputs"]
            }
        )
        return result if return_dict is not False else result.to_tuple()


def _position_limit(config: Any) -> int:
    limit = getattr(config, "max_position_embeddings", None) or 512
    # RoBERTa-style models start their positions after the padding index
    if config.model_type in ("roberta", "xlm-roberta", "camembert") and config.pad_token_id:
        limit -= config.pad_token_id + 1
    return int(limit)
