"""User lowerings: ``register_torch_lowering`` in both forms (the simple ``fn(values_map, node,
loc)`` and the built-ins' ``fn(cx, **arguments)`` with ``bind=True``), ``get_operand(s)``, the
seed 002 guide and docs/extending.md."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import coreai.authoring as ca  # before the dialect import (coreai-core's import order)
import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from coreai._compiler.dialects import coreai

import coreai_torch
from coreai_torch import LoweringError, TorchConverter, UnsupportedOpError
from coreai_torch._mlir import ir
from coreai_torch._utils import get_operand, get_operands
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.lowerings import BUILTIN_LOWERINGS, LoweringContext, cast, constant, dtype_of
from coreai_torch.lowerings.registry import resolve_op, rule_parameter_problem
from coreai_torch.program import AIProgram
from coreai_torch.verify import verify

SEED_EXAMPLES = Path(__file__).parent / "seed_examples"

# ----------------------------------------------------------------------- custom test ops ----


@torch.library.custom_op("cl_test::scaled_add", mutates_args=())
def scaled_add(x: torch.Tensor, y: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
    return x + scale * y


@scaled_add.register_fake
def _(x, y, scale=2.0):
    return torch.empty_like(x)


@torch.library.custom_op("cl_test::sum_diff", mutates_args=())
def sum_diff(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x + y, x - y


@sum_diff.register_fake
def _(x, y):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("cl_test::halves", mutates_args=())
def halves(x: torch.Tensor) -> list[torch.Tensor]:
    return [x * 0.5]


@halves.register_fake
def _(x):
    return [torch.empty_like(x)]


@torch.library.custom_op("cl_test::stack_sum", mutates_args=())
def stack_sum(xs: list[torch.Tensor], offset: int) -> torch.Tensor:
    return torch.stack(xs).sum(0) + offset


@stack_sum.register_fake
def _(xs, offset):
    return torch.empty_like(xs[0])


class ScaledAdd(nn.Module):
    def __init__(self, scale: float | None = 0.5) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            return torch.ops.cl_test.scaled_add(x, y)  # the schema default, 2.0
        return torch.ops.cl_test.scaled_add(x, y, self.scale)


class SumDiff(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        s, d = torch.ops.cl_test.sum_diff(x, y)
        return s * d


class SumOnly(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        s, _ = torch.ops.cl_test.sum_diff(x, y)
        return s


class Halves(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (h,) = torch.ops.cl_test.halves(x)
        return h + 1


class Pool(nn.Module):
    def __init__(self, size: tuple[int, int]) -> None:
        super().__init__()
        self.size = size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.adaptive_avg_pool2d(x, self.size)


def lower_scaled_add(values_map, node, loc):
    x, y, scale = get_operands(values_map, node, [0, 1, 2], loc)
    return coreai.broadcasting_add(x, coreai.broadcasting_mul(y, scale, loc=loc), loc=loc)


def lower_sum_diff(values_map, node, loc):
    x, y = get_operands(values_map, node, [0, 1], loc)
    return [coreai.broadcasting_add(x, y, loc=loc), coreai.broadcasting_sub(x, y, loc=loc)]


def lower_pool_static(values_map, node, loc):
    """The seed 002 override: sum pooling divided by the window size."""
    x = get_operand(values_map, node, 0, loc)
    output_h, output_w = node.args[1]
    input_h, input_w = x.type.shape[2], x.type.shape[3]
    stride_h, stride_w = input_h // output_h, input_w // output_w
    kernel_h = input_h - (output_h - 1) * stride_h
    kernel_w = input_w - (output_w - 1) * stride_w
    return coreai.broadcasting_divide(
        coreai.sumpool2d(
            x,
            kernel_size=np.array([kernel_h, kernel_w], dtype=np.uint32),
            strides=np.array([stride_h, stride_w], dtype=np.uint32),
            dilation=coreai.constant([1, 1], dtype=np.uint32),
        ),
        coreai.cast(float(kernel_h * kernel_w), x.type.element_type),
    )


def convert(converter: TorchConverter, model: nn.Module, args: Sequence[Any]) -> AIProgram:
    return converter.add_exported_program(export_decomposed(model.eval(), args)).to_coreai()


def check(converter: TorchConverter, model: nn.Module, args: Sequence[Any], **tol: float) -> str:
    """Convert with ``converter``, run on the runtime, compare with PyTorch; returns the IR."""
    program = convert(converter, model, args).optimize()
    report = verify(model, args, program=program, **tol)
    assert report.ok, f"{report}\n{program}"
    return str(program)


def converter_with(name: str, fn: Any, **kw: Any) -> TorchConverter:
    converter = TorchConverter()
    converter.register_torch_lowering(name, **kw)(fn)
    return converter


# ----------------------------------------------------------------------- seed examples ----


@pytest.mark.parametrize(
    "script", ["seed002_custom_op_lowering.py", "seed000_register_examples.py"]
)
def test_seed_examples_verbatim(script: str) -> None:
    """Each guide runs as written in a fresh interpreter (both define my_lib::scaled_add)."""
    done = subprocess.run(
        [sys.executable, str(SEED_EXAMPLES / script)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    checks = [line for line in done.stdout.splitlines() if line.startswith("CHECK")]
    assert len(checks) == {"seed002_custom_op_lowering.py": 2}.get(script, 3), done.stdout


# --------------------------------------------------------------------- names and errors ----


@pytest.mark.parametrize(
    "name",
    [
        "scaled_add",
        "my_lib:scaled_add",
        "my_lib::",
        "::scaled_add",
        "my lib::scaled_add",
        "my_lib::scaled_add.",
        "my_lib::scaled_add.default.extra",
        "my_lib::scaled-add",
        "",
        42,
        None,
    ],
)
def test_malformed_names_raise_value_error(name: Any) -> None:
    with pytest.raises(ValueError, match="namespace::op_name"):
        TorchConverter().register_torch_lowering(name)


@pytest.mark.parametrize("namespace", ["aten", "higher_order", "coreai", "coreaix"])
@pytest.mark.parametrize("op", ["add.Tensor", "_adaptive_avg_pool2d.default", "no_such_op"])
def test_reserved_namespaces_need_allow_override(namespace: str, op: str) -> None:
    name = f"{namespace}::{op}"
    converter = TorchConverter()
    with pytest.raises(ValueError, match=f"namespace '{namespace}'.*reserved.*allow_override"):
        converter.register_torch_lowering(name)
    assert name not in converter.lowerings.own_names()

    def fn(values_map, node, loc):
        return None

    assert converter.register_torch_lowering(name, allow_override=True)(fn) is fn
    assert converter.lowerings.get(name) is fn


def test_duplicates_raise_unless_allow_override_which_replaces_silently() -> None:
    converter = converter_with("cl_test::scaled_add.default", lower_scaled_add)
    with pytest.raises(ValueError, match=r"already registered.*allow_override=True"):
        converter.register_torch_lowering("cl_test::scaled_add.default")

    def doubled(values_map, node, loc):
        x, y = get_operands(values_map, node, [0, 1], loc)
        return coreai.broadcasting_mul(coreai.broadcasting_add(x, y), 2.0)

    converter.register_torch_lowering("cl_test::scaled_add.default", allow_override=True)(doubled)
    assert converter.lowerings.get("cl_test::scaled_add.default") is doubled
    x, y = torch.randn(3), torch.randn(3)
    program = convert(converter, ScaledAdd(1.0), (x, y))
    (out,) = coreai_torch.runtime.run_program(program, {"x": x, "y": y}).values()
    torch.testing.assert_close(torch.from_numpy(out), (x + y) * 2)  # the replacement ran


def test_non_callable_is_a_type_error() -> None:
    converter = TorchConverter()
    with pytest.raises(TypeError) as info:
        converter.register_torch_lowering("cl_test::scaled_add.default")(42)
    assert str(info.value) == (
        "register_torch_lowering('cl_test::scaled_add.default') decorates a lowering function "
        "fn(values_map, node, loc) returning a Core AI value (or a list of them); got int 42"
    )
    assert converter.lowerings.own_names() == []


def test_decorator_without_the_op_name() -> None:
    """``@converter.register_torch_lowering`` without parentheses would register nothing (and
    used to fail with a confusing 'not in namespace::op_name form' ValueError)."""
    converter = TorchConverter()
    with pytest.raises(TypeError) as info:

        @converter.register_torch_lowering
        def lower(values_map, node, loc):
            return None

    assert str(info.value) == (
        "register_torch_lowering was applied directly to 'lower'; it needs the op's qualified "
        "name: decorate with @converter.register_torch_lowering('namespace::op_name.overload') "
        "(with parentheses)"
    )
    assert converter.lowerings.own_names() == []


@pytest.mark.parametrize(
    ("fn", "shown"),
    [
        (lambda v: v, "(v)"),
        (lambda v, n: v, "(v, n)"),
        (lambda v, n, loc, extra: v, "(v, n, loc, extra)"),
    ],
)
def test_lowering_with_the_wrong_signature(fn: Any, shown: str) -> None:
    converter = TorchConverter()
    with pytest.raises(TypeError) as info:
        converter.register_torch_lowering("cl_test::scaled_add.default")(fn)
    assert str(info.value) == (
        "register_torch_lowering('cl_test::scaled_add.default'): the lowering "
        f"'<lambda>' takes {shown}, but lowerings are called as fn(values_map, node, loc) "
        "returning a Core AI value (or a list of them)"
    )
    assert converter.lowerings.own_names() == []


def test_lowerings_with_defaults_or_varargs_are_accepted() -> None:
    converter = TorchConverter()
    for fn in (lambda v, n, loc=None: v, lambda *args: args[0], lambda v, n, loc, *, k=1: v):
        converter.register_torch_lowering("cl_test::scaled_add.default", allow_override=True)(fn)
        assert converter.lowerings.get("cl_test::scaled_add.default") is fn


@pytest.mark.parametrize("flag", ["yes", 1, None])
def test_allow_override_must_be_a_bool(flag: Any) -> None:
    with pytest.raises(TypeError) as info:
        TorchConverter().register_torch_lowering("aten::add.Tensor", allow_override=flag)
    assert str(info.value) == (
        "register_torch_lowering: allow_override must be True or False, got "
        f"{type(flag).__name__} {flag!r}"
    )


# --------------------------------------------------------------------- isolation, clear ----


def test_registrations_stay_on_their_converter() -> None:
    args = (torch.randn(2, 3), torch.randn(2, 3))
    mine = converter_with("cl_test::scaled_add.default", lower_scaled_add)
    other = TorchConverter()
    assert "cl_test::scaled_add.default" not in BUILTIN_LOWERINGS
    assert "cl_test::scaled_add.default" not in other.lowerings
    check(mine, ScaledAdd(), args)
    with pytest.raises(UnsupportedOpError) as info:
        convert(other, ScaledAdd(), args)
    message = str(info.value)
    assert "cl_test::scaled_add.default" in message
    assert "test_custom_lowering.py" in message  # the model's source line
    assert 'register_torch_lowering("cl_test::scaled_add.default")' in message


def test_override_of_a_builtin_does_not_leak() -> None:
    x = torch.randn(1, 2, 4, 4)
    mine = converter_with(
        "aten::_adaptive_avg_pool2d.default", lower_pool_static, allow_override=True
    )
    builtin = BUILTIN_LOWERINGS.get("aten::_adaptive_avg_pool2d.default")
    assert builtin is not None and builtin is not lower_pool_static
    assert TorchConverter().lowerings.get("aten::_adaptive_avg_pool2d.default") is builtin
    assert "sum_pool_2d" in check(mine, Pool((1, 1)), (x,))
    assert "sum_pool_2d" not in str(convert(TorchConverter(), Pool((1, 1)), (x,)))


def test_clear_keeps_lowerings() -> None:
    args = (torch.randn(4), torch.randn(4))
    converter = converter_with("cl_test::scaled_add.default", lower_scaled_add)
    converter.add_exported_program(export_decomposed(ScaledAdd(), args))
    converter.add_exported_program(export_decomposed(ScaledAdd(), args), entrypoint_name="b")
    converter.clear(entrypoints=["b"])
    assert converter.entrypoints == ["main"]
    converter.clear()
    assert converter.entrypoints == []
    assert converter.lowerings.own_names() == ["cl_test::scaled_add.default"]
    check(converter, ScaledAdd(), args)


def test_name_without_overload_covers_every_overload() -> None:
    args = (torch.randn(4), torch.randn(4))
    converter = converter_with("cl_test::scaled_add", lower_scaled_add)
    assert converter.lowerings.get("cl_test::scaled_add.default") is lower_scaled_add
    check(converter, ScaledAdd(), args)

    def exact(values_map, node, loc):
        return get_operand(values_map, node, 0, loc)

    converter.register_torch_lowering("cl_test::scaled_add.default")(exact)
    assert converter.lowerings.get("cl_test::scaled_add.default") is exact  # exact name wins


# ------------------------------------------------------------------- adaptive pool override --


@pytest.mark.parametrize(
    ("size", "shape", "window"),
    [
        ((1, 1), (1, 3, 8, 8), "dense<8>"),
        ((2, 2), (2, 3, 8, 8), "dense<4>"),
        ((2, 3), (1, 2, 6, 9), "dense<3>"),
    ],
)
def test_adaptive_avg_pool2d_override_is_reached_and_used(
    size: tuple[int, int], shape: tuple[int, ...], window: str
) -> None:
    """get_decomp_table() keeps _adaptive_avg_pool2d (even for (1, 1)), so the override runs."""
    ep = export_decomposed(Pool(size).eval(), (torch.randn(shape),))
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert targets == ["aten._adaptive_avg_pool2d.default"]

    calls = []

    def spy(values_map, node, loc):
        calls.append(node.name)
        return lower_pool_static(values_map, node, loc)

    converter = converter_with("aten::_adaptive_avg_pool2d.default", spy, allow_override=True)
    text = check(converter, Pool(size), (torch.randn(shape),), atol=1e-5, rtol=1e-5)
    assert calls == ["_adaptive_avg_pool2d"]
    assert "coreai.sum_pool_2d" in text and "reduce_mean" not in text
    assert f"{window} : tensor<2xui32>" in text or window.replace(">", ", ") in text


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float16, 1e-3), (torch.bfloat16, 1e-2)])
def test_adaptive_avg_pool2d_override_in_half_precision(dtype: torch.dtype, tol: float) -> None:
    """The seed's coreai.cast(float, x.type.element_type) divisor follows the input dtype."""
    x = torch.randn(1, 3, 8, 8).to(dtype)
    converter = converter_with(
        "aten::_adaptive_avg_pool2d.default", lower_pool_static, allow_override=True
    )
    assert "coreai.sum_pool_2d" in check(converter, Pool((2, 2)), (x,), atol=tol, rtol=tol)


