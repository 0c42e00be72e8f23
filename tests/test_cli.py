"""The ``coreai-torch`` command line on a small model saved as a ``.pt2`` and as a factory
file: one run of the installed console script per exit code (0, 1, 2), the rest through
``cli.main`` in this process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from coreai_torch.cli import main

SCRIPT = Path(sys.executable).parent / "coreai-torch"

MODEL_PY = """
import torch
import torch.nn as nn


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.register_buffer("count", torch.zeros(1))

    def forward(self, x, ids):
        self.count.add_(1)
        h = torch.relu(self.fc(x))
        return self.norm(h) * ids.float().unsqueeze(-1), h.argmax(-1)


def make():
    torch.manual_seed(0)
    return Tiny().eval(), (torch.randn(2, 8), torch.randint(1, 5, (2,)))


def other_weights():
    torch.manual_seed(1)
    return Tiny().eval(), (torch.randn(2, 8), torch.randint(1, 5, (2,)))


def wide():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    return model.eval(), (torch.randn(2, 64),)
"""

SETUP_PY = """
from coreai_torch._mlir import cai
from coreai_torch._utils import get_operand


def wrong_relu(converter):
    @converter.register_torch_lowering("aten::relu.default", allow_override=True)
    def lower(values_map, node, loc):
        return cai.abs_(get_operand(values_map, node, 0, loc))
"""

CUSTOM_OP_PY = """
import torch
import torch.nn as nn


