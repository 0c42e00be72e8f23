"""Hugging Face causal LMs -> one Core AI program with a ``prefill`` and a ``decode`` entry point.

Both entry points share the weights (stored once) and the KV cache, a static cache of
``max_context`` positions per layer held as Core AI state::

    prefill(input_ids: int64 [1, T], start_position: int64 [1]) -> logits    1 <= T <= max_context
    decode(input_ids: int64 [1, 1], start_position: int64 [1]) -> logits
    states: layers.{i}.k_cache, layers.{i}.v_cache   [1, kv_heads, max_context, head_dim]

The tokens are written to cache positions ``start_position .. start_position + T - 1`` and
attend to every cached position before them (within the sliding window where the model has
one).  ``logits`` is ``[1, 1, vocab]`` (the last position) or ``[1, T, vocab]`` with
``all_logits=True``.  RMSNorm, rotary embeddings and attention are composite ops
(``rms_norm``, ``rope``, ``scaled_dot_product_attention``; models that soft-cap attention
scores, such as Gemma 2, attend with plain ops).

``precision`` converts with ``TorchConverter(compute_precision=...)`` (half weights and KV
cache, float32 islands; the logits stay float32) and ``compress`` runs ``program.compress()``
before ``optimize()``.  Mixture-of-experts models (:data:`MOE_ARCHITECTURES`) are traced with
their sparse-MoE blocks replaced by static ones (:func:`~coreai_torch.rewrites.moe.rewrite_moe`):
the prefill runs every expert on its tokens and combines them with the routing weights (its
token count is dynamic), the decode step gathers its token's experts only; both read the
same stacked expert weights, stored once.

Hugging Face's export recipes (``transformers.integrations.executorch``) are reused where
they fit: the cache is ``transformers``' own ``StaticLayer`` (the ``StaticCache`` layer
``TorchExportableModuleWithStaticCache`` registers as buffers).  The program is traced
non-strict, which takes a third of the time of the recipes' ``strict=True`` (no bytecode
analysis): the cache layers are pointed at the buffers in each call, so the writes reach the
tensors export traces with rather than being lifted a second time as constants.  The decode
step of a dense model is the prefill's graph specialized to one token
(:func:`~coreai_torch.frontend.specialize.specialize`), not a second trace.  The recipe
modules themselves do not fit:

* ``TorchExportableModuleWithStaticCache`` / ``...WithHybridCache`` give sliding-window layers
  a ``StaticSlidingWindowLayer``, whose update branches in Python on how many tokens it has
  seen, so the traced program is only right for the call it was traced with; here every layer
  keeps all ``max_context`` positions and the sliding window is part of the attention mask,
  so one program serves any start position;
* they return the logits of every position (no ``logits_to_keep``), take the cache positions
  instead of a start position, and require ``generation_config.cache_implementation ==
  "static"`` on the user's model;
* their ``sdpa_without_vmap`` mask puts the sliding window into the masks of Gemma 2's
  full-attention layers too; the trace here uses Hugging Face's own masks.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
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
from coreai_torch.frontend.specialize import SpecializationError, specialize
from coreai_torch.ir import lazy
from coreai_torch.ir.lazy import WeightSource
from coreai_torch.llm.calibration import (
    Calibrationdata,
    calibrated,
    calibration_tokens,
    measured,
    vocab_size,
)
from coreai_torch.precision import Precision, from_spec
from coreai_torch.rewrites.moe import SparseMoE, rewrite_moe

if TYPE_CHECKING:
    from coreai_torch.compression import CompressionConfig
    from coreai_torch.precision import Precision
    from coreai_torch.program import AIProgram

#: ``config.model_type`` of the mixture-of-experts architectures :func:`export` supports
#: (their sparse-MoE blocks are made static with :func:`~coreai_torch.rewrites.moe.rewrite_moe`).
MOE_ARCHITECTURES = ("deepseek_v3", "gpt_oss", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe")

#: ``config.model_type`` of the architectures :func:`export` supports (SmolLM models are
#: ``llama`` with tied embeddings).
ARCHITECTURES = (
    "gemma",
    "gemma2",
    "llama",
    "mistral",
    "phi3",
    "qwen2",
    "qwen3",
    *MOE_ARCHITECTURES,
)

#: The KV-cache length when none is given and the model allows it.
DEFAULT_MAX_CONTEXT = 2048

#: Names of the program's inputs and output (the same for both entry points).
INPUT_NAMES = ("input_ids", "start_position")
OUTPUT_NAME = "logits"

#: Attention implementations the export traces as they are; others switch to ``sdpa``.
_TRACEABLE_ATTENTION = ("sdpa", "eager")


def export(
    model_or_dir: nn.Module | str | os.PathLike[str],
    max_context: int | None = None,
    precision: torch.dtype | str | Precision | None = None,
    compress: CompressionConfig | str | None = None,
    *,
    all_logits: bool = False,
    calibration: Calibrationdata | None = None,
    target_bpw: float | None = None,
) -> AIProgram:
    """Convert a Hugging Face causal LM into one Core AI program (``AIProgram``) with the
    entry points ``prefill`` and ``decode`` sharing weights and a KV cache of ``max_context``
    positions (see the module documentation for the signature); ``max_context`` defaults to
    the model's own limit (``max_position_embeddings``), at most :data:`DEFAULT_MAX_CONTEXT`.

    ``model_or_dir`` is a ``transformers`` causal LM (``AutoModelForCausalLM``) or a local
    directory written by ``save_pretrained`` (loaded with ``from_pretrained``, never
    downloaded).  Mixture-of-experts blocks are made static (:func:`rewrite_moe`) while the
    model is traced; a model instance gets its own blocks back afterwards.

    ``precision``: the compute precision, ``torch.float16`` / ``torch.bfloat16`` (or
    ``"fp16"`` / ``"bf16"``, or a :class:`~coreai_torch.precision.Precision`): weights, KV
    cache and activations in 16 bits with float32 islands; None or ``"fp32"`` keeps the
    model's own dtype.  ``compress``: the weights stored compressed, a
    :mod:`coreai_torch.compression` configuration or a name (``"int4"``: blocks of 32,
    ``"int8"``: per output channel, ``"palette4"``, ...), compressed before ``optimize()``.
    ``all_logits=True`` returns the logits of every prompt position instead of the last one.

    ``calibration``: data the compressed weights are fitted against (GPTQ, activation-aware
    scales, weighted palettes; :mod:`coreai_torch.compression.calibration`): the path of a text
    file (read with the tokenizer of the model's directory) or token ids (lists of ints, or
    a ``[samples, tokens]`` tensor); at most 32 sequences of 256 tokens are used.
    ``compress="mixed"`` chooses a form per weight to ``target_bpw`` bits per weight (every
    weight counted) and needs ``calibration``.
    """
    policy = precision_policy(precision)
    compression = compression_config(compress, target_bpw, calibration)
    listener = progress_events.resolve(None)
    with progress_events.phase(listener, "load", 1, "steps"):
        model = load_causal_lm(model_or_dir)
    if max_context is None:
        max_context = default_max_context(model.config)
    check_max_context(model, max_context)
    tokens = calibration_input(model, model_or_dir, calibration)
    return convert_causal_lm(
        model,
        max_context,
        policy,
        compression,
        all_logits=all_logits,
        restore=isinstance(model_or_dir, nn.Module),
        calibration=tokens,
    )


def calibration_input(
    model: nn.Module, model_or_dir: Any, calibration: Calibrationdata | None
) -> torch.Tensor | None:
    """The calibration token ids ``calibration=`` stands for (None: no calibration)."""
    if calibration is None:
        return None
    directory = None if isinstance(model_or_dir, nn.Module) else Path(model_or_dir)
    return calibration_tokens(calibration, vocab_size(model), tokenizer_dir=directory)


def convert_causal_lm(
    model: nn.Module,
    max_context: int,
    policy: Precision,
    compression: CompressionConfig | None,
    *,
    all_logits: bool = False,
    forward: bool = False,
    restore: bool = True,
    calibration: torch.Tensor | None = None,
) -> AIProgram:
    """The optimized program of a loaded causal LM (a model instance, or one whose weights
    :func:`load_causal_lm` left in its checkpoint): ``prefill`` and ``decode`` as
    :func:`export` makes them and, with ``forward``, a third entry point ``forward`` taking
    the ``prefill``'s inputs and returning every position's logits, all sharing the weights
    and the KV cache.  ``restore`` puts the model's own mixture-of-experts blocks back after
    tracing (:func:`export` does it for a model it was given)."""
    # entry points over a prompt of 1..max_context tokens -> whether they return every logit
    prompts = {"prefill": all_logits, **({"forward": True} if forward else {})}
    exported: dict[str, torch.export.ExportedProgram] = {}
    listener = progress_events.resolve(None)
    # the checks of half precision and compression read every weight's statistics: a streamed
    # checkpoint is read on the other core while the model is traced
    checked = policy.is_half or compression is not None
    with (
        lazy.statistics_in_background(model.state_dict(keep_vars=True).values() if checked else ()),
        traceable_attention(model),
        _static_moe(model, restore=restore) as experts,
        progress_events.phase(listener, "trace", len(prompts) + 1, "entry points") as traced,
    ):
        wrapper = CachedCausalLM(model, max_context).eval()
        tokens = torch.export.Dim("tokens", min=1, max=max_context)
        with lazy.tracing():  # a streamed model's weights are lazy: trace without recording
            experts("dense")
            for name, every_position in prompts.items():
                wrapper.all_logits = every_position
                exported[name] = trace_cached(wrapper, token_args(2), ({1: tokens}, None))
                traced(len(exported), len(prompts) + 1)
            wrapper.all_logits = all_logits
            if experts("gather"):  # the decode step reads its token's experts only
                exported["decode"] = trace_cached(wrapper, token_args(1), None)
            else:  # the prefill of one token
                exported["decode"] = decode_step(exported["prefill"], wrapper)
    converter = TorchConverter(compute_precision=policy)
    for name, ep in exported.items():
        converter.add_exported_program(
            ep,
            input_names=list(INPUT_NAMES),
            output_names=[OUTPUT_NAME],
            state_names=cache_state_names(ep),
            entrypoint_name=name,
        )
    program = converter.to_coreai()
    fitted = None
    if compression is not None and calibration is not None:
        fitted = calibrated(model, calibration, compression, policy.compute)
    elif compression is not None:  # data-free: its output error measured on examples
        fitted = measured(model, compression, policy.compute, max_context, _source_dir(model))
    if compression is not None:  # before optimize(): no transposed float copies of weights
        program.compress(compression, calibration=fitted)
    return program.optimize()


def _source_dir(model: nn.Module) -> Path | None:
    """The directory the model was loaded from (its tokenizer may be there), if known."""
    source = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", "")
    return Path(source) if source and Path(source).is_dir() else None


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


def load_causal_lm(model_or_dir: nn.Module | str | os.PathLike[str]) -> nn.Module:
    """The model itself, or the one saved in a local directory; its architecture checked
    before any weight is read."""
    if isinstance(model_or_dir, nn.Module):
        name = type(model_or_dir).__name__
        check_architecture(getattr(model_or_dir, "config", None), name)
        if model_or_dir.get_output_embeddings() is None:
            raise UnsupportedModelError(
                f"{name} has no language-model head; llm.export needs a causal LM "
                "(AutoModelForCausalLM, e.g. LlamaForCausalLM rather than LlamaModel)"
            )
        return model_or_dir.eval()
    if not isinstance(model_or_dir, (str, os.PathLike)):
        raise TypeError(
            "llm.export expects a transformers causal LM or the path of a directory written by "
            f"save_pretrained, got {type(model_or_dir).__name__}"
        )
    path = Path(model_or_dir)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path}: not a model directory (no config.json); llm.export loads local "
            "directories written by save_pretrained and never downloads models"
        )
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, local_files_only=True)
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
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    return source.bind(model).eval()


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


def check_max_context(model: nn.Module, max_context: int) -> None:
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


class CachedCausalLM(nn.Module):
    """``(input_ids [1, T], start_position [1]) -> logits`` with the KV cache in buffers
    ``layers.{i}.k_cache`` / ``layers.{i}.v_cache`` (``transformers``' ``StaticLayer``s of
    ``max_context`` positions), written in place at ``start_position .. + T - 1``."""

    def __init__(self, model: nn.Module, max_context: int, *, all_logits: bool = False) -> None:
        super().__init__()
        from transformers.cache_utils import Cache, StaticCache, StaticLayer

        self.model = model
        self.all_logits = all_logits
        config = model.config.get_text_config()
        kv_heads, key_dim, value_dim = cache_dims(config)
        # A StaticCache (Qwen2-MoE and OLMoE build their masks from the cache's length only
        # for one) whose every layer keeps all positions (StaticCache(config) would give
        # sliding-window layers a StaticSlidingWindowLayer, see the module documentation).
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
        return out.logits


def cache_dims(config: Any) -> tuple[int, int, int]:
    """``(kv_heads, key_dim, value_dim)`` of each layer's cache: grouped-query attention's
    key/value heads; DeepSeek's multi-head latent attention caches every head's full key
    (``qk_nope_head_dim + qk_rope_head_dim``) and value (``v_head_dim``), as Hugging Face's
    attention computes them."""
    heads = config.num_attention_heads
    if getattr(config, "qk_nope_head_dim", None) is not None:
        return heads, config.qk_nope_head_dim + config.qk_rope_head_dim, config.v_head_dim
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return kv_heads, head_dim, head_dim


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


def decode_step(
    prefill: torch.export.ExportedProgram, wrapper: nn.Module
) -> torch.export.ExportedProgram:
    """The ``decode`` entry point: the ``prefill`` program specialized to one token
    (:func:`~coreai_torch.frontend.specialize.specialize`), or ``wrapper`` traced for one
    token where the prefill's graph cannot be specialized."""
    try:
        return specialize(prefill, token_args(1))
    except SpecializationError:
        return trace_cached(wrapper, token_args(1), None)


def trace_cached(
    wrapper: nn.Module, args: tuple[torch.Tensor, ...], dynamic_shapes: Any
) -> torch.export.ExportedProgram:
    """Export (decomposed) a module that writes the KV cache of its ``cache`` attribute in
    place (:class:`CachedCausalLM` and modules like it), traced non-strict as the module
    documentation explains; the cache is reset afterwards."""
    try:
        return export_decomposed(wrapper, args, dynamic_shapes=dynamic_shapes, strict=False)
    finally:
        wrapper.cache.reset()  # tracing does not write, but start from a clean cache anyway


@contextlib.contextmanager
def _static_moe(model: nn.Module, restore: bool) -> Iterator[Callable[[str], bool]]:
    """Trace with the model's sparse-MoE blocks replaced by static ones (:func:`rewrite_moe`),
    then put the user's blocks back if ``restore``.  Yields ``experts(strategy)``, which sets
    how the experts run in the entry point traced next: ``"dense"`` for the prefill (a dynamic
    token count), ``"gather"`` for the decode step (only its token's experts are read), and
    returns whether the model has experts."""

    before = dict(model.named_modules()) if restore else {}
    rewrite_moe(model, strategy="dense")

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
def traceable_attention(model: nn.Module) -> Iterator[None]:
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
