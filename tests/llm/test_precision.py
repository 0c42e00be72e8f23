"""``llm.export(precision=..., compress=...)``: half-precision programs with a half KV cache,
compressed weights, and both (``coreai-torch llm export --precision fp16 --compress int4``).

The honest reference for the numbers is the eager model in the same precision with the
same weights: a copy of the model whose compressed weights are replaced by their
quantized-dequantized values (``tests.test_compress``'s fake-quantized references), cast to
the program's precision.  Logits are compared within ``tol * max(1, max|ref|)``:

* float16: ``tol = 4e-3``, about three times the largest error measured here (1.5e-3, with
  int4 or int8 weights or without: one or two float16 ulps of logits of magnitude ~4);
* bfloat16: ``tol = 3e-2``, about 2.5 times the largest error measured (1.2e-2; bfloat16
  keeps 8 significant bits to float16's 11);
* float32 with compressed weights: ``tol = 1e-4``, as for every float32 program.

Greedy tokens (the reference driver running the bundle as the app does) equal
``model.generate`` on that reference token for token, except that they may part at a near tie
of the reference's two best logits (closer than the tolerance), where the comparison stops
(``check_steps``).  The logits are float16 whatever the precision (the app's convention).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn

from coreai_torch import bundles, compression, llm
from coreai_torch.cli import main
from tests.bundles.support import assert_doctor_clean
from tests.llm.support import (
    ARCHITECTURES,
    HALF_LOGITS,
    MAX_CONTEXT,
    MOE_ARCHITECTURES,
    NEW_TOKENS,
    PROMPTS,
    asset_bytes,
    causal_lm,
    check_engine,
    export_bundle,
    save_model_dir,
    tiny_tokenizer,
)
from tests.test_compress import fake_linear, fake_palette, stored_palette

# The tests share one export (module fixture): keep them on one xdist worker.
pytestmark = pytest.mark.xdist_group("llm_export_fp16_int4")

#: A Llama wide enough for blocks of 32 and for the weights to dominate the asset.
WIDE = dict(hidden_size=128, intermediate_size=256)
FP16_TOLERANCE = 4e-3
BF16_TOLERANCE = 3e-2
#: Gemma (1) in float16: its scaled embeddings and (1 + w) norms drift further over a decode
#: (Gemma with int4 weights: largest measured 4.0e-3 of max|ref|)
GEMMA_FP16_TOLERANCE = 6e-3
#: the asset beyond its weights: the program, metadata (an uncompressed float16 embedding
#: table would add 23 KB more and exceed it)
ASSET_OVERHEAD = 64 * 1024
#: the weights compress() stores compressed: those the Llama's matmuls read and the
#: embedding table (looked up by a dynamic number of tokens)
COMPRESSED = re.compile(r"(proj|lm_head|embed_tokens)\.weight$")


def compressed_weights(program_text: str) -> set[str]:
    """The model's weights a program stores compressed (their codes or palette indices)."""
    found = re.findall(r"dense_resource<\"?model\.([\w.]+)\.(?:codes|indices)", program_text)
    return set(found)


def fake_quantized(
    model: nn.Module,
    names: set[str],
    fake: Any,
    dtype: torch.dtype,
) -> nn.Module:
    """A copy of ``model`` in ``dtype`` whose weights ``names`` are ``fake(name, weight)``
    (the weight rounded to ``dtype`` first, as the program stores it before compressing)."""
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for name in names:
            param = reference.get_parameter(name)
            param.copy_(fake(name, param.detach().to(dtype).float()))
    return reference.to(dtype)


