"""Sweep fixtures: a per-process worker pool, a result cache, and the results file.

Each pytest process runs its OpInfo entries through its own :class:`WorkerPool`.  Without
xdist, every selected entry is submitted up front to a pool of ``OPINFO_JOBS`` workers (default:
the number of cores) and the tests consume the results as they arrive; under xdist each
process runs one worker and computes entries on demand (``--dist loadgroup`` keeps the
dtypes of one entry on one process).

At the end, every process writes its summaries to a partial file; the last one to finish
merges them, and when they cover every swept entry (``make test-all``) writes
``tests/opinfo/results.json`` for ``python -m tools.ops_table``.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.opinfo import catalog, results
from tests.opinfo.pool import REPO, WorkerPool
from tests.opinfo.sweep import task


class Sweep:
    """Summaries of OpInfo entries, computed on demand or prefetched in the background."""

    def __init__(self, jobs: int) -> None:
        self.jobs = jobs
        self.pool: WorkerPool | None = None
        self.summaries: dict[str, dict[str, Any]] = {}
        self.started = time.monotonic()
        self._ready = threading.Condition()
        self._thread: threading.Thread | None = None
        self._prefetched: set[str] = set()
        self._error: BaseException | None = None

    def _pool(self) -> WorkerPool:
        if self.pool is None:
            self.pool = WorkerPool(self.jobs)
        return self.pool

    def prefetch(self, ids: list[str]) -> None:
        self._prefetched = set(ids)
        self._thread = threading.Thread(target=self._run_all, args=(ids,), daemon=True)
        self._thread.start()

    def _run_all(self, ids: list[str]) -> None:
        try:
            for result in self._pool().run(task(i) for i in ids):
                with self._ready:
                    self.summaries[result["op"]] = results.summarize(result)
                    self._ready.notify_all()
        except BaseException as error:
            with self._ready:
                self._error = error
                self._ready.notify_all()

    def summary(self, op_id: str) -> dict[str, Any]:
        if op_id in self._prefetched:
            with self._ready:
                while op_id not in self.summaries and self._error is None:
                    self._ready.wait()
                if self._error is not None and op_id not in self.summaries:
                    raise RuntimeError(f"the sweep stopped: {self._error!r}")
        elif op_id not in self.summaries:
            self.summaries[op_id] = results.summarize(self._pool().run_one(task(op_id)))
        return self.summaries[op_id]

    def close(self) -> None:
        if self._thread is not None:
            if self._thread.is_alive() and self.pool is not None:
                self.pool.cancel()  # e.g. pytest -x stopped early
            self._thread.join()
        if self.pool is not None:
            self.pool.close()


_SWEEP: Sweep | None = None


def _jobs() -> int:
    if "OPINFO_JOBS" in os.environ:
        return max(1, int(os.environ["OPINFO_JOBS"]))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return 1
    return max(1, os.cpu_count() or 1)


@pytest.fixture(scope="session")
def sweep(request: pytest.FixtureRequest) -> Iterator[Sweep]:
    global _SWEEP
    _SWEEP = Sweep(_jobs())
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        ids = []
        for item in request.session.items:
            callspec = getattr(item, "callspec", None)
            op_id = callspec.params.get("op_id") if callspec else None
            if op_id and op_id not in ids:
                ids.append(op_id)
        _SWEEP.prefetch(ids)
    yield _SWEEP
    _SWEEP.close()


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _SWEEP is None and not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID", "local")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    directory = REPO / ".pytest_cache" / "opinfo" / uid
    directory.mkdir(parents=True, exist_ok=True)
    own = {
        "summaries": _SWEEP.summaries if _SWEEP else {},
        "seconds": time.monotonic() - _SWEEP.started if _SWEEP else 0.0,
    }
    (directory / f"partial-{worker}.json").write_text(json.dumps(own))
    with open(directory / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        partials = sorted(directory.glob("partial-*.json"))
        if len(partials) < count:
            return
        merged: dict[str, dict[str, Any]] = {}
        seconds = 0.0
        for path in partials:
            data = json.loads(path.read_text())
            merged.update(data["summaries"])
            seconds = max(seconds, data["seconds"])
            path.unlink()
    _write_if_complete(merged, seconds, count)


def _write_if_complete(merged: dict[str, dict[str, Any]], seconds: float, count: int) -> None:
    ops = catalog.op_db_by_id()
    wanted = [i for i in catalog.sweep_ids() if catalog.sweep_dtypes(ops[i])]
    if not merged or any(i not in merged for i in wanted):
        return
    for op_id in catalog.sweep_ids():
        merged.setdefault(op_id, results.summarize(results.empty_result(op_id)))
    left_out = results.merge_left_out(ops)
    results.write_results(merged, left_out, seconds=seconds, jobs=max(count, _jobs()))
