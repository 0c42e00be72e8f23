"""Every reference to the project in its docstrings, messages and documents names something real.

Checked (``python -m tools.check_references`` prints what does not resolve and exits 1;
``make lint`` runs it):

* Sphinx roles in the package's docstrings: ``:func:`x```, ``:class:`x```, ``:mod:`x```,
  ``:data:`x```, ``:exc:`x``` and dotted ``:meth:`` / ``:attr:`` references, resolved relative
  to the module they appear in, then as absolute names (with or without the ``coreai_torch.``
  prefix).  Undotted ``:meth:`` and ``:attr:`` references are relative to the enclosing class
  and are not checked.
* Dotted names ``coreai_torch.a.b`` in the package's string literals (docstrings, error and
  warning messages), README.md, CONTRIBUTING.md and docs/*.md: each names a module or an
  attribute, and one written as a call (``coreai_torch.a.b(``) names a callable.
* The calls a message advises (``coreai_torch.a.b(`` in a string literal that is not a
  docstring) run as pasted: each is reachable in a fresh interpreter after ``import
  coreai_torch`` alone.
* File names (``x.py``, ``a/b/x.py``) in those documents and docstrings name a file of the
  repository (a path relative to the root, to ``coreai_torch/`` or to ``tests/``; a bare name
  anywhere in the repository), except the example files users write (:data:`EXAMPLE_FILES`).
"""

from __future__ import annotations

import ast
import importlib
import json
import posixpath
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ROLE = re.compile(r":(func|class|mod|data|meth|attr|exc):`~?([A-Za-z_][\w.]*)`")
DOTTED = re.compile(r"(?<![\w.])(coreai_torch(?:\.[A-Za-z_]\w*)+)(\()?")
FILE = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[A-Za-z_][\w-]*\.py)\b")
#: The documents checked besides the package's docstrings and messages.
DOCUMENTS = ("README.md", "CONTRIBUTING.md", "docs/*.md")
#: Files the documents ask users to write (``coreai-torch convert model.py:make``).
EXAMPLE_FILES = frozenset({"model.py", "custom_op.py", "file.py", "FILE.py"})
#: Packages whose source files the documents may name (``transformers/models/...py``).
OTHER_PACKAGES = ("transformers/", "torch/", "coreai/")
#: Directories searched for a bare file name.
SOURCE_DIRS = ("coreai_torch", "tests", "tools", "benchmarks")


@dataclass(frozen=True)
class Text:
    """A piece of text to check: where it is, and whether it is a message (a string literal
    of the package that is not a docstring: what users see in errors and warnings)."""

    where: str
    text: str
    message: bool = False
    #: the directory relative paths start from (a document's own; the root for docstrings)
    directory: str = ""


def _resolve_module(name: str) -> Any:
    """The object ``name`` names as a module path: the longest importable prefix, then
    attributes (``coreai_torch.llm.export.load_causal_lm``, a function of the module
    ``llm/export.py``).  Raises ``LookupError`` or ``AttributeError``."""
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


def _resolve_attribute(name: str) -> Any:
    """The object ``name`` names as Python code reads it: each part an attribute of the
    previous one, or a submodule imported for it (``coreai_torch.llm.export`` is the function
    the package exports, not its module of that name).  Raises ``LookupError``."""
    parts = name.split(".")
    try:
        obj = importlib.import_module(parts[0])
    except ImportError:
        raise LookupError(name) from None
    for i, part in enumerate(parts[1:], 2):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            raise LookupError(name) from None
    return obj


def _meanings(name: str) -> list[Any]:
    """What ``name`` may name (as code reads it, and as a module path), possibly nothing."""
    found = []
    for resolve in (_resolve_attribute, _resolve_module):
        try:
            found.append(resolve(name))
        except (LookupError, AttributeError):
            continue
    return found


def _resolves(name: str) -> bool:
    return bool(_meanings(name))


# ----------------------------------------------------------------------------- sources ----


def _module_name(path: Path, root: Path) -> str:
    return ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")


