"""The compressed-weight emitters (``coreai_torch.ir.compressed``) on the Core AI runtime: every
storage width round-trips exactly, operand rules the runtime aborts on are rejected at
conversion, and casts of compressed constants are not folded back into float weights."""

from __future__ import annotations

from collections.abc import Callable

import ml_dtypes
import numpy as np
import pytest
import torch

from coreai_torch._mlir import cai, ir, new_context
from coreai_torch.errors import RuntimeHazardError
from coreai_torch.ir import compressed
from coreai_torch.ir.compressed import LinearCodes, PaletteCodes, pack_bits, unpack_bits
from coreai_torch.ir.weights import WeightStore
from coreai_torch.program import AIProgram
from coreai_torch.runtime import run_program
from tests.helpers import asset_bytes


def build(emit: Callable[[WeightStore], ir.Value]) -> AIProgram:
    """A program without inputs returning ``emit(store)`` as output ``y``."""
    store = WeightStore()
    context = new_context()
    with context, ir.Location.unknown():
        module = ir.Module.create()
        with ir.InsertionPoint(module.body):
            graph = cai.GraphOp("main", [], [], [])
            with graph.block:
                graph.outputs_spec = [("y", emit(store))]
    program = AIProgram._from_mlir_module(module)
    program.weights = store
    program.verify()
    return program


def run(emit: Callable[[WeightStore], ir.Value]) -> np.ndarray:
    return run_program(build(emit), {})["y"]


def assert_close_to_rounding(actual: np.ndarray, expected: np.ndarray) -> None:
    """Equal up to a few float32 roundings of the largest magnitude."""
    np.testing.assert_allclose(actual, expected, rtol=0, atol=4 * 2**-24 * np.abs(expected).max())


