"""The request queue in front of the generations: at most ``concurrency`` generations run at
once (each holds its own KV cache), at most ``max_queue`` requests wait for one, and a request
beyond that is refused at once (the server answers 429 with ``Retry-After``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class QueueFull(Exception):
    """Every generation slot is taken and the waiting line is full."""


class ShuttingDown(Exception):
    """The server is stopping and takes no new requests."""


class RequestQueue:
    """Slots for ``concurrency`` generations and a waiting line of ``max_queue`` requests
    (used from one event loop)."""

    def __init__(self, concurrency: int, max_queue: int) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.concurrency = concurrency
        self.max_queue = max_queue
        self._slots = asyncio.Semaphore(concurrency)
        #: requests holding a slot / waiting for one
        self.running = 0
        self.waiting = 0
        self.closed = False

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold a generation slot for the block; :class:`QueueFull` if none is free and the
        line is full, :class:`ShuttingDown` once :meth:`close` was called."""
        if self.closed:
            raise ShuttingDown()
        if self.running >= self.concurrency and self.waiting >= self.max_queue:
            raise QueueFull()
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1
            self._slots.release()

    def close(self) -> None:
        """Refuse new requests (those running or waiting go on)."""
        self.closed = True
