"""The Python reference driver of the app's vision-language engine.

:class:`VisionLanguageEngine` runs a ``vlm`` bundle on the Core AI runtime as
``CoreAISequentialVLMEngine`` (``CoreAILanguageModels``) does, written from its contract
(``COREAI_BUNDLES.md`` §8):

* the image is preprocessed per the manifest's ``vision`` block (:func:`preprocess_image`:
  the resize strategy to ``image_size``, ``pixel * rescale_factor / 255``, then
  ``(x - mean) / std``, channels first, float32 ``[1, 3, S, S]``);
* the ``vision`` asset (``encode_image`` then ``project``, or a fused ``main``) makes the
  projected features ``[1, image_token_count, hidden]``;
* the prompt (every placeholder token already there: exactly ``image_token_count`` of
  ``image_token_id``, as the app's prompt builder expands them) is embedded by the
  ``embedding`` asset (``embed_tokens`` or ``main``), the placeholders' rows replaced by the
  features in order, and the whole prompt prefilled in one call of the decoder (the engine does
  not chunk a prompt with an image); a prompt without an image is prefilled in the chunks of
  the sequential engine;
* then one call per generated token (the token embedded first), the two KV states carried and
  grown as the sequential engine grows them
  (:class:`~coreai_torch.bundles.driver.SequentialEngine`);
  the states are zeroed before every request, as the app's executor resets the engine.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from coreai_torch.bundles.driver import LogitsCallback, SequentialEngine
from coreai_torch.bundles.manifest import VisionConfig
from coreai_torch.bundles.reader import Bundle
from coreai_torch.errors import BundleError
from coreai_torch.runtime import Session

#: the app's defaults for the keys a ``vision`` block leaves out (``VisionConfig.swift``)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def preprocess_image(image: Any, vision: VisionConfig) -> np.ndarray:
    """The pixels the app feeds the vision asset for ``image`` (a PIL image or an 8-bit RGB
    array ``[H, W, 3]``): float32 ``[1, 3, S, S]`` (``ImagePreprocessor.preprocessCHW``).

    ``stretch`` resizes to ``S x S``; ``center_crop`` resizes the shortest edge to ``S`` and
    crops the centre; ``pad`` resizes the longest edge to ``S`` and centres the image on a
    black square.  Resizing is bicubic (the app draws with Core Graphics' high-quality
    interpolation, which is close to but not the same as PIL's bicubic)."""
    from PIL import Image

    picture = image if isinstance(image, Image.Image) else Image.fromarray(np.asarray(image))
    picture = picture.convert("RGB")
    size = vision.image_size
    width, height = picture.size
    strategy = vision.image_strategy or "stretch"
    if strategy == "stretch":
        picture = picture.resize((size, size), Image.Resampling.BICUBIC)
    else:
        edge = min(width, height) if strategy == "center_crop" else max(width, height)
        scale = size / edge
        resized = (max(1, round(width * scale)), max(1, round(height * scale)))
        picture = picture.resize(resized, Image.Resampling.BICUBIC)
        if strategy == "center_crop":
            left, top = (resized[0] - size) // 2, (resized[1] - size) // 2
            picture = picture.crop((left, top, left + size, top + size))
        else:
            canvas = Image.new("RGB", (size, size))
            canvas.paste(picture, ((size - resized[0]) // 2, (size - resized[1]) // 2))
            picture = canvas
    pixels = np.asarray(picture, np.float32) * np.float32((vision.rescale_factor or 1.0) / 255.0)
    mean = np.asarray(vision.image_mean or CLIP_MEAN, np.float32)
    std = np.asarray(vision.image_std or CLIP_STD, np.float32)
    normalized = (pixels - mean) / std
    return np.ascontiguousarray(normalized.transpose(2, 0, 1)[None], np.float32)


class VisionLanguageEngine(SequentialEngine):
    """``CoreAISequentialVLMEngine`` (see the module docstring); ``generate`` returns the
    generated ids (ending with the stop token when one was produced)."""

    kinds = ("vlm",)
    embeddings_input = True

    def __init__(self, bundle: Bundle | str | os.PathLike[str], **options: Any) -> None:
        super().__init__(bundle, **options)
        self.components: list[Session] = []
        try:
            self.vision = self.bundle.manifest.vision_config()
            vision = self.bundle.required_signatures("vision")
            names = ["encode_image", "project"] if "encode_image" in vision else ["main"]
            self.vision_functions = [vision[name] for name in names]
            embedding = self.bundle.required_signatures("embedding")
            self.embed_function = embedding.get("embed_tokens") or embedding["main"]
            self.vision_session = self._open("vision")
            self.embed_session = self._open("embedding")
        except BaseException:
            self.close()
            raise

    def _open(self, role: str) -> Session:
        session = Session(self.bundle.asset_path(role), verify_hash=False)
        session.open()
        self.components.append(session)
        return session

    def close(self) -> None:
        for session in getattr(self, "components", []):
            session.close()
        super().close()

    # -- the components --------------------------------------------------------------------

    def encode_image(self, image: Any = None, *, pixel_values: Any = None) -> np.ndarray:
        """The projected features ``[1, image_token_count, hidden]`` of ``image`` (preprocessed
        by :func:`preprocess_image`) or of ``pixel_values`` ``[1, 3, S, S]`` made elsewhere."""
        if pixel_values is None:
            pixel_values = preprocess_image(image, self.vision)
        size = self.vision.image_size
        pixels = np.ascontiguousarray(np.asarray(pixel_values, np.float32))
        if pixels.shape != (1, 3, size, size):
            raise BundleError(
                f"pixel_values must be [1, 3, {size}, {size}] (vision.image_size), got "
                f"{list(pixels.shape)}"
            )
        value = pixels
        for function in self.vision_functions:  # encode_image then project, or main
            out = self.vision_session.run(
                {function.inputs[0].name: value}, entrypoint=function.name
            )
            value = out[function.outputs[0].name]
        features: np.ndarray = value
        return features

    def embed(self, tokens: Sequence[int]) -> np.ndarray:
        """The embeddings ``[1, T, hidden]`` of ``tokens`` (the ``embedding`` asset)."""
        function = self.embed_function
        ids = np.asarray([list(tokens)], np.int32)
        out = self.embed_session.run({function.inputs[0].name: ids}, entrypoint=function.name)
        embeddings: np.ndarray = out[function.outputs[0].name]
        return embeddings

    def _batch(self, tokens: Sequence[int]) -> np.ndarray:
        return self._call(self.embed(tokens))

    def prompt_tokens(self, text: str) -> list[int]:
        """The prompt the app builds for ``text`` and one image (``buildPromptTokens``): the
        bundle's chat template applied to one user message ``"<image token>\\n<text>"``, the
        first image token expanded into ``image_token_count`` placeholders (others dropped)."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.bundle.tokenizer_dir)
        image = self.vision.image_token_id
        message = [{"role": "user", "content": f"{tokenizer.convert_ids_to_tokens(image)}\n{text}"}]
        ids = tokenizer.apply_chat_template(message, add_generation_prompt=True, tokenize=True)
        out: list[int] = []
        for token in ids:
            if token != image:
                out.append(int(token))
            elif image not in out:
                out.extend([image] * self.vision.image_token_count)
        if image not in out:
            raise BundleError(
                f"the chat template of {self.bundle.tokenizer_dir} does not render the image "
                "token of a plain-string message; the app would ignore the image"
            )
        return out

    # -- generation ------------------------------------------------------------------------

    def merge(self, tokens: Sequence[int], features: np.ndarray) -> np.ndarray:
        """``scatterMerge``: the prompt's embeddings with the rows of its image placeholder
        tokens replaced by ``features``, in order; their number must be the features'."""
        positions = [i for i, t in enumerate(tokens) if t == self.vision.image_token_id]
        embeddings = self.embed(tokens).copy()
        if not positions:
            return embeddings
        if len(positions) != features.shape[1]:
            raise BundleError(
                f"the prompt holds {len(positions)} image placeholder tokens (id "
                f"{self.vision.image_token_id}) but the image has {features.shape[1]} features; "
                "expand the image token to vision.image_token_count placeholders"
            )
        embeddings[0, positions] = features[0].astype(embeddings.dtype)
        return embeddings

    def generate(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        image: Any = None,
        pixel_values: Any = None,
        on_logits: LogitsCallback | None = None,
    ) -> list[int]:
        """Greedy generation from ``prompt`` (token ids, the image's placeholders expanded)
        with ``image`` (or its ``pixel_values``); without either, the text-only path."""
        self.reset(0)  # the app's executor resets the engine before each request
        tokens = [int(t) for t in prompt]
        if image is None and pixel_values is None:
            return super().generate(tokens, max_new_tokens, on_logits=on_logits)
        merged = self.merge(tokens, self.encode_image(image, pixel_values=pixel_values))

        def run(current: list[int]) -> np.ndarray:
            if self.processed == 0:  # the prompt, whole, with the image features
                last: np.ndarray = self._call(merged)[-1]
                return last
            return self._prefill(current[self.processed :])

        return self._decode(tokens, max_new_tokens, on_logits, run)
