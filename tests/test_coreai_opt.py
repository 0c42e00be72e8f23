"""coreai-opt (Apple's compression library) with this converter: its finalized models convert
unchanged, run on the Core AI runtime and match the finalized PyTorch model; its
post-conversion passes run on our programs (after ``optimize()``).

Each workflow is coreai-opt's documented flow: compress, ``finalize(backend=CoreAI)``,
``torch.export`` -> ``run_decompositions(get_decomp_table())`` -> (optionally coreai-opt's
``cast_to_16_bit_precision``) -> ``TorchConverter().add_exported_program(ep).to_coreai()`` ->
``optimize()`` -> ``save_asset``, on an MLP and a small transformer (hidden size 256).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from coreai_opt import ExportBackend
from coreai_opt.casting.casting import cast_to_16_bit_precision
from coreai_opt.palettization import (
    KMeansPalettizer,
    KMeansPalettizerConfig,
    ModuleKMeansPalettizerConfig,
    PalettizationSpec,
)
from coreai_opt.palettization.spec.granularity import PerGroupedChannelGranularity
from coreai_opt.pruning import (
    MagnitudePruner,
    MagnitudePrunerConfig,
    ModuleMagnitudePrunerConfig,
    PruningSpec,
)
from coreai_opt.quantization import (
    ExecutionMode,
    ModuleQuantizerConfig,
    QuantizationSpec,
    Quantizer,
    QuantizerConfig,
)
from coreai_opt.quantization.spec import PerBlockGranularity, PerChannelGranularity
from torch import nn

import coreai_torch
from coreai_torch import TorchConverter, get_decomp_table
from coreai_torch.errors import UnsupportedOpError
from coreai_torch.runtime import Session

# ------------------------------------------------------------------------------ models ---


class MLP(nn.Module):
    def __init__(self, d: int = 256, h: int = 512) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(d, h), nn.Linear(h, h), nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class Block(nn.Module):
    def __init__(self, d: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (
            m(h).view(b, t, self.heads, -1).transpose(1, 2) for m in (self.q, self.k, self.v)
        )
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(nn.functional.gelu(self.up(self.ln2(x))))


class Transformer(nn.Module):
    """A decoder of hidden size 256: embedding, 2 blocks (attention + MLP), head."""

    def __init__(self, vocab: int = 256, d: int = 256, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def _model(kind: str) -> tuple[nn.Module, tuple[torch.Tensor, ...], list[tuple[torch.Tensor, ...]]]:
    """(model, example args, calibration batches)."""
    torch.manual_seed(0)
    if kind == "mlp":
        return MLP().eval(), (torch.randn(4, 256),), [(torch.randn(4, 256),) for _ in range(4)]
    ids = (torch.randint(0, 256, (1, 16)),)
    return Transformer().eval(), ids, [(torch.randint(0, 256, (1, 16)),) for _ in range(4)]


def _fp32_weight_bytes(model: nn.Module) -> int:
    return sum(t.numel() * 4 for t in model.state_dict().values() if t.is_floating_point())


# --------------------------------------------------------------------------- workflows ---

Workflow = Callable[[nn.Module, tuple, list], nn.Module]


def _palettize(spec: PalettizationSpec, **finalize: Any) -> Workflow:
    def run(model: nn.Module, args: tuple, calib: list) -> nn.Module:
        module_config = ModuleKMeansPalettizerConfig(
            op_state_spec={"weight": spec}, enable_fast_kmeans_mode=spec.cluster_dim == 1
        )
        palettizer = KMeansPalettizer(model, KMeansPalettizerConfig(global_config=module_config))
        palettizer.prepare(args)
        return palettizer.finalize(backend=ExportBackend.CoreAI, **finalize)

    return run


def _palettize_sensitive(spec: PalettizationSpec) -> Workflow:
    """Sensitive k-means: squared gradients of a loss on calibration data weight the clusters."""

    def run(model: nn.Module, args: tuple, calib: list) -> nn.Module:
        with torch.no_grad():
            targets = [model(*batch) for batch in calib]
        module_config = ModuleKMeansPalettizerConfig(op_state_spec={"weight": spec})
        palettizer = KMeansPalettizer(model, KMeansPalettizerConfig(global_config=module_config))
        prepared = palettizer.prepare(args)
        with palettizer.calibration_mode(loss_fn=nn.functional.mse_loss) as calibration:
            for batch, target in zip(calib, targets, strict=True):
                calibration.step(prepared(*batch), target)
        return palettizer.finalize(backend=ExportBackend.CoreAI)

    return run


def _quantize(
    weight: QuantizationSpec | None,
    activation: QuantizationSpec | None = None,
    mode: ExecutionMode = ExecutionMode.GRAPH,
    **finalize: Any,
) -> Workflow:
    def run(model: nn.Module, args: tuple, calib: list) -> nn.Module:
        config = ModuleQuantizerConfig(
            op_input_spec={"*": activation} if activation is not None else None,
            op_output_spec=None,
            op_state_spec={"weight": weight} if weight is not None else None,
        )
        quantizer = Quantizer(model, QuantizerConfig(global_config=config, execution_mode=mode))
        prepared = quantizer.prepare(args)
        if activation is not None:
            with quantizer.calibration_mode(prepared):
                for batch in calib:
                    prepared(*batch)
        return quantizer.finalize(prepared, backend=ExportBackend.CoreAI, **finalize)

    return run


def _prune(spec: PruningSpec) -> Workflow:
    def run(model: nn.Module, args: tuple, calib: list) -> nn.Module:
        config = ModuleMagnitudePrunerConfig(op_state_spec={"weight": spec})
        pruner = MagnitudePruner(model, MagnitudePrunerConfig(global_config=config))
        pruner.prepare(args)
        return pruner.finalize(backend=ExportBackend.CoreAI)

    return run


def _joint(first: Workflow, second: Workflow) -> Workflow:
    def run(model: nn.Module, args: tuple, calib: list) -> nn.Module:
        return second(first(model, args, calib), args, calib)

    return run


_INT8 = QuantizationSpec(dtype=torch.int8, granularity=PerChannelGranularity())
_INT4_32 = QuantizationSpec(dtype=torch.int4, granularity=PerBlockGranularity(block_size=32))
_MINVAL_32 = QuantizationSpec(
    dtype=torch.int4,
    qscheme="asymmetric",
    qformulation="minval",
    granularity=PerBlockGranularity(block_size=32),
)
_FP4 = QuantizationSpec(
    dtype=torch.float4_e2m1fn_x2, granularity=PerBlockGranularity(block_size=32)
)
_A8 = QuantizationSpec(dtype=torch.int8)
_LUT8 = QuantizationSpec(dtype=torch.int8)
_GROUPED = PerGroupedChannelGranularity(axis=0, group_size=16)

#: name -> (workflow, largest asset / fp32 weights on the transformer)
WORKFLOWS: dict[str, tuple[Workflow, float]] = {
    "palette_4bit": (_palettize(PalettizationSpec(n_bits=4)), 0.17),
    "palette_2bit": (_palettize(PalettizationSpec(n_bits=2)), 0.11),
    "palette_4bit_sensitive": (_palettize_sensitive(PalettizationSpec(n_bits=4)), 0.17),
    "palette_3bit": (_palettize(PalettizationSpec(n_bits=3)), 0.14),
    "palette_6bit": (_palettize(PalettizationSpec(n_bits=6)), 0.23),
    "palette_8bit": (_palettize(PalettizationSpec(n_bits=8)), 0.29),
    "palette_4bit_grouped": (_palettize(PalettizationSpec(n_bits=4, granularity=_GROUPED)), 0.17),
    "palette_vector": (_palettize(PalettizationSpec(n_bits=4, cluster_dim=2)), 0.11),
    "palette_int8_lut": (_palettize(PalettizationSpec(n_bits=4, lut_qspec=_LUT8)), 0.17),
    "palette_channel_scale": (
        _palettize(PalettizationSpec(n_bits=4, enable_per_channel_scale=True)),
        0.17,
    ),
    "palette_int8_lut_channel_scale": (
        _palettize(PalettizationSpec(n_bits=4, lut_qspec=_LUT8, enable_per_channel_scale=True)),
        0.17,
    ),
    "palette_grouped_uint8_lut": (
        _palettize(
            PalettizationSpec(
                n_bits=4,
                granularity=_GROUPED,
                lut_qspec=QuantizationSpec(dtype=torch.uint8, qscheme="asymmetric"),
            )
        ),
        0.17,
    ),
    "int8_channel": (_quantize(_INT8), 0.27),
    "int8_channel_eager": (_quantize(_INT8, mode=ExecutionMode.EAGER), 0.27),
    "uint8_asymmetric": (
        _quantize(
            QuantizationSpec(
                dtype=torch.uint8, qscheme="asymmetric", granularity=PerChannelGranularity()
            )
        ),
        0.27,
    ),
    "int4_channel": (
        _quantize(QuantizationSpec(dtype=torch.int4, granularity=PerChannelGranularity())),
        0.14,
    ),
    "int4_block32": (_quantize(_INT4_32), 0.17),
    "int4_block32_eager": (_quantize(_INT4_32, mode=ExecutionMode.EAGER), 0.17),
    "int4_block32_minval": (_quantize(_MINVAL_32), 0.2),
    "uint4_block32_asymmetric": (
        _quantize(
            QuantizationSpec(
                dtype=torch.uint4,
                qscheme="asymmetric",
                granularity=PerBlockGranularity(block_size=32),
            )
        ),
        0.17,
    ),
    "int2_block32": (
        _quantize(
            QuantizationSpec(dtype=torch.int2, granularity=PerBlockGranularity(block_size=32))
        ),
        0.11,
    ),
    "fp8": (
        _quantize(QuantizationSpec(dtype=torch.float8_e4m3fn, granularity=PerChannelGranularity())),
        0.27,
    ),
    "fp8_mx": (
        _quantize(
            QuantizationSpec(
                dtype=torch.float8_e4m3fn,
                granularity=PerBlockGranularity(block_size=32),
                scale_dtype=torch.float8_e8m0fnu,
            )
        ),
        0.27,
    ),
    "mxfp4": (_quantize(_FP4), 0.14),
    "mxfp4_eager": (_quantize(_FP4, mode=ExecutionMode.EAGER), 0.14),
    "w8a8": (_quantize(_INT8, _A8), 0.27),
    "w8a8_eager": (_quantize(_INT8, _A8, mode=ExecutionMode.EAGER), 0.27),
    "w8a8_uint8_asymmetric": (
        _quantize(_INT8, QuantizationSpec(dtype=torch.uint8, qscheme="asymmetric")),
        0.27,
    ),
    "w8a8_minval": (
        _quantize(
            _INT8, QuantizationSpec(dtype=torch.int8, qscheme="asymmetric", qformulation="minval")
        ),
        0.27,
    ),
    "prune_50": (_prune(PruningSpec(target_sparsity=0.5)), 0.56),
    "palette_4bit_a8": (
        _joint(_palettize(PalettizationSpec(n_bits=4)), _quantize(None, _A8)),
        0.17,
    ),
    "int4_block32_a8": (_joint(_quantize(_INT4_32), _quantize(None, _A8)), 0.17),
}

#: the fast subset (``make test``): one of each kind, on the MLP; eager mode (the first
#: graph-mode quantizer of a process spends ~45 s tracing coreai-opt's annotation patterns)
FAST = {
    "palette_4bit",
    "palette_int8_lut_channel_scale",
    "int4_block32_eager",
    "mxfp4_eager",
    "w8a8_eager",
    "prune_50",
}
#: the kinds also run after coreai-opt's cast_to_16_bit_precision (transformer)
HALF = (
    "palette_4bit",
    "palette_vector",
    "palette_int8_lut_channel_scale",
    "int8_channel",
    "int4_block32",
    "int4_block32_minval",
    "fp8_mx",
    "mxfp4",
    "w8a8",
    "prune_50",
)


# ------------------------------------------------------------------------------ runner ---


def _convert(
    final: nn.Module, args: tuple, half: bool = False
) -> tuple[torch.export.ExportedProgram, coreai_torch.AIProgram]:
    with torch.no_grad():
        ep = torch.export.export(final, args).run_decompositions(get_decomp_table())
    if half:
        ep = cast_to_16_bit_precision(ep)
    return ep, TorchConverter().add_exported_program(ep).to_coreai().optimize()


def _run_saved(program: coreai_torch.AIProgram, path: Path, feeds: dict) -> tuple[np.ndarray, int]:
    program.save_asset(path)
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    with Session(path) as session:
        (out,) = session.run(feeds).values()
    return out, size


def _feeds(kind: str, args: tuple, half: bool = False) -> dict[str, np.ndarray]:
    (arg,) = args
    if half and arg.is_floating_point():
        arg = arg.half()
    return {"x" if kind == "mlp" else "ids": arg.numpy()}


def _check_workflow(name: str, kind: str, tmp_path: Path, half: bool = False) -> float:
    """Run workflow ``name`` on model ``kind`` through the converter; returns the asset size
    relative to the fp32 weights."""
    workflow, _ = WORKFLOWS[name]
    model, args, calib = _model(kind)
    fp32 = _fp32_weight_bytes(model)
    final = workflow(model, args, calib)
    with torch.no_grad():
        ref = final(*args).float().numpy()
    ep, program = _convert(final, args, half)
    out, size = _run_saved(program, tmp_path / "m.aimodel", _feeds(kind, args, half))
    out = out.astype(np.float32)
    assert np.isfinite(out).all()
    scale = max(1.0, float(np.abs(ref).max()))
    if not half:
        np.testing.assert_allclose(out, ref, rtol=0, atol=1e-4 * scale)
    elif "a8" in name:
        # activations quantized in float16: a value on a rounding boundary may land one step
        # apart in PyTorch's and the runtime's float16 arithmetic (PyTorch's own float16
        # program differs from float32 as much); compare with the float16 PyTorch program
        with torch.no_grad():
            (half_arg,) = (a.half() if a.is_floating_point() else a for a in args)
            ref16 = ep.module()(half_arg).float().numpy()
        assert float(np.abs(out - ref16).max()) <= 5e-2 * scale
        cosine = float((out * ref16).sum() / (np.linalg.norm(out) * np.linalg.norm(ref16)))
        assert cosine >= 0.999
    else:
        assert float(np.abs(out - ref).max()) <= 1e-2 * scale
    return size / fp32


def _params(names: Any, fast: set[str] | None = None) -> list:
    return [
        pytest.param(n, id=n, marks=() if fast is not None and n in fast else pytest.mark.slow)
        for n in names
    ]


@pytest.mark.parametrize("name", _params(WORKFLOWS, FAST))
def test_workflow_mlp(name: str, tmp_path: Path) -> None:
    _check_workflow(name, "mlp", tmp_path)


@pytest.mark.parametrize("name", _params(WORKFLOWS))
def test_workflow_transformer(name: str, tmp_path: Path) -> None:
    ratio = _check_workflow(name, "transformer", tmp_path)
    bound = WORKFLOWS[name][1]
    assert ratio <= bound, f"asset {ratio:.3f}x of the fp32 weights, expected <= {bound}x"


@pytest.mark.parametrize("name", _params(HALF))
def test_workflow_transformer_half(name: str, tmp_path: Path) -> None:
    ratio = _check_workflow(name, "transformer", tmp_path, half=True)
    assert ratio <= WORKFLOWS[name][1]  # scales and float values in float16 are smaller still


def test_compressed_ops_stay_compressed_in_the_program() -> None:
    """The IR holds Core AI's decompression ops over packed constants (no float weight)."""
    model, args, calib = _model("mlp")
    activations = _quantize(None, _A8, mode=ExecutionMode.EAGER)
    final = _joint(_palettize(PalettizationSpec(n_bits=4)), activations)(model, args, calib)
    _, program = _convert(final, args)
    text = program.to_mlir()
    assert text.count("coreai.lut_to_dense") == 3
    assert "tensor<256x512xui4>" in text and "fc1.weight.indices" in text
    quantized = text.count("= coreai.quantize ")  # eager mode quantizes weights' reads too
    assert quantized >= 3 and text.count("= coreai.dequantize ") == quantized
    assert "x512xf32> = coreai.constant dense_resource" not in text