def test_adaptive_avg_pool2d_module_override() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    converter = converter_with(
        "aten::_adaptive_avg_pool2d.default", lower_pool_static, allow_override=True
    )
    assert "sum_pool_2d" in check(converter, model, (torch.randn(1, 3, 8, 8),))


# ------------------------------------------------------------------------- multi-output ----


def test_multi_output_list_is_stored_per_result() -> None:
    seen: dict[str, Any] = {}

    def lower(values_map, node, loc):
        seen["node"] = node.name
        seen["map"] = values_map
        return lower_sum_diff(values_map, node, loc)

    converter = converter_with("cl_test::sum_diff.default", lower)
    args = (torch.randn(2, 3), torch.randn(2, 3))
    check(converter, SumDiff(), args)
    name = seen["node"]
    assert f"{name}#0" in seen["map"] and f"{name}#1" in seen["map"]
    assert name not in seen["map"]


def test_multi_output_may_skip_unused_results() -> None:
    def lower(values_map, node, loc):
        x, y = get_operands(values_map, node, [0, 1], loc)
        return [coreai.broadcasting_add(x, y), None]

    check(converter_with("cl_test::sum_diff.default", lower), SumOnly(), (torch.randn(3),) * 2)


@pytest.mark.parametrize("as_list", [False, True])
def test_single_element_tuple_result(as_list: bool) -> None:
    def lower(values_map, node, loc):
        half = coreai.broadcasting_mul(get_operand(values_map, node, 0, loc), 0.5)
        return [half] if as_list else half

    check(converter_with("cl_test::halves.default", lower), Halves(), (torch.randn(5),))


