"""``metadata.json`` (schema 0.2): typed, checked with the rules of the Swift decoders that read it.

A bundle's manifest names its kind, its assets and, per kind, the block the app runtime reads:
``language`` (kinds ``llm`` and ``vlm``, ``LanguageConfig.swift``), ``vision`` (kind ``vlm``),
``diffusion`` (kind ``diffusion``, ``PipelineDescriptor.swift``).  Swift decodes it with
``JSONDecoder``: a wrong JSON type fails the whole load, unknown keys are ignored, ``null`` for
an optional key means absent and for a required key fails; an ``Int`` is not read from
``512.0`` nor from ``true``.  :meth:`Manifest.from_json` applies exactly these rules and names
the key that breaks one; :meth:`Manifest.to_json` writes what they accept.  Keys the Swift side
does not read (``source``, ``compression``, ``compilation``, and keys unknown here) are kept as
they are, so a manifest read and written again loses nothing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, TypeVar, overload

from coreai_torch.errors import BundleError

METADATA_VERSION = "0.2"
#: ``BundleKind.swift``
BUNDLE_KINDS = ("llm", "vlm", "diffusion", "segmenter", "speech_recognizer")
#: the kinds ``LanguageBundle`` loads
LANGUAGE_KINDS = ("llm", "vlm")
#: ``StateKind`` (``StateHandlerFactory.swift``)
STATE_KINDS = ("kv_cache", "sliding_cache", "fixed")
#: ``VisionConfig.ImageStrategy``
IMAGE_STRATEGIES = ("stretch", "center_crop", "pad")
#: ``PipelineDescriptor.PipelineType``
DIFFUSION_TYPES = ("stable-diffusion", "stable-diffusion-xl", "stable-diffusion-3", "flux2")
#: ``PredictionType`` (``PNDMScheduler.swift``)
PREDICTION_TYPES = ("epsilon", "v_prediction", "flow", "flow_matching")
#: asset roles ``PipelineDescriptor.loadFromMetadata`` maps to components
DIFFUSION_ROLES = (
    "text_encoder",
    "text_encoder_2",
    "transformer",
    "unet",
    "vae_decoder",
    "vae_encoder",
)

_INT32 = (-(2**31), 2**31 - 1)
_INT64 = (-(2**63), 2**63 - 1)

T = TypeVar("T")


# ----------------------------------------------------------------------- JSON type rules ---


class _Reader:
    """Reads one JSON object with Swift ``JSONDecoder`` rules; errors name the key path."""

    def __init__(self, data: Any, where: str, path: str) -> None:
        if not isinstance(data, dict):
            raise BundleError(
                f"{where}: {path or 'the manifest'} must be a JSON object, got {_shown(data)}"
            )
        self.data, self.where, self.path = data, where, path

    def _key(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def fail(self, key: str, what: str) -> BundleError:
        return BundleError(f"{self.where}: {self._key(key)} {what}")

    @overload
    def get(self, key: str, check: Callable[[Any, str], T], *, required: Literal[True]) -> T: ...
    @overload
    def get(
        self, key: str, check: Callable[[Any, str], T], *, required: Literal[False]
    ) -> T | None: ...
    def get(self, key: str, check: Callable[[Any, str], T], *, required: bool) -> T | None:
        value = self.data.get(key)
        if value is None:
            if required:
                state = "is null" if key in self.data else "is missing"
                raise self.fail(key, f"{state}; the app runtime requires it")
            return None
        return check(value, self._key(key))

    @overload
    def obj(self, key: str, *, required: Literal[True]) -> _Reader: ...
    @overload
    def obj(self, key: str, *, required: Literal[False]) -> _Reader | None: ...
    def obj(self, key: str, *, required: bool) -> _Reader | None:
        value = self.data.get(key)
        if value is None:
            if required:
                raise self.fail(key, "is missing; the app runtime requires it")
            return None
        return _Reader(value, self.where, self._key(key))

    def string(self, value: Any, key: str) -> str:
        if not isinstance(value, str):
            raise BundleError(f"{self.where}: {key} must be a string, got {_shown(value)}")
        return value

    def boolean(self, value: Any, key: str) -> bool:
        if not isinstance(value, bool):
            raise BundleError(f"{self.where}: {key} must be true or false, got {_shown(value)}")
        return value

    def integer(self, value: Any, key: str, bounds: tuple[int, int] = _INT64) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            hint = (
                f" (write {int(value)}, not {value!r}: Swift reads an Int only from an integer)"
                if isinstance(value, float) and value.is_integer()
                else ""
            )
            raise BundleError(f"{self.where}: {key} must be an integer, got {_shown(value)}{hint}")
        if not bounds[0] <= value <= bounds[1]:
            raise BundleError(f"{self.where}: {key} = {value} is out of range {bounds}")
        return value

    def number(self, value: Any, key: str) -> float:
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            raise BundleError(f"{self.where}: {key} must be a finite number, got {_shown(value)}")
        return value

    def choice(self, options: tuple[str, ...]) -> Callable[[Any, str], str]:
        def check(value: Any, key: str) -> str:
            if value not in options:
                raise BundleError(
                    f"{self.where}: {key} must be one of {list(options)}, got {_shown(value)}"
                )
            chosen: str = value
            return chosen

        return check

    def list_of(self, check: Callable[[Any, str], T]) -> Callable[[Any, str], list[T]]:
        def read(value: Any, key: str) -> list[T]:
            if not isinstance(value, list):
                raise BundleError(f"{self.where}: {key} must be a JSON array, got {_shown(value)}")
            return [check(item, f"{key}[{i}]") for i, item in enumerate(value)]

        return read

    def map_of(self, check: Callable[[Any, str], T]) -> Callable[[Any, str], dict[str, T]]:
        def read(value: Any, key: str) -> dict[str, T]:
            if not isinstance(value, dict):
                raise BundleError(f"{self.where}: {key} must be a JSON object, got {_shown(value)}")
            return {k: check(v, f"{key}.{k}") for k, v in value.items()}

        return read

    def extra(self, known: tuple[str, ...]) -> dict[str, Any]:
        return {k: v for k, v in self.data.items() if k not in known}


def _shown(value: Any) -> str:
    kind = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}.get(
        type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__
    )
    text = json.dumps(value)
    return f"{kind} {text if len(text) <= 60 else text[:57] + '...'}"


def _drop_none(data: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if v is not None}


def _json_value(value: Any) -> Any:
    """A field's JSON value: blocks by their ``to_json``, tuples as arrays, recursively."""
    if hasattr(value, "to_json"):
        return value.to_json()
    if isinstance(value, (tuple, list)):
        return [_json_value(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _json_value(v) for k, v in value.items()}
    return value


def _block_json(block: Any) -> dict[str, Any]:
    """A block's JSON object: its fields (``None`` omitted) over the unknown keys it was read
    with (``extra``)."""
    data = {f.name: _json_value(getattr(block, f.name)) for f in fields(block) if f.name != "extra"}
    return {**dict(getattr(block, "extra", {})), **_drop_none(data)}


# ------------------------------------------------------------------------------ blocks ---


@dataclass(frozen=True)
class VisionConfig:
    """The ``vision`` block of a ``vlm`` bundle (``VisionConfig``, ``LanguageConfig.swift``).

    Fields left ``None`` are omitted, and the app takes its defaults (CLIP mean and std,
    rescale 1.0, ``stretch``, no image info, no video)."""

    image_size: int
    patch_size: int
    image_token_count: int
    image_token_id: int
    image_mean: tuple[float, ...] | None = None
    image_std: tuple[float, ...] | None = None
    rescale_factor: float | None = None
    image_strategy: str | None = None
    include_image_info: bool | None = None
    max_video_frames: int | None = None
    tokens_per_frame: int | None = None
    #: keys the Swift decoder does not read, kept as they are (e.g. ``temporal_patch_size``)
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def _read(cls, r: _Reader) -> VisionConfig:
        floats = r.list_of(r.number)
        return cls(
            image_size=r.get("image_size", r.integer, required=True),
            patch_size=r.get("patch_size", r.integer, required=True),
            image_token_count=r.get("image_token_count", r.integer, required=True),
            image_token_id=r.get(
                "image_token_id", lambda v, k: r.integer(v, k, _INT32), required=True
            ),
            image_mean=_tuple(r.get("image_mean", floats, required=False)),
            image_std=_tuple(r.get("image_std", floats, required=False)),
            rescale_factor=r.get("rescale_factor", r.number, required=False),
            image_strategy=r.get("image_strategy", r.choice(IMAGE_STRATEGIES), required=False),
            include_image_info=r.get("include_image_info", r.boolean, required=False),
            max_video_frames=r.get("max_video_frames", r.integer, required=False),
            tokens_per_frame=r.get("tokens_per_frame", r.integer, required=False),
            extra=r.extra(tuple(f.name for f in fields(cls))),
        )

    def to_json(self) -> dict[str, Any]:
        return _block_json(self)

    @classmethod
    def from_json(cls, data: Any, where: str = "metadata.json") -> VisionConfig:
        """Parse a ``vision`` block with the Swift decoder's rules."""
        return cls._read(_Reader(data, where, "vision"))

    def check(self, where: str, language: LanguageConfig | None = None) -> None:
        """Raise :class:`~coreai_torch.errors.BundleError` for values the VLM engine would
        misuse: sizes that are not positive, an ``image_token_id`` outside the vocabulary,
        mean/std that are not three channels (or a zero std)."""
        for key in ("image_size", "patch_size", "image_token_count"):
            if getattr(self, key) <= 0:
                raise BundleError(
                    f"{where}: vision.{key} must be positive, got {getattr(self, key)}"
                )
        vocab = None if language is None else language.vocab_size
        if self.image_token_id < 0 or (vocab is not None and self.image_token_id >= vocab):
            raise BundleError(
                f"{where}: vision.image_token_id = {self.image_token_id} is not a token id of "
                f"the vocabulary (language.vocab_size {vocab}); it must be the id of the image "
                "placeholder token the prompt holds"
            )
        for key in ("image_mean", "image_std"):
            values = getattr(self, key)
            if values is not None and len(values) != 3:
                raise BundleError(
                    f"{where}: vision.{key} must have 3 values (R, G, B), got {list(values)}"
                )
        if self.image_std is not None and 0 in self.image_std:
            raise BundleError(f"{where}: vision.image_std must not hold 0")


def _tuple(values: list[float] | None) -> tuple[float, ...] | None:
    return None if values is None else tuple(values)


@dataclass(frozen=True)
class LanguageConfig:
    """The ``language`` block of an ``llm``/``vlm`` bundle (``LanguageConfig.swift``).

    ``tokenizer`` is the Hugging Face id the app downloads the tokenizer from when the bundle
    has no embedded one; ``vocab_size`` must equal the logits' last dimension;
    ``max_context_length`` caps the KV cache.  ``function_map`` (only its ``main`` role is read:
    the function the engines load) is optional for Swift and written by default because
    ``coreai doctor`` requires it.  ``states`` is decoded but not passed to any engine of the
    snapshot; ``prefill_chunk_size``/``prefill_chunk_threshold``/``overrides`` are read only by
    runtimes newer than it (write them only where a bundle needs them)."""

    tokenizer: str
    vocab_size: int
    max_context_length: int
    embedded_tokenizer: bool = True
    function_map: Mapping[str, tuple[str, ...]] | None = field(
        default_factory=lambda: {"main": ("main",)}
    )
    states: Mapping[str, str] | None = None
    vision: VisionConfig | None = None
    prefill_chunk_size: int | None = None
    prefill_chunk_threshold: int | None = None
    overrides: Mapping[str, Any] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def main_function(self) -> str:
        """The function the engines load: ``function_map.main[0]``, else ``main``."""
        names = (self.function_map or {}).get("main") or ()
        return names[0] if names else "main"

    @classmethod
    def _read(cls, r: _Reader) -> LanguageConfig:
        positive = _positive(r)
        function_map = r.get("function_map", r.map_of(r.list_of(r.string)), required=False)
        vision = r.obj("vision", required=False)
        overrides = r.get("overrides", _object(r), required=False)
        return cls(
            tokenizer=r.get("tokenizer", r.string, required=True),
            vocab_size=r.get("vocab_size", positive, required=True),
            max_context_length=r.get("max_context_length", positive, required=True),
            embedded_tokenizer=_default(
                r.get("embedded_tokenizer", r.boolean, required=False), True
            ),
            function_map=None
            if function_map is None
            else {k: tuple(v) for k, v in function_map.items()},
            states=r.get("states", r.map_of(r.choice(STATE_KINDS)), required=False),
            vision=None if vision is None else VisionConfig._read(vision),
            prefill_chunk_size=r.get("prefill_chunk_size", positive, required=False),
            prefill_chunk_threshold=r.get("prefill_chunk_threshold", positive, required=False),
            overrides=overrides,
            extra=r.extra(tuple(f.name for f in fields(cls))),
        )

    def to_json(self) -> dict[str, Any]:
        return _block_json(self)


def _positive(r: _Reader) -> Callable[[Any, str], int]:
    def check(value: Any, key: str) -> int:
        number = r.integer(value, key)
        if number <= 0:
            raise BundleError(f"{r.where}: {key} must be positive, got {number}")
        return number

    return check


def _object(r: _Reader) -> Callable[[Any, str], dict[str, Any]]:
    def check(value: Any, key: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise BundleError(f"{r.where}: {key} must be a JSON object, got {_shown(value)}")
        return value

    return check


def _default(value: T | None, default: T) -> T:
    return default if value is None else value


@dataclass(frozen=True)
class SchedulerDefaults:
    """``diffusion.scheduler`` (``PipelineDescriptor.SchedulerDefaults``: the four keys are
    required)."""

    training_steps: int = 1000
    beta_start: float = 0.00085
    beta_end: float = 0.012
    beta_schedule: str = "scaled_linear"

    @classmethod
    def _read(cls, r: _Reader) -> SchedulerDefaults:
        return cls(
            training_steps=r.get("training_steps", r.integer, required=True),
            beta_start=r.get("beta_start", r.number, required=True),
            beta_end=r.get("beta_end", r.number, required=True),
            beta_schedule=r.get("beta_schedule", r.string, required=True),
        )

    def to_json(self) -> dict[str, Any]:
        return _block_json(self)


@dataclass(frozen=True)
class DiffusionConfig:
    """The ``diffusion`` block (``PipelineDescriptor``, decoded with ``convertFromSnakeCase``;
    every key optional: the pipeline infers or defaults what is absent)."""

    type: str | None = None
    version: str | None = None
    prediction_type: str | None = None
    image_size: int | None = None
    scheduler: SchedulerDefaults | None = None
    encoder_scale_factor: float | None = None
    decoder_scale_factor: float | None = None
    decoder_shift_factor: float | None = None
    batch_norm_eps: float | None = None
    guidance_embeds: bool | None = None
    rope_axes_dims: tuple[int, ...] | None = None
    rope_theta: float | None = None
    default_guidance_scale: float | None = None
    default_steps: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def _read(cls, r: _Reader) -> DiffusionConfig:
        scheduler = r.obj("scheduler", required=False)
        axes = r.get("rope_axes_dims", r.list_of(r.integer), required=False)
        return cls(
            type=r.get("type", r.choice(DIFFUSION_TYPES), required=False),
            version=r.get("version", r.string, required=False),
            prediction_type=r.get("prediction_type", r.choice(PREDICTION_TYPES), required=False),
            image_size=r.get("image_size", _positive(r), required=False),
            scheduler=None if scheduler is None else SchedulerDefaults._read(scheduler),
            encoder_scale_factor=r.get("encoder_scale_factor", r.number, required=False),
            decoder_scale_factor=r.get("decoder_scale_factor", r.number, required=False),
            decoder_shift_factor=r.get("decoder_shift_factor", r.number, required=False),
            batch_norm_eps=r.get("batch_norm_eps", r.number, required=False),
            guidance_embeds=r.get("guidance_embeds", r.boolean, required=False),
            rope_axes_dims=None if axes is None else tuple(axes),
            rope_theta=r.get("rope_theta", r.number, required=False),
            default_guidance_scale=r.get("default_guidance_scale", r.number, required=False),
            default_steps=r.get("default_steps", r.integer, required=False),
            extra=r.extra(tuple(f.name for f in fields(cls))),
        )

    def to_json(self) -> dict[str, Any]:
        return _block_json(self)


# ---------------------------------------------------------------------------- manifest ---


@dataclass(frozen=True)
class Manifest:
    """A bundle's ``metadata.json``.

    ``assets`` maps a role (``main``, ``vision``, ``embedding``; diffusion: ``text_encoder``,
    ``unet``, ...) to the asset's path relative to the bundle directory.  ``source``,
    ``compression`` and ``compilation`` are not read by Swift (the exporter records where the
    model came from and how it was made); ``user_data`` must map strings to strings."""

    kind: str
    name: str
    assets: Mapping[str, str] = field(default_factory=dict)
    language: LanguageConfig | None = None
    vision: VisionConfig | None = None
    diffusion: DiffusionConfig | None = None
    user_data: Mapping[str, str] | None = None
    source: Mapping[str, Any] | None = None
    compression: Any = None
    compilation: Mapping[str, Any] | None = None
    metadata_version: str = METADATA_VERSION
    extra: Mapping[str, Any] = field(default_factory=dict)

    def language_config(self) -> LanguageConfig:
        """The ``language`` section (``llm`` / ``vlm`` bundles, whose validation requires it)."""
        return _section(self.language, "language", self.kind)

    def vision_config(self) -> VisionConfig:
        """The ``vision`` section (``vlm`` bundles)."""
        return _section(self.vision, "vision", self.kind)

    def diffusion_config(self) -> DiffusionConfig:
        """The ``diffusion`` section (``diffusion`` bundles)."""
        return _section(self.diffusion, "diffusion", self.kind)

    # -- reading ---------------------------------------------------------------------------

    @classmethod
    def from_json(cls, data: Any, where: str = "metadata.json") -> Manifest:
        """Parse a manifest with the Swift decoders' rules and :meth:`validate` it; raises
        :class:`~coreai_torch.errors.BundleError` naming ``where`` and the key."""
        r = _Reader(data, where, "")
        version = r.get("metadata_version", r.string, required=False)
        if version != METADATA_VERSION:
            shown = "absent (read as '0.1')" if version is None else repr(version)
            raise BundleError(
                f"{where}: metadata_version is {shown}; the app runtime loads only "
                f"'{METADATA_VERSION}' (unsupportedVersion): write \"metadata_version\": "
                f'"{METADATA_VERSION}"'
            )
        kind = r.get("kind", r.choice(BUNDLE_KINDS), required=True)
        assets = r.get("assets", r.map_of(r.string), required=False)
        language = r.obj("language", required=False)
        vision = r.obj("vision", required=False)
        diffusion = r.obj("diffusion", required=False)
        manifest = cls(
            kind=kind,
            name=r.get("name", r.string, required=True),
            assets=assets or {},
            language=None if language is None else LanguageConfig._read(language),
            vision=None if vision is None else VisionConfig._read(vision),
            diffusion=None if diffusion is None else DiffusionConfig._read(diffusion),
            user_data=r.get("user_data", r.map_of(r.string), required=False),
            source=data.get("source"),
            compression=data.get("compression"),
            compilation=data.get("compilation"),
            extra=r.extra(tuple(f.name for f in fields(cls))),
        )
        if kind in LANGUAGE_KINDS and "assets" not in data:
            raise BundleError(f"{where}: assets is missing; the app runtime requires it")
        manifest.validate(where)
        return manifest

    @classmethod
    def read(cls, path: str | Path) -> Manifest:
        """Read and parse a ``metadata.json`` file."""
        path = Path(path)
        try:
            data = json.loads(path.read_bytes())
        except FileNotFoundError:
            raise
        except (ValueError, UnicodeDecodeError) as error:
            raise BundleError(
                f"{path} is not valid JSON ({error}); the app runtime reports malformedMetadata"
            ) from error
        return cls.from_json(data, str(path))

    # -- checking --------------------------------------------------------------------------

    def validate(self, where: str = "metadata.json") -> None:
        """Raise :class:`~coreai_torch.errors.BundleError` unless the app runtime for
        :attr:`kind` would accept this manifest (required blocks and roles, value ranges);
        the same rules as :meth:`from_json`, for a manifest built in code."""
        Manifest.from_json_types(self.to_json(), where)
        if self.kind in LANGUAGE_KINDS:
            if "main" not in self.assets:
                raise BundleError(
                    f"{where}: assets.main is missing; a {self.kind} bundle names its decoder "
                    'asset there (e.g. "assets": {"main": "model.aimodel"})'
                )
            if self.language is None:
                raise BundleError(f"{where}: language is missing; a {self.kind} bundle needs it")
            size = self.language.prefill_chunk_size
            threshold = self.language.prefill_chunk_threshold
            if size and threshold and size > threshold:
                raise BundleError(
                    f"{where}: language.prefill_chunk_size ({size}) exceeds "
                    f"language.prefill_chunk_threshold ({threshold})"
                )
        if self.kind == "vlm":
            if self.vision is None:
                raise BundleError(
                    f"{where}: vision is missing; a vlm bundle needs the top-level vision block"
                )
            for role in ("vision", "embedding"):
                if role not in self.assets:
                    raise BundleError(
                        f"{where}: assets.{role} is missing; a vlm bundle needs the assets main, "
                        "vision and embedding"
                    )
            self.vision.check(where, self.language)
        if self.kind == "diffusion":
            if self.diffusion is None:
                raise BundleError(
                    f"{where}: diffusion is missing; CoreAIDiffusionPipeline reads a diffusion "
                    "bundle's settings from it ('metadata.json has no diffusion block')"
                )
            if not self.assets:
                raise BundleError(f"{where}: assets is missing or empty for a diffusion bundle")
        for role, relative in self.assets.items():
            if not relative or Path(relative).is_absolute() or ".." in Path(relative).parts:
                raise BundleError(
                    f"{where}: assets.{role} = {relative!r} must be a path inside the bundle "
                    "(relative, without '..')"
                )

    @staticmethod
    def from_json_types(data: dict[str, Any], where: str) -> None:
        """Check ``data``'s JSON types (what Swift would fail to decode) without validating."""
        r = _Reader(data, where, "")
        r.get("kind", r.choice(BUNDLE_KINDS), required=True)
        r.get("name", r.string, required=True)
        r.get("assets", r.map_of(r.string), required=False)
        r.get("user_data", r.map_of(r.string), required=False)
        for key, reader in (
            ("language", LanguageConfig._read),
            ("vision", VisionConfig._read),
            ("diffusion", DiffusionConfig._read),
        ):
            block = r.obj(key, required=False)
            if block is not None:
                reader(block)
        try:
            json.dumps(data, allow_nan=False)
        except (TypeError, ValueError) as error:
            raise BundleError(f"{where}: the manifest is not plain JSON ({error})") from error

    # -- writing ---------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """The JSON object written as ``metadata.json`` (``None`` fields omitted)."""
        return {"metadata_version": self.metadata_version, **_block_json(self)}

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, ensure_ascii=False) + "\n"


_S = TypeVar("_S")


def _section(section: _S | None, name: str, kind: str) -> _S:
    if section is None:
        raise BundleError(f'metadata.json: a {kind} bundle needs a "{name}" section')
    return section
