"""Hugging Face causal LMs -> Core AI programs that Apple's app runtimes run as they are.

:func:`export` makes, by default, the function ``main`` of the app's sequential and pipelined
engines (:mod:`coreai_torch.llm.decoder`)::

    main(input_ids: int32 [1, T], position_ids: int32 [1, P]) -> logits: float16 [1, T, vocab]
    states keyCache [layers, 1, kv_heads, S, key_dim], valueCache [..., S, value_dim]

with ``engine="static"`` the fixed-shape functions of the static-shape engine that iOS apps
and the Neural Engine use (:mod:`coreai_torch.llm.static_shape`), and with ``bundle=`` it
writes the bundle the app loads (``metadata.json``, ``tokenizer/``, the asset; see
``docs/bundles.md``).

``precision`` converts with ``TorchConverter(compute_precision=...)`` (half weights, KV cache
and activations, float32 islands; the logits are float16 whatever the precision) and
``compress`` runs ``program.compress()`` before ``optimize()``.  Mixture-of-experts models
(:data:`MOE_ARCHITECTURES`) are traced with their sparse-MoE blocks replaced by static ones
(:func:`~coreai_torch.rewrites.moe.rewrite_moe`) that gather the weights of the experts the
call's tokens selected (at most ``T * top_k``: a decode step reads its token's experts only)
and combine them with the routing weights.  A model directory is *streamed*: its weights stay
in the checkpoint until the asset is written (``docs/large_models.md``).

The model is traced non-strict (``torch.export(strict=False)``) through its own ``forward``:
Hugging Face's attention, rotary embeddings and masks, given a cache object that reads and
writes the program's states.  Every layer keeps all positions and the sliding window of the
layers that have one is part of their attention mask, built in the graph from the positions
(``transformers``' sliding-window cache layers branch in Python on how many tokens they have
seen, so a program traced through them is right only for the call it was traced with).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from coreai_torch import compression
from coreai_torch import progress as progress_events
from coreai_torch.composite_ops.moe import GatedExperts
from coreai_torch.converter import TorchConverter
from coreai_torch.errors import UnsupportedModelError
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.llm import decoder as main_function
from coreai_torch.llm.calibration import (
    Calibrationdata,
    calibrated,
    calibration_tokens,
    measured,
    vocab_size,
)
from coreai_torch.precision import Precision, from_spec
from coreai_torch.rewrites.moe import SparseMoE, rewrite_moe
from coreai_torch.tensors import lazy
from coreai_torch.tensors.lazy import WeightSource

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from coreai_torch.compression import CompressionConfig
    from coreai_torch.precision import Precision
    from coreai_torch.program import AIProgram

#: ``config.model_type`` of the mixture-of-experts architectures :func:`export` supports
#: (their sparse-MoE blocks are made static with :func:`~coreai_torch.rewrites.moe.rewrite_moe`).
MOE_ARCHITECTURES = ("deepseek_v3", "gpt_oss", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe")

#: ``config.model_type`` of the architectures :func:`export` supports (SmolLM models are
#: ``llama`` with tied embeddings; ``gemma3_text`` is Gemma 3's text model).
ARCHITECTURES = (
    "gemma",
    "gemma2",
    "gemma3_text",
    "llama",
    "mistral",
    "phi3",
    "qwen2",
    "qwen3",
    *MOE_ARCHITECTURES,
)

#: The KV-cache length when none is given and the model allows it.
DEFAULT_MAX_CONTEXT = 2048

#: what ``engine=`` takes: the app engine the program is made for
ENGINES = ("dynamic", "static")

#: Attention implementations the export traces as they are; others switch to ``sdpa``.
_TRACEABLE_ATTENTION = ("sdpa", "eager")


def export(
    model_or_dir: nn.Module | str | os.PathLike[str],
    max_context: int | None = None,
    precision: torch.dtype | str | Precision | None = None,
    compress: CompressionConfig | str | None = None,
    *,
    calibration: Calibrationdata | None = None,
    target_bpw: float | None = None,
    engine: str = "dynamic",
    bundle: str | os.PathLike[str] | None = None,
    tokenizer: Any = None,
    name: str | None = None,
    overwrite: bool = False,
    contexts: Sequence[int] | None = None,
    query_lengths: Sequence[int] | None = None,
) -> AIProgram:
    """Convert a Hugging Face causal LM into a Core AI program (``AIProgram``) that Apple's
    app runtimes run as they are (see the module documentation); ``max_context`` (the most
    positions a generation holds) defaults to the model's own limit
    (``max_position_embeddings``), at most :data:`DEFAULT_MAX_CONTEXT`.

    ``model_or_dir`` is a ``transformers`` causal LM (``AutoModelForCausalLM``) or a local
    directory written by ``save_pretrained`` (streamed from its checkpoint, never
    downloaded).  A model instance gets its own mixture-of-experts blocks back afterwards.

    ``precision``: the compute precision, ``torch.float16`` / ``torch.bfloat16`` (or
    ``"fp16"`` / ``"bf16"``, or a :class:`~coreai_torch.precision.Precision`): weights, KV
    cache and activations in 16 bits with float32 islands; None or ``"fp32"`` keeps the
    model's own dtype.  ``compress``: the weights stored compressed, a
    :mod:`coreai_torch.compression` configuration or a name (``"int4"``: blocks of 32,
    ``"int8"``: per output channel, ``"palette4"``, ...), compressed before ``optimize()``.

    ``engine``: ``"dynamic"`` (default) makes ``main`` for the sequential and pipelined
    engines (macOS); ``"static"`` the static-shape family for the static-shape engine (iOS,
    the Neural Engine): ``load_embeddings``, ``gather_embeddings_<Q>``, ``extend_<ctx>_<Q>``
    and ``prompt_opt_<ctx>_<Q>`` for the cache lengths ``contexts`` (default 256 doubling up
    to ``max_context``, and ``max_context``) and the query lengths ``query_lengths`` (default
    8, 16 and 64), sharing one copy of the weights.

    ``bundle``: a directory to write the bundle the app loads (the program, the manifest,
    ``tokenizer/`` from ``tokenizer`` -- a Hugging Face tokenizer or its directory; default
    the model directory's --, named ``name``, default the directory's name; ``overwrite``
    replaces an existing bundle).  The program is returned either way.

    ``calibration``: data the compressed weights are fitted against (GPTQ, activation-aware
    scales, weighted palettes; :mod:`coreai_torch.compression.calibration`): the path of a text
    file (read with the tokenizer of the model's directory) or token ids (lists of ints, or
    a ``[samples, tokens]`` tensor); at most 32 sequences of 256 tokens are used.
    ``compress="mixed"`` chooses a form per weight to ``target_bpw`` bits per weight (every
    weight counted) and needs ``calibration``.

    Bad arguments raise before the model is read.
    """
    policy = precision_policy(precision)
    compression = compression_config(compress, target_bpw, calibration)
    if engine not in ENGINES:
        raise ValueError(f"llm.export(engine={engine!r}): engine must be one of {ENGINES}")
    static = _static_options(engine, contexts, query_lengths)
    directory = None if isinstance(model_or_dir, nn.Module) else model_or_dir
    if bundle is not None:
        check_bundle_target(bundle, overwrite, directory, tokenizer)
    listener = progress_events.resolve(None)
    with progress_events.phase(listener, "load", 1, "steps"):
        model = load_causal_lm(model_or_dir)
    if max_context is None:
        max_context = default_max_context(model.config)
    check_max_context(model, max_context)
    tokens = calibration_input(model, model_or_dir, calibration)
    program = convert_causal_lm(
        model,
        max_context,
        policy,
        compression,
        engine=engine,
        restore=isinstance(model_or_dir, nn.Module),
        calibration=tokens,
        **static,
    )
    if bundle is not None:
        save_bundle(
            bundle,
            program,
            model,
            max_context,
            compression=compression,
            model_dir=directory,
            tokenizer=tokenizer,
            name=name,
            overwrite=overwrite,
        )
    return program


def calibration_input(
    model: nn.Module, model_or_dir: Any, calibration: Calibrationdata | None
) -> torch.Tensor | None:
    """The calibration token ids ``calibration=`` stands for (None: no calibration)."""
    if calibration is None:
        return None
    directory = None if isinstance(model_or_dir, nn.Module) else Path(model_or_dir)
    return calibration_tokens(calibration, vocab_size(model), tokenizer_dir=directory)


def convert_causal_lm(
    model: PreTrainedModel,
    max_context: int,
    policy: Precision,
    compression: CompressionConfig | None,
    *,
    engine: str = "dynamic",
    restore: bool = True,
    calibration: torch.Tensor | None = None,
    contexts: Sequence[int] | None = None,
    query_lengths: Sequence[int] | None = None,
    embeddings_input: bool = False,
) -> AIProgram:
    """The optimized program of a loaded causal LM (a model instance, or one whose weights
    :func:`load_causal_lm` left in its checkpoint) for the app engine ``engine`` (see
    :func:`export`).  ``restore`` puts the model's own mixture-of-experts blocks back after
    tracing (:func:`export` does it for a model it was given).  ``embeddings_input``: ``main``
    takes the token embeddings instead of the ids (a vision-language bundle's decoder)."""
    listener = progress_events.resolve(None)
    # the checks of half precision and compression read every weight's statistics: a streamed
    # checkpoint is read on the other core while the model is traced
    checked = policy.is_half or compression is not None
    converter = TorchConverter(compute_precision=policy)
    with (
        lazy.statistics_in_background(model.state_dict(keep_vars=True).values() if checked else ()),
        traceable_attention(model),
        _static_moe(model, restore=restore) as experts,
        progress_events.phase(listener, "trace", 1, "entry points") as traced,
        lazy.tracing(),  # a streamed model's weights are lazy: trace without recording
    ):
        # the routed experts' weights gathered for few tokens, every expert for many (picked
        # at run time from T; statically for the static-shape functions)
        has_experts = experts("auto")
        # the KV states in the compute precision (half precision halves their bytes)
        states = policy.compute if policy.is_half else model.dtype
        if engine == "static":
            from coreai_torch.llm import static_shape

            shapes = static_shape.stage(
                converter, model, max_context, states, contexts, query_lengths
            )
        else:
            _stage_main(converter, model, max_context, states, embeddings_input)
            shapes = {}
        traced(1, 1)
    program = converter.to_coreai()
    fitted = None
    if compression is not None and calibration is not None:
        fitted = calibrated(model, calibration, compression, policy.compute)
    elif compression is not None and not has_experts and not embeddings_input:
        # data-free: measured on examples (of token ids: not for a decoder fed embeddings)
        fitted = measured(model, compression, policy.compute, max_context, _source_dir(model))
    if compression is not None:  # before optimize(): no transposed float copies of weights
        program.compress(compression, calibration=fitted)
    for entrypoint, config in shapes.items():  # the static-shape functions, one per shape
        program.set_static_shape_config(entrypoint, config)
    return program.optimize()


def _source_dir(model: nn.Module) -> Path | None:
    """The directory the model was loaded from (its tokenizer may be there), if known."""
    source = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", "")
    return Path(source) if source and Path(source).is_dir() else None


def _stage_main(
    converter: TorchConverter,
    model: PreTrainedModel,
    max_context: int,
    states: torch.dtype,
    embeddings_input: bool = False,
) -> None:
    """Trace :class:`~coreai_torch.llm.decoder.Decoder` (``T``, ``P`` and the states' rows of
    run-time size, the states of ``states``) and stage it as ``main``."""
    wrapper = main_function.Decoder(model, embeddings_input=embeddings_input).eval()
    config = model.config.get_text_config()
    args = main_function.example_inputs(config, states, embeddings_input=embeddings_input)
    ep = export_decomposed(
        wrapper, args, dynamic_shapes=main_function.dynamic_shapes(max_context), strict=False
    )
    names = main_function.EMBEDDINGS_INPUT_NAMES if embeddings_input else main_function.INPUT_NAMES
    converter.add_exported_program(
        ep,
        input_names=list(names),
        output_names=[main_function.OUTPUT_NAME],
        state_names=list(main_function.STATE_NAMES),
        entrypoint_name=main_function.FUNCTION_NAME,
    )


def _static_options(
    engine: str, contexts: Sequence[int] | None, query_lengths: Sequence[int] | None
) -> dict[str, Any]:
    if engine == "static":
        return {"contexts": contexts, "query_lengths": query_lengths}
    given = [n for n, v in (("contexts", contexts), ("query_lengths", query_lengths)) if v]
    if given:
        raise ValueError(
            f"llm.export({', '.join(given)}=...) shapes the static-shape functions; pass "
            "engine='static' with it"
        )
    return {}


# ------------------------------------------------------------------------------ bundles ---


def check_bundle_target(
    bundle: str | os.PathLike[str],
    overwrite: bool,
    model_dir: str | os.PathLike[str] | None,
    tokenizer: Any,
) -> None:
    """Refuse, before anything is converted, a bundle directory that exists (without
    ``overwrite``) or a bundle without a tokenizer."""
    target = Path(bundle)
    if target.suffix.lower() in (".aimodel", ".aimodelc"):
        raise ValueError(
            f"bundle={str(bundle)!r}: a bundle is a directory that holds the .aimodel (and "
            "metadata.json, tokenizer/); name a directory without the .aimodel suffix"
        )
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} exists; pass overwrite=True to replace the bundle")
    if tokenizer is None and model_dir is None:
        raise ValueError(
            "a bundle embeds the model's tokenizer: pass tokenizer= (a Hugging Face tokenizer "
            "or its directory) with a model instance"
        )


