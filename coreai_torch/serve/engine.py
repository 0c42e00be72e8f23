"""What the server runs: a :class:`~coreai_torch.llm.Generator` behind a
:class:`~coreai_torch.serve.queue.RequestQueue`, prompts made from chat messages with the
model's chat template, and the generated tokens turned into text as they come (stop strings
found across token boundaries, never half a UTF-8 character)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from coreai_torch.llm.generate import Generator, encode
from coreai_torch.llm.text import TextStream, chat_ids, eos_ids
from coreai_torch.serve.protocol import RequestError, Sampling
from coreai_torch.serve.queue import RequestQueue


@dataclass
class Generation:
    """One request's prompt and what came of it (filled in while it streams)."""

    prompt_ids: list[int]
    sampling: Sampling
    max_tokens: int
    completion_tokens: int = 0
    #: "stop" (end of sequence or a stop string) or "length" (max_tokens reached)
    finish_reason: str | None = None


class Engine:
    """The served model: ``name`` as the API calls it, its generator and tokenizer, and the
    request queue (``concurrency`` generations at once, ``max_queue`` waiting)."""

    def __init__(
        self,
        generator: Generator,
        name: str,
        *,
        concurrency: int = 4,
        max_queue: int = 16,
        max_tokens: int | None = None,
    ) -> None:
        if generator.max_context is None:
            raise ValueError(
                "the server checks each request against the model's context, which this "
                "generator does not know (a bare asset): load a bundle, or pass "
                "Generator(..., max_context=N)"
            )
        self.generator = generator
        #: the most positions a generation holds (the program's context)
        self.context: int = generator.max_context
        self.tokenizer = generator.tokenizer
        self.name = name
        self.queue = RequestQueue(concurrency, max_queue)
        #: the most tokens a request may ask for (default: the program's context)
        self.max_tokens_limit = max_tokens or self.context
        #: generations that ended early: a client gone, an error
        self.interrupted = 0

    def close(self) -> None:
        self.queue.close()
        self.generator.close()

    # -- prompts ------------------------------------------------------------------------------

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of ``messages`` formatted with the model's chat template."""
        template = getattr(self.tokenizer, "chat_template", None)
        if self.tokenizer is None or not template:
            raise RequestError(
                f"the model '{self.name}' has no chat template (its tokenizer has none); use "
                "/v1/completions with a prompt",
                param="messages",
                code="no_chat_template",
            )
        try:
            return chat_ids(self.tokenizer, messages)
        except Exception as error:  # a template may raise on roles it does not know
            raise RequestError(
                f"the chat template cannot format these messages: {error}", param="messages"
            ) from error

    def text_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if self.tokenizer is None:
            raise RequestError(
                f"the model '{self.name}' is served without a tokenizer; give the prompt as "
                "token ids",
                param="prompt",
            )
        return encode(self.tokenizer, prompt)

    def prepare(self, prompt_ids: list[int], sampling: Sampling) -> Generation:
        """Check the request against the program's context and the server's limits."""
        context = self.context
        room = context - len(prompt_ids) + 1
        if room < 1:
            raise RequestError(
                f"the prompt has {len(prompt_ids)} tokens; the model's context holds {context}",
                code="context_length_exceeded",
                param="messages",
            )
        if sampling.max_tokens is not None and sampling.max_tokens > self.max_tokens_limit:
            raise RequestError(
                f"max_tokens={sampling.max_tokens} exceeds this server's limit of "
                f"{self.max_tokens_limit}",
                param="max_tokens",
            )
        max_tokens = sampling.max_tokens or min(room, self.max_tokens_limit)
        if max_tokens > room:
            raise RequestError(
                f"the prompt has {len(prompt_ids)} tokens and max_tokens={max_tokens}: "
                f"{len(prompt_ids) + max_tokens - 1} positions, the model's context holds "
                f"{context}",
                code="context_length_exceeded",
                param="max_tokens",
            )
        bad = [t for t in prompt_ids if not 0 <= t < self.generator.vocab_size]
        if bad:
            raise RequestError(
                f"token id {bad[0]} is outside the model's vocabulary (0..."
                f"{self.generator.vocab_size - 1})",
                param="prompt",
            )
        return Generation(prompt_ids, sampling, max_tokens)

    # -- generating ---------------------------------------------------------------------------

    async def stream(self, generation: Generation) -> AsyncGenerator[str, None]:
        """The text of ``generation`` as it is produced, once a slot is free (raises
        :class:`~coreai_torch.serve.queue.QueueFull` at once if the queue is full).  Closing
        the iterator early (a client that disconnects) stops the generation and frees its
        cache."""
        sampling = generation.sampling
        async with self.queue.slot():
            tokens = self.generator.astream(
                generation.prompt_ids,
                max_new_tokens=generation.max_tokens,
                do_sample=sampling.temperature > 0,
                temperature=sampling.temperature or 1.0,
                top_p=sampling.top_p if sampling.top_p < 1 else None,
                seed=sampling.seed,
            )
            text = TextStream(self.tokenizer, self._stop_ids(), sampling.stop)
            ended = False
            try:
                async with contextlib.aclosing(tokens) as steps:
                    async for token in steps:
                        generation.completion_tokens += 1
                        piece = text.push(token)
                        if piece:
                            yield piece
                        if text.stopped:
                            break
                rest = text.finish()
                if rest:
                    yield rest
                generation.finish_reason = "stop" if text.stopped else "length"
                ended = True
            finally:
                if not ended:
                    self.interrupted += 1

    async def complete(self, generation: Generation) -> str:
        return "".join([piece async for piece in self.stream(generation)])

    def _stop_ids(self) -> set[int]:
        return eos_ids(self.tokenizer)