def state_bytes(model: nn.Module, itemsize: int) -> int:
    """Bytes of the KV cache: k and v per layer, ``[1, kv_heads, MAX_CONTEXT, head_dim]``."""
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    per_layer = 2 * config.num_key_value_heads * MAX_CONTEXT * head_dim
    return config.num_hidden_layers * per_layer * itemsize


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``coreai-torch llm export MODEL_DIR --precision fp16 --compress int4`` and what it
    printed (JSON)."""
    root = tmp_path_factory.mktemp("llm_fp16_int4")
    model, tokenizer, model_dir = save_model_dir(root, **WIDE)
    bundle = root / "bundle"
    args = ["--json", "llm", "export", str(model_dir), "-o", str(bundle), "--max-context", "64"]
    with contextlib.redirect_stdout(io.StringIO()) as out:
        code = main([*args, "--precision", "fp16", "--compress", "int4"])
    return {
        "model": model,
        "tokenizer": tokenizer,
        "bundle": bundle,
        "asset": bundle / "bundle.aimodel",  # <name>.aimodel
        "code": code,
        "out": out,
    }


def test_cli_export_fp16_int4_stores_the_weights_in_4_bits(exported: dict[str, Any]) -> None:
    import coreai.authoring as ca

    assert exported["code"] == 0
    printed = json.loads(exported["out"].getvalue())
    assert printed["precision"] == "fp16"
    assert printed["compression"] == compression.from_spec("int4").describe()
    model = exported["model"]
    names = compressed_weights(str(ca.AIModelAsset.load(exported["asset"]).program))
    selected = {n for n, _ in model.named_parameters() if COMPRESSED.search(n)}
    assert len(selected) == 16 and selected <= names, f"not compressed: {selected - names}"
    # int4 codes with a float16 scale per block of 32 (4.5 bits), the embedding and the head
    # int8 with a float16 scale per row (the preset's safe form); every other weight float16
    bound = ASSET_OVERHEAD + sum(
        p.numel() * (_preset_bits(n, p) / 8 if n in selected else 2)
        for n, p in model.named_parameters()
    )
    size = asset_bytes(exported["asset"])
    assert size <= bound, f"asset {size} B > {bound:.0f} B"
    assert printed["asset_bytes"] == size
    manifest = json.loads((exported["bundle"] / "metadata.json").read_text())
    assert manifest["compression"] == printed["compression"]
    assert_doctor_clean(exported["bundle"])


def _preset_bits(name: str, weight: torch.Tensor) -> float:
    """Bits per weight of the int4 preset: the embedding and the head in int8 per row."""
    form = compression.from_spec("int4")
    if "embed_tokens" in name or "lm_head" in name:
        form = compression.SAFE_FORM
    return compression.bits_per_weight(form, tuple(weight.shape), torch.float16)


def _preset_form(name: str) -> compression.LinearQuantization:
    """The form the int4 preset gives a weight, with float16 scales (a float16 program)."""
    form = compression.from_spec("int4")
    if "embed_tokens" in name or "lm_head" in name:
        form = compression.SAFE_FORM
    return dataclasses.replace(form, scale_dtype=torch.float16)


def test_fp16_int4_generation_matches_the_same_model_in_fp16_with_int4_weights(
    exported: dict[str, Any],
) -> None:
    import coreai.authoring as ca

    model, tokenizer = exported["model"], exported["tokenizer"]
    names = compressed_weights(str(ca.AIModelAsset.load(exported["asset"]).program))
    reference = fake_quantized(
        model, names, lambda name, w: fake_linear(w, _preset_form(name)), torch.float16
    )
    main_fn = bundles.function_signatures(exported["asset"])["main"]
    # the KV cache in float16: half the state bytes of the float32 program
    assert [s.dtype for s in main_fn.states] == ["float16", "float16"]
    assert main_fn.outputs[0].dtype == "float16"
    with llm.Generator(exported["bundle"]) as generator:
        assert generator.state_bytes == state_bytes(model, 2)
        logits: list[np.ndarray] = []
        list(generator.generate([5, 6], 1, on_logits=logits.append))
        assert logits[0].dtype == np.float32  # the float16 logits, as float32
    with bundles.open_engine(exported["bundle"], stop_token_ids=[]) as engine:
        for prompt in PROMPTS:
            check_engine(engine, reference, tokenizer.encode(prompt), tolerance=FP16_TOLERANCE)


def check_variant(
    root: Path,
    precision: Any,
    compress: Any,
    tolerance: float,
    dtype: torch.dtype,
    fake: Any = None,
    architecture: str = "llama",
    against_float32: bool = False,
) -> None:
    """Export the bundle of ``architecture`` (the wide Llama by default) with ``precision`` /
    ``compress``; its greedy generation against the eager model in ``dtype`` with the
    compressed weights ``fake``-quantized (``against_float32``: against the float32 model,
    no further from it than that eager model, :func:`check_closer_to_float32`)."""
    overrides = WIDE if architecture == "llama" else {}
    model, tokenizer = causal_lm(architecture, **overrides), tiny_tokenizer()
    bundle, program = export_bundle(model, root, precision=precision, compress=compress)
    names = compressed_weights(str(program)) if compress is not None else set()
    if architecture == "llama":
        selected = {n for n, _ in model.named_parameters() if COMPRESSED.search(n)}
        assert selected <= names if compress is not None else not names
    else:
        assert bool(names) == (compress is not None), sorted(names)
    reference = fake_quantized(model, names, fake and fake(program), dtype)
    with llm.Generator(program, max_context=MAX_CONTEXT) as generator:
        itemsize = torch.empty((), dtype=dtype).element_size()
        assert generator.state_bytes == state_bytes(model, itemsize)
    with bundles.open_engine(bundle, stop_token_ids=[]) as engine:
        for prompt in PROMPTS:
            ids = tokenizer.encode(prompt)
            if against_float32:
                check_closer_to_float32(engine, model, reference, ids, tolerance)
            else:
                check_engine(engine, reference, ids, tolerance=tolerance)
    assert_doctor_clean(bundle)


def check_closer_to_float32(
    engine: Any, model: nn.Module, half_model: nn.Module, ids: list[int], tolerance: float
) -> None:
    """The engine's greedy generation from ``ids`` against the float32 ``model`` fed the same
    tokens: every step's logits no further from float32's than the eager ``half_model``'s
    (fed the same tokens) plus ``tolerance`` and the float16 logits' rounding (relative to
    the largest float32 logit), and every token float32's best or within that distance of it."""
    steps: list[np.ndarray] = []
    tokens = engine.generate(ids, NEW_TOKENS, on_logits=steps.append)
    assert len(tokens) == len(steps) == NEW_TOKENS
    sequence = torch.tensor([ids + list(tokens)])
    predicting = slice(len(ids) - 1, sequence.shape[1] - 1)
    with torch.no_grad():
        exact = model(sequence).logits[0, predicting].float()
        half = half_model(sequence).logits[0, predicting].float()
    for step, actual in enumerate(steps):
        ref = exact[step]
        largest = max(1.0, float(ref.abs().max()))
        half_err = float((half[step] - ref).abs().max())
        tol = half_err + (tolerance + HALF_LOGITS) * largest
        err = float((torch.from_numpy(actual.astype(np.float32)) - ref).abs().max())
        assert err <= tol, (
            f"prompt {ids}, step {step}: max|err| against float32 {err:.3e} > {tol:.3e} "
            f"(eager float16: {half_err:.3e})"
        )
        margin = float(ref.max() - ref[tokens[step]])
        assert margin <= 2 * tol, f"prompt {ids}, step {step}: token margin {margin:.3e}"


