"""The app engines' calling convention, checked on function signatures: every rule of the
sequential/pipelined engines (§6.1-6.2) and of the static-shape engine (§6.4) refuses an
asset that breaks it, naming the function, the value and the fix."""

from __future__ import annotations

from dataclasses import replace

import pytest

from coreai_torch.bundles import (
    CallingConventionError,
    FunctionSignature,
    LanguageConfig,
    TensorSpec,
    check_dynamic_decoder,
    check_language_asset,
    check_static_shape,
    classify_states,
    detect_structure,
)

LANGUAGE = LanguageConfig("t", vocab_size=96, max_context_length=1024)
IDS = TensorSpec("input_ids", "int32", (1, None))
POSITIONS = TensorSpec("position_ids", "int32", (1, None))
LOGITS = TensorSpec("logits", "float16", (1, None, 96))
KEYS = TensorSpec("keyCache", "float16", (2, 1, 2, None, 8))
VALUES = TensorSpec("valueCache", "float16", (2, 1, 2, None, 8))
GOOD = FunctionSignature("main", (IDS, POSITIONS), (LOGITS,), (KEYS, VALUES))


def check(function: FunctionSignature, language: LanguageConfig = LANGUAGE) -> None:
    check_dynamic_decoder({function.name: function}, language, where="m.aimodel")


def test_the_convention_itself_passes() -> None:
    check(GOOD)
    assert check_language_asset({"main": GOOD}, LANGUAGE, where="m") == "dynamic"
    hybrid = replace(GOOD, states=(KEYS, VALUES, TensorSpec("conv_state", "float32", (2, 16))))
    check(hybrid)  # a persistent fixed state of a hybrid model
    assert classify_states(hybrid) == [
        ("keyCache", "kv_cache"),
        ("valueCache", "kv_cache"),
        ("conv_state", "fixed"),
    ]
    static = replace(GOOD, states=(replace(KEYS, shape=(2, 1, 2, 1024, 8)),) * 2)
    check(static)  # static caches of max_context_length rows


@pytest.mark.parametrize(
    ("function", "message"),
    [
        (replace(GOOD, name="forward"), "load the function 'main'"),
        (
            replace(GOOD, inputs=(IDS, POSITIONS, TensorSpec("mask", "float16", (1, None)))),
            "takes 3 inputs",
        ),
        (
            replace(GOOD, inputs=(replace(IDS, dtype="int64"), POSITIONS)),
            "is int64; the engines write int32",
        ),
        (
            replace(GOOD, inputs=(IDS, TensorSpec("start_position", "int32", (1,)))),
            "input 1 (the positions)",
        ),
        (replace(GOOD, inputs=(replace(IDS, shape=(1, 1)), POSITIONS)), "dynamic second dimension"),
        (
            replace(GOOD, outputs=(replace(LOGITS, dtype="float32"),)),
            "float32; the engines accept only float16",
        ),
        (replace(GOOD, outputs=(replace(LOGITS, shape=(1, 96)),)), "logits [1, T, vocab]"),
        (
            replace(GOOD, outputs=(replace(LOGITS, shape=(1, None, 100)),)),
            "100 logits per token but",
        ),
        (replace(GOOD, outputs=()), "has no outputs"),
        (replace(GOOD, states=(KEYS,)), "has 1 states"),
        (replace(GOOD, states=(KEYS, VALUES) * 3), "has 6 states"),
        (replace(GOOD, states=(replace(KEYS, dtype="int8"), VALUES)), "'keyCache' is int8"),
        (
            replace(GOOD, states=(replace(KEYS, shape=(2, 1, None, 2, 8)), VALUES)),
            "grow along its second-to-last dimension",
        ),
        (
            replace(
                GOOD,
                states=(
                    replace(KEYS, shape=(1, 2, None, 8)),
                    replace(VALUES, shape=(1, 2, None, 8)),
                ),
            ),
            "is 4-D; the pipelined engine grows",
        ),
        (replace(GOOD, states=(replace(KEYS, shape=(2, 1, 2, 512, 8)),) * 2), "is static"),
        (
            replace(
                GOOD,
                states=(
                    KEYS,
                    TensorSpec("ssm", "float32", (4,)),
                    TensorSpec("conv", "float32", (4,)),
                ),
            ),
            "has 1 KV cache state",
        ),
    ],
)
def test_a_decoder_breaking_the_convention_is_refused(
    function: FunctionSignature, message: str
) -> None:
    with pytest.raises(CallingConventionError, match=r"m\.aimodel") as error:
        check(function)
    assert message in str(error.value)


