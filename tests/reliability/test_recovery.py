"""The converter stays usable after any error: staged programs and registered lowerings are
kept, and fixing the cause and calling again works.

One test per kind of failure: unsupported op, lowering that raises, verifier failure (with the
message naming the op, node, source line and fix), bad names, export_fn failures, a lowering
that keeps Core AI values between to_coreai() calls (in a child process: it used to crash).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

import coreai_torch
from coreai_torch import (
    ConversionError,
    ExternalizationError,
    InvalidSignatureError,
    LoweringError,
    NotDecomposedError,
    TorchConverter,
    UnsupportedOpError,
    VerificationError,
)
from coreai_torch._mlir import cai
from coreai_torch._utils import get_operand
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.ir.values import u32
from coreai_torch.runtime import Session
from tests.reliability.support import run_isolated


@torch.library.custom_op("rel_recover::tile2", mutates_args=())
def tile2(x: torch.Tensor) -> torch.Tensor:
    return x.repeat(1, 2)


@tile2.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], 2 * x.shape[1])


class Tiled(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.rel_recover.tile2(x) + 1


class Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 3


X = torch.randn(2, 3)
OP = "rel_recover::tile2.default"


def _good_tile(values_map, node, loc):
    return cai.tile(get_operand(values_map, node, 0, loc), u32([1, 2]), loc=loc)


def _staged_pair(converter: TorchConverter) -> TorchConverter:
    converter.add_exported_program(export_decomposed(Scale(), (X,)), entrypoint_name="scale")
    converter.add_exported_program(export_decomposed(Tiled(), (X,)), entrypoint_name="tiled")
    return converter


def _runs_correctly(converter: TorchConverter) -> None:
    program = converter.to_coreai()
    assert program.function_names == ["scale", "tiled"]
    with Session(program) as session:
        (tiled,) = session.run({"x": X}, entrypoint="tiled").values()
        (scaled,) = session.run({"x": X}, entrypoint="scale").values()
    np.testing.assert_allclose(tiled, Tiled()(X).numpy(), atol=1e-6)
    np.testing.assert_allclose(scaled, Scale()(X).numpy(), atol=1e-6)


def test_after_unsupported_op() -> None:
    converter = _staged_pair(TorchConverter())
    with pytest.raises(UnsupportedOpError, match=OP):
        converter.to_coreai()
    assert converter.to_coreai(entrypoints=["scale"]).function_names == ["scale"]
    converter.register_torch_lowering(OP)(_good_tile)
    _runs_correctly(converter)


def test_after_a_lowering_that_raises() -> None:
    converter = _staged_pair(TorchConverter())

    @converter.register_torch_lowering(OP)
    def broken(values_map, node, loc):
        raise NotImplementedError("not yet")

    with pytest.raises(LoweringError, match=r"NotImplementedError: not yet"):
        converter.to_coreai()
    assert converter.entrypoints == ["scale", "tiled"]
    converter.register_torch_lowering(OP, allow_override=True)(_good_tile)
    _runs_correctly(converter)


def test_after_a_verifier_failure() -> None:
    converter = _staged_pair(TorchConverter())

    @converter.register_torch_lowering(OP)
    def wrong_index_type(values_map, node, loc):
        return cai.tile(get_operand(values_map, node, 0, loc), [1, 2], loc=loc)  # si32, not ui32

    with pytest.raises(VerificationError) as info:
        converter.to_coreai()
    message = str(info.value)
    assert isinstance(info.value, ConversionError)
    assert "'coreai.tile' op operand #1 must be 1D CoreAI Tensor" in message  # the cause
    assert "tensor<2xsi32>" in message
    assert f"node 'tile2' (op {OP})" in message  # the node and op ...
    assert "test_recovery.py" in message and "torch.ops.rel_recover.tile2(x)" in message  # line
    assert f"register_torch_lowering('{OP}') built this invalid op: fix the operands" in message
    converter.register_torch_lowering(OP, allow_override=True)(_good_tile)
    _runs_correctly(converter)


def test_after_bad_names() -> None:
    converter = TorchConverter()
    converter.register_torch_lowering(OP)(_good_tile)
    converter.add_exported_program(export_decomposed(Scale(), (X,)), entrypoint_name="scale")
    ep = export_decomposed(Tiled(), (X,))
    for bad in ({"input_names": ["x", "y"]}, {"output_names": [""]}, {"entrypoint_name": "scale"}):
        with pytest.raises(InvalidSignatureError):
            converter.add_exported_program(ep, **({"entrypoint_name": "tiled"} | bad))
    assert converter.entrypoints == ["scale"]
    assert OP in converter.lowerings.own_names()
    converter.add_exported_program(ep, input_names=["x"], entrypoint_name="tiled")
    _runs_correctly(converter)


def test_after_export_fn_failures() -> None:
    converter = TorchConverter()
    converter.register_torch_lowering(OP)(_good_tile)
    converter.add_exported_program(export_decomposed(Scale(), (X,)), entrypoint_name="scale")

    def raises(m: nn.Module) -> torch.export.ExportedProgram:
        raise ValueError("bad sample")

    for export_fn, error in (
        (raises, ConversionError),
        (lambda m: None, ConversionError),
        (lambda m: torch.export.export(m, (X,)), NotDecomposedError),
    ):
        with pytest.raises(error):
            converter.add_pytorch_module(Tiled(), export_fn=export_fn, entrypoint_name="tiled")
        assert converter.entrypoints == ["scale"]  # the name is not taken by the failed call
    converter.add_pytorch_module(
        Tiled(),
        export_fn=lambda m: torch.export.export(m, (X,)).run_decompositions(
            coreai_torch.get_decomp_table()
        ),
        entrypoint_name="tiled",
    )
    _runs_correctly(converter)


class NormThenScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = coreai_torch.composite_ops.RMSNorm(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x) * 3


def test_after_an_externalization_failure() -> None:
    """A bad ExternalizeSpec or a failing export_fn while externalizing leaves the module as it
    was (forward restored, same eager output) and nothing staged; fixing it works."""
    from coreai_torch.composite_ops import RMSNormImpl

    model = NormThenScale().eval()
    inner = model.norm.norm
    expected = model(X)
    forwards = (model.forward, inner.forward)

    def export_fn(m: nn.Module) -> torch.export.ExportedProgram:
        ep = torch.export.export(m, (X,))
        return ep.run_decompositions(coreai_torch.get_decomp_table())

    def raises(m: nn.Module) -> torch.export.ExportedProgram:
        raise ValueError("bad sample")

    converter = TorchConverter()
    converter.add_exported_program(export_decomposed(Scale(), (X,)), entrypoint_name="scale")
    bad_spec = coreai_torch.ExternalizeSpec(RMSNormImpl, "rms_norm", ["eps", "epsilon"])
    with pytest.raises(ExternalizationError, match=r"names 'epsilon', which is not an attribute"):
        converter.add_pytorch_module(model, export_fn, [bad_spec], entrypoint_name="norm")
    good_spec = coreai_torch.ExternalizeSpec(RMSNormImpl, "rms_norm", ["eps"])
    with pytest.raises(ConversionError, match=r"export_fn raised ValueError .*: bad sample"):
        converter.add_pytorch_module(model, raises, [good_spec], entrypoint_name="norm")
    assert converter.entrypoints == ["scale"]
    assert (model.forward, inner.forward) == forwards  # the module is restored
    torch.testing.assert_close(model(X), expected)

    converter.add_pytorch_module(model, export_fn, [good_spec], entrypoint_name="norm")
    program = converter.to_coreai()
    assert program.function_names == ["scale", "norm"]
    assert "rms_norm" in str(program)
    with Session(program) as session:
        (got,) = session.run({"x": X}, entrypoint="norm").values()
    np.testing.assert_allclose(got, expected.detach().numpy(), atol=1e-5)


KEPT_VALUES = """
import gc, json, warnings
warnings.simplefilter("ignore")
import numpy as np, torch, torch.nn as nn
from coreai_torch import LoweringError, TorchConverter
from coreai_torch._mlir import cai
from coreai_torch._utils import get_operand
from coreai_torch.runtime import Session
from coreai_torch.frontend.export import export_decomposed
from tests.reliability.support import run_isolated

