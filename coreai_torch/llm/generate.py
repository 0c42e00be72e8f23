"""Text generation on the Core AI runtime with a program from :func:`coreai_torch.llm.export`
(or any program in the calling convention of Apple's app engines: a bundle, an asset, an
``AIProgram``), called as the app calls it (:mod:`coreai_torch.llm.decoder`)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from coreai_torch.ir.assets import check_asset
from coreai_torch.llm.decoder import FUNCTION_NAME
from coreai_torch.runtime import Session, numpy_dtype, to_ndarray, to_numpy

if TYPE_CHECKING:
    import torch


@dataclass
class GenerationStats:
    """Token counts and wall-clock times of the last :meth:`Generator.generate` call."""

    prompt_tokens: int = 0
    prefill_seconds: float = 0.0
    #: tokens produced (the first comes from the prefill, each later one from a decode step)
    generated_tokens: int = 0
    decode_steps: int = 0
    decode_seconds: float = 0.0

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_steps / self.decode_seconds if self.decode_seconds else 0.0

    def __str__(self) -> str:
        return (
            f"prefill: {self.prompt_tokens} tokens in {self.prefill_seconds:.3f} s "
            f"({self.prefill_tokens_per_second:.1f} tokens/s); decode: {self.decode_steps} "
            f"tokens in {self.decode_seconds:.3f} s ({self.decode_tokens_per_second:.1f} tokens/s)"
        )


class Generator:
    """Generates tokens with an exported LLM: a bundle directory (``llm.export(...,
    bundle=...)``, ``CoreAIModelForCausalLM.save_pretrained``, Apple's exports), a saved
    ``.aimodel`` or an ``AIProgram`` whose function ``main`` follows the app engines' calling
    convention (int32 ``input_ids [1, T]`` and ``position_ids [1, P]`` in, float16 logits
    ``[1, T, vocab]`` out, two KV-cache states that grow).

    ``tokenizer`` (optional) turns text prompts into token ids: a ``transformers`` tokenizer,
    a ``tokenizers.Tokenizer``, or the path of a directory to load one from; a bundle's own
    ``tokenizer/`` by default.  ``max_context``: the most positions a generation may hold (a
    bundle's ``max_context_length`` by default; a bare asset or program does not record it,
    and is then not limited).  A saved asset is checked before it is loaded (files complete,
    bytecode matching ``main.hash``; ``verify_hash=False`` skips the hash, see
    :class:`coreai_torch.runtime.Session`).  Use as a context manager (or call :meth:`close`)
    to release the runtime.
    """

    def __init__(
        self,
        program_or_path: Any,
        tokenizer: Any = None,
        *,
        max_context: int | None = None,
        verify_hash: bool = True,
    ) -> None:
        from coreai_torch.bundles import Bundle, is_bundle_dir

        program, bundle = program_or_path, None
        if isinstance(program_or_path, (str, os.PathLike)):
            path = Path(program_or_path)
            if is_bundle_dir(path):
                bundle = Bundle.load(path)
                program = bundle.asset_path("main")
            check_asset(program, verify_hash=False)  # cheap checks first
        #: the bundle the generator was loaded from (None for an asset or a program)
        self.bundle = bundle
        self._check_program(program, bundle, max_context)
        if tokenizer is None and bundle is not None:
            tokenizer = bundle.tokenizer_dir
        self.tokenizer = load_tokenizer(tokenizer)
        self.session = Session(program, verify_hash=verify_hash)
        self.session.open()
        #: what the generation started last did (with concurrent generations: the last one
        #: started)
        self.stats = GenerationStats()
        self._active = 0
        self._count_lock = threading.Lock()

    def _check_program(self, program: Any, bundle: Any, max_context: int | None) -> None:
        from coreai_torch.bundles import LanguageConfig, check_dynamic_decoder, function_signatures

        if bundle is not None:
            if bundle.kind == "vlm":
                raise ValueError(
                    f"{bundle.path} is a vision-language bundle (its decoder takes embeddings); "
                    "run it with coreai_torch.hf.CoreAIModelForImageTextToText or "
                    "coreai_torch.bundles.VisionLanguageEngine"
                )
            if bundle.structure == "chunked_static":
                raise ValueError(
                    f"{bundle.path} holds the static-shape functions of the iOS engine "
                    "(extend_<ctx>_<Q>, ...); a Generator calls the function 'main' of the "
                    "dynamic engines. Run it with coreai_torch.bundles.StaticShapeEngine, or "
                    "export with engine='dynamic'"
                )
            language = bundle.language
            if max_context is None:
                max_context = language.max_context_length
        signatures = function_signatures(program)
        if {"prefill", "decode"} <= set(signatures):
            raise ValueError(
                "this program was exported in the earlier prefill/decode format (int64 ids and "
                "a start position), which Generator no longer runs; export the model again "
                "with coreai_torch.llm.export(model_dir, bundle='out/MyModel') (or "
                "`coreai-torch llm export MODEL_DIR -o out/MyModel`) and load the bundle"
            )
        name = bundle.language.main_function if bundle is not None else FUNCTION_NAME
        function = signatures.get(name)
        if function is None or not function.outputs:
            raise ValueError(
                f"the program's functions are {sorted(signatures)}; a Generator calls "
                f"'{name}' (a program from coreai_torch.llm.export)"
            )
        vocab = function.outputs[0].shape[-1]
        if bundle is None:  # the engines' rules, with what the program itself says
            language = LanguageConfig(
                tokenizer="model",
                vocab_size=vocab if isinstance(vocab, int) else 0,
                max_context_length=max_context or 2**31 - 1,
            )
        decoder = check_dynamic_decoder(signatures, language, where="the program")
        self._function = decoder.function
        #: token ids the program takes: the width of its logits
        self.vocab_size = int(language.vocab_size)
        #: the most positions one generation may hold (None: not known, not limited)
        self.max_context = max_context

    @property
    def state_bytes(self) -> int | None:
        """Bytes of the KV-cache states of a generation of :attr:`max_context` positions
        (None when the context is not known)."""
        if self.max_context is None:
            return None
        return self.max_context * self.bytes_per_position

    @property
    def bytes_per_position(self) -> int:
        """Bytes the KV-cache states take per position (every layer's key and value)."""
        total = 0
        for state in self._function.states:
            elements = np.prod([d for d in state.shape if d is not None])
            total += int(elements) * numpy_dtype(state.dtype).itemsize
        return total

    def __enter__(self) -> Generator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.session.close()

    @property
    def active_generations(self) -> int:
        """Generations in progress, each holding its own KV-cache state (0 when idle)."""
        return self._active

    def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 32,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        seed: int | None = None,
        *,
        on_logits: Callable[[np.ndarray], None] | None = None,
    ) -> Iterator[int]:
        """Yield up to ``max_new_tokens`` new token ids, each as soon as it is produced.

        ``prompt`` is a list of token ids, or text when the generator has a tokenizer.  Greedy
        unless ``do_sample``; sampling divides the logits by ``temperature``, keeps the
        ``top_k`` most likely tokens and the smallest set whose probability reaches ``top_p``,
        drawing with a generator seeded by ``seed``.  Generation stops after a token of
        ``eos_token_id`` (default: the tokenizer's end-of-sequence token, if any).  Every
        prompt starts from an empty cache.  ``on_logits`` receives each step's logits
        (``[vocab]`` float32) before its token is chosen.  :attr:`stats` reports the speeds.

        Bad arguments (an empty prompt, a context longer than the program's ``max_context``,
        ...) raise before anything runs.  Each call has its own KV cache, so calls from several
        threads (or interleaved iterators) run side by side and each returns what it would
        alone; :meth:`astream` is the same generation for async code.
        """
        decoding = self._start(
            prompt,
            max_new_tokens,
            do_sample,
            temperature,
            top_k,
            top_p,
            eos_token_id,
            seed,
            on_logits,
        )
        return self._iterate(decoding)

    def astream(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 32,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        seed: int | None = None,
        *,
        on_logits: Callable[[np.ndarray], None] | None = None,
    ) -> AsyncGenerator[int, None]:
        """:meth:`generate` for async code: ``async for token in generator.astream(prompt)``.

        The runtime works on its own thread while the caller's event loop keeps running.
        Stopping the iteration early (``break``, ``aclose()``, a cancelled task -- a client
        that disconnects) ends the generation after the step in flight and frees its state.
        Arguments are checked when this is called, before anything runs.
        """
        decoding = self._start(
            prompt,
            max_new_tokens,
            do_sample,
            temperature,
            top_k,
            top_p,
            eos_token_id,
            seed,
            on_logits,
        )
        return self._aiterate(decoding)

    def _start(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int,
        do_sample: bool,
        temperature: float,
        top_k: int | None,
        top_p: float | None,
        eos_token_id: int | Sequence[int] | None,
        seed: int | None,
        on_logits: Callable[[np.ndarray], None] | None,
    ) -> _Decoding:
        """Check the arguments; the generation they describe (nothing run yet)."""
        ids = self._prompt_ids(prompt)
        _check_sampling(max_new_tokens, temperature, top_k, top_p)
        needed = len(ids) + max_new_tokens - 1
        if self.max_context is not None and needed > self.max_context:
            raise ValueError(
                f"a prompt of {len(ids)} tokens plus max_new_tokens={max_new_tokens} needs a "
                f"context of {needed} positions; the program holds max_context="
                f"{self.max_context} (export with a larger max_context, or shorten the prompt)"
            )
        stop = _eos_ids(eos_token_id, self.tokenizer, self._default_stop())
        _check_token_ids(sorted(stop), self.vocab_size, "eos_token_id", positions=False)
        rng = np.random.default_rng(seed)

        def pick(logits: np.ndarray, step: int) -> int:
            if on_logits is not None:
                on_logits(logits)
            _check_logits(logits, step, len(ids))
            token = (
                int(np.argmax(logits))
                if not do_sample
                else sample(logits, rng, temperature, top_k, top_p)
            )
            _check_token_ids([token], self.vocab_size, f"the token generated at step {step}")
            return token

        return _Decoding(ids, max_new_tokens, pick, stop)

    def _default_stop(self) -> set[int] | None:
        """The tokens a bundle's app stops on (its tokenizer's stop set), if any."""
        if self.bundle is None or self.bundle.tokenizer_dir is None:
            return None
        return set(self.bundle.tokenizer.stop_token_ids)

    def _iterate(self, decoding: _Decoding) -> Iterator[int]:
        with self._holding_state(decoding) as states:
            self.stats = decoding.stats
            while (step := decoding.next_step()) is not None:
                start = time.perf_counter()
                outputs = self.session.run(
                    self._step_inputs(step),
                    entrypoint=self._function.name,
                    state=states,
                    keep_state=False,
                )
                yield decoding.take(self._step_logits(outputs), time.perf_counter() - start)

    async def _aiterate(self, decoding: _Decoding) -> AsyncGenerator[int, None]:
        with self._holding_state(decoding) as states:
            self.stats = decoding.stats
            while (step := decoding.next_step()) is not None:
                start = time.perf_counter()
                outputs = await self.session.arun(
                    self._step_inputs(step),
                    entrypoint=self._function.name,
                    state=states,
                    keep_state=False,
                )
                yield decoding.take(self._step_logits(outputs), time.perf_counter() - start)

    @contextlib.contextmanager
    def _holding_state(self, decoding: _Decoding) -> Iterator[dict[str, Any]]:
        """The KV cache of one generation, with room for all its positions (zeroed), counted
        in :attr:`active_generations` until the generation ends (released by the garbage
        collector once nothing refers to it)."""
        states = self.new_states(len(decoding.ids) + decoding.max_new_tokens)
        with self._count_lock:
            self._active += 1
        try:
            yield states
        finally:
            with self._count_lock:
                self._active -= 1

    def new_states(self, positions: int) -> dict[str, Any]:
        """Zeroed runtime buffers for the states of a generation of ``positions`` positions."""
        return new_states(self._function, positions)

    # -- the program's calling convention: one step -------------------------------------------

    def _step_inputs(self, step: _Step) -> dict[str, np.ndarray]:
        """The inputs of one call of ``main``, by position as the app passes them: the new
        token ids ``[1, T]`` and every position so far ``[1, P]`` (int32)."""
        ids, positions = (spec.name for spec in self._function.inputs)
        return {
            ids: np.asarray([step.ids], np.int32),
            positions: np.arange(step.start + len(step.ids), dtype=np.int32)[None],
        }

    def _step_logits(self, outputs: dict[str, np.ndarray]) -> np.ndarray:
        """The next token's logits (``[vocab]``, float32) of one step's outputs (the last row
        of the float16 logits)."""
        logits: np.ndarray = outputs[self._function.outputs[0].name][0, -1].astype(np.float32)
        return logits

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "a text prompt needs a tokenizer: Generator(program, tokenizer=...); or "
                    "pass the prompt as a list of token ids"
                )
            ids = encode(self.tokenizer, prompt)
        else:
            ids = _token_list(prompt)
        if not ids:
            raise ValueError("the prompt is empty (0 tokens); give at least one token")
        _check_token_ids(ids, self.vocab_size, "the prompt")
        return ids


