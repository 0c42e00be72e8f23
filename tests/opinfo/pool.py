"""A pool of long-lived sweep workers that survives their deaths.

Each worker (``tests/opinfo/worker.py``) imports torch, the converter and ``op_db`` once and
then processes many tasks.  When a worker dies (an abort that escaped its runtime child) or
overruns its time budget, it is killed and replaced; the samples of the task it was running
are retried one by one, and a sample that kills a worker on its own is reported as failed.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

#: seconds a worker may take to start (imports) before it is considered hung
STARTUP_TIMEOUT = 300.0
#: time budget of one task: base + per sample (seconds); the runtime child has its own limit
TASK_BASE_SECONDS = 180.0
TASK_SAMPLE_SECONDS = 60.0


@dataclass
class _Part:
    key: int
    task: dict[str, Any]
    attempts: int = 0
    id: int = 0


@dataclass
class _Worker:
    proc: subprocess.Popen
    fd: int
    log: Path
    spawned: float
    buffer: bytes = b""
    part: _Part | None = None
    started: float | None = None
    samples: int | None = None

    def deadline(self) -> float:
        if self.started is None:
            return self.spawned + STARTUP_TIMEOUT + TASK_BASE_SECONDS
        n = self.samples if self.samples is not None else 16
        return self.started + TASK_BASE_SECONDS + TASK_SAMPLE_SECONDS * n


@dataclass
class _Entry:
    op: str
    open_parts: int = 1
    result: dict[str, Any] = field(default_factory=dict)


class WorkerPool:
    """Runs sweep tasks ``{"op": id, "dtypes": [...]?, "samples": [[dtype, i]]?}``."""

    def __init__(
        self, jobs: int = 1, log_dir: Path | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.jobs = max(1, jobs)
        self.env = dict(env or {})
        self._tmp = None if log_dir else tempfile.TemporaryDirectory(prefix="coreai_opinfo_logs_")
        self.log_dir = Path(log_dir or self._tmp.name)  # type: ignore[union-attr]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.workers: list[_Worker] = []
        self.restarts = 0
        self._ids = itertools.count()
        self._selector = selectors.DefaultSelector()
        self._cancelled = False

    # -- lifecycle ------------------------------------------------------------------------

    def _spawn(self) -> _Worker:
        read_fd, write_fd = os.pipe()
        log = self.log_dir / f"worker-{next(self._ids)}.log"
        env = dict(os.environ, **self.env)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        env.setdefault("OMP_NUM_THREADS", "1")
        with open(log, "ab") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.opinfo.worker", str(write_fd)],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=err,
                pass_fds=(write_fd,),
                cwd=REPO,
                env=env,
            )
        os.close(write_fd)
        os.set_blocking(read_fd, False)
        worker = _Worker(proc, read_fd, log, time.monotonic())
        self._selector.register(read_fd, selectors.EVENT_READ, worker)
        self.workers.append(worker)
        return worker

    def _retire(self, worker: _Worker) -> None:
        self._selector.unregister(worker.fd)
        os.close(worker.fd)
        if worker.proc.poll() is None:
            worker.proc.kill()
        worker.proc.wait()
        if worker.proc.stdin:
            worker.proc.stdin.close()
        self.workers.remove(worker)

    def cancel(self) -> None:
        """Stop a ``run()`` in progress (from another thread): its workers are killed."""
        self._cancelled = True
        for worker in list(self.workers):
            worker.proc.kill()

    def close(self) -> None:
        for worker in list(self.workers):
            if worker.proc.stdin:
                with contextlib.suppress(OSError):
                    worker.proc.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.proc.wait(timeout=10)
            self._retire(worker)
        self._selector.close()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- running ---------------------------------------------------------------------------

    def run_one(self, task: dict[str, Any]) -> dict[str, Any]:
        return next(iter(self.run([task])))

    def run(self, tasks: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        """Run tasks; yields one merged result per task, in completion order."""
        queue: deque[_Part] = deque()
        entries: dict[int, _Entry] = {}
        for key, task in enumerate(tasks):
            entries[key] = _Entry(task["op"], result=_empty_result(task["op"]))
            queue.append(_Part(key, dict(task), id=next(self._ids)))
        while queue or any(w.part for w in self.workers):
            if self._cancelled:
                return
            self._dispatch(queue)
            busy = [w for w in self.workers if w.part is not None]
            wait = max(0.0, min(w.deadline() for w in busy) - time.monotonic()) if busy else 0
            for selected, _ in self._selector.select(timeout=min(wait, 5.0)):
                worker: _Worker = selected.data
                yield from self._read(worker, queue, entries)
            now = time.monotonic()
            for worker in [w for w in self.workers if w.part is not None]:
                if now > worker.deadline():
                    yield from self._lost(worker, queue, entries, "timed out (killed)")

    def _dispatch(self, queue: deque[_Part]) -> None:
        idle = [w for w in self.workers if w.part is None]
        while queue and (idle or len(self.workers) < self.jobs):
            worker = idle.pop() if idle else self._spawn()
            part = queue.popleft()
            message = dict(part.task, id=part.id)
            try:
                worker.log.write_bytes(b"")
                assert worker.proc.stdin is not None
                worker.proc.stdin.write((json.dumps(message) + "\n").encode())
                worker.proc.stdin.flush()
            except OSError:
                queue.appendleft(part)
                self._retire(worker)
                self.restarts += 1
                continue
            worker.part, worker.started = part, None
            samples = part.task.get("samples")
            worker.samples = len(samples) if samples is not None else None

    def _read(
        self, worker: _Worker, queue: deque[_Part], entries: dict[int, _Entry]
    ) -> Iterator[dict[str, Any]]:
        try:
            chunk = os.read(worker.fd, 1 << 20)
        except BlockingIOError:
            return
        if not chunk:
            if worker.part is not None:
                yield from self._lost(worker, queue, entries, "died")
            else:
                self._retire(worker)
                self.restarts += 1
            return
        worker.buffer += chunk
        *lines, worker.buffer = worker.buffer.split(b"\n")
        for line in lines:
            if line.strip():
                yield from self._message(worker, json.loads(line), entries)

    def _message(
        self, worker: _Worker, message: dict[str, Any], entries: dict[int, _Entry]
    ) -> Iterator[dict[str, Any]]:
        part = worker.part
        kind = message["type"]
        if kind == "ready" or part is None or message.get("id") != part.id:
            return
        entry = entries[part.key]
        if kind == "start":
            worker.started = time.monotonic()
        elif kind == "plan":
            entry.result["plan"].update(message["plan"])
            part.task["samples"] = message["samples"]
            worker.samples = len(message["samples"])
        elif kind == "result":
            _merge(entry.result, message)
            worker.part = None
            yield from self._close_part(part.key, entries)

    def _close_part(self, key: int, entries: dict[int, _Entry]) -> Iterator[dict[str, Any]]:
        entry = entries[key]
        entry.open_parts -= 1
        if entry.open_parts == 0:
            del entries[key]
            yield entry.result

    def _lost(
        self, worker: _Worker, queue: deque[_Part], entries: dict[int, _Entry], what: str
    ) -> Iterator[dict[str, Any]]:
        part = worker.part
        assert part is not None
        self._retire(worker)
        self.restarts += 1
        returncode = worker.proc.returncode
        if returncode is not None and returncode < 0 and what == "died":
            what = f"killed by {signal.Signals(-returncode).name}"
        elif returncode is not None and what == "died":
            what = f"exited with status {returncode}"
        why = f"sweep worker {what}{log_tail(worker.log)}"
        entry = entries[part.key]
        samples = part.task.get("samples")
        count = "its samples" if samples is None else f"{len(samples)} sample(s)"
        entry.result["incidents"].append(f"{why} (running {count})")
        if samples is None:
            if part.attempts == 0:
                part.attempts += 1
                queue.appendleft(part)
                return
            entry.result["errors"].append(why)
        elif len(samples) > 1:
            entry.open_parts += len(samples) - 1
            for sample in reversed(samples):
                queue.appendleft(
                    _Part(part.key, dict(part.task, samples=[sample]), id=next(self._ids))
                )
            return
        else:
            dtype, index = samples[0]
            stage = "timeout" if "timed out" in what else "abort"
            entry.result["records"].append(
                {
                    "dtype": dtype,
                    "index": index,
                    "desc": "",
                    "status": "fail",
                    "stage": stage,
                    "reason": why,
                    "ops": [],
                }
            )
        yield from self._close_part(part.key, entries)


def _empty_result(op: str) -> dict[str, Any]:
    return {
        "op": op,
        "left_out": None,
        "plan": {},
        "records": [],
        "errors": [],
        "incidents": [],
        "batches": 0,
        "seconds": 0.0,
    }


def _merge(result: dict[str, Any], message: dict[str, Any]) -> None:
    result["records"].extend(message.get("records", []))
    if message.get("left_out"):
        result["left_out"] = message["left_out"]
    if message.get("error"):
        result["errors"].append(message["error"])
    result["batches"] += message.get("batches", 0)
    result["seconds"] = round(result["seconds"] + message.get("seconds", 0.0), 3)


def log_tail(path: Path) -> str:
    """The last telling line of a process's stderr log, as ': line' (or '')."""
    try:
        lines = [
            ln.strip()
            for ln in path.read_text(errors="replace").splitlines()
            if ln.strip() and not ln.startswith("ODIE")
        ]
    except OSError:
        return ""
    interesting = [ln for ln in lines if "rror" in ln or "atal" in ln] or lines
    return f": {interesting[-1][:200]}" if interesting else ""