def test_tensor_list_operand_and_int_scalar() -> None:
    class StackSum(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.ops.cl_test.stack_sum([a, b, a], 3)

    def lower(values_map, node, loc):
        xs, offset = get_operands(values_map, node, [0, 1], loc)
        assert isinstance(xs, list) and len(xs) == 3
        total = xs[0]
        for x in xs[1:]:
            total = coreai.broadcasting_add(total, x)
        return coreai.broadcasting_add(total, offset)

    ints = (torch.randint(-5, 5, (4,), dtype=torch.int32),) * 2
    text = check(converter_with("cl_test::stack_sum.default", lower), StackSum(), ints)
    assert "dense<3> : tensor<si32>" in text  # the int scalar took the tensors' dtype


# -------------------------------------------------------------------------- get_operand ----


@pytest.mark.parametrize(
    ("dtype", "mlir"),
    [(torch.float16, "f16"), (torch.float32, "f32"), (torch.bfloat16, "bf16")],
)
def test_python_scalars_become_constants_of_the_tensor_dtype(dtype: torch.dtype, mlir: str) -> None:
    converter = converter_with("cl_test::scaled_add.default", lower_scaled_add)
    args = (torch.randn(3, 4).to(dtype), torch.randn(3, 4).to(dtype))
    program = convert(converter, ScaledAdd(0.5), args)
    assert f"dense<5.000000e-01> : tensor<{mlir}>" in str(program)
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype]
    report = verify(ScaledAdd(0.5), args, program=program, atol=tol, rtol=tol)
    assert report.ok, report


