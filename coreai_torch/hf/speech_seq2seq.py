"""``CoreAIModelForSpeechSeq2Seq``: Whisper on the Core AI runtime, with Whisper's own
``generate`` (``transformers``' ``WhisperGenerationMixin``: language / task / timestamp
tokens as the generation config sets them) and the ``automatic-speech-recognition``
pipeline.

One program, whose entry points share the weights (stored once) and the caches (Core AI
state)::

    encode(input_features [1, mel_bins, frames]) -> last_hidden_state [1, positions, d_model]
    prefill(input_ids [1, T], start_position [1], encoder_hidden_states [1, positions, d_model])
        -> logits [1, T, vocab]
    decode(input_ids [1, 1], start_position [1]) -> logits [1, 1, vocab]
    states: layers.{i}.k_cache / v_cache  [1, heads, max_context, head_dim]   self-attention
            layers.{i}.cross_k / cross_v  [1, heads, positions, head_dim]     cross-attention

The encoder runs once per input.  ``prefill`` computes every layer's cross-attention keys and
values from the encoder output once and keeps them in state; ``decode`` reads them (it
rewrites one position of them with itself: a state must be written by each entry point that
uses it).  A batch runs row by row, each row with its own states.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Self, cast

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, Seq2SeqLMOutput
from transformers.models.whisper.generation_whisper import WhisperGenerationMixin

from coreai_torch.hf.base import (
    CoreAIModel,
    checked_config,
    load_for_export,
)
from coreai_torch.hf.causal_lm import RuntimeCache, check_generation_mode, describe_options
from coreai_torch.hf.tasks import SPEECH_SEQ2SEQ_TYPES
from coreai_torch.tensors import lazy


class WhisperEncoder(nn.Module):
    """``input_features -> last_hidden_state`` (Hugging Face's encoder)."""

    def __init__(self, encoder: PreTrainedModel) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, input_features: torch.Tensor) -> torch.Tensor:
        return self.encoder(input_features).last_hidden_state


