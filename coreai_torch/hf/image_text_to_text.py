"""``CoreAIModelForImageTextToText``: a LLaVA-style vision-language model (vision tower +
projector + Llama / Mistral / Qwen2 decoder) on the Core AI runtime, with ``generate``
(``transformers``' ``GenerationMixin``) and the ``image-text-to-text`` pipeline.

Three programs, the three assets of the vision-language bundle Apple's app runtime loads
(``CoreAIVisionLanguageModel``, kind ``vlm``; ``docs/bundles.md``), each holding its weights
once::

    main (decoder)      main(inputs_embeds: float16 [1, T, hidden], position_ids: int32 [1, P])
                            -> logits float16 [1, T, vocab]; states keyCache, valueCache
    embedding           main(input_ids: int32 [1, T]) -> embeddings float16 [1, T, hidden]
    vision              main(pixel_values: float32 [1, 3, S, S])
                            -> image_features float16 [1, image_tokens, hidden]

The decoder is :mod:`coreai_torch.llm.decoder`'s ``main`` fed with embeddings.  The image
features are computed once per image and written over the embeddings of the image tokens (as
the processor expanded them), then the prompt is prefilled and decoded as a causal LM's, every
token embedded by the ``embedding`` asset.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import numpy as np
import torch
import torch.nn as nn
from transformers import PreTrainedModel

from coreai_torch.bundles.manifest import VisionConfig
from coreai_torch.errors import BundleError
from coreai_torch.hf.base import PREPROCESSING_FILES, checked_config, load_for_export
from coreai_torch.hf.causal_lm import (
    CoreAIModelForCausalLM,
    RuntimeCache,
    describe_options,
    split_rows,
)
from coreai_torch.hf.tasks import IMAGE_TEXT_DECODER_TYPES, IMAGE_TEXT_TO_TEXT_TYPES
from coreai_torch.tensors import lazy

if TYPE_CHECKING:
    from coreai_torch.bundles import Bundle

#: the function of the ``embedding`` and ``vision`` assets (Apple's public VLM exports' name)
COMPONENT_FUNCTION = "main"
#: the bundle's roles -> this class's asset names
ASSETS = {"main": "model", "embedding": "embedding", "vision": "vision"}
#: the tokenizer and processor files a vision-language bundle carries in ``tokenizer/`` (the
#: processor's beside the tokenizer's, so ``AutoProcessor`` loads from that directory)
PROCESSOR_FILES = tuple(
    name
    for name in PREPROCESSING_FILES
    if name.endswith(("preprocessor_config.json", "processor_config.json"))
)


class ImageFeatures(nn.Module):
    """``pixel_values -> image_features`` (vision tower + projector), float16 (the app merges
    them into the token embeddings as float16)."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        features = self.model.model.get_image_features(pixel_values=pixel_values)
        if isinstance(features, (list, tuple)):
            features = torch.stack(list(features))
        return features.to(torch.float16)


