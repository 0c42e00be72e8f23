"""The runtime's own messages on stderr, quiet unless asked for.

Loading a function prints ``ODIE [default]: Loading function 'main'`` straight to file
descriptor 2 (coreai-core 1.0.0b3 has no option or environment variable to turn it off).  While
a function loads, :func:`quiet_runtime` points descriptor 2 at a temporary file; afterwards the
runtime's messages are logged (logger ``coreai_torch.runtime``, level DEBUG) and anything else
written meanwhile -- by another thread, say -- is written to stderr as it came, so nothing is
lost, only delayed by the load.

If the runtime aborted the process while a function loads, what it wrote in that moment would
be lost with the temporary file: with DEBUG enabled nothing is redirected, so run with it to
see a crash's last words.  To see the messages on stderr as the runtime prints them, enable
DEBUG for the logger::

    logging.getLogger("coreai_torch.runtime").setLevel(logging.DEBUG)

(``coreai-torch --debug ...`` does this).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator

logger = logging.getLogger("coreai_torch.runtime")

#: lines the runtime prints on its own (``ODIE [default]: Loading function 'main'``)
RUNTIME_MESSAGE = re.compile(rb"^ODIE \[[^\]]*\]: ")

# descriptor 2 is one per process: one redirection at a time, whichever thread asks
_lock = threading.RLock()
_depth = 0


@contextlib.contextmanager
def quiet_runtime() -> Iterator[None]:
    """Keep the runtime's messages off stderr while the block runs (see the module)."""
    global _depth
    if logger.isEnabledFor(logging.DEBUG):
        yield
        return
    with _lock:
        if _depth:  # already redirected by this thread
            _depth += 1
            try:
                yield
            finally:
                _depth -= 1
            return
        with _captured_stderr() as capture:
            _depth = 1
            try:
                yield
            finally:
                _depth = 0
    _replay(capture.data)


class _Capture:
    data: bytes = b""


@contextlib.contextmanager
def _captured_stderr() -> Iterator[_Capture]:
    capture = _Capture()
    _flush_python_stderr()
    try:
        saved = os.dup(2)
    except OSError:  # no descriptor 2 at all: nothing to keep quiet
        yield capture
        return
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield capture
        finally:
            _flush_python_stderr()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            capture.data = sink.read()


def _flush_python_stderr() -> None:
    with contextlib.suppress(Exception):
        sys.stderr.flush()


def _replay(data: bytes) -> None:
    """Log the runtime's lines of ``data``; write the others to stderr."""
    others = []
    for line in data.splitlines(keepends=True):
        if RUNTIME_MESSAGE.match(line):
            logger.debug("%s", line.decode(errors="replace").rstrip())
        else:
            others.append(line)
    if others:
        with contextlib.suppress(OSError):
            os.write(2, b"".join(others))
