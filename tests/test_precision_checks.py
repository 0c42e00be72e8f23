"""Half-precision conversions check the program they convert
(``coreai_torch.frontend.precision_checks``): weights beyond the half type's range stay in
float32 with a warning, selectors naming nothing the program has are errors with the close
matches, and ``check_range=sample_inputs`` keeps the nodes that overflow on the samples in
float32."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn

from coreai_torch import TorchConverter
from coreai_torch.cli.report import ConversionReport
from coreai_torch.frontend import precision_checks
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.runtime import run_program
from coreai_torch.verify import VerifyReport
from tests.helpers import run_advice


class Net(nn.Module):
    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc(x))
        return self.head(h * self.scale * self.scale) / self.scale**2


def _run(converter: TorchConverter, model: nn.Module, x: torch.Tensor) -> np.ndarray:
    program = converter.add_exported_program(export_decomposed(model, (x,))).to_coreai()
    name = "x" if isinstance(model, Net) else "input"  # forward()'s argument
    (out,) = run_program(program, {name: x}).values()
    return out


def _close(out: np.ndarray, expected: np.ndarray) -> None:
    scale = max(1.0, float(np.abs(expected).max()))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-2 * scale)


def test_weights_beyond_float16_stay_float32_with_a_warning() -> None:
    """They were stored as inf (every output of the layer inf or NaN)."""
    torch.manual_seed(0)
    model = nn.Linear(16, 4).eval()
    with torch.no_grad():
        model.weight[1, 3] = 1e5
        model.weight[2, 0] = -7e4
    x = torch.randn(3, 16) * 0.1
    with pytest.warns(RuntimeWarning) as record:
        out = _run(TorchConverter(compute_precision="fp16"), model, x)
    message = "\n".join(str(w.message) for w in record)
    assert "1 weight(s) hold values beyond fp16's largest finite value 65504" in message
    assert "weight (largest magnitude 1e+05)" in message
    assert "They stay in float32" in message
    assert "coreai_torch.verify.verify(model, args, precision='fp16')" in message
    assert "check_range=sample_inputs" in message
    _close(out, model(x).detach().numpy())
    with pytest.warns(RuntimeWarning):  # the advice, pasted, converts the model again
        (report,) = run_advice(message, model=model, args=(x,))
    assert isinstance(report, VerifyReport) and report.ok, report
    # bfloat16 holds them: nothing to say
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _run(TorchConverter(compute_precision="bf16"), model, x)
    assert not [w for w in record if "largest finite value" in str(w.message)]


def test_check_range_keeps_overflowing_nodes_in_float32() -> None:
    torch.manual_seed(1)
    model = Net(scale=300.0).eval()
    x = torch.randn(2, 16)
    expected = model(x).detach().numpy()
    out = _run(TorchConverter(compute_precision="fp16", check_range=False), model, x)
    assert not np.isfinite(out).all()  # h * 300 * 300 overflows float16
    with pytest.warns(RuntimeWarning, match="check_range") as record:
        out = _run(TorchConverter(compute_precision="fp16", check_range=(x,)), model, x)
    message = str(record[0].message)
    assert "node(s) computed values beyond fp16's largest finite value 65504" in message
    assert "node 'mul_1' (op aten::mul.Tensor)" in message
    assert "test_precision_checks.py" in message and "h * self.scale * self.scale" in message
    assert "coreai_torch.verify.verify(model, args, precision='fp16')" in message
    _close(out, expected)
    (report,) = run_advice(message, model=model, args=(x,))  # names the overflowing node
    assert not report.ok and report.divergence is not None, report
    # per entry point
    converter = TorchConverter(compute_precision="fp16", check_range={"main": (x,)})
    with pytest.warns(RuntimeWarning, match="check_range"):
        _close(_run(converter, model, x), expected)


def test_check_range_on_a_program_that_fits_changes_nothing() -> None:
    torch.manual_seed(2)
    model = Net(scale=1.0).eval()
    x = torch.randn(2, 16)
    plain = _run(TorchConverter(compute_precision="fp16", check_range=False), model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        checked = _run(TorchConverter(compute_precision="fp16", check_range=(x,)), model, x)
    np.testing.assert_array_equal(plain, checked)


def _converted(model: nn.Module, x: torch.Tensor, **options: Any) -> tuple[Any, Any]:
    """(the program, the converter) of ``model`` exported with ``x`` and converted in fp16."""
    converter = TorchConverter(compute_precision="fp16", **options)
    program = converter.add_exported_program(export_decomposed(model, (x,))).to_coreai()
    return program, converter


def test_activations_beyond_float16_are_found_on_the_example_inputs_by_default() -> None:
    """A float16 conversion of a model whose activations overflow was silently wrong (inf /
    NaN outputs) unless check_range= was given: the example inputs the exported program
    carries are checked by default, with a warning naming the node, its source line and
    what to do."""
    torch.manual_seed(1)
    model = Net(scale=300.0).eval()
    x = torch.randn(2, 16)
    with pytest.warns(RuntimeWarning, match="on the example inputs") as record:
        program, converter = _converted(model, x)
    message = str(record[0].message)
    assert "node 'mul_1' (op aten::mul.Tensor)" in message
    assert "test_precision_checks.py" in message and "h * self.scale * self.scale" in message
    assert "keep_fp32_ops / keep_fp32_modules" in message and "check_range=False" in message
    (out,) = run_program(program, {"x": x}).values()
    _close(out, model(x).detach().numpy())
    check = converter.last_stats.range_checks["main"]
    assert check.inputs == "example inputs" and check.skipped is None
    assert check.overflowing == 1 and 0 < check.seconds < converter.last_stats.seconds["main"]
    report = ConversionReport.build(converter, program)
    assert "main: range check on the example inputs: " in str(report)
    assert "1 node(s) overflowed, kept in float32" in str(report)


def test_the_default_range_check_is_switched_off_by_check_range_false() -> None:
    torch.manual_seed(1)
    model = Net(scale=300.0).eval()
    x = torch.randn(2, 16)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "check_range", RuntimeWarning)  # (not numpy's)
        program, converter = _converted(model, x, check_range=False)
    assert converter.last_stats.range_checks == {}
    (out,) = run_program(program, {"x": x}).values()
    assert not np.isfinite(out).all()  # as converted before the check existed


def test_the_default_range_check_is_silent_on_a_model_in_range() -> None:
    torch.manual_seed(2)
    model = Net(scale=1.0).eval()
    x = torch.randn(2, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        program, converter = _converted(model, x)
        plain, _ = _converted(model, x, check_range=False)
    assert str(program) == str(plain)
    check = converter.last_stats.range_checks["main"]
    assert check.skipped is None and check.overflowing == 0
    # a float32 conversion runs no check
    TorchConverter().add_exported_program(export_decomposed(model, (x,))).to_coreai()


class MaskedScores(nn.Module):
    """Causal attention weights with the mask Hugging Face builds: ``finfo(float32).min`` (the
    "minus infinity" that half precision holds as an infinity) above the diagonal."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        scores = h @ h.transpose(0, 1)
        blocked = torch.full_like(scores, torch.finfo(torch.float32).min)
        mask = torch.triu(blocked, diagonal=1)
        return torch.softmax(scores + mask, dim=-1)