def test_defaults_and_keywords_are_read_through_the_schema() -> None:
    converter = converter_with("cl_test::scaled_add.default", lower_scaled_add)
    args = (torch.randn(3), torch.randn(3))
    text = check(converter, ScaledAdd(None), args)  # scale left at its default, 2.0
    assert "dense<2.000000e+00> : tensor<f32>" in text


def test_get_operand_without_loc_uses_the_nodes_location() -> None:
    def lower(values_map, node, loc):
        x, y = get_operands(values_map, node, [0, 1])
        return coreai.broadcasting_add(
            x, coreai.broadcasting_mul(y, get_operand(values_map, node, 2))
        )

    check(converter_with("cl_test::scaled_add.default", lower), ScaledAdd(), (torch.randn(2),) * 2)


# ------------------------------------------------------------------- bad lowerings ----


def _convert_error(fn: Any, model: nn.Module, args: Sequence[Any], name: str) -> str:
    with pytest.raises(LoweringError) as info:
        convert(converter_with(name, fn), model, args)
    message = str(info.value)
    assert name in message, message  # names the op ...
    assert "test_custom_lowering.py" in message, message  # ... and the model's source line
    return message


def test_lowering_that_raises() -> None:
    def broken(values_map, node, loc):
        raise ValueError("cannot lower this scale")

    message = _convert_error(
        broken, ScaledAdd(), (torch.randn(2),) * 2, "cl_test::scaled_add.default"
    )
    assert "ValueError: cannot lower this scale" in message
    assert "raised in lowering" in message and "broken" in message