def _docstring_nodes(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def python_texts(path: Path, root: Path = ROOT) -> Iterator[Text]:
    """The string literals of one source file (f-string pieces included), docstrings and
    messages told apart."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = _docstring_nodes(tree)
    relative = path.relative_to(root)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield Text(f"{relative}:{node.lineno}", node.value, id(node) not in docstrings)


def document_texts(root: Path = ROOT) -> Iterator[Text]:
    for pattern in DOCUMENTS:
        for path in sorted(root.glob(pattern)):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                where = f"{path.relative_to(root)}:{number}"
                yield Text(where, line, directory=path.parent.relative_to(root).as_posix())


# ------------------------------------------------------------------------------ checks ----


def role_problems(path: Path, root: Path = ROOT) -> list[str]:
    """``path: :role:`name``` for every Sphinx reference of ``path`` that names nothing."""
    module = _module_name(path, root)
    found = []
    for role, name in ROLE.findall(path.read_text()):
        if role in ("meth", "attr") and "." not in name:
            continue
        if not any(_resolves(c) for c in (f"{module}.{name}", name, f"coreai_torch.{name}")):
            found.append(f"{path.relative_to(root)}: :{role}:`{name}`")
    return found


def advised_calls(texts: Iterable[Text]) -> dict[str, str]:
    """``name -> where`` for every ``coreai_torch.a.b(`` call a message advises."""
    calls: dict[str, str] = {}
    for text in texts:
        if text.message:
            for name, call in DOTTED.findall(text.text):
                if call:
                    calls.setdefault(name, text.where)
    return calls


def dotted_problems(texts: Iterable[Text]) -> list[str]:
    """Every ``coreai_torch.a.b`` that names nothing, or is written as a call of something
    that is not callable."""
    found = []
    for text in texts:
        for name, call in DOTTED.findall(text.text):
            meanings = _meanings(name)
            if not meanings:
                found.append(f"{text.where}: {name} does not exist")
            elif call and not any(callable(m) for m in meanings):
                kind = type(meanings[0]).__name__
                found.append(f"{text.where}: {name}(...) calls a {kind}, which is not callable")
    return found


_REACHABLE = """
import json, sys
import coreai_torch
result = {}
for name in json.loads(sys.argv[1]):
    obj = coreai_torch
    try:
        for attribute in name.split(".")[1:]:
            obj = getattr(obj, attribute)
        result[name] = callable(obj)
    except AttributeError:
        result[name] = False
print(json.dumps(result))
"""


def unreachable_calls(calls: dict[str, str], root: Path = ROOT) -> list[str]:
    """The advised calls that ``import coreai_torch`` alone does not make callable (checked in
    a fresh interpreter, where no other module of the package was imported)."""
    if not calls:
        return []
    done = subprocess.run(
        [sys.executable, "-c", _REACHABLE, json.dumps(sorted(calls))],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
    )
    reachable = json.loads(done.stdout.strip().splitlines()[-1])
    return [
        f"{calls[name]}: {name}(...) does not run after `import coreai_torch` alone"
        for name in sorted(calls)
        if not reachable[name]
    ]


def _repository_files(root: Path) -> tuple[set[str], set[str]]:
    paths, names = set(), set()
    for directory in SOURCE_DIRS:
        for path in (root / directory).rglob("*.py"):
            paths.add(path.relative_to(root).as_posix())
            names.add(path.name)
    return paths, names


def file_problems(texts: Iterable[Text], root: Path = ROOT) -> list[str]:
    """Every file name that names no file of the repository."""
    paths, names = _repository_files(root)
    found = []
    for text in texts:
        for name in FILE.findall(text.text):
            if name in EXAMPLE_FILES or name.startswith(OTHER_PACKAGES):
                continue
            if "/" not in name:
                exists = name in names
            elif name.startswith("../"):
                exists = posixpath.normpath(posixpath.join(text.directory, name)) in paths
            else:
                exists = any(
                    f"{prefix}{name}" in paths for prefix in ("", "coreai_torch/", "tests/")
                )
            if not exists:
                found.append(f"{text.where}: {name} is not a file of the repository")
    return found


def unresolved(root: Path = ROOT) -> list[str]:
    """Every reference of the package and its documents that names nothing (see the module
    docstring)."""
    sys.path.insert(0, str(root))
    found: list[str] = []
    texts: list[Text] = []
    for path in sorted((root / "coreai_torch").rglob("*.py")):
        found += role_problems(path, root)
        texts += python_texts(path, root)
    documents = list(document_texts(root))
    found += dotted_problems([*texts, *documents])
    found += unreachable_calls(advised_calls(texts), root)
    found += file_problems([*(t for t in texts if not t.message), *documents], root)
    return found


def main() -> int:
    problems = unresolved()
    for problem in problems:
        print(problem)
    print(f"{len(problems)} unresolved references")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