class TokenEmbeddings(nn.Module):
    """``input_ids (int32) -> embeddings (float16)``."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.embeddings = model.get_input_embeddings()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embeddings(input_ids).to(torch.float16)


def export_vlm(
    model: PreTrainedModel,
    max_context: int,
    precision: Any = None,
    compress: Any = None,
    *,
    restore: bool = True,
) -> tuple[dict[str, Any], int]:
    """The three ``AIProgram`` of a LLaVA-style model by bundle role (``main``, ``embedding``,
    ``vision``; see the module documentation) and the number of tokens of each image.

    ``precision`` and ``compress`` apply to all three (the compression configuration says how
    the embedding table is stored, as for causal LMs)."""
    from coreai_torch.converter import TorchConverter
    from coreai_torch.frontend.export import export_decomposed
    from coreai_torch.llm.export import (
        check_max_context,
        compression_config,
        convert_causal_lm,
        precision_policy,
        traceable_attention,
    )

    policy = precision_policy(precision)
    compression = compression_config(compress)
    check_max_context(model, max_context)
    programs = {
        "main": convert_causal_lm(
            model, max_context, policy, compression, restore=restore, embeddings_input=True
        )
    }
    vision = model.config.vision_config
    pixels = torch.zeros(1, vision.num_channels, vision.image_size, vision.image_size)
    tokens = torch.export.Dim("tokens", min=1, max=max_context)
    # lazy.tracing(): a streamed model's weights are lazy, traced without recording
    with traceable_attention(model), torch.no_grad(), lazy.tracing():
        traced = {
            "vision": (
                export_decomposed(ImageFeatures(model).eval(), (pixels,)),
                "pixel_values",
                "image_features",
            ),
            "embedding": (
                export_decomposed(
                    TokenEmbeddings(model).eval(),
                    (torch.zeros(1, 2, dtype=torch.int32),),
                    dynamic_shapes=({1: tokens},),
                ),
                "input_ids",
                "embeddings",
            ),
        }
    for role, (ep, input_name, output_name) in traced.items():
        converter = TorchConverter(compute_precision=policy)
        converter.add_exported_program(
            ep,
            input_names=[input_name],
            output_names=[output_name],
            entrypoint_name=COMPONENT_FUNCTION,
        )
        program = converter.to_coreai()
        if compression is not None:
            program.compress(compression)
        programs[role] = program.optimize()
    output = next(n for n in traced["vision"][0].graph.nodes if n.op == "output")
    image_tokens = int(output.args[0][0].meta["val"].shape[1])
    return programs, image_tokens


def vision_block(
    config: Any, image_tokens: int, processor: Mapping[str, Any] | None = None
) -> VisionConfig:
    """The manifest's ``vision`` block of a LLaVA-style model (``docs/bundles.md`` says how
    each key is derived): the sizes and the image token from ``config``, the preprocessing
    from ``processor`` (the image processor's ``preprocessor_config.json``; None: the keys are
    left out and the app uses its defaults).  Raises :class:`BundleError` for a processor
    whose images the vision tower does not take."""
    vision = config.vision_config
    size = int(vision.image_size)
    options: dict[str, Any] = {}
    if processor is not None:
        options = _preprocessing(processor, size)
    return VisionConfig(
        image_size=size,
        patch_size=int(vision.patch_size),
        image_token_count=image_tokens,
        image_token_id=int(config.image_token_id),
        **options,
    )


def _preprocessing(processor: Mapping[str, Any], size: int) -> dict[str, Any]:
    """``image_mean``/``image_std``, ``rescale_factor`` and ``image_strategy`` of a Hugging
    Face image processor's settings."""
    resize = processor.get("size") or {}
    crop = processor.get("crop_size") or {}
    if processor.get("do_pad"):
        strategy, made = "pad", resize.get("height", resize.get("shortest_edge"))
    elif processor.get("do_center_crop") and "shortest_edge" in resize:
        strategy, made = "center_crop", crop.get("height", resize["shortest_edge"])
    else:
        strategy, made = "stretch", resize.get("height", resize.get("shortest_edge"))
    if made is not None and int(made) != size:
        raise BundleError(
            f"the image processor makes {made}x{made} images but the vision tower takes "
            f"{size}x{size} (vision_config.image_size); the app resizes to the latter, so the "
            "two must agree"
        )
    normalize = processor.get("do_normalize", True)
    mean = processor.get("image_mean") if normalize else [0.0, 0.0, 0.0]
    std = processor.get("image_std") if normalize else [1.0, 1.0, 1.0]
    # the app scales 8-bit pixels by rescale_factor / 255; Hugging Face by rescale_factor
    rescale = (
        float(processor.get("rescale_factor", 1 / 255))
        if processor.get("do_rescale", True)
        else 1.0
    )
    return {
        "image_mean": None if mean is None else tuple(float(v) for v in mean),
        "image_std": None if std is None else tuple(float(v) for v in std),
        "rescale_factor": round(rescale * 255, 9),
        "image_strategy": strategy,
    }


