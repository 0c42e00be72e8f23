"""The notebooks in ``docs/`` run top to bottom in a real Jupyter kernel (``nbclient`` +
``ipykernel``): the synchronous API inside the kernel's running event loop, top-level
``await`` of the async API -- and no runtime chatter on stderr."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "docs").glob("*.ipynb"))

pytestmark = pytest.mark.xdist_group("notebooks")


def test_there_is_a_notebook() -> None:
    assert NOTEBOOKS, "docs/ has no notebook"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_in_a_kernel(path: Path, tmp_path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # raises CellExecutionError naming the cell that failed
    stderr = [
        output.get("text", "")
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
        if output.get("name") == "stderr"
    ]
    assert not any("ODIE" in text for text in stderr), stderr
    assert all(cell.get("execution_count") for cell in notebook.cells if cell.cell_type == "code")
