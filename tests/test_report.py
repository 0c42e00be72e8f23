"""The conversion report, the op analysis (analyze / is_supported) and conversion progress."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import coreai_torch
from coreai_torch import TorchConverter, get_decomp_table, progress
from coreai_torch.cli.report import ConversionReport, timed
from coreai_torch.frontend.export import export_decomposed


class Counter(nn.Module):
    """A state (a mutated buffer), a layer_norm composite, int64 and float outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.register_buffer("steps", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.steps.add_(1)
        h = self.norm(torch.relu(self.fc(x)))
        return h, h.argmax(-1)


@torch.library.custom_op("report_test::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return 2 * x


@twice.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class UsesCustomOp(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.report_test.twice(x).relu()  # the custom op has no lowering


def test_report_lists_io_ops_composites_weights_and_timings(tmp_path: Path) -> None:
    timings: dict[str, float] = {}
    with timed(timings, "export"):
        ep = export_decomposed(Counter().eval(), (torch.randn(2, 8),))
    converter = TorchConverter().add_exported_program(
        ep, input_names=["x"], output_names=["features", "best"], state_names=["steps"]
    )
    program = converter.to_coreai()
    with timed(timings, "optimize"):
        program.optimize()
    asset = tmp_path / "counter.aimodel"
    program.save_asset(asset)
    report = ConversionReport.build(
        converter, program, timings=timings, source="Counter", asset=asset
    )

    data = report.to_dict()
    (entry,) = data["entrypoints"]
    assert entry["name"] == "main"
    assert entry["inputs"] == [{"name": "x", "shape": [2, 8], "dtype": "float32"}]
    assert entry["outputs"] == [
        {"name": "features", "shape": [2, 16], "dtype": "float32"},
        {"name": "best", "shape": [2], "dtype": "int64"},
    ]
    assert entry["states"] == [{"name": "steps", "shape": [1], "dtype": "float32"}]
    assert entry["ops"]["aten::layer_norm.default"] == 1
    assert entry["ops"]["aten::addmm.default"] == 1
    assert entry["fx_nodes"] == sum(n.op == "call_function" for n in ep.graph.nodes)
    assert entry["composites"] == {"layer_norm": 1}
    assert entry["coreai_ops"] > 0 and entry["seconds"] > 0
    # fc.weight, fc.bias, norm.weight, norm.bias; the small ones are inlined
    assert (data["weight_tensors"], data["weight_total_bytes"]) == (4, (128 + 16 * 3) * 4)
    assert data["weight_bytes"] == converter.last_stats.weight_bytes == 128 * 4
    assert list(data["timings"]) == ["export", "optimize", "to_coreai"]
    assert data["asset"] == str(asset) and data["asset_bytes"] > data["weight_bytes"]

    text = str(report)
    lines = text.splitlines()
    assert lines[0] == "coreai-torch conversion report" and len(lines) < 25
    assert "source     Counter" in text
    assert "  inputs     x float32(2, 8)" in text
    assert "  outputs    features float32(2, 16), best int64(2,)" in text
    assert "  states     steps float32(1,)" in text
    assert "  composites layer_norm x1" in text
    assert "layer_norm x1" in text.split("  ops")[1]
    assert "weights    4 tensors, 704 B (512 B as zero-copy resources)" in text
    assert "timings    export " in text and "| to_coreai " in text
    assert f"asset      {asset} (" in text


def test_analyze_lists_missing_ops_with_their_source_line() -> None:
    ep = torch.export.export(UsesCustomOp(), (torch.randn(3),))  # training IR
    report = coreai_torch.analyze(ep)
    assert report.decomposed_here and not report.ok
    assert report.histogram == {"report_test::twice.default": 1, "aten::relu.default": 1}
    assert report.supported == ["aten::relu.default"]
    (missing,) = report.missing
    assert (missing.op, missing.count, missing.node) == ("report_test::twice.default", 1, "twice")
    assert missing.source.startswith(__file__) and "torch.ops.report_test.twice(x)" in (
        missing.source
    )
    text = str(report)
    assert "2 op(s) in 2 node(s): 1 supported, 1 missing" in text
    assert "report_test::twice.default  MISSING" in text and "first at " + __file__ in text
    assert report.to_dict()["missing"][0]["op"] == "report_test::twice.default"

    # the converter's own lowerings count; is_supported answers per node
    converter = TorchConverter()
    decomposed = ep.run_decompositions(get_decomp_table())
    twice_node = next(n for n in decomposed.graph.nodes if n.name == "twice")
    assert not converter.is_supported(twice_node)
    converter.register_torch_lowering("report_test::twice.default")(lambda v, n, loc: None)
    assert converter.is_supported(twice_node)
    assert all(converter.is_supported(n) for n in decomposed.graph.nodes)
    assert coreai_torch.analyze(decomposed, converter).ok


def test_progress_reports_every_node_per_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    ep = export_decomposed(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), (torch.randn(1, 4),))
    nodes = sum(1 for n in ep.graph.nodes if n.op == "call_function")

    seen: list[tuple[str, int, int]] = []
    converter = TorchConverter()
    converter.add_exported_program(ep, entrypoint_name="a").add_exported_program(
        ep, entrypoint_name="b"
    )
    with progress.track(lambda *event: seen.append(event)):
        converter.to_coreai()
    assert seen == [("a", 0, nodes), ("a", nodes, nodes), ("b", 0, nodes), ("b", nodes, nodes)]

    seen.clear()
    converter.to_coreai()  # off again outside the block
    assert seen == []
    converter.progress = lambda *event: seen.append(event)
    converter.to_coreai(entrypoints=["b"])
    assert seen == [("b", 0, nodes), ("b", nodes, nodes)]

    from rich.console import Console

    out = io.StringIO()
    converter.progress = progress.RichProgress(console=Console(file=out, width=80))
    converter.to_coreai(entrypoints=["a"])
    assert "lowering a" in out.getvalue() and f"{nodes}/{nodes} nodes" in out.getvalue()

    converter.progress = None
    monkeypatch.setenv(progress.ENV_VAR, "1")
    assert isinstance(progress.resolve(None), progress.RichProgress)
    monkeypatch.setenv(progress.ENV_VAR, "0")
    assert progress.resolve(None) is None
    with pytest.raises(TypeError, match=r"TorchConverter\.progress must be"):
        progress.resolve(3)
