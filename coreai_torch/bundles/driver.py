"""The Python reference driver of the app engines' calling convention.

It runs a bundle on the Core AI runtime (``coreai_torch.runtime.Session``) exactly as Apple's
Swift engines call it (``CoreAILanguageModels/InferenceEngines``, ``COREAI_BUNDLES.md`` §6):

* :class:`SequentialEngine` (``CoreAISequentialEngine``): the function's two inputs by
  position, the new token ids ``[1, T]`` and all positions ``0..P-1``; prefill in one call, or
  in chunks of ``prefill_chunk_size`` when more than ``chunk_threshold`` tokens are new; then
  one call per generated token; the KV states start at ``min(256, max_context_length)`` rows
  and double, copied with the Swift rule (the first ``old_rows * head_dim`` elements of each
  leading block) into **fresh memory that is not zeroed** (here: noise, or NaN); greedy argmax
  over the float16 logits; stop on the tokenizer's stop set; prefix reuse across calls
  (a prompt the history already holds is re-fed from its last token).
* :class:`PipelinedEngine` (``CoreAIPipelinedEngine``, the default for a dynamic asset): the
  same calls split as it splits them (chunks while more than ``prefill_chunk_size`` remain,
  the rest in the call that samples), its KV cache starting at 256 rows and grown before the
  prompt to what the generation needs, and its warmup at load (token 1 at position 0, then the
  position reset without clearing the cache).
* :class:`StaticShapeEngine` (``StaticShapeEngine``, iOS): ``load_embeddings`` once, then
  ``gather_embeddings_<Q>`` and ``extend_<ctx>_<Q>`` / ``prompt_opt_<ctx>_<Q>`` on batches
  aligned down to a multiple of Q, with uint16 positions, the float16 causal mask, the int32
  step, and slices of one pair of cache buffers.

``chunk_threshold`` is, as in the app, the ``COREAI_CHUNK_THRESHOLD`` environment variable when
set (> 0), else the manifest's ``language.prefill_chunk_threshold`` (newer runtimes), else
1024; ``prefill_chunk_size`` the manifest's, else ``min(512, chunk_threshold)``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from coreai_torch.bundles.convention import (
    GATHER_PREFIX,
    INITIAL_KV_CAPACITY,
    STATIC_LOGITS,
    STATIC_STATES,
    check_dynamic_decoder,
    check_static_shape,
)
from coreai_torch.bundles.reader import Bundle
from coreai_torch.errors import BundleError
from coreai_torch.runtime import Session, numpy_dtype

#: what fresh (never written) state memory holds: ``noise`` (finite random values of the
#: state's dtype), ``nan``, or ``zeros``
FRESH_MEMORY = ("noise", "nan", "zeros")
DEFAULT_CHUNK_THRESHOLD = 1024
MAX_PREFILL_CHUNK = 512
#: the magnitude of the noise in fresh memory (large enough to change any result it reaches)
NOISE_SCALE = 100.0
#: the causal mask's "masked" value in the static-shape engine
MASKED = -40000.0

LogitsCallback = Callable[[np.ndarray], None]


def _ndarray(values: np.ndarray) -> Any:
    from coreai.runtime import NDArray

    return NDArray(np.ascontiguousarray(values))


def _numpy(array: Any) -> np.ndarray:
    from coreai_torch.runtime import to_numpy

    return to_numpy(array)


class _Engine:
    """What the engines share: the bundle, a runtime session, fresh memory, the stop set."""

    #: the bundle kinds the engine runs
    kinds: tuple[str, ...] = ("llm",)

    def __init__(
        self,
        bundle: Bundle | str | os.PathLike[str],
        *,
        fresh_memory: str = "noise",
        seed: int = 0,
        chunk_threshold: int | None = None,
        stop_token_ids: Iterable[int] | None = None,
    ) -> None:
        self.bundle = bundle if isinstance(bundle, Bundle) else Bundle.load(bundle)
        if self.bundle.kind not in self.kinds:
            hint = " (run it with VisionLanguageEngine)" if self.bundle.kind == "vlm" else ""
            raise BundleError(
                f"{self.bundle.path}: {type(self).__name__} runs {' and '.join(self.kinds)} "
                f"bundles, not {self.bundle.kind}{hint}"
            )
        if fresh_memory not in FRESH_MEMORY:
            raise ValueError(f"fresh_memory must be one of {FRESH_MEMORY}, got {fresh_memory!r}")
        self.language = self.bundle.language
        self.fresh_memory = fresh_memory
        self.rng = np.random.default_rng(seed)
        env = os.environ.get("COREAI_CHUNK_THRESHOLD", "")
        threshold = chunk_threshold or (
            int(env) if env.strip().isdigit() and int(env) > 0 else None
        )
        self.chunk_threshold = (
            threshold or self.language.prefill_chunk_threshold or DEFAULT_CHUNK_THRESHOLD
        )
        self.prefill_chunk_size = self.language.prefill_chunk_size or min(
            MAX_PREFILL_CHUNK, self.chunk_threshold
        )
        if stop_token_ids is None:
            stop_token_ids = (
                self.bundle.tokenizer.stop_token_ids if self.bundle.tokenizer_dir else ()
            )
        self.stop_token_ids = frozenset(int(i) for i in stop_token_ids)
        self.session = Session(self.bundle.asset_path("main"), verify_hash=False)
        self.session.open()
        #: every call made: (function, number of new tokens, number of positions)
        self.calls: list[tuple[str, int, int]] = []
        self.processed = 0
        self.history: list[int] = []

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.session.close()

    def fresh(self, shape: Sequence[int], dtype: str) -> np.ndarray:
        """Memory as the app gets it from an allocation: never zeroed."""
        np_dtype = numpy_dtype(dtype)
        if self.fresh_memory == "zeros":
            return np.zeros(shape, np_dtype)
        if self.fresh_memory == "nan":
            return np.full(shape, np.nan, np.float32).astype(np_dtype)
        return (self.rng.standard_normal(shape, np.float32) * NOISE_SCALE).astype(np_dtype)

    def _sample(self, logits: np.ndarray) -> int:
        """Greedy: argmax over the float16 logits (the first of equal maxima)."""
        return int(np.argmax(logits))

    def _max_tokens(self, prompt: Sequence[int], requested: int) -> int:
        return min(requested, max(0, self.language.max_context_length - len(prompt)))

    def _decode(
        self,
        tokens: list[int],
        max_new_tokens: int,
        on_logits: LogitsCallback | None,
        run: Callable[[list[int]], np.ndarray],
    ) -> list[int]:
        """The engines' iterator: ``run`` processes the tokens not processed yet and returns
        the logits of the last one; sample, record, stop on a stop token, feed it back."""
        out: list[int] = []
        for _ in range(self._max_tokens(tokens, max_new_tokens)):
            start = self.processed
            if start >= len(tokens):
                raise BundleError("no new tokens to process")
            logits = run(tokens)
            self.history.extend(tokens[start : self.processed])
            token = self._sample(logits)
            if on_logits is not None:
                on_logits(logits)
            out.append(token)
            if token in self.stop_token_ids:
                break
            tokens.append(token)
        return out


def _common_prefix(history: Sequence[int], tokens: Sequence[int]) -> int:
    count = 0
    for a, b in zip(history, tokens, strict=False):
        if a != b:
            break
        count += 1
    return count


def _grow_copy(source: np.ndarray, destination: np.ndarray, sequence_dim: int) -> None:
    """``GrowingNDArrayState.copyCache``: for each block of the dimensions before
    ``sequence_dim``, copy the first ``old_rows * last_dim`` elements (right only when the
    sequence dimension is the second-to-last)."""
    blocks = int(np.prod(source.shape[:sequence_dim], dtype=np.int64))
    count = source.shape[sequence_dim] * source.shape[-1]
    src = source.reshape(blocks, -1)
    dst = destination.reshape(blocks, -1)
    dst[:, :count] = src[:, :count]


# --------------------------------------------------------------------------- sequential ---


class SequentialEngine(_Engine):
    """``CoreAISequentialEngine`` (see the module docstring); ``generate`` returns the
    generated ids (ending with the stop token when one was produced)."""

    #: whether ``main``'s first input is the token embeddings (a vlm decoder) or the ids
    embeddings_input = False

    def __init__(self, bundle: Bundle | str | os.PathLike[str], **options: Any) -> None:
        super().__init__(bundle, **options)
        try:
            self.decoder = check_dynamic_decoder(
                self.bundle.required_signatures("main"),
                self.language,
                where=str(self.bundle.asset_path("main")),
                embeddings_input=self.embeddings_input,
            )
            self._allocate()
        except BaseException:
            self.close()
            raise

    def _allocate(self) -> None:
        function = self.decoder.function
        self.function = function.name
        self.ids_name, self.positions_name = (t.name for t in function.inputs)
        growing = [s for s in function.states if self.decoder.state_kinds[s.name] == "kv_cache"]
        #: growing states: the first one's dynamic dim, else its second-to-last
        first = growing[0]
        self.sequence_dim = first.dynamic_dims[0] if first.dynamic_dims else first.rank - 2
        self.growing = [s.name for s in growing]
        self.capacity = min(INITIAL_KV_CAPACITY, self.language.max_context_length)
        self.specs = {s.name: s for s in function.states}
        self.states: dict[str, Any] = {}
        for state in function.states:
            shape = [self.capacity if d is None else d for d in state.shape]
            if state.name in self.growing:
                values = self.fresh(shape, state.dtype)
            else:  # sliding / fixed: zero-filled
                values = np.zeros(shape, numpy_dtype(state.dtype))
            self.states[state.name] = _ndarray(values)
        self.non_truncatable = any(k == "fixed" for k in self.decoder.state_kinds.values())

    # -- the engine --------------------------------------------------------------------------

    def reset(self, to: int = 0) -> None:
        """``reset(to:)``: 0 zero-fills every state and clears the history; otherwise only the
        count of processed tokens moves back."""
        if to == 0:
            self.processed = 0
            self.history.clear()
            for name, array in self.states.items():
                self.states[name] = _ndarray(np.zeros_like(_numpy(array)))
        else:
            self.processed = to
            del self.history[to:]

    def _ensure_capacity(self, context: int) -> None:
        if context <= self.capacity:
            return
        limit = self.language.max_context_length
        if context > limit:
            raise BundleError(f"context length {context} exceeds the maximum {limit}")
        capacity = max(self.capacity, 1)
        while capacity < context:
            capacity = min(capacity * 2, limit)
        for name in self.growing:
            spec = self.specs[name]
            old = _numpy(self.states[name])
            shape = [capacity if d is None else d for d in spec.shape]
            new = self.fresh(shape, spec.dtype)
            _grow_copy(old, new, self.sequence_dim)
            self.states[name] = _ndarray(new)
        self.capacity = capacity

    def _batch(self, tokens: Sequence[int]) -> np.ndarray:
        """One call with ``tokens`` new: returns their logits ``[T, vocab]`` (float16)."""
        return self._call(np.asarray([tokens], np.int32))

    def _call(self, first: np.ndarray) -> np.ndarray:
        """One call of the decoder with its first input ``first`` (``[1, T, ...]``: the new
        tokens' ids, or embeddings); returns their logits ``[T, vocab]`` (float16)."""
        count = first.shape[1]
        self._ensure_capacity(self.processed + count)
        total = self.processed + count
        inputs = {
            self.ids_name: first,
            self.positions_name: np.arange(total, dtype=np.int32)[None, :],
        }
        out = self.session.run(inputs, entrypoint=self.function, state=self.states)
        logits = out[self.decoder.function.outputs[0].name]
        self.calls.append((self.function, count, total))
        self.processed = total
        return logits.reshape(count, self.language.vocab_size)

    def _prefill(self, tokens: Sequence[int]) -> np.ndarray:
        if len(tokens) > self.chunk_threshold:
            size = self.prefill_chunk_size
            for start in range(0, len(tokens), size):
                logits = self._batch(tokens[start : start + size])
        else:
            logits = self._batch(tokens)
        last: np.ndarray = logits[-1]
        return last

    def generate(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        on_logits: LogitsCallback | None = None,
    ) -> list[int]:
        """Greedy generation from ``prompt`` (the whole conversation so far, as the app passes
        it; tokens the history already holds are not processed again)."""
        tokens = [int(t) for t in prompt]
        if self.history:
            common = _common_prefix(self.history, tokens)
            if self.non_truncatable:
                if common < len(self.history) or self.processed >= len(tokens):
                    self.reset(0)
            elif common < len(tokens) and common < len(self.history):
                self.reset(0)
            elif self.processed >= len(tokens):
                self.reset(max(0, common - 1))
        return self._decode(
            tokens, max_new_tokens, on_logits, lambda t: self._prefill(t[self.processed :])
        )


# ---------------------------------------------------------------------------- pipelined ---


class PipelinedEngine(SequentialEngine):
    """``CoreAIPipelinedEngine`` (see the module docstring): the same graph calls as the
    sequential engine, split and grown as the pipelined engine does, with its warmup."""

    def _allocate(self) -> None:
        function = self.decoder.function
        self.function = function.name
        self.ids_name, self.positions_name = (t.name for t in function.inputs)
        kv = [s for s in function.states if self.decoder.state_kinds[s.name] == "kv_cache"]
        key, value = kv[0], kv[1]
        self.kv_pair = (key.name, value.name)
        self.specs = {s.name: s for s in function.states}
        self.sequence_dim = 3 if key.rank == 5 else 2  # KVCacheFactory.detectSequenceDim
        size = key.shape[self.sequence_dim]
        dynamic = size is None
        self.growing = [key.name, value.name] if dynamic else []
        self.capacity = INITIAL_KV_CAPACITY if dynamic else self.language.max_context_length
        self.max_capacity = 2**62 if size is None else size
        self.states = {}
        for state in function.states:
            if state.name in (key.name, value.name):
                shape = _sized(state.shape, self.capacity)
                shape[self.sequence_dim] = self.capacity
                values = self.fresh(shape, state.dtype)
            else:  # fixed, sliding and further growing states: max context, zero-filled
                shape = _sized(state.shape, self.language.max_context_length)
                values = np.zeros(shape, numpy_dtype(state.dtype))
            self.states[state.name] = _ndarray(values)
        self.non_truncatable = any(k == "fixed" for k in self.decoder.state_kinds.values())
        self._warmup()

    def _warmup(self) -> None:
        """``performWarmup(queryLength: 1)`` at load: token 1 at position 0, then ``reset()``
        (the position back to 0, fixed states zeroed, the KV cache left as it is)."""
        self._batch([1])
        self._soft_reset()

    def _soft_reset(self) -> None:
        """``reset()``: the position back to 0 and the states other than the KV pair zeroed."""
        self.processed = 0
        for name in self.specs:
            if name not in self.kv_pair:
                self.states[name] = _ndarray(np.zeros_like(_numpy(self.states[name])))

    def _ensure_capacity(self, context: int) -> None:
        if context <= self.capacity:
            return
        capacity = self.capacity
        while capacity < context:
            capacity *= 2
        capacity = min(capacity, self.max_capacity)
        if capacity < context:
            raise BundleError(f"context length {context} exceeds the KV capacity {capacity}")
        for name in self.growing:
            spec = self.specs[name]
            old = _numpy(self.states[name])
            shape = list(old.shape)
            shape[self.sequence_dim] = capacity
            new = self.fresh(shape, spec.dtype)
            index = tuple(slice(0, n) for n in old.shape)
            new[index] = old  # MPSNDArrayIdentity into the sliced destination
            self.states[name] = _ndarray(new)
        self.capacity = capacity

    def generate(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        on_logits: LogitsCallback | None = None,
    ) -> list[int]:
        tokens = [int(t) for t in prompt]
        common = _common_prefix(self.history, tokens)
        new = tokens[common:]
        diverged = common < len(tokens) and common < len(self.history)
        if not new and common > 0:
            common -= 1
            new = tokens[common:]
        if diverged:
            self._soft_reset()
            self.history.clear()
            new = tokens
        elif self.non_truncatable:
            if common < self.processed:
                self._soft_reset()
                self.history.clear()
                new = tokens
        elif common < self.processed:
            self.processed = common
            del self.history[common:]
        self.history.extend(new)
        return self._run_completion(new, max_new_tokens, on_logits)

    def _run_completion(
        self, prompt: list[int], max_tokens: int, on_logits: LogitsCallback | None
    ) -> list[int]:
        left = self.language.max_context_length - self.processed - len(prompt)
        if left < 1:
            raise BundleError(
                f"context length exceeded: {self.processed} processed + {len(prompt)} new, "
                f"maximum {self.language.max_context_length}"
            )
        total = min(max_tokens, left)
        self._ensure_capacity(
            min(self.processed + len(prompt) + total, self.language.max_context_length)
        )
        out: list[int] = []
        if not prompt:
            return out
        size = self.prefill_chunk_size
        rest = prompt
        if len(prompt) > self.chunk_threshold:
            while len(rest) > size:
                self._batch(rest[:size])
                rest = rest[size:]
        logits = self._batch(rest)[-1]
        while True:
            token = self._sample(logits)
            if on_logits is not None:
                on_logits(logits)
            out.append(token)
            self.history.append(token)
            if token in self.stop_token_ids or len(out) >= total:
                return out
            self._ensure_capacity(self.processed + 1)
            logits = self._batch([token])[-1]


# ------------------------------------------------------------------------- static shape ---


class StaticShapeEngine(_Engine):
    """``StaticShapeEngine`` (iOS, see the module docstring)."""

    def __init__(self, bundle: Bundle | str | os.PathLike[str], **options: Any) -> None:
        super().__init__(bundle, **options)
        try:
            self.signatures = self.bundle.required_signatures("main")
            self.family = check_static_shape(
                self.signatures, self.language, where=str(self.bundle.asset_path("main"))
            )
            self.embedding_table = self.session.run({}, entrypoint="load_embeddings")[
                "embedding_table"
            ]
            function = self.signatures[self.family.cache_function]
            self.caches = {
                name: self.fresh(_sized(spec.shape, self.language.max_context_length), spec.dtype)
                for name in STATIC_STATES
                for spec in [function.required_state(name)]
            }
        except BaseException:
            self.close()
            raise

    def reset(self, to: int = 0) -> None:
        """``reset(to:)``: the position moves back; the caches are not cleared."""
        self.processed = to
        del self.history[to:]

    def _graph(self, remaining: int, position: int, prefill: bool) -> str:
        pairs = self.family.pairs
        lengths = sorted({q for _, q in pairs})
        q = next((q for q in lengths if q >= remaining), lengths[-1])
        contexts = sorted(c for c, qq in pairs if qq == q and c > position)
        if not contexts:
            raise BundleError(f"no graph with cache length > {position} and query length {q}")
        return f"{'prompt_opt' if prefill else 'extend'}_{contexts[0]}_{q}"

    def _inference(self, tokens: list[int]) -> np.ndarray:
        total = len(tokens)
        logits = np.zeros(self.language.vocab_size, np.float16)
        position = self.processed
        while position < total:
            remaining = total - position
            prefill = remaining > self.family.max_query_length
            graph = self._graph(remaining, position, prefill)
            function = self.signatures[graph]
            transformer = next(t for t in function.inputs if "transformer_input" in t.name)
            batch = transformer.static_shape()[1]
            aligned = (position // batch) * batch
            end = min(aligned + batch - 1, total - 1)
            count = end - aligned + 1
            inputs = self._inputs(function, tokens[aligned : end + 1], batch, aligned, count)
            states = {}
            for name in STATIC_STATES:
                shape = function.required_state(name).shape
                index = tuple(slice(0, n) for n in shape)
                states[name] = _ndarray(self.caches[name][index])
            out = self.session.run(inputs, entrypoint=graph, state=states)
            for name in STATIC_STATES:
                shape = function.required_state(name).shape
                self.caches[name][tuple(slice(0, n) for n in shape)] = _numpy(states[name])
            self.calls.append((graph, count, aligned + count))
            if not prefill:
                rows = out[STATIC_LOGITS].reshape(-1, self.language.vocab_size)
                logits = rows[count - 1]
            position = end + 1
            self.processed = position
        return logits

    def _inputs(
        self, function: Any, tokens: list[int], batch: int, aligned: int, count: int
    ) -> dict[str, np.ndarray]:
        inputs: dict[str, np.ndarray] = {}
        names = [t.name for t in function.inputs]
        if "embedding_table" in names:
            inputs["embedding_table"] = self.embedding_table
        transformer = next(n for n in names if "transformer_input" in n)
        gather = f"{GATHER_PREFIX}{batch}"
        ids_spec = self.signatures[gather].required_input("in_new_token_ids")
        ids = self.rng.integers(0, self.language.vocab_size, ids_spec.static_shape())
        ids = ids.astype(np.int32)
        if self.fresh_memory == "zeros":
            ids[...] = 0
        flat = ids.reshape(-1)
        if ids_spec.rank == 2:
            flat[: min(batch, len(tokens))] = tokens[:batch]
        else:
            flat[0] = tokens[0]
        gathered = self.session.run(
            {"in_new_token_ids": ids, "embedding_table": self.embedding_table},
            entrypoint=gather,
        )
        inputs[transformer] = gathered.get(
            "out_transformer_input", gathered[self.signatures[gather].outputs[0].name]
        )
        pos = next(n for n in names if "pos" in n)
        inputs[pos] = (aligned + np.arange(batch, dtype=np.int64)).astype(np.uint16)[None, :]
        mask_spec = function.input("causal_mask")
        if mask_spec is not None:
            mask = np.full(mask_spec.shape, MASKED, np.float16)
            context = mask_spec.shape[1]
            for q in range(count):
                mask[0, : min(aligned + q, context - 1) + 1, 0, q] = 0
            inputs["causal_mask"] = mask
        step = next((n for n in names if "step" in n and "pos" not in n), None)
        if step is not None:
            inputs[step] = np.full(function.input(step).shape, aligned, np.int32)
        return inputs

    def generate(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        on_logits: LogitsCallback | None = None,
    ) -> list[int]:
        tokens = [int(t) for t in prompt]
        if self.history:
            common = _common_prefix(self.history, tokens)
            if common < len(tokens) and common < len(self.history):
                self.processed = 0
                self.history.clear()
            elif self.processed >= len(tokens):
                self.reset(max(0, common - 1))
        return self._decode(tokens, max_new_tokens, on_logits, self._inference)


def open_engine(
    bundle: Bundle | str | os.PathLike[str], variant: str = "auto", **options: Any
) -> Any:
    """The engine the app would create (``EngineFactory``): ``auto`` picks the static-shape
    engine for a static-shape asset and the pipelined engine otherwise; ``sequential``,
    ``pipelined`` and ``static`` ask for one (the sequential engine only on request, as in the
    app)."""
    bundle = bundle if isinstance(bundle, Bundle) else Bundle.load(bundle)
    if variant in ("auto", "default"):
        variant = "static" if bundle.structure == "chunked_static" else "pipelined"
    engines = {
        "sequential": SequentialEngine,
        "pipelined": PipelinedEngine,
        "static": StaticShapeEngine,
    }
    if variant not in engines:
        raise ValueError(f"variant must be auto, {', '.join(engines)}; got {variant!r}")
    return engines[variant](bundle, **options)


def _sized(shape: Sequence[int | None], size: int) -> list[int]:
    """``shape`` with its run-time dimensions given ``size``."""
    return [size if d is None else d for d in shape]