def test_the_function_map_names_the_decoder() -> None:
    renamed = replace(GOOD, name="decode")
    check(renamed, replace(LANGUAGE, function_map={"main": ("decode",)}))
    with pytest.raises(CallingConventionError, match=r"language.function_map to \{\"main\""):
        check(renamed)


# ----------------------------------------------------------------------- static shape ---

HIDDEN = 32


def static_family(contexts=(64, 128), queries=(4, 16), **overrides) -> dict[str, FunctionSignature]:
    table = TensorSpec("embedding_table", "float32", (96, HIDDEN))
    functions = {"load_embeddings": FunctionSignature("load_embeddings", (), (table,), ())}
    for q in queries:
        functions[f"gather_embeddings_{q}"] = FunctionSignature(
            f"gather_embeddings_{q}",
            (TensorSpec("in_new_token_ids", "int32", (1, q)), table),
            (TensorSpec("out_transformer_input", "float32", (1, q, HIDDEN)),),
            (),
        )
    for ctx in contexts:
        for q in queries:
            cache = TensorSpec("key_cache", "float16", (2, 1, 2, ctx, 8))
            decoder = FunctionSignature(
                "",
                (
                    TensorSpec("transformer_input", "float32", (1, q, HIDDEN)),
                    TensorSpec("position_ids", "uint16", (1, q)),
                    TensorSpec("causal_mask", "float16", (1, ctx, 1, q)),
                    TensorSpec("in_step", "int32", (1,)),
                ),
                (TensorSpec("out_logits", "float16", (1, q, 96)),),
                (cache, replace(cache, name="value_cache")),
            )
            for prefix in ("extend", "prompt_opt") if q == max(queries) else ("extend",):
                name = f"{prefix}_{ctx}_{q}"
                functions[name] = replace(decoder, name=name)
    functions.update(overrides)
    return {k: v for k, v in functions.items() if v is not None}


STATIC_LANGUAGE = LanguageConfig("t", vocab_size=96, max_context_length=128)


def test_a_static_shape_family_passes() -> None:
    family = static_family()
    assert detect_structure(list(family)) == "chunked_static"
    found = check_static_shape(family, STATIC_LANGUAGE, where="m")
    assert found.pairs == ((64, 4), (64, 16), (128, 4), (128, 16))
    assert found.max_query_length == 16 and found.gather_lengths == (4, 16)
    assert found.cache_function == "extend_128_16"


def _edit(name: str, **changes) -> dict[str, FunctionSignature]:
    family = static_family()
    return {**family, name: replace(family[name], **changes)}


@pytest.mark.parametrize(
    ("family", "message"),
    [
        (static_family(load_embeddings=None), "the asset has no such function"),
        (static_family(prompt_opt_128_16=None), "'prompt_opt_128_16', which is missing"),
        (static_family(gather_embeddings_4=None), "'gather_embeddings_4', which is missing"),
        (static_family(extend_64_16=None), "'extend_64_16' (which the engine picks"),
        (
            {**static_family(), "extend_big": static_family()["extend_64_4"]},
            "name it extend_<ctx>_<Q>",
        ),
        (static_family(contexts=(64,)), "no extend function has a key cache of max_context_length"),
        (
            _edit("extend_64_4", states=static_family()["extend_64_4"].states[:1]),
            "binds exactly 'key_cache'",
        ),
        (
            _edit(
                "extend_64_4",
                inputs=(
                    TensorSpec("transformer_input", "float32", (1, 4, HIDDEN)),
                    TensorSpec("position_ids", "int32", (1, 4)),
                ),
            ),
            "must be uint16 [1, 4]",
        ),
        (
            _edit("extend_64_4", outputs=(TensorSpec("logits", "float16", (1, 4, 96)),)),
            "no output 'out_logits'",
        ),
        (
            _edit(
                "extend_64_4",
                inputs=static_family()["extend_64_4"].inputs
                + (TensorSpec("rope_cos", "float16", (4, 8)),),
            ),
            "'rope_cos' is not one the static-shape engine feeds",
        ),
        (
            _edit("gather_embeddings_4", inputs=(TensorSpec("in_new_token_ids", "int32", (1, 4)),)),
            "must take 'embedding_table'",
        ),
    ],
)
def test_a_static_family_breaking_the_convention_is_refused(family, message: str) -> None:
    with pytest.raises(CallingConventionError) as error:
        check_static_shape(family, STATIC_LANGUAGE, where="m")
    assert message in str(error.value)
