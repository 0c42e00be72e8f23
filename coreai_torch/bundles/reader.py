"""Reading a bundle as Apple's app runtimes do: :meth:`Bundle.load`.

The rules are those of ``ModelBundle``/``LanguageBundle`` (``CoreAIShared``,
``CoreAILanguageModels``) and ``PipelineDescriptor`` (``CoreAIDiffusionPipeline``): the path is
a directory (not the ``.aimodel`` itself) holding ``metadata.json`` (schema 0.2, see
:mod:`coreai_torch.bundles.manifest`); every asset the manifest names exists, as written or
compiled (``name.aimodel`` -> ``name.aimodelc``); a language bundle's embedded tokenizer loads
in swift-transformers.  Then each asset's functions are checked against the engine that would
run them (:mod:`coreai_torch.bundles.convention`).  Bundles written by Apple's own exporter
load as far as their layout allows; what cannot be read here (a compiled ``.aimodelc``) is
listed in ``Bundle.unchecked`` instead of being checked.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from coreai_torch.bundles.asset_metadata import AssetMetadata, read_asset_metadata
from coreai_torch.bundles.convention import (
    check_diffusion_asset,
    check_diffusion_roles,
    check_language_asset,
    check_vlm_assets,
    detect_structure,
)
from coreai_torch.bundles.manifest import (
    LANGUAGE_KINDS,
    DiffusionConfig,
    LanguageConfig,
    Manifest,
    VisionConfig,
)
from coreai_torch.bundles.signatures import FunctionSignature, Signatures, function_signatures
from coreai_torch.bundles.tokenizer import TokenizerInfo, read_tokenizer, render_chat
from coreai_torch.errors import BundleError, BundleNotFoundError
from coreai_torch.ir.assets import check_asset

MANIFEST_FILE = "metadata.json"
TOKENIZER_DIR = "tokenizer"
ASSET_SUFFIXES = (".aimodel", ".aimodelc")
#: FLUX.2 finds these components by file name (``Flux2Pipeline+Resources.swift``)
FLUX2_FILES = (("Transformer", "Transformer_512"), ("VAEDecoder", "VAEDecoder_half"))


def is_bundle_dir(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a bundle directory: one holding ``metadata.json`` that is not an
    asset itself (a ``.aimodel`` directory holds a ``metadata.json`` of its own)."""
    root = Path(path)
    return root.suffix.lower() not in ASSET_SUFFIXES and (root / MANIFEST_FILE).is_file()


def resolve_asset_path(relative: str, directory: str | os.PathLike[str]) -> Path:
    """``ModelBundle.resolveAssetURL``: ``directory / relative`` if it exists, else for a
    ``.aimodel`` name the compiled ``.aimodelc`` beside it if that exists, else the path as
    written."""
    path = Path(directory) / relative
    if path.exists():
        return path
    if relative.endswith(".aimodel"):
        compiled = Path(directory) / (relative + "c")
        if compiled.exists():
            return compiled
    return path


