"""Progress of long conversions: FX nodes lowered / total, per entry point, then the bytes of
weights ``compress()`` has fitted, the steps of ``optimize()`` and the bytes ``save_asset()``
has written.

Off by default (and then free).  Turn it on for one ``to_coreai()`` call, a block of code, a
converter, or the whole process::

    with coreai_torch.progress.progress_bar():         # a rich progress bar on stderr
        program = converter.to_coreai()

    with coreai_torch.progress.track(lambda entrypoint, done, total: ...):
        program = converter.to_coreai()                # your own callback

    converter.progress = True                          # this converter, always
    COREAI_TORCH_PROGRESS=1 python convert.py          # every conversion of the process

A program from ``to_coreai()`` reports ``compress()``, ``optimize()`` and ``save_asset()`` the
same way (its ``progress`` attribute is the converter's; a callback then also receives
``("compress", weight bytes fitted, weight bytes selected)``, ``("optimize", steps done,
steps)`` and ``("save", bytes written, bytes expected)``).  The
``coreai-torch convert`` command shows the bar whenever stderr is a terminal.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

#: Set to ``1`` to show a progress bar for every conversion of the process.
ENV_VAR = "COREAI_TORCH_PROGRESS"

ProgressCallback = Callable[[str, int, int], None]


class ConversionProgress:
    """Receives the progress events of ``to_coreai()``; subclass it to report elsewhere.

    ``start`` is called once per entry point with its number of FX ``call_function`` nodes,
    ``advance`` after each of them is lowered, ``finish`` when the entry point is done and
    ``close`` at the end of the ``to_coreai()`` call (also when it fails).
    """

    def start(self, entrypoint: str, total: int) -> None:
        """An entry point with ``total`` nodes begins."""

    def advance(self, entrypoint: str) -> None:
        """One more node of ``entrypoint`` is lowered."""

    def finish(self, entrypoint: str) -> None:
        """Every node of ``entrypoint`` is lowered."""

    def update(self, task: str, done: int, total: int, unit: str) -> None:
        """Another phase advanced: ``task`` is ``"compress"`` (``unit`` "bytes"),
        ``"optimize"`` (``unit`` "steps") or ``"save"`` (``unit`` "bytes"); ``llm.export``
        also reports ``"load"`` and ``"trace"`` (``unit`` "entry points")."""

    def close(self) -> None:
        """The ``to_coreai()`` (or ``compress()``, ``optimize()``, ``save_asset()``) call is
        over."""


class CallbackProgress(ConversionProgress):
    """Calls ``callback(entrypoint, done, total)`` at most every ``interval`` seconds (and
    always at the start and the end of each entry point)."""

    def __init__(self, callback: ProgressCallback, interval: float = 0.1) -> None:
        self.callback = callback
        self.interval = interval
        self._done = 0
        self._total = 0
        self._last = 0.0

    def start(self, entrypoint: str, total: int) -> None:
        self._done, self._total, self._last = 0, total, time.perf_counter()
        self.callback(entrypoint, 0, total)

    def advance(self, entrypoint: str) -> None:
        self._done += 1
        now = time.perf_counter()
        if now - self._last >= self.interval:
            self._last = now
            self.callback(entrypoint, self._done, self._total)

    def finish(self, entrypoint: str) -> None:
        self.callback(entrypoint, self._total, self._total)

    def update(self, task: str, done: int, total: int, unit: str) -> None:
        now = time.perf_counter()
        if done in (0, total) or now - self._last >= self.interval:
            self._last = now
            self.callback(task, done, total)


_BYTE_UNITS = ((1e9, "GB"), (1e6, "MB"), (1e3, "KB"))


class RichProgress(CallbackProgress):
    """A ``rich`` progress bar (one line per entry point) on ``stderr``."""

    def __init__(self, *, transient: bool = False, console: Any = None) -> None:
        super().__init__(self._update, interval=0.05)
        self._transient = transient
        self._console = console
        self._bar: Any = None
        self._tasks: dict[str, Any] = {}
        self._units: dict[str, str] = {}

    def _start_bar(self) -> Any:
        try:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
        except ImportError as error:
            raise ImportError(
                "the progress bar needs the 'rich' package: pip install "
                "'coreai-torch-converter[cli]' (or pass a callback instead)"
            ) from error

        console = self._console or Console(stderr=True)
        self._bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[count]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=self._transient,
        )
        self._bar.start()
        return self._bar

    def update(self, task: str, done: int, total: int, unit: str) -> None:
        self._units[task] = unit
        super().update(task, done, total, unit)

    def _update(self, name: str, done: int, total: int) -> None:
        bar = self._bar or self._start_bar()
        unit = self._units.get(name, "nodes")
        if unit == "bytes":
            scale, suffix = next((s, u) for s, u in _BYTE_UNITS if total >= s or s == 1e3)
            count = f"{done / scale:.1f}/{total / scale:.1f} {suffix}"
        else:
            count = f"{done}/{total} {unit}"
        task = self._tasks.get(name)
        if task is None:
            label = f"lowering [bold]{name}" if unit == "nodes" else f"[bold]{name}"
            task = self._tasks[name] = bar.add_task(label, total=total, count=count)
        bar.update(task, completed=done, total=total, count=count)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
            self._tasks.clear()


@contextlib.contextmanager
def phase(
    listener: ConversionProgress | None, task: str, total: int, unit: str
) -> Iterator[Callable[[int, int], None]]:
    """Report one phase to ``listener`` (nothing if None): yields ``report(done, total)``;
    the phase is complete, and the listener closed, when the block ends."""
    if listener is None:
        yield lambda done, total: None
        return
    last = [total]

    def report(done: int, total: int) -> None:
        last[0] = total
        listener.update(task, done, total, unit)

    report(0, total)
    try:
        yield report
        listener.update(task, last[0], last[0], unit)
    finally:
        listener.close()


_ACTIVE: contextvars.ContextVar[ConversionProgress | None] = contextvars.ContextVar(
    "coreai_torch_progress", default=None
)


@contextlib.contextmanager
def reporting(listener: ConversionProgress) -> Iterator[ConversionProgress]:
    """Send the progress of every conversion inside the block to ``listener``."""
    token = _ACTIVE.set(listener)
    try:
        yield listener
    finally:
        _ACTIVE.reset(token)


def progress_bar(*, transient: bool = False) -> contextlib.AbstractContextManager[Any]:
    """Show a rich progress bar on stderr for every conversion inside the block."""
    return reporting(RichProgress(transient=transient))


def track(callback: ProgressCallback) -> contextlib.AbstractContextManager[Any]:
    """Call ``callback(entrypoint, done, total)`` while conversions inside the block run."""
    return reporting(CallbackProgress(callback))


def resolve(
    setting: bool | ConversionProgress | ProgressCallback | None,
) -> ConversionProgress | None:
    """The listener for one ``to_coreai()`` call, or None when progress is off.

    ``setting`` is the converter's ``progress`` attribute: ``None`` defers to an enclosing
    :func:`reporting` block and then to the ``COREAI_TORCH_PROGRESS`` environment variable,
    ``False`` turns progress off, ``True`` shows a bar, a listener or callback receives it.
    """
    if setting is None:
        active = _ACTIVE.get()
        if active is not None:
            return active
        if os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on"):
            return RichProgress()
        return None
    if setting is False:
        return None
    if setting is True:
        return RichProgress()
    if isinstance(setting, ConversionProgress):
        return setting
    if callable(setting):
        return CallbackProgress(setting)
    raise TypeError(
        "TorchConverter.progress must be None, True, False, a ConversionProgress or a "
        f"callback(entrypoint, done, total), got {type(setting).__name__}"
    )


def stderr_is_terminal() -> bool:
    """Whether a live progress bar makes sense (stderr is a terminal)."""
    return sys.stderr.isatty()
