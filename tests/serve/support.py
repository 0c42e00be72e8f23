"""The served model of the server tests: a tiny random-weight Llama exported to a bundle with
``llm.export``, and its tokenizer (trained here, with a chat template) -- nothing downloaded --
plus a server started with ``coreai-torch serve`` on a free loopback port."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.llm.support import causal_lm, tiny_tokenizer

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
MAX_CONTEXT = 64
NAME = "tiny"


def save_model(root: Path) -> tuple[Path, Path]:
    """``(bundle, tokenizer directory)`` of the served model, written under ``root`` (the
    bundle embeds the tokenizer, chat template included)."""
    from coreai_torch import llm

    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    hf = root / "hf"
    tokenizer.save_pretrained(hf)
    bundle = root / NAME
    llm.export(causal_lm("llama"), max_context=MAX_CONTEXT, bundle=bundle, tokenizer=hf)
    return bundle, hf


@dataclass
class Server:
    """A ``coreai-torch serve`` child process and what it wrote."""

    process: subprocess.Popen
    url: str
    stderr: list[str] = field(default_factory=list)

    @property
    def base(self) -> str:
        return self.url.removesuffix("/v1")

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, then the exit code (the server re-raises the signal once it has shut
        down cleanly: -15)."""
        if self.process.poll() is None:
            self.process.terminate()
        return self.process.wait(timeout)


def start_server(args: list[str], timeout: float = 600) -> Server:
    """``coreai-torch serve ARGS --port 0``, once it listens."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "coreai_torch.cli.main", "serve", *args, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    server = Server(process, "")
    threading.Thread(target=_collect, args=(process.stderr, server.stderr), daemon=True).start()
    deadline = time.monotonic() + timeout
    assert process.stdout is not None
    line = process.stdout.readline()  # "coreai-torch: serving 'tiny' at http://...:PORT/v1 ..."
    if " at http://" not in line or time.monotonic() > deadline:
        process.kill()
        raise AssertionError(f"the server did not start: {line!r} {''.join(server.stderr)}")
    server.url = line.split(" at ", 1)[1].split()[0]
    return server


def _collect(stream: Any, into: list[str]) -> None:
    for line in stream:
        into.append(line)
