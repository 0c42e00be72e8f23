"""``AIProgram.compress()``: the compressed program equals the same quantization applied to
the weights in PyTorch (a fake-quantized copy of the model run eagerly) within
1e-4 × max(1, max|ref|), for every form, with the asset size checked against the bits.

The fake-quantized references are written here independently (torch, the formulas the
configurations document); palettes are checked against the palette the program stores
(every weight maps to its nearest entry, every entry is the mean of its weights).
"""

from __future__ import annotations

import copy
import re
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from coreai_torch import TorchConverter, compression, progress
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.ir.compressed import unpack_bits
from coreai_torch.program import AIProgram
from coreai_torch.runtime import Session
from coreai_torch.verify import compare, eager_outputs, run_entrypoint
from tests.helpers import asset_bytes
from tests.models.common import Call, redraw_weights

VOCAB = 512
ASSET_OVERHEAD = 64 * 1024


def llama(layers: int = 1, tie: bool = False) -> Call:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
        tie_word_embeddings=tie,
    )
    config._attn_implementation = "sdpa"
    model = redraw_weights(LlamaForCausalLM(config).eval(), embedding_std=0.15 if tie else 1.0)
    return Call(model, lambda m, ids: m(input_ids=ids, use_cache=False, return_dict=False)[0])


def tokens() -> tuple[torch.Tensor]:
    return (torch.randint(0, VOCAB, (2, 12)),)


def convert(model: nn.Module, args: tuple[torch.Tensor, ...]) -> AIProgram:
    return TorchConverter().add_exported_program(export_decomposed(model, args)).to_coreai()


# ------------------------------------------------------------- fake-quantized references ---


