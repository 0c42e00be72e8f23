"""Runtime hazards: inputs and programs that would abort the Core AI runtime never reach it.

The runtime kills the process (no Python exception) on integer division by zero, on
``INT_MIN / -1``, on zero-element tensors, on 16-bit index operands, on huge pads and when a
rank-0 input is fed an array of shape (1,).  The converter prevents these at conversion time
(``coreai_torch.ir.checks``, the lowerings' guards) and ``coreai_torch.runtime.Session`` checks
inputs before calling the runtime.  Everything that runs a program here runs in a child
process that must survive.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from coreai_torch import RuntimeHazardError, TorchConverter
from coreai_torch._mlir import cai
from coreai_torch._utils import get_operand
from coreai_torch.frontend.export import export_decomposed
from tests.reliability.support import run_isolated

CHILD = """
import json, warnings
warnings.simplefilter("ignore")
import numpy as np, torch, torch.nn as nn, torch.nn.functional as F
from coreai_torch import TorchConverter
from coreai_torch.runtime import Session
from coreai_torch.frontend.export import export_decomposed

def program(model, args, **kw):
    return TorchConverter().add_exported_program(export_decomposed(model, args, **kw)).to_coreai()

def ordered(p, outputs):
    return [outputs[o.name] for o in p.signatures["main"].outputs]

def first(outputs):
    return next(iter(outputs.values()))

def error_of(fn):
    try:
        fn()
    except Exception as e:
        return [type(e).__name__, str(e)]
    return None

out = {}

class IntDiv(nn.Module):
    def forward(self, x, y):
        return x // y, x % y, torch.div(x, y, rounding_mode="trunc"), torch.fmod(x, y)

x = torch.tensor([7, -7, 5, -9, 3], dtype=torch.int32)
y = torch.tensor([2, 0, -1, 0, 3], dtype=torch.int32)
p = program(IntDiv(), (x, y))
with Session(p) as s:
    got = ordered(p, s.run({"x": x, "y": y}))
nz = (y != 0).numpy()
expected = [t.numpy() for t in IntDiv()(x, torch.where(y == 0, 1, y))]
out["int_div_nonzero_divisors_match"] = all(
    np.array_equal(g[nz], e[nz]) for g, e in zip(got, expected)
)
out["int_div_by_zero_values"] = [g[~nz].tolist() for g in got]

class MinDiv(nn.Module):
    def forward(self, x, y):
        return x // y, x % y
imin = torch.tensor([-2**31, -2**31, 6], dtype=torch.int32)
neg1 = torch.tensor([-1, 1, -1], dtype=torch.int32)
pm = program(MinDiv(), (imin, neg1))
with Session(pm) as s:
    got = ordered(pm, s.run({"x": imin, "y": neg1}))
out["int_min_div_minus_one"] = [g.tolist() for g in got]
out["int_min_expected"] = [t.tolist() for t in MinDiv()(imin, neg1)]

small = {}
for dtype in (torch.int8, torch.int16, torch.uint8):
    signs = [1, -1, -1, 1, 1] if dtype.is_signed else [1] * 5
    xs = torch.tensor([7 * signs[0], 100 * signs[1], 5 * signs[2], 9, 3], dtype=dtype)
    ys = torch.tensor([2, 0, 3 * signs[2], 0, 1], dtype=dtype)
    ps = program(IntDiv(), (xs, ys))
    with Session(ps) as s:
        got = ordered(ps, s.run({"x": xs, "y": ys}))
    nzs = (ys != 0).numpy()
    want = [t.numpy() for t in IntDiv()(xs, torch.where(ys == 0, 1, ys))]
    small[str(dtype)] = {
        "nonzero_match": all(np.array_equal(g[nzs], e[nzs]) for g, e in zip(got, want)),
        "dtypes": sorted({str(g.dtype) for g in got}),
        "by_zero": [g[~nzs].tolist() for g in got],
        "dividend": xs[~torch.from_numpy(nzs)].tolist(),
    }
out["small_int_division"] = small

