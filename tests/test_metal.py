"""Custom Metal kernels: ``TorchMetalKernel``, ``MetalParameter``, ``register_custom_kernels``."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

from coreai_torch import (
    MetalParameter,
    TorchConverter,
    TorchMetalKernel,
    UnsupportedOpError,
    UnsupportedPlatformError,
)
from coreai_torch._mlir import ca, ir
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.importer.metal import METAL_KERNEL_OP
from coreai_torch.program import AIProgram
from coreai_torch.runtime import run_program

ID = MetalParameter("id", "uint", "thread_position_in_grid")


def torch_add(x, y):  # no annotations, as in seed 000
    return x + y


VECTOR_ADD = TorchMetalKernel(
    "vector_add",
    input_names=["x", "y"],
    result_names=["output"],
    src="output[id] = x[id] + y[id];",
    torch_defn=torch_add,
    metal_params=[ID],
)

SUM_DIFF = TorchMetalKernel(
    "sum_diff",
    ["a", "b"],
    ["s", "d"],
    "s[id] = a[id] + b[id]; d[id] = a[id] - b[id];",
    lambda a, b: (a + b, a - b),
    [ID],
)

SCALE = TorchMetalKernel(
    "scale_rows",
    ["m", "factor"],
    ["out"],
    "out[gid.y, gid.x] = m[gid.y, gid.x] * factor;",
    lambda m, factor: m * factor,
    [MetalParameter("gid", "uint2", "[[thread_position_in_grid]]")],
)


class VectorAdd(nn.Module):
    def __init__(self, n: int = 8, group: int = 4, shapes: Any = "given") -> None:
        super().__init__()
        self.n, self.group, self.shapes = n, group, shapes

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        kwargs = {} if self.shapes is None else {"result_shapes": [(self.n,)]}
        out = VECTOR_ADD(
            x,
            y,
            threads_per_grid=(self.n, 1, 1),
            threads_per_thread_group=(self.group, 1, 1),
            **kwargs,
        )
        return out * 2


def staged(model: nn.Module, args: Sequence[Any], *kernels: TorchMetalKernel) -> TorchConverter:
    converter = TorchConverter().register_custom_kernels(list(kernels))
    return converter.add_exported_program(export_decomposed(model.eval(), args))


def convert(model: nn.Module, args: Sequence[Any], *kernels: TorchMetalKernel) -> AIProgram:
    return staged(model, args, *kernels).to_coreai()


@dataclass
class KernelOp:
    """What a ``coreai.metal4_kernel`` op holds, copied out of the IR."""

    name: str
    source: str
    #: printed defining ops of threads_per_grid, threads_per_thread_group, result shapes
    sizes: list[str]
    results: int


def kernel_ops(program: AIProgram) -> list[KernelOp]:
    found = []
    for graph in program.mlir_module.body.operations:
        for op in graph.regions[0].blocks[0].operations:
            if op.operation.name != "coreai.metal4_kernel":
                continue
            attrs = op.operation.attributes
            operands = list(op.operation.operands)
            n_results = len(op.operation.results)
            found.append(
                KernelOp(
                    ir.StringAttr(attrs["kernel_name"]).value,
                    ir.StringAttr(attrs["kernel_source"]).value,
                    [str(v.owner.attributes["value"]) for v in operands[-(2 + n_results) :]],
                    n_results,
                )
            )
    return found


# ---------------------------------------------------------------------- eager and export ----


def test_eager_call_runs_torch_defn() -> None:
    x, y = torch.randn(8), torch.randn(8)
    torch.testing.assert_close(VectorAdd()(x, y), (x + y) * 2)
    s, d = SUM_DIFF(
        x,
        y,
        threads_per_grid=(8, 1, 1),
        threads_per_thread_group=(8, 1, 1),
        result_shapes=[(8,), (8,)],
    )
    torch.testing.assert_close(s, x + y)
    torch.testing.assert_close(d, x - y)


def test_identity_torch_defn_does_not_alias_its_input() -> None:
    ident = TorchMetalKernel("ident", ["x"], ["y"], "y[id] = x[id];", lambda x: x, [ID])
    x = torch.randn(4)
    y = ident(x, threads_per_grid=(4, 1, 1), threads_per_thread_group=(4, 1, 1))
    assert torch.equal(x, y) and y.data_ptr() != x.data_ptr()


def test_export_keeps_one_node_per_call() -> None:
    ep = export_decomposed(VectorAdd().eval(), (torch.randn(8), torch.randn(8)))
    calls = [n for n in ep.graph.nodes if n.op == "call_function"]
    kernels = [n for n in calls if str(n.target) == "coreai_torch.metal_kernel.default"]
    assert len(kernels) == 1
    node = kernels[0]
    assert node.args[1] == "vector_add"
    assert list(node.args[3]) == [8, 1, 1] and list(node.args[4]) == [4, 1, 1]
    assert [tuple(v.shape) for v in node.meta["val"]] == [(8,)]


# --------------------------------------------------------------------------------- IR ----


def test_vector_add_lowers_to_metal4_kernel() -> None:
    program = convert(VectorAdd(), (torch.randn(8), torch.randn(8)), VECTOR_ADD)
    (op,) = kernel_ops(program)
    name = op.name
    source = op.source
    assert re.fullmatch(r"vector_add_[0-9a-f]{8}", name)
    assert "#include <metal_stdlib>" in source
    assert f"[[kernel]] void {name}(" in source
    assert "tensor<device float, metal::dextents<int, 1>, tensor_handle> x [[buffer(0)]]" in source
    assert "tensor<device float, metal::dextents<int, 1>, tensor_handle> y [[buffer(1)]]" in source
    assert (
        "tensor<device float, metal::dextents<int, 1>, tensor_handle> output [[buffer(2)]]"
        in source
    )
    assert "uint id [[thread_position_in_grid]]" in source
    assert "{ output[id] = x[id] + y[id]; }" in source
    assert op.sizes == [
        "dense<[8, 1, 1]> : tensor<3xui32>",  # threads_per_grid
        "dense<[4, 1, 1]> : tensor<3xui32>",  # threads_per_thread_group
        "dense<8> : tensor<1xui32>",  # the result's shape
    ]
    text = str(program)
    assert text.count("coreaix.copy_with_constraints") == 2
    assert "coreaix.copy_discarding_constraints" in text
    program.verify()
    program.optimize()
    assert len(kernel_ops(program)) == 1


def test_kernel_names_are_reproducible_and_differ_per_specialisation() -> None:
    class TwoDtypes(nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            grid = {"threads_per_grid": (4, 1, 1), "threads_per_thread_group": (4, 1, 1)}
            a = VECTOR_ADD(x, y, **grid)
            b = VECTOR_ADD(x.half(), y.half(), **grid)
            c = VECTOR_ADD(x, x, **grid)
            return a + b.float() + c

    args = (torch.randn(4), torch.randn(4))
    ops = kernel_ops(convert(TwoDtypes(), args, VECTOR_ADD))
    names = [op.name for op in ops]
    assert names[0] == names[2] != names[1]
    assert "tensor<device half," in ops[1].source
    again = [op.name for op in kernel_ops(convert(TwoDtypes(), args, VECTOR_ADD))]
    assert again == names


def test_multi_result_kernel() -> None:
    class M(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            s, d = SUM_DIFF(
                a,
                b,
                threads_per_grid=(6, 1, 1),
                threads_per_thread_group=(6, 1, 1),
                result_shapes=[(6,), (6,)],
            )
            return s * d

    program = convert(M(), (torch.randn(6), torch.randn(6)), SUM_DIFF)
    (op,) = kernel_ops(program)
    assert op.results == 2 and op.sizes[2:] == ["dense<6> : tensor<1xui32>"] * 2
    source = op.source
    assert "s [[buffer(2)]]" in source and "d [[buffer(3)]]" in source
    assert str(program).count("coreaix.copy_discarding_constraints") == 2
    program.verify()


def test_rank2_scalar_input_and_uint2_parameter() -> None:
    class M(nn.Module):
        def forward(self, m: torch.Tensor) -> torch.Tensor:
            factor = torch.tensor(3.0)
            return SCALE(
                m,
                factor,
                threads_per_grid=(5, 3, 1),
                threads_per_thread_group=(5, 3, 1),
                result_shapes=[(3, 5)],
            )

    m = torch.randn(3, 5)
    torch.testing.assert_close(M()(m), m * 3)
    (op,) = kernel_ops(convert(M(), (m,), SCALE))
    source = op.source
    assert "tensor<device float, metal::dextents<int, 2>, tensor_handle> m [[buffer(0)]]" in source
    assert "constant float& factor [[buffer(1)]]" in source
    assert "uint2 gid [[thread_position_in_grid]]" in source


def test_result_shapes_and_dtypes_default_to_torch_defn() -> None:
    to_int = TorchMetalKernel(
        "to_int", ["x"], ["y"], "y[id] = int(x[id]);", lambda x: x.to(torch.int32), [ID]
    )

    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return to_int(x, threads_per_grid=(6, 1, 1), threads_per_thread_group=(6, 1, 1))

    ep = export_decomposed(M(), (torch.randn(2, 3),))
    (node,) = [n for n in ep.graph.nodes if str(n.target) == "coreai_torch.metal_kernel.default"]
    assert [(tuple(v.shape), v.dtype) for v in node.meta["val"]] == [((2, 3), torch.int32)]
    (op,) = kernel_ops(convert(M(), (torch.randn(2, 3),), to_int))
    assert "tensor<device int, metal::dextents<int, 2>, tensor_handle> y" in op.source
    assert op.sizes == [
        "dense<[6, 1, 1]> : tensor<3xui32>",
        "dense<[6, 1, 1]> : tensor<3xui32>",
        "dense<[2, 3]> : tensor<2xui32>",
    ]


def test_helper_source_and_dtype_templates() -> None:
    kernel = TorchMetalKernel(
        "twice",
        ["x"],
        ["y"],
        "y[id] = twice_of(x[id]);",
        lambda x: x * 2,
        [ID],
        helper_src="inline T_X twice_of(T_X v) { return v + v; }",
        template_dtypes={"x": "T_X"},
    )

    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return kernel(x.half(), threads_per_grid=(4, 1, 1), threads_per_thread_group=(4, 1, 1))

    (op,) = kernel_ops(convert(M(), (torch.randn(4),), kernel))
    assert "inline half twice_of(half v) { return v + v; }" in op.source


# ------------------------------------------------------------------- saving and running ----


def test_program_saves_as_an_asset_and_running_it_here_is_a_clear_error(tmp_path: Path) -> None:
    program = convert(VectorAdd(), (torch.randn(8), torch.randn(8)), VECTOR_ADD).optimize()
    path = tmp_path / "vector_add.aimodel"
    program.save_asset(path)
    assert ca.AIModelAsset.is_valid(path)
    loaded = ca.AIModelAsset.load(path)
    assert "coreai.metal4_kernel" in str(loaded.program)
    with pytest.raises(UnsupportedPlatformError, match=r"Metal kernels.*Apple GPUs"):
        run_program(program, {"x": torch.randn(8), "y": torch.randn(8)})


# -------------------------------------------------------------------- registration ----


def test_register_custom_kernels_returns_self_and_accepts_repeats() -> None:
    converter = TorchConverter()
    assert converter.register_custom_kernels([VECTOR_ADD]) is converter
    assert converter.register_custom_kernels([VECTOR_ADD, SUM_DIFF]) is converter
    assert METAL_KERNEL_OP in converter.lowerings.own_names()
    assert METAL_KERNEL_OP not in TorchConverter().lowerings.own_names()


def test_unregistered_kernel_is_reported_when_staging() -> None:
    ep = export_decomposed(VectorAdd().eval(), (torch.randn(8), torch.randn(8)))
    other = TorchConverter().register_custom_kernels([SUM_DIFF])
    for converter in (TorchConverter(), other):
        with pytest.raises(UnsupportedOpError) as info:
            converter.add_exported_program(ep)
        message = str(info.value)
        assert "kernel 'vector_add'" in message
        assert "test_metal.py" in message  # the model's source line
        assert "register_custom_kernels" in message
    # registered on one converter only: the other still knows nothing about it
    TorchConverter().register_custom_kernels([VECTOR_ADD]).add_exported_program(ep)
    with pytest.raises(UnsupportedOpError):
        TorchConverter().add_exported_program(ep)


def test_clear_keeps_kernels() -> None:
    args = (torch.randn(8), torch.randn(8))
    converter = staged(VectorAdd(), args, VECTOR_ADD)
    converter.clear()
    converter.add_exported_program(export_decomposed(VectorAdd().eval(), args))
    assert len(kernel_ops(converter.to_coreai())) == 1


@pytest.mark.parametrize(
    ("kernels", "error", "match"),
    [
        (VECTOR_ADD, TypeError, r"pass \[kernel\]"),
        ("vector_add", TypeError, "list of TorchMetalKernel"),
        ([lambda x: x], TypeError, "TorchMetalKernel objects"),
        (
            [VECTOR_ADD, TorchMetalKernel("vector_add", ["x", "y"], ["o"], "o[0] = 1;", torch_add)],
            ValueError,
            "different Metal kernel named 'vector_add'",
        ),
    ],
)
def test_register_custom_kernels_errors(kernels: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        TorchConverter().register_custom_kernels(kernels)


SUPPORTED = (
    "supported: torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.uint8, "
    "torch.int16, torch.uint16, torch.int32, torch.uint32"
)

GREATER = TorchMetalKernel(
    "greater", ["x", "y"], ["output"], "output[id] = x[id] > y[id];", lambda x, y: x > y, [ID]
)


class Greater(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return GREATER(x, y, threads_per_grid=(8, 1, 1), threads_per_thread_group=(8, 1, 1))


@pytest.mark.parametrize(
    ("model", "kernel", "dtype", "problem", "fix"),
    [
        (
            VectorAdd(),
            VECTOR_ADD,
            torch.float64,
            "input 'x' has element type f64 (torch.float64)",
            "cast it before the call, e.g. x.to(torch.int32)",
        ),
        (
            VectorAdd(),
            VECTOR_ADD,
            torch.int64,
            "input 'x' has element type si64 (torch.int64)",
            "cast it before the call, e.g. x.to(torch.int32)",
        ),
        (
            Greater(),
            GREATER,
            torch.float32,
            "result 'output' has dtype torch.bool (torch_defn's result)",
            "make torch_defn return a supported dtype (e.g. .to(torch.int32) or .to(torch.uint8) "
            "for booleans) and convert the result after the call",
        ),
    ],
)
def test_unsupported_dtype_is_reported_at_conversion(
    model: nn.Module, kernel: TorchMetalKernel, dtype: torch.dtype, problem: str, fix: str
) -> None:
    """Dtypes the metal4_kernel verifier rejects (f64, si64, ui64, i1) are reported with the
    kernel, the argument, the accepted dtypes and the fix -- not as a verifier failure."""
    args = (torch.ones(8, dtype=dtype), torch.ones(8, dtype=dtype))
    with pytest.raises(UnsupportedOpError) as info:
        convert(model, args, kernel)
    message = str(info.value)
    assert message.startswith(f"node 'metal_kernel' (op {METAL_KERNEL_OP}) at ")
    assert "test_metal.py" in message
    assert f"Metal kernel '{kernel.name}': {problem}, which Metal kernels do not support" in message
    assert f"({SUPPORTED}); {fix}" in message


def test_metal_element_types_are_the_ones_the_verifier_accepts() -> None:
    """``METAL_ELEMENT_TYPES`` is checked against the metal4_kernel verifier for every type
    coreai-core's Metal type table maps."""
    from coreai_torch import dtypes
    from coreai_torch._mlir import cai, new_context
    from coreai_torch.importer.metal import METAL_ELEMENT_TYPES

    identity = TorchMetalKernel("ident", ["x"], ["y"], "y[id] = x[id];", lambda x: x, [ID])
    accepted = []
    for element in identity.core.metal_type_mappings:
        with new_context(), ir.Location.unknown():
            t = dtypes.tensor_type([8], dtypes.to_torch(element))  # type: ignore[arg-type]
            module = ir.Module.create()
            with ir.InsertionPoint(module.body):
                graph = cai.GraphOp("main", [t], [], ["x"])
                with graph.block:
                    (y,) = identity.emit([graph.arguments[0]], (8, 1, 1), (8, 1, 1), [t])
                    graph.outputs_spec = [("y", y)]
            try:
                module.operation.verify()
                accepted.append(element)
            except ir.MLIRError:
                pass
    assert sorted(accepted) == sorted(METAL_ELEMENT_TYPES)
    assert set(identity.core.metal_type_mappings) - set(accepted) == {"si64", "ui64", "i1"}


