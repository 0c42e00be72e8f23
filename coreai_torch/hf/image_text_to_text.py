"""``CoreAIModelForImageTextToText``: a LLaVA-style vision-language model (vision tower +
projector + Llama / Mistral / Qwen2 decoder) on the Core AI runtime, with ``generate``
(``transformers``' ``GenerationMixin``) and the ``image-text-to-text`` pipeline.

One program, whose entry points share the weights (stored once) and the KV cache (state)::

    image_features(pixel_values [1, 3, size, size]) -> image_features [1, image_tokens, hidden]
    embed(input_ids [1, T]) -> inputs_embeds [1, T, hidden]
    prefill(inputs_embeds [1, T, hidden], start_position [1]) -> logits [1, 1, vocab]
    forward(inputs_embeds [1, T, hidden], start_position [1]) -> logits [1, T, vocab]
    decode(input_ids [1, 1], start_position [1]) -> logits [1, 1, vocab]

The image features are computed once per image, written into the token embeddings at the
image tokens (as the processor expanded them), then the prompt is prefilled and decoded as a
causal LM's.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import numpy as np
import torch
import torch.nn as nn
from transformers import PreTrainedModel

from coreai_torch.hf.base import checked_config, load_for_export
from coreai_torch.hf.causal_lm import (
    CoreAIModelForCausalLM,
    RuntimeCache,
    describe_options,
    split_rows,
)
from coreai_torch.hf.tasks import IMAGE_TEXT_DECODER_TYPES, IMAGE_TEXT_TO_TEXT_TYPES
from coreai_torch.tensors import lazy

if TYPE_CHECKING:
    from coreai_torch.llm.static_cache import CachedCausalLM


class ImageFeatures(nn.Module):
    """``pixel_values -> image_features`` (vision tower + projector)."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        features = self.model.model.get_image_features(pixel_values=pixel_values)
        if isinstance(features, (list, tuple)):
            features = torch.stack(list(features))
        return features


