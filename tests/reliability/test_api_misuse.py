"""Catalogue: misuse of the converter API gets a clear exception naming cause and fix.

Cases already covered elsewhere are listed in docs/errors.md (tests/test_converter.py,
tests/test_io_naming.py, tests/test_custom_lowering.py, tests/test_metal.py,
tests/test_externalize.py); this module covers the rest.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn as nn

import coreai_torch
from coreai_torch import (
    ConversionError,
    InvalidSignatureError,
    NotDecomposedError,
    TorchConverter,
)
from coreai_torch.frontend.export import export_decomposed


class Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


class Stateful(nn.Module):
    """One buffer state, two plain inputs, two outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(3))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.cache.add_(x)
        return self.cache + z, z * 2


SAMPLE = (torch.randn(3),)


@functools.cache
def _ep() -> torch.export.ExportedProgram:
    return export_decomposed(Scale(), SAMPLE)


@functools.cache
def _stateful_ep() -> torch.export.ExportedProgram:
    return export_decomposed(Stateful(), (torch.randn(3), torch.randn(3)))


def _export_fn(module: nn.Module) -> torch.export.ExportedProgram:
    return torch.export.export(module, SAMPLE).run_decompositions(coreai_torch.get_decomp_table())


# ----------------------------------------------------------------------- what is passed in ----


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (None, "expected a torch.export.ExportedProgram, got NoneType"),
        ("model.pt2", "expected a torch.export.ExportedProgram, got str"),
        (Scale(), r"got Scale — for an nn.Module use add_pytorch_module\(module, export_fn=...\)"),
    ],
)
def test_add_exported_program_needs_an_exported_program(value: Any, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        TorchConverter().add_exported_program(value)


def test_add_pytorch_module_needs_a_module_and_a_callable() -> None:
    with pytest.raises(TypeError, match=r"add_pytorch_module expects an nn\.Module, got Exported"):
        TorchConverter().add_pytorch_module(_ep(), export_fn=_export_fn)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"export_fn must be a callable .*run_decompositions"):
        TorchConverter().add_pytorch_module(Scale(), export_fn="export")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ export_fn ----


def test_export_fn_that_raises_names_the_module_and_keeps_the_cause() -> None:
    def broken(module: nn.Module) -> torch.export.ExportedProgram:
        raise RuntimeError("dynamic control flow")

    with pytest.raises(ConversionError) as info:
        TorchConverter().add_pytorch_module(Scale(), export_fn=broken)
    assert str(info.value) == "export_fn raised RuntimeError while exporting Scale: dynamic " + (
        "control flow"
    )
    assert isinstance(info.value.__cause__, RuntimeError)


def test_export_fn_returning_none_says_what_to_return() -> None:
    with pytest.raises(ConversionError, match=r"export_fn returned None; it must return the "):
        TorchConverter().add_pytorch_module(Scale(), export_fn=lambda m: None)


def test_export_fn_returning_the_module_says_what_to_return() -> None:
    with pytest.raises(TypeError, match=r"got Scale — for an nn.Module use add_pytorch_module"):
        TorchConverter().add_pytorch_module(Scale(), export_fn=lambda m: m)


def test_export_fn_returning_a_training_ir_program_says_how_to_decompose() -> None:
    with pytest.raises(NotDecomposedError) as info:
        TorchConverter().add_pytorch_module(
            Scale(), export_fn=lambda m: torch.export.export(m, SAMPLE)
        )
    message = str(info.value)
    assert "has not been decomposed" in message and "get_decomp_table()" in message
    assert "inside export_fn" in message


# ------------------------------------------------------------------------------ IO names ----


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"output_names": ["o", ""]}, "output_names contains an empty name"),
        ({"output_names": ["o", None]}, "output_names must contain only strings, got NoneType"),
        ({"output_names": ["o", "o"]}, "output_names contains 'o' more than once"),
        ({"output_names": ("o",)}, r"output_names has 1 name\(s\) but the program has 2"),
        ({"output_names": {"o": 1, "p": 2}}, "output_names must be a sequence of strings"),
        ({"state_names": [""]}, "state_names contains an empty name"),
        ({"state_names": [b"cache"]}, "state_names must contain only strings, got bytes"),
        ({"state_names": "cache"}, "state_names must be a sequence of strings, got str"),
        ({"state_names": []}, r"state_names has 0 name\(s\) but the program has 1 state"),
        (
            {"state_names": ["kv"], "output_names": ["kv", "o"]},
            "name 'kv' is used in both state_names and output_names",
        ),
        (
            {"input_names": ["a", "b"], "output_names": ["o", "b"]},
            "name 'b' is used in both input_names and output_names",
        ),
        ({"input_names": ["b_cache", "z"]}, "default name 'b_cache' of one of the state_names"),
    ],
)
def test_name_errors(kwargs: dict[str, Any], match: str) -> None:
    converter = TorchConverter()
    with pytest.raises(InvalidSignatureError, match=match) as info:
        converter.add_exported_program(_stateful_ep(), **kwargs)
    assert isinstance(info.value, ValueError)  # generic handlers keep working
    assert converter.entrypoints == []


