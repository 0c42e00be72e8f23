"""The package layout stays readable: checked from the source with ``ast``.

Counts, over every ``import`` in ``coreai_torch`` (imports inside functions included):

* top-level modules of the package (at most ``MAX_TOP_LEVEL``);
* import cycles between modules (none allowed);
* private names imported across modules (``from a import _b`` where ``a`` is another module;
  none allowed), and imports of private modules from outside their own package;
* upward imports between layers (``LAYERS``: a module never imports a layer above it);
* imports between lowering families: a module of ``lowerings/`` holds one op family and takes
  what it shares with others from ``lowerings/helpers/`` and the registry, never from another
  family (nor does a helper import a family);
* every lowering family has its test module, ``tests/lowerings/test_<family>.py`` (checked
  when the tree has a ``tests/`` folder);
* third-party libraries (``LIBRARIES``): which modules may import each (torch's tracing and FX
  never in the IR, passes or compression; coreai-core's MLIR layers only through ``_mlir``;
  transformers only in the model-specific layers, inside functions where ``import
  coreai_torch`` would otherwise need it), and no library that no rule names.

``python -m tools.check_layout`` prints what it finds and exits 1 on any violation
(``make lint`` runs it).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "coreai_torch"
MAX_TOP_LEVEL = 12

# Layers from bottom to top: a module may import its own layer and those below it.
# A module not listed belongs to the layer of its nearest listed parent.
LAYERS: list[tuple[str, ...]] = [
    (  # leaves
        "coreai_torch.errors",
        "coreai_torch._mlir",
        "coreai_torch.dtypes",
        "coreai_torch.locations",
        "coreai_torch.progress",
        "coreai_torch.torch_compat",
    ),
    ("coreai_torch.precision",),  # the precision policy (a public configuration)
    ("coreai_torch.tensors",),  # torch tensors whose data is elsewhere (lazy checkpoint tensors)
    ("coreai_torch.frontend",),  # torch / FX only: never imports the IR
    ("coreai_torch.ir",),  # building, checking and saving Core AI IR: never reads FX
    ("coreai_torch.composite_ops", "coreai_torch.rewrites"),  # nn.Modules
    ("coreai_torch.lowerings",),
    ("coreai_torch.importer",),
    ("coreai_torch.passes",),
    ("coreai_torch.compression",),
    (
        "coreai_torch.converter",
        "coreai_torch.program",
        "coreai_torch.runtime",
        "coreai_torch.analysis",
        "coreai_torch._utils",
    ),
    ("coreai_torch.verify",),
    ("coreai_torch.bundles",),  # the bundles Apple's app runtimes load (llm/, hf/ write them)
    (
        "coreai_torch.llm",
        "coreai_torch.hf",
        "coreai_torch.diffusers",
        "coreai_torch.examples",
        "coreai_torch._compression",
    ),
    ("coreai_torch.serve",),  # the HTTP server over llm/
    ("coreai_torch.cli", "coreai_torch"),
]

# The lowering rules: one module per op family directly under this package; what families
# share lives in these modules, which import no family.
LOWERINGS = "coreai_torch.lowerings"
LOWERING_SHARED = ("coreai_torch.lowerings.registry", "coreai_torch.lowerings.helpers")
LOWERING_NON_FAMILIES: tuple[str, ...] = ()


@dataclass(frozen=True)
class Library:
    """Which modules of the package may use a third-party library (or a part of one)."""

    #: the library's module, or a submodule with its own rule (``torch.fx``)
    name: str
    #: what it is for (shown with a violation)
    role: str
    #: the modules (name prefixes) that may use it
    only: tuple[str, ...] = (PACKAGE,)
    #: ... except these
    never: tuple[str, ...] = ()
    #: an optional dependency: imported inside functions, except in these modules
    eager_in: tuple[str, ...] | None = None


#: The torch side the IR, the passes, compression, the runtime, the bundles and the server
#: never see: tracing, FX graphs, exported programs, fake tensors.  (The IR uses torch for
#: dtypes and tensor memory only.)
_NOT_FX = (
    "coreai_torch.ir",
    "coreai_torch.passes",
    "coreai_torch.compression",
    "coreai_torch.runtime",
    "coreai_torch.bundles",
    "coreai_torch.serve",
    "coreai_torch._mlir",
    "coreai_torch.dtypes",
    "coreai_torch.errors",
    "coreai_torch.progress",
)
#: The torch-only layers and the server: no Core AI IR (coreai-core's MLIR through
#: ``coreai_torch._mlir``).
_NO_IR = (
    "coreai_torch.precision",
    "coreai_torch.tensors",
    "coreai_torch.frontend",
    "coreai_torch.composite_ops",
    "coreai_torch.rewrites",
    "coreai_torch.serve",
)
LIBRARIES: tuple[Library, ...] = (
    Library("torch", "tensors and dtypes"),
    *(
        Library(name, "tracing / FX", never=_NOT_FX)
        for name in (
            "torch.fx",
            "torch.export",
            "torch._export",
            "torch._subclasses",
            "torch._decomp",
            "torch._dynamo",
            "torch._higher_order_ops",
        )
    ),
    Library("numpy", "arrays"),
    Library("ml_dtypes", "numpy dtypes for bfloat16 / float8 (installed with coreai-core)"),
    Library("sympy", "symbolic sizes (installed with torch)", only=("coreai_torch.frontend",)),
    Library("coreai._compiler", "coreai-core's MLIR layers", only=("coreai_torch._mlir",)),
    Library("coreai_torch._mlir", "Core AI IR (MLIR)", never=_NO_IR),
    Library(
        "coreai.authoring",
        "coreai-core's authoring API",
        only=("coreai_torch._mlir", "coreai_torch.ir.saving", "coreai_torch.importer.metal"),
    ),
    Library(
        "coreai.runtime",
        "the Core AI runtime",
        only=(
            "coreai_torch.runtime",
            "coreai_torch.ir.saving",
            "coreai_torch.bundles",
            "coreai_torch.hf",
        ),
    ),
    Library(
        "transformers",
        "Hugging Face models (an optional dependency)",
        only=(
            "coreai_torch.rewrites.moe",
            "coreai_torch.bundles",
            "coreai_torch.llm",
            "coreai_torch.hf",
            "coreai_torch.diffusers",  # a pipeline's text encoders
        ),
        eager_in=("coreai_torch.hf",),
    ),
    Library(
        "diffusers",
        "diffusers pipelines (the diffusers extra)",
        only=("coreai_torch.diffusers",),
        eager_in=(),
    ),
    Library(
        "starlette",
        "the HTTP server's application (the serve extra)",
        only=("coreai_torch.serve",),
        eager_in=("coreai_torch.serve.app",),
    ),
    Library(
        "uvicorn", "the HTTP server (the serve extra)", only=("coreai_torch.serve",), eager_in=()
    ),
    # the tests' HTTP client (the test extra): the server answers HTTP, it never sends it
    Library("httpx", "an HTTP client (a test dependency)", only=()),
    Library(
        "jinja2",
        "chat templates (optional; installed with transformers)",
        only=("coreai_torch.bundles",),
        eager_in=(),
    ),
    Library(
        "PIL",
        "images: the reference VLM driver's preprocessing (optional; the test extra)",
        only=("coreai_torch.bundles",),
        eager_in=(),
    ),
    Library(
        "rich",
        "progress bars (the cli extra)",
        only=("coreai_torch.progress", "coreai_torch.cli"),
        eager_in=(),
    ),
)


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    imports: list[tuple[str, int]] = field(default_factory=list)  # (module, line)
    private_names: list[tuple[str, str, int]] = field(default_factory=list)  # (module, name, line)
    #: (library module or attribute path, line, at module level) for every third-party use
    libraries: list[tuple[str, int, bool]] = field(default_factory=list)


def discover(root: Path) -> dict[str, Module]:
    """Every module of the package under ``root`` (the directory holding the package)."""
    modules: dict[str, Module] = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        modules[".".join(parts)] = Module(".".join(parts), path, is_package)
    return modules


def _resolve(module: Module, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = module.name.split(".")
    if not module.is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join([*base, target] if target else base)


def _owner(name: str, modules: dict[str, Module]) -> str | None:
    """The package module ``name`` refers to (itself, or its nearest parent that exists)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _dotted(node: ast.expr) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _third_party(name: str) -> bool:
    top = name.split(".")[0]
    return top != "__future__" and top not in sys.stdlib_module_names


