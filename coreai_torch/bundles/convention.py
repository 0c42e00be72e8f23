"""The calling convention of Apple's app engines, checked on an asset's function signatures.

The rules are those of the Swift engines that would run the asset (``COREAI_BUNDLES.md``
§5-6, §8-9): what they check with an error (function present, input/state counts, float16
logits, state dtypes) and what they silently assume (ids before positions, int32 ids and
positions, ``vocab_size`` equal to the logits' width, KV caches growing along their
second-to-last dimension).  An asset that breaks a rule raises
:class:`~coreai_torch.errors.CallingConventionError` naming the function, the value, the rule
and the fix; the writer runs these checks before it writes a bundle, the reader when it loads
one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from coreai_torch.bundles.manifest import DiffusionConfig, LanguageConfig, VisionConfig
from coreai_torch.bundles.signatures import FunctionSignature, Signatures, TensorSpec
from coreai_torch.errors import CallingConventionError

#: state dtypes the engines zero-fill and copy when a KV cache grows
STATE_DTYPES = ("float16", "bfloat16", "float32")
#: ``GrowingNDArrayState``/``GrowingKVCache``: initial capacity (sequential: at most max ctx)
INITIAL_KV_CAPACITY = 256
LOAD_EMBEDDINGS = "load_embeddings"
GATHER_PREFIX = "gather_embeddings_"
STATIC_LOGITS = "out_logits"
STATIC_STATES = ("key_cache", "value_cache")
_STATIC_NAME = re.compile(r"^(extend|prompt_opt)_(\d+)_(\d+)$")


def _error(where: str, function: str, message: str) -> CallingConventionError:
    return CallingConventionError(f"{where}: function '{function}': {message}")


# -------------------------------------------------------------------------- structure ---


def detect_structure(function_names: list[str] | tuple[str, ...]) -> str:
    """``ModelStructure.detectStructure``: ``"chunked_static"`` (an ``extend*`` function and
    ``load_embeddings``: the static-shape engine), ``"segmenter"``, else ``"dynamic"`` (the
    pipelined or sequential engine)."""
    names = set(function_names)
    if any(n.startswith("extend") for n in function_names) and LOAD_EMBEDDINGS in names:
        return "chunked_static"
    if {"image_encode", "text_encode", "detect"} <= names:
        return "segmenter"
    return "dynamic"


def classify_states(function: FunctionSignature) -> list[tuple[str, str]]:
    """``StateHandlerFactory.classifyStates`` without a manifest ``states`` map (no engine of the
    snapshot passes one): two states are both ``kv_cache``; otherwise a state with a dimension
    of run-time size is ``kv_cache``, a static one whose name holds ``cache`` or ``kv`` is
    ``sliding_cache``, any other ``fixed``."""
    if len(function.states) == 2:
        return [(s.name, "kv_cache") for s in function.states]
    kinds = []
    for state in function.states:
        if state.dynamic_dims:
            kinds.append((state.name, "kv_cache"))
        elif "cache" in state.name.lower() or "kv" in state.name.lower():
            kinds.append((state.name, "sliding_cache"))
        else:
            kinds.append((state.name, "fixed"))
    return kinds


# ----------------------------------------------------------- dynamic (macOS) engines ---


@dataclass(frozen=True)
class DynamicDecoder:
    """What the sequential and pipelined engines take from the decoder function."""

    function: FunctionSignature
    #: state name -> ``kv_cache`` | ``sliding_cache`` | ``fixed``
    state_kinds: dict[str, str]
    #: index of the dimension the growing KV states grow along (second-to-last)
    sequence_dim: int

    @property
    def kv_states(self) -> list[TensorSpec]:
        return [s for s in self.function.states if self.state_kinds[s.name] == "kv_cache"]


def check_dynamic_decoder(
    signatures: Signatures,
    language: LanguageConfig,
    *,
    where: str,
    embeddings_input: bool = False,
) -> DynamicDecoder:
    """Check the decoder of a dynamic ``llm`` asset (``embeddings_input``: a ``vlm`` decoder,
    whose first input is the embeddings) against the sequential and pipelined engines:

    * the function ``language.function_map.main[0]`` (else ``main``) exists;
    * exactly 2 inputs, taken by position: int32 token ids ``[1, T]`` (vlm: embeddings
      ``[1, T, hidden]``), then int32 positions ``[1, P]``, T and P of run-time size;
    * the first output is float16 logits ``[1, T, vocab_size]`` (vlm: float16 or bfloat16);
    * 2 to 4 states (vlm: exactly 2) of float16, bfloat16 or float32, at least two of them KV
      caches; a KV cache either grows along its second-to-last dimension (the only dimension
      of run-time size; the pipelined engine's copy on growth needs the 5-D layout
      ``[layers, batch, kv_heads, S, head_dim]``) or is static with that dimension equal to
      ``max_context_length``.
    """
    name = language.main_function
    function = signatures.get(name)
    if function is None:
        mapped = "language.function_map.main[0]" if language.function_map else "the default"
        raise CallingConventionError(
            f"{where}: the engines load the function '{name}' ({mapped}), which the asset does "
            f"not have; its functions are {sorted(signatures)}. Name the decoder 'main' or set "
            'language.function_map to {"main": ["<its name>"]}'
        )
    inputs = function.inputs
    if len(inputs) != 2:
        raise _error(
            where,
            name,
            f"takes {len(inputs)} inputs {[t.name for t in inputs]}; the engines pass exactly "
            "2, by position: the token ids, then the positions 0..P-1 (no masks, no cache "
            "positions, no separate start position)",
        )
    first, positions = inputs
    if embeddings_input:
        if first.rank != 3 or first.shape[0] not in (1, None) or first.shape[1] is not None:
            raise _error(
                where, name, f"input 0 is {first}; the VLM engine passes embeddings [1, T, hidden]"
            )
    else:
        _check_ids(where, name, first, "input 0 (the token ids)", "[1, T]")
    _check_ids(where, name, positions, "input 1 (the positions)", "[1, P]")
    _check_logits(where, name, function, language.vocab_size, vlm=embeddings_input)
    return _check_dynamic_states(where, function, language, vlm=embeddings_input)


def _check_ids(where: str, name: str, spec: TensorSpec, what: str, shape: str) -> None:
    if spec.dtype != "int32":
        raise _error(
            where,
            name,
            f"{what} {spec.name!r} is {spec.dtype}; the engines write int32 into it (an int64 "
            "input would read the ids as the wrong numbers, silently): export it as int32",
        )
    if spec.rank != 2 or spec.shape[0] not in (1, None) or spec.shape[1] is not None:
        raise _error(
            where,
            name,
            f"{what} is {spec}; the engines bind it as {shape} with the length known only at "
            "run time: export it with a dynamic second dimension",
        )


def _check_logits(
    where: str, name: str, function: FunctionSignature, vocab_size: int, *, vlm: bool
) -> None:
    if not function.outputs:
        raise _error(where, name, "has no outputs; the engines read the logits from output 0")
    logits = function.outputs[0]
    allowed = ("float16", "bfloat16") if vlm else ("float16",)
    if logits.dtype not in allowed:
        raise _error(
            where,
            name,
            f"output 0 {logits.name!r} (the logits) is {logits.dtype}; the engines accept only "
            f"{' or '.join(allowed)} logits (unsupportedLogitsType): cast them to float16 in "
            "the graph",
        )
    if logits.rank != 3 or logits.shape[0] not in (1, None) or logits.shape[1] is not None:
        raise _error(
            where,
            name,
            f"output 0 is {logits}; the engines read logits [1, T, vocab] for all T new tokens",
        )
    if logits.shape[2] != vocab_size:
        raise _error(
            where,
            name,
            f"output 0 {logits.name!r} has {logits.shape[2]} logits per token but "
            f"language.vocab_size is {vocab_size}; the engines read vocab_size values per "
            "token, so they must be equal",
        )


def _check_dynamic_states(
    where: str, function: FunctionSignature, language: LanguageConfig, *, vlm: bool
) -> DynamicDecoder:
    name, states = function.name, function.states
    counts = "exactly 2" if vlm else "2 to 4"
    if (vlm and len(states) != 2) or not 2 <= len(states) <= 4:
        raise _error(
            where,
            name,
            f"has {len(states)} states {[s.name for s in states]}; the engines take {counts} "
            "(the KV caches, then persistent states of hybrid models): keep all layers' keys in "
            "one state and all values in another",
        )
    for state in states:
        if state.dtype not in STATE_DTYPES:
            raise _error(
                where,
                name,
                f"state {state.name!r} is {state.dtype}; the engines zero-fill and grow only "
                f"{', '.join(STATE_DTYPES)} states",
            )
    kinds = dict(classify_states(function))
    kv = [s for s in states if kinds[s.name] == "kv_cache"]
    if len(kv) < 2:
        raise _error(
            where,
            name,
            f"has {len(kv)} KV cache state(s) ({kinds}); the pipelined engine (the default for "
            "a dynamic asset) needs at least 2 (keys, values): give them a dimension of "
            "run-time size",
        )
    sequence_dim = kv[0].rank - 2
    for index, state in enumerate(kv):
        dims = state.dynamic_dims
        if not dims:  # static: the engines allocate it once, at max_context_length
            if state.rank < 2 or state.shape[-2] != language.max_context_length:
                raise _error(
                    where,
                    name,
                    f"KV state {state} is static; the engines then allocate it at "
                    f"max_context_length ({language.max_context_length}) along its "
                    "second-to-last dimension, which it must have (or make that dimension "
                    "dynamic so that it grows)",
                )
            continue
        if dims != (state.rank - 2,) or state.rank - 2 != sequence_dim:
            raise _error(
                where,
                name,
                f"KV state {state} must grow along its second-to-last dimension only (the "
                "engines copy the first old_length * head_dim elements of each leading block "
                "when they grow it; any other layout is scrambled silently)",
            )
        if index < 2 and state.rank != 5:
            raise _error(
                where,
                name,
                f"KV state {state} is {state.rank}-D; the pipelined engine grows its key and "
                "value caches as [layers, batch, kv_heads, S, head_dim] (5-D) and cannot grow "
                "another layout: stack the layers into one 5-D state",
            )
    return DynamicDecoder(function, kinds, sequence_dim)


# --------------------------------------------------------- static-shape (iOS) engine ---


@dataclass(frozen=True)
class StaticShapeFamily:
    """The functions the static-shape engine picks from: ``(ctx, Q)`` of every
    ``extend_<ctx>_<Q>`` (and ``prompt_opt_<ctx>_<Q>``), the gather query lengths, and the
    function whose caches are allocated (its key cache length is ``max_context_length``)."""

    pairs: tuple[tuple[int, int], ...]
    gather_lengths: tuple[int, ...]
    max_query_length: int
    cache_function: str


def check_static_shape(
    signatures: Signatures, language: LanguageConfig, *, where: str
) -> StaticShapeFamily:
    """Check a static-shape asset against ``StaticShapeEngine`` (``COREAI_BUNDLES.md`` §6.4):
    ``load_embeddings`` returning ``embedding_table``; ``extend_<ctx>_<Q>`` and
    ``prompt_opt_<ctx>_<Q>`` functions (for the largest Q, one per context) taking a
    ``transformer_input`` ``[1, Q, ...]``, uint16 positions ``[1, Q]`` (an input whose name holds
    ``pos``), optionally a float16 ``causal_mask`` ``[1, ctx, 1, Q]``, an int32 step ``[1]`` and
    ``embedding_table``, returning float16 ``out_logits`` ``[1, Q, vocab_size]`` and holding
    exactly the states ``key_cache`` and ``value_cache``; a ``gather_embeddings_<Q>`` for each Q
    taking ``in_new_token_ids`` and ``embedding_table``; one ``extend`` whose key cache length
    is ``max_context_length``."""
    load = signatures.get(LOAD_EMBEDDINGS)
    if load is None or load.output("embedding_table") is None:
        raise CallingConventionError(
            f"{where}: the static-shape engine runs '{LOAD_EMBEDDINGS}' once and reads its "
            "output 'embedding_table'; the asset has "
            + ("no such function" if load is None else f"{load}")
        )
    if load.inputs:
        raise _error(where, LOAD_EMBEDDINGS, "must take no inputs (the engine passes none)")
    names = sorted(n for n in signatures if n.startswith(("extend", "prompt")))
    pairs: dict[str, tuple[int, int]] = {}
    for name in names:
        match = _STATIC_NAME.match(name)
        if match is None:
            raise _error(
                where,
                name,
                "the static-shape engine reads the context and query length from the last two "
                "'_' fields of every function named extend*/prompt*: name it "
                "extend_<ctx>_<Q> or prompt_opt_<ctx>_<Q>",
            )
        pairs[name] = (int(match.group(2)), int(match.group(3)))
    if not any(n.startswith("extend_") for n in pairs):
        raise CallingConventionError(f"{where}: the asset has no extend_<ctx>_<Q> function")
    max_q = max(q for _, q in pairs.values())
    for ctx, q in set(pairs.values()):
        if f"extend_{ctx}_{q}" not in signatures:
            raise CallingConventionError(
                f"{where}: a function is named for context {ctx} and query length {q}, but "
                f"'extend_{ctx}_{q}' (which the engine picks for it when decoding) is missing"
            )
        if q == max_q and f"prompt_opt_{ctx}_{q}" not in signatures:
            raise CallingConventionError(
                f"{where}: prompts longer than {max_q} tokens are prefilled with "
                f"'prompt_opt_{ctx}_{q}', which is missing"
            )
    vocab = language.vocab_size
    gathers: set[int] = set()
    cache_function = None
    for name, (ctx, q) in pairs.items():
        function = signatures[name]
        _check_static_decoder(where, function, ctx, q, vocab)
        if function.input("embedding_table") is not None or any(
            "transformer_input" in t.name for t in function.inputs
        ):
            gathers.add(q)
        key = function.required_state("key_cache")
        length = None if key.dynamic_dims else max(key.static_shape())
        if (
            cache_function is None
            and name.startswith("extend")
            and length
            in (
                None,
                language.max_context_length,
            )
        ):
            cache_function = name
    if cache_function is None:
        raise CallingConventionError(
            f"{where}: no extend function has a key cache of max_context_length "
            f"({language.max_context_length}) (its largest dimension); the static-shape engine "
            "allocates the caches from that function"
        )
    for name in pairs:
        for state_name in STATIC_STATES:
            state = signatures[name].required_state(state_name)
            reference = signatures[cache_function].required_state(state_name)
            if state.rank != reference.rank or any(
                a is not None and b is not None and a > b
                for a, b in zip(state.shape, reference.shape, strict=True)
            ):
                raise _error(
                    where,
                    name,
                    f"state {state} is not a leading slice of {cache_function}'s {reference}; "
                    "the engine passes every function a slice of one pair of cache buffers",
                )
    for q in sorted(gathers):
        _check_gather(where, signatures, q)
    return StaticShapeFamily(
        tuple(sorted(set(pairs.values()))), tuple(sorted(gathers)), max_q, cache_function
    )


def _check_static_decoder(
    where: str, function: FunctionSignature, ctx: int, q: int, vocab: int
) -> None:
    name = function.name
    transformer = [t for t in function.inputs if "transformer_input" in t.name]
    if len(transformer) != 1:
        raise _error(
            where,
            name,
            "takes the gathered embeddings as one input whose name holds 'transformer_input' "
            f"(inputs: {[t.name for t in function.inputs]})",
        )
    if transformer[0].rank < 2 or transformer[0].shape[1] != q:
        raise _error(
            where, name, f"{transformer[0]} must be [1, {q}, ...] (the query length of its name)"
        )
    positions = [t for t in function.inputs if "pos" in t.name]
    if len(positions) != 1:
        raise _error(where, name, "needs exactly one input whose name holds 'pos' (the positions)")
    pos = positions[0]
    if pos.dtype != "uint16" or pos.shape != (1, q):
        raise _error(
            where, name, f"positions {pos} must be uint16 [1, {q}] (the engine writes UInt16)"
        )
    for spec in function.inputs:
        if spec is transformer[0] or spec is pos or spec.name == "embedding_table":
            continue
        if spec.name == "causal_mask":
            if spec.dtype != "float16" or spec.shape != (1, ctx, 1, q):
                raise _error(where, name, f"causal_mask {spec} must be float16 [1, {ctx}, 1, {q}]")
        elif "step" in spec.name:
            if spec.dtype != "int32" or spec.shape not in ((1,), (1, 1)):
                raise _error(where, name, f"step input {spec} must be int32 [1]")
        else:
            raise _error(
                where,
                name,
                f"input {spec.name!r} is not one the static-shape engine feeds (transformer_input, "
                "a 'pos' input, causal_mask, a 'step' input, embedding_table)",
            )
    logits = function.output(STATIC_LOGITS)
    if logits is None:
        raise _error(where, name, f"has no output '{STATIC_LOGITS}', which the engine reads")
    if logits.dtype != "float16" or logits.shape[-1] != vocab or q not in logits.shape[:-1]:
        raise _error(
            where,
            name,
            f"{logits} must be float16 [1, {q}, {vocab}] (a row of vocab_size logits per query)",
        )
    if sorted(s.name for s in function.states) != sorted(STATIC_STATES):
        raise _error(
            where,
            name,
            f"has states {[s.name for s in function.states]}; the static-shape engine binds "
            "exactly 'key_cache' and 'value_cache'",
        )


def _check_gather(where: str, signatures: Signatures, q: int) -> None:
    name = f"{GATHER_PREFIX}{q}"
    gather = signatures.get(name)
    if gather is None:
        raise CallingConventionError(
            f"{where}: the static-shape engine gathers the embeddings of {q} tokens with "
            f"'{name}', which is missing"
        )
    ids = gather.input("in_new_token_ids")
    if ids is None or ids.dtype != "int32":
        raise _error(where, name, "needs an int32 input 'in_new_token_ids' (the token ids)")
    if gather.input("embedding_table") is None:
        raise _error(where, name, "must take 'embedding_table' (the engine always passes it)")
    if not gather.outputs:
        raise _error(
            where, name, "has no output (the engine reads out_transformer_input or output 0)"
        )


# ------------------------------------------------------------------------ the checks ---


def check_language_asset(signatures: Signatures, language: LanguageConfig, *, where: str) -> str:
    """Check the ``main`` asset of an ``llm`` bundle against the engine its structure selects
    (:func:`detect_structure`); returns the structure."""
    structure = detect_structure(list(signatures))
    if structure == "chunked_static":
        check_static_shape(signatures, language, where=where)
    elif structure == "dynamic":
        check_dynamic_decoder(signatures, language, where=where)
    else:
        raise CallingConventionError(
            f"{where}: the functions {sorted(signatures)} make a segmenter asset, not a "
            "language model"
        )
    return structure


def check_vlm_assets(
    main: Signatures | None,
    vision_asset: Signatures | None,
    embedding: Signatures | None,
    language: LanguageConfig,
    vision: VisionConfig,
    *,
    where: dict[str, str],
) -> None:
    """``CoreAISequentialVLMEngine``: the decoder (``main``: embeddings and positions, exactly 2
    states, float16/bfloat16 logits), the vision asset (``encode_image`` + ``project``, or
    ``main``: float32 pixels ``[1, 3, S, S]``), the embedding asset (``embed_tokens`` or
    ``main``: int32 ids ``[1, T]`` to ``[1, T, hidden]``).  ``None``: not readable here.

    The engine merges the image features into the token embeddings through a float16 view
    and passes the result to the decoder as it is: the features (``[1, image_token_count,
    hidden]``), the embeddings and the decoder's first input must all be float16 with the
    same ``hidden``."""
    hidden: dict[str, int | None] = {}
    if main is not None:
        decoder = check_dynamic_decoder(
            main, language, where=where["main"], embeddings_input=True
        ).function
        _check_merged(where["main"], decoder.name, decoder.inputs[0], "input 0 (the embeddings)")
        hidden["main"] = decoder.inputs[0].shape[2]
    if vision_asset is not None:
        names = ("encode_image", "project") if "encode_image" in vision_asset else ("main",)
        for name in names:
            if name not in vision_asset:
                raise CallingConventionError(
                    f"{where['vision']}: the VLM engine runs 'encode_image' and 'project', or "
                    f"'main'; the asset has {sorted(vision_asset)}"
                )
        pixels = vision_asset[names[0]].inputs[:1]
        size = vision.image_size
        if (
            not pixels
            or pixels[0].dtype != "float32"
            or pixels[0].shape[1:]
            not in (
                (3, size, size),
                (3, None, None),
            )
        ):
            raise _error(
                where["vision"],
                names[0],
                f"input 0 must be float32 pixels [1, 3, {size}, {size}] (vision.image_size), "
                f"got {pixels[0] if pixels else 'none'}",
            )
        last = vision_asset[names[-1]]
        if not last.outputs:
            raise _error(where["vision"], last.name, "has no output (the image features)")
        features = last.outputs[0]
        _check_merged(where["vision"], last.name, features, "output 0 (the image features)")
        if features.shape[1] not in (vision.image_token_count, None):
            raise _error(
                where["vision"],
                last.name,
                f"output 0 {features} has {features.shape[1]} image tokens but "
                f"vision.image_token_count is {vision.image_token_count}; the engine replaces "
                "that many placeholder tokens, so they must be equal",
            )
        hidden["vision"] = features.shape[2]
    if embedding is not None:
        name = "embed_tokens" if "embed_tokens" in embedding else "main"
        function = embedding.get(name)
        if function is None:
            raise CallingConventionError(
                f"{where['embedding']}: the VLM engine runs 'embed_tokens' or 'main'; the asset "
                f"has {sorted(embedding)}"
            )
        if not function.inputs or not function.outputs:
            raise _error(where["embedding"], name, "needs the token ids in and the embeddings out")
        _check_ids(
            where["embedding"], name, function.inputs[0], "input 0 (the token ids)", "[1, T]"
        )
        _check_merged(where["embedding"], name, function.outputs[0], "output 0 (the embeddings)")
        hidden["embedding"] = function.outputs[0].shape[2]
    sizes = {role: size for role, size in hidden.items() if size is not None}
    if len(set(sizes.values())) > 1:
        raise CallingConventionError(
            f"{where.get('main', 'the bundle')}: the hidden sizes of the decoder's embeddings, "
            f"the image features and the token embeddings differ ({sizes}); the engine merges "
            "them into one [1, T, hidden] input"
        )


def _check_merged(where: str, name: str, spec: TensorSpec, what: str) -> None:
    """An embeddings tensor of the VLM engine: float16 ``[1, N, hidden]``."""
    if spec.dtype != "float16" or spec.rank != 3 or spec.shape[0] not in (1, None):
        raise _error(
            where,
            name,
            f"{what} is {spec}; the VLM engine merges image features and token embeddings as "
            "float16 [1, N, hidden] (scatterMerge supports only float16): cast it to float16 "
            "in the graph",
        )


def check_diffusion_asset(signatures: Signatures, role: str, *, where: str) -> None:
    """Every component of a diffusion bundle is an asset whose function is ``main``
    (``CoreAIDiffusionModelFunction``)."""
    if "main" not in signatures:
        raise CallingConventionError(
            f"{where}: CoreAIDiffusionPipeline runs the function 'main' of the {role} asset; "
            f"it has {sorted(signatures)}"
        )


def check_diffusion_roles(
    assets: dict[str, str], diffusion: DiffusionConfig, *, where: str
) -> None:
    """The components ``PipelineDescriptor.loadComponents`` (and the SD3 pipeline) require."""
    missing = []
    if diffusion.type != "flux2":  # FLUX.2 finds its transformer and decoder by file name
        if "unet" not in assets and "transformer" not in assets:
            missing.append("unet (or transformer)")
        if "vae_decoder" not in assets:
            missing.append("vae_decoder")
    if "text_encoder" not in assets:
        missing.append("text_encoder")
    if diffusion.type == "stable-diffusion-3" and "text_encoder_2" not in assets:
        missing.append("text_encoder_2")
    if missing:
        raise CallingConventionError(
            f"{where}: assets lacks {', '.join(missing)}; CoreAIDiffusionPipeline "
            "throws missingComponent without them"
        )
