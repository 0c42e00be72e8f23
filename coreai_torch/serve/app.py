"""The OpenAI-compatible HTTP API, as a Starlette (ASGI) application, and running it with
uvicorn.

    GET  /v1/models              the served model
    POST /v1/chat/completions    messages -> the model's chat template -> generated text
    POST /v1/completions         a prompt (text or token ids) -> generated text
    GET  /health                 status, generations running and waiting, states held

Both generation routes stream with server-sent events when ``"stream": true``.  The event
loop never waits for the runtime: generation steps run on the runtime's own thread
(:mod:`coreai_torch.runtime.loop`).  Errors are OpenAI error objects: 400 for a bad request
(malformed JSON, a field out of range, a prompt longer than the context), 401 without the
API key when one is set, 404 for another model's name, 413 for a body over the size limit,
429 with ``Retry-After`` when the queue is full, 503 with ``Retry-After`` while shutting down.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from coreai_torch.serve import protocol
from coreai_torch.serve.engine import Engine, Generation
from coreai_torch.serve.protocol import RequestError, error_body
from coreai_torch.serve.queue import QueueFull, ShuttingDown

#: seconds a client is told to wait before retrying a refused request
RETRY_AFTER = 1


@dataclass
class ServerOptions:
    """Limits of the HTTP layer: ``api_key`` (None: no key needed) and the largest request
    body in bytes."""

    api_key: str | None = None
    max_request_bytes: int = 1 << 20


def create_app(engine: Engine, options: ServerOptions | None = None) -> Starlette:
    """The ASGI application serving ``engine`` (closed when the application shuts down)."""
    options = options or ServerOptions()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            engine.close()

    def guarded(
        handler: Callable[[Request], Awaitable[Response]],
    ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                _authorize(request, options.api_key)
                return await handler(request)
            except RequestError as error:
                return _error(error)
            except QueueFull:
                return _refused(
                    429,
                    "the server is busy: every generation slot and the queue "
                    "are taken; retry later",
                    "rate_limit_exceeded",
                )
            except ShuttingDown:
                return _refused(503, "the server is shutting down", "shutting_down")
            except ValueError as error:  # the program's logits cannot be sampled (NaN, ...)
                body = error_body(str(error), kind="server_error", code="generation_failed")
                return JSONResponse(body, status_code=500)

        return endpoint

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [_model_card(engine)]})

    async def chat(request: Request) -> Response:
        parsed = protocol.parse_chat(await _read_json(request, options.max_request_bytes))
        _check_model(engine, parsed.model)
        generation = engine.prepare(engine.chat_prompt(parsed.messages), parsed.sampling)
        return await _respond(engine, generation, chat=True)

    async def completions(request: Request) -> Response:
        parsed = protocol.parse_completion(await _read_json(request, options.max_request_bytes))
        _check_model(engine, parsed.model)
        generation = engine.prepare(engine.text_prompt(parsed.prompt), parsed.sampling)
        return await _respond(engine, generation, chat=False)

    async def health(request: Request) -> Response:
        queue = engine.queue
        return JSONResponse(
            {
                "status": "shutting_down" if queue.closed else "ok",
                "model": engine.name,
                "running": queue.running,
                "waiting": queue.waiting,
                "concurrency": queue.concurrency,
                "max_queue": queue.max_queue,
                "active_generations": engine.generator.active_generations,
                "interrupted": engine.interrupted,
            }
        )

    routes = [
        Route("/v1/models", guarded(models), methods=["GET"]),
        Route("/v1/chat/completions", guarded(chat), methods=["POST"]),
        Route("/v1/completions", guarded(completions), methods=["POST"]),
        Route("/health", health, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.engine = engine
    return app


# ------------------------------------------------------------------------------ requests ---


def _authorize(request: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip(), api_key):
        raise RequestError(
            "a valid API key is needed: send 'Authorization: Bearer KEY'",
            status=401,
            code="invalid_api_key",
            kind="authentication_error",
        )


async def _read_json(request: Request, limit: int) -> Any:
    """The request body as JSON; 413 past ``limit`` bytes (read no further), 400 if it is not
    JSON."""
    declared = request.headers.get("content-length")
    too_large = RequestError(
        f"the request body exceeds this server's limit of {limit} bytes",
        status=413,
        code="request_too_large",
    )
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise too_large
    except ClientDisconnect:
        raise RequestError("the client disconnected while sending the request") from None
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as error:
        raise RequestError(f"the request body is not valid JSON: {error}") from None


def _check_model(engine: Engine, model: str) -> None:
    if model != engine.name:
        raise RequestError(
            f"the model '{model}' does not exist; this server serves '{engine.name}'",
            status=404,
            param="model",
            code="model_not_found",
        )


def _model_card(engine: Engine) -> dict[str, Any]:
    return {"id": engine.name, "object": "model", "created": 0, "owned_by": "coreai-torch"}


# ----------------------------------------------------------------------------- responses ---


def _error(error: RequestError) -> Response:
    return JSONResponse(error.body(), status_code=error.status)


def _refused(status: int, message: str, code: str) -> Response:
    return JSONResponse(
        error_body(
            message, kind="server_error" if status == 503 else "rate_limit_error", code=code
        ),
        status_code=status,
        headers={"Retry-After": str(RETRY_AFTER)},
    )


async def _respond(engine: Engine, generation: Generation, *, chat: bool) -> Response:
    rid = protocol.new_id("chatcmpl" if chat else "cmpl")
    stream = engine.stream(generation)
    if generation.sampling.stream:
        first = await _first_piece(stream)  # queue refusals become HTTP errors, not events
        return EventStream(_events(engine, generation, stream, first, rid, chat))
    async with contextlib.aclosing(stream):
        text = "".join([piece async for piece in stream])
    build = protocol.chat_response if chat else protocol.completion_response
    return JSONResponse(
        build(
            rid,
            engine.name,
            text,
            generation.finish_reason or "stop",
            len(generation.prompt_ids),
            generation.completion_tokens,
        )
    )


_END = object()


async def _first_piece(stream: AsyncIterator[str]) -> Any:
    """The first text piece (or :data:`_END`): waiting for it enters the queue, so a full
    queue is refused before the response starts."""
    try:
        return await anext(stream)
    except StopAsyncIteration:
        return _END
    except BaseException:
        await stream.aclose()  # type: ignore[attr-defined]
        raise


async def _events(
    engine: Engine,
    generation: Generation,
    stream: AsyncIterator[str],
    first: Any,
    rid: str,
    chat: bool,
) -> AsyncIterator[str]:
    """The server-sent events of a streamed response."""
    name = engine.name

    def chunk(text: str | None, finish: str | None = None, role: bool = False) -> str:
        if chat:
            delta = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            body = protocol.chat_chunk(rid, name, delta, finish)
        else:
            body = protocol.completion_chunk(rid, name, text or "", finish)
        return f"data: {json.dumps(body)}\n\n"

    async with contextlib.aclosing(stream):  # type: ignore[type-var]
        try:
            if chat:
                yield chunk(None, role=True)
            if first is not _END:
                yield chunk(first)
                async for piece in stream:
                    yield chunk(piece)
        except ValueError as error:  # the program's logits cannot be sampled (NaN, ...)
            body = error_body(str(error), kind="server_error", code="generation_failed")
            yield f"data: {json.dumps(body)}\n\n"
            return
    yield chunk(None, finish=generation.finish_reason or "stop")
    if generation.sampling.include_usage:
        kind = "chat.completion.chunk" if chat else "text_completion"
        usage = protocol.usage_chunk(
            rid, name, kind, len(generation.prompt_ids), generation.completion_tokens
        )
        yield f"data: {json.dumps(usage)}\n\n"
    yield "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """A ``text/event-stream`` response whose generator is closed however the response ends
    (a client that disconnects included), so the generation's state is freed at once."""

    def __init__(self, events: AsyncIterator[str]) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


# -------------------------------------------------------------------------------- running ---


def is_loopback(host: str) -> bool:
    """Whether ``host`` names only this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        import ipaddress

        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def run_server(
    app: Starlette,
    sock: socket.socket,
    *,
    shutdown_timeout: float = 10.0,
    log_level: str = "warning",
) -> None:
    """Serve ``app`` on ``sock`` until SIGINT / SIGTERM; requests in flight get
    ``shutdown_timeout`` seconds to finish, then the engine is closed."""
    import uvicorn

    config = uvicorn.Config(
        app,
        log_level=log_level,
        # annotated int by uvicorn, used as asyncio.wait_for's timeout (seconds, a float)
        timeout_graceful_shutdown=shutdown_timeout,  # type: ignore[arg-type]
        lifespan="on",
    )
    server = uvicorn.Server(config)
    server.run(sockets=[sock])
    sys.stdout.flush()