@pytest.mark.parametrize(
    "name",
    [
        pytest.param("palette_4bit", id="palette"),
        pytest.param("mxfp4_eager", id="mxfp4_eager"),
        pytest.param("int4_block32", id="graph_int4", marks=pytest.mark.slow),
    ],
)
def test_finalize_with_mmap_dir(name: str, tmp_path: Path) -> None:
    """``finalize(mmap_dir=...)`` writes the modules' tensors to safetensors and reloads them
    (``load_state_dict(assign=True)``, packed FP4 through ``SubbyteTensor.elem``)."""
    workflow, _ = WORKFLOWS[name]
    model, args, calib = _model("mlp")
    reference = workflow(copy.deepcopy(model), args, calib)
    mmap_dir = tmp_path / "weights"
    final = _with_mmap(name, mmap_dir)(model, args, calib)
    assert any(mmap_dir.iterdir())
    with torch.no_grad():
        expected = reference(*args)
        torch.testing.assert_close(final(*args), expected, rtol=0, atol=0)
    _, program = _convert(final, args)
    out, _ = _run_saved(program, tmp_path / "m.aimodel", _feeds("mlp", args))
    np.testing.assert_allclose(out, expected.numpy(), rtol=0, atol=1e-4)


def _with_mmap(name: str, mmap_dir: Path) -> Workflow:
    if name == "palette_4bit":
        return _palettize(PalettizationSpec(n_bits=4), mmap_dir=mmap_dir)
    if name == "mxfp4_eager":
        return _quantize(_FP4, mode=ExecutionMode.EAGER, mmap_dir=mmap_dir)
    return _quantize(_INT4_32, mmap_dir=mmap_dir)


