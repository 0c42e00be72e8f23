"""Peak resident memory of each benchmark phase, above one baseline taken before conversion.

On Linux the kernel keeps the exact high-water mark (``VmHWM`` in ``/proc/self/status``) and
resets it to the current RSS when ``5`` is written to ``/proc/self/clear_refs``: each phase
resets it, runs, and reads it.  Elsewhere (or where the reset is not permitted) a thread samples
the RSS every 2 ms, which can miss short peaks.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_bytes(field: str) -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_high_water_mark() -> bool:
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def rss() -> int:
    """This process's resident set size in bytes."""
    return psutil.Process(os.getpid()).memory_info().rss


class _Sampler:
    """The largest RSS seen by a thread sampling every ``interval`` seconds."""

    def __init__(self, interval: float = 0.002) -> None:
        self._interval = interval
        self._stop = threading.Event()
        self.peak = rss()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(self._interval)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, rss())


class PhaseMemory:
    """Peak RSS per phase minus one baseline, the RSS when the object is created.

    ``with memory.phase("to_coreai"): ...`` records ``memory.peaks["to_coreai"]``.
    """

    def __init__(self) -> None:
        gc.collect()
        self.exact = _STATUS.exists() and _reset_high_water_mark()
        self.baseline = _status_bytes("VmRSS") if self.exact else rss()
        self.peaks: dict[str, int] = {}

    @property
    def method(self) -> str:
        return "VmHWM (exact)" if self.exact else "sampled every 2 ms"

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.exact:
            _reset_high_water_mark()
            yield
            peak = _status_bytes("VmHWM")
        else:
            sampler = _Sampler()
            try:
                yield
            finally:
                peak = sampler.stop()
        self.peaks[name] = peak - self.baseline