def _processor_settings(source: PreTrainedModel | Path, processor: Any) -> dict[str, Any] | None:
    """The image processor's settings: ``processor`` (an image processor, a processor holding
    one, or its settings), else the source directory's ``preprocessor_config.json``."""
    if processor is None:
        if isinstance(source, Path) and (source / "preprocessor_config.json").is_file():
            return dict(json.loads((source / "preprocessor_config.json").read_text()))
        return None
    if isinstance(processor, Mapping):
        return dict(processor)
    images = getattr(processor, "image_processor", processor)
    if not hasattr(images, "to_dict"):
        raise TypeError(
            "processor= takes a Hugging Face image processor (or a processor holding one) or "
            f"its settings as a dict, got {type(processor).__name__}"
        )
    return dict(images.to_dict())


class CoreAIModelForImageTextToText(CoreAIModelForCausalLM):
    """A LLaVA-style vision-language model exported to the three assets of a vision-language
    bundle and run on the Core AI runtime::

        model = CoreAIModelForImageTextToText.from_pretrained("llava_dir", export=True)
        model.save_pretrained("out/MyVLM")   # the bundle Apple's CoreAIVisionLanguageModel loads
        model = CoreAIModelForImageTextToText.from_pretrained("out/MyVLM")
        inputs = processor(images=image, text="USER: <image>\\nWhat is this? ASSISTANT:",
                           return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=32)
        pipeline("image-text-to-text", model=model, processor=processor)

    ``generate`` is ``transformers``' (greedy search, sampling, beam search); the image
    features are computed once per image at the prefill.
    """

    task = "image-text-to-text"
    bundle_kind = "vlm"

    @classmethod
    def _export_model(
        cls,
        source: PreTrainedModel | Path,
        *,
        max_context: int | None,
        precision: Any,
        compress: Any,
        processor: Any = None,
        calibration: Any = None,
        target_bpw: float | None = None,
    ) -> Self:
        """``processor``: the image processor whose preprocessing the bundle's ``vision``
        block declares (default: the model directory's ``preprocessor_config.json``)."""
        from coreai_torch.llm.export import default_max_context

        if calibration is not None or target_bpw is not None:
            raise ValueError(
                f"{cls.__name__} exports without calibration: calibration= and target_bpw= "
                "apply to text models (CoreAIModelForCausalLM)"
            )
        describe = describe_options(precision, compress)
        config = checked_config(source, IMAGE_TEXT_TO_TEXT_TYPES, cls.__name__)
        _check_decoder(config, str(source) if isinstance(source, Path) else type(source).__name__)
        settings = _processor_settings(source, processor)
        if isinstance(source, Path):
            from transformers import AutoModelForImageTextToText

            model = load_for_export(AutoModelForImageTextToText, config, source)
        else:
            model = source
        model = model.eval()
        if max_context is None:
            max_context = default_max_context(model.config)
        programs, image_tokens = export_vlm(
            model, max_context, precision, compress, restore=not isinstance(source, Path)
        )
        vision = vision_block(model.config, image_tokens, settings)
        vision.check(f"{cls.__name__} (the vision block)")
        meta = {
            "max_context": max_context,
            "vision": vision.to_json(),
            "num_channels": model.config.vision_config.num_channels,
            **describe,
        }
        return cls._from_programs(
            model, {ASSETS[role]: program for role, program in programs.items()}, meta, source
        )

    # -- bundles ------------------------------------------------------------------------------

    @classmethod
    def _bundle_assets(cls, bundle: Bundle) -> dict[str, Path]:
        return {name: bundle.asset_path(role) for role, name in ASSETS.items()}

    @classmethod
    def _bundle_meta(cls, bundle: Bundle) -> dict[str, Any]:
        return {"vision": bundle.manifest.vision_config().to_json(), "num_channels": 3}

    def _write_bundle(self, out: Path, files: dict[str, Path], **options: Any) -> None:
        from coreai_torch.bundles.writer import write_vlm_bundle

        source = self._source_dir
        if source is not None:  # the processor's files, beside the tokenizer's
            folder = source / "tokenizer" if (source / "metadata.json").is_file() else source
            for name in PROCESSOR_FILES:
                if (folder / name).is_file():
                    files[f"tokenizer/{name}"] = folder / name
        assets = {role: self.assets[name] for role, name in ASSETS.items()}
        write_vlm_bundle(out, assets, self._vision, **options, files=files)

    # -- running ------------------------------------------------------------------------------

    @functools.cached_property
    def _vision(self) -> VisionConfig:
        """The ``vision`` block (image size, image tokens, the image token's id)."""
        return VisionConfig.from_json(self.coreai_config["vision"], "coreai_config.json")

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The projected features of each image, ``[images, image_tokens, hidden]``."""
        size = self._vision.image_size
        channels = self.coreai_config.get("num_channels", 3)
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
        function = self._components["vision"]
        rows = [
            self._run(
                "vision",
                function.name,
                {function.inputs[0].name: np.ascontiguousarray(row[None].float().numpy())},
            )[function.outputs[0].name]
            for row in pixel_values
        ]
        return torch.from_numpy(np.concatenate(rows).astype(np.float32))

    @functools.cached_property
    def _components(self) -> dict[str, Any]:
        """The function the app runs of the ``embedding`` asset (``embed_tokens``, else
        ``main``) and of the ``vision`` asset (a fused ``main``)."""
        from coreai_torch.bundles import function_signatures

        embedding = function_signatures(self.assets["embedding"])
        vision = function_signatures(self.assets["vision"])
        if "encode_image" in vision:
            raise ValueError(
                "the vision asset has separate encode_image / project functions; "
                f"{type(self).__name__} runs a fused '{COMPONENT_FUNCTION}' (run the bundle "
                "with coreai_torch.bundles.VisionLanguageEngine)"
            )
        return {
            "embedding": embedding.get("embed_tokens") or embedding[COMPONENT_FUNCTION],
            "vision": vision[COMPONENT_FUNCTION],
        }

    def _embed(self, ids: Any) -> np.ndarray:
        """The embeddings ``[T, hidden]`` (float16) of token ids ``[T]``."""
        function = self._components["embedding"]
        feed = np.ascontiguousarray(np.asarray(ids), np.int32).reshape(1, -1)
        out = self._run("embedding", function.name, {function.inputs[0].name: feed})
        embeddings: np.ndarray = out[function.outputs[0].name][0]
        return embeddings

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
        image_token = self._vision.image_token_id
        counts = [int((ids == image_token).sum()) for _, ids in rows]
        features = np.empty((0, 0), np.float32)  # the images' features, if the prompt has any
        if sum(counts):
            if pixel_values is None:
                raise ValueError(
                    f"input_ids hold {sum(counts)} image tokens but no pixel_values were given"
                )
            if any(cache.lengths[r] > 0 for r, n in enumerate(counts) if n):
                raise ValueError("image tokens must be in the prompt (the first call)")
            per_image = self._vision.image_token_count
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
            features = self.image_features(pixel_values).numpy()
            features = features.reshape(-1, features.shape[-1])
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
            embeds = self._embed(ids)
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
        """One call of ``main`` with the embeddings ``[n, hidden]`` (token ids ``[n]`` are
        embedded first)."""
        values = np.asarray(values)
        if values.ndim == 1:
            values = self._embed(values)
        return self._call_main(values.astype(np.float16).reshape(1, n, -1), start, states)


def _check_decoder(config: Any, what: str) -> None:
    from coreai_torch.errors import UnsupportedModelError

    text = config.get_text_config()
    if getattr(text, "model_type", None) not in IMAGE_TEXT_DECODER_TYPES:
        raise UnsupportedModelError(
            f"{what}: a '{config.model_type}' model with a '{text.model_type}' text decoder is "
            f"not supported (text decoders: {', '.join(IMAGE_TEXT_DECODER_TYPES)})"
        )
