"""What names a composite op: the syntax of its name and the version it records by default.

Shared by :class:`~coreai_torch.frontend.externalize.ExternalizeSpec` (which checks a name when
the spec is made) and :mod:`coreai_torch.ir.composite` (which writes the declaration).
"""

from __future__ import annotations

import re

#: Every composite op records a version; this one is used when none is given.
DEFAULT_VERSION = 1

_OP_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:]*$")


def is_op_name(name: str) -> bool:
    """Whether ``name`` can name a composite op (``rms_norm``, ``my_lib.attention``, ...)."""
    return bool(_OP_NAME.match(name))
