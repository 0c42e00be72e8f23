"""What the coverage table claims: every op a decomposed program can contain is handled.

``run_decompositions(get_decomp_table())`` leaves Core ATen ops, the composites the table
keeps, the ops real programs carry (asserts, sizes, views...) and ops without a PyTorch
decomposition (those the OpInfo sweep met are read from its results file).  Each must be
lowered, decomposed by the table, left out (backward / random / dropout), or listed in
``tools.ops_table.KNOWN_GAPS`` with a reason — a strict xfail, so lowering it
shows up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from coreai_torch import get_decomp_table
from coreai_torch.frontend.export import COMPOSITE_OPS
from coreai_torch.lowerings import BUILTIN_LOWERINGS
from tests.opinfo import results
from tools import ops_table as coverage


def _names() -> list[str]:
    names = set(coverage.core_aten_ops()) | set(coverage.composite_ops())
    names |= set(coverage.PROGRAM_OPS) | set(coverage.KNOWN_GAPS)
    data = results.load_results()
    if data:
        names.update(data["ops"])
    return sorted(n for n in names if not coverage.left_out_reason(n))


def _params() -> list[Any]:
    params = []
    for name in _names():
        marks = []
        if name in coverage.KNOWN_GAPS:
            marks.append(pytest.mark.xfail(reason=coverage.KNOWN_GAPS[name], strict=True))
        params.append(pytest.param(name, id=name, marks=marks))
    return params


_DECOMPOSED = coverage.decomposed_ops()
_LOWERED = BUILTIN_LOWERINGS.names()


@pytest.mark.parametrize("name", _params())
def test_op_is_lowered(name: str) -> None:
    status = coverage.op_status(name, _LOWERED, _DECOMPOSED)
    assert status.supported, (
        f"{name} can appear in a decomposed program but has no lowering and "
        "get_decomp_table() does not decompose it: lower it, or list it in "
        "tools.ops_table.KNOWN_GAPS with the reason"
    )


def test_core_aten_set() -> None:
    core = coverage.core_aten_ops()
    # 189 overloads are listed by iterating torch.ops.aten; the dispatcher also knows
    # adaptive_avg_pool1d, avg_pool1d, resize_ and sym_is_contiguous.
    assert len(core) == 193
    assert "aten::add.Tensor" in core and "aten::avg_pool1d.default" in core


def test_decomp_table_keeps_composites() -> None:
    table = get_decomp_table()
    for op in COMPOSITE_OPS:
        assert op not in table, f"get_decomp_table() must keep {op} for its composite lowering"


def test_known_gaps_are_not_left_out() -> None:
    left = [n for n in coverage.KNOWN_GAPS if coverage.left_out_reason(n)]
    assert not left, f"left-out ops need no KNOWN_GAPS entry: {left}"


def test_render_covers_every_core_op() -> None:
    fake = {
        "meta": {
            "torch": "x",
            "coreai_core": "y",
            "date": "d",
            "seconds": 1.0,
            "jobs": 1,
            "float32_cap": 16,
            "other_cap": 8,
        },
        "totals": {
            "entries": 1,
            "left_out": 0,
            "float32_pass": 1,
            "by_status": {"float32 pass": 1},
            "samples": {"pass": 2},
            "aborts": 0,
        },
        "left_out": {"bernoulli": "random numbers"},
        "ops": {"aten::add.Tensor": {"verified": ["float32"], "entries": 1, "failing": []}},
        "entries": {
            "add": {
                "left_out": None,
                "errors": [],
                "dtypes": {
                    "float32": {
                        "status": "pass",
                        "tested": 2,
                        "counts": {"pass": 2},
                        "failures": [],
                    }
                },
            }
        },
    }
    text = coverage.render(fake)
    for name in coverage.core_aten_ops():
        assert f"| `{name}` |" in text
    row = next(line for line in text.splitlines() if line.startswith("| `aten::add.Tensor` |"))
    assert "native" in row and "float32" in row
    assert "| `add` | ✅ 2/2 |" in text


def test_the_ops_table_reads_the_recorded_sweep() -> None:
    """``make ops-table`` finds its inputs (the sweep's results, the page it writes) and the
    table it generates has the OpInfo sections (a wrong results path used to drop them)."""
    assert coverage.RESULTS_FILE.is_file(), f"{coverage.RESULTS_FILE} is missing"
    assert (coverage.ROOT / "docs" / "ops.md").is_file()
    text = coverage.render(coverage.load(coverage.RESULTS_FILE))
    for section in ("## OpInfo sweep", "## OpInfo entries", "## Core ATen ops"):
        assert f"\n{section}" in text, f"the generated table has no {section!r} section"
    assert "without the OpInfo sweep" not in text
    published = (coverage.ROOT / "docs" / "ops.md").read_text()
    assert "\n## OpInfo sweep" in published and "\n## OpInfo entries" in published


def test_the_ops_table_refuses_a_missing_results_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no OpInfo sweep results"):
        coverage.main(["--results", str(tmp_path / "missing.json")])
