"""Catalogue: unusual values and boundaries convert correctly, or are explained.

float64 (computed in double precision), complex tensors (explained), 0-d inputs and outputs,
very high rank, programs without inputs, constant and Python-scalar outputs, NaN/Inf inputs.
Inputs returned unchanged and the same tensor returned twice are covered by
tests/test_io_naming.py::test_input_returned_unchanged_and_same_tensor_twice; zero-size tensors
by tests/reliability/test_runtime_hazards.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from coreai_torch import TorchConverter, UnsupportedOpError
from coreai_torch._mlir import cai
from coreai_torch._utils import get_operand
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.runtime import Session
from coreai_torch.verify import verify
from tests.helpers import check_module


class Float64Mix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.ln = nn.LayerNorm(4)
        self.conv = nn.Conv2d(1, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = self.ln(self.fc(x))
        z = self.conv(x.reshape(1, 1, 3, 4))
        return torch.softmax(y, -1), y.exp().sum(-1), torch.cumsum(y, 0), y @ y.T, z, x + 1e-12


def test_float64_is_computed_in_double_precision() -> None:
    model = Float64Mix().double().eval()
    x = torch.randn(3, 4, dtype=torch.float64)
    check_module(model, (x,), atol=1e-12, rtol=1e-12)  # float32 would miss by ~1e-7
    program = TorchConverter().add_exported_program(export_decomposed(model, (x,))).to_coreai()
    assert 'tensor<3x4xf64> {coreai.name = "x"}' in str(program)


class MixedPrecision(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x + y, (x.float() * 3).double()


def test_float64_mixed_with_float32_follows_type_promotion() -> None:
    args = (torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.float32))
    check_module(MixedPrecision(), args, atol=1e-12, rtol=1e-6)


class ComplexMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x


def test_complex_arithmetic_is_explained_with_op_line_and_fix() -> None:
    x = torch.randn(3, dtype=torch.complex64)
    converter = TorchConverter().add_exported_program(export_decomposed(ComplexMul(), (x,)))
    with pytest.raises(UnsupportedOpError) as info:
        converter.to_coreai()
    message = str(info.value)
    assert "1 node(s) compute with complex tensors" in message
    assert "node 'mul' (op aten::mul.Tensor)" in message and "[complex64]" in message
    assert "test_values.py" in message and "return x * x" in message
    assert "torch.view_as_real" in message and "register_torch_lowering" in message
    assert list(info.value.ops) == ["aten::mul.Tensor"]

    # a lowering registered for the op is trusted with complex values
    @converter.register_torch_lowering("aten::mul.Tensor", allow_override=True)
    def mul(values_map, node, loc):
        a, b = (get_operand(values_map, node, i, loc) for i in (0, 1))
        return cai.mul(a, b)

    assert "coreai.mul" in str(converter.to_coreai())


class Identity(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_complex64_passing_through_unchanged_runs() -> None:
    x = torch.randn(4, dtype=torch.complex64)
    program = TorchConverter().add_exported_program(export_decomposed(Identity(), (x,))).to_coreai()
    with Session(program) as session:
        (out,) = session.run({"x": x}).values()
    np.testing.assert_array_equal(out, x.numpy())


def test_complex128_has_no_core_ai_type() -> None:
    """No lowering can help a dtype Core AI lacks: the fix is to keep complex128 out of the
    model, not register_torch_lowering."""
    x = torch.randn(2, dtype=torch.complex128)
    with pytest.raises(UnsupportedOpError) as info:
        TorchConverter().add_exported_program(export_decomposed(Identity(), (x,))).to_coreai()
    assert str(info.value) == (
        "entry point 'main': 1 node(s) compute with complex tensors, which coreai-torch's "
        "built-in lowerings do not support (complex128 has no Core AI type at all):\n"
        "  - input 'x' [complex128]\n"
        "No lowering can handle complex128 values, since Core AI cannot hold them: pass complex "
        "data as real tensors with a trailing dimension of 2 (torch.view_as_real outside the "
        "model) and do the arithmetic on real and imaginary parts, or keep the complex math "
        "outside the model."
    )


class Scalars(nn.Module):
    def forward(self, x: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x.sum(), s * 2, (x * s).mean(), s


def test_0d_inputs_and_outputs() -> None:
    check_module(Scalars(), (torch.randn(3), torch.tensor(1.5)))


class HighRank(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = torch.softmax(x * 2 + 1, -1)
        return y.sum((1, 3, 5)), y.permute(7, 6, 5, 4, 3, 2, 1, 0) - 1, y.amax(0), y[:, 1:, ..., :1]


def test_very_high_rank() -> None:
    check_module(HighRank(), (torch.randn(2, 2, 1, 2, 2, 1, 2, 3),))


def test_rank_10_elementwise_and_reduction() -> None:
    x = torch.randn(1, 2, 1, 2, 1, 2, 1, 2, 1, 3)
    check_module(Scalars(), (x, torch.tensor(0.5)))


class NoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))
        self.register_buffer("b", torch.arange(3.0))

    def forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.w * 2 + self.b, torch.ones(2, 2)


def test_model_without_inputs() -> None:
    report = check_module(NoInputs().eval(), ())
    assert len(report.outputs) == 2


class ConstantOutputs(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple:
        return x + 1, torch.zeros(2), 3, 2.5, True


def test_constant_and_python_scalar_outputs() -> None:
    ep = export_decomposed(ConstantOutputs(), (torch.randn(3),))
    program = TorchConverter().add_exported_program(ep).to_coreai()
    outputs = program.signatures["main"].outputs
    assert [o.name for o in outputs] == ["add", "full", "output_2", "output_3", "output_4"]
    with Session(program) as session:
        out = session.run({"x": torch.ones(3)})
    np.testing.assert_array_equal(out["add"], [2, 2, 2])
    np.testing.assert_array_equal(out["full"], [0, 0])
    assert out["output_2"].dtype == np.int64 and out["output_2"] == 3
    assert out["output_3"].dtype == np.float32 and out["output_3"] == 2.5
    assert out["output_4"].dtype == np.bool_ and bool(out["output_4"])


class StringOutput(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple:
        return x + 1, "label"


def test_string_output_is_explained() -> None:
    from coreai_torch import ConversionError

    ep = export_decomposed(StringOutput(), (torch.randn(3),))
    with pytest.raises(ConversionError) as info:
        TorchConverter().add_exported_program(ep).to_coreai()
    assert str(info.value) == (
        "output 'output_1' is a Python str ('label'); Core AI programs can only return tensors "
        "(and numbers): return it from a wrapper outside the exported module instead"
    )


class NonFinite(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (
            x * 2 + 1,
            torch.relu(x),
            torch.maximum(x, torch.zeros_like(x)),
            x.amax(-1),
            torch.softmax(x, -1),
            torch.exp(x),
            torch.where(x > 0, x, -x),
            torch.clamp(x, -1, 1),
            F.layer_norm(x, (4,)),
        )


def test_nan_and_inf_inputs_propagate_like_pytorch() -> None:
    nan, inf = math.nan, math.inf
    x = torch.tensor(
        [[nan, 1.0, 2.0, 3.0], [inf, -1.0, 0.5, 2.0], [-inf, -inf, -inf, -inf], [0.0, -0.0, 1, 2]]
    )
    model = NonFinite()
    program = TorchConverter().add_exported_program(export_decomposed(model, (x,))).to_coreai()
    program.optimize()
    report = verify(model, (x,), program=program)
    # verify() requires NaN and Inf in exactly the same places as PyTorch
    assert report.ok, str(report)


def test_verify_compares_the_imaginary_parts_of_complex_outputs() -> None:
    from coreai_torch.verify import compare

    z = np.array([1 + 2j, 3 - 1j], np.complex64)
    assert compare("z", z, z.copy()).ok
    assert not compare("z", z, np.conj(z)).ok  # same real parts: must still differ


def test_verify_flags_every_misplaced_nan_or_infinity() -> None:
    from coreai_torch.verify import compare

    inf, nan = math.inf, math.nan
    ref = np.array([1.0, inf, -inf, nan, 2.0], np.float32)
    assert compare("y", ref, ref.copy()).ok
    for wrong in (
        [inf, inf, -inf, nan, 2.0],
        [1.0, 3.0, -inf, nan, 2.0],
        [1.0, inf, inf, nan, 2.0],
        [1.0, inf, -inf, 0.0, 2.0],
        [1.0, inf, -inf, nan, nan],
    ):
        result = compare("y", ref, np.array(wrong, np.float32))
        assert not result.ok and result.problem == "NaN/Inf placement differs", wrong


class ConstantScaleChain(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1e30 * 1e30


@pytest.mark.xfail(
    reason="the Core AI runtime's compiler reassociates x * c1 * c2 into x * (c1 * c2) even "
    "when c1 * c2 overflows (docs/errors.md, 'compiler mis-folds'); no graph form found that "
    "it keeps apart",
    strict=True,
)
def test_chained_constant_scales_whose_product_overflows() -> None:
    check_module(ConstantScaleChain(), (torch.tensor([1e-30, 2e-31]),), optimize=False)