@torch.library.custom_op("rel_kept::plus_one", mutates_args=())
def plus_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1

@plus_one.register_fake
def _(x):
    return torch.empty_like(x)

class PlusOne(nn.Module):
    def forward(self, x):
        return torch.ops.rel_kept.plus_one(x) * 2

OP = "rel_kept::plus_one.default"
x = torch.randn(3)
out = {}
for variant in ("operand", "result"):
    kept = {}
    converter = TorchConverter()

    @converter.register_torch_lowering(OP)
    def keeps_values(values_map, node, loc):
        x = get_operand(values_map, node, 0, loc)
        if variant == "operand":  # a constant kept between calls, used as an operand
            kept.setdefault("one", cai.constant(np.ones(3, np.float32)))
            return cai.broadcasting_add(x, kept["one"])
        kept.setdefault("result", cai.broadcasting_add(x, np.float32(1)))
        return kept["result"]  # a value of the first call returned again

    converter.add_exported_program(export_decomposed(PlusOne(), (x,)))
    first = converter.to_coreai()
    del first
    gc.collect()  # the first program (and its module) are gone
    errors = []
    for _ in range(2):
        try:
            converter.to_coreai()
        except LoweringError as error:
            errors.append(str(error))
    gc.collect()

    @converter.register_torch_lowering(OP, allow_override=True)
    def fixed(values_map, node, loc):
        return cai.broadcasting_add(get_operand(values_map, node, 0, loc), np.float32(1))

    program = converter.to_coreai()
    with Session(program) as session:
        (got,) = session.run({"x": x}).values()
    out[variant] = {
        "errors": errors,
        "fixed_matches": bool(np.allclose(got, PlusOne()(x).numpy(), atol=1e-6)),
    }
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def kept_values_child() -> dict:
    return run_isolated(KEPT_VALUES)


@pytest.mark.parametrize("variant", ["operand", "result"])
def test_after_a_lowering_that_keeps_values_between_calls(
    variant: str, kept_values_child: dict
) -> None:
    """A user lowering that caches an ``ir.Value`` and uses it in a later ``to_coreai()`` call
    (after the first program was freed) gets a LoweringError naming the op, the lowering and
    the fix, the process survives (it used to segfault), and the fixed lowering converts."""
    result = kept_values_child[variant]
    assert len(result["errors"]) == 2  # every later call is reported, none crashes
    for message in result["errors"]:
        assert message.startswith(
            "the lowering of 'rel_kept::plus_one.default' (keeps_values at <string>:"
        )
        assert (
            "used a Core AI value created during an earlier to_coreai() call (or for another "
            "graph) for node 'plus_one' (op rel_kept::plus_one.default)"
        ) in message
        assert "a value belongs to the conversion and graph that built it" in message
        assert (
            "Build values anew every time the lowering runs instead of keeping them between "
            "calls (keep numpy arrays and call cai.constant(...) each time), then call "
            "to_coreai() again."
        ) in message
    assert result["fixed_matches"]