def save_bundle(
    directory: str | os.PathLike[str],
    program: AIProgram,
    model: PreTrainedModel,
    max_context: int,
    *,
    compression: CompressionConfig | None = None,
    model_dir: str | os.PathLike[str] | None = None,
    tokenizer: Any = None,
    name: str | None = None,
    overwrite: bool = False,
) -> Any:
    """Write the bundle of ``program`` (exported from ``model`` with ``max_context``):
    :func:`coreai_torch.bundles.write_llm_bundle` with the manifest's ``max_context_length``
    the exported context and ``compression`` described; returns the
    :class:`~coreai_torch.bundles.Bundle`."""
    from coreai_torch.bundles import write_llm_bundle

    with tempfile.TemporaryDirectory(prefix="coreai_torch_configs_") as scratch:
        return write_llm_bundle(
            directory,
            program,
            model_dir=model_dir,
            config=model.config,
            tokenizer=tokenizer,
            name=name,
            max_context_length=max_context,
            compression=compression.describe() if compression is not None else None,
            files=hf_config_files(model, model_dir, Path(scratch)),
            overwrite=overwrite,
        )


#: the Hugging Face files a language bundle carries beside what the app reads (the app ignores
#: them; ``CoreAIModelForCausalLM.from_pretrained`` reads them)
HF_CONFIG_FILES = ("config.json", "generation_config.json")


