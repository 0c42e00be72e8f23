"""Text generation with a program from :func:`coreai_torch.llm.export` on the Core AI runtime."""

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
from coreai_torch.llm.export import INPUT_NAMES, OUTPUT_NAME
from coreai_torch.runtime import Session, numpy_dtype

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
    """Generates tokens with an exported LLM (an ``AIProgram`` or a saved ``.aimodel``).

    ``tokenizer`` (optional) turns text prompts into token ids: a ``transformers`` tokenizer,
    a ``tokenizers.Tokenizer``, or the path of a directory to load one from.  A saved asset is
    checked before it is loaded (files complete, bytecode matching ``main.hash``;
    ``verify_hash=False`` skips the hash, see :class:`coreai_torch.runtime.Session`).  Use as a
    context manager (or call :meth:`close`) to release the runtime.
    """

    def __init__(
        self, program_or_asset_path: Any, tokenizer: Any = None, *, verify_hash: bool = True
    ) -> None:
        if isinstance(program_or_asset_path, (str, os.PathLike)):
            check_asset(program_or_asset_path, verify_hash=False)  # cheap checks first
        self.tokenizer = load_tokenizer(tokenizer)
        self.session = Session(program_or_asset_path, verify_hash=verify_hash)
        self.session.open()
        try:
            self._check_program()
        except Exception:
            self.session.close()
            raise
        #: what the generation started last did (with concurrent generations: the last one
        #: started)
        self.stats = GenerationStats()
        self._active = 0
        self._count_lock = threading.Lock()

    def _check_program(self) -> None:
        names = list(getattr(self.session.model, "function_names", None) or [])
        if not {"prefill", "decode"} <= set(names):
            raise ValueError(
                f"the program's entry points are {names}; a Generator needs 'prefill' and "
                "'decode' (a program from coreai_torch.llm.export)"
            )
        desc = self.session.descriptor("decode")
        if list(desc.input_names) != list(INPUT_NAMES) or OUTPUT_NAME not in desc.output_names:
            raise ValueError(
                f"'decode' takes {list(desc.input_names)} and returns {list(desc.output_names)}; "
                f"a Generator needs inputs {list(INPUT_NAMES)} and output '{OUTPUT_NAME}' "
                "(a program from coreai_torch.llm.export)"
            )
        self._states = {name: desc.state_descriptor(name) for name in desc.state_names}
        #: token ids the program takes: the width of its logits
        self.vocab_size = int(list(desc.output_descriptor(OUTPUT_NAME).shape)[-1])
        #: cache positions the program holds
        self.max_context = int(next(iter(self._states.values())).shape[2])

    @property
    def state_bytes(self) -> int:
        """Bytes of the KV-cache state one generation uses."""
        return sum(
            int(np.prod(list(desc.shape))) * numpy_dtype(desc.dtype).itemsize
            for desc in self._states.values()
        )

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
        if needed > self.max_context:
            raise ValueError(
                f"a prompt of {len(ids)} tokens plus max_new_tokens={max_new_tokens} needs a "
                f"context of {needed} positions; the program holds max_context="
                f"{self.max_context} (export with a larger max_context, or shorten the prompt)"
            )
        stop = _eos_ids(eos_token_id, self.tokenizer)
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

    def _iterate(self, decoding: _Decoding) -> Iterator[int]:
        with self._holding_state() as states:
            self.stats = decoding.stats
            while (step := decoding.next_step()) is not None:
                start = time.perf_counter()
                outputs = self.session.run(
                    self._step_inputs(step),
                    entrypoint=step.entrypoint,
                    state=states,
                    keep_state=False,
                )
                yield decoding.take(self._step_logits(outputs), time.perf_counter() - start)

    async def _aiterate(self, decoding: _Decoding) -> AsyncGenerator[int, None]:
        with self._holding_state() as states:
            self.stats = decoding.stats
            while (step := decoding.next_step()) is not None:
                start = time.perf_counter()
                outputs = await self.session.arun(
                    self._step_inputs(step),
                    entrypoint=step.entrypoint,
                    state=states,
                    keep_state=False,
                )
                yield decoding.take(self._step_logits(outputs), time.perf_counter() - start)

    @contextlib.contextmanager
    def _holding_state(self) -> Iterator[dict[str, Any]]:
        """A zeroed KV cache for one generation, counted in :attr:`active_generations` until
        the generation ends (released by the garbage collector once nothing refers to it)."""
        states = self.session.zero_states("decode")
        with self._count_lock:
            self._active += 1
        try:
            yield states
        finally:
            with self._count_lock:
                self._active -= 1

    # -- the program's calling convention: one step -------------------------------------------

    @staticmethod
    def _step_inputs(step: _Step) -> dict[str, np.ndarray]:
        """The inputs of one call of ``prefill`` / ``decode`` (a batch of one)."""
        return {
            INPUT_NAMES[0]: np.asarray([step.ids], np.int64),
            INPUT_NAMES[1]: np.asarray([step.start], np.int64),
        }

    @staticmethod
    def _step_logits(outputs: dict[str, np.ndarray]) -> np.ndarray:
        """The next token's logits (``[vocab]``) of one step's outputs."""
        logits: np.ndarray = outputs[OUTPUT_NAME][0, -1]
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
    """One call of the program: ``entrypoint`` fed ``ids`` at cache position ``start``."""

    entrypoint: str
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
            return _Step("prefill", self.ids, 0)
        if self.produced >= self.max_new_tokens or self.token in self.stop:
            return None
        return _Step("decode", [self.token], len(self.ids) + self.produced - 1)

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


def _eos_ids(eos_token_id: int | Sequence[int] | None, tokenizer: Any) -> set[int]:
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