def test_lowering_with_invalid_coreai_call_reports_the_diagnostic() -> None:
    def bad(values_map, node, loc):
        x = get_operand(values_map, node, 0, loc)
        return coreai.batch_matmul(x, x)  # rank 1: rejected by the op builder

    message = _convert_error(bad, ScaledAdd(), (torch.randn(2),) * 2, "cl_test::scaled_add.default")
    assert "bad" in message


def test_lowering_that_returns_none() -> None:
    message = _convert_error(
        lambda values_map, node, loc: None,
        ScaledAdd(),
        (torch.randn(2),) * 2,
        "cl_test::scaled_add.default",
    )
    assert "returned None" in message


@pytest.mark.parametrize(
    ("model", "name", "count", "expected"),
    [
        (ScaledAdd(), "cl_test::scaled_add.default", 2, "returned 2 value(s)"),
        (ScaledAdd(), "cl_test::scaled_add.default", 0, "returned 0 value(s)"),
        (SumDiff(), "cl_test::sum_diff.default", 1, "returned one value"),
        (SumDiff(), "cl_test::sum_diff.default", 3, "returned 3 value(s)"),
    ],
)
def test_lowering_that_returns_the_wrong_number_of_values(
    model: nn.Module, name: str, count: int, expected: str
) -> None:
    def lower(values_map, node, loc):
        x = get_operand(values_map, node, 0, loc)
        return x if count == 1 else [x] * count

    message = _convert_error(lower, model, (torch.randn(2),) * 2, name)
    assert expected in message


def test_lowering_that_leaves_a_used_result_out() -> None:
    def lower(values_map, node, loc):
        return [get_operand(values_map, node, 0, loc), None]

    message = _convert_error(lower, SumDiff(), (torch.randn(2),) * 2, "cl_test::sum_diff.default")
    assert "gave no value for result 1" in message


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        (lambda x: np.ones(2, np.float32), "returned ndarray"),
        (lambda x: 1.5, "returned float"),
        (lambda x: coreai.cast(x, np.float16), "PyTorch computes"),
        (lambda x: coreai.concat(0, [x, x]), "PyTorch computes"),
    ],
)
def test_lowering_that_returns_the_wrong_type(result: Any, expected: str) -> None:
    def lower(values_map, node, loc):
        return result(get_operand(values_map, node, 0, loc))

    message = _convert_error(
        lower, ScaledAdd(), (torch.randn(2),) * 2, "cl_test::scaled_add.default"
    )
    assert expected in message


