"""Text around generation: prompts formatted with a tokenizer's chat template, and generated
token ids turned into text as they come (what ``coreai-torch llm generate --chat`` and
``coreai-torch serve`` show)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from coreai_torch.llm.generate import decode


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` formatted with the tokenizer's chat template, ready for the
    assistant's reply; ``ValueError`` if the tokenizer has no template."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the tokenizer has no chat template (chat_template in tokenizer_config.json or "
            "chat_template.jinja)"
        )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def eos_ids(tokenizer: Any) -> set[int]:
    """The tokenizer's end-of-sequence token id(s)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(t) for t in eos}


class TextStream:
    """Generated token ids -> text pieces: a token of ``stop_ids`` ends the text (not shown);
    text that might be the start of a stop string is held back until it is known not to be;
    a trailing partial UTF-8 character waits for the next token."""

    def __init__(self, tokenizer: Any, stop_ids: set[int], stops: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop_ids = stop_ids
        self.stops = list(stops)
        self.tokens: list[int] = []
        self.decoded = ""  # text of self.tokens, as far as it is complete
        self.sent = 0  # characters of the visible text given out
        self.stopped = False

    def push(self, token: int) -> str:
        if self.stopped:
            return ""
        if token in self.stop_ids:
            self.stopped = True
            return self._release(len(self.decoded))
        self.tokens.append(token)
        if self.tokenizer is None:
            self.decoded += f"{token} "
        else:
            text = decode(self.tokenizer, self.tokens)
            if text.endswith("\ufffd"):  # half a character: wait for the rest
                return ""
            self.decoded = text
        for stop in self.stops:
            at = self.decoded.find(stop)
            if at != -1:
                self.stopped = True
                self.decoded = self.decoded[:at]
                return self._release(at)
        return self._release(len(self.decoded) - self._held_back())

    def finish(self) -> str:
        """What is left once the generation ended (text held back for a stop string that did
        not come)."""
        if self.tokenizer is not None and not self.stopped:
            self.decoded = decode(self.tokenizer, self.tokens)
        return self._release(len(self.decoded))

    def _held_back(self) -> int:
        """Characters at the end of the text that could begin a stop string."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(self.decoded)), longest, -1):
                if self.decoded.endswith(stop[:size]):
                    longest = size
                    break
        return longest

    def _release(self, end: int) -> str:
        if end <= self.sent:
            return ""
        piece, self.sent = self.decoded[self.sent : end], end
        return piece