@dataclass
class Bundle:
    """A bundle directory: its manifest, assets and tokenizer (see :meth:`load`)."""

    path: Path
    manifest: Manifest
    #: ``dynamic`` (sequential/pipelined engines) or ``chunked_static`` (static-shape engine)
    #: for language bundles whose main asset could be read; else None
    structure: str | None = None
    #: what could not be checked here and why (e.g. a compiled .aimodelc)
    unchecked: list[str] = field(default_factory=list)
    _signatures: dict[str, dict[str, FunctionSignature] | None] = field(
        default_factory=dict, repr=False
    )
    _tokenizer: TokenizerInfo | None = field(default=None, repr=False)

    # -- loading ---------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, check_assets: bool = True) -> Bundle:
        """Load and check the bundle at ``path``; raises
        :class:`~coreai_torch.errors.BundleError` (or :class:`BundleNotFoundError`) naming the
        file, key or asset at fault.  ``check_assets=False`` skips the checks of the assets'
        functions (the manifest, files and tokenizer are always checked)."""
        root = Path(path)
        if root.suffix.lower() in ASSET_SUFFIXES:
            raise BundleError(
                f"'{root.name}' is a model asset, not a model bundle directory "
                "(pointedAtModelAsset): pass the directory that holds metadata.json, the "
                "tokenizer and the asset"
                + (
                    f" (here perhaps '{root.parent}')"
                    if (root.parent / MANIFEST_FILE).exists()
                    else ""
                )
            )
        if not root.is_dir():
            raise BundleNotFoundError(f"bundle directory {root} does not exist")
        manifest_path = root / MANIFEST_FILE
        if not manifest_path.is_file():
            hint = ""
            if (root / "config.json").is_file():
                hint = (
                    " It holds config.json: a Hugging Face checkpoint or a model saved in the "
                    "earlier coreai-torch format, not a bundle; write a bundle with "
                    "coreai_torch.bundles.write_llm_bundle"
                )
            raise BundleNotFoundError(
                f"{manifest_path} not found (missingMetadata): a bundle directory holds "
                f"metadata.json, its assets and a tokenizer/ directory.{hint}"
            )
        bundle = cls(root, Manifest.read(manifest_path))
        bundle._check_files()
        if check_assets:
            bundle.check_assets()
        return bundle

    def _check_files(self) -> None:
        where = str(self.path / MANIFEST_FILE)
        for role, relative in self.manifest.assets.items():
            asset = resolve_asset_path(relative, self.path)
            if not asset.exists():
                raise BundleNotFoundError(
                    f"{where}: asset '{role}' not found at {asset} (missingAsset); the bundle "
                    f"must hold it, or assets.{role} must name the file it holds"
                )
            if asset.is_symlink():
                raise BundleError(
                    f"{asset} is a symbolic link; the app's AIModel(contentsOf:) does not follow "
                    "links (failedToSpecialize): copy the asset into the bundle"
                )
            if asset.suffix == ".aimodel":
                check_asset(asset, verify_hash=False)
        if self.manifest.kind == "diffusion" and self.diffusion.type == "flux2":
            for names in FLUX2_FILES:
                if not any(resolve_asset_path(f"{n}.aimodel", self.path).exists() for n in names):
                    wanted = " or ".join(f"{n}.aimodel" for n in names)
                    raise BundleNotFoundError(
                        f"{self.path}: a FLUX.2 bundle needs {wanted} (the pipeline finds it by "
                        "file name)"
                    )
        if self.manifest.kind in LANGUAGE_KINDS and self.language.embedded_tokenizer:
            directory = self.path / TOKENIZER_DIR
            if not (directory / "tokenizer.json").is_file():
                raise BundleNotFoundError(
                    f"{directory / 'tokenizer.json'} is missing while language.embedded_tokenizer "
                    f"is true; the app would download '{self.language.tokenizer}' from the "
                    "Hugging Face Hub instead: write the tokenizer into the bundle"
                )
            self._tokenizer = read_tokenizer(directory)
            if self.manifest.kind == "vlm":
                check_image_token(self.manifest.vision_config(), self._tokenizer, where)

    def check_assets(self) -> None:
        """Check every asset's functions against the engine that runs it
        (:mod:`coreai_torch.bundles.convention`); raises
        :class:`~coreai_torch.errors.CallingConventionError`."""
        readable = {role: self.signatures(role) for role in self.manifest.assets}
        self.structure = check_bundle_assets(
            self.manifest,
            readable,
            self.asset_where(),
            manifest_where=str(self.path / MANIFEST_FILE),
        )
        self.unchecked = [
            f"asset '{role}' ({self.asset_path(role).name}): a compiled .aimodelc, whose "
            "functions cannot be read here"
            for role, sigs in readable.items()
            if sigs is None
        ]

    def asset_where(self) -> dict[str, str]:
        return {role: str(self.asset_path(role)) for role in self.manifest.assets}

    # -- contents --------------------------------------------------------------------------

    @property
    def kind(self) -> str:
        return self.manifest.kind

    @property
    def name(self) -> str:
        return self.manifest.name

    @property
    def language(self) -> LanguageConfig:
        if self.manifest.language is None:
            raise BundleError(f"{self.path}: a {self.kind} bundle has no language block")
        return self.manifest.language

    @property
    def vision(self) -> VisionConfig | None:
        return self.manifest.vision

    @property
    def diffusion(self) -> DiffusionConfig:
        if self.manifest.diffusion is None:
            raise BundleError(f"{self.path}: a {self.kind} bundle has no diffusion block")
        return self.manifest.diffusion

    def asset_path(self, role: str = "main") -> Path:
        """The asset of ``role``, resolved as the app resolves it (``.aimodel`` or compiled
        ``.aimodelc``)."""
        relative = self.manifest.assets.get(role)
        if relative is None:
            raise BundleError(
                f"{self.path / MANIFEST_FILE}: assets.{role} is missing; the bundle's roles are "
                f"{sorted(self.manifest.assets)}"
            )
        return resolve_asset_path(relative, self.path)

    @property
    def tokenizer_dir(self) -> Path | None:
        """``LanguageBundle.tokenizerPath``: ``tokenizer/`` if the tokenizer is embedded and
        ``tokenizer/tokenizer.json`` exists, else None (the app downloads
        ``language.tokenizer``)."""
        if self.manifest.kind not in LANGUAGE_KINDS or not self.language.embedded_tokenizer:
            return None
        directory = self.path / TOKENIZER_DIR
        return directory if (directory / "tokenizer.json").is_file() else None

    @property
    def tokenizer(self) -> TokenizerInfo:
        """The embedded tokenizer as the app reads it (class, eos, stop tokens, template)."""
        if self._tokenizer is None:
            directory = self.tokenizer_dir
            if directory is None:
                raise BundleError(f"{self.path}: the bundle embeds no tokenizer")
            self._tokenizer = read_tokenizer(directory)
        return self._tokenizer

    def signatures(self, role: str = "main") -> dict[str, FunctionSignature] | None:
        """The functions of the asset of ``role`` (None for a compiled ``.aimodelc``)."""
        if role not in self._signatures:
            asset = self.asset_path(role)
            self._signatures[role] = (
                None if asset.suffix == ".aimodelc" else function_signatures(asset)
            )
        return self._signatures[role]

    def required_signatures(self, role: str = "main") -> dict[str, FunctionSignature]:
        """The functions of the asset of ``role``, which must be readable (not compiled)."""
        found = self.signatures(role)
        if found is None:
            raise BundleError(
                f"{self.asset_path(role)} is compiled (.aimodelc): its functions cannot be read"
            )
        return found

    def asset_metadata(self, role: str = "main") -> AssetMetadata:
        """The metadata stored in the asset of ``role``."""
        return read_asset_metadata(self.asset_path(role))


