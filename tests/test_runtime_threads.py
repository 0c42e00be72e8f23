"""``Session`` from notebooks, async code and threads: sync calls inside a running event loop,
``await session.arun``, cancellation, one session shared by threads, calls on stored states
serialized, calls with their own states concurrent -- and the runtime's load messages kept off
stderr unless asked for."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import torch.nn as nn

from coreai_torch import TorchConverter
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.runtime import Session, loop


class Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1


class Counter(nn.Module):
    """A state that counts the calls (and sums what it was given)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.total.add_(x)
        return self.total * 1


@pytest.fixture(scope="module")
def scale_session():
    ep = export_decomposed(Scale(), (torch.ones(4),))
    with Session(TorchConverter().add_exported_program(ep).to_coreai()) as session:
        yield session


@pytest.fixture(scope="module")
def counter_session():
    ep = export_decomposed(Counter(), (torch.ones(4),))
    with Session(TorchConverter().add_exported_program(ep).to_coreai()) as session:
        yield session


def _x(value: float) -> np.ndarray:
    return np.full(4, value, np.float32)


def test_sync_run_inside_a_running_event_loop(scale_session: Session) -> None:
    async def handler() -> np.ndarray:  # as in a notebook cell or an async web handler
        return scale_session.run({"x": _x(3)})["add"]

    np.testing.assert_array_equal(asyncio.run(handler()), _x(7))


def test_arun_awaits_concurrent_calls(scale_session: Session) -> None:
    async def main() -> list[np.ndarray]:
        calls = [scale_session.arun({"x": _x(i)}) for i in range(8)]
        return [out["add"] for out in await asyncio.gather(*calls)]

    for i, out in enumerate(asyncio.run(main())):
        np.testing.assert_array_equal(out, _x(2 * i + 1))


def test_async_with_opens_and_closes() -> None:
    ep = export_decomposed(Scale(), (torch.ones(4),))
    session = Session(TorchConverter().add_exported_program(ep).to_coreai())

    async def main() -> np.ndarray:
        async with session:
            return (await session.arun({"x": _x(1)}))["add"]

    np.testing.assert_array_equal(asyncio.run(main()), _x(3))
    assert not session.is_open


def test_one_session_shared_by_threads(scale_session: Session) -> None:
    def worker(i: int) -> None:
        for k in range(25):
            out = scale_session.run({"x": _x(i * 100 + k)})["add"]
            np.testing.assert_array_equal(out, _x(2 * (i * 100 + k) + 1))

    with ThreadPoolExecutor(8) as pool:
        for future in [pool.submit(worker, i) for i in range(8)]:
            future.result()


def test_calls_on_stored_states_are_serialized(counter_session: Session) -> None:
    counter_session.run({"x": _x(0)}, state={"b_total": np.zeros(4, np.float32)})
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: counter_session.run({"x": _x(1)}), range(40)))
    # every call added 1 to the one stored buffer, none lost to a concurrent call
    np.testing.assert_array_equal(counter_session.state_values()["b_total"], _x(40))


def test_calls_with_their_own_states_are_independent(counter_session: Session) -> None:
    def sequence(i: int) -> np.ndarray:
        states = counter_session.zero_states()
        out = None
        for _ in range(10):
            out = counter_session.run({"x": _x(i)}, state=states, keep_state=False)["mul"]
        return out

    stored = counter_session.state_values()
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(sequence, range(1, 9)))
    for i, out in enumerate(results, start=1):
        np.testing.assert_array_equal(out, _x(10 * i))
    # keep_state=False leaves the stored states alone
    for name, value in counter_session.state_values().items():
        np.testing.assert_array_equal(value, stored[name])


def test_cancelled_arun_leaves_the_session_usable(scale_session: Session) -> None:
    async def main() -> np.ndarray:
        task = asyncio.ensure_future(scale_session.arun({"x": _x(1)}))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return (await scale_session.arun({"x": _x(2)}))["add"]

    np.testing.assert_array_equal(asyncio.run(main()), _x(5))


def test_sync_call_on_the_runtime_loop_is_an_error(scale_session: Session) -> None:
    async def on_runtime_loop() -> None:
        scale_session.run({"x": _x(1)})

    with pytest.raises(RuntimeError, match="await the async form"):
        loop.run(on_runtime_loop())


def test_closed_session_is_a_clear_error() -> None:
    ep = export_decomposed(Scale(), (torch.ones(4),))
    session = Session(TorchConverter().add_exported_program(ep).to_coreai())
    with pytest.raises(RuntimeError, match="the session is closed"):
        session.run({"x": _x(1)})

    async def main() -> None:
        await session.arun({"x": _x(1)})

    with pytest.raises(RuntimeError, match="the session is closed"):
        asyncio.run(main())


def test_runtime_loop_runs_in_its_own_thread() -> None:
    async def where() -> str:
        return threading.current_thread().name

    assert loop.run(where()) == loop.THREAD_NAME
    assert asyncio.run(loop.arun(where())) == loop.THREAD_NAME


# ------------------------------------------------------------------ the runtime's messages ---

LOAD = """
import logging, sys, warnings
warnings.simplefilter("ignore")
import torch
from coreai_torch import TorchConverter
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.runtime import Session
from tests.test_runtime_threads import Scale
if sys.argv[1] == "debug":
    logging.getLogger("coreai_torch.runtime").setLevel(logging.DEBUG)
ep = export_decomposed(Scale(), (torch.ones(4),))
with Session(TorchConverter().add_exported_program(ep).to_coreai()) as session:
    session.run({"x": torch.ones(4)})
print("ran")
"""


def _load_stderr(mode: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", LOAD, mode], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ran"
    return done.stderr


def test_loading_prints_nothing_on_stderr_by_default() -> None:
    assert _load_stderr("default") == ""


def test_loading_messages_show_in_debug_mode() -> None:
    assert "ODIE [default]: Loading function 'main'" in _load_stderr("debug")


QUIET = """
import os, threading
from coreai_torch.runtime.chatter import quiet_runtime
with quiet_runtime():
    os.write(2, b"ODIE [default]: Loading function 'main'\\n")
    t = threading.Thread(target=lambda: os.write(2, b"another thread's line\\n"))
    t.start(); t.join()
    os.write(2, b"the runtime's other words\\n")
os.write(2, b"after\\n")
"""


def test_other_stderr_output_during_a_load_is_kept_in_order() -> None:
    done = subprocess.run([sys.executable, "-c", QUIET], capture_output=True, text=True)
    assert done.stderr == "another thread's line\nthe runtime's other words\nafter\n"


def test_verify_inside_a_running_event_loop() -> None:
    from coreai_torch.verify import verify

    async def cell() -> bool:
        return verify(Scale(), (torch.randn(4),)).ok

    assert asyncio.run(cell())