def _int4_preset(program: Any) -> Any:
    """The int4 preset's fitted forms, as :func:`fake_quantized` applies them."""
    return lambda name, w: fake_linear(w, _preset_form(name))


#: every architecture in float16; the dense ones with int4 weights too (the mixtures of
#: experts' stacked expert weights with int4: ``tests/llm/test_moe.py``, Mixtral)
HALF_VARIANTS: list[Any] = [
    *((name, None) for name in sorted({*ARCHITECTURES, *MOE_ARCHITECTURES})),
    *((name, "int4") for name in sorted(ARCHITECTURES)),
]
#: the variants checked against the float32 model (:func:`check_closer_to_float32`), where
#: the eager float16 model is no better a reference than the bundle: Gemma (1) in float16
#: (eager float16 1.1e-2 of max|ref| from float32 at step 31 of the third prompt, the bundle
#: 4.6e-3; mean over the steps of three seeds, bundle 1.2e-3 to 1.7e-3, eager 1.5e-3 to
#: 1.9e-3) and Gemma 2 with int4 weights (5.5e-2 apart from its eager float16 model at step 20
#: of the third prompt once ``1 + w`` is read in float32, as the eager model computes it)
AGAINST_FLOAT32 = {("gemma", None), ("gemma2", "int4")}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("architecture", "compress"),
    HALF_VARIANTS,
)
def test_every_architecture_in_half_precision(
    architecture: str, compress: str | None, tmp_path: Path
) -> None:
    """Every architecture ``llm.export`` supports, in float16 (and the dense ones in float16
    with int4 weights): the bundle run by the reference driver against the eager model in
    float16 with the same quantized weights (``coreai doctor`` clean).

    The variants of :data:`AGAINST_FLOAT32` (Gemma (1) in float16, Gemma 2 with int4 weights),
    whose eager float16 model and bundle part along a decode, are checked against the float32
    model instead: the bundle no further from float32 than eager float16 is, plus the float16
    tolerance."""
    fake = _int4_preset if compress else None
    against_float32 = (architecture, compress) in AGAINST_FLOAT32
    tolerance = GEMMA_FP16_TOLERANCE if architecture == "gemma" else FP16_TOLERANCE
    if against_float32:
        tolerance = FP16_TOLERANCE
    check_variant(
        tmp_path, "fp16", compress, tolerance, torch.float16, fake, architecture, against_float32
    )


