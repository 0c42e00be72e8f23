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


def test_every_docstring_reference_resolves() -> None:
    assert check_references.unresolved(ROOT) == []


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
    ],
)
def test_each_rule_is_enforced(tmp_path: Path, files: dict[str, str], expected: str) -> None:
    problems = check_layout.check(_tree(tmp_path, files))
    assert any(expected in p for p in problems), problems


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
