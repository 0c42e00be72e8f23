"""``make test-compat``: does the released package work with this Python and this torch?

    python3.12 tools/compat.py --torch 2.14.1 [--numpy 2.3.0] [--keep] [--workdir DIR]

Runs with the Python under test (standard library only, no project venv needed):

1. builds an sdist and a wheel with ``python -m build`` from the files git tracks (the wheel
   is built from the sdist, as pip would);
2. creates a fresh venv, installs exactly the requested torch (and numpy);
3. installs the wheel and checks it left torch (and numpy) as they were;
4. installs the ``test`` extra with torch held at the requested version;
5. from a directory outside the source tree: checks ``coreai_torch`` comes from the venv,
   runs ``coreai-torch demo`` and the test subset (seed examples, model families, CLI) against
   the installed package.

Prints one Markdown row for the matrix in docs/compatibility.md and appends it to
``<tmp>/coreai-torch-compat/results.md``. Torch other than 2.13.0 on Python 3.11 comes as a
CUDA build (several GB): the venv is removed afterwards unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "coreai-torch-converter"

#: What runs against the installed wheel: the seed examples verbatim, a few model families
#: (transformers' GPT-2/Llama/BERT/ViT from configs, a ResNet, torch.nn models, a KV-cache
#: decode), the command line (its installed console script included), the torch-version
#: module, the recurrent-module rewrite and the package metadata. Slow tests are deselected.
SUBSET = (
    "tests/test_custom_lowering.py::test_seed_examples_verbatim",
    "tests/test_seed_workflows.py",
    "tests/test_seed_composites.py",
    "tests/models",
    "tests/test_cli.py",
    "tests/test_torch_compat.py",
    "tests/test_recurrent.py",
    "tests/test_packaging.py::test_version_comes_from_the_package_metadata",
)


class CompatError(RuntimeError):
    """A step of the compatibility run failed."""


def run(cmd: list[str], *, cwd: Path | None = None, capture: bool = False) -> str:
    """Run ``cmd`` (echoed); raise :class:`CompatError` if it fails."""
    shown = (str(c) if "\n" not in str(c) else "'...'" for c in cmd)
    print("+", " ".join(shown), flush=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHONNOUSERSITE"] = "1"
    done = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, text=True, capture_output=capture
    )
    if done.returncode != 0:
        detail = f"\n{done.stdout}{done.stderr}" if capture else ""
        raise CompatError(f"exit code {done.returncode}: {' '.join(map(str, cmd))}{detail}")
    return done.stdout if capture else ""


def tracked_source(dest: Path) -> Path:
    """Copy the files git tracks (as they are in the work tree) to ``dest``."""
    try:
        listed = subprocess.run(
            ["git", "-C", str(ROOT), "ls-files", "-z"], capture_output=True, check=True
        ).stdout.decode()
        files = [f for f in listed.split("\0") if f and (ROOT / f).is_file()]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (e.g. an sdist)
        skip = {".git", ".venv", "build", "dist", "__pycache__"}
        files = [
            str(p.relative_to(ROOT))
            for p in ROOT.rglob("*")
            if p.is_file() and not skip.intersection(p.relative_to(ROOT).parts)
        ]
    for name in files:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, dest / name)
    return dest


def source_revision() -> str:
    """The git commit the run tests (``+changes`` if the work tree differs from it)."""
    try:
        rev = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", "HEAD"]).returncode
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + ("+changes" if dirty else "")


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def installed_versions(python: Path, *names: str) -> dict[str, str | None]:
    """Distribution versions in the venv of ``python`` (``None`` if not installed)."""
    code = (
        "import importlib.metadata as m, json, sys\n"
        "out = {}\n"
        "for n in sys.argv[1:]:\n"
        "    try: out[n] = m.version(n)\n"
        "    except m.PackageNotFoundError: out[n] = None\n"
        "print(json.dumps(out))\n"
    )
    return json.loads(run([python, "-c", code, *names], capture=True))


def pytest_ini(dest: Path) -> None:
    """The project's pytest settings (markers, warnings), without its source-tree paths."""
    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    lines = ["[pytest]", f"addopts = {options.get('addopts', '')}", "markers ="]
    lines += [f"    {m}" for m in options.get("markers", [])]
    lines += ["filterwarnings ="] + [f"    {w}" for w in options.get("filterwarnings", [])]
    (dest / "pytest.ini").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", required=True, help="torch version to install, e.g. 2.14.1")
    parser.add_argument("--numpy", help="numpy version to install (default: newest allowed)")
    parser.add_argument("--workdir", type=Path, help="default: <tmp>/coreai-torch-compat/<run>")
    parser.add_argument("--keep", action="store_true", help="keep the venvs afterwards")
    parser.add_argument("--marker", default="not slow", help="pytest -m expression")
    parser.add_argument("tests", nargs="*", default=list(SUBSET), help="tests to run")
    args = parser.parse_args(argv)

    py = platform.python_version()
    label = f"py{py}-torch{args.torch}" + (f"-numpy{args.numpy}" if args.numpy else "")
    results_dir = Path(tempfile.gettempdir()) / "coreai-torch-compat"
    work = (args.workdir or results_dir / label).resolve()
    if work.is_relative_to(ROOT):
        parser.error(f"--workdir must be outside the source tree {ROOT}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    revision = source_revision()
    times: dict[str, float] = {}
    facts: dict[str, str | None] = {}
    error: str | None = None
    try:
        start = time.perf_counter()
        src = tracked_source(work / "src")
        build_env = work / "build-env"
        run([sys.executable, "-m", "venv", build_env])
        run([venv_python(build_env), "-m", "pip", "install", "--quiet", "build"])
        run([venv_python(build_env), "-m", "build", "--outdir", work / "dist", src])
        (wheel,) = (work / "dist").glob("*.whl")
        (sdist,) = (work / "dist").glob("*.tar.gz")
        print(f"built {sdist.name} and {wheel.name}")
        times["build"] = time.perf_counter() - start

        start = time.perf_counter()
        venv = work / "venv"
        python = venv_python(venv)
        run([sys.executable, "-m", "venv", venv])
        run([python, "-m", "pip", "install", "--quiet", "--upgrade", "pip"])
        pins = [f"torch=={args.torch}"] + ([f"numpy=={args.numpy}"] if args.numpy else [])
        run([python, "-m", "pip", "install", "--quiet", *pins])
        before = installed_versions(python, "torch", "numpy")
        times["torch"] = time.perf_counter() - start

        # The wheel must leave the user's torch alone: ask pip first (no download if it
        # would not), then install and compare.
        start = time.perf_counter()
        report = work / "install-report.json"
        run([python, "-m", "pip", "install", "--quiet", "--dry-run", "--report", report, wheel])
        planned = {
            item["metadata"]["name"].lower(): item["metadata"]["version"]
            for item in json.loads(report.read_text())["install"]
        }
        for name in ("torch", "numpy"):
            if before[name] is not None and name in planned:
                raise CompatError(
                    f"installing the wheel would replace {name} {before[name]} with "
                    f"{planned[name]}: the dependency range excludes it"
                )
        run([python, "-m", "pip", "install", "--quiet", wheel])
        after = installed_versions(python, "torch", "numpy", "coreai-core", PACKAGE)
        for name in ("torch", "numpy"):
            if before[name] is not None and after[name] != before[name]:
                raise CompatError(f"installing the wheel changed {name}: {before} -> {after}")
        facts.update(after)
        print(f"the wheel left torch {after['torch']} and numpy {after['numpy']} in place")

        constraints = work / "constraints.txt"
        constraints.write_text("\n".join(pins) + "\n")
        run([python, "-m", "pip", "install", "--quiet", "-c", constraints, f"{wheel}[test,cli]"])
        if installed_versions(python, "torch")["torch"] != before["torch"]:
            raise CompatError("installing the test extra changed torch")
        times["install"] = time.perf_counter() - start

        start = time.perf_counter()
        outside = work / "run"
        shutil.copytree(
            ROOT / "tests", outside / "tests", ignore=shutil.ignore_patterns("__pycache__")
        )
        pytest_ini(outside)
        where = run(
            [python, "-c", "import coreai_torch; print(coreai_torch.__file__)"],
            cwd=outside,
            capture=True,
        ).strip()
        if not Path(where).is_relative_to(venv):
            raise CompatError(f"coreai_torch was imported from {where}, not from the venv")
        print(f"coreai_torch imported from {where}")
        print(run([venv / "bin" / "coreai-torch", "--version"], cwd=outside, capture=True))
        demo = run(
            [venv / "bin" / "coreai-torch", "demo", "--out", outside / "demo"],
            cwd=outside,
            capture=True,
        )
        print(demo)
        if "MATCH: the converted program reproduces PyTorch" not in demo:
            raise CompatError("coreai-torch demo did not match PyTorch")
        times["demo"] = time.perf_counter() - start

        start = time.perf_counter()
        run(
            [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", args.marker]
            + args.tests,
            cwd=outside,
        )
        times["tests"] = time.perf_counter() - start
    except CompatError as failure:
        error = str(failure)
    finally:
        if not args.keep:
            for venv_dir in ("venv", "build-env"):
                shutil.rmtree(work / venv_dir, ignore_errors=True)

    result = "pass" if error is None else "FAIL"
    timing = ", ".join(f"{k} {v:.0f} s" for k, v in times.items())
    row = (
        f"| {py} | {facts.get('torch') or args.torch} | {facts.get('numpy') or args.numpy} | "
        f"{result} | {timing} | {revision} | `make test-compat "
        f"PYTHON=python{py.rsplit('.', 1)[0]} TORCH={args.torch}"
        f"{f' NUMPY={args.numpy}' if args.numpy else ''}` |"
    )
    results_dir.mkdir(parents=True, exist_ok=True)
    with open(results_dir / "results.md", "a") as log:
        log.write(row + "\n")
    if error is not None:
        print(f"\ntest-compat FAILED: {error}", file=sys.stderr)
    print(
        "\n| Python | torch | numpy | result | time | commit | command |"
        "\n|---|---|---|---|---|---|---|"
    )
    print(row)
    return 0 if error is None else 1


if __name__ == "__main__":
    raise SystemExit(main())