@dataclass
class _Step:
    """One call of ``main``: ``ids`` fed at positions ``start .. start + len(ids) - 1``."""

    ids: list[int]
    start: int


class _Decoding:
    """Where one generation is: the next step to run, the tokens chosen, the stop rules and
    the stats (the loop over steps is the caller's, sync or async)."""

    def __init__(
        self,
        ids: list[int],
        max_new_tokens: int,
        pick: Callable[[np.ndarray, int], int],
        stop: set[int],
    ) -> None:
        self.ids = ids
        self.max_new_tokens = max_new_tokens
        self.pick = pick
        self.stop = stop
        self.stats = GenerationStats(prompt_tokens=len(ids))
        self.token: int | None = None
        self.produced = 0

    def next_step(self) -> _Step | None:
        """The next call to make, or None when the generation is over."""
        if self.token is None:
            return _Step(self.ids, 0)
        if self.produced >= self.max_new_tokens or self.token in self.stop:
            return None
        return _Step([self.token], len(self.ids) + self.produced - 1)

    def take(self, logits: np.ndarray, seconds: float) -> int:
        """Choose the token of a step's ``logits`` (the step took ``seconds``)."""
        stats = self.stats
        if self.token is None:
            stats.prefill_seconds = seconds
        else:
            stats.decode_seconds += seconds
            stats.decode_steps += 1
        self.token = self.pick(logits, self.produced)
        self.produced += 1
        stats.generated_tokens = self.produced
        return self.token