def test_get_operand_errors_name_the_node() -> None:
    def out_of_range(values_map, node, loc):
        return get_operand(values_map, node, 7, loc)

    message = _convert_error(
        out_of_range, ScaledAdd(), (torch.randn(2),) * 2, "cl_test::scaled_add.default"
    )
    assert "index 7 is out of range" in message

    def not_a_tensor(values_map, node, loc):
        return get_operand(values_map, node, 1, loc)

    pool = nn.Sequential(Pool((1, 1)))
    with pytest.raises(LoweringError, match=r"operand 1 .* is a list .*node.args"):
        convert(
            converter_with("aten::_adaptive_avg_pool2d.default", not_a_tensor, allow_override=True),
            pool,
            (torch.randn(1, 1, 2, 2),),
        )


def test_facade_values_and_single_result_ops_are_accepted() -> None:
    def lower(values_map, node, loc):
        x, y, scale = get_operands(values_map, node, [0, 1, 2], loc)
        return ca.broadcasting_add(x, ca.broadcasting_mul(y, scale))  # facade values

    args = (torch.randn(3), torch.randn(3))
    check(converter_with("cl_test::scaled_add.default", lower), ScaledAdd(), args)


def test_lowering_that_reuses_a_value_across_entry_points() -> None:
    """A value cached while lowering one entry point and reused in the next graph of the same
    conversion is reported like one from an earlier call (it would not dominate its use)."""
    kept: dict[str, Any] = {}

    def keeps_scale(values_map, node, loc):
        x, y = get_operands(values_map, node, [0, 1], loc)
        kept.setdefault("scale", coreai.constant(np.full(3, 0.5, np.float32)))
        return coreai.broadcasting_add(x, coreai.broadcasting_mul(y, kept["scale"]))

    converter = converter_with("cl_test::scaled_add.default", keeps_scale)
    ep = export_decomposed(ScaledAdd().eval(), (torch.randn(3), torch.randn(3)))
    converter.add_exported_program(ep, entrypoint_name="first")
    converter.add_exported_program(ep, entrypoint_name="second")
    with pytest.raises(LoweringError) as info:
        converter.to_coreai()
    message = str(info.value)
    assert message.startswith(
        "the lowering of 'cl_test::scaled_add.default' "
        "(test_lowering_that_reuses_a_value_across_entry_points.<locals>.keeps_scale at "
    )
    assert (
        "used a Core AI value created during an earlier to_coreai() call (or for another "
        in message
    )
    assert "Build values anew every time the lowering runs" in message
    kept.clear()  # a cache per conversion and graph would work; so does no cache
    assert converter.to_coreai(entrypoints=["first"]).function_names == ["first"]


# ------------------------------------------------- the built-in form (bind=True) ----


def bound_converter(name: str, fn: Any, **kw: Any) -> TorchConverter:
    return converter_with(name, fn, bind=True, **kw)


def test_bound_lowering_takes_the_arguments_by_name() -> None:
    seen: dict[str, Any] = {}

    def lower(cx: LoweringContext, x: Any, y: Any, scale: float) -> Any:
        seen.update(cx=cx, x=x, y=y, scale=scale, dtype=cx.out_dtype, shape=cx.out_shape)
        scaled = coreai.broadcasting_mul(y, constant(scale, dtype_of(y)))
        return coreai.broadcasting_add(x, scaled)

    check(
        bound_converter("cl_test::scaled_add.default", lower),
        ScaledAdd(0.5),
        (torch.randn(2, 3),) * 2,
    )
    assert isinstance(seen["cx"], LoweringContext)
    assert isinstance(seen["x"], ir.Value) and isinstance(seen["y"], ir.Value)
    assert seen["scale"] == 0.5
    assert (seen["dtype"], seen["shape"]) == (torch.float32, [2, 3])
    assert seen["cx"].node.name == "scaled_add"


@pytest.mark.parametrize(
    ("model", "expected"),
    [(ScaledAdd(None), 2.0), (ScaledAdd(0.25), 0.25)],
    ids=["left at the schema default", "given"],
)
def test_bound_lowering_gets_schema_defaults(model: nn.Module, expected: float) -> None:
    seen: list[float] = []

    def lower(cx: LoweringContext, x: Any, y: Any, scale: float) -> Any:
        seen.append(scale)
        return coreai.broadcasting_add(
            x, coreai.broadcasting_mul(y, constant(scale, torch.float32))
        )

    check(bound_converter("cl_test::scaled_add.default", lower), model, (torch.randn(3),) * 2)
    assert seen == [expected]


