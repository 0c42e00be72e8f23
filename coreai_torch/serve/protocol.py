"""The OpenAI API's request and response bodies, as far as the server speaks them: the request
fields checked (a :class:`RequestError` naming the field, answered in OpenAI's error format),
the responses and the streamed chunks built."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

#: fields that change what is generated in ways the server does not do (refused, not ignored)
UNSUPPORTED = {
    "logprobs": "log probabilities",
    "top_logprobs": "log probabilities",
    "tools": "tool calls",
    "functions": "function calls",
    "best_of": "best_of",
    "echo": "echo",
    "suffix": "suffix",
    "logit_bias": "logit_bias",
    "response_format": "structured output (response_format)",
}


class RequestError(Exception):
    """A request the server refuses: HTTP ``status`` and an OpenAI-style error body."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict[str, Any]:
        return error_body(str(self), kind=self.kind, param=self.param, code=self.code)


def error_body(
    message: str, *, kind: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class Sampling:
    """What to generate: ``max_tokens`` (None: what the context leaves, up to the server's
    limit), greedy when ``temperature`` is 0, ``stop`` strings."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False


@dataclass
class ChatRequest:
    model: str
    messages: list[dict[str, str]]
    sampling: Sampling


@dataclass
class CompletionRequest:
    model: str
    #: text, or token ids
    prompt: str | list[int]
    sampling: Sampling


def parse_chat(body: Any) -> ChatRequest:
    body = _object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of messages", param="messages")
    parsed = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(f"{where} must be an object with a 'role'", param=where)
        parsed.append({"role": message["role"], "content": _content(message.get("content"), where)})
    return ChatRequest(
        _model(body),
        parsed,
        _sampling(body, max_tokens_keys=("max_tokens", "max_completion_tokens")),
    )


def parse_completion(body: Any) -> CompletionRequest:
    body = _object(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise RequestError(
                "'prompt' must be a string or a non-empty list of token ids (one prompt per "
                "request)",
                param="prompt",
            )
    elif not isinstance(prompt, str) or not prompt:
        raise RequestError("'prompt' must be a non-empty string", param="prompt")
    return CompletionRequest(_model(body), prompt, _sampling(body, max_tokens_keys=("max_tokens",)))


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    for name, what in UNSUPPORTED.items():
        if body.get(name) not in (None, False, 0, [], {}, ""):
            raise RequestError(f"'{name}': {what} is not supported by this server", param=name)
    n = body.get("n", 1)
    if n != 1:
        raise RequestError(f"'n' must be 1 (one choice per request), got {n!r}", param="n")
    return body


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("'model' must name the served model (GET /v1/models)", param="model")
    return model


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise RequestError(
                    f"{where}.content: only text parts are supported", param=f"{where}.content"
                )
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    if content is None:
        return ""
    raise RequestError(f"{where}.content must be a string or a list of text parts", param=where)


def _sampling(body: dict[str, Any], max_tokens_keys: tuple[str, ...]) -> Sampling:
    sampling = Sampling()
    for key in max_tokens_keys:
        value = body.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RequestError(f"'{key}' must be an integer >= 1, got {value!r}", param=key)
            sampling.max_tokens = value
    sampling.temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    sampling.top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if sampling.top_p == 0:
        raise RequestError("'top_p' must be > 0", param="top_p")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError(f"'seed' must be an integer, got {seed!r}", param="seed")
    sampling.seed = seed
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (
        not isinstance(stop, list)
        or len(stop) > 4
        or not all(isinstance(s, str) and s for s in stop)
    ):
        raise RequestError("'stop' must be a string or a list of up to 4 strings", param="stop")
    sampling.stop = list(stop or [])
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("'stream' must be true or false", param="stream")
    sampling.stream = stream
    options = body.get("stream_options") or {}
    sampling.include_usage = bool(isinstance(options, dict) and options.get("include_usage"))
    return sampling


def _number(body: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise RequestError(
            f"'{key}' must be a number in [{low:g}, {high:g}], got {value!r}", param=key
        )
    return float(value)


# ------------------------------------------------------------------------------ responses ---


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _envelope(
    rid: str, model: str, kind: str, choices: list[dict[str, Any]], **extra: Any
) -> dict[str, Any]:
    """What every response and chunk carries around its choices."""
    return {
        "id": rid,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        **extra,
    }


def chat_response(
    rid: str, model: str, text: str, finish: str, prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    message = {"role": "assistant", "content": text}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
    return _envelope(
        rid, model, "chat.completion", [choice], usage=usage(prompt_tokens, completion_tokens)
    )


def completion_response(
    rid: str, model: str, text: str, finish: str, prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return _envelope(
        rid, model, "text_completion", [choice], usage=usage(prompt_tokens, completion_tokens)
    )


def chat_chunk(rid: str, model: str, delta: dict[str, str], finish: str | None) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return _envelope(rid, model, "chat.completion.chunk", [choice])


def completion_chunk(rid: str, model: str, text: str, finish: str | None) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return _envelope(rid, model, "text_completion", [choice])


def usage_chunk(rid: str, model: str, kind: str, prompt: int, completion: int) -> dict[str, Any]:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices."""
    return _envelope(rid, model, kind, [], usage=usage(prompt, completion))