# ------------------------------------------------------------------------------- states ---


def new_states(function: Any, positions: int) -> dict[str, Any]:
    """Zeroed runtime buffers for the states of ``function`` (a
    :class:`~coreai_torch.bundles.FunctionSignature` of ``main``) with room for ``positions``
    positions (their dimension of run-time size)."""
    return {
        state.name: to_ndarray(
            np.zeros([positions if d is None else d for d in state.shape], numpy_dtype(state.dtype))
        )
        for state in function.states
    }


def ensure_room(states: dict[str, Any], function: Any, positions: int) -> None:
    """Grow ``states`` (``name -> NDArray``, replaced in the dict) to hold ``positions``
    positions if they hold fewer: as the app does, the capacity doubles and the rows held are
    copied."""
    for state in function.states:
        for dim in state.dynamic_dims:  # the sequence dim (second-to-last) of a KV cache
            old = to_numpy(states[state.name])
            held = old.shape[dim]
            if held >= positions:
                continue
            capacity = max(held, 1)
            while capacity < positions:
                capacity *= 2
            shape = list(old.shape)
            shape[dim] = capacity
            grown = np.zeros(shape, old.dtype)
            grown[(slice(None),) * dim + (slice(0, held),)] = old
            states[state.name] = to_ndarray(grown)


