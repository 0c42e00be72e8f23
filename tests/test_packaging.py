"""The distribution: ``__version__`` from the package metadata, and ``python -m build`` giving
an sdist and a wheel (built from the sdist) that carry the whole package, the console script
and the dependency ranges.  The wheel installed beside other torch releases, outside the source
tree, is ``make test-compat`` (tools/compat.py)."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from email.parser import HeaderParser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

import coreai_torch

ROOT = Path(__file__).resolve().parent.parent


def test_version_comes_from_the_package_metadata() -> None:
    version = importlib.metadata.version("coreai-torch-converter")
    assert coreai_torch.__version__ == version
    script = Path(sys.executable).parent / "coreai-torch"
    shown = subprocess.run([script, "--version"], capture_output=True, text=True, check=True)
    assert shown.stdout.startswith(f"coreai-torch {version} (torch "), shown.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``python -m build`` (sdist, then the wheel from it) of the files git tracks."""
    if not (ROOT / "pyproject.toml").is_file():
        pytest.fail("needs the source tree (this test is not part of the compat subset)")
    from tools.compat import tracked_source

    work = tmp_path_factory.mktemp("dist")
    src = tracked_source(work / "src")
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", work / "dist", src],
        check=True,
        capture_output=True,
    )
    return work / "dist"


def package_files() -> set[str]:
    """Every file of the package as git tracks it (what the wheel must hold)."""
    listed = subprocess.run(
        ["git", "-C", ROOT, "ls-files", "coreai_torch"], capture_output=True, text=True, check=True
    )
    return set(listed.stdout.split())


def test_the_wheel_holds_the_whole_package_and_its_script(dist: Path) -> None:
    (wheel,) = dist.glob("*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (info,) = {n.split("/")[0] for n in names if ".dist-info/" in n}
        metadata = HeaderParser().parsestr(archive.read(f"{info}/METADATA").decode())
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
    packaged = {n for n in names if not n.startswith(info)}
    # a file added under coreai_torch/ that is not .py needs [tool.setuptools.package-data]
    assert packaged == package_files()
    assert "coreai_torch/py.typed" in packaged
    assert "coreai-torch = coreai_torch.cli:main" in entry_points

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert metadata["Name"] == project["name"]
    assert metadata["Version"] == project["version"]
    assert SpecifierSet(metadata["Requires-Python"]) == SpecifierSet(">=3.11,<3.14")
    requires = {r.name: r.specifier for r in map(Requirement, metadata.get_all("Requires-Dist"))}
    assert requires["torch"] == SpecifierSet(">=2.12,<2.15")
    assert requires["coreai-core"] == SpecifierSet("==1.0.0b3")


def test_the_sdist_builds_the_same_package(dist: Path) -> None:
    (sdist,) = dist.glob("*.tar.gz")
    with tarfile.open(sdist) as archive:
        top = archive.getnames()[0].split("/")[0]
        names = {n.removeprefix(f"{top}/") for n in archive.getnames()}
    assert {"pyproject.toml", "README.md", "CHANGELOG.md"} <= names
    assert package_files() <= names