@torch.library.custom_op("cli_test::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return 2 * x


@twice.register_fake
def _(x):
    return torch.empty_like(x)


class UsesCustomOp(nn.Module):
    def forward(self, x):
        return torch.ops.cli_test.twice(x) + 1


def make():
    return UsesCustomOp(), (torch.randn(3),)
"""


def run(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [str(SCRIPT), *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=600
    )
    result.stderr = "\n".join(
        line for line in result.stderr.splitlines() if not line.startswith("ODIE ")
    )
    return result


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """model.py / setup.py / custom_op.py, model.pt2 (training IR) and model.aimodel (converted
    from the factory by the CLI, with names)."""
    work = tmp_path_factory.mktemp("cli")
    for name, text in (("model.py", MODEL_PY), ("setup.py", SETUP_PY)):
        (work / name).write_text(textwrap.dedent(text))
    (work / "custom_op.py").write_text(CUSTOM_OP_PY)
    namespace: dict = {}
    exec(compile(MODEL_PY, str(work / "model.py"), "exec"), namespace)
    module, example = namespace["make"]()
    torch.export.save(torch.export.export(module, example), work / "model.pt2")
    np.save(work / "x.npy", torch.randn(2, 8).numpy())
    torch.save(torch.tensor([3, 1]), work / "ids.pt")
    converted = run(
        "convert",
        "model.py:make",
        "-o",
        "out/model.aimodel",
        "--input-names",
        "features,ids",
        "--output-names",
        "y,best",
        "--state-names",
        "calls",
        "--progress",
        cwd=work,
    )
    assert converted.returncode == 0, converted.stderr
    (work / "convert.out").write_text(converted.stdout)
    (work / "convert.err").write_text(converted.stderr)
    return work


def test_convert_a_factory_prints_the_report_and_a_progress_bar(work: Path) -> None:
    out = (work / "convert.out").read_text()
    assert (work / "out" / "model.aimodel" / "main.mlirb").is_file()
    assert out.startswith("coreai-torch conversion report\nsource     model.py:make (Tiny)\n")
    assert "  inputs     features float32(2, 8), ids int64(2,)" in out
    assert "  outputs    y float32(2, 16), best int64(2,)" in out
    assert "  states     calls float32(1,)" in out
    assert "  composites layer_norm x1" in out
    for phase in ("export", "decompose", "to_coreai", "optimize", "save"):
        assert f"{phase} " in out.split("timings")[1]
    assert "asset      out/model.aimodel (" in out and "/s)" in out  # size, write rate
    assert len(out.splitlines()) < 25
    err = (work / "convert.err").read_text()
    assert "lowering main" in err
    assert "optimize" in err and "save" in err and "KB" in err  # the bar moves there too


def test_convert_a_pt2_decomposes_it_and_says_so(
    work: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(work)
    assert main(["convert", "model.pt2", "--no-optimize", "--json"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert report["notes"] == [
        "the program was not decomposed: ran run_decompositions(get_decomp_table())",
        "not optimized (--no-optimize)",
    ]
    assert list(report["timings"]) == ["load", "decompose", "to_coreai", "save"]
    (entry,) = report["entrypoints"]
    assert [i["name"] for i in entry["inputs"]] == ["x", "ids"]
    assert [s["name"] for s in entry["states"]] == ["b_count"]
    assert report["asset"] == "model.aimodel" and (work / "model.aimodel").is_dir()
    assert "lowering" not in err  # no progress bar when stderr is not a terminal


def test_verify_against_the_factory_on_random_inputs(
    work: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(work)
    assert main(["verify", "out/model.aimodel", "model.py:make", "--seed", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "out/model.aimodel vs model.py:make (Tiny) (random inputs, seed 3)"
    assert lines[1].startswith("y ") and lines[1].endswith(" ok")
    assert lines[2].startswith("best ") and lines[2].endswith(" ok")
    assert lines[3].startswith("calls (state) ") and lines[3].endswith(" ok")
    assert lines[-1] == "MATCH"


def test_verify_refuses_a_damaged_asset_unless_told_not_to_hash(
    work: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    monkeypatch.chdir(work)
    shutil.copytree("out/model.aimodel", "damaged.aimodel")
    (work / "damaged.aimodel" / "main.hash").write_bytes(b"\0" * 32)
    assert main(["verify", "damaged.aimodel", "model.py:make"]) == 2
    err = capsys.readouterr().err
    assert "main.mlirb does not match main.hash" in err
    assert main(["verify", "damaged.aimodel", "model.py:make", "--no-verify-hash"]) == 0


def test_verify_against_the_pt2_on_input_files(work: Path, capsys: pytest.CaptureFixture) -> None:
    code = main(
        [
            "verify",
            str(work / "out/model.aimodel"),
            str(work / "model.pt2"),
            "--json",
            "--inputs",
            str(work / "x.npy"),
            str(work / "ids.pt"),
        ]
    )
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and data["ok"]
    assert [o["name"] for o in data["outputs"]] == ["y", "best", "calls (state)"]
    assert all(o["max_abs"] < 1e-4 for o in data["outputs"])


def test_verify_mismatch_and_bisect_to_the_wrong_lowering(work: Path) -> None:
    assert (
        main(
            [
                "convert",
                str(work / "model.py:make"),
                "-o",
                str(work / "wrong.aimodel"),
                "--setup",
                str(work / "setup.py:wrong_relu"),
            ]
        )
        == 0
    )
    result = run(
        "verify",
        "wrong.aimodel",
        "model.py:make",
        "--bisect",
        "--setup",
        "setup.py:wrong_relu",
        cwd=work,
    )
    assert result.returncode == 1, result.stderr
    out = result.stdout
    assert "MISMATCH" in out and "bisecting" in out
    assert "first diverging node: node 'relu' (op aten::relu.default) at " in out
    assert f"{work / 'model.py'}:15 in forward: h = torch.relu(self.fc(x))" in out
    assert "its inputs match PyTorch: addmm" in out


def test_verify_mismatch_whose_source_converts_correctly(
    work: Path, capsys: pytest.CaptureFixture
) -> None:
    asset, other = str(work / "out/model.aimodel"), str(work / "model.py:other_weights")
    assert main(["verify", asset, other, "--bisect"]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH" in out
    assert "the program matches PyTorch: the asset was converted differently" in out


def test_ops_lists_missing_ops_with_their_source_line(
    work: Path, capsys: pytest.CaptureFixture
) -> None:
    assert main(["ops", str(work / "custom_op.py:make")]) == 1
    out = capsys.readouterr().out
    assert "2 op(s) in 2 node(s): 1 supported, 1 missing" in out
    assert "aten::add.Tensor" in out
    assert (
        f"cli_test::twice.default  x1  (first at {work / 'custom_op.py'}:18 in forward: "
        "return torch.ops.cli_test.twice(x) + 1; node 'twice')"
    ) in out


def test_ops_json_of_a_supported_pt2(work: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["ops", str(work / "model.pt2"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] and data["missing"] == []
    status = {o["op"]: o["status"] for o in data["ops"]}
    assert status["aten::layer_norm.default"] == "composite"
    assert status["aten::relu.default"] == "ok"


def test_errors_are_one_line_with_exit_code_2(work: Path) -> None:
    result = run("convert", "custom_op.py:make", cwd=work)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines() == [
        "coreai-torch: error: no Core AI lowering for cli_test::twice.default x1 (first at "
        f"{work / 'custom_op.py'}:18 in forward: return torch.ops.cli_test.twice(x) + 1)"
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["convert", "model.py"], "source 'model.py' is neither a .pt2 file"),
        (["convert", "missing.pt2"], "missing.pt2: no such file"),
        (["convert", "model.py:nope"], "model.py has no function 'nope'"),
        (["convert", "model.py:make", "-o", "x.bin"], "must end in .aimodel, got x.bin"),
        (["convert", "model.py:make", "--input-names", "a"], "input_names has 1 name(s)"),
        (["verify", "none.aimodel", "model.py:make"], "none.aimodel: no such .aimodel"),
        (["convert", "model.py:make", "--compress", "int9"], "--compress: unknown compression"),
        (["convert", "model.py:make", "--block-size", "32"], "--block-size needs --compress"),
        (
            ["verify", "out/model.aimodel", "custom_op.py:make"],
            "has 2 inputs ['features', 'ids'] but the source program has 1",
        ),
        (
            ["verify", "out/model.aimodel", "model.py:make", "--entrypoint", "decode"],
            "has no entry point 'decode'; it has ['main']",
        ),
    ],
)
def test_error_messages(
    work: Path,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    message: str,
) -> None:
    monkeypatch.chdir(work)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("coreai-torch: error: ") and message in err, err
    assert "\n" not in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("form", "block", "ratio"),
    # below 8 bits the last layer (the output head: its result is the program's output) stays
    # int8, as the presets keep it
    [("int4", None, 0.205), ("int8", None, 0.260), ("palette4", None, 0.197), ("int4", 64, 0.197)],
)
def test_convert_with_compressed_weights(
    work: Path,
    capsys: pytest.CaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    form: str,
    block: int | None,
    ratio: float,
) -> None:
    monkeypatch.chdir(work)
    blocks = ["--block-size", str(block)] if block else []
    out = f"{form}.aimodel"
    assert main(["convert", "model.py:wide", "-o", out, "--compress", form, *blocks]) == 0
    text = capsys.readouterr().out
    (line,) = [line for line in text.splitlines() if line.startswith("compressed ")]
    kind = "4-bit palettes" if form == "palette4" else form
    assert line.startswith(f"compressed 2 weight(s) ({kind}") and "128.0 KB ->" in line
    assert f"({ratio:.3f}x)" in line, line
    assert "compress " in text.split("timings")[1]
    assert main(["convert", "model.py:wide", "-o", "plain.aimodel", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["compression"] is None
    assert main(["convert", "model.py:wide", "-o", out, "--compress", form, *blocks, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    weights = report["compression"]["weights"]
    assert [w["name"] for w in weights] == ["0.weight", "2.weight"]
    assert weights[1]["bits"] == 8
    saved = plain["asset_bytes"] - report["asset_bytes"]
    assert saved >= 0.95 * (
        report["compression"]["bytes_before"] - report["compression"]["bytes_after"]
    )


def test_convert_half_precision_with_int4_weights(
    work: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--precision fp16 --compress int4``: both weights compressed (float16 scales), the
    output head in int8 per channel (the preset's safe form)."""
    monkeypatch.chdir(work)
    argv = ["convert", "model.py:wide", "--precision", "fp16", "--json"]
    assert main([*argv, "-o", "fp16.aimodel"]) == 0
    half = json.loads(capsys.readouterr().out)
    assert main([*argv, "-o", "fp16-int4.aimodel", "--compress", "int4"]) == 0
    report = json.loads(capsys.readouterr().out)
    compressed = report["compression"]
    assert [w["name"] for w in compressed["weights"]] == ["0.weight", "2.weight"]
    assert compressed["skipped"] == []
    assert compressed["bytes_before"] == 2 * 64 * 256 * 2  # float16 weights
    assert compressed["bytes_after"] == 64 * 256 * (4 + 16 / 32) // 8 + 64 * 256 + 64 * 2
    saved = half["asset_bytes"] - report["asset_bytes"]
    assert saved >= 0.95 * (compressed["bytes_before"] - compressed["bytes_after"]), (half, report)


def test_debug_shows_the_traceback(work: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["convert", str(work / "missing.pt2"), "--debug"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and err.endswith(
        "error: " + str(work) + "/missing.pt2: no such file\n"
    )


def test_demo(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["demo", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "MATCH: the converted program reproduces PyTorch" in out
    assert "max|err|" in out and "to_coreai" in out  # per-output error and conversion time
    assert (tmp_path / "tiny_lm.aimodel").is_dir()