def fake_linear(w: torch.Tensor, config: compression.LinearQuantization) -> torch.Tensor:
    """Quantize-dequantize ``w`` (output channels on dim 0, the rest reduced) as documented."""
    out = w.shape[0]
    rest = w.shape[1:]
    k = rest[0]
    block = config.block_size if config.block_size and config.block_size < k else k
    blocks = w.reshape(out, k // block, block, *rest[1:]).float()
    dims = tuple(range(2, blocks.dim()))
    scale_dtype = config.scale_dtype or w.dtype
    if config.symmetric:
        high = 2 ** (config.bits - 1) - 1
        scale = blocks.abs().amax(dims, keepdim=True) / high
        scale = scale.to(scale_dtype).float()
        scale[scale == 0] = 1
        q = torch.clamp(torch.round(blocks / scale), -high - 1, high)
        return (q * scale).reshape(w.shape)
    high = 2**config.bits - 1
    lo = blocks.amin(dims, keepdim=True).clamp(max=0)
    hi = blocks.amax(dims, keepdim=True).clamp(min=0)
    scale = ((hi - lo) / high).to(scale_dtype).float()
    scale[scale == 0] = 1
    zero_point = torch.clamp(torch.round(-lo / scale), 0, high)
    q = torch.clamp(torch.round(blocks / scale) + zero_point, 0, high)
    return ((q - zero_point) * scale).reshape(w.shape)


def stored_palette(
    program: AIProgram, name: str, bits: int, transposed: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The indices and the palettes ``program`` stores for weight ``name``, the indices in the
    model's layout (``transposed``: whether they are stored with the last two axes swapped;
    None: when their shape differs from the weight's)."""
    store = program.weights
    (indices_name,) = [n for n in store.derived_by_name if n.startswith(f"{name}.indices")]
    shape, palette = lut_values(program, indices_name)
    stored = {5: 6, 7: 8}.get(bits, bits)
    indices = unpack_bits(store.derived_by_name[indices_name], stored, int(np.prod(shape)))
    indices = torch.from_numpy(indices.reshape(shape).astype(np.int64))
    palette = palette.reshape(-1, 2**stored)[:, : 2**bits]
    if transposed is None:
        transposed = list(store.by_name[name].shape) != shape
    return (indices.transpose(-1, -2) if transposed else indices), torch.from_numpy(palette)


def lut_values(program: AIProgram, indices_name: str) -> tuple[list[int], np.ndarray]:
    """The shape of the indices and the palette operand (as float32) of the ``lut_to_dense``
    reading resource ``indices_name`` (or of the gather of palette entries that decompresses
    the rows a dynamic number of tokens looks up)."""
    import ml_dtypes

    from coreai_torch._mlir import ir

    found = []
    through = ("coreai.gather_nd", "coreai.reshape", "coreai.cast", "coreai.expand_dims")

    def source(value: ir.Value) -> ir.Operation | None:
        """The constant behind a value (through the row lookups of compressed tables and the
        palette offsets added to their indices)."""
        op = value.owner
        if isinstance(op, ir.Block):
            return None
        if op.name in through or op.name == "coreai.decomposable.broadcasting_add":
            return source(op.operands[0])
        return op

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name == "coreai.lut_to_dense":
            indices, lut = op.operands[0], op.operands[1]
        elif op.name == "coreai.gather_along_axis":  # the palettes of the rows looked up
            lut, indices = op.operands[0], op.operands[1]
        else:
            return ir.WalkResult.ADVANCE
        if indices_name in str(source(indices)):
            shape = list(ir.RankedTensorType(source(indices).result.type).shape)
            attr = source(lut).attributes["value"]
            element = str(ir.RankedTensorType(attr.type).element_type)
            if ir.DenseResourceElementsAttr.isinstance(attr):
                resource = str(attr).split("<")[1].split(">")[0].strip('"')
                dtype = {"f16": np.float16, "bf16": ml_dtypes.bfloat16}.get(element, np.float32)
                values = program.weights.derived_by_name[resource].view(dtype)
            else:  # inline: read from the text (bfloat16 attributes have no Python buffer)
                body = str(attr).split("dense<")[1].split(">")[0]
                values = np.array(re.findall(r"[-+0-9.e]+|inf", body), dtype=np.float64)
            found.append((shape, values.astype(np.float32)))
        return ir.WalkResult.ADVANCE

    program.mlir_module.operation.walk(visit)
    return found[0]


def fake_palette(
    w: torch.Tensor,
    indices: torch.Tensor,
    palettes: torch.Tensor,
    group: int | None,
    slack: float = 1e-6,
) -> torch.Tensor:
    """``w`` replaced by its palette entries; checks the palette is a k-means fixed point
    (and each weight mapped to its nearest entry, within ``slack``: palettes fitted in
    float32 are stored rounded to a half-precision program's type)."""
    out = w.shape[0]
    size = out if group is None else group
    rows = w.reshape(out // size, -1)
    idx = indices.reshape(out // size, -1)
    lut = palettes[: out // size]
    approx = torch.gather(lut, 1, idx)
    nearest = (rows[..., None] - lut[:, None, :]).abs().min(-1).values
    assert torch.allclose((rows - approx).abs(), nearest, atol=slack), "an index is not nearest"
    # converged k-means: moving every entry to the mean of its weights (one more Lloyd
    # step) lowers the squared error by less than 1%
    error = float(((rows - approx) ** 2).sum())
    mass = torch.zeros_like(lut).scatter_add_(1, idx, torch.ones_like(rows))
    total = torch.zeros_like(lut).scatter_add_(1, idx, rows)
    means = torch.where(mass > 0, total / mass.clamp(min=1), lut)
    assert float(((rows - torch.gather(means, 1, idx)) ** 2).sum()) >= 0.99 * error
    return approx.reshape(w.shape)


def fake_weights(program: AIProgram, config: Any, dtype: torch.dtype = torch.float32) -> Any:
    """``fake(name, weight)``: the weight in ``dtype`` quantize-dequantized as ``config``
    documents (palettes: checked against those ``program`` stores, the nearest entry within
    the rounding of the palettes to a half type), as float32."""
    if isinstance(config, compression.LinearQuantization):

        def fake(name: str, w: torch.Tensor) -> torch.Tensor:
            return fake_linear(w.to(dtype), config).to(dtype).float()

    else:

        def fake(name: str, w: torch.Tensor) -> torch.Tensor:
            indices, palette = stored_palette(program, name, config.bits)
            slack = 1e-6 if dtype == torch.float32 else 2**-7 * float(palette.abs().max())
            return fake_palette(w.to(dtype).float(), indices, palette, config.group_size, slack)

    return fake


def reference_model(model: nn.Module, report: Any, fake: Any) -> nn.Module:
    """A copy of ``model`` whose compressed weights are replaced by ``fake(name, weight)``."""
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for entry in report.weights:
            param = reference.get_parameter(entry.name)
            param.copy_(fake(entry.name, param.detach()))
    return reference


def check_against(
    program: AIProgram, reference: nn.Module, args: tuple[torch.Tensor, ...], bound: int
) -> int:
    return check_runs_against(program, reference, [args], bound)


def check_runs_against(
    program: AIProgram, reference: nn.Module, runs: list[tuple[torch.Tensor, ...]], bound: int
) -> int:
    """Run ``program`` on each argument tuple (one session): the outputs equal
    ``reference``'s within 1e-4 × max(1, max|ref|); the asset is at most ``bound`` bytes."""
    with Session(program) as session:
        for args in runs:
            expected = eager_outputs(reference, args)
            tol = 1e-4 * max(1.0, max(float(e.abs().max()) for e in expected))
            actual = run_entrypoint(session, program, args)
            for e, a in zip(expected, actual, strict=True):
                result = compare("out", e, a, atol=tol, rtol=0.0)
                assert result.ok, f"{result} (tolerance {tol:.2e}, input shape {args[0].shape})"
    size = asset_bytes(program)
    assert size <= bound, f"asset {size} B > {bound} B"
    return size


def bound(model: nn.Module, report: Any, bits_per_weight: float) -> int:
    compressed = {w.name for w in report.weights}
    total = 0.0
    for name, p in model.named_parameters():
        total += p.numel() * (bits_per_weight / 8 if name in compressed else p.element_size())
    return int(total) + ASSET_OVERHEAD


# ------------------------------------------------------------------------------- linear ---

LINEAR = [
    pytest.param(compression.LinearQuantization(bits=4, block_size=32), 4 + 32 / 32, id="int4-b32"),
    pytest.param(compression.LinearQuantization(bits=8), 8 + 32 / 256, id="int8-channel"),
    pytest.param(
        compression.LinearQuantization(bits=4, block_size=64, symmetric=False),
        4 + 36 / 64,
        id="int4-b64-asym",
    ),
    pytest.param(compression.LinearQuantization(bits=2, block_size=32), 2 + 1, id="int2-b32"),
    pytest.param(compression.LinearQuantization(bits=3, block_size=32), 4 + 1, id="int3-b32"),
    pytest.param(
        compression.LinearQuantization(bits=8, block_size=128, symmetric=False),
        8 + 40 / 128,
        id="int8-b128-asym",
    ),
    pytest.param(
        compression.LinearQuantization(bits=4, block_size=32, scale_dtype=torch.float16),
        4 + 16 / 32,
        id="int4-b32-f16-scales",
    ),
]


def compress_in_order(program: AIProgram, config: Any, optimize_first: bool) -> Any:
    """``program.compress(config)`` before or after ``optimize()`` (optimized either way)."""
    if optimize_first:
        program.optimize()
    report = program.compress(config)
    if not optimize_first:
        program.optimize()
    return report


def check_linear(config: compression.LinearQuantization, bits: float, optimize_first: bool) -> Any:
    model = llama()
    args = tokens()
    program = convert(model, args)
    report = compress_in_order(program, config, optimize_first)
    names = {w.name for w in report.weights}
    assert "model.model.embed_tokens.weight" in names and "model.lm_head.weight" in names
    assert len(names) == 9 and not report.skipped, str(report)
    reference = reference_model(model, report, lambda name, w: fake_linear(w, config))
    size = check_against(program, reference, args, bound(model, report, bits))
    print(report, f"\nasset {size} B", sep="")
    return program, report


def test_int4_blocks_of_32_match_the_fake_quantized_model() -> None:
    """The representative case (fast suite): int4 in blocks of 32 after optimize()."""
    program, report = check_linear(compression.LinearQuantization(bits=4, block_size=32), 5, True)
    text = str(program)
    assert "blockwise_shift_scale" in text and "x512xsi4>" in text
    main = text[text.index("coreai.graph @main") :]
    # the decompressed weights feed the matmuls directly: no transposes of weights
    assert "mlp.down_proj.weight.codes> : tensor<512x256xsi4>" in main
    assert all(w.snr_db > 19 for w in report.weights)
    assert 0.155 < report.bytes_after / report.bytes_before < 0.157


@pytest.mark.slow
@pytest.mark.parametrize(("config", "bits"), LINEAR)
@pytest.mark.parametrize("optimize_first", [True, False], ids=["optimized", "then-optimized"])
def test_linear_quantization(config: Any, bits: float, optimize_first: bool) -> None:
    check_linear(config, bits, optimize_first)


def test_int8_per_channel_is_read_as_cast_matmul_scale() -> None:
    program, _ = check_linear(compression.LinearQuantization(bits=8), 8 + 32 / 256, True)
    main = str(program)[str(program).index("coreai.graph @main") :]
    assert main.count("= coreai.dequantize") == 1  # only the embedding's looked-up rows
    assert main.count("coreai.cast") >= 8


# ------------------------------------------------------------------------------ palettes ---

PALETTES = [
    pytest.param(4, None, id="4bit-per-weight"),
    pytest.param(4, 16, id="4bit-groups-of-16"),
    pytest.param(2, None, id="2bit"),
    pytest.param(3, 64, id="3bit-groups-of-64"),
    pytest.param(6, None, id="6bit"),
    pytest.param(5, None, id="5bit-stored-in-6"),
]


def check_palettes(bits: int, group: int | None) -> None:
    model = llama()
    args = tokens()
    program = convert(model, args).optimize()
    config = compression.Palettization(bits=bits, group_size=group)
    report = program.compress(config)
    assert len(report.weights) == 9 and not report.skipped

    def fake(name: str, w: torch.Tensor) -> torch.Tensor:
        transposed = f"{name}.T" in program.weights.by_name
        indices, palettes = stored_palette(program, name, bits, transposed)
        return fake_palette(w, indices, palettes, group)

    reference = reference_model(model, report, fake)
    stored = {5: 6, 7: 8}.get(bits, bits)
    per_palette = 32 * 2**stored / (256 * (group or 256))
    size = check_against(program, reference, args, bound(model, report, stored + per_palette))
    print(report, f"\nasset {size} B", sep="")


def test_palettes_4_bit_per_weight() -> None:
    """The palette form in the fast suite (4 bits, one palette per weight)."""
    check_palettes(4, None)


@pytest.mark.slow
@pytest.mark.parametrize(("bits", "group"), PALETTES)
def test_palettization(bits: int, group: int | None) -> None:
    check_palettes(bits, group)


# ------------------------------------------------------------------------------ choosing ---


def test_selection_and_reasons() -> None:
    model = llama()
    program = convert(model, tokens()).optimize()
    report = program.compress(
        compression.LinearQuantization(
            bits=8, weights=r"layers\.0\.(mlp|self_attn\.q)", embeddings=False, output_head=False
        )
    )
    assert sorted(w.name.rsplit(".", 2)[-2] for w in report.weights) == [
        "down_proj",
        "gate_proj",
        "q_proj",
        "up_proj",
    ]
    reasons = dict(report.skipped)
    assert reasons == {}  # the embeddings and the head were not selected by name
    report = program.compress(
        compression.LinearQuantization(bits=4, block_size=32, embeddings=False, output_head=False)
    )
    reasons = dict(report.skipped)
    assert reasons["model.model.embed_tokens.weight"] == "an embedding table (embeddings=False)"
    assert reasons["model.lm_head.weight"] == "the output head (output_head=False)"
    assert reasons["model.model.layers.0.mlp.up_proj.weight"] == "already compressed"
    assert {w.name.rsplit(".", 2)[-2] for w in report.weights} == {"k_proj", "v_proj", "o_proj"}
    predicate = compression.Palettization(bits=2, weights=lambda name: "lm_head" in name)
    assert [w.name for w in program.compress(predicate).weights] == ["model.lm_head.weight"]
    big = compression.LinearQuantization(bits=8, min_elements=10**9)
    assert program.compress(big).weights == []
    print(report)


def test_compressing_twice_changes_nothing() -> None:
    model = llama()
    args = tokens()
    program = convert(model, args).optimize()
    config = compression.LinearQuantization(bits=4, block_size=32)
    first = program.compress(config)
    text = program.to_mlir()
    second = program.compress(compression.Palettization(bits=4))
    assert second.weights == [] and program.to_mlir() == text
    assert {n for n, r in second.skipped if r == "already compressed"} == {
        w.name for w in first.weights
    }
    assert str(second).startswith("compressed 0 weight(s) (4-bit palettes, one per weight)")


class WeightAlsoAdded(nn.Module):
    """A weight read by a matmul and by an elementwise op: it cannot be compressed."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(128, 128) / 11)
        self.v = nn.Parameter(torch.randn(128, 128) / 11)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w + (x[:, :, None] * self.w).amax(1)) @ self.v


def test_a_weight_read_by_other_ops_is_left_alone_with_the_reason() -> None:
    model = WeightAlsoAdded()
    args = (torch.randn(4, 128),)
    program = convert(model, args).optimize()
    report = program.compress(compression.LinearQuantization(bits=8))
    assert [w.name for w in report.weights] == ["v"]
    ((name, reason),) = report.skipped
    assert name == "w" and reason.startswith(
        "read by coreai.decomposable.broadcasting_mul (only"
    ), reason
    reference = reference_model(
        model, report, lambda name, w: fake_linear(w.T, compression.LinearQuantization()).T
    )
    check_against(program, reference, args, 128 * 128 * 5 + ASSET_OVERHEAD)


@pytest.mark.slow
def test_tied_embeddings_are_compressed_once() -> None:
    """A head tied to the token embeddings (one weight, read by the lookup and the matmul)."""
    model = llama(tie=True)
    args = tokens()
    program = convert(model, args).optimize()
    config = compression.LinearQuantization(bits=8)
    report = program.compress(config)
    readers = {w.name: w.reader for w in report.weights}
    assert len(report.weights) == 8 and not report.skipped  # the shared table once
    assert readers["model.lm_head.weight"] == "embedding"  # (export names it after the head)
    reference = reference_model(model, report, lambda name, w: fake_linear(w, config))
    check_against(program, reference, args, bound(model, report, 8.2))


@pytest.mark.slow
def test_entry_points_share_the_compressed_weights() -> None:
    """Two entry points reading the same weights store them once."""
    model = llama()
    a, b = tokens(), (torch.randint(0, VOCAB, (1, 3)),)
    converter = TorchConverter()
    converter.add_exported_program(export_decomposed(model, a), entrypoint_name="prefill")
    converter.add_exported_program(export_decomposed(model, b), entrypoint_name="decode")
    program = converter.to_coreai().optimize()
    config = compression.LinearQuantization(bits=4, block_size=32)
    report = program.compress(config)
    assert len(report.weights) == 9
    reference = reference_model(model, report, lambda name, w: fake_linear(w, config))
    with Session(program) as session:
        for entry, args in (("prefill", a), ("decode", b)):
            expected = eager_outputs(reference, args)
            actual = run_entrypoint(session, program, args, entrypoint=entry)
            tol = 1e-4 * max(1.0, float(expected[0].abs().max()))
            assert compare("out", expected[0], actual[0], atol=tol, rtol=0).ok
    size = asset_bytes(program)
    assert size <= bound(model, report, 5) + ASSET_OVERHEAD


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(32, 64, 3, padding=1)
        self.b = nn.Conv2d(64, 64, 3, padding=1, groups=2)
        self.head = nn.Linear(64, 32)  # large enough not to be folded into a transposed copy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.b(torch.relu(self.a(x))))
        return self.head(x.mean((2, 3)))


@pytest.mark.parametrize(
    "config",
    [
        compression.LinearQuantization(bits=8, min_elements=256),
        compression.LinearQuantization(bits=4, block_size=16, min_elements=256),
    ],
    ids=["int8", "int4-b16"],
)
def test_convolution_kernels(config: compression.LinearQuantization) -> None:
    """Kernels ``[O, I, kh, kw]``: per output channel, blocks along the input channels."""
    torch.manual_seed(0)
    model = ConvNet().eval()
    args = (torch.randn(1, 32, 8, 8),)
    program = convert(model, args).optimize()
    report = program.compress(config)
    assert {w.name: w.reader for w in report.weights} == {
        "a.weight": "convolution",
        "b.weight": "convolution",
        "head.weight": "matmul",
    }
    reference = reference_model(model, report, lambda name, w: fake_linear(w, config))
    check_against(program, reference, args, bound(model, report, config.bits + 2))


@pytest.mark.slow
def test_half_precision_programs_get_half_precision_scales() -> None:
    """A float16 program: scales stored in float16 (the weight's own element type); the
    float32 matmuls decompress with them cast to float32 (the runtime requires the scale's
    type to match the decompressed one)."""
    model = llama().half()
    args = tokens()
    program = convert(model, args).optimize()
    config = compression.LinearQuantization(bits=4, block_size=32)
    report = program.compress(config)
    assert len(report.weights) == 9
    text = str(program)
    assert "scale> : tensor<8x512xf16>" in text
    assert "scale> : tensor<8x512xf32>" not in text
    reference = reference_model(model, report, lambda name, w: fake_linear(w, config).half())
    expected = eager_outputs(reference.float(), args)[0]
    with Session(program) as session:
        actual = run_entrypoint(session, program, args)[0]
    # float16 arithmetic on both sides of a float32 reference
    assert compare("out", expected, actual, atol=0.05 * float(expected.abs().max()), rtol=0).ok


@pytest.mark.parametrize(
    ("config", "gathered"),
    [
        (compression.LinearQuantization(bits=4, block_size=32), "si4"),
        (compression.LinearQuantization(bits=8), "si8"),
        (compression.LinearQuantization(bits=8, block_size=64, symmetric=False), "ui8"),
        (compression.Palettization(bits=4), "ui4"),
        (compression.Palettization(bits=4, group_size=16), "ui4"),
        (compression.LinearQuantization(bits=2, block_size=32), None),
    ],
    ids=["int4", "int8", "int8-b64-asym", "palette4", "palette4-g16", "int2"],
)
def test_embedding_lookups_decompress_only_their_rows(config: Any, gathered: str | None) -> None:
    """``gather_nd`` of the compressed rows, then the decompression of those rows (4- and
    8-bit data; 2-bit tables, which gather_nd misreads, are decompressed whole)."""
    model = Call(nn.Embedding(VOCAB, 128), lambda m, ids: m(ids) * 2)
    args = tokens()
    program = convert(model, args).optimize()
    report = program.compress(config)
    assert [w.reader for w in report.weights] == ["embedding"]
    main = str(program)
    lookups = [line for line in main.splitlines() if "coreai.gather_nd" in line]
    if gathered is None:
        assert any("x128xf32>" in line.split("->")[0] for line in lookups), main
    else:
        assert any(f"tensor<{VOCAB}x128x{gathered}>" in line for line in lookups), main
        assert f"tensor<{VOCAB}x128xf32>" not in main  # the whole table is never decompressed
    if isinstance(config, compression.LinearQuantization):
        fake = lambda name, w: fake_linear(w, config)  # noqa: E731
    else:

        def fake(name: str, w: torch.Tensor) -> torch.Tensor:
            indices, palettes = stored_palette(program, name, 4, False)
            return fake_palette(w, indices, palettes, config.group_size)

    reference = reference_model(model, report, fake)
    check_against(program, reference, args, 10**7)


# ------------------------------------------------------ a dynamic number of tokens looked up ---


class TokenModel(nn.Module):
    """An embedding, a feed-forward block and an output head, optionally tied to the
    embedding (one table read by the lookup and, transposed, by the head)."""

    def __init__(self, tie: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 128)
        self.up = nn.Linear(128, 256)
        self.down = nn.Linear(256, 128)
        self.head = nn.Linear(128, VOCAB, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return self.head(x + self.down(F.gelu(self.up(x))))


#: the (batch, tokens) shapes the programs exported with dynamic tokens run at
DYNAMIC_RUNS = [(1, 1), (1, 5), (1, 16)]
DYNAMIC = {
    "int4": (compression.LinearQuantization(bits=4, block_size=32), 4 + 32 / 32),
    "int8": (compression.LinearQuantization(bits=8), 8 + 32 / 128),
    "palette4": (compression.Palettization(bits=4), 4 + 32 * 16 / (128 * 256)),
    "palette4-g16": (compression.Palettization(bits=4, group_size=16), 4 + 32 * 16 / (16 * 128)),
}


def dynamic_token_program(
    model: nn.Module, dtype: torch.dtype | None = None, dynamic_batch: bool = False
) -> AIProgram:
    """``model`` exported with a dynamic number of tokens (and batch), as the prefill entry
    point of ``llm.export``."""
    from torch.export import Dim

    tokens = Dim("tokens", min=1, max=64)
    shape = {0: Dim("batch", min=1, max=4), 1: tokens} if dynamic_batch else {1: tokens}
    example = (torch.randint(0, VOCAB, (2 if dynamic_batch else 1, 8)),)
    ep = export_decomposed(model, example, dynamic_shapes=(shape,))
    return TorchConverter(compute_precision=dtype).add_exported_program(ep).to_coreai()


def check_dynamic_lookup(
    form: str,
    optimize_first: bool,
    tie: bool,
    dtype: torch.dtype = torch.float32,
    runs: list[tuple[int, int]] = DYNAMIC_RUNS,
) -> AIProgram:
    """A table looked up by a dynamic number of tokens is compressed (its lookup gathers
    the compressed rows) and the program equals the fake-quantized model at every length."""
    from coreai_torch.verify import HALF_TOLERANCE
    from tests.helpers import check_half

    config, bits = DYNAMIC[form]
    torch.manual_seed(0)
    model = TokenModel(tie).eval()
    with torch.no_grad():
        model.embed.weight.mul_(0.1 if tie else 0.5)
    half = dtype != torch.float32
    program = dynamic_token_program(
        model, dtype if half else None, dynamic_batch=any(b > 1 for b, _ in runs)
    )
    report = compress_in_order(program, config, optimize_first)
    readers = {w.name: w.reader for w in report.weights}
    table = "head.weight" if tie else "embed.weight"  # export names a tied table after the head
    assert readers.get(table) == "embedding" and not report.skipped, str(report)
    assert len(readers) == (3 if tie else 4), str(report)
    text = str(program)
    assert "dense_resource<" + f'"{table}"' not in text and f"<{table}>" not in text, text
    assert "dense_resource<resource_" not in text, text  # no anonymous copies of constants
    if not tie:  # the lookup gathers compressed rows: the table is never decompressed whole
        assert f"tensor<{VOCAB}x128xf" not in text, text
    reference = reference_model(model, report, fake_weights(program, config, dtype))
    inputs = [(torch.randint(0, VOCAB, shape),) for shape in runs]
    if half:
        for args in inputs:
            check_half(reference, args, program, rel=HALF_TOLERANCE[dtype])
        itemsize = 2
        size = asset_bytes(program)
    else:
        itemsize = 4
        size = check_runs_against(program, reference, inputs, 10**9)
    compressed_ = {w.name for w in report.weights}
    limit = ASSET_OVERHEAD + sum(
        p.numel() * (bits / 8 if name in compressed_ else itemsize)
        for name, p in model.named_parameters()
    )
    assert size <= limit, f"asset {size} B > {limit:.0f} B"
    print(report, f"\nasset {size} B", sep="")
    return program


@pytest.mark.parametrize(
    ("form", "gathered"), [("int4", "si4"), ("int8", "si8"), ("palette4-g16", "ui4")]
)
def test_tables_looked_up_by_a_dynamic_number_of_tokens_are_compressed(
    form: str, gathered: str
) -> None:
    """Compressed before optimize() (the order of llm.export): the lookup gathers the
    compressed rows of the prompt's tokens, then decompresses them."""
    program = check_dynamic_lookup(form, False, False)
    assert f"tensor<{VOCAB}x128x{gathered}>, tensor<?x1xsi32>) to tensor<?x128x{gathered}>" in (
        str(program)
    )


def test_tied_table_looked_up_by_a_dynamic_number_of_tokens() -> None:
    """A tied table (lookup and head), stored transposed by optimize(): compressed once."""
    check_dynamic_lookup("int8", True, True, runs=[(1, 3), (2, 9), (3, 1)])


@pytest.mark.slow
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("optimize_first", [True, False], ids=["optimized", "then-optimized"])
@pytest.mark.parametrize("form", list(DYNAMIC))
def test_dynamic_lookups(form: str, optimize_first: bool, tie: bool) -> None:
    check_dynamic_lookup(form, optimize_first, tie)
    check_dynamic_lookup(form, optimize_first, tie, runs=[(2, 3), (4, 11), (1, 1)])


def test_configuration_errors() -> None:
    with pytest.raises(ValueError, match="2 to 8 bits"):
        compression.LinearQuantization(bits=1)
    with pytest.raises(ValueError, match="1 to 8 bits"):
        compression.Palettization(bits=9)
    with pytest.raises(ValueError, match="block_size must be a positive integer"):
        compression.LinearQuantization(bits=4, block_size=0)
    with pytest.raises(ValueError, match="scale_dtype"):
        compression.LinearQuantization(scale_dtype=torch.int8)
    with pytest.raises(ValueError, match="not a regular expression"):
        compression.Palettization(weights="(")
    with pytest.raises(TypeError):
        compression.LinearQuantization(4)  # keyword-only
    with pytest.raises(TypeError, match="LinearQuantization, Palettization, Pruning or Mixed"):
        convert(nn.Linear(64, 64), (torch.randn(1, 64),)).compress("int4")  # type: ignore[arg-type]


class Recorder(progress.ConversionProgress):
    """Every progress event, unthrottled."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, int, str]] = []

    def update(self, task: str, done: int, total: int, unit: str) -> None:
        self.events.append((task, done, total, unit))


def test_progress_of_compress() -> None:
    """compress() reports the bytes of weights it has fitted (the CLI's bar moves through a
    large model weight by weight), to a program's listener or an enclosing block."""
    from rich.console import Console

    def mlp() -> AIProgram:
        model = nn.Sequential(
            nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256), nn.Linear(256, 256)
        )
        return convert(model, (torch.randn(2, 256),))

    program = mlp()
    program.progress = recorder = Recorder()
    report = program.compress(compression.LinearQuantization(bits=4, block_size=32))
    total = report.bytes_before
    events = [e for e in recorder.events if e[0] == "compress"]
    assert events[0] == ("compress", 0, total, "bytes")
    assert events[-1] == ("compress", total, total, "bytes")
    done = [e[1] for e in events]
    assert done == sorted(done) and len(set(done)) == len(report.weights) + 1

    callbacks: list[tuple[str, int, int]] = []
    program = mlp()
    with progress.track(lambda *event: callbacks.append(event)):
        program.compress(compression.LinearQuantization(bits=8))
    assert callbacks[0] == ("compress", 0, total) and callbacks[-1] == ("compress", total, total)

    out = __import__("io").StringIO()
    program = mlp()
    program.progress = progress.RichProgress(console=Console(file=out, width=100))
    program.compress(compression.Palettization(bits=2))
    assert (
        "compress" in out.getvalue() and f"{total / 1e6:.1f}/{total / 1e6:.1f} MB" in out.getvalue()
    )


def test_compress_needs_a_converted_program() -> None:
    program = convert(nn.Linear(64, 64), (torch.randn(1, 64),))
    program.weights = None
    with pytest.raises(ValueError, match="needs a program converted by TorchConverter"):
        program.compress(compression.LinearQuantization())


def test_a_block_size_that_does_not_divide_is_reported() -> None:
    model = nn.Sequential(nn.Linear(96, 64), nn.Linear(64, 64))
    program = convert(model, (torch.randn(2, 96),)).optimize()
    report = program.compress(compression.LinearQuantization(bits=4, block_size=64, min_elements=1))
    assert [w.name for w in report.weights] == ["1.weight"]
    assert report.skipped == [("0.weight", "its input size 96 is not a multiple of block_size=64")]


def test_from_spec() -> None:
    safe = {"embeddings": compression.SAFE_FORM, "output_head": compression.SAFE_FORM}
    assert compression.from_spec("int8") == compression.LinearQuantization(bits=8)
    assert compression.from_spec("int4") == compression.LinearQuantization(
        bits=4, block_size=32, **safe
    )
    assert compression.from_spec("int4", 128).block_size == 128
    assert compression.from_spec("int8", 64).block_size == 64
    assert compression.from_spec("palette4") == compression.Palettization(
        bits=4, group_size=16, **safe
    )
    assert compression.from_spec("palette4-pt") == compression.Palettization(bits=4, **safe)
    assert compression.from_spec("palette2", 8) == compression.Palettization(
        bits=2, group_size=8, **safe
    )
    for bad in ("int9", "fp8", "palette", "int1"):
        with pytest.raises(ValueError):
            compression.from_spec(bad)
