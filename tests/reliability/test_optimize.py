"""``AIProgram.optimize()`` preserves numerics where Core AI's rewrite would mis-fold.

The pre-compilation rewrite folds ``(conv(x) - C1) * C2`` (constants C1, C2, bias-free
convolution) into ``conv'(x) + C1 * C2`` — a sign flip of the shift.  ``optimize()`` guards
against it (``coreai_torch.passes.safe_rewrite``); these tests cover the whole family found by
experiment: ``/ C2``, ``C2 * (...)``, scalar C1, constant expressions, chains, grouped and
strided 2-d and 3-d convolutions, and the forms that were always right (linear, ``C1 - conv``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from coreai_torch import TorchConverter
from coreai_torch._mlir import run_pre_compilation_rewrite
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.passes.safe_rewrite import protect_from_misfolds
from coreai_torch.verify import verify
from tests.helpers import check_module
from tests.reliability.support import run_isolated


class Shifted(nn.Module):
    """Every pattern of the family on one layer output (one conversion per layer)."""

    def __init__(self, layer: nn.Module, channels: int, rank: int) -> None:
        super().__init__()
        self.layer = layer
        shape = (1, channels) + (1,) * (rank - 2) if rank > 2 else (channels,)
        self.register_buffer("c", torch.randn(shape))
        self.register_buffer("s", torch.rand(shape) + 0.5)
        self.register_buffer("c2", torch.randn(shape))
        self.register_buffer("s2", torch.rand(shape) + 0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y, c, s = self.layer(x), self.c, self.s
        return (
            (y - c) * s,  # the reported case
            (y - c) / s,
            s * (y - c),
            (c - y) * s,
            (y - 0.5) * s,  # scalar C1
            (y - c * 2) * (s + 1),  # constant expressions
            (y * s - c) * self.s2,
            ((y - c) * s - self.c2) * self.s2,
            torch.relu(y - c) * s,
        )


LAYERS = {
    "conv2d": (lambda: nn.Conv2d(2, 3, 3, bias=False), 3, (1, 2, 6, 6)),
    "conv2d_stride_pad": (lambda: nn.Conv2d(2, 3, 3, 2, 1, bias=False), 3, (1, 2, 6, 6)),
    "conv2d_grouped": (lambda: nn.Conv2d(2, 4, 3, groups=2, bias=False), 4, (1, 2, 6, 6)),
    "conv2d_bias": (lambda: nn.Conv2d(2, 3, 3), 3, (1, 2, 6, 6)),
    "conv3d": (lambda: nn.Conv3d(2, 3, 3, bias=False), 3, (1, 2, 4, 4, 4)),
    "conv1d": (lambda: nn.Conv1d(2, 3, 3, bias=False), 3, (1, 2, 8)),
    "conv_transpose2d": (lambda: nn.ConvTranspose2d(2, 3, 3, bias=False), 3, (1, 2, 5, 5)),
    "linear": (lambda: nn.Linear(4, 3, bias=False), 3, (2, 4)),
}


@pytest.mark.parametrize("layer", list(LAYERS))
def test_optimize_keeps_shift_and_scale_patterns_exact(layer: str) -> None:
    make, channels, shape = LAYERS[layer]
    x = torch.randn(shape)
    model = Shifted(make(), channels, len(shape) if "conv" in layer else 2).eval()
    check_module(model, (x,), atol=1e-4, rtol=1e-4)  # converts, optimizes (twice is the same)


class ConvShift(nn.Module):
    """A user model doing ``(conv(x) - c) * s``, as in a hand-written batch norm."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1, bias=False)
        self.register_buffer("c", torch.tensor([-0.5, 0.25, 1.0]).reshape(1, 3, 1, 1))
        self.register_buffer("s", torch.tensor([1.5, 0.5, 2.0]).reshape(1, 3, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.conv(x) - self.c) * self.s


def test_conv_minus_constant_times_constant_after_optimize_twice() -> None:
    model, x = ConvShift().eval(), torch.randn(1, 2, 5, 5)
    program = TorchConverter().add_exported_program(export_decomposed(model, (x,))).to_coreai()
    program.optimize().optimize()
    report = verify(model, (x,), program=program)
    assert report.ok, str(report)
    text = str(program)
    assert "broadcasting_sub" not in text  # the shift is folded into an add
    assert text.count("coreai.conv2d") == 1


def test_guard_only_touches_float_subtractions_of_constants_feeding_a_scale() -> None:
    class Mixed(nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor, i: torch.Tensor) -> tuple:
            return (x - y) * 2.0, (x - 1.0) + y, (i - 3) * 2, (2.0 - x) * 3.0

    args = (torch.randn(3), torch.randn(3), torch.arange(3))
    program = TorchConverter().add_exported_program(export_decomposed(Mixed(), args)).to_coreai()
    assert protect_from_misfolds(program.mlir_module) == 0
    program.verify()


def test_raw_core_ai_rewrite_still_misfolds() -> None:
    """Documents the upstream bug the guard exists for: if this starts failing, coreai-core
    fixed the rewrite and ``coreai_torch.passes.safe_rewrite`` can be retired."""
    model, x = ConvShift().eval(), torch.randn(1, 2, 5, 5)
    program = TorchConverter().add_exported_program(export_decomposed(model, (x,))).to_coreai()
    module = program.mlir_module
    with module.context:
        run_pre_compilation_rewrite(module=module)
    report = verify(model, (x,), program=program)
    assert not report.ok
    assert np.isfinite(report.max_abs) and report.max_abs > 0.1


def test_guard_handles_long_dependency_chains() -> None:
    """A chain far longer than Python's recursion limit (the analysis is one forward pass)."""
    from coreai_torch._mlir import cai, ir, new_context

    with new_context(), ir.Location.unknown():
        module = ir.Module.create()
        with ir.InsertionPoint(module.body):
            t = ir.RankedTensorType.get([4], ir.F32Type.get())
            graph = cai.GraphOp("main", [t], [t], ["x"], ["y"])
            with graph.block:
                x = graph.arguments[0]
                c = cai.constant(np.float32(0.5))
                for _ in range(3000):
                    x = cai.broadcasting_add(cai.broadcasting_mul(x, c), c)
                cai.output([cai.broadcasting_mul(cai.broadcasting_sub(x, c), c)])
        assert protect_from_misfolds(module) == 1
        module.operation.verify()


class ReshapedMatmul(nn.Module):
    """A reshape feeding a matmul operand whose sizes only line up by coincidence."""

    def forward(self, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(w, x.reshape(1, 4, 24))  # right operand: 4x6 -> 24 columns


RESHAPED_ARGS = (torch.randn(1, 2, 4), torch.randn(1, 1, 4, 4, 6))


def test_optimize_keeps_reshapes_feeding_matmuls_exact() -> None:
    """The rewrite moves a reshape through a matmul when sizes merely coincide (it then
    contracts over the wrong dimension); optimize() keeps such programs exact."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_module(ReshapedMatmul(), RESHAPED_ARGS)
    assert not [w for w in caught if "kept unoptimized" in str(w.message)]  # rewrite ran


def test_raw_core_ai_rewrite_still_misfolds_reshaped_matmuls() -> None:
    """Documents the upstream bug behind the reshape guard (see the test above)."""
    model = ReshapedMatmul()
    ep = export_decomposed(model, RESHAPED_ARGS)
    program = TorchConverter().add_exported_program(ep).to_coreai()
    module = program.mlir_module
    with module.context:
        run_pre_compilation_rewrite(module=module)
    assert not verify(model, RESHAPED_ARGS, program=program).ok


FLATTENED_TOKENS = """
import json, torch, torch.nn as nn, torch.nn.functional as F
from tests.helpers import check_module
from tests.reliability.support import run_isolated

class FlattenedTokens(nn.Module):
    \"\"\"Linear layers on flattened tokens combined elementwise (SwiGLU experts / a shared
    expert working on ``(tokens, dim)``).\"\"\"

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 48, bias=False)
        self.b = nn.Linear(64, 48, bias=False)
        self.register_buffer("scale", torch.rand(48))
        self.experts = nn.Parameter(torch.randn(4, 48, 64))

    def forward(self, x, y, idx):
        x = x.reshape(-1, 64)
        a = self.a(x)
        return (
            F.silu(a) * self.b(x),  # the SwiGLU gate
            a + y,  # another (tokens, 48) value
            a * a,
            a * self.scale,  # broadcasts either way: the rewrite may move the reshape
            a * 2.0,
            torch.matmul(self.experts[idx], x.unsqueeze(-2).unsqueeze(-1)),  # batched (14, 2)
        )

