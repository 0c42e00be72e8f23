"""Core AI bundles: the directories Apple's app runtimes load a converted model from.

A bundle is ``metadata.json`` (the manifest, schema 0.2), the asset(s) (``.aimodel``), and for
language models a ``tokenizer/`` directory.  One writer and one reader serve every kind
(``llm``, ``vlm``, ``diffusion``); both check what the app would check, and what it silently
assumes, so that a bundle written here loads and runs in the app unchanged::

    from coreai_torch import bundles

    bundle = bundles.write_llm_bundle("out/MyModel", program, model_dir="path/to/hf_model")
    bundle = bundles.Bundle.load("out/MyModel")          # the app's loading rules
    with bundles.SequentialEngine(bundle) as engine:     # the app's calling convention
        tokens = engine.generate(prompt_ids, max_new_tokens=32)
    with bundles.VisionLanguageEngine("out/MyVLM") as engine:   # a vlm bundle
        tokens = engine.generate(prompt_ids, 32, image=pil_image)

See ``docs/bundles.md`` ("Ship it in an app").
"""

from coreai_torch.bundles.asset_metadata import (
    AssetMetadata,
    metadata_from_model_dir,
    read_asset_metadata,
    write_asset_metadata,
)
from coreai_torch.bundles.convention import (
    check_dynamic_decoder,
    check_language_asset,
    check_static_shape,
    classify_states,
    detect_structure,
)
from coreai_torch.bundles.driver import (
    FRESH_MEMORY,
    PipelinedEngine,
    SequentialEngine,
    StaticShapeEngine,
    open_engine,
)
from coreai_torch.bundles.manifest import (
    METADATA_VERSION,
    DiffusionConfig,
    LanguageConfig,
    Manifest,
    SchedulerDefaults,
    VisionConfig,
)
from coreai_torch.bundles.reader import Bundle, is_bundle_dir, resolve_asset_path
from coreai_torch.bundles.signatures import FunctionSignature, TensorSpec, function_signatures
from coreai_torch.bundles.tokenizer import TokenizerInfo, read_tokenizer, write_tokenizer
from coreai_torch.bundles.vlm_driver import VisionLanguageEngine, preprocess_image
from coreai_torch.bundles.writer import (
    eos_token_ids,
    language_config_from_hf,
    write_bundle,
    write_llm_bundle,
    write_vlm_bundle,
)
from coreai_torch.errors import BundleError, BundleNotFoundError, CallingConventionError

__all__ = [
    "FRESH_MEMORY",
    "METADATA_VERSION",
    "AssetMetadata",
    "Bundle",
    "BundleError",
    "BundleNotFoundError",
    "CallingConventionError",
    "DiffusionConfig",
    "FunctionSignature",
    "LanguageConfig",
    "Manifest",
    "PipelinedEngine",
    "SchedulerDefaults",
    "SequentialEngine",
    "StaticShapeEngine",
    "TensorSpec",
    "TokenizerInfo",
    "VisionConfig",
    "VisionLanguageEngine",
    "check_dynamic_decoder",
    "check_language_asset",
    "check_static_shape",
    "classify_states",
    "detect_structure",
    "eos_token_ids",
    "function_signatures",
    "is_bundle_dir",
    "language_config_from_hf",
    "metadata_from_model_dir",
    "open_engine",
    "preprocess_image",
    "read_asset_metadata",
    "read_tokenizer",
    "resolve_asset_path",
    "write_asset_metadata",
    "write_bundle",
    "write_llm_bundle",
    "write_tokenizer",
    "write_vlm_bundle",
]
