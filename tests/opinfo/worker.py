"""A long-lived sweep worker: reads tasks (JSON lines) on stdin, answers on a result pipe.

    python -m tests.opinfo.worker <result-fd>

Messages: ``ready`` once imports are done; per task ``start``, then ``plan`` (the samples it
covers, when the task did not list them) and ``result``.  Anything else the process prints
goes to stderr.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import traceback
from typing import Any


def main() -> None:
    out_fd = int(sys.argv[1])
    os.dup2(2, 1)  # stray prints must not reach anything that parses our output

    def send(message: dict[str, Any]) -> None:
        data = (json.dumps(message) + "\n").encode()
        view = memoryview(data)
        while view:
            view = view[os.write(out_fd, view) :]

    import torch

    torch.set_num_threads(1)
    from tests.opinfo import catalog, runner

    catalog.op_db_by_id()
    workdir = tempfile.mkdtemp(prefix="coreai_opinfo_")
    send({"type": "ready", "pid": os.getpid()})
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            task = json.loads(line)
            send({"type": "start", "id": task["id"]})
            try:
                if task.get("samples") is None:
                    plan = runner.plan(task["op"], task.get("dtypes"))
                    task["samples"] = [[d, i] for d, info in plan.items() for i in info["selected"]]
                    send(
                        {"type": "plan", "id": task["id"], "plan": plan, "samples": task["samples"]}
                    )
                result = runner.run_task(task, workdir)
            except Exception as error:
                result = {
                    "op": task["op"],
                    "error": f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=4)}",
                    "records": [],
                }
            send({"type": "result", "id": task["id"], **result})
            for entry in os.listdir(workdir):
                shutil.rmtree(os.path.join(workdir, entry), ignore_errors=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