class TokenEmbeddings(nn.Module):
    """``input_ids -> inputs_embeds``."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.embeddings = model.get_input_embeddings()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embeddings(input_ids)


def _embeds_lm(model: PreTrainedModel, max_context: int, all_logits: bool) -> CachedCausalLM:
    """The cached decoder of :mod:`coreai_torch.llm.static_cache` fed with embeddings."""
    from coreai_torch.llm.static_cache import CachedCausalLM

    class CachedEmbedsLM(CachedCausalLM):
        def forward(self, inputs_embeds: torch.Tensor, start_position: torch.Tensor) -> Any:
            return self.logits(start_position, inputs_embeds=inputs_embeds)

    return CachedEmbedsLM(model, max_context, all_logits=all_logits).eval()


def export_vlm(
    model: PreTrainedModel,
    max_context: int,
    precision: Any = None,
    compress: Any = None,
    *,
    all_logits_entry_point: bool = True,
) -> tuple[Any, int]:
    """The ``AIProgram`` of a LLaVA-style model (see the module documentation) and the
    number of tokens of each image."""
    from coreai_torch.converter import TorchConverter
    from coreai_torch.frontend.export import export_decomposed
    from coreai_torch.llm.export import (
        check_max_context,
        compression_config,
        precision_policy,
        traceable_attention,
    )
    from coreai_torch.llm.static_cache import (
        CachedCausalLM,
        cache_state_names,
        token_args,
        trace_cached,
    )

    policy = precision_policy(precision)
    compression = compression_config(compress)
    check_max_context(model, max_context)
    vision = model.config.vision_config
    hidden = model.config.get_text_config().hidden_size
    pixels = torch.zeros(1, vision.num_channels, vision.image_size, vision.image_size)
    tokens = torch.export.Dim("tokens", min=1, max=max_context)
    start = torch.zeros(1, dtype=torch.int64)
    converter = TorchConverter(compute_precision=policy)
    # lazy.tracing(): a streamed model's weights are lazy, traced without recording
    with traceable_attention(model), torch.no_grad(), lazy.tracing():
        features = export_decomposed(ImageFeatures(model).eval(), (pixels,))
        embed = export_decomposed(
            TokenEmbeddings(model).eval(),
            (torch.zeros(1, 2, dtype=torch.int64),),
            dynamic_shapes=({1: tokens},),
        )
        decoders = {}
        embeds = (torch.zeros(1, 2, hidden, dtype=model.dtype), start)
        for name, all_logits in (("prefill", False), ("forward", True)):
            if all_logits and not all_logits_entry_point:
                continue
            wrapper = _embeds_lm(model, max_context, all_logits)
            decoders[name] = trace_cached(wrapper, embeds, ({1: tokens}, None))
        decode = CachedCausalLM(model, max_context).eval()
        decoders["decode"] = trace_cached(decode, token_args(1), None)
    converter.add_exported_program(
        features,
        input_names=["pixel_values"],
        output_names=["image_features"],
        entrypoint_name="image_features",
    )
    converter.add_exported_program(
        embed, input_names=["input_ids"], output_names=["inputs_embeds"], entrypoint_name="embed"
    )
    for name, ep in decoders.items():
        first = "input_ids" if name == "decode" else "inputs_embeds"
        converter.add_exported_program(
            ep,
            input_names=[first, "start_position"],
            output_names=["logits"],
            state_names=cache_state_names(ep),
            entrypoint_name=name,
        )
    program = converter.to_coreai()
    if compression is not None:
        program.compress(compression)
    output = next(n for n in features.graph.nodes if n.op == "output")
    image_tokens = int(output.args[0][0].meta["val"].shape[1])
    return program.optimize(), image_tokens


class CoreAIModelForImageTextToText(CoreAIModelForCausalLM):
    """A LLaVA-style vision-language model exported to one Core AI program and run on the Core
    AI runtime::

        model = CoreAIModelForImageTextToText.from_pretrained("llava_dir", export=True)
        inputs = processor(images=image, text="USER: <image>\\nWhat is this? ASSISTANT:",
                           return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=32)
        pipeline("image-text-to-text", model=model, processor=processor)

    ``generate`` is ``transformers``' (greedy search, sampling, beam search); the image
    features are computed once per image at the prefill.
    """

    task = "image-text-to-text"

    @classmethod
    def _export_model(
        cls,
        source: PreTrainedModel | Path,
        *,
        max_context: int | None,
        precision: Any,
        compress: Any,
        all_logits_entry_point: bool = True,
        calibration: Any = None,
        target_bpw: float | None = None,
    ) -> Self:
        from coreai_torch.llm.export import default_max_context

        if calibration is not None or target_bpw is not None:
            raise ValueError(
                f"{cls.__name__} exports without calibration: calibration= and target_bpw= "
                "apply to text models (CoreAIModelForCausalLM)"
            )
        describe = describe_options(precision, compress)
        config = checked_config(source, IMAGE_TEXT_TO_TEXT_TYPES, cls.__name__)
        _check_decoder(config, str(source) if isinstance(source, Path) else type(source).__name__)
        if isinstance(source, Path):
            from transformers import AutoModelForImageTextToText

            model = load_for_export(AutoModelForImageTextToText, config, source)
        else:
            model = source
        model = model.eval()
        if max_context is None:
            max_context = default_max_context(model.config)
        program, image_tokens = export_vlm(
            model, max_context, precision, compress, all_logits_entry_point=all_logits_entry_point
        )
        vision = model.config.vision_config
        meta = {
            "max_context": max_context,
            "image_size": vision.image_size,
            "image_tokens": image_tokens,
            "num_channels": vision.num_channels,
            **describe,
        }
        return cls._from_programs(model, {"model": program}, meta, source)

    # -- running ------------------------------------------------------------------------------

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The projected features of each image, ``[images, image_tokens, hidden]``."""
        size, channels = self.coreai_config["image_size"], self.coreai_config["num_channels"]
        if (
            not isinstance(pixel_values, torch.Tensor)
            or pixel_values.dim() != 4
            or list(pixel_values.shape[1:]) != [channels, size, size]
        ):
            shape = list(getattr(pixel_values, "shape", []))
            raise ValueError(
                f"pixel_values must be [images, {channels}, {size}, {size}] (as the model's "
                f"image processor makes them), got {shape}"
            )
        return self._run_each_row("image_features", "pixel_values", pixel_values, "image_features")

    def _embed(self, ids: torch.Tensor) -> np.ndarray:
        feed = np.ascontiguousarray(ids.numpy(), np.int64).reshape(1, -1)
        return self._run("model", "embed", {"input_ids": feed})["inputs_embeds"][0]

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: RuntimeCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        return_dict: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        **kwargs: Any,
    ) -> Any:
        """Feed ``input_ids`` (with the processor's image tokens, whose embeddings become the
        features of ``pixel_values``, in order) after what ``past_key_values`` holds."""
        from transformers.modeling_outputs import CausalLMOutputWithPast

        if inputs_embeds is not None:
            raise NotImplementedError(
                f"{type(self).__name__} takes input_ids and pixel_values, not inputs_embeds"
            )
        if output_attentions or output_hidden_states:
            raise NotImplementedError(
                f"{type(self).__name__} returns logits only (no attentions or hidden states)"
            )
        if input_ids is None or input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError("input_ids must be a [batch, tokens] tensor with at least one token")
        cache = past_key_values if past_key_values is not None else self._new_cache(len(input_ids))
        if not isinstance(cache, RuntimeCache) or len(cache) != len(input_ids):
            raise ValueError(
                "past_key_values must be the RuntimeCache returned for the same batch size"
            )
        rows = split_rows(input_ids, attention_mask, cache.seen, cache.lengths)
        image_token = self.config.image_token_id
        counts = [int((ids == image_token).sum()) for _, ids in rows]
        features = np.empty((0, 0), np.float32)  # the images' features, if the prompt has any
        if sum(counts):
            if pixel_values is None:
                raise ValueError(
                    f"input_ids hold {sum(counts)} image tokens but no pixel_values were given"
                )
            if any(cache.lengths[r] > 0 for r, n in enumerate(counts) if n):
                raise ValueError("image tokens must be in the prompt (the first call)")
            per_image = self._image_tokens()
            if sum(counts) != per_image * len(pixel_values):
                raise ValueError(
                    f"input_ids hold {sum(counts)} image tokens; {len(pixel_values)} image(s) "
                    f"of {per_image} tokens each need {per_image * len(pixel_values)} (use the "
                    "model's processor, which expands each image token)"
                )
            for r, (_, ids) in enumerate(rows):  # bad lengths fail before any image runs
                if self.max_context is not None and cache.lengths[r] + len(ids) > self.max_context:
                    raise ValueError(
                        f"row {r}: {cache.lengths[r]} cached + {len(ids)} new tokens exceed the "
                        f"model's max_context={self.max_context} (export with a larger "
                        "max_context, or shorten the prompt)"
                    )
            features = self.image_features(pixel_values).reshape(-1, self._hidden()).numpy()
        elif pixel_values is not None and all(n == 0 for n in cache.lengths):
            raise ValueError(
                "pixel_values were given but input_ids hold no image token "
                f"(id {image_token}); use the model's processor to build the prompt"
            )
        feeds, used = [], 0
        for r, (_, ids) in enumerate(rows):
            if cache.lengths[r] > 0 and len(ids) == 1:
                feeds.append((ids.numpy(), 1))
                continue
            embeds = self._embed(ids).astype(np.float32)
            if counts[r]:
                embeds[(ids == image_token).numpy()] = features[used : used + counts[r]]
                used += counts[r]
            feeds.append((embeds, len(ids)))
        all_logits = logits_to_keep != 1
        logits = self._run_rows(cache, feeds, all_logits)
        cache.seen += input_ids.shape[1]
        vocab = logits[0].shape[-1]
        if all_logits:
            out = torch.zeros(len(rows), input_ids.shape[1], vocab, dtype=torch.float32)
            for r, ((cols, _), row) in enumerate(zip(rows, logits, strict=True)):
                out[r, cols] = torch.from_numpy(np.ascontiguousarray(row, np.float32))
            if logits_to_keep > 0:
                out = out[:, -logits_to_keep:]
        else:
            out = torch.from_numpy(np.stack([row[-1:] for row in logits]).astype(np.float32))
        result = CausalLMOutputWithPast(
            logits=out, past_key_values=cache if use_cache is not False else None
        )
        return result if return_dict is not False else result.to_tuple()

    def _step(
        self, values: Any, n: int, start: int, states: dict[str, Any], all_logits: bool
    ) -> np.ndarray:
        values = np.asarray(values)
        if values.ndim == 1:  # one token id: a decode step
            return super()._step(values, n, start, states, all_logits)
        entry = "forward" if all_logits else "prefill"
        dtype = self._input_dtype(entry, "inputs_embeds")
        out = self._run(
            "model",
            entry,
            {
                "inputs_embeds": np.ascontiguousarray(values[None], dtype),
                "start_position": np.asarray([start], np.int64),
            },
            state=states,
        )
        return out["logits"][0]

    def _input_dtype(self, entry: str, name: str) -> np.dtype:
        from coreai_torch.runtime import numpy_dtype

        desc = self.sessions["model"].descriptor(entry).input_descriptor(name)
        return numpy_dtype(desc.dtype)

    def _image_tokens(self) -> int:
        return int(self.coreai_config["image_tokens"])

    def _hidden(self) -> int:
        return int(self.config.get_text_config().hidden_size)


def _check_decoder(config: Any, what: str) -> None:
    from coreai_torch.errors import UnsupportedModelError

    text = config.get_text_config()
    if getattr(text, "model_type", None) not in IMAGE_TEXT_DECODER_TYPES:
        raise UnsupportedModelError(
            f"{what}: a '{config.model_type}' model with a '{text.model_type}' text decoder is "
            f"not supported (text decoders: {', '.join(IMAGE_TEXT_DECODER_TYPES)})"
        )
