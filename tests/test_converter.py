"""TorchConverter: staging, entry points, clear(), optimize(), decomposition and op checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

import coreai_torch
from coreai_torch import (
    AIProgram,
    ConversionError,
    InvalidSignatureError,
    NotDecomposedError,
    TorchConverter,
    UnsupportedOpError,
    get_decomp_table,
)
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.runtime import Session


class Linear(nn.Module):
    def __init__(self, i: int = 8, o: int = 4) -> None:
        super().__init__()
        self.fc = nn.Linear(i, o)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 3.0 - 1.0


def _ep(model: nn.Module, *args: torch.Tensor) -> torch.export.ExportedProgram:
    return export_decomposed(model.eval(), args)


# ------------------------------------------------------------------------------ staging ----


def test_add_methods_chain_and_return_self() -> None:
    converter = TorchConverter()
    assert converter.add_exported_program(_ep(Linear(), torch.randn(1, 8))) is converter
    sample = (torch.randn(1, 8),)
    same = converter.add_pytorch_module(
        Linear(),
        export_fn=lambda m: torch.export.export(m, args=sample).run_decompositions(
            coreai_torch.get_decomp_table()
        ),
        entrypoint_name="second",
    )
    assert same is converter
    assert converter.entrypoints == ["main", "second"]


def test_to_coreai_returns_aiprogram_with_save_asset_and_optimize(tmp_path) -> None:
    program = TorchConverter().add_exported_program(_ep(Linear(), torch.randn(1, 8))).to_coreai()
    assert isinstance(program, AIProgram)
    from coreai.authoring import AIProgram as CoreAIProgram

    assert isinstance(program, CoreAIProgram)
    assert program.optimize() is program
    asset = program.save_asset(tmp_path / "linear.aimodel")
    assert (tmp_path / "linear.aimodel" / "main.mlirb").exists()
    assert asset is not None
    assert "coreai.graph @main" in str(program)


def test_optimize_is_idempotent_and_preserves_numerics() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    x = torch.randn(3, 8)
    program = TorchConverter().add_exported_program(_ep(model, x)).to_coreai()
    (name_x,) = [i.name for i in program.signatures["main"].inputs]
    assert name_x == "input"  # nn.Sequential.forward(input)
    with Session(program) as s:
        before = s.run({name_x: x})
    program.optimize()
    once = program.to_mlir()
    program.optimize()
    assert program.to_mlir() == once
    with Session(program) as s:
        after = s.run({name_x: x})
    (name,) = after
    np.testing.assert_allclose(after[name], before[name], atol=1e-6)
    np.testing.assert_allclose(after[name], model(x).detach().numpy(), atol=1e-5)


def test_several_entry_points_in_one_program_each_loadable_by_name() -> None:
    x = torch.randn(2, 8)
    lin, scale = Linear().eval(), Scale().eval()
    program = (
        TorchConverter()
        .add_exported_program(_ep(lin, x), entrypoint_name="encoder")
        .add_exported_program(_ep(scale, x), entrypoint_name="decoder")
        .to_coreai()
    )
    assert program.function_names == ["encoder", "decoder"]
    with Session(program) as s:
        assert sorted(s.model.function_names) == ["decoder", "encoder"]
        enc = s.run({"x": x}, entrypoint="encoder")
        dec = s.run({"x": x}, entrypoint="decoder")
    np.testing.assert_allclose(next(iter(enc.values())), lin(x).detach().numpy(), atol=1e-5)
    np.testing.assert_allclose(next(iter(dec.values())), scale(x).numpy(), atol=1e-6)


def test_to_coreai_entrypoints_selects_programs() -> None:
    x = torch.randn(2, 8)
    converter = (
        TorchConverter()
        .add_exported_program(_ep(Linear(), x), entrypoint_name="a")
        .add_exported_program(_ep(Scale(), x), entrypoint_name="b")
        .add_exported_program(_ep(Scale(), x), entrypoint_name="c")
    )
    assert converter.to_coreai(entrypoints=["c", "a"]).function_names == ["c", "a"]
    assert converter.to_coreai().function_names == ["a", "b", "c"]
    with pytest.raises(InvalidSignatureError, match=r"unknown entry point\(s\) \['zzz'\]"):
        converter.to_coreai(entrypoints=["zzz"])


def test_clear_some_then_all_keeps_lowerings() -> None:
    x = torch.randn(2, 8)
    converter = TorchConverter()
    converter.add_exported_program(_ep(Linear(), x), entrypoint_name="encoder")
    converter.add_exported_program(_ep(Scale(), x), entrypoint_name="decoder")

    @converter.register_torch_lowering("my_ns::thing.default")
    def lower(values_map, node, loc):  # pragma: no cover - never called
        return None

    converter.clear(entrypoints=["encoder"])
    assert converter.entrypoints == ["decoder"]
    converter.clear()
    assert converter.entrypoints == []
    assert "my_ns::thing.default" in converter.lowerings
    # a cleared name can be staged again
    converter.add_exported_program(_ep(Linear(), x), entrypoint_name="encoder")
    assert converter.to_coreai().function_names == ["encoder"]


def test_clear_unknown_entrypoint_is_an_error() -> None:
    converter = TorchConverter().add_exported_program(_ep(Scale(), torch.randn(2)))
    with pytest.raises(InvalidSignatureError, match="unknown entry point"):
        converter.clear(entrypoints=["nope"])
    assert converter.entrypoints == ["main"]


def test_duplicate_entrypoint_name_is_rejected() -> None:
    ep = _ep(Scale(), torch.randn(2))
    converter = TorchConverter().add_exported_program(ep, entrypoint_name="enc")
    with pytest.raises(InvalidSignatureError, match="'enc' is already staged"):
        converter.add_exported_program(ep, entrypoint_name="enc")
    assert converter.entrypoints == ["enc"]


def test_to_coreai_with_nothing_staged() -> None:
    with pytest.raises(ConversionError, match="nothing to convert"):
        TorchConverter().to_coreai()


def test_non_exported_program_input() -> None:
    with pytest.raises(TypeError, match="add_pytorch_module"):
        TorchConverter().add_exported_program(Linear())  # type: ignore[arg-type]


# ------------------------------------------------------------------------ decomposition ----


def test_get_decomp_table_is_fresh_and_keeps_composites() -> None:
    a, b = get_decomp_table(), get_decomp_table()
    assert a is not b and a.keys() == b.keys()
    a.clear()
    assert len(get_decomp_table()) == len(b) > 100
    aten = torch.ops.aten
    for op in (
        aten.layer_norm.default,
        aten.instance_norm.default,
        aten.group_norm.default,
        aten.pixel_shuffle.default,
        aten.scaled_dot_product_attention.default,
    ):
        assert op not in b
    assert aten.linear.default in b  # an ordinary op is still decomposed


def test_non_decomposed_program_error_says_how_to_fix() -> None:
    ep = torch.export.export(Linear().eval(), (torch.randn(1, 8),))
    with pytest.raises(NotDecomposedError, match=r"(?s)run_decompositions\(\).*get_decomp_table"):
        TorchConverter().add_exported_program(ep)


def test_export_fn_returning_non_decomposed_program() -> None:
    sample = (torch.randn(1, 8),)
    with pytest.raises(NotDecomposedError, match="export_fn"):
        TorchConverter().add_pytorch_module(
            Linear().eval(), export_fn=lambda m: torch.export.export(m, args=sample)
        )


# ----------------------------------------------------------------------- unsupported ops ----

_lib = torch.library.Library("coreai_torch_test", "DEF")
_lib.define("mystery(Tensor x) -> Tensor")
_lib.define("enigma(Tensor x) -> Tensor")


@torch.library.impl(_lib, "mystery", "CompositeExplicitAutograd")
def _mystery(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@torch.library.impl(_lib, "enigma", "CompositeExplicitAutograd")
def _enigma(x: torch.Tensor) -> torch.Tensor:
    return x * 2


class Mysterious(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.ops.coreai_torch_test.mystery(x)
        b = torch.ops.coreai_torch_test.mystery(a)
        return torch.ops.coreai_torch_test.enigma(b) + 1


def test_unsupported_ops_are_all_listed_at_once_with_source_lines() -> None:
    converter = TorchConverter().add_exported_program(_ep(Mysterious(), torch.randn(3)))
    with pytest.raises(UnsupportedOpError) as info:
        converter.to_coreai()
    message = str(info.value)
    assert "2 op(s) have no Core AI lowering (3 node(s))" in message
    assert "coreai_torch_test::mystery.default  x2" in message
    assert "coreai_torch_test::enigma.default  x1" in message
    assert "test_converter.py:" in message and "torch.ops.coreai_torch_test.mystery(x)" in message
    assert "register_torch_lowering" in message
    assert set(info.value.ops) == {
        "coreai_torch_test::mystery.default",
        "coreai_torch_test::enigma.default",
    }
    # the converter stays usable: register the missing lowerings and convert again
    from coreai_torch._mlir import cai
    from coreai_torch._utils import get_operand
    from coreai_torch.ir.values import constant

    @converter.register_torch_lowering("coreai_torch_test::mystery.default")
    def lower_mystery(values_map, node, loc):
        return cai.broadcasting_add(
            get_operand(values_map, node, 0, loc), constant(1.0, torch.float32)
        )

    @converter.register_torch_lowering("coreai_torch_test::enigma.default")
    def lower_enigma(values_map, node, loc):
        return cai.broadcasting_mul(
            get_operand(values_map, node, 0, loc), constant(2.0, torch.float32)
        )

    program = converter.to_coreai()
    x = torch.randn(3)
    with Session(program) as s:
        out = s.run({"x": x})
    np.testing.assert_allclose(next(iter(out.values())), Mysterious()(x).numpy(), atol=1e-6)