# -------------------------------------------------------------------------------- helpers ---


def sample(
    logits: np.ndarray,
    rng: np.random.Generator,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> int:
    """Draw a token from ``softmax(logits / temperature)`` restricted to the ``top_k`` most
    likely tokens and to the smallest set whose probability reaches ``top_p``."""
    scores = logits.astype(np.float64) / temperature
    if top_k is not None and top_k < scores.size:
        kth = np.partition(scores, -top_k)[-top_k]
        scores = np.where(scores < kth, -np.inf, scores)
    if top_p is not None and top_p < 1.0:
        order = np.argsort(-scores, kind="stable")
        probs = _softmax(scores[order])
        # keep a token while the tokens more likely than it do not reach top_p yet
        drop = order[(np.cumsum(probs) - probs) >= top_p]
        scores[drop] = -np.inf
    return int(rng.choice(scores.size, p=_softmax(scores)))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - np.max(x))
    probabilities: np.ndarray = e / e.sum()
    return probabilities


def _check_sampling(
    max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None
) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise TypeError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be an int >= 1 (or None), got {top_k!r}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (or None), got {top_p!r}")


def _token_list(prompt: Any, what: str = "prompt") -> list[int]:
    """Token ids as Python ints; a ``TypeError`` naming the first non-integer."""
    if isinstance(prompt, (bytes, bytearray)) or not hasattr(prompt, "__iter__"):
        kind = "text or a sequence of int token ids" if what == "prompt" else "int token ids"
        raise TypeError(f"{what} must be {kind}, got {type(prompt).__name__}")
    if isinstance(prompt, np.ndarray | _torch_tensor_type()):
        prompt = prompt.tolist()
        if not isinstance(prompt, list):  # a 0-d array
            prompt = [prompt]
    ids = []
    for position, value in enumerate(prompt):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(
                f"{what} token ids must be ints; the id at position {position} is {value!r} "
                f"({type(value).__name__})"
            )
        ids.append(int(value))
    return ids


