"""Converting a module whose weights stay in their checkpoint (``coreai_torch.tensors.lazy``): its
parameters are created on the meta device, bound to a safetensors file (or a mapping of
tensors and loaders), and read only while the asset is written.  The asset is the one the
in-memory conversion of the same module writes, and it runs like PyTorch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file
from transformers import ViTConfig, ViTForImageClassification

import coreai_torch
from coreai_torch import TorchConverter
from coreai_torch.errors import CheckpointError
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.ir.weights import PendingLazy
from coreai_torch.runtime import Session
from coreai_torch.tensors import lazy
from coreai_torch.verify import compare, eager_outputs, run_entrypoint

VIT = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    image_size=32,
    patch_size=8,
    num_labels=10,
)


def _convert(model: nn.Module, args: tuple, path: Path, **options: object) -> Path:
    ep = export_decomposed(model, args)
    program = TorchConverter(**options).add_exported_program(ep).to_coreai().optimize()
    program.save_asset(path)
    return path


def _bytecode(asset: Path) -> bytes:
    return (asset / "main.mlirb").read_bytes()


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_vision_transformer_converts_from_its_checkpoint(tmp_path: Path, precision: str) -> None:
    torch.manual_seed(0)
    config = ViTConfig(**VIT)
    reference = ViTForImageClassification(config).eval()
    reference.save_pretrained(tmp_path / "vit")  # model.safetensors
    pixels = torch.randn(1, 3, 32, 32)

    with coreai_torch.empty_parameters():
        model = ViTForImageClassification(config).eval()
    assert all(p.is_meta for p in model.parameters())
    coreai_torch.WeightSource(tmp_path / "vit" / "model.safetensors").bind(model)
    assert all(lazy.is_lazy(p) for p in model.parameters())

    ep = export_decomposed(model, (pixels,))
    program = TorchConverter(compute_precision=precision).add_exported_program(ep).to_coreai()
    program.optimize()
    assert any(isinstance(p, PendingLazy) for p in program.weights.pending.values())
    program.save_asset(tmp_path / "lazy.aimodel")

    in_memory = _convert(
        reference, (pixels,), tmp_path / "ref.aimodel", compute_precision=precision
    )
    assert _bytecode(tmp_path / "lazy.aimodel") == _bytecode(in_memory)

    expected = eager_outputs(reference, (pixels,))
    with Session(tmp_path / "lazy.aimodel") as session:
        actual = run_entrypoint(session, program, (pixels,))
    tolerance = 1e-4 if precision == "fp32" else 2e-2
    for e, a in zip(expected, actual, strict=True):
        assert compare("logits", e, a, atol=tolerance, rtol=tolerance).ok


class _Fused(nn.Module):
    """Two linear layers whose weights a loading step fuses into one (``torch.cat``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(16, 32)

    def fuse(self) -> None:
        with torch.no_grad():
            fused = nn.Linear(16, 64)
            fused.weight = nn.Parameter(torch.cat([self.a.weight, self.b.weight]))
            fused.bias = nn.Parameter(torch.cat([self.a.bias, self.b.bias]))
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused(x).relu()


def test_ops_on_bound_weights_are_replayed_on_their_data(tmp_path: Path) -> None:
    """Weights transformed after binding (here concatenated) stay lazy: the transformation is
    recorded and made on the data when it is read."""
    torch.manual_seed(0)
    reference = _Fused()
    save_file(reference.state_dict(), tmp_path / "w.safetensors")
    reference.fuse()
    x = torch.randn(3, 16)

    with coreai_torch.empty_parameters():
        model = _Fused()
    coreai_torch.WeightSource(tmp_path / "w.safetensors").bind(model)
    model.fuse()
    assert lazy.is_lazy(model.fused.weight)
    assert torch.equal(lazy.materialize(model.fused.weight), reference.fused.weight)

    lazy_asset = _convert(model, (x,), tmp_path / "lazy.aimodel")
    assert _bytecode(lazy_asset) == _bytecode(_convert(reference, (x,), tmp_path / "ref.aimodel"))


def test_a_mapping_source_calls_its_loaders_when_the_asset_is_written(tmp_path: Path) -> None:
    torch.manual_seed(0)
    # weights of 1024 elements or more are not folded at conversion, vectors of 64 or more are
    # not inlined: nothing is read before the asset is written
    reference = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64)).eval()
    state = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    calls: list[str] = []

    def loader(name: str):
        def load() -> torch.Tensor:
            calls.append(name)
            return state[name]

        return load

    with coreai_torch.empty_parameters():
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64)).eval()
    coreai_torch.WeightSource({name: loader(name) for name in state}).bind(model)
    x = torch.randn(2, 64)
    program = TorchConverter().add_exported_program(export_decomposed(model, (x,))).to_coreai()
    program.optimize()
    assert calls == []  # nothing read while converting
    program.save_asset(tmp_path / "m.aimodel")
    assert sorted(calls) == sorted(state)  # each read once
    expected = eager_outputs(reference, (x,))
    with Session(tmp_path / "m.aimodel") as session:
        actual = run_entrypoint(session, program, (x,))
    assert compare("out", expected[0], actual[0]).ok