def reference_pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """The layout the runtime reads (primer §12), written the slow obvious way."""
    u = codes.astype(np.uint8).ravel() & ((1 << bits) - 1)
    return np.packbits(
        ((u[:, None] >> np.arange(bits, dtype=np.uint8)) & 1).ravel(), bitorder="little"
    )


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("count", [1, 7, 64, 1001, (1 << 20) + 13])
def test_pack_bits_matches_the_runtime_layout(bits: int, count: int) -> None:
    rng = np.random.default_rng(bits * count)
    codes = rng.integers(0, 1 << bits, count).astype(np.uint8)
    packed = pack_bits(codes, bits)
    assert packed.size == -(-count * bits // 8)
    np.testing.assert_array_equal(packed, reference_pack(codes, bits))
    np.testing.assert_array_equal(unpack_bits(packed, bits, count), codes)
    signed = (codes.astype(np.int16) - (1 << (bits - 1))).astype(np.int8)
    np.testing.assert_array_equal(
        unpack_bits(pack_bits(signed, bits), bits, count, signed=True), signed
    )


LINEAR_CASES = [(bits, signed) for bits in range(1, 9) for signed in (True, False)]


@pytest.mark.parametrize(("bits", "signed"), LINEAR_CASES)
def test_linear_codes_round_trip_exactly(bits: int, signed: bool) -> None:
    """Every code width, blocks of 8 along rows; exact without a zero point, within a few
    roundings of the largest weight with one (the runtime applies 8-bit zero points after
    scaling)."""
    rng = np.random.default_rng(bits)
    low, high = (-(1 << (bits - 1)), 1 << (bits - 1)) if signed else (0, 1 << bits)
    shape = (24, 40)
    codes = rng.integers(low, high, shape).astype(np.int8 if signed else np.uint8)
    scale = rng.uniform(0.5, 2.0, (24, 5)).astype(np.float32)
    zero_point = rng.integers(low, high, (24, 5)).astype(np.int32)
    for zp in (None, zero_point):
        q = LinearCodes(codes, bits, scale, zp, signed=signed)
        y = run(
            lambda store, q=q: compressed.linear_decompression(store, "w", q, torch.float32).build()
        )
        if zp is None:
            np.testing.assert_array_equal(y, q.dequantized())
        else:
            assert_close_to_rounding(y, q.dequantized())


@pytest.mark.parametrize("bits", [8, 4])
def test_linear_per_channel_and_per_tensor(bits: int) -> None:
    """One scale per row, per column or per tensor (8 bits: ``dequantize``)."""
    rng = np.random.default_rng(0)
    codes = rng.integers(-(1 << (bits - 1)), 1 << (bits - 1), (16, 96)).astype(np.int8)
    for scale_shape in [(16, 1), (1, 96), (1, 1)]:
        scale = rng.uniform(0.1, 1.0, scale_shape).astype(np.float32)
        zp = rng.integers(-3, 3, scale_shape).astype(np.int32)
        q = LinearCodes(codes, bits, scale, zp)
        program = build(
            lambda store, q=q: compressed.linear_decompression(store, "w", q, torch.float32).build()
        )
        expected_op = "coreai.dequantize" if bits == 8 else "coreai.blockwise_shift_scale"
        assert expected_op in str(program)
        y = run_program(program, {})["y"]
        assert_close_to_rounding(y, q.dequantized())


def test_zero_point_outside_the_storage_type_is_applied_after_scaling() -> None:
    codes = np.random.default_rng(0).integers(0, 16, (8, 64)).astype(np.uint8)
    scale = np.full((8, 2), 0.25, np.float32)
    zp = np.full((8, 2), 300, np.int32)  # no ui4 holds it
    q = LinearCodes(codes, 4, scale, zp, signed=False)
    y = run(lambda store: compressed.linear_decompression(store, "w", q, torch.float32).build())
    np.testing.assert_allclose(y, q.dequantized(), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("fmt", [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2])
@pytest.mark.parametrize("scale_shape", [(32, 1), (32, 4)])
def test_float8_round_trips_exactly(fmt: type, scale_shape: tuple[int, int]) -> None:
    rng = np.random.default_rng(0)
    codes = (rng.standard_normal((32, 64)) * 4).astype(fmt)
    q = LinearCodes(codes, 8, rng.uniform(0.5, 2, scale_shape).astype(np.float32))
    y = run(lambda store: compressed.linear_decompression(store, "w", q, torch.float32).build())
    np.testing.assert_array_equal(y, q.dequantized())


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("groups", [(1, 1), (4, 1), (1, 8)])
def test_palette_round_trips_exactly(bits: int, groups: tuple[int, int]) -> None:
    rng = np.random.default_rng(bits)
    indices = rng.integers(0, 1 << bits, (16, 40)).astype(np.uint8)
    lut = rng.standard_normal((*groups, 1 << bits, 1)).astype(np.float32)
    p = PaletteCodes(indices, bits, lut)
    y = run(lambda store: compressed.palette_decompression(store, "w", p, torch.float32).build())
    np.testing.assert_array_equal(y, p.dequantized())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_outputs(dtype: torch.dtype) -> None:
    """Scales, offsets and palettes in the output's precision (the runtime's rule)."""
    rng = np.random.default_rng(0)
    codes = rng.integers(-8, 8, (16, 64)).astype(np.int8)
    scale = rng.uniform(0.01, 0.1, (16, 2)).astype(np.float32)
    q = LinearCodes(codes, 4, scale)
    np_dtype = np.float16 if dtype == torch.float16 else ml_dtypes.bfloat16
    expected = codes.astype(np.float32) * np.repeat(
        scale.astype(np_dtype).astype(np.float32), 32, 1
    )
    y = run(lambda store: compressed.linear_decompression(store, "w", q, dtype).build())
    np.testing.assert_allclose(y.astype(np.float32), expected, rtol=1e-2)
    p = PaletteCodes(
        rng.integers(0, 16, (16, 64)).astype(np.uint8), 4, rng.standard_normal((1, 1, 16, 1))
    )
    y = run(lambda store: compressed.palette_decompression(store, "w", p, dtype).build())
    np.testing.assert_array_equal(
        y.astype(np.float32), p.dequantized().astype(np_dtype).astype(np.float32)
    )


def test_sub_byte_constants_are_stored_packed() -> None:
    """The asset holds ceil(n * bits / 8) bytes per weight, not one byte per element."""
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, (512, 1024)).astype(np.uint8)
    p = PaletteCodes(codes, 4, rng.standard_normal((1, 1, 16, 1)).astype(np.float32))
    size = asset_bytes(
        build(lambda store: compressed.palette_decompression(store, "w", p, torch.float32).build())
    )
    assert codes.size // 2 <= size <= codes.size // 2 + 16384


def test_derived_constants_check_their_size() -> None:
    with new_context(), ir.Location.unknown():
        store = WeightStore()
        ttype = ir.RankedTensorType.get([10, 3], ir.IntegerType.get_signed(4))
        with pytest.raises(ValueError, match="needs 15 bytes, got 30"):
            store.derived(np.zeros(30, np.uint8), "w", ttype)


def test_codes_out_of_range_are_rejected() -> None:
    codes = np.full((4, 64), 9, np.int8)
    q = LinearCodes(codes, 4, np.ones((4, 1), np.float32))
    with pytest.raises(ValueError, match=r"4-bit signed codes must lie in \[-8, 7\]"):
        build(lambda store: compressed.linear_decompression(store, "w", q, torch.float32).build())


# ---------------------------------------------------------------- runtime abort hazards ---


def _blockwise(store: WeightStore, scale_type: ir.Type, scale_shape: list[int]) -> ir.Value:
    """A hand-built blockwise_shift_scale with an f32 output and the given scale."""
    si8 = ir.IntegerType.get_signed(8)
    ttype = ir.RankedTensorType.get([8, 64], si8)
    data = cai.ConstantOp(value=store.derived(np.ones((8, 64), np.int8), "q", ttype)).result
    zeros = np.zeros(scale_shape, np.float32)
    scale = cai.constant(np.ones(scale_shape, np.float32), dtype=scale_type)
    return cai.blockwise_shift_scale(
        data,
        scale,
        cai.constant(zeros.astype(np.int8), dtype=si8),
        cai.constant(zeros, dtype=ir.F32Type.get()),
    )


@pytest.mark.parametrize(
    ("scale_type", "scale_shape", "message"),
    [
        (ir.F16Type.get, [8, 1], "scale's element type f16 differs from the output's f32"),
        (ir.F32Type.get, [8], "must all have the data's rank 2"),
    ],
)
def test_runtime_aborts_are_rejected_at_conversion(scale_type, scale_shape, message) -> None:
    """Both verify cleanly and kill the runtime (SIGILL): the hazard scan run by
    ``to_coreai()`` names them."""
    from coreai_torch.ir.checks import find_runtime_hazards

    program = build(lambda store: _blockwise(store, scale_type(), scale_shape))
    hazards = find_runtime_hazards(program.mlir_module)
    assert len(hazards) == 1 and message in hazards[0].problem
    assert hazards[0].op_name == "coreai.blockwise_shift_scale"


@pytest.mark.parametrize(
    ("scale_type", "scale_shape", "message"),
    [
        (ir.F16Type.get, [4, 1], "scale's element type f16 differs from the output's f32"),
        (ir.F32Type.get, [4], "must all have the data's rank 2"),
    ],
    ids=["scale_type", "rank_1_scale"],
)
def test_a_user_lowering_building_a_hazard_is_rejected_by_to_coreai(
    scale_type, scale_shape, message
) -> None:
    from coreai_torch import TorchConverter
    from coreai_torch.frontend.export import export_decomposed

    @torch.library.custom_op("quant_test::unpack", mutates_args=())
    def unpack(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @unpack.register_fake
    def _(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    class M(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ops.quant_test.unpack(x)

    converter = TorchConverter()

    @converter.register_torch_lowering("quant_test::unpack.default")
    def lower(values_map, node, loc):
        x = values_map[node.args[0].name]
        si8 = ir.IntegerType.get_signed(8)
        q = cai.constant(np.ones((4, 8), np.int8), dtype=si8)
        return (
            cai.blockwise_shift_scale(
                q,
                cai.constant(np.ones(scale_shape, np.float32), dtype=scale_type()),
                cai.constant(np.zeros(scale_shape, np.int8), dtype=si8),
                cai.constant(np.zeros(scale_shape, np.float32)),
            )
            if x is not None
            else None
        )

    ep = export_decomposed(M(), (torch.randn(4, 8),))
    with pytest.raises(RuntimeHazardError, match=message) as error:
        converter.add_exported_program(ep).to_coreai()
    text = str(error.value)  # the op, the node and its source line
    assert "coreai.blockwise_shift_scale" in text and "node 'unpack' (op quant_test::" in text
    assert "in forward: return torch.ops.quant_test.unpack(x)" in text


# ---------------------------------------------------------------------------- folding ---


@pytest.mark.parametrize("shape", [(64, 64), (256, 512)])
def test_a_cast_int8_weight_stays_int8_in_the_asset(shape: tuple[int, int]) -> None:
    """Core AI folds ``cast(constant)`` below ~262k elements (by optimize()'s rewrite and by
    save_asset): the fold guard keeps the int8 weight."""
    q = np.random.default_rng(0).integers(-127, 128, shape).astype(np.int8)

    def emit(store: WeightStore) -> ir.Value:
        ttype = ir.RankedTensorType.get(list(shape), ir.IntegerType.get_signed(8))
        return cai.cast(cai.ConstantOp(value=store.derived(q, "w", ttype)).result, np.float32)

    program = build(emit).optimize()
    assert "coreai.cast" in str(program)
    size = asset_bytes(program)
    assert q.nbytes <= size <= 1.2 * q.nbytes + 8192, size
    np.testing.assert_array_equal(run_program(program, {})["y"], q.astype(np.float32))