def test_the_default_range_check_does_not_count_the_minimum_of_a_mask() -> None:
    """The masks' ``finfo(float32).min`` is not an overflow: the program computes in float16
    as the same program without the check (an OLMoE exported in fp16 from memory computed
    its attention in float32, from its checkpoint, unchecked, in float16)."""
    torch.manual_seed(2)
    model = MaskedScores().eval()
    x = torch.randn(6, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        program, converter = _converted(model, x)
    plain, _ = _converted(model, x, check_range=False)
    assert str(program) == str(plain)
    assert converter.last_stats.range_checks["main"].overflowing == 0
    (out,) = run_program(program, {"x": x}).values()
    _close(out, model(x).detach().numpy())


def test_the_default_range_check_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Beyond its caps the default check does not run (or stops), says why in the conversion
    stats and report, and the conversion goes on with the policy as given; sample inputs
    (or check_range=True) run it whatever it costs."""
    torch.manual_seed(1)
    model = Net(scale=300.0).eval()
    x = torch.randn(2, 16)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    monkeypatch.setattr(precision_checks, "AUTO_MAX_WEIGHT_BYTES", weights - 1)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "check_range", RuntimeWarning)  # (not numpy's)
        program, converter = _converted(model, x)
    check = converter.last_stats.range_checks["main"]
    assert check.seconds == 0.0 and check.overflowing == 0
    assert (
        check.skipped is not None and "more than the 0 MB the default check runs" in check.skipped
    )
    assert "pass check_range=sample_inputs" in check.skipped
    assert "range check on the example inputs: not run (" in str(
        ConversionReport.build(converter, program)
    )
    for explicit in (True, (x,)):  # not capped
        with pytest.warns(RuntimeWarning, match="check_range: 1 node"):
            _converted(model, x, check_range=explicit)

    monkeypatch.setattr(precision_checks, "AUTO_MAX_WEIGHT_BYTES", weights)
    monkeypatch.setattr(precision_checks, "AUTO_MAX_SECONDS", 0.0)  # stops at the first node
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "check_range", RuntimeWarning)  # (not numpy's)
        _, converter = _converted(model, x)
    check = converter.last_stats.range_checks["main"]
    assert check.skipped is not None and check.skipped.startswith("stopped after 0 s, at node 0")


def test_the_range_check_reports_its_progress() -> None:
    torch.manual_seed(1)
    events: list[tuple[str, int, int]] = []
    converter = TorchConverter(compute_precision="fp16")
    converter.progress = lambda task, done, total: events.append((task, done, total))
    x = torch.randn(2, 16)
    converter.add_exported_program(export_decomposed(Net(scale=1.0).eval(), (x,))).to_coreai()
    checked = [e for e in events if e[0] == "range check main"]
    assert checked and checked[-1][1] == checked[-1][2] > 0


def test_check_range_arguments_are_validated() -> None:
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match=r"check_range= is for half-precision conversions"):
        TorchConverter(check_range=(x,))
    ep = export_decomposed(Net().eval(), (x,))
    converter = TorchConverter(compute_precision="fp16", check_range=(x, x))
    with pytest.raises(
        ValueError, match=r"takes 1 input value\(s\) \(x\); the sample inputs have 2"
    ):
        converter.add_exported_program(ep).to_coreai()
    converter = TorchConverter(compute_precision="fp16", check_range=(x,))
    converter.add_exported_program(ep, entrypoint_name="a")
    converter.add_exported_program(ep, entrypoint_name="b")
    with pytest.raises(ValueError, match=r"2 entry points \(a, b\); give the sample inputs per"):
        converter.to_coreai()


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"keep_fp32_modules": ["hed"]}, r"keep_fp32_modules entry 'hed' .*close matches: head"),
        ({"keep_fp32_modules": ["fc.wieght"]}, r"'fc.wieght' .*its modules include fc, head"),
        (
            {"keep_fp32_modules": [nn.Conv2d]},
            r"'torch.nn.modules.conv.Conv2d' matches no module",
        ),
        ({"keep_fp32_modules": ["Linaer"]}, r"'Linaer' .*close matches: Linear"),
        ({"keep_fp32_ops": {"aten::adm"}}, r"'aten::adm': no such op; close matches: aten::addmm"),
        (
            {"keep_fp32_ops": {"aten::linear"}},
            r"'aten::linear': no node of the program runs it \(after decomposition\)",
        ),
    ],
)
def test_selectors_that_match_nothing_are_errors(options: dict, expected: str) -> None:
    ep = export_decomposed(Net().eval(), (torch.randn(2, 16),))
    converter = TorchConverter(compute_precision="fp16", **options)
    with pytest.raises(ValueError, match=r"(?s)the float32 islands they ask for would be missing"):
        converter.add_exported_program(ep).to_coreai()
    with pytest.raises(ValueError, match=f"(?s){expected}"):
        converter.to_coreai()


def test_selectors_that_match_are_accepted_and_a_predicate_that_selects_nothing_warns() -> None:
    ep = export_decomposed(Net().eval(), (torch.randn(2, 16),))
    for options in (
        {"keep_fp32_modules": ["head", "Linear", nn.Linear, "f*"]},
        {"keep_fp32_ops": {"aten::addmm", "aten::relu.default"}},
    ):
        TorchConverter(compute_precision="fp16", **options).add_exported_program(ep).to_coreai()
    converter = TorchConverter(compute_precision="fp16", keep_fp32=lambda node: False)
    with pytest.warns(RuntimeWarning, match=r"keep_fp32 \(the predicate\) selects no node"):
        converter.add_exported_program(ep).to_coreai()


def test_verify_bisects_with_selectors_that_match_later_nodes_only() -> None:
    """The probe conversions of a prefix of the program do not check the selectors (the
    prefix need not hold the selected module)."""
    from coreai_torch.precision import Precision
    from coreai_torch.verify import verify

    torch.manual_seed(1)
    model = Net(scale=300.0).eval()
    policy = Precision(torch.float16, keep_fp32_modules=("head",))
    report = verify(model, (torch.randn(2, 16),), precision=policy)
    assert not report.ok
    assert report.divergence is not None and report.divergence.node.name.startswith("mul")