def hf_config_files(
    model: PreTrainedModel, model_dir: str | os.PathLike[str] | None, scratch: Path
) -> dict[str, Path]:
    """``config.json`` and ``generation_config.json`` of ``model``: the model directory's own,
    else written from the model into ``scratch``."""
    if model_dir is not None:
        found = {name: Path(model_dir) / name for name in HF_CONFIG_FILES}
        return {name: path for name, path in found.items() if path.is_file()}
    model.config.save_pretrained(scratch)
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(scratch)
    return {name: scratch / name for name in HF_CONFIG_FILES if (scratch / name).is_file()}


def precision_policy(precision: torch.dtype | str | Precision | None) -> Precision:
    """The :class:`~coreai_torch.precision.Precision` ``precision=`` asks for."""

    if precision is not None and not isinstance(precision, (str, torch.dtype, Precision)):
        raise TypeError(
            "llm.export(precision=...) takes torch.float16, torch.bfloat16, torch.float32, "
            f"'fp16', 'bf16', 'fp32' or a coreai_torch.precision.Precision; got {precision!r}"
        )
    try:
        return from_spec(precision)
    except ValueError as error:
        raise ValueError(f"llm.export(precision={precision!r}): {error}") from None


def compression_config(
    compress: CompressionConfig | str | None,
    target_bpw: float | None = None,
    calibration: Any = None,
) -> CompressionConfig | None:
    """The compression configuration ``compress=`` (and ``target_bpw=``) ask for (None: no
    compression); ``compress="mixed"`` needs ``calibration``."""
    config = _compression_config(compress, target_bpw)
    if isinstance(config, compression.Mixed) and calibration is None:
        raise ValueError(
            f"compress={compress!r} chooses each weight's form from its error on calibration "
            "data: pass calibration= (a text file, or token ids)"
        )
    if target_bpw is not None and not isinstance(config, compression.Mixed):
        raise ValueError(
            "target_bpw= is the budget of compress='mixed' (a form per weight); "
            f"compress={compress!r} has a fixed size"
        )
    if calibration is not None and config is None:
        raise ValueError("calibration= fits compressed weights: pass compress= too")
    return config