def test_state_names_for_a_program_without_state() -> None:
    with pytest.raises(
        InvalidSignatureError,
        match=r"state_names has 1 name\(s\) but the program has 0 state\(s\) .*Pass exactly 0",
    ):
        TorchConverter().add_exported_program(_ep(), state_names=["s"])


# --------------------------------------------------------------------------- entry points ----


@pytest.mark.parametrize(
    ("name", "match"),
    [
        (3, "entrypoint_name must be a non-empty string, got 3"),
        ("", "entrypoint_name must be a non-empty string, got ''"),
        (None, "entrypoint_name must be a non-empty string, got None"),
        ("my model", r"entrypoint_name 'my model' may only contain letters, digits"),
    ],
)
def test_invalid_entrypoint_names(name: Any, match: str) -> None:
    with pytest.raises(InvalidSignatureError, match=match):
        TorchConverter().add_exported_program(_ep(), entrypoint_name=name)


def test_duplicate_entrypoint_name_through_add_pytorch_module() -> None:
    converter = TorchConverter().add_exported_program(_ep(), entrypoint_name="enc")
    with pytest.raises(InvalidSignatureError, match=r"'enc' is already staged.*\['enc'\]"):
        converter.add_pytorch_module(Scale(), export_fn=_export_fn, entrypoint_name="enc")
    assert converter.entrypoints == ["enc"]


@pytest.mark.parametrize("method", ["to_coreai", "clear"])
def test_entrypoints_given_as_a_string(method: str) -> None:
    converter = TorchConverter().add_exported_program(_ep())
    with pytest.raises(TypeError, match=r"expects a sequence of names, got the string 'main'; "):
        getattr(converter, method)(entrypoints="main")
    assert converter.entrypoints == ["main"]


def test_unknown_entrypoints_list_what_is_staged() -> None:
    converter = TorchConverter().add_exported_program(_ep(), entrypoint_name="enc")
    with pytest.raises(InvalidSignatureError, match=r"unknown entry point\(s\) \['dec'\]; staged "):
        converter.to_coreai(entrypoints=["enc", "dec"])
    with pytest.raises(
        InvalidSignatureError, match=r"clear\(entrypoints=...\): unknown .*\['enc'\]"
    ):
        converter.clear(entrypoints=["dec"])
    assert converter.entrypoints == ["enc"]


@pytest.mark.parametrize("method", ["to_coreai", "clear"])
def test_duplicate_entrypoints_in_the_selection(method: str) -> None:
    """Naming an entry point twice is a caller mistake (it used to surface as an MLIR
    'redefinition of symbol' verifier error blaming coreai-torch)."""
    converter = TorchConverter().add_exported_program(_ep())
    converter.add_exported_program(_ep(), entrypoint_name="second")
    with pytest.raises(InvalidSignatureError) as info:
        getattr(converter, method)(entrypoints=["main", "second", "main"])
    assert str(info.value) == (
        f"{method}(entrypoints=...) names 'main' more than once: ['main', 'second', 'main']; "
        "list each entry point once (staged entry points are ['main', 'second'])"
    )
    assert converter.entrypoints == ["main", "second"]  # nothing was removed
    assert converter.to_coreai(entrypoints=["second", "main"]).function_names == [
        "second",
        "main",
    ]


@pytest.mark.parametrize("method", ["to_coreai", "clear"])
def test_entrypoints_that_are_not_a_sequence(method: str) -> None:
    converter = TorchConverter().add_exported_program(_ep())
    with pytest.raises(TypeError) as info:
        getattr(converter, method)(entrypoints=5)
    assert str(info.value) == (
        f"{method}(entrypoints=...) expects a sequence of entry point names, got int 5; use "
        "e.g. entrypoints=['main']"
    )
    assert converter.entrypoints == ["main"]


def test_empty_entrypoint_selection() -> None:
    converter = TorchConverter().add_exported_program(_ep())
    with pytest.raises(ConversionError, match=r"to_coreai\(entrypoints=\[\]\) selects no program"):
        converter.to_coreai(entrypoints=[])


def test_nothing_staged_after_clear() -> None:
    converter = TorchConverter().add_exported_program(_ep())
    converter.clear()
    with pytest.raises(ConversionError, match=r"nothing to convert: stage a program with "):
        converter.to_coreai()


class Norms(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.ln(x)
        return nn.functional.scaled_dot_product_attention(q, q, q)


def test_default_decomposition_table_still_converts_correctly() -> None:
    """Decomposing with PyTorch's default table instead of get_decomp_table() loses the
    composite ops, not correctness."""
    from coreai_torch.verify import verify

    model, x = Norms().eval(), torch.randn(1, 3, 4)
    ep = torch.export.export(model, (x,)).run_decompositions()
    program = TorchConverter().add_exported_program(ep).to_coreai()
    assert "composite" not in str(program)
    report = verify(model, (x,), program=program.optimize())
    assert report.ok, str(report)