# ------------------------------------------------------------------- the interface itself ---


def _hand_made(kind: str) -> nn.Module:
    """An MLP whose weights are decompression modules built directly (the forms coreai-opt's
    slower recipes produce: min-value offsets, vector palettes, MX scales, ...)."""
    from torch.nn.utils import parametrize

    from coreai_torch._compression.custom_layers import (
        PalettizeModule,
        ScaledPalettizeModule,
        SparseModule,
        WeightDequantizeModule,
    )
    from coreai_torch._compression.utils import wrap_for_parametrization

    model, _, _ = _model("mlp")
    for linear in (model.fc1, model.fc2, model.fc3):
        out_features, in_features = linear.weight.shape
        blocks = in_features // 32
        if kind == "int4_minval":
            cls, arguments = (
                WeightDequantizeModule,
                (
                    torch.randint(-8, 8, (out_features, in_features), dtype=torch.int8),
                    torch.rand(out_features, blocks) * 0.01,
                    None,
                    -torch.rand(out_features, blocks) * 0.05,
                    {"input_dtype": torch.int4},
                ),
            )
        elif kind == "uint4_zero_point":
            cls, arguments = (
                WeightDequantizeModule,
                (
                    torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8),
                    torch.rand(out_features, blocks) * 0.01,
                    torch.randint(0, 16, (out_features, blocks), dtype=torch.uint8),
                    {"input_dtype": torch.uint4},
                ),
            )
        elif kind == "fp8_e8m0":
            exponent = torch.randint(-9, -5, (out_features, blocks)).float()
            cls, arguments = (
                WeightDequantizeModule,
                (
                    (torch.randn(out_features, in_features) * 100).to(torch.float8_e4m3fn),
                    torch.pow(2.0, exponent).to(torch.float8_e8m0fnu),
                    {"output_dtype": torch.float32},
                ),
            )
        elif kind == "vector_palette":
            cls, arguments = (
                PalettizeModule,
                (
                    torch.randint(0, 16, (out_features // 2, in_features), dtype=torch.uint8),
                    torch.randn(2, 1, 16, 2) * 0.05,
                    {"vector_axis": 0},
                ),
            )
        elif kind == "uint8_lut_zero_point":
            scale = torch.rand(out_features // 16, 1) * 1e-3
            scale[0] = 2.056e-5  # subnormal in float16 (Core AI folds their casts wrongly)
            cls, arguments = (
                ScaledPalettizeModule,
                (
                    torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8),
                    torch.randint(0, 256, (out_features // 16, 1, 16, 1), dtype=torch.uint8),
                    scale,
                    torch.randint(100, 150, (out_features // 16, 1), dtype=torch.uint8),
                    {},
                ),
            )
        else:
            mask = torch.rand(out_features, in_features) < 0.3
            cls, arguments = SparseModule, (torch.randn(int(mask.sum())) * 0.05, mask, {})
        parametrize.register_parametrization(linear, "weight", nn.Identity(), unsafe=True)
        *positional, keywords = arguments
        linear.parametrizations.weight[0] = wrap_for_parametrization(cls)(*positional, **keywords)
    return model


@pytest.mark.parametrize(
    "kind",
    [
        "int4_minval",
        "uint4_zero_point",
        "fp8_e8m0",
        "vector_palette",
        "uint8_lut_zero_point",
        "sparse",
    ],
)
@pytest.mark.parametrize("half", [False, True], ids=["fp32", "fp16"])
def test_decompression_modules_convert(kind: str, half: bool, tmp_path: Path) -> None:
    model = _hand_made(kind)
    args = (torch.randn(4, 256),)
    with torch.no_grad():
        ref = model(*args).numpy()
    _, program = _convert(model, args, half)
    out, size = _run_saved(program, tmp_path / "m.aimodel", _feeds("mlp", args, half))
    scale = max(1.0, float(np.abs(ref).max()))
    assert float(np.abs(out.astype(np.float32) - ref).max()) <= (1e-2 if half else 1e-4) * scale
    assert size < 0.6 * _fp32_weight_bytes(model)


def test_ops_are_kept_whole_by_the_decomposition_table() -> None:
    from coreai_torch._compression.custom_layers import WeightDequantizeModule

    module = WeightDequantizeModule(
        torch.randint(-8, 8, (8, 64), dtype=torch.int8),
        torch.rand(8, 2),
        torch.zeros(8, 2, dtype=torch.int8),
        input_dtype=torch.int4,
    )
    ep = torch.export.export(module, ()).run_decompositions(get_decomp_table())
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert targets == ["coreai.constexpr_blockwise_shift_scale.default"]


def test_parametrization_state_dict_and_assign() -> None:
    """The wrapped modules are parametrizations whose tensors round-trip through state_dict
    and ``load_state_dict(assign=True)``."""
    from torch.nn.utils import parametrize

    from coreai_torch._compression._floatx import Float4Tensor
    from coreai_torch._compression.custom_layers import WeightDequantizeModule
    from coreai_torch._compression.utils import wrap_for_parametrization

    wrapped = wrap_for_parametrization(WeightDequantizeModule)
    assert wrapped is wrap_for_parametrization(WeightDequantizeModule)
    linear = nn.Linear(64, 8)
    packed = torch.randint(0, 256, (8, 32), dtype=torch.uint8)
    scale = torch.tensor(2.0).pow(torch.randint(-4, 2, (8, 2)).float()).to(torch.float8_e8m0fnu)
    module = wrapped(Float4Tensor(packed), scale, output_dtype=torch.float32)
    parametrize.register_parametrization(linear, "weight", nn.Identity(), unsafe=True)
    linear.parametrizations.weight[0] = module
    assert isinstance(module.quantized_data, Float4Tensor)
    assert module.quantized_data.shape == (8, 64)
    weight = linear.weight
    state = module.state_dict()
    assert set(state) == {"quantized_data", "scale"}
    fresh = {
        k: (Float4Tensor(v.elem.clone()) if isinstance(v, Float4Tensor) else v.clone())
        for k, v in state.items()
    }
    module.load_state_dict(fresh, assign=True)
    assert module.quantized_data.elem.data_ptr() == fresh["quantized_data"].elem.data_ptr()
    torch.testing.assert_close(linear.weight, weight)
    copied = copy.deepcopy(module)
    torch.testing.assert_close(copied(), weight)


def test_float4_unpacks_even_elements_from_the_low_nibble() -> None:
    from coreai_torch._compression._floatx import Float4Tensor

    packed = torch.tensor([[0x21, 0xF8]], dtype=torch.uint8)  # 0.5, 1.0, -0.0, -6.0
    out = torch.ops.coreai.constexpr_blockwise_shift_scale(
        Float4Tensor(packed), torch.ones(1, 1), output_dtype=torch.float32
    )
    assert out.tolist() == [[0.5, 1.0, -0.0, -6.0]]


def test_lut_to_dense_vector_palettes() -> None:
    indices = torch.tensor([[0, 1], [1, 0]], dtype=torch.uint8)  # [O/2, I]
    lut = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]])  # [1, 1, 2 entries, V=2]
    out = torch.ops.coreai.lut_to_dense(indices, lut, 0)
    assert out.tolist() == [[1.0, 3.0], [2.0, 4.0], [3.0, 1.0], [4.0, 2.0]]


def test_quantize_rounds_half_to_even_and_clamps() -> None:
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, 300.0, -300.0])
    q = torch.ops.coreai.quantize(x, torch.tensor(1.0), torch.int8)
    assert q.tolist() == [0, 2, 2, 0, 127, -128]
    minval = torch.ops.coreai.quantize(x, torch.tensor(1.0), torch.uint8, minval=torch.tensor(-1.0))
    assert minval.tolist() == [2, 2, 4, 0, 255, 0]


def test_types_and_sub_byte_packing() -> None:
    from coreai_torch._compression import _intx, _types

    int4 = _types.string_to_builtin("int4")
    assert (int4.get_bitwidth(), int4.is_unsigned(), _types.is_int(int4)) == (4, False, True)
    assert _types.nptype_from_builtin(int4) is np.int8
    assert _types.nptype_from_builtin(_types.string_to_builtin("uint2")) is np.uint8
    assert _types.builtin_to_string(int4) == "int4"
    assert _intx.pack_intx(torch.tensor([1, -1, -8, 7], dtype=torch.int8), 4).tolist() == [
        0xF1,
        0x78,
    ]
    assert _intx.pack_uintx(np.array([1, 0, 1, 1, 0, 0, 0, 1, 1]), 1).tolist() == [0x8D, 0x01]
    with pytest.raises(ValueError, match="4-bit codes must lie in"):
        _intx.pack_uintx(np.array([16]), 4)


def test_activation_quantization_to_int4_is_refused_by_name() -> None:
    class Model(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ops.coreai.quantize(x, torch.tensor(0.1), torch.int16).float()

    ep = torch.export.export(Model(), (torch.randn(2, 3),)).run_decompositions(get_decomp_table())
    with pytest.raises(UnsupportedOpError, match=r"int8 or uint8, not torch\.int16"):
        TorchConverter().add_exported_program(ep).to_coreai()


def test_palettes_of_computed_indices_are_refused() -> None:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("lut", torch.randn(1, 1, 16, 1))

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return torch.ops.coreai.lut_to_dense(idx, self.lut)

    idx = torch.randint(0, 16, (4, 8), dtype=torch.uint8)
    ep = torch.export.export(Model(), (idx,)).run_decompositions(get_decomp_table())
    with pytest.raises(UnsupportedOpError, match="must be weights of the program"):
        TorchConverter().add_exported_program(ep).to_coreai()


# ----------------------------------------------------------------- post-conversion passes ---


def _optimized(kind: str) -> tuple[coreai_torch.AIProgram, nn.Module, tuple]:
    model, args, _ = _model(kind)
    _, program = _convert(model, args)
    store = program.weights
    assert store is not None and store.pending  # weights stored transposed, not made yet
    return program, model, args


def _ir_passes() -> dict[str, tuple[Callable, float]]:
    from coreai_opt.coreai_utils import (
        CompressionGranularity,
        DType,
        palettize_weights,
        quantize_weights,
        sparsify_weights,
    )

    block = CompressionGranularity.PER_BLOCK
    return {  # pass, largest relative error vs the fp32 model (weights read as zeros: ~0.3)
        "quantize_int8": (lambda p: quantize_weights(p, DType.INT8), 0.01),
        "quantize_int4_block": (
            lambda p: quantize_weights(p, DType.INT4, granularity=block, block_size=32),
            0.08,
        ),
        "quantize_fp8": (lambda p: quantize_weights(p, DType.FP8_E4M3FN), 0.03),
        "palettize_4bit": (lambda p: palettize_weights(p, None, 4, num_kmeans_workers=1), 0.08),
        "palettize_int8_lut_channel_scale": (
            lambda p: palettize_weights(
                p, DType.INT8, 4, enable_per_channel_scale=True, num_kmeans_workers=1
            ),
            0.08,
        ),
        "sparsify_50": (lambda p: sparsify_weights(p, target_sparsity=0.5), 0.25),
        "sparsify_50_int8": (
            lambda p: sparsify_weights(p, target_sparsity=0.5, quantize_dtype=DType.INT8),
            0.25,
        ),
    }


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, id=n, marks=() if n == "quantize_int8" else pytest.mark.slow)
        for n in (
            "quantize_int8",
            "quantize_int4_block",
            "quantize_fp8",
            "palettize_4bit",
            "palettize_int8_lut_channel_scale",
            "sparsify_50",
            "sparsify_50_int8",
        )
    ],
)
def test_coreai_opt_pass_after_optimize(name: str, tmp_path: Path) -> None:
    """coreai-opt's IR passes read the weights ``optimize()`` stored transposed (their data,
    not placeholders), and the asset holds the constants they wrote."""
    compress, bound = _ir_passes()[name]
    program, model, args = _optimized("mlp")
    compressed = compress(program)
    out, size = _run_saved(compressed, tmp_path / "m.aimodel", _feeds("mlp", args))
    with torch.no_grad():
        ref = model(*args).numpy()
    assert float(np.abs(out - ref).max()) / max(1.0, float(np.abs(ref).max())) <= bound
    assert size < 0.6 * _fp32_weight_bytes(model)  # the float weights were dropped
    original, _ = _run_saved(program, tmp_path / "original.aimodel", _feeds("mlp", args))
    np.testing.assert_allclose(original, ref, rtol=0, atol=1e-4)  # the copy left it alone