@pytest.mark.slow
def test_bf16(tmp_path: Path) -> None:
    check_variant(tmp_path, torch.bfloat16, None, BF16_TOLERANCE, torch.bfloat16)


@pytest.mark.slow
def test_fp16_int8_per_channel(tmp_path: Path) -> None:
    config = compression.LinearQuantization(bits=8, scale_dtype=torch.float16)
    check_variant(
        tmp_path,
        "fp16",
        config,
        FP16_TOLERANCE,
        torch.float16,
        lambda _: lambda n, w: fake_linear(w, config),
    )


@pytest.mark.slow
def test_fp32_palette4(tmp_path: Path) -> None:
    # the preset's palettes are shared by groups of output channels (16), not one per weight
    group = compression.from_spec("palette4").group_size

    def fake(program: Any) -> Any:
        def replace(name: str, w: torch.Tensor) -> torch.Tensor:
            if "embed_tokens" in name or "lm_head" in name:  # the preset's int8 rows
                return fake_linear(w, compression.SAFE_FORM)
            # compressed before optimize(), the indices are stored as the matmul reads the
            # weight: transposed (fake_palette fails on indices in another layout); the
            # embedding table's as the lookup reads it
            transposed = "embed_tokens" not in name
            indices, palettes = stored_palette(program, f"model.{name}", 4, transposed)
            return fake_palette(w, indices, palettes, group)

        return replace

    check_variant(tmp_path, None, "palette4", 1e-4, torch.float32, fake)


def test_precision_and_compress_are_checked_before_the_model_is_read(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown precision"):
        llm.export(tmp_path / "missing", precision="fp12")
    with pytest.raises(ValueError, match="unknown compression"):
        llm.export(tmp_path / "missing", compress="int16")
    args = ["llm", "export", str(tmp_path / "missing"), "-o", str(tmp_path / "m")]
    assert main([*args, "--block-size", "64"]) == 2  # --block-size needs --compress
    assert main([*args, "--keep-fp32", "lm_head"]) == 2  # --keep-fp32 needs --precision