@pytest.mark.parametrize(
    "dtype",
    [torch.bfloat16, torch.float16, torch.int8, torch.uint8, torch.int16, torch.int32],
)
def test_supported_dtypes_convert(dtype: torch.dtype) -> None:
    args = (torch.ones(8, dtype=dtype), torch.ones(8, dtype=dtype))
    assert len(kernel_ops(convert(VectorAdd(), args, VECTOR_ADD))) == 1


def _raises(x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("boom")


RAISES = TorchMetalKernel("raises", ["x"], ["y"], "y[id] = x[id];", _raises, [ID])


class CallsRaises(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return RAISES(x, threads_per_grid=(8, 1, 1), threads_per_thread_group=(8, 1, 1))


def test_torch_defn_that_raises() -> None:
    """``torch_defn`` runs eagerly and while exporting (for the result dtypes); its error is
    reported with the kernel's name and keeps the original exception as the cause."""
    expected = "kernel 'raises': torch_defn raised RuntimeError: boom"
    with pytest.raises(RuntimeError) as info:
        CallsRaises()(X)
    assert str(info.value) == expected
    assert isinstance(info.value.__cause__, RuntimeError) and str(info.value.__cause__) == "boom"
    with pytest.raises(RuntimeError, match=re.escape(expected)):
        export_decomposed(CallsRaises(), (X,))


def test_dynamic_shape_inputs_are_rejected_at_conversion() -> None:
    """docs/extending.md: dynamic shapes are an UnsupportedOpError at conversion."""
    n = torch.export.Dim("n", min=2, max=64)
    ep = export_decomposed(
        VectorAdd(), (torch.randn(8), torch.randn(8)), dynamic_shapes=({0: n}, {0: n})
    )
    converter = TorchConverter().register_custom_kernels([VECTOR_ADD]).add_exported_program(ep)
    with pytest.raises(UnsupportedOpError) as info:
        converter.to_coreai()
    message = str(info.value)
    assert "test_metal.py" in message and "out = VECTOR_ADD(" in message
    assert (
        "Metal kernel 'vector_add': input 'x' has a dynamic shape (tensor<?xf32>); Metal "
        "kernels need static shapes: export without dynamic dimensions for the kernel's inputs"
    ) in message


DOUBLE = TorchMetalKernel("twice", ["x"], ["y"], "y[id] = 2 * x[id];", lambda x: 2 * x, [ID])


class ThreadsFromASize(nn.Module):
    def forward(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        grid = (n.shape[0], 1, 1)
        return DOUBLE(x, threads_per_grid=grid, threads_per_thread_group=(1, 1, 1)) + n.sum()


def test_thread_counts_known_only_at_run_time_are_rejected() -> None:
    n = torch.export.Dim("n", min=2, max=16)
    ep = export_decomposed(
        ThreadsFromASize(), (torch.randn(8), torch.randn(8)), dynamic_shapes=(None, {0: n})
    )
    converter = TorchConverter().register_custom_kernels([DOUBLE]).add_exported_program(ep)
    with pytest.raises(UnsupportedOpError) as info:
        converter.to_coreai()
    message = str(info.value)
    assert "test_metal.py" in message and "return DOUBLE(x, threads_per_grid=grid" in message
    assert re.search(
        r"Metal kernel 'twice': threads_per_grid must be static thread counts, got "
        r"\('s\d+', 1, 1\) \(computed from sizes that are only known at run time\); pass "
        r"fixed counts \(e.g. for the largest size\) and guard the kernel body",
        message,
    ), message


def test_result_shapes_must_hold_integers() -> None:
    with pytest.raises(ValueError) as info:
        _call(X, X, result_shapes=[(8.0,)])
    assert str(info.value) == "kernel 'vector_add': result shape (8.0,) must hold integers"


# ------------------------------------------------------------------- definition errors ----


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"name": "vector add"}, ValueError, "kernel name must be a C identifier"),
        ({"name": ""}, ValueError, "kernel name must be a C identifier"),
        ({"name": "kernel"}, ValueError, "reserved word"),
        ({"name": "__add"}, ValueError, "reserved word"),
        ({"input_names": ["x", "y-2"]}, ValueError, "input_names entry must be a C identifier"),
        ({"input_names": "xy"}, TypeError, "input_names must be a list"),
        ({"result_names": []}, ValueError, "at least one result"),
        ({"result_names": ["x"]}, ValueError, r"unique.*\['x'\]"),
        (
            {"metal_params": [MetalParameter("x", "uint", "thread_position_in_grid")]},
            ValueError,
            r"unique.*\['x'\]",
        ),
        ({"src": ""}, ValueError, "src must be the kernel body"),
        ({"src": None}, ValueError, "src must be the kernel body"),
        ({"torch_defn": "x + y"}, TypeError, "torch_defn must be a function"),
        ({"torch_defn": lambda x: x}, ValueError, r"takes 1 positional argument.*2 input"),
        ({"torch_defn": lambda x, y, z: x}, ValueError, r"takes 3 positional argument.*2 input"),
        (
            {"metal_params": [("id", "uint", "thread_position_in_grid")]},
            TypeError,
            "MetalParameter objects",
        ),
        (
            {"input_names": [f"t{i}" for i in range(30)], "torch_defn": lambda *xs: xs[0]},
            ValueError,
            "at most 31",
        ),
        ({"helper_src": 3}, TypeError, "helper_src must be a string"),
        ({"template_dtypes": {"z": "T"}}, ValueError, "not specified as part of the kernel"),
    ],
)
def test_kernel_definition_errors(kwargs: dict[str, Any], error: type, match: str) -> None:
    spec: dict[str, Any] = {
        "name": "vector_add",
        "input_names": ["x", "y"],
        "result_names": ["output"],
        "src": "output[id] = x[id] + y[id];",
        "torch_defn": torch_add,
        "metal_params": [ID],
    }
    spec.update(kwargs)
    with pytest.raises(error, match=match):
        TorchMetalKernel(**spec)


