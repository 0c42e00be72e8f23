"""Known failures of the OpInfo sweep — data, not code.

``EXPECTED_FAILURES`` maps an OpInfo id (``name`` or ``name.variant``) to the reason it fails,
either for every swept dtype (a string) or per dtype (``{"float32": "...", "bool": "..."}``).
The sweep's tests are strict xfails: when a fix makes an entry pass, the test reports an
unexpected pass and the entry must be removed here.

``TOLERANCES`` widens the float comparison ``(atol, rtol)`` for entries whose PyTorch reference
itself is computed differently (say why next to each entry).
"""

from __future__ import annotations

EXPECTED_FAILURES: dict[str, str | dict[str, str]] = {}

TOLERANCES: dict[str, tuple[float, float]] = {}