def test_an_outside_pass_rewriting_constants_after_optimize(tmp_path: Path) -> None:
    """A pass of another tool reads every weight through ``program._module`` with
    coreai-core's ``copy_constant_value_to_array`` and writes new constants: it sees the data
    (never the placeholders of weights stored transposed), and the asset holds what it wrote."""
    from coreai._compiler._mlir_libs._coreaiIR import _bindings
    from coreai._compiler.dialects.coreai.constant import create_elements_attr

    from coreai_torch._mlir import cai, ir

    program, model, args = _optimized("mlp")
    doubled = copy.deepcopy(program)
    rewritten = []

    def double(op: ir.Operation) -> ir.WalkResult:
        if op.name != "coreai.constant" or not ir.DenseResourceElementsAttr.isinstance(
            op.attributes["value"]
        ):
            return ir.WalkResult.ADVANCE
        ttype = ir.RankedTensorType(op.result.type)
        if ttype.rank != 2:
            return ir.WalkResult.ADVANCE
        data = np.zeros(math.prod(ttype.shape) * 4, np.uint8)
        _bindings.compiler.copy_constant_value_to_array(constant_op=op, destination=data)
        values = data.view(np.float32).reshape(ttype.shape) * 2
        with op.context, op.location, ir.InsertionPoint(op):
            new = cai.ConstantOp(value=create_elements_attr(op.location, ttype, values)).result
        op.result.replace_all_uses_with(new)
        rewritten.append(values)
        return ir.WalkResult.ADVANCE

    doubled._module._mlir_module.operation.walk(double)
    assert len(rewritten) == 3 and all(np.abs(v).max() > 0 for v in rewritten)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for linear in (reference.fc1, reference.fc2, reference.fc3):
            linear.weight.mul_(2)
        expected = reference(*args).numpy()
    out, size = _run_saved(doubled, tmp_path / "m.aimodel", _feeds("mlp", args))
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    assert size < 1.1 * _fp32_weight_bytes(model)  # the replaced constants were not saved


