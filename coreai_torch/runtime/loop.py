"""The one event loop the Core AI runtime's coroutines run on, in a thread of its own.

coreai-core's runtime is asynchronous: loading a model and calling a function are coroutines,
whose work runs on the runtime's own threads and completes on the event loop that awaited them.
The package drives every one of them on a single loop that it owns (started on first use, in
a daemon thread named ``coreai-runtime``):

* :func:`run` submits a coroutine from synchronous code and waits for its result.  It works
  from any thread, including one whose own event loop is running (a notebook, an async web
  handler), because it never runs a loop in the caller's thread.
* :func:`arun` awaits the same coroutine from any event loop without blocking it.  Cancelling
  the awaiting task cancels the coroutine on the runtime loop.
* :func:`shielded` is how a runtime call is awaited on that loop: a call in flight always runs
  to its end (the runtime may still be writing into its buffers), so a cancelled caller gets
  ``CancelledError`` at once while the buffers stay referenced until the runtime is done.

User code never runs on the runtime loop, so nothing can block it but the runtime itself.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

#: name of the thread that runs the loop
THREAD_NAME = "coreai-runtime"

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_thread: threading.Thread | None = None
#: runtime calls in flight, referenced until the runtime completes them
_in_flight: set[asyncio.Future[Any]] = set()


def runtime_loop() -> asyncio.AbstractEventLoop:
    """The runtime's event loop, started (with its thread) on first use."""
    global _loop, _thread
    loop = _loop
    if loop is not None:
        return loop
    with _lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def serve() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                loop.run_forever()

            thread = threading.Thread(target=serve, name=THREAD_NAME, daemon=True)
            thread.start()
            ready.wait()
            _loop, _thread = loop, thread
        return _loop


def in_runtime_thread() -> bool:
    """Whether the caller runs on the runtime loop's thread."""
    return _thread is not None and threading.current_thread() is _thread


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on the runtime loop and wait for its result (from synchronous code, in any
    thread).  An interrupt (Ctrl-C) while waiting cancels it."""
    if in_runtime_thread():
        coro.close()
        raise RuntimeError(
            "a synchronous coreai_torch runtime call was made on the runtime's own event loop; "
            "await the async form (e.g. `await session.arun(...)`) there instead"
        )
    future = asyncio.run_coroutine_threadsafe(coro, runtime_loop())
    try:
        return future.result()
    except BaseException:
        future.cancel()
        raise


async def arun(coro: Coroutine[Any, Any, T]) -> T:
    """Await ``coro``, run on the runtime loop, from any event loop (never blocking it)."""
    loop = runtime_loop()
    if asyncio.get_running_loop() is loop:
        return await coro
    future: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(coro, loop)
    return await asyncio.wrap_future(future)


async def shielded(call: Awaitable[T]) -> T:
    """Await a runtime call on the runtime loop; if the awaiting task is cancelled, the call
    still runs to its end (holding its inputs and states) before ``CancelledError`` is
    raised here."""
    task = asyncio.ensure_future(call)
    _in_flight.add(task)
    task.add_done_callback(_in_flight.discard)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait({task})
        if not task.cancelled() and task.exception() is not None:
            task.exception()  # retrieved: the caller no longer wants it
        raise


def _forget_in_child() -> None:
    """A forked child has no runtime thread: it starts its own on first use."""
    global _lock, _loop, _thread
    _lock, _loop, _thread = threading.Lock(), None, None
    _in_flight.clear()


os.register_at_fork(after_in_child=_forget_in_child)
