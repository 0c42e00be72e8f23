"""The package layout stays readable: the checks ``make lint`` runs, on the package and on
small trees that break each rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools import check_layout, check_references

ROOT = Path(__file__).resolve().parents[1]


def test_the_package_keeps_its_layout() -> None:
    assert check_layout.check(ROOT) == []
    modules = check_layout.discover(ROOT)
    top = [n for n, m in modules.items() if n.count(".") == 1 and not m.is_package]
    assert len(top) <= check_layout.MAX_TOP_LEVEL


def test_every_reference_resolves() -> None:
    assert check_references.unresolved(ROOT) == []


def test_advice_naming_a_module_as_a_function_is_caught() -> None:
    """The half-precision warning used to advise ``coreai_torch.verify(...)``: a package."""
    Text = check_references.Text
    old = Text("precision_checks.py:161", "check with coreai_torch.verify(model, args, ", True)
    new = Text("precision_checks.py:161", "check with coreai_torch.verify.verify(model, ", True)
    (problem,) = check_references.dotted_problems([old])
    assert "coreai_torch.verify(...) calls a module, which is not callable" in problem
    assert check_references.dotted_problems([new]) == []
    missing = Text("README.md:1", "`coreai_torch.verify.verify_all(model, args)`")
    assert "does not exist" in check_references.dotted_problems([missing])[0]


def test_advice_needs_only_import_coreai_torch() -> None:
    """A message's call must run as pasted: reachable after ``import coreai_torch`` alone (the
    ``hf`` package, which needs transformers, is not imported by it)."""
    calls = {"coreai_torch.verify.verify": "a", "coreai_torch.hf.CoreAIModelForCausalLM": "b"}
    problems = check_references.unreachable_calls(calls, ROOT)
    assert problems == [
        "b: coreai_torch.hf.CoreAIModelForCausalLM(...) does not run after "
        "`import coreai_torch` alone"
    ]


def test_a_document_naming_a_missing_file_is_caught() -> None:
    """docs/data_movement.md used to name ``decomp.py`` (now ``frontend/export.py``)."""
    Text = check_references.Text
    old = Text("docs/data_movement.md:34", "(`NATIVE_OPS` in `decomp.py`)", directory="docs")
    (problem,) = check_references.file_problems([old], ROOT)
    assert problem == "docs/data_movement.md:34: decomp.py is not a file of the repository"
    fine = [
        Text(
            "docs/x.md:1", "`coreai_torch/frontend/export.py`, `../tools/compat.py`", False, "docs"
        ),
        Text("docs/x.md:2", "`reliability/test_values.py`, `check_layout.py`", False, "docs"),
        Text("docs/x.md:3", "coreai-torch convert model.py:make", False, "docs"),
    ]
    assert check_references.file_problems(fine, ROOT) == []
    moved = Text("docs/x.md:4", "`coreai_torch/lowerings/coverage.py`", False, "docs")
    assert check_references.file_problems([moved], ROOT)


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / "coreai_torch" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for directory in [tmp_path / "coreai_torch", *(tmp_path / "coreai_torch").rglob("*")]:
        if directory.is_dir() and not (directory / "__init__.py").exists():
            (directory / "__init__.py").write_text("")
    return tmp_path


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        pytest.param(
            {
                "ir/a.py": "def f():\n    from coreai_torch.ir import b\n",
                "ir/b.py": "from coreai_torch.ir.a import f\n",
            },
            "import cycle: coreai_torch.ir.a <-> coreai_torch.ir.b",
            id="a cycle through an import inside a function",
        ),
        pytest.param(
            {"ir/a.py": "_x = 1\n", "ir/b.py": "from coreai_torch.ir.a import _x\n"},
            "imports private coreai_torch.ir.a._x",
            id="a private name of another module",
        ),
        pytest.param(
            {"ir/a.py": "from coreai_torch.passes import b\n", "passes/b.py": ""},
            "a layer above it",
            id="an import from a higher layer",
        ),
        pytest.param(
            {
                "lowerings/a.py": "from coreai_torch.lowerings.b import f\n",
                "lowerings/b.py": "def f(): ...\n",
            },
            "lowering family coreai_torch.lowerings.a imports the family",
            id="a lowering family importing another family",
        ),
        pytest.param(
            {
                "lowerings/helpers/h.py": "from coreai_torch.lowerings import b\n",
                "lowerings/b.py": "",
            },
            "lowering helper coreai_torch.lowerings.helpers.h imports the family",
            id="a lowering helper importing a family",
        ),
        pytest.param(
            {f"m{i}.py": "" for i in range(check_layout.MAX_TOP_LEVEL + 1)},
            "top-level modules",
            id="too many top-level modules",
        ),
        pytest.param(
            {"ir/a.py": "import torch.fx\n"},
            "coreai_torch.ir.a uses torch.fx (tracing / FX), which it may not",
            id="FX imported by the IR",
        ),
        pytest.param(
            {"ir/a.py": "import torch\n\ndef f(node: torch.fx.Node) -> None: ...\n"},
            "coreai_torch.ir.a uses torch.fx.Node (tracing / FX), which it may not",
            id="FX reached through torch by the IR",
        ),
        pytest.param(
            {"frontend/a.py": "from coreai_torch._mlir import ir\n", "_mlir.py": ""},
            "coreai_torch.frontend.a uses coreai_torch._mlir.ir (Core AI IR (MLIR))",
            id="MLIR imported by the frontend",
        ),
        pytest.param(
            {"passes/a.py": "from coreai._compiler import ir\n"},
            "uses coreai._compiler.ir (coreai-core's MLIR layers), which it may not",
            id="coreai-core's MLIR imported around the gateway",
        ),
        pytest.param(
            {"lowerings/a.py": "def f():\n    import transformers\n"},
            "coreai_torch.lowerings.a uses transformers",
            id="transformers in a lowering",
        ),
        pytest.param(
            {"llm/a.py": "import transformers\n"},
            "imports transformers (Hugging Face models (an optional dependency)) at module level",
            id="an optional dependency imported at module level",
        ),
        pytest.param(
            {"ir/a.py": "import scipy.linalg\n"},
            "imports scipy, a library no rule allows",
            id="a library no rule names",
        ),
    ],
)
def test_each_rule_is_enforced(tmp_path: Path, files: dict[str, str], expected: str) -> None:
    problems = check_layout.check(_tree(tmp_path, files))
    assert any(expected in p for p in problems), problems


def test_allowed_library_uses_pass(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "ir/a.py": "import numpy as np\nimport torch\n\nX = torch.float32\n",
            "llm/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    import transformers\ndef f():\n    import transformers\n",
            "hf/a.py": "import transformers\nfrom coreai.runtime import NDArray\n",
            "frontend/a.py": "import torch.fx\nimport sympy\n",
        },
    )
    assert check_layout.check(root) == []


def test_lowering_families_may_import_helpers_and_the_registry(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "lowerings/registry.py": "",
            "lowerings/helpers/h.py": "from coreai_torch.lowerings.registry import x\n",
            "lowerings/a.py": "from coreai_torch.lowerings.helpers.h import f\n"
            "from coreai_torch.lowerings.registry import x\n",
        },
    )
    assert check_layout.check(root) == []


def test_every_lowering_family_has_its_test_module(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"lowerings/registry.py": "", "lowerings/helpers/h.py": ""})
    (root / "coreai_torch" / "lowerings" / "norm.py").write_text("")
    assert check_layout.check(root) == []  # no tests/ folder: not checked
    (root / "tests" / "lowerings").mkdir(parents=True)
    assert check_layout.check(root) == [
        f"{root / 'coreai_torch' / 'lowerings' / 'norm.py'}: the lowering family "
        "coreai_torch.lowerings.norm has no test module tests/lowerings/test_norm.py"
    ]
    (root / "tests" / "lowerings" / "test_norm.py").write_text("")
    assert check_layout.check(root) == []


def test_a_package_init_importing_its_own_modules_is_no_cycle(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {"ir/__init__.py": "from coreai_torch.ir.a import f\n", "ir/a.py": "def f(): ...\n"},
    )
    assert check_layout.check(root) == []


def test_ci_checks_the_rules_before_the_tests() -> None:
    """``.ci/run`` runs ``make lint`` (ruff, mypy, layout, references), then ``make test``; and
    ``make lint`` runs every checker."""
    steps = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert steps.index("make lint") < steps.index("make test")
    makefile = (ROOT / "Makefile").read_text()
    lint = makefile.split("\nlint:", 1)[1].split("\n\n", 1)[0]
    for tool in ("ruff check", "ruff format --check", "mypy", "check_layout", "check_references"):
        assert tool in lint, f"make lint does not run {tool}"