def _compression_config(
    compress: CompressionConfig | str | None, target_bpw: float | None
) -> CompressionConfig | None:
    if compress is None or isinstance(
        compress,
        (
            compression.LinearQuantization,
            compression.Palettization,
            compression.Pruning,
            compression.Mixed,
        ),
    ):
        return compress
    if not isinstance(compress, str):
        raise TypeError(
            "llm.export(compress=...) takes a coreai_torch.compression configuration "
            "(LinearQuantization, Palettization, Pruning) or a name such as 'int4', 'int8', "
            "'palette4', 'sparse50'; "
            f"got {compress!r}"
        )
    try:
        return compression.from_spec(compress, target_bpw=target_bpw)
    except ValueError as error:
        raise ValueError(f"llm.export(compress={compress!r}): {error}") from None


# ------------------------------------------------------------------------------- the model ---


def load_causal_lm(model_or_dir: nn.Module | str | os.PathLike[str]) -> PreTrainedModel:
    """The model itself, or the one saved in a local directory; its architecture checked
    before any weight is read."""
    if isinstance(model_or_dir, nn.Module):
        name = type(model_or_dir).__name__
        check_architecture(getattr(model_or_dir, "config", None), name)
        model: PreTrainedModel = model_or_dir  # a transformers model, as checked
        if model.get_output_embeddings() is None:
            raise UnsupportedModelError(
                f"{name} has no language-model head; llm.export needs a causal LM "
                "(AutoModelForCausalLM, e.g. LlamaForCausalLM rather than LlamaModel)"
            )
        return model.eval()
    if not isinstance(model_or_dir, (str, os.PathLike)):
        raise TypeError(
            "llm.export expects a transformers causal LM or the path of a directory written by "
            f"save_pretrained, got {type(model_or_dir).__name__}"
        )
    path = Path(model_or_dir)
    config = load_config(path)
    from transformers import AutoModelForCausalLM

    check_architecture(config, str(path))
    saved = getattr(config, "architectures", None) or []
    if saved and not any(a.endswith("ForCausalLM") for a in saved):
        raise UnsupportedModelError(
            f"{path} holds a {', '.join(saved)}, not a causal LM (no language-model head to "
            "load); save the AutoModelForCausalLM"
        )
    # the weights stay in the checkpoint: read one at a time while the asset is written
    source = WeightSource(path)
    with lazy.empty_parameters():  # in float32, as from_pretrained loads it
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return source.bind(model).eval()