def test_flexible_torch_defn_signatures_are_accepted() -> None:
    for fn in (lambda *xs: xs[0] + xs[1], lambda x, y, scale=1.0: x + y * scale, torch.add):
        TorchMetalKernel("k", ["x", "y"], ["o"], "o[id] = x[id];", fn, [ID])


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("1d", "uint", "thread_position_in_grid"), "MetalParameter name must be a C identifier"),
        (("id", "uint 2", "thread_position_in_grid"), "type must be a Metal type name"),
        (("id", "uint", "thread_pos"), "unknown Metal attribute 'thread_pos'"),
        (("id", "uint", None), "unknown Metal attribute"),
    ],
)
def test_metal_parameter_errors(args: tuple[Any, ...], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MetalParameter(*args)


def test_metal_parameter_fields() -> None:
    p = MetalParameter("gid", "uint2", "[[ threads_per_grid ]]")
    assert (p.name, p.type, p.attribute) == ("gid", "uint2", "threads_per_grid")


# ------------------------------------------------------------------------ call errors ----


def _call(*tensors: Any, **kwargs: Any) -> Any:
    spec = {"threads_per_grid": (8, 1, 1), "threads_per_thread_group": (8, 1, 1)}
    spec.update(kwargs)
    return VECTOR_ADD(*tensors, **spec)


X = torch.randn(8)


@pytest.mark.parametrize(
    ("tensors", "kwargs", "error", "match"),
    [
        ((X,), {}, TypeError, r"takes 2 tensor\(s\) \['x', 'y'\], got 1"),
        ((X, X, X), {}, TypeError, "takes 2 tensor"),
        ((X, 1.0), {}, TypeError, "input 'y' must be a torch.Tensor, got float"),
        ((X, X), {"threads_per_grid": (8, 1)}, ValueError, "threads_per_grid must be 3"),
        ((X, X), {"threads_per_grid": 8}, ValueError, "threads_per_grid must be 3"),
        ((X, X), {"threads_per_grid": (8, 0, 1)}, ValueError, "positive thread counts"),
        ((X, X), {"threads_per_thread_group": (8, 1.5, 1)}, ValueError, "must hold integers"),
        ((X, X), {"threads_per_thread_group": (64, 32, 1)}, ValueError, "at most 1024"),
        ((X, X), {"result_shapes": [(8,), (8,)]}, ValueError, "one shape .* per result"),
        ((X, X), {"result_shapes": (8,)}, ValueError, "one shape .* per result"),
        ((X, X), {"result_shapes": [(0,)]}, ValueError, "size < 1"),
        ((X, X), {"result_shapes": [(4, 2)]}, ValueError, r"result_shapes entry \(4, 2\).*\(8,\)"),
    ],
)
def test_call_errors(
    tensors: tuple[Any, ...], kwargs: dict[str, Any], error: type, match: str
) -> None:
    with pytest.raises(error, match=match):
        _call(*tensors, **kwargs)


def test_missing_thread_counts_are_a_type_error() -> None:
    with pytest.raises(TypeError, match="threads_per_grid"):
        VECTOR_ADD(X, X, threads_per_thread_group=(8, 1, 1))


def test_torch_defn_returning_the_wrong_results() -> None:
    two = TorchMetalKernel("two", ["x"], ["a", "b"], "a[id] = x[id];", lambda x: x + 1, [ID])
    with pytest.raises(ValueError, match=r"torch_defn must return 2 tensor\(s\) \['a', 'b'\]"):
        two(X, threads_per_grid=(8, 1, 1), threads_per_thread_group=(8, 1, 1))

    class M(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return two(x, threads_per_grid=(8, 1, 1), threads_per_thread_group=(8, 1, 1))[0]

    with pytest.raises(ValueError, match="torch_defn must return 2"):
        export_decomposed(M(), (X,))  # the same check runs while exporting


# ------------------------------------------------------------------ strict export, saving ----


def test_strict_export_and_saved_exported_programs(tmp_path: Path) -> None:
    args = (torch.randn(8), torch.randn(8))
    ep = torch.export.export(VectorAdd().eval(), args, strict=True)
    torch.export.save(ep, tmp_path / "ep.pt2")
    loaded = torch.export.load(tmp_path / "ep.pt2").run_decompositions()
    converter = TorchConverter().register_custom_kernels([VECTOR_ADD])
    program = converter.add_exported_program(loaded).to_coreai()
    assert [
        op.source.endswith("{ output[id] = x[id] + y[id]; }") for op in kernel_ops(program)
    ] == [True]


def test_calls_from_another_process_find_the_kernel_by_name() -> None:
    kernel = TorchMetalKernel("by_name", ["x"], ["y"], "y[id] = x[id];", lambda x: x * 3, [ID])
    x = torch.randn(4)
    unknown_key = kernel.key + 10_000
    (y,) = torch.ops.coreai_torch.metal_kernel(
        [x], "by_name", unknown_key, [4, 1, 1], [4, 1, 1], [], []
    )
    torch.testing.assert_close(y, x * 3)
    with pytest.raises(RuntimeError, match="Metal kernel 'nowhere' is not defined"):
        torch.ops.coreai_torch.metal_kernel(
            [x], "nowhere", unknown_key, [4, 1, 1], [4, 1, 1], [], []
        )


def test_verifier_failures_of_kernel_ops_name_the_kernel_not_register_torch_lowering() -> None:
    """Should a kernel op still fail the verifier, the message blames the kernel call (which
    the user wrote with register_custom_kernels), not a register_torch_lowering lowering."""
    from types import SimpleNamespace

    from coreai_torch import VerificationError
    from coreai_torch._mlir import cai, new_context
    from coreai_torch.converter import _verify_with_sources
    from coreai_torch.locations import location

    ep = export_decomposed(VectorAdd(), (X, X))
    (node,) = [n for n in ep.graph.nodes if n.name == "metal_kernel"]
    with new_context(), ir.Location.unknown():
        si64 = ir.RankedTensorType.get([8], ir.IntegerType.get_signed(64))
        module = ir.Module.create()
        with ir.InsertionPoint(module.body):
            graph = cai.GraphOp("main", [si64, si64], [], ["x", "y"])
            with graph.block, location(node):
                (out,) = VECTOR_ADD.emit(list(graph.arguments), (8, 1, 1), (4, 1, 1), [si64])
                graph.outputs_spec = [("out", out)]
        builder = SimpleNamespace(nodes={node.name: node})
        with pytest.raises(VerificationError) as info:
            _verify_with_sources(module, builder, TorchConverter().lowerings)  # type: ignore[arg-type]
    message = str(info.value)
    assert "'coreai.metal4_kernel' op operand #0 must be" in message
    assert f"node 'metal_kernel' (op {METAL_KERNEL_OP})" in message and "test_metal.py" in message
    assert message.endswith(
        "The call of Metal kernel 'vector_add' (registered with register_custom_kernels) built "
        "this invalid coreai.metal4_kernel op: check the dtypes and shapes of the tensors passed "
        "to the kernel and returned by its torch_defn against the verifier message, then call "
        "to_coreai() again."
    )
    assert "register_torch_lowering" not in message