def _torch_tensor_type() -> type[torch.Tensor]:
    import torch

    return torch.Tensor


def _check_token_ids(
    ids: Sequence[int], vocab_size: int, what: str, *, positions: bool = True
) -> None:
    """``ValueError`` naming the first id outside ``[0, vocab_size)`` and its position."""
    for position, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            where = f" at position {position}" if positions and len(ids) > 1 else ""
            kind = "negative" if token < 0 else f">= the vocabulary size {vocab_size}"
            raise ValueError(
                f"{what} holds token id {token}{where}, which is {kind}: the program's "
                f"vocabulary has ids 0..{vocab_size - 1} (is the tokenizer the model's own?)"
            )


def _check_logits(logits: np.ndarray, step: int, prompt_tokens: int) -> None:
    """A ``ValueError`` for logits with NaN or +inf (no token can be chosen from them)."""
    bad = ~np.isfinite(logits) & ~np.isneginf(logits)
    if not bad.any() and not np.isneginf(logits).all():
        return
    where = "after the prompt" if step == 0 else f"at decode step {step}"
    count = int(bad.sum()) if bad.any() else logits.size
    kind = "NaN or +inf" if bad.any() else "-inf"
    raise ValueError(
        f"the program's logits {where} (position {prompt_tokens + step - 1}) hold {count} "
        f"{kind} values of {logits.size}: no token can be chosen. A half-precision program "
        "may overflow: check it with coreai_torch.verify.verify(model, args, precision='fp16') "
        "(or 'bf16') or export in float32"
    )


def _eos_ids(
    eos_token_id: int | Sequence[int] | None, tokenizer: Any, default: set[int] | None = None
) -> set[int]:
    """The ids generation stops after: ``eos_token_id``, else ``default`` (a bundle's stop
    set), else the tokenizer's end-of-sequence token."""
    if eos_token_id is None and default:
        return set(default)
    if eos_token_id is None:
        eos_token_id = getattr(tokenizer, "eos_token_id", None)
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, (int, np.integer)) and not isinstance(eos_token_id, bool):
        return {int(eos_token_id)}
    return set(_token_list(eos_token_id, "eos_token_id"))


def load_tokenizer(tokenizer: Any) -> Any:
    """A tokenizer object as given, or one loaded from a local directory (never downloaded)."""
    if not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    path = Path(tokenizer)
    if not path.is_dir():
        raise FileNotFoundError(
            f"{path}: no such tokenizer directory (a directory written by save_pretrained)"
        )
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` (``transformers`` tokenizers and ``tokenizers.Tokenizer``)."""
    ids = tokenizer.encode(text)
    return list(getattr(ids, "ids", ids))


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    """Text of ``ids`` (``transformers`` tokenizers and ``tokenizers.Tokenizer``)."""
    text: str = tokenizer.decode(list(ids))
    return text