def test_bound_lowering_gets_keyword_arguments_and_tensor_lists() -> None:
    class Keyword(nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return torch.ops.cl_test.scaled_add(x, y=y, scale=3.0)

    class StackSum(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.ops.cl_test.stack_sum([a, b, a], 3)

    def scaled(cx: LoweringContext, x: Any, y: Any, scale: float) -> Any:
        assert scale == 3.0
        return coreai.broadcasting_add(x, coreai.broadcasting_mul(y, constant(scale, dtype_of(x))))

    def stacked(cx: LoweringContext, xs: list[Any], offset: int) -> Any:
        assert len(xs) == 3 and all(isinstance(x, ir.Value) for x in xs) and offset == 3
        total = xs[0]
        for x in xs[1:]:
            total = coreai.broadcasting_add(total, x)
        return coreai.broadcasting_add(total, constant(offset, dtype_of(total)))

    check(bound_converter("cl_test::scaled_add.default", scaled), Keyword(), (torch.randn(4),) * 2)
    ints = (torch.randint(-5, 5, (4,), dtype=torch.int32),) * 2
    check(bound_converter("cl_test::stack_sum.default", stacked), StackSum(), ints)


def test_bound_lowering_with_kwargs_takes_every_argument() -> None:
    seen: dict[str, Any] = {}

    def lower(cx: LoweringContext, **arguments: Any) -> Any:
        seen.update(arguments)
        return lower_sum_diff(cx.values_map, cx.node, cx.loc)

    check(bound_converter("cl_test::sum_diff.default", lower), SumDiff(), (torch.randn(3),) * 2)
    assert sorted(seen) == ["x", "y"]


def test_bound_lowering_rejects_an_argument_it_does_not_declare() -> None:
    def lower(cx: LoweringContext, x: Any, y: Any) -> Any:  # no scale: only its default is fine
        return coreai.broadcasting_add(x, coreai.broadcasting_mul(y, constant(2.0, dtype_of(y))))

    check(
        bound_converter("cl_test::scaled_add.default", lower),
        ScaledAdd(None),
        (torch.randn(3),) * 2,
    )
    with pytest.raises(UnsupportedOpError) as info:
        convert(
            bound_converter("cl_test::scaled_add.default", lower),
            ScaledAdd(0.5),
            (torch.randn(3),) * 2,
        )
    message = str(info.value)
    assert "argument scale=0.5 is not supported by this lowering" in message
    assert "cl_test::scaled_add.default" in message and "node 'scaled_add'" in message
    assert "test_custom_lowering.py" in message  # the model's source line


def test_bound_lowering_says_what_it_cannot_do() -> None:
    def lower(cx: LoweringContext, x: Any, y: Any, scale: float) -> Any:
        if scale < 0:
            raise cx.unsupported("negative scales are not supported")
        return x

    with pytest.raises(UnsupportedOpError) as info:
        convert(
            bound_converter("cl_test::scaled_add.default", lower),
            ScaledAdd(-1.0),
            (torch.randn(3),) * 2,
        )
    message = str(info.value)
    assert "negative scales are not supported" in message
    assert "cl_test::scaled_add.default" in message and "test_custom_lowering.py" in message


@pytest.mark.parametrize(
    ("model", "name", "result", "expected"),
    [
        (ScaledAdd(), "cl_test::scaled_add.default", lambda x: None, "returned None"),
        (ScaledAdd(), "cl_test::scaled_add.default", lambda x: 1.5, "returned float"),
        (
            ScaledAdd(),
            "cl_test::scaled_add.default",
            lambda x: cast(x, torch.float16),
            "PyTorch computes",
        ),
        (
            ScaledAdd(),
            "cl_test::scaled_add.default",
            lambda x: coreai.concat(0, [x, x]),
            "PyTorch computes",
        ),
        (ScaledAdd(), "cl_test::scaled_add.default", lambda x: [x, x], "returned 2 value(s)"),
        (SumDiff(), "cl_test::sum_diff.default", lambda x: x, "returned one value"),
    ],
    ids=["none", "not a value", "dtype", "shape", "too many", "too few"],
)
def test_bound_lowering_results_are_checked(
    model: nn.Module, name: str, result: Any, expected: str
) -> None:
    def lower(cx: LoweringContext, x: Any, **_: Any) -> Any:
        return result(x)

    with pytest.raises(LoweringError) as info:
        convert(bound_converter(name, lower), model, (torch.randn(2),) * 2)
    message = str(info.value)
    assert expected in message and name in message, message
    assert "test_custom_lowering.py" in message, message  # the model's source line


def test_bound_lowering_that_raises_names_its_own_line() -> None:
    def broken(cx: LoweringContext, x: Any, y: Any, scale: float) -> Any:
        raise ValueError("cannot lower this scale")

    with pytest.raises(LoweringError) as info:
        convert(
            bound_converter("cl_test::scaled_add.default", broken),
            ScaledAdd(),
            (torch.randn(2),) * 2,
        )
    message = str(info.value)
    assert "ValueError: cannot lower this scale" in message
    assert "raised in lowering" in message and "broken" in message
    assert "cl_test::scaled_add.default" in message and "test_custom_lowering.py" in message


@pytest.mark.parametrize(
    ("fn", "shown"),
    [
        (lambda cx, x, y, factor: x, "it declares factor, which the op's schema does not have"),
        (lambda x, y, scale: x, "it declares x (the first parameter receives the context, cx)"),
        (lambda *, x: x, "no positional first parameter for the LoweringContext"),
    ],
    ids=["unknown parameter", "no cx", "keyword-only"],
)
def test_bound_lowering_parameters_are_checked_at_registration(fn: Any, shown: str) -> None:
    with pytest.raises(TypeError) as info:
        bound_converter("cl_test::scaled_add.default", fn)
    message = str(info.value)
    assert "bind=True" in message and shown in message, message
    assert "(its arguments: x, y, scale)" in message or "keyword-only" not in shown, message


def test_bound_lowering_of_an_op_defined_later_is_checked_at_conversion() -> None:
    converter = bound_converter("cl_test::late_scale.default", lambda cx, x, factor: x)

    @torch.library.custom_op("cl_test::late_scale", mutates_args=())
    def late_scale(x: torch.Tensor, scale: float) -> torch.Tensor:
        return x * scale

    @late_scale.register_fake
    def _(x, scale):
        return torch.empty_like(x)

    class Late(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ops.cl_test.late_scale(x, 2.0)

    with pytest.raises(LoweringError) as info:
        convert(converter, Late(), (torch.randn(2),))
    message = str(info.value)
    assert "cannot take the arguments of cl_test::late_scale.default" in message
    assert "it declares factor" in message and "test_custom_lowering.py" in message


@pytest.mark.parametrize("flag", ["yes", 1, None])
def test_bind_must_be_a_bool(flag: Any) -> None:
    with pytest.raises(TypeError, match="bind must be True or False"):
        TorchConverter().register_torch_lowering("cl_test::scaled_add.default", bind=flag)


def test_a_builtin_rule_registers_unchanged_as_a_user_lowering() -> None:
    """Built-ins and user lowerings share the contract: the built-in relu rule itself, given to
    register_torch_lowering(bind=True), lowers relu; other converters keep the built-in."""
    relu_rule = inspect.unwrap(BUILTIN_LOWERINGS.get("aten::relu.default"))
    calls: list[str] = []

    def relu(cx: LoweringContext, self: Any) -> Any:
        calls.append(cx.node.name)
        return relu_rule(cx, self)

    converter = bound_converter("aten::relu.default", relu, allow_override=True)
    check(converter, nn.ReLU(), (torch.randn(2, 3),))
    assert calls == ["relu"]
    assert converter.lowerings.is_own("aten::relu.default")
    assert not TorchConverter().lowerings.is_own("aten::relu.default")


def test_every_builtin_rule_takes_its_ops_arguments() -> None:
    """The check bind=True makes of user lowerings holds for every built-in rule."""
    checked = 0
    for name in sorted(BUILTIN_LOWERINGS.names()):
        rule = getattr(BUILTIN_LOWERINGS.get(name), "__wrapped__", None)
        op = resolve_op(name)
        if rule is None or op is None:
            continue
        assert rule_parameter_problem(rule, op._schema) is None, name
        checked += 1
    assert checked > 500


def _doc_blocks() -> list[str]:
    text = (Path(__file__).parents[1] / "docs" / "extending.md").read_text()
    section = text.split("## Custom op lowerings", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


@pytest.mark.parametrize("form", ["simple", "bound"])
def test_extending_guide_examples_run(form: str, tmp_path: Path) -> None:
    """docs/extending.md: the op block followed by each form's block is a complete script;
    the program it converts matches PyTorch on the runtime."""
    setup, *forms = _doc_blocks()
    assert len(forms) == 2 and "bind=True" in forms[1] and "bind=True" not in forms[0]
    script = tmp_path / f"extending_{form}.py"
    script.write_text(
        setup
        + forms[form == "bound"]
        + "from coreai_torch.verify import verify\n"
        + "report = verify(Model(), args, program=program)\n"
        + "assert report.ok, report\n"
        + "print('CHECK ok')\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "CHECK ok" in done.stdout
