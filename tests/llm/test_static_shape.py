"""``llm.export(engine="static")``: the function family of the app's static-shape engine (iOS,
the Neural Engine) -- ``load_embeddings``, ``gather_embeddings_<Q>``, ``extend_<ctx>_<Q>``,
``prompt_opt_<ctx>_<Q>`` -- every function reading one copy of the weights; the reference
driver's ``StaticShapeEngine`` (aligned batches, uint16 positions, slices of one pair of cache
buffers full of noise or NaN) generates what ``model.generate`` does, token for token, and
``coreai doctor`` finds nothing wrong with the bundle.  Bad shapes are refused before
anything is traced.

Fast: a Llama in float32; slow: Gemma 2 (sliding window, soft-capping) in float16."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from coreai_torch import bundles, llm
from tests.bundles.support import assert_doctor_clean
from tests.llm.support import causal_lm, check_engine, export_bundle
from tests.llm.test_precision import FP16_TOLERANCE

CONTEXTS = [32, 64]
QUERY_LENGTHS = [8, 16]
#: prompts of 3 and 27 tokens (a prefill in chunks of 16, a batch realigned)
PROMPTS = [[5, 6, 7], list(range(3, 30))]


def check_static(name: str, root: Path, precision: str | None, tolerance: float) -> None:
    model = causal_lm(name)
    bundle, program = export_bundle(
        model,
        root,
        engine="static",
        precision=precision,
        contexts=CONTEXTS,
        query_lengths=QUERY_LENGTHS,
    )
    functions = set(program.function_names)
    assert functions == {
        "load_embeddings",
        *(f"gather_embeddings_{q}" for q in QUERY_LENGTHS),
        *(f"extend_{c}_{q}" for c in CONTEXTS for q in QUERY_LENGTHS),
        *(f"prompt_opt_{c}_16" for c in CONTEXTS),
    }
    assert bundles.Bundle.load(bundle).structure == "chunked_static"
    # every decoder function reads the same copy of each of the model's weights; only
    # constants the pre-compilation rewrite folds (Gemma's 1 + norm weight: a vector per norm)
    # are made once for the extend functions and once for the prompt ones
    graphs = str(program.structural_module).split("coreai.graph")[1:]
    read = {
        g.split("(")[0].strip(): frozenset(re.findall(r"dense_resource<\"?([^>\"]+)", g))
        for g in graphs
    }
    decoders = [read[f"@{f}"] for f in functions if f.startswith(("extend_", "prompt_opt_"))]
    shared = frozenset.intersection(*decoders)
    assert any(".layers.0." in n for n in shared), sorted(shared)
    for names in decoders:
        assert not [n for n in names - shared if n.startswith(("model.", "lm_head"))]
    for fresh_memory in ("noise", "nan"):
        with bundles.open_engine(bundle, stop_token_ids=[], fresh_memory=fresh_memory) as engine:
            assert isinstance(engine, bundles.StaticShapeEngine)
            for ids in PROMPTS:
                check_engine(engine, model, ids, 24, tolerance=tolerance)
    assert_doctor_clean(bundle)


def test_static_shape_bundle_matches_transformers(tmp_path: Path) -> None:
    check_static("llama", tmp_path, None, 1e-4)


@pytest.mark.slow
def test_static_shape_gemma2_in_float16(tmp_path: Path) -> None:
    check_static("gemma2", tmp_path, "fp16", FP16_TOLERANCE)


def test_bad_static_shapes_are_refused_before_tracing() -> None:
    model = causal_lm("llama")
    with pytest.raises(ValueError, match="must be max_context=64"):
        llm.export(model, max_context=64, engine="static", contexts=[32])
    with pytest.raises(ValueError, match="not a multiple of the query length 16"):
        llm.export(model, max_context=64, engine="static", contexts=[40, 64], query_lengths=[16])
    with pytest.raises(ValueError, match="contexts of at least"):
        llm.export(model, max_context=64, engine="static", contexts=[8, 64], query_lengths=[8])