args = (torch.randn(2, 7, 64), torch.randn(14, 48), torch.randint(0, 4, (14, 2)))
print(json.dumps(check_module(FlattenedTokens(), args).max_abs))
"""


def test_optimize_of_matmuls_on_flattened_tokens_used_elementwise() -> None:
    """The rewrite moves a reshape feeding a matmul behind it, then aborted the process (LLVM
    ERROR: Failed to infer result type(s)) when an elementwise op combined the matmul's result
    with a value of its own shape; optimize() keeps those reshapes in place."""
    assert run_isolated(FLATTENED_TOKENS) < 1e-5


class RewriteBreaker(nn.Module):
    """A program Core AI's rewrite fails on (it builds an invalid broadcast_in_dims from the
    reshape and the broadcast)."""

    def forward(self, a: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(a.reshape(1, 6, 4).expand(4, 6, 4) * 2, x[0, 0])


def test_a_program_the_rewrite_cannot_handle_stays_valid_and_runs() -> None:
    model, args = RewriteBreaker(), (torch.randn(2, 12), torch.randn(1, 1, 4, 4, 6))
    program = TorchConverter().add_exported_program(export_decomposed(model, args)).to_coreai()
    before = program.to_mlir()
    with pytest.warns(RuntimeWarning, match="kept unoptimized"):
        assert program.optimize() is program
    assert program.to_mlir() == before
    assert verify(model, args, program=program).ok


_LEFT = [2.5, 1e38, 1.0, np.inf, -np.inf, np.nan, 0.0, -0.0, np.nan, 3.0]
_RIGHT = [np.inf, np.inf, 1.0000001, np.inf, np.inf, np.nan, -0.0, 0.0, 1.0, 3.0]


class _Sigmoid(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(x)


@pytest.mark.parametrize("optimize", [False, True], ids=["as-converted", "optimized"])
@pytest.mark.parametrize("not_equal", [False, True], ids=["eq", "ne"])
def test_comparisons_of_constants_fold_exactly(optimize: bool, not_equal: bool) -> None:
    """Core AI's folder compares float constants with a tolerance (2.5 == inf was true);
    the converter's guard makes such comparisons fold exactly, as the kernels compute."""
    from coreai_torch._mlir import cai
    from coreai_torch.runtime import run_program

    converter = TorchConverter()

    @converter.register_torch_lowering("aten::sigmoid.default", allow_override=True)
    def compare_constants(values_map, node, loc):
        a = cai.constant(np.array(_LEFT, np.float32))
        b = cai.constant(np.array(_RIGHT, np.float32))
        mask = (cai.broadcasting_not_equal if not_equal else cai.broadcasting_equal)(a, b)
        one, zero = cai.constant(np.float32(1.0)), cai.constant(np.float32(0.0))
        return cai.broadcasting_where(mask, one, zero)

    x = torch.zeros(len(_LEFT))
    program = converter.add_exported_program(export_decomposed(_Sigmoid(), (x,))).to_coreai()
    if optimize:
        program.optimize()
    (got,) = run_program(program, {"x": x}).values()
    left, right = np.array(_LEFT, np.float32), np.array(_RIGHT, np.float32)
    expected = (left != right) if not_equal else (left == right)
    np.testing.assert_array_equal(got, expected.astype(np.float32))