def _library_uses(tree: ast.Module) -> list[tuple[str, int, bool]]:
    """Every third-party library a module imports or reaches through an imported name
    (``torch.fx.Node`` after ``import torch``), with whether it happens at module level."""
    uses: list[tuple[str, int, bool]] = []
    aliases: dict[str, str] = {}  # local name -> library module

    def visit(node: ast.AST, eager: bool) -> None:
        function = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        if function or (isinstance(node, ast.If) and _is_type_checking(node)):
            eager = False
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE + ".") and alias.name != PACKAGE + "._mlir":
                    continue
                if _third_party(alias.name) or alias.name == PACKAGE + "._mlir":
                    uses.append((alias.name, node.lineno, eager))
                    local = alias.asname or alias.name.split(".")[0]
                    aliases[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == PACKAGE and any(a.name == "_mlir" for a in node.names):
                uses.append((PACKAGE + "._mlir", node.lineno, eager))
            elif node.module == PACKAGE + "._mlir" or (
                not node.module.startswith(PACKAGE) and _third_party(node.module)
            ):
                for alias in node.names:
                    uses.append((f"{node.module}.{alias.name}", node.lineno, eager))
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            dotted = _dotted(node)
            root = dotted.split(".")[0] if dotted else None
            if dotted and root in aliases:
                uses.append((aliases[root] + dotted[len(root) :], node.lineno, eager))
                return  # the chain's inner attributes name less of the same path
        for child in ast.iter_child_nodes(node):
            visit(child, eager)

    visit(tree, True)
    return uses


def library_of(name: str) -> Library | None:
    """The rule for ``name`` (a module or attribute path): the longest library prefix."""
    best = None
    for library in LIBRARIES:
        if (name == library.name or name.startswith(library.name + ".")) and (
            best is None or len(library.name) > len(best.name)
        ):
            best = library
    return best


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def library_problems(module: Module) -> list[str]:
    """The module's uses of third-party libraries that ``LIBRARIES`` does not allow."""
    problems = []
    for name, line, eager in module.libraries:
        library = library_of(name)
        where = f"{module.path}:{line}: {module.name}"
        if library is None:
            problems.append(
                f"{where} imports {name.split('.')[0]}, a library no rule allows "
                "(add it to LIBRARIES in tools/check_layout.py and to pyproject.toml)"
            )
        elif not _within(module.name, library.only) or _within(module.name, library.never):
            problems.append(f"{where} uses {name} ({library.role}), which it may not")
        elif eager and library.eager_in is not None and not _within(module.name, library.eager_in):
            problems.append(
                f"{where} imports {name} ({library.role}) at module level: import it "
                "inside the function that needs it"
            )
    return problems


def parse(modules: dict[str, Module]) -> None:
    """Fill in every module's imports (inside functions too), private-name imports and uses
    of third-party libraries."""
    for module in modules.values():
        tree = ast.parse(module.path.read_text(), str(module.path))
        module.libraries = _library_uses(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    owner = _owner(alias.name, modules)
                    if owner:
                        module.imports.append((owner, node.lineno))
            elif isinstance(node, ast.ImportFrom):
                source = _resolve(module, node.level, node.module)
                if not source.startswith(PACKAGE):
                    continue
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    if submodule in modules:
                        module.imports.append((submodule, node.lineno))
                        continue
                    owner = _owner(source, modules)
                    if owner is None:
                        continue
                    module.imports.append((owner, node.lineno))
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        module.private_names.append((owner, alias.name, node.lineno))


def _private_module(name: str) -> str | None:
    """The package whose own a private module ``name`` is (``a.b._c`` -> ``a.b``)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i])
    return None


def layer_of(name: str) -> int | None:
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for index, layer in enumerate(LAYERS):
        for prefix in layer:
            if (name == prefix or name.startswith(prefix + ".")) and (
                best is None or len(prefix) > best[0]
            ):
                best = (len(prefix), index)
    return None if best is None else best[1]


def is_lowering_family(name: str) -> bool:
    """Whether ``name`` is an op-family module of the lowerings (``lowerings/<family>.py``)."""
    parent, _, _ = name.rpartition(".")
    return (
        parent == LOWERINGS
        and not _within(name, LOWERING_SHARED)
        and not _within(name, LOWERING_NON_FAMILIES)
    )


def lowering_import_problem(source: str, target: str) -> str | None:
    """Why ``source`` may not import ``target`` under the lowering-family rule, if it may not."""
    if target == source or not _within(target, (LOWERINGS,)):
        return None
    importer_is_family = is_lowering_family(source)
    if not (importer_is_family or _within(source, LOWERING_SHARED)):
        return None
    if not (is_lowering_family(target) or target == LOWERINGS):
        return None
    if importer_is_family:
        return (
            f"lowering family {source} imports the family {target}: what families share "
            f"belongs in {LOWERING_SHARED[1]}"
        )
    return f"lowering helper {source} imports the family {target}: helpers import no family"


def cycles(modules: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    graph = {
        name: sorted({target for target, _ in m.imports if target != name and target in modules})
        for name, m in modules.items()
    }
    # A package's __init__ importing its own submodules is not a cycle through the submodule.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(graph[start]))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(graph[nxt])))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def _is_package_init_edge(source: str, target: str) -> bool:
    """``pkg/__init__`` re-exporting ``pkg.sub`` (or ``pkg.sub`` importing its ``pkg``)."""
    return target.startswith(source + ".") or source.startswith(target + ".")


def missing_lowering_tests(root: Path, modules: dict[str, Module]) -> list[str]:
    """The lowering families without ``tests/lowerings/test_<family>.py`` under ``root``."""
    if not (root / "tests").is_dir():
        return []
    return [
        f"{m.path}: the lowering family {name} has no test module "
        f"tests/lowerings/test_{name.rpartition('.')[2]}.py"
        for name, m in modules.items()
        if is_lowering_family(name)
        and not (root / "tests" / "lowerings" / f"test_{name.rpartition('.')[2]}.py").is_file()
    ]


def check(root: Path) -> list[str]:
    modules = discover(root)
    parse(modules)
    problems: list[str] = missing_lowering_tests(root, modules)

    top = sorted(name for name, m in modules.items() if name.count(".") == 1 and not m.is_package)
    if len(top) > MAX_TOP_LEVEL:
        problems.append(f"{len(top)} top-level modules (at most {MAX_TOP_LEVEL}): {top}")

    # Cycles, ignoring the edges between a package's __init__ and its own submodules.
    pruned = {
        name: Module(
            m.name,
            m.path,
            m.is_package,
            [(t, line) for t, line in m.imports if not _is_package_init_edge(name, t)],
        )
        for name, m in modules.items()
    }
    for component in cycles(pruned):
        problems.append("import cycle: " + " <-> ".join(component))

    for name, m in modules.items():
        problems += library_problems(m)
        for owner, private, line in m.private_names:
            if owner != name:
                problems.append(f"{m.path}:{line}: imports private {owner}.{private}")
        for target, line in m.imports:
            home = _private_module(target)
            if home is not None and not (name == home or name.startswith(home + ".")):
                problems.append(f"{m.path}:{line}: imports private module {target}")
            family_problem = lowering_import_problem(name, target)
            if family_problem is not None:
                problems.append(f"{m.path}:{line}: {family_problem}")
            source_layer, target_layer = layer_of(name), layer_of(target)
            if (
                source_layer is not None
                and target_layer is not None
                and target_layer > source_layer
                and not _is_package_init_edge(name, target)
            ):
                problems.append(
                    f"{m.path}:{line}: {name} (layer {source_layer}) imports "
                    f"{target} (layer {target_layer}), a layer above it"
                )
    return list(dict.fromkeys(problems))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    args = parser.parse_args(argv)
    problems = check(args.root)
    for problem in problems:
        print(problem)
    modules = discover(args.root)
    top = [n for n, m in modules.items() if n.count(".") == 1 and not m.is_package]
    print(f"{len(modules)} modules, {len(top)} top-level; {len(problems)} layout problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
