"""A sample that kills its process is a failure of that sample, never of the sweep.

Faults are injected into the sweep workers (``OPINFO_FAULT``): the runtime child aborts, the
worker itself aborts, the runtime child hangs past its time limit.
"""

from __future__ import annotations

from tests.opinfo import results
from tests.opinfo.pool import WorkerPool


def test_aborts_and_hangs_are_sample_failures() -> None:
    env = {
        "OPINFO_FAULT": "asin:child-abort,abs:worker-abort,atan:child-hang",
        "OPINFO_RUN_TIMEOUT": "5",
    }
    tasks = [{"op": op, "dtypes": ["float32"]} for op in ("asin", "abs", "atan", "ceil")]
    with WorkerPool(1, env=env) as pool:
        got = {r["op"]: results.summarize(r)["dtypes"]["float32"] for r in pool.run(tasks)}
        restarts = pool.restarts

    def only_failure(op: str) -> dict:
        info = got[op]
        assert info["status"] == "fail", info
        (failure,) = info["failures"]
        return failure

    child = only_failure("asin")
    assert child["stage"] == "abort"
    assert "SIGABRT" in child["reason"] and "injected fault" in child["reason"]
    worker = only_failure("abs")
    assert worker["stage"] == "abort" and "SIGABRT" in worker["reason"]
    assert only_failure("atan")["stage"] == "timeout"
    assert got["ceil"]["status"] == "pass"  # the pool carried on with a new worker
    assert restarts == 1  # (these entries have one float32 sample each)