class RenormalizedEmbedding(nn.Module):
    """``F.embedding(max_norm=...)`` renormalises the table in place: the lookup reads a state
    (``coreai.read_handle``, an op with two results)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", 3 * torch.randn(6, 8))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.table, max_norm=1.0)


def test_optimize_of_a_lookup_of_a_state() -> None:
    check_module(RenormalizedEmbedding(), (torch.tensor([[0, 1], [4, 1]]),))


class UnitDimReshape(nn.Module):
    """A ``[T, D]`` value reshaped to ``[1, T, D]`` and added to a ``[B, T, D]`` one (BERT's
    position embeddings once their lookup is compressed)."""

    def forward(self, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return x + r.reshape(1, -1, 8)


def _unit_dim_program() -> tuple[object, tuple[torch.Tensor, torch.Tensor]]:
    batch, tokens = torch.export.Dim("batch", max=64), torch.export.Dim("tokens", max=64)
    args = (torch.randn(2, 5, 8), torch.randn(5, 8))
    ep = export_decomposed(
        UnitDimReshape(), args, dynamic_shapes=({0: batch, 1: tokens}, {0: tokens})
    )
    program = TorchConverter().add_exported_program(ep).to_coreai()
    return program, (torch.randn(3, 4, 8), torch.randn(4, 8))


def test_optimize_keeps_unit_dim_reshapes_of_broadcast_operands_exact() -> None:
    """The rewrite moves ``reshape(r, [1, -1, D])`` behind the add when the batch is dynamic
    (the result becomes ``[1, B*T, D]``); optimize() turns the reshape into expand_dims."""
    program, args = _unit_dim_program()
    program.optimize()
    assert verify(UnitDimReshape(), args, program=program).ok


def test_raw_core_ai_rewrite_still_misfolds_unit_dim_reshapes() -> None:
    """Documents the upstream bug behind the unit-dim reshape guard (see the test above)."""
    program, args = _unit_dim_program()
    module = program.mlir_module
    with module.context:
        run_pre_compilation_rewrite(module=module)
    assert not verify(UnitDimReshape(), args, program=program).ok


class RegroupedTokens(nn.Module):
    """Tokens regrouped into chunks of 8 (``[1, T, 8, 16] -> [1, T/8, 8, 8, 16]``, as Bamba's
    chunked scan does) and scaled by a per-chunk factor: the reshape keeps the rank's leading
    1 but is no unit-dim reshape."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chunks = x.reshape(1, -1, 8, 8, 16)
        return chunks * chunks.sum(-1, keepdim=True)


def test_optimize_leaves_reshapes_that_regroup_a_run_time_size_alone() -> None:
    """The unit-dim guard above only rewrites reshapes that add leading unit dimensions;
    one that splits a run-time size (here into chunks of 8) stays a reshape."""
    chunks = torch.export.Dim("chunks", max=16)
    args = (torch.randn(1, 16, 8, 16),)
    ep = export_decomposed(RegroupedTokens(), args, dynamic_shapes=({1: 8 * chunks},))
    program = TorchConverter().add_exported_program(ep).to_coreai().optimize()
    for length in (16, 24, 128):
        assert verify(RegroupedTokens(), (torch.randn(1, length, 8, 16),), program=program).ok
