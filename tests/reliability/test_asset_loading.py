"""Catalogue: loading a saved asset checks it first (``coreai_torch.ir.assets``).

Before these checks a missing path crashed ``Session`` (SIGSEGV), a truncated bytecode file
aborted the process (SIGABRT in coreai-core) and flipped weight bytes ran with wrong outputs.
The damaged cases run in a child process, so a regression fails the test instead of killing
pytest.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

from coreai_torch import TorchConverter
from coreai_torch.errors import AssetNotFoundError, InvalidAssetError
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.ir.assets import check_asset, check_bytecode_layout, file_sha256
from coreai_torch.runtime import Session
from tests.reliability.support import run_isolated


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    x = torch.randn(3, 16)
    path = tmp_path_factory.mktemp("assets") / "model.aimodel"
    TorchConverter().add_exported_program(export_decomposed(model, (x,))).to_coreai().save_asset(
        path
    )
    return path, model, x


def test_a_sound_asset_loads_with_or_without_the_hash_check(saved: tuple) -> None:
    path, model, x = saved
    info = check_asset(path)
    assert info.hash_verified and info.bytecode_bytes == (path / "main.mlirb").stat().st_size
    assert file_sha256(path / "main.mlirb") == (path / "main.hash").read_bytes()
    expected = model(x).detach().numpy()
    for verify in (True, False):
        with Session(str(path), verify_hash=verify) as session:
            (out,) = session.run({"input": x}).values()
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_paths_that_are_not_assets(tmp_path: Path) -> None:
    with pytest.raises(AssetNotFoundError, match=r"missing.aimodel: no such \.aimodel asset"):
        Session(tmp_path / "missing.aimodel").open()
    with pytest.raises(FileNotFoundError):  # AssetNotFoundError is one
        check_asset(tmp_path / "missing.aimodel")
    (tmp_path / "file.aimodel").write_text("x")
    with pytest.raises(InvalidAssetError, match=r"is a file, not a Core AI asset"):
        check_asset(tmp_path / "file.aimodel")
    (tmp_path / "empty.aimodel").mkdir()
    with pytest.raises(
        InvalidAssetError,
        match=r"not a complete Core AI asset: main.mlirb, main.hash, metadata.json missing",
    ):
        check_asset(tmp_path / "empty.aimodel")
    with pytest.raises(TypeError, match=r"Session takes an AIProgram or the path"):
        Session(42)  # type: ignore[arg-type]


def _damaged(saved: tuple, tmp_path: Path, name: str) -> Path:
    target = tmp_path / f"{name}.aimodel"
    shutil.copytree(saved[0], target)
    return target


def test_damaged_assets_are_refused_with_the_file_and_the_problem(
    saved: tuple, tmp_path: Path
) -> None:
    path = saved[0]
    blobs = check_bytecode_layout(path / "main.mlirb")
    size = (path / "main.mlirb").stat().st_size
    cases: dict[str, Path] = {}

    def bytecode(name: str, data: bytes, rehash: bool = False) -> None:
        target = cases[name] = _damaged(saved, tmp_path, name)
        (target / "main.mlirb").write_bytes(data)
        if rehash:
            (target / "main.hash").write_bytes(hashlib.sha256(data).digest())

    original = (path / "main.mlirb").read_bytes()
    bytecode("truncated", original[: size // 2])
    bytecode("truncated_in_header", original[:3])
    bytecode("empty", b"")
    flipped = bytearray(original)
    flipped[blobs[0][0] + 5] ^= 0x40  # a weight
    bytecode("flipped_weight", bytes(flipped))
    bytecode("appended", original + b"\x01\x02\x03")
    bytecode("appended_rehashed", original + b"\x01\x02\x03", rehash=True)
    for name in ("main.mlirb", "main.hash", "metadata.json"):
        target = cases[f"no_{name}"] = _damaged(saved, tmp_path, f"no_{name}")
        (target / name).unlink()
    target = cases["short_hash"] = _damaged(saved, tmp_path, "short_hash")
    (target / "main.hash").write_bytes(b"\0" * 20)
    target = cases["bad_json"] = _damaged(saved, tmp_path, "bad_json")
    (target / "metadata.json").write_text('{"producer": ')
    target = cases["json_list"] = _damaged(saved, tmp_path, "json_list")
    (target / "metadata.json").write_text("[]")
    target = cases["json_types"] = _damaged(saved, tmp_path, "json_types")
    (target / "metadata.json").write_text('{"creationDate": 5}')
    target = cases["bad_date"] = _damaged(saved, tmp_path, "bad_date")
    (target / "metadata.json").write_text('{"creationDate": "yesterday"}')

    result = run_isolated(
        f"""
        import json
        from coreai_torch.runtime import Session
        out = {{}}
        for name, path in {json.dumps({k: str(v) for k, v in cases.items()})}.items():
            try:
                with Session(path) as session:
                    out[name] = ["ran", ""]
            except Exception as error:
                out[name] = [type(error).__name__, str(error)]
        print(json.dumps(out))
        """
    )
    expected = {
        "truncated": r"main.mlirb is not a readable Core AI program: .*\(truncated\)",
        "truncated_in_header": r"no MLIR bytecode header",
        "empty": r"main.mlirb is empty",
        "flipped_weight": r"main.mlirb does not match main.hash .*changed after the asset was",
        "appended": r"is not a readable Core AI program",
        "appended_rehashed": r"is not a readable Core AI program",
        "no_main.mlirb": r"main.mlirb missing",
        "no_main.hash": r"main.hash missing",
        "no_metadata.json": r"metadata.json missing",
        "short_hash": r"main.hash holds 20 bytes, not a 32-byte SHA-256 digest",
        "bad_json": r"metadata.json is not valid JSON",
        "json_list": r"metadata.json holds a JSON list, not an object",
        "json_types": r"field 'creationDate' must be a str, got 5",
        "bad_date": r"coreai-core cannot read the asset",
    }
    for name, pattern in expected.items():
        kind, message = result[name]
        assert kind in ("InvalidAssetError", "AssetNotFoundError"), (name, kind, message)
        assert re.search(pattern, message), (name, message)


def test_a_hash_free_load_still_refuses_truncation(saved: tuple, tmp_path: Path) -> None:
    target = _damaged(saved, tmp_path, "no_hash_check")
    (target / "main.hash").unlink()
    with Session(target, verify_hash=False) as session:  # main.hash is not needed then
        assert session.run({"input": saved[2]})
    data = (target / "main.mlirb").read_bytes()
    (target / "main.mlirb").write_bytes(data[: len(data) - 7])
    with pytest.raises(InvalidAssetError, match=r"\(truncated\)"):
        check_asset(target, verify_hash=False)


def test_bytecode_that_crashes_coreai_core_is_an_error_in_this_process(
    saved: tuple, tmp_path: Path
) -> None:
    """Malformed sections with a matching hash (a faulty writer), which the layout check does
    not read: coreai-core's reader aborts -- in the child process that compiles the program."""
    original = (saved[0] / "main.mlirb").read_bytes()
    blobs = check_bytecode_layout(saved[0] / "main.mlirb")
    candidates = {}
    for offset in range(40, blobs[0][0] - 64, 7):  # the string, dialect, IR ... sections
        data = bytearray(original)
        data[offset] ^= 0xFF
        target = tmp_path / f"bad{offset}.aimodel"
        shutil.copytree(saved[0], target)
        (target / "main.mlirb").write_bytes(bytes(data))
        (target / "main.hash").write_bytes(hashlib.sha256(bytes(data)).digest())
        try:
            check_asset(target)
            candidates[offset] = str(target)
        except InvalidAssetError:
            shutil.rmtree(target)
        if len(candidates) == 24:
            break
    result = run_isolated(
        f"""
        import json
        import numpy as np
        from coreai_torch.runtime import Session
        out = {{}}
        for offset, path in {json.dumps(candidates)}.items():
            try:
                with Session(path) as session:
                    session.run({{"input": np.ones((3, 16), "float32")}})
                out[offset] = ["ran", ""]
            except Exception as error:
                out[offset] = [type(error).__name__, str(error)]
        print(json.dumps(out))
        """
    )
    assert all(kind in ("InvalidAssetError", "ran") for kind, _ in result.values()), result
    crashed = [m for kind, m in result.values() if "coreai-core crashed" in m]
    assert crashed, result
    assert re.search(r"coreai-core crashed \(SIG\w+\) reading .*main.mlirb", crashed[0])
    assert "match main.hash" in crashed[0]