class ConstDiv(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("d", torch.tensor([3, 0, 2], dtype=torch.int64))
    def forward(self, x):
        return x // self.d
xi = torch.tensor([9, 4, 5])
with Session(program(ConstDiv(), (xi,))) as s:
    out["constant_divisor_with_zero"] = first(s.run({"x": xi})).tolist()

class Scalar0(nn.Module):
    def forward(self, x):
        return x * 2
p0 = program(Scalar0(), (torch.tensor(1.5),))
with Session(p0) as s:
    out["rank0_fed_shape_1"] = error_of(lambda: s.run({"x": np.ones(1, np.float32)}))
    out["rank0_ok"] = first(s.run({"x": np.array(2.0, np.float32)})).tolist()

batch = torch.export.Dim("batch", min=1, max=8)
pd = program(Scalar0(), (torch.randn(2, 3),), dynamic_shapes=({0: batch},))
with Session(pd) as s:
    out["zero_rows_at_run_time"] = error_of(lambda: s.run({"x": np.zeros((0, 3), np.float32)}))
    out["three_rows"] = first(s.run({"x": np.ones((3, 3), np.float32)})).tolist()

class Crop(nn.Module):
    def forward(self, x):
        return F.pad(x, (-1, 2, 1, -1)) * 2
xc = torch.randn(3, 5)
with Session(program(Crop(), (xc,))) as s:
    out["negative_pad_matches"] = bool(np.allclose(first(s.run({"x": xc})), Crop()(xc).numpy()))

class CatEmpty(nn.Module):
    def forward(self, x):
        return torch.cat([x[:, :0], x, x[:, 2:2]], 1) + 1
xe = torch.randn(2, 3)
with Session(program(CatEmpty(), (xe,))) as s:
    got = first(s.run({"x": xe}))
out["cat_with_empty_matches"] = bool(np.allclose(got, CatEmpty()(xe).numpy()))

class CatDynamicEmpty(nn.Module):
    def forward(self, x, y, p):
        t, n = y.shape[2], p.shape[0]
        torch._check(t <= n)
        torch._check(n <= x.shape[2])
        return torch.cat([x[:, :, : n - t], y], 2) * 2
rows = torch.export.Dim("rows", min=2, max=16)
new, seen = torch.export.Dim("new", min=1, max=8), torch.export.Dim("seen", min=1, max=8)
pe = program(
    CatDynamicEmpty(),
    (torch.randn(1, 2, 8, 4), torch.randn(1, 2, 3, 4), torch.zeros(5)),
    dynamic_shapes=({2: rows}, {2: new}, {0: seen}),
)
with Session(pe) as s:
    cases = [(8, 4, 4), (8, 2, 6)]
    matches = []
    for r, t, n in cases:
        a, b, c = torch.randn(1, 2, r, 4), torch.randn(1, 2, t, 4), torch.zeros(n)
        got = first(s.run({"x": a, "y": b, "p": c}))
        matches.append(bool(np.allclose(got, CatDynamicEmpty()(a, b, c).numpy())))
    out["cat_with_dynamically_empty_matches"] = matches

class ItemSlice(nn.Module):
    def forward(self, x, n):
        k = n.item()
        torch._check(k >= 1)
        torch._check(k <= x.shape[0])
        return x[:k] * 2
x4 = np.ones((4, 3), np.float32)
with Session(program(ItemSlice(), (torch.randn(4, 3), torch.tensor(2)))) as s:
    out["item_of_input_0"] = error_of(lambda: s.run({"x": x4, "n": np.array(0, np.int64)}))
    out["item_of_input_2"] = first(s.run({"x": x4, "n": np.array(2, np.int64)})).shape

class IntArgument(nn.Module):
    def forward(self, x, n: int):
        return x[:n] * n
pi = program(IntArgument(), (torch.randn(6, 3), 4), dynamic_shapes=(None, torch.export.Dim.DYNAMIC))
x6 = np.ones((6, 3), np.float32)
with Session(pi) as s:
    out["int_argument_0"] = error_of(lambda: s.run({"x": x6, "n": np.array(0, np.int64)}))
    out["int_argument_7"] = error_of(lambda: s.run({"x": x6, "n": np.array(7, np.int64)}))
    out["int_argument_4"] = first(s.run({"x": x6, "n": np.array(4, np.int64)})).shape

class ComputedItem(nn.Module):
    def forward(self, x, n):
        k = (n * 2).sum().item()
        torch._check(k >= 1)
        torch._check(k <= x.shape[0])
        return x[:k] * 2
pc = program(ComputedItem(), (torch.randn(4, 3), torch.tensor([1])))
with Session(pc) as s:
    out["computed_item_0"] = error_of(lambda: s.run({"x": x4, "n": np.array([0], np.int64)}))
    out["computed_item_3"] = error_of(lambda: s.run({"x": x4, "n": np.array([3], np.int64)}))
    out["computed_item_2"] = first(s.run({"x": x4, "n": np.array([2], np.int64)})).shape
with Session(pc.optimize()) as s:
    out["computed_item_0_optimized"] = error_of(
        lambda: s.run({"x": x4, "n": np.array([0], np.int64)})
    )

class AddRows(nn.Module):
    def forward(self, x, y):
        return x + y
rows = torch.export.Dim("rows", min=2, max=8)
pr = program(
    AddRows(), (torch.randn(3, 2), torch.randn(3, 2)), dynamic_shapes=({0: rows}, {0: rows})
)
with Session(pr) as s:
    out["dim_above_max"] = error_of(
        lambda: s.run({"x": np.ones((9, 2), np.float32), "y": np.ones((9, 2), np.float32)})
    )
    out["dims_disagree"] = error_of(
        lambda: s.run({"x": np.ones((3, 2), np.float32), "y": np.ones((4, 2), np.float32)})
    )
    out["dims_agree"] = first(
        s.run({"x": np.ones((4, 2), np.float32), "y": np.ones((4, 2), np.float32)})
    ).tolist()

print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def child() -> dict[str, Any]:
    return run_isolated(CHILD)


def test_integer_division_by_a_zero_tensor_divisor_does_not_abort(child: dict[str, Any]) -> None:
    assert child["int_div_nonzero_divisors_match"]
    # PyTorch raises for these elements; the program returns the documented values
    # (x // 0 == x, x % 0 == 0, trunc(x / 0) == x, fmod(x, 0) == 0) instead of aborting.
    assert child["int_div_by_zero_values"] == [[-7, -9], [0, 0], [-7, -9], [0, 0]]


@pytest.mark.parametrize(
    ("dtype", "numpy_dtype"),
    [("torch.int8", "int8"), ("torch.int16", "int16"), ("torch.uint8", "uint8")],
)
def test_small_integer_tensor_divisors_containing_zero_do_not_abort(
    child: dict[str, Any], dtype: str, numpy_dtype: str
) -> None:
    """int8/int16/uint8 divisors are guarded like int32 ones (``//``, ``%``, trunc, fmod)."""
    result = child["small_int_division"][dtype]
    assert result["nonzero_match"]
    assert result["dtypes"] == [numpy_dtype]  # no silent promotion
    dividend = result["dividend"]
    assert result["by_zero"] == [dividend, [0, 0], dividend, [0, 0]]


def test_int_min_divided_by_minus_one_wraps_like_pytorch(child: dict[str, Any]) -> None:
    assert child["int_min_div_minus_one"] == child["int_min_expected"]


def test_constant_divisor_containing_zero_does_not_abort(child: dict[str, Any]) -> None:
    assert child["constant_divisor_with_zero"] == [3, 4, 2]


def test_rank0_input_fed_shape_1_is_a_clear_error(child: dict[str, Any]) -> None:
    kind, message = child["rank0_fed_shape_1"]
    assert kind == "ValueError"
    assert "input 'x' of 'main' must have shape ()" in message and "got (1,)" in message
    assert child["rank0_ok"] == 4.0  # the session stays usable


def test_a_concatenation_runs_with_an_operand_empty_at_run_time(child: dict[str, Any]) -> None:
    """``cat([x[:, : n - t], y])`` with ``n == t``: the slice is empty, the concatenation skips
    it (the rows of a KV cache before a prompt's first tokens); the Session lets it run."""
    assert child["cat_with_dynamically_empty_matches"] == [True, True]


def test_zero_rows_for_a_dynamic_dimension_is_a_clear_error(child: dict[str, Any]) -> None:
    kind, message = child["zero_rows_at_run_time"]
    assert kind == "ValueError"
    assert "zero elements (0, 3)" in message and "cannot run on empty tensors" in message
    assert child["three_rows"] == [[2.0] * 3] * 3


def test_item_of_an_input_outside_its_checked_range_is_rejected_before_the_runtime(
    child: dict[str, Any],
) -> None:
    """``k = n.item(); torch._check(k >= 1)``: the Session checks the fed ``n`` (an input) against
    the range torch.export recorded (it aborted the process before)."""
    kind, message = child["item_of_input_0"]
    assert kind == "ValueError"
    assert message.startswith(
        "'main': the value of input 'n' (read with .item()) is 0, outside the range [1, 4] the "
        "program was exported for (the model's torch._check calls on the .item() value; "
        "PyTorch raises too). Feed a value within the range"
    )
    assert child["item_of_input_2"] == [2, 3]  # the session stays usable


def test_dynamic_int_argument_that_empties_a_value_is_rejected_before_the_runtime(
    child: dict[str, Any],
) -> None:
    """``x[:n] * n`` with a dynamic int ``n`` fed 0: ``x[:0]`` would be empty and ``mul`` would
    abort the runtime; the Session names the value, the node and the source line."""
    kind, message = child["int_argument_0"]
    assert kind == "ValueError"
    assert message.startswith("'main': with input 'n' = 0, node 'slice_1' (op aten::slice.Tensor)")
    assert "would have zero elements (shape (0, 3))" in message
    assert "the Core AI runtime aborts the process when an op consumes an empty tensor" in message
    assert "Feed values that keep its size" in message and "being input 'n'" in message
    kind, message = child["int_argument_7"]
    assert kind == "ValueError"
    assert "input 'n' is 7, outside the range [0, 6] the program was exported for" in message
    assert child["int_argument_4"] == [4, 3]


def test_computed_item_outside_its_checked_range_stops_the_program_recoverably(
    child: dict[str, Any],
) -> None:
    """``k = (n * 2).sum().item()``: no feed shows ``k``, so the program itself checks the
    range of ``torch._check`` (a guarded gather) and the Session explains the runtime's error."""
    for key, value in (("computed_item_0", 0), ("computed_item_3", 6)):
        kind, message = child[key]
        assert kind == "ValueError"
        assert message.startswith(
            "'main': the value read with .item() by node '_local_scalar_dense' "
            "(op aten::_local_scalar_dense.default)"
        )
        assert f"was {value} when the program ran, outside the range [1, 4]" in message
        assert "Feed inputs for which the checks hold" in message
    assert child["computed_item_0_optimized"] == child["computed_item_0"]
    assert child["computed_item_2"] == [4, 3]


def test_dynamic_dims_outside_their_range_or_disagreeing_are_rejected(
    child: dict[str, Any],
) -> None:
    kind, message = child["dim_above_max"]
    assert kind == "ValueError"
    assert message.startswith("'main': dimension 0 of input 'x' is 9, outside the range [2, 8]")
    assert "(its torch.export.Dim bounds)" in message
    kind, message = child["dims_disagree"]
    assert kind == "ValueError"
    assert message == (
        "'main': dimension 0 of input 'y' is 4 but dimension 0 of input 'x' is 3; the program "
        "was exported with both equal (the same torch.export.Dim). Feed equal sizes."
    )
    assert child["dims_agree"] == [[2.0, 2.0]] * 4


def test_negative_pads_crop_instead_of_wrapping_around(child: dict[str, Any]) -> None:
    assert child["negative_pad_matches"]


def test_empty_inputs_of_cat_are_dropped(child: dict[str, Any]) -> None:
    assert child["cat_with_empty_matches"]


# ----------------------------------------------------- rejected at conversion time (no run) ----


def _convert(model: nn.Module, *args: torch.Tensor, converter: TorchConverter | None = None):
    converter = converter or TorchConverter()
    return converter.add_exported_program(export_decomposed(model, args)).to_coreai()


class EmptySlice(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, 2:2] * 2


def test_zero_element_values_are_rejected_with_the_source_line() -> None:
    with pytest.raises(RuntimeHazardError) as info:
        _convert(EmptySlice(), torch.randn(2, 4))
    message = str(info.value)
    assert "zero elements" in message and "runtime cannot execute" in message
    assert "node 'slice_1' (op aten::slice.Tensor)" in message
    assert "test_runtime_hazards.py" in message and "return x[:, 2:2] * 2" in message
    assert "Remove the empty tensors" in message


def test_zero_size_input_is_rejected() -> None:
    with pytest.raises(RuntimeHazardError, match=r"(?s)zero elements.*node 'x'.*Remove the empty"):
        _convert(EmptySlice(), torch.randn(0, 4))


class ItemMaybeZero(nn.Module):
    def forward(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        k = n.item()
        torch._check(k >= 0)
        torch._check(k <= x.shape[0])
        return x[:k] * 2


class ItemAsStart(nn.Module):
    def forward(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        k = n.item()
        torch._check(k >= 1)
        torch._check(k <= x.shape[0])
        return x[k:] * 2


class ItemUnchecked(nn.Module):
    def forward(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        k = n.item()
        return torch.zeros(k) + x.sum()


class ItemReturned(nn.Module):
    def forward(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        k = n.item()
        torch._check(k >= 0)
        torch._check(k <= x.shape[0])
        return x[:k]


@pytest.mark.parametrize(
    ("model", "node", "source", "size", "fix"),
    [
        (
            ItemMaybeZero(),
            "slice_1",
            "return x[:k] * 2",
            "size u0 of shape (u0, 3) can be 0",
            "torch._check(k >= 1)",
        ),
        (
            ItemAsStart(),
            "slice_1",
            "return x[k:] * 2",
            "size 4 - u0 of shape (4 - u0, 3) can be 0",
            "torch._check(4 - k >= 1)",
        ),
        (
            ItemUnchecked(),
            "full",
            "torch.zeros(k) + x.sum()",
            "size u0 of shape (u0,) can be 0",
            "torch._check(k >= 1)",
        ),
    ],
)
def test_item_sizes_that_may_be_zero_are_rejected_at_conversion(
    model: nn.Module, node: str, source: str, size: str, fix: str
) -> None:
    """A size from ``.item()`` that torch.export's ranges allow to be 0 would abort the runtime
    when it is 0; the converter names the node, the .item() line and the torch._check to add."""
    with pytest.raises(RuntimeHazardError) as info:
        _convert(model, torch.randn(4, 3), torch.tensor(2))
    message = str(info.value)
    assert message.startswith(
        "entry point 'main': 1 value(s) have a size computed from .item() that may be 0 when the "
        "program runs, and the Core AI runtime aborts the process when an op consumes an empty "
        "tensor:"
    )
    assert f"node '{node}'" in message and source in message and size in message
    assert "u0 = .item() at" in message and "k = n.item()" in message
    assert f"add {fix} right after the .item() call in the model" in message
    assert "torch.export turns torch._check into a range constraint" in message


def test_item_sizes_that_are_only_returned_may_be_zero() -> None:
    """Returning a possibly empty slice is safe (the runtime returns empty outputs)."""
    program = _convert(ItemReturned(), torch.randn(4, 3), torch.tensor(2))
    assert program.function_names == ["main"]


class IntArgument(nn.Module):
    def forward(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x[:n] * n


class ComputedItem(nn.Module):
    def forward(self, x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        k = (n * 2).sum().item()
        torch._check(k >= 1)
        torch._check(k <= x.shape[0])
        return x[:k] * 2


def test_feed_checks_name_the_source_line() -> None:
    """The checks the Session runs before calling the runtime (see the child process above for
    the end-to-end run) point at the user's line."""
    ep = export_decomposed(
        IntArgument(), (torch.randn(6, 3), 4), dynamic_shapes=(None, torch.export.Dim.DYNAMIC)
    )
    sizes = TorchConverter().add_exported_program(ep).to_coreai().signatures["main"].sizes
    feeds = {"x": np.ones((6, 3), np.float32), "n": np.array(0, np.int64)}
    with pytest.raises(ValueError) as info:
        sizes.check(feeds, "main")
    message = str(info.value)
    assert "node 'slice_1' (op aten::slice.Tensor) at " in message
    assert "test_runtime_hazards.py" in message and "return x[:n] * n" in message
    sizes.check({**feeds, "n": np.array(1, np.int64)}, "main")  # no error


class FirstRows(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x[: y.shape[0]] + y


def test_derived_dims_are_checked_before_the_runtime() -> None:
    """``x`` exported with ``2 * b`` rows and ``y`` with ``b``: feeds must keep the relation
    and the ranges (checked without calling the runtime)."""
    b = torch.export.Dim("b", min=2, max=8)
    ep = export_decomposed(
        FirstRows(), (torch.randn(8, 3), torch.randn(4, 3)), dynamic_shapes=({0: 2 * b}, {0: b})
    )
    sizes = TorchConverter().add_exported_program(ep).to_coreai().signatures["main"].sizes

    def feeds(x_rows: int, y_rows: int) -> dict[str, np.ndarray]:
        return {"x": np.ones((x_rows, 3), np.float32), "y": np.ones((y_rows, 3), np.float32)}

    sizes.check(feeds(6, 3), "main")
    with pytest.raises(ValueError) as info:
        sizes.check(feeds(8, 3), "main")
    assert re.fullmatch(
        r"'main': dimension 0 of input 'x' is 8, but the program was exported with it equal to "
        r"2\*s\d+ = 6 \(s\d+ being dimension 0 of input 'y' = 3; a derived torch.export.Dim\)\. "
        r"Feed sizes that satisfy the relation\.",
        str(info.value),
    ), str(info.value)
    with pytest.raises(ValueError) as info:
        sizes.check(feeds(18, 9), "main")
    assert str(info.value) == (
        "'main': dimension 0 of input 'x' is 18, outside the range [4, 16] the program was "
        "exported for (its torch.export.Dim bounds). Feed a value within the range, or export "
        "again with other bounds."
    )


def test_failed_item_range_check_names_the_item_line() -> None:
    program = _convert(ComputedItem(), torch.randn(4, 3), torch.tensor([1]))
    sizes = program.signatures["main"].sizes
    (guard,) = sizes.guards
    assert (guard.lower, guard.upper) == (1, 4)
    assert "coreai.gather_nd" in str(program)  # the range check is part of the program
    runtime_error = RuntimeError(
        'KernelError(kernelName: "coreai.gather_nd", kind: StaticCoreAIRuntime.KernelError.Kind.'
        f'invalidParameters("Index {-(guard.table + 1)} is out of range [-{guard.table}, '
        f'{guard.table}) for gather/scatter dimension.")))'
    )
    message = str(sizes.explain(runtime_error, "main"))
    assert "node '_local_scalar_dense' (op aten::_local_scalar_dense.default) at " in message
    assert "test_runtime_hazards.py" in message and "k = (n * 2).sum().item()" in message
    assert "was 0 when the program ran, outside the range [1, 4]" in message
    assert sizes.explain(RuntimeError("Index 9 is out of range [-4, 4)"), "main") is None


class HugePad(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.pad(x, (100000, 100000, 100000, 100000)) + 1


def test_huge_pads_are_rejected_before_they_abort_the_runtime() -> None:
    with pytest.raises(RuntimeHazardError) as info:
        _convert(HugePad(), torch.randn(2, 5))
    message = str(info.value)
    assert "would abort the Core AI runtime" in message
    assert "elements; Core AI tensors hold at most 2147483647" in message
    assert "test_runtime_hazards.py" in message and "F.pad(x, (100000" in message
    assert "Reduce the sizes" in message


class FloorDivByZero(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x // 0


class ModuloByZero(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x % 0


class FmodByZero(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fmod(x, 0)


class RemainderByZero(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.remainder(x, 0)


class TruncDivByZero(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.div(x, 0, rounding_mode="trunc")


@pytest.mark.parametrize(
    ("model", "node", "source"),
    [
        (FloorDivByZero(), "node 'div' (op aten::div.Tensor_mode)", "return x // 0"),
        (ModuloByZero(), "node 'remainder' (op aten::remainder.Scalar)", "return x % 0"),
        (FmodByZero(), "node 'fmod' (op aten::fmod.Scalar)", "return torch.fmod(x, 0)"),
        (
            RemainderByZero(),
            "node 'remainder' (op aten::remainder.Scalar)",
            "return torch.remainder(x, 0)",
        ),
        (
            TruncDivByZero(),
            "node 'div' (op aten::div.Tensor_mode)",
            'return torch.div(x, 0, rounding_mode="trunc")',
        ),
    ],
)
def test_integer_division_by_literal_zero_is_rejected(
    model: nn.Module, node: str, source: str
) -> None:
    from coreai_torch import UnsupportedOpError

    with pytest.raises(UnsupportedOpError) as info:
        _convert(model, torch.tensor([1, 2]))
    message = str(info.value)
    assert message.startswith(f"{node} at ")
    assert "test_runtime_hazards.py" in message and source in message
    assert message.endswith(
        ": integer division by zero (PyTorch raises ZeroDivisionError; the Core AI runtime "
        "would abort): divide by a non-zero constant or remove the division"
    )


_lib = torch.library.Library("rel_hazard", "DEF")
_lib.define("swap(Tensor x) -> Tensor")


@torch.library.impl(_lib, "swap", "CompositeExplicitAutograd")
def _swap(x: torch.Tensor) -> torch.Tensor:
    return x.t().contiguous()


@torch.library.register_fake("rel_hazard::swap")
def _swap_fake(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[1], x.shape[0])


class Swap(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.rel_hazard.swap(x) + 1


def _swap_lowering(dtype: Any):
    def lower(values_map, node, loc):
        return cai.transpose(get_operand(values_map, node, 0, loc), np.array([1, 0], dtype))

    return lower


def test_16_bit_index_operands_from_a_user_lowering_are_rejected() -> None:
    converter = TorchConverter()
    converter.register_torch_lowering("rel_hazard::swap.default")(_swap_lowering(np.uint16))
    with pytest.raises(RuntimeHazardError) as info:
        _convert(Swap(), torch.randn(2, 3), converter=converter)
    message = str(info.value)
    assert "'coreai.transpose' takes the 16-bit index operand #1 (tensor<2xui16>)" in message
    assert "node 'swap' (op rel_hazard::swap.default)" in message
    assert "test_runtime_hazards.py" in message and "torch.ops.rel_hazard.swap(x)" in message
    assert "Use si32 or ui32" in message
    # fixing the lowering makes the same converter (same staged program) work
    converter.register_torch_lowering("rel_hazard::swap.default", allow_override=True)(
        _swap_lowering(np.uint32)
    )
    assert "coreai.transpose" in str(converter.to_coreai())


def test_ops_the_runtime_cannot_compile_are_reported() -> None:
    """``reduce_index`` (argmin/argmax primitive) aborts the process while compiling."""
    from coreai._compiler.dialects import _coreai_ops_gen as ops

    from coreai_torch._mlir import ir, new_context
    from coreai_torch.ir.checks import find_runtime_hazards

    with new_context(), ir.Location.unknown():
        module = ir.Module.create()
        with ir.InsertionPoint(module.body):
            t = ir.RankedTensorType.get([2, 3], ir.F32Type.get())
            graph = cai.GraphOp("main", [t], [], ["x"])
            with graph.block:
                x = graph.arguments[0]
                out = ir.RankedTensorType.get([2, 1], ir.IntegerType.get_unsigned(32))
                init = cai.constant(np.float32(0))
                index = cai.constant(np.uint32(0))
                ops.ReduceIndexOp(out, x, cai.constant(np.int32(1)), init, index)
        (hazard,) = find_runtime_hazards(module)
    assert hazard.op_name == "coreai.reduce_index"
    assert "aborts the process" in hazard.problem and "use coreai.argmax" in hazard.problem
