"""Every Sphinx-style reference in the package's docstrings names something that exists.

``:func:`x```, ``:class:`x```, ``:mod:`x```, ``:data:`x```, ``:exc:`x``` and dotted
``:meth:`` / ``:attr:`` references are resolved relative to the module they appear in, then
as absolute names (with or without the ``coreai_torch.`` prefix).  Undotted ``:meth:`` and
``:attr:`` references are relative to the enclosing class and are not checked.

``python -m tools.check_references`` prints the unresolved ones and exits 1 if there are any
(``make lint`` runs it).
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ROLE = re.compile(r":(func|class|mod|data|meth|attr|exc):`~?([A-Za-z_][\w.]*)`")


def _resolve(name: str) -> Any:
    """The object ``name`` (a dotted path through modules and attributes), or raise."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attribute in parts[i:]:
            obj = getattr(obj, attribute)
        return obj
    raise LookupError(name)


def unresolved(root: Path = ROOT) -> list[str]:
    """``path: :role:`name``` for every reference that names nothing."""
    sys.path.insert(0, str(root))
    found = []
    for path in sorted((root / "coreai_torch").rglob("*.py")):
        module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        for role, name in ROLE.findall(path.read_text()):
            if role in ("meth", "attr") and "." not in name:
                continue
            for candidate in (f"{module}.{name}", name, f"coreai_torch.{name}"):
                try:
                    _resolve(candidate)
                    break
                except (LookupError, AttributeError):
                    continue
            else:
                found.append(f"{path.relative_to(root)}: :{role}:`{name}`")
    return found


def main() -> int:
    problems = unresolved()
    for problem in problems:
        print(problem)
    print(f"{len(problems)} unresolved docstring references")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