def test_a_loader_returning_the_wrong_tensor_is_named(tmp_path: Path) -> None:
    with coreai_torch.empty_parameters():
        model = nn.Linear(16, 64)
    source = coreai_torch.WeightSource(
        {"weight": lambda: torch.zeros(64, 15), "bias": lambda: torch.zeros(64)}
    )
    source.bind(model)
    with pytest.raises(CheckpointError, match=r"loader of weight 'weight' returned \(64, 15\)"):
        lazy.materialize(model.weight)


def test_parameters_missing_from_the_source_are_listed_at_once() -> None:
    with coreai_torch.empty_parameters():
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(CheckpointError) as error:
        coreai_torch.WeightSource({"0.weight": torch.zeros(4, 4)}).bind(model)
    for name in ("0.bias", "1.weight", "1.bias"):
        assert f"'{name}' is not in the checkpoint" in str(error.value)


def test_tied_parameters_stay_tied_and_are_found_under_either_name() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

    with coreai_torch.empty_parameters():
        model = Tied()
    assert model.head.weight is model.embed.weight
    coreai_torch.WeightSource({"embed.weight": torch.randn(10, 4)}).bind(model)
    assert model.head.weight is model.embed.weight and lazy.is_lazy(model.head.weight)


def test_a_weight_converted_while_tracing_stays_lazy() -> None:
    """``lazy.converted`` records the cast even inside ``lazy.tracing()`` (where a module's ops
    are the program's): the copy is made from the data when it is read."""
    data = torch.randn(8, 4)
    weight = lazy.lazy_tensor(lazy.Held(data))
    with lazy.tracing():
        untracked = weight.to(torch.float16)
        half = lazy.converted(weight, torch.float16)
    assert not lazy.is_lazy(untracked)
    assert lazy.is_lazy(half) and half.dtype == torch.float16
    assert torch.equal(lazy.materialize(half), data.to(torch.float16))
    assert lazy.converted(data, torch.float16).dtype == torch.float16  # a tensor in memory


def test_rows_past_the_last_are_not_read(tmp_path: Path) -> None:
    """``lazy.read_rows`` reads like a slice: a last block of rows asked whole stops at the
    tensor's end (past it lie another tensor's bytes, or the end of the file)."""
    table = torch.randn(10, 4)
    save_file({"bias": torch.ones(10), "weight": table}, tmp_path / "w.safetensors")
    with coreai_torch.empty_parameters():
        model = nn.Linear(4, 10)
    coreai_torch.WeightSource(tmp_path / "w.safetensors").bind(model)
    for first in (0, 8, 10):
        rows = lazy.read_rows(model.weight, first, 4)
        assert rows is not None and torch.equal(rows, table[first : first + 4])


def test_an_unbound_fake_tensor_is_a_clear_error() -> None:
    with lazy.MODE:
        unknown = torch.empty(4)
    bound = lazy.lazy_tensor(lazy.Held(torch.ones(4)))
    with pytest.raises(CheckpointError, match="fake tensor whose data is unknown"):
        bound + unknown


def test_statistics_computed_in_the_background_are_the_ones_read_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``statistics_in_background`` reads each checkpoint tensor once, on another thread, and
    what it found is what :func:`lazy.statistics` returns afterwards without reading again."""
    torch.manual_seed(0)
    weights = {"a": torch.randn(300, 64) * 7, "b": torch.randn(5)}
    weights["b"][2] = float("inf")
    save_file(weights, tmp_path / "w.safetensors")
    source = coreai_torch.WeightSource(tmp_path / "w.safetensors")
    with coreai_torch.empty_parameters():
        model = nn.Module()
        model.a = nn.Parameter(torch.empty(300, 64))
        model.b = nn.Parameter(torch.empty(5))
    source.bind(model)
    monkeypatch.setattr(lazy, "STATISTICS_BLOCK", 4096)  # several blocks of rows
    with lazy.statistics_in_background([model.a, model.b, model.a]):
        pass

    def no_more_reads(*args: object) -> None:
        raise AssertionError("the checkpoint was read again")

    monkeypatch.setattr(lazy._Reader, "read_into", no_more_reads)
    a, b = lazy.statistics(model.a), lazy.statistics(model.b)
    assert a == lazy.statistics(weights["a"])
    assert a.finite_peak == float(weights["a"].abs().max())
    assert (b.inf, b.nan, b.finite_peak) == (1, 0, float(weights["b"][[0, 1, 3, 4]].abs().max()))


def test_a_tensor_the_background_cannot_read_is_left_to_the_caller(tmp_path: Path) -> None:
    torch.manual_seed(0)
    save_file({"weight": torch.randn(64, 64)}, tmp_path / "w.safetensors")
    with coreai_torch.empty_parameters():
        model = nn.Linear(64, 64, bias=False)
    coreai_torch.WeightSource(tmp_path / "w.safetensors").bind(model)
    with open(tmp_path / "w.safetensors", "r+b") as f:  # truncated after binding
        f.truncate(f.seek(0, 2) - 100)
    with lazy.statistics_in_background([model.weight]):
        pass
    with pytest.raises(CheckpointError, match="truncated"):
        lazy.statistics(model.weight)
