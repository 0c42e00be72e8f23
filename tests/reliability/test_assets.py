"""Catalogue: ``save_asset`` to a bad path gets a clear error and never destroys user data."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from coreai_torch import AIProgram, TorchConverter
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.runtime import Session


class Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


@functools.cache
def _program() -> AIProgram:
    ep = export_decomposed(Scale(), (torch.randn(3),))
    return TorchConverter().add_exported_program(ep).to_coreai()


def test_str_and_path_both_work_and_saving_again_replaces_the_asset(tmp_path: Path) -> None:
    program = _program()
    program.save_asset(str(tmp_path / "a.aimodel"))
    program.save_asset(tmp_path / "a.aimodel")  # an existing asset is replaced
    (tmp_path / "empty.aimodel").mkdir()
    program.save_asset(tmp_path / "empty.aimodel")  # so is an empty directory
    with Session(tmp_path / "a.aimodel") as session:
        (out,) = session.run({"x": torch.ones(3)}).values()
    assert out.tolist() == [2.0, 2.0, 2.0]


def test_wrong_suffix_suggests_the_right_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"must end in '.aimodel'.*use e.g. '.*model.aimodel'"):
        _program().save_asset(tmp_path / "model.mlpackage")


def test_not_a_path() -> None:
    with pytest.raises(TypeError, match=r"save_asset expects a path \(str or pathlib.Path\)"):
        _program().save_asset(42)  # type: ignore[arg-type]


def test_existing_file_or_foreign_directory_is_not_replaced(tmp_path: Path) -> None:
    file = tmp_path / "notes.aimodel"
    file.write_text("precious")
    with pytest.raises(FileExistsError, match=r"exists and is a file, not a Core AI asset"):
        _program().save_asset(file)
    assert file.read_text() == "precious"
    folder = tmp_path / "data.aimodel"
    folder.mkdir()
    (folder / "keep.txt").write_text("precious")
    with pytest.raises(FileExistsError, match=r"is a directory, not a Core AI asset; refusing"):
        _program().save_asset(folder)
    assert (folder / "keep.txt").read_text() == "precious"


def test_unwritable_location_names_the_path(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError, match=r"save_asset could not write '.*file/m.aimodel'"):
        _program().save_asset(blocker / "m.aimodel")
    with pytest.raises(OSError, match=r"could not write '/proc/m.aimodel'.*writable directory"):
        _program().save_asset("/proc/m.aimodel")