class WhisperDecoderWithCache(nn.Module):
    """Whisper's decoder over a self-attention cache of ``max_context`` positions and a
    cross-attention cache, both in buffers (states once exported).  With ``write_cross`` the
    cross-attention keys/values are computed from ``encoder_hidden_states`` and stored;
    otherwise they are read from the buffers."""

    def __init__(self, model: PreTrainedModel, max_context: int, *, write_cross: bool) -> None:
        super().__init__()
        config = model.config
        self.decoder = model.model.decoder
        self.proj_out = model.proj_out
        self.write_cross = write_cross
        self.heads: int = config.decoder_attention_heads
        self.head_dim: int = config.d_model // self.heads
        self.max_context = max_context
        dtype = self.proj_out.weight.dtype
        self_shape = (1, self.heads, max_context, self.head_dim)
        cross_shape = (1, self.heads, config.max_source_positions, self.head_dim)
        self.layers = nn.ModuleList(
            _LayerCache(self_shape, cross_shape, dtype) for _ in range(config.decoder_layers)
        )

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(1, x.shape[1], self.heads, self.head_dim).transpose(1, 2)

    def forward(
        self,
        input_ids: torch.Tensor,
        start_position: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        decoder = self.decoder
        tokens = input_ids.shape[1]
        positions = start_position + torch.arange(tokens)
        hidden = (
            decoder.embed_tokens(input_ids)
            + F.embedding(positions, decoder.embed_positions.weight)[None]
        )
        allowed = torch.arange(self.max_context)[None, :] <= positions[:, None]
        caches = cast("list[_LayerCache]", self.layers)
        for layer, cache in zip(decoder.layers, caches, strict=True):
            attn = layer.self_attn
            x = layer.self_attn_layer_norm(hidden)
            q = self._heads(attn.q_proj(x) * attn.scaling)
            cache.k_cache.index_copy_(2, positions, self._heads(attn.k_proj(x)))
            cache.v_cache.index_copy_(2, positions, self._heads(attn.v_proj(x)))
            out = F.scaled_dot_product_attention(
                q, cache.k_cache, cache.v_cache, attn_mask=allowed, scale=1.0
            )
            hidden = hidden + attn.out_proj(out.transpose(1, 2).reshape(1, tokens, -1))

            cross = layer.encoder_attn
            x = layer.encoder_attn_layer_norm(hidden)
            if self.write_cross:
                assert encoder_hidden_states is not None
                cache.cross_k.copy_(self._heads(cross.k_proj(encoder_hidden_states)))
                cache.cross_v.copy_(self._heads(cross.v_proj(encoder_hidden_states)))
            else:  # a state is written by every entry point that reads it
                cache.cross_k[:, :, :1].copy_(cache.cross_k[:, :, :1])
                cache.cross_v[:, :, :1].copy_(cache.cross_v[:, :, :1])
            q = self._heads(cross.q_proj(x) * cross.scaling)
            out = F.scaled_dot_product_attention(q, cache.cross_k, cache.cross_v, scale=1.0)
            hidden = hidden + cross.out_proj(out.transpose(1, 2).reshape(1, tokens, -1))

            x = layer.final_layer_norm(hidden)
            hidden = hidden + layer.fc2(layer.activation_fn(layer.fc1(x)))
        return self.proj_out(decoder.layer_norm(hidden))


class _LayerCache(nn.Module):
    """One decoder layer's self-attention and cross-attention caches (states once exported)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    cross_k: torch.Tensor
    cross_v: torch.Tensor

    def __init__(
        self, self_shape: tuple[int, ...], cross_shape: tuple[int, ...], dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(self_shape, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(self_shape, dtype=dtype))
        self.register_buffer("cross_k", torch.zeros(cross_shape, dtype=dtype))
        self.register_buffer("cross_v", torch.zeros(cross_shape, dtype=dtype))


def input_frames(config: Any) -> int:
    """Feature frames the encoder takes (``2 * max_source_positions``: two strided convs)."""
    return 2 * config.max_source_positions


def export_whisper(
    model: PreTrainedModel, max_context: int, precision: Any = None, compress: Any = None
) -> Any:
    """The ``AIProgram`` of a ``WhisperForConditionalGeneration`` (``encode``, ``prefill``,
    ``decode``; see the module documentation)."""
    from coreai_torch.converter import TorchConverter
    from coreai_torch.frontend.export import export_decomposed
    from coreai_torch.llm.export import (
        compression_config,
        precision_policy,
        traceable_attention,
    )
    from coreai_torch.llm.static_cache import cache_state_names

    policy = precision_policy(precision)
    compression = compression_config(compress)
    config = model.config
    features = torch.zeros(1, config.num_mel_bins, input_frames(config))
    hidden = torch.zeros(1, config.max_source_positions, config.d_model)
    start = torch.zeros(1, dtype=torch.int64)
    tokens = torch.export.Dim("tokens", min=1, max=max_context)
    converter = TorchConverter(compute_precision=policy)
    # lazy.tracing(): a streamed model's weights are lazy, traced without recording
    with traceable_attention(model), torch.no_grad(), lazy.tracing():
        encoder = export_decomposed(WhisperEncoder(model.model.encoder).eval(), (features,))
        converter.add_exported_program(
            encoder,
            input_names=["input_features"],
            output_names=["last_hidden_state"],
            entrypoint_name="encode",
        )
        prefill = export_decomposed(
            WhisperDecoderWithCache(model, max_context, write_cross=True).eval(),
            (torch.zeros(1, 2, dtype=torch.int64), start, hidden),
            dynamic_shapes=({1: tokens}, None, None),
        )
        decode = export_decomposed(
            WhisperDecoderWithCache(model, max_context, write_cross=False).eval(),
            (torch.zeros(1, 1, dtype=torch.int64), start),
        )
    for name, ep, inputs in (
        ("prefill", prefill, ["input_ids", "start_position", "encoder_hidden_states"]),
        ("decode", decode, ["input_ids", "start_position"]),
    ):
        converter.add_exported_program(
            ep,
            input_names=inputs,
            output_names=["logits"],
            state_names=cache_state_names(ep),
            entrypoint_name=name,
        )
    program = converter.to_coreai()
    if compression is not None:
        program.compress(compression)
    return program.optimize()


class _EncoderStub:
    """What ``WhisperGenerationMixin`` reads of ``model.encoder``: the convolutions'
    strides."""

    def __init__(self) -> None:
        stride = type("Conv", (), {"stride": (1,)})
        self.conv1 = stride()
        self.conv2 = type("Conv", (), {"stride": (2,)})()


class _ModelStub:
    """What ``WhisperGenerationMixin`` reads of ``self.model``."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.encoder = _EncoderStub()


class _RuntimeEncoder(nn.Module):
    """``get_encoder()``: the ``encode`` entry point, row by row."""

    main_input_name = "input_features"

    def __init__(self, owner: CoreAIModelForSpeechSeq2Seq) -> None:
        super().__init__()
        self._owner = [owner]  # not a submodule

    def forward(
        self,
        input_features: torch.Tensor,
        return_dict: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        **kwargs: Any,
    ) -> BaseModelOutput:
        if output_attentions or output_hidden_states:
            raise NotImplementedError(
                "the Core AI Whisper encoder returns its last hidden state only (no attentions "
                "or hidden states)"
            )
        return BaseModelOutput(last_hidden_state=self._owner[0].encode(input_features))


class CoreAIModelForSpeechSeq2Seq(WhisperGenerationMixin, CoreAIModel):
    """Whisper exported to one Core AI program and run on the Core AI runtime::

        model = CoreAIModelForSpeechSeq2Seq.from_pretrained("whisper_dir", export=True)
        features = processor(audio, sampling_rate=16000, return_tensors="pt").input_features
        ids = model.generate(features, language="en", task="transcribe")
        pipeline("automatic-speech-recognition", model=model, tokenizer=processor.tokenizer,
                 feature_extractor=processor.feature_extractor)

    ``generate`` is Whisper's (greedy search, sampling, beam search);
    ``model(input_features=..., decoder_input_ids=...)`` returns ``Seq2SeqLMOutput`` with
    every decoder position's logits and the encoder's last hidden state.
    """

    task = "automatic-speech-recognition"
    main_input_name = "input_features"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.model = _ModelStub(self.config)
        self._encoder = _RuntimeEncoder(self)

    def get_encoder(self) -> nn.Module:
        return self._encoder

    @classmethod
    def _export_model(
        cls,
        source: PreTrainedModel | Path,
        *,
        max_context: int | None,
        precision: Any,
        compress: Any,
    ) -> Self:
        describe = describe_options(precision, compress)
        config = checked_config(source, SPEECH_SEQ2SEQ_TYPES, cls.__name__)
        if isinstance(source, Path):
            from transformers import AutoModelForSpeechSeq2Seq

            model = load_for_export(AutoModelForSpeechSeq2Seq, config, source)
        else:
            model = source
        if not hasattr(model, "proj_out"):
            raise ValueError(
                f"{type(model).__name__} has no language-model head; export a "
                "WhisperForConditionalGeneration"
            )
        model = model.eval()
        limit = model.config.max_target_positions
        if max_context is None:
            max_context = limit
        if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 2:
            raise ValueError(f"max_context must be an int >= 2, got {max_context!r}")
        if max_context > limit:
            raise ValueError(
                f"max_context={max_context} exceeds the decoder's max_target_positions ({limit})"
            )
        program = export_whisper(model, max_context, precision, compress)
        meta = {"max_context": max_context, **describe}
        return cls._from_programs(model, {"model": program}, meta, source)

    # -- the encoder --------------------------------------------------------------------------

    def encode(self, input_features: torch.Tensor) -> torch.Tensor:
        """The encoder's last hidden state ``[batch, positions, d_model]`` (row by row)."""
        frames = input_frames(self.config)
        expected = [self.config.num_mel_bins, frames]
        if (
            not isinstance(input_features, torch.Tensor)
            or input_features.dim() != 3
            or list(input_features.shape[1:]) != expected
        ):
            shape = list(getattr(input_features, "shape", []))
            raise ValueError(
                f"input_features must be [batch, {expected[0]}, {expected[1]}] (log-mel "
                f"features of 30 s of audio, as the feature extractor makes them), got {shape}"
            )
        return self._run_each_row("encode", "input_features", input_features, "last_hidden_state")

    # -- GenerationMixin hooks ----------------------------------------------------------------

    def _prepare_cache_for_generation(
        self,
        generation_config: Any,
        model_kwargs: dict,
        generation_mode: Any,
        batch_size: int,
        max_cache_length: int,
    ) -> None:
        if self.max_context is not None and max_cache_length > self.max_context:
            raise ValueError(
                f"generating up to max_length={generation_config.max_length} decoder tokens needs "
                f"{max_cache_length} cache positions; the model was exported with max_context="
                f"{self.max_context}: export with a larger max_context or lower max_new_tokens"
            )
        generation_config.use_cache = True
        # rows once generate has expanded the inputs for beams / returned sequences
        expand = max(generation_config.num_beams, generation_config.num_return_sequences)
        model_kwargs["past_key_values"] = self._new_cache(batch_size * expand)

    def _new_cache(self, batch_size: int) -> RuntimeCache:
        return RuntimeCache([self._fresh_states("model", "prefill") for _ in range(batch_size)])

    def generate(
        self, input_features: torch.Tensor | None = None, *args: Any, **kwargs: Any
    ) -> Any:
        """Whisper's ``generate`` (``WhisperGenerationMixin``), its inputs checked first."""
        if kwargs.get("return_token_timestamps") or kwargs.get("output_attentions"):
            raise NotImplementedError(
                f"{type(self).__name__}.generate does not return attentions (token timestamps "
                "need the cross-attention weights); segment timestamps (return_timestamps) work"
            )
        check_generation_mode(self, kwargs)
        if input_features is not None:
            frames = input_frames(self.config)
            if input_features.dim() != 3 or input_features.shape[1] != self.config.num_mel_bins:
                raise ValueError(
                    f"input_features must be [batch, {self.config.num_mel_bins}, frames] log-mel "
                    f"features, got {list(input_features.shape)}"
                )
            if input_features.shape[2] < frames and kwargs.get("attention_mask") is None:
                raise ValueError(
                    f"input_features has {input_features.shape[2]} frames; Whisper takes "
                    f"{frames} (pad the audio to 30 s, as the feature extractor does)"
                )
        return super().generate(input_features, *args, **kwargs)

    def _postprocess_outputs(self, seek_outputs: Any, *args: Any, **kwargs: Any) -> Any:
        # the runtime cache is not split per row (Whisper splits past_key_values by batch)
        if hasattr(seek_outputs, "past_key_values") and seek_outputs.past_key_values is not None:
            fields = {k: v for k, v in seek_outputs.items() if k != "past_key_values"}
            seek_outputs = type(seek_outputs)(**fields)
        return super()._postprocess_outputs(seek_outputs, *args, **kwargs)

    # -- running ------------------------------------------------------------------------------

    def forward(
        self,
        input_features: torch.Tensor | None = None,
        decoder_input_ids: torch.Tensor | None = None,
        encoder_outputs: Any = None,
        past_key_values: RuntimeCache | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        use_cache: bool | None = None,
        return_dict: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        **kwargs: Any,
    ) -> Seq2SeqLMOutput | tuple:
        """Decoder logits of ``decoder_input_ids`` after what ``past_key_values`` holds (a
        fresh cache if None), cross-attending to ``encoder_outputs`` (computed from
        ``input_features`` if not given)."""
        if output_attentions or output_hidden_states:
            raise NotImplementedError(
                f"{type(self).__name__} returns logits only (no attentions or hidden states)"
            )
        if decoder_input_ids is None or decoder_input_ids.dim() != 2:
            raise ValueError("decoder_input_ids must be a [batch, tokens] tensor of token ids")
        if decoder_attention_mask is not None and not bool(decoder_attention_mask.all()):
            raise NotImplementedError(
                f"{type(self).__name__} does not take padded decoder inputs "
                "(decoder_attention_mask with zeros)"
            )
        batch, new = decoder_input_ids.shape
        if encoder_outputs is None:
            if input_features is None:
                raise ValueError("pass input_features or encoder_outputs")
            encoder_outputs = BaseModelOutput(last_hidden_state=self.encode(input_features))
        elif isinstance(encoder_outputs, (tuple, list)):
            encoder_outputs = BaseModelOutput(last_hidden_state=encoder_outputs[0])
        hidden = encoder_outputs.last_hidden_state
        if hidden.shape[0] != batch:
            raise ValueError(
                f"the encoder output has batch {hidden.shape[0]}, decoder_input_ids {batch}"
            )
        cache = past_key_values if past_key_values is not None else self._new_cache(batch)
        if not isinstance(cache, RuntimeCache) or len(cache) != batch:
            raise ValueError(
                "past_key_values must be the RuntimeCache returned for the same batch size"
            )
        for r in range(batch):
            if self.max_context is not None and cache.lengths[r] + new > self.max_context:
                raise ValueError(
                    f"row {r}: {cache.lengths[r]} cached + {new} new decoder tokens exceed the "
                    f"model's max_context={self.max_context}"
                )
        logits = []
        for r in range(batch):
            ids = np.ascontiguousarray(decoder_input_ids[r : r + 1].numpy(), np.int64)
            start = np.asarray([cache.lengths[r]], np.int64)
            if cache.lengths[r] > 0 and new == 1:
                out = self._run(
                    "model",
                    "decode",
                    {"input_ids": ids, "start_position": start},
                    state=cache.rows[r],
                )
            else:
                out = self._run(
                    "model",
                    "prefill",
                    {
                        "input_ids": ids,
                        "start_position": start,
                        "encoder_hidden_states": np.ascontiguousarray(
                            hidden[r : r + 1].float().numpy()
                        ),
                    },
                    state=cache.rows[r],
                )
            logits.append(out["logits"])
            cache.lengths[r] += new
        cache.seen += new
        result = Seq2SeqLMOutput(
            logits=torch.from_numpy(np.concatenate(logits).astype(np.float32)),
            past_key_values=cache if use_cache is not False else None,
            encoder_last_hidden_state=hidden,
        )
        return result if return_dict is not False else result.to_tuple()