class _CoreMLActivations(nn.Module):
    """Activations quantized the way coreai-opt's Core ML route does (``torch.quantize_per_tensor``
    with tensor parameters, then ``dequantize()``), and with Python numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.tensor(0.05))
        self.register_buffer("zero_point", torch.tensor(3))
        self.linear = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = torch.quantize_per_tensor(x, self.scale, self.zero_point, torch.qint8)
        y = self.linear(q.dequantize())
        return torch.quantize_per_tensor(y, 0.02, 128, torch.quint8).dequantize()


def test_aten_quantize_per_tensor_then_dequantize() -> None:
    model = _CoreMLActivations().eval()
    x = torch.randn(4, 16) * 3
    ep = torch.export.export(model, (x,)).run_decompositions(get_decomp_table())
    program = TorchConverter().add_exported_program(ep).to_coreai().optimize()
    with Session(program) as session:
        (out,) = session.run({"x": x.numpy()}).values()
    with torch.no_grad():
        np.testing.assert_allclose(out, model(x).numpy(), rtol=0, atol=1e-6)


def test_float4_weights_with_float32_scales_are_refused_by_name() -> None:
    """The runtime aborts on FP4 data with float32 scales (it takes e8m0, f16, bf16 or
    f8E4M3FN ones): refused at conversion, naming the weight."""
    from torch.nn.utils import parametrize

    from coreai_torch._compression._floatx import Float4Tensor
    from coreai_torch._compression.custom_layers import WeightDequantizeModule
    from coreai_torch._compression.utils import wrap_for_parametrization
    from coreai_torch.errors import RuntimeHazardError

    linear = nn.Linear(64, 16)
    packed = torch.randint(0, 256, (16, 32), dtype=torch.uint8)
    module = wrap_for_parametrization(WeightDequantizeModule)(
        Float4Tensor(packed), torch.rand(16, 2)
    )
    parametrize.register_parametrization(linear, "weight", nn.Identity(), unsafe=True)
    linear.parametrizations.weight[0] = module
    ep = torch.export.export(linear, (torch.randn(2, 64),)).run_decompositions(get_decomp_table())
    expected = r"weight 'weight': coreai.blockwise_shift_scale would abort.*float4 data needs"
    with pytest.raises(RuntimeHazardError, match=expected):
        TorchConverter().add_exported_program(ep).to_coreai()