def load_config(model_dir: str | os.PathLike[str]) -> Any:
    """The Hugging Face config of a local model directory (never downloaded)."""
    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path}: not a model directory (no config.json); llm.export loads local "
            "directories written by save_pretrained and never downloads models"
        )
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, local_files_only=True)


def check_architecture(config: Any, what: str) -> None:
    """Raise :class:`UnsupportedModelError` unless ``config`` is one of :data:`ARCHITECTURES`."""
    model_type = getattr(config, "model_type", None)
    if model_type is None:
        raise UnsupportedModelError(
            f"{what} is not a Hugging Face transformers model (no config.model_type); "
            "llm.export converts transformers causal LMs, convert other modules with "
            "TorchConverter"
        )
    if model_type not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"{what}: model type '{model_type}' is not supported by llm.export (supported: "
            f"{', '.join(ARCHITECTURES)}); convert other models with TorchConverter"
        )


def default_max_context(config: Any) -> int:
    """The KV-cache length used when none is given: the model's ``max_position_embeddings``
    (of its text model), at most :data:`DEFAULT_MAX_CONTEXT`."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 2:
        return min(limit, DEFAULT_MAX_CONTEXT)
    return DEFAULT_MAX_CONTEXT


def check_max_context(model: PreTrainedModel, max_context: int) -> None:
    """``max_context`` must be an int in [2, the model's max_position_embeddings]."""
    if isinstance(max_context, bool) or not isinstance(max_context, int) or max_context < 2:
        raise ValueError(f"max_context must be an int >= 2, got {max_context!r}")
    config = model.config.get_text_config()
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and max_context > limit:
        raise ValueError(
            f"max_context={max_context} exceeds the model's max_position_embeddings ({limit}); "
            "positions beyond it were never trained. Pass max_context <= "
            f"{limit}"
        )


@contextlib.contextmanager
def _static_moe(model: PreTrainedModel, restore: bool) -> Iterator[Callable[[str], bool]]:
    """Trace with the model's sparse-MoE blocks replaced by static ones (:func:`rewrite_moe`),
    then put the user's blocks back if ``restore``.  Yields ``experts(strategy)``, which sets
    how the experts run in the functions traced next (``"auto"``: the experts the call's
    tokens selected, gathered, for a token count known at run time; each token's own for a
    static-shape function with few tokens, every expert for a long chunk), and returns whether
    the model has experts."""

    before = dict(model.named_modules()) if restore else {}
    rewrite_moe(model, strategy="auto")

    def experts(strategy: str) -> bool:
        found = False
        for module in model.modules():
            if isinstance(module, GatedExperts):
                module.strategy = strategy
                found = True
        return found

    try:
        yield experts
    finally:
        for name, module in list(model.named_modules()):
            if isinstance(module, SparseMoE) and before.get(name, module) is not module:
                parent, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent), attr, before[name])


@contextlib.contextmanager
def traceable_attention(model: PreTrainedModel) -> Iterator[None]:
    """Trace with the model's attention if it is ``sdpa`` or ``eager`` (kernels such as
    flash attention have no export path), then put the user's choice back."""
    config = model.config
    chosen = getattr(config, "_attn_implementation", None)
    if chosen in _TRACEABLE_ATTENTION:
        yield
        return
    config._attn_implementation = "sdpa"
    try:
        yield
    finally:
        config._attn_implementation = chosen