def check_image_token(vision: VisionConfig, tokenizer: TokenizerInfo, where: str) -> None:
    """``vision.image_token_id`` must be a token of the embedded tokenizer, and the chat
    template must render the app's image prompt: ``CoreAIVisionLanguageModel`` applies it to
    one user message whose content is the string ``"<image token>\\n<text>"`` and expands the
    image token it finds into ``image_token_count`` placeholders (without one, it falls back to
    a Qwen-VL prompt that holds no image token of this vocabulary: the image is ignored)."""
    token = tokenizer.token(vision.image_token_id)
    if token is None:
        raise BundleError(
            f"{where}: vision.image_token_id = {vision.image_token_id} is not a token of the "
            f"bundle's tokenizer ({tokenizer.directory}); it must be the id of the model's image "
            "placeholder token (e.g. the processor's image_token)"
        )
    message = [{"role": "user", "content": f"{token}\nWhat is in this image?"}]
    rendered = render_chat(tokenizer.directory, message, add_generation_prompt=True)
    if rendered is None or token not in rendered:
        problem = (
            "has no chat template"
            if not tokenizer.chat_template
            else "has a chat template "
            f"that does not render the image token {token!r} of a plain-string user message"
        )
        raise BundleError(
            f"{where}: the bundle's tokenizer {problem}; the app's CoreAIVisionLanguageModel "
            f"sends the user's text as one string message '{token}\\n<text>' through the chat "
            "template and would otherwise ignore the image: write a chat template that renders "
            "string content (save_pretrained(..., chat_template=...))"
        )


def check_bundle_assets(
    manifest: Manifest,
    signatures: Mapping[str, Signatures | None],
    where: Mapping[str, str],
    *,
    manifest_where: str = MANIFEST_FILE,
) -> str | None:
    """Check the assets of a bundle of ``manifest`` (their functions by role; None: not
    readable) against the engines of its kind; returns the main asset's structure for
    language bundles."""
    if manifest.kind == "llm":
        main = signatures.get("main")
        if main is None:
            return None
        return check_language_asset(main, manifest.language_config(), where=where["main"])
    if manifest.kind == "vlm":
        check_vlm_assets(
            signatures.get("main"),
            signatures.get("vision"),
            signatures.get("embedding"),
            manifest.language_config(),
            manifest.vision_config(),
            where=dict(where),
        )
        main_functions = signatures.get("main")
        return None if main_functions is None else detect_structure(list(main_functions))
    if manifest.kind == "diffusion":
        check_diffusion_roles(
            dict(manifest.assets), manifest.diffusion_config(), where=manifest_where
        )
        for role, sigs in signatures.items():
            if sigs is not None:
                check_diffusion_asset(sigs, role, where=where[role])
    return None
