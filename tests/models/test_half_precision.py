"""Every model family of the model tests, converted with ``compute_precision=torch.float16``
and ``torch.bfloat16``, against float32 eager PyTorch on the Core AI runtime; and models that
are already in 16 bits against their own eager output.

The rule: every floating output within ``tol * max(1, max|ref|)`` of float32 eager, with
``tol`` per family and dtype (:data:`TOLERANCE`, about twice the largest error measured in
the family, and never below what PyTorch itself gets running the model in that dtype), and a
cosine similarity of at least 0.999.  docs/precision.md has the table with the measured errors.
Mixture-of-experts models run after ``rewrite_moe`` (the expert projections also as
``gather_matmul`` composites), the frontier models with their documented patches.
A representative model of each dtype is in the fast suite, the rest are slow.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn as nn

from coreai_torch import TorchConverter, rewrite_moe
from coreai_torch.composite_ops import GatherMatmul, default_specs
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.runtime import Session, to_ndarray
from coreai_torch.verify import eager_outputs, run_entrypoint
from tests.helpers import check_half
from tests.models.common import Call, record_errors, redraw_weights
from tests.models.test_gpt2 import two_layer_gpt2

#: family -> (float16, bfloat16) tolerance, relative to max(1, max|ref|)
TOLERANCE = {
    "decoder_lm": (1e-2, 6e-2),
    "encoder_lm": (1e-2, 4e-2),
    "encoder_decoder": (1e-2, 6e-2),
    "vision": (1e-2, 4e-2),
    "audio": (1e-2, 4e-2),
    "clip": (1e-2, 2e-2),
    "torch_nn": (1e-2, 8e-2),
    "llm_decode": (1e-2, 4e-2),
    "moe_lm": (1e-2, 3e-2),
    "multimodal": (1e-2, 3e-2),
    "hybrid_ssm": (1e-2, 6e-2),
    "linear_attention": (2e-2, 8e-2),
}
COSINE = 0.999

Build = Callable[[], tuple[nn.Module, tuple[Any, ...]]]


def _decoder(name: str) -> Build:
    def build() -> tuple[nn.Module, tuple[Any, ...]]:
        from tests.models.test_decoder_lms import SLOW_MODELS, VOCAB, causal_lm

        if name == "llama":
            model = causal_lm("LlamaConfig", "LlamaForCausalLM")
        else:
            config, model_name, attn, overrides = SLOW_MODELS[name]
            model = causal_lm(config, model_name, attn, **overrides)
        return model, (torch.randint(0, VOCAB, (2, 16)),)

    return build


def _moe(name: str, strategy: str = "auto") -> Build:
    def build() -> tuple[nn.Module, tuple[Any, ...]]:
        from tests.models.test_decoder_lms import VOCAB
        from tests.models.test_moe import moe_causal_lm

        model = rewrite_moe(moe_causal_lm(name), strategy=strategy)
        logits = Call(model, lambda m, ids: m(input_ids=ids, use_cache=False, return_dict=False)[0])
        return logits, (torch.randint(0, VOCAB, (2, 8)),)

    return build


def _bert() -> tuple[nn.Module, tuple[Any, ...]]:
    from tests.models.test_encoder_lms import SEQ, encoder, padded_inputs

    model = encoder("BertConfig", "BertModel", pad_token_id=1)
    ids, mask = padded_inputs()
    types = torch.zeros_like(ids)
    types[:, SEQ // 2 :] = 1

    def call(m: nn.Module, i: torch.Tensor, a: torch.Tensor, t: torch.Tensor) -> Any:
        return m(input_ids=i, attention_mask=a, token_type_ids=t, return_dict=False)[:2]

    return Call(model, call), (ids, mask, types)


def _encoder(name: str) -> Build:
    def build() -> tuple[nn.Module, tuple[Any, ...]]:
        from tests.models.test_encoder_lms import MODELS, encoder, padded_inputs

        config, model_name, overrides = MODELS[name]
        model = encoder(config, model_name, **overrides)
        call = Call(model, lambda m, i, a: m(input_ids=i, attention_mask=a, return_dict=False)[0])
        return call, padded_inputs()

    return build


def _vision(name: str) -> Build:
    def build() -> tuple[nn.Module, tuple[Any, ...]]:
        from tests.models.test_vision import IMAGE, MODELS, logits_and_hidden, vit

        model, fn = (vit(), logits_and_hidden) if name == "vit" else MODELS[name]
        if name != "vit":
            model = model()
        return Call(model, fn), (torch.randn(2, 3, IMAGE, IMAGE),)

    return build


def _resnet18() -> tuple[nn.Module, tuple[Any, ...]]:
    from tests.models.test_resnet import ResNet

    return redraw_weights(ResNet().eval()), (torch.randn(2, 3, 64, 64),)


def _wav2vec2(norm: str) -> Build:
    def build() -> tuple[nn.Module, tuple[Any, ...]]:
        from tests.models.test_audio import logits_and_hidden, wav2vec2

        variant: dict[str, Any] = (
            dict(feat_extract_norm="group", do_stable_layer_norm=False)
            if norm == "group"
            else dict(feat_extract_norm="layer", do_stable_layer_norm=True, conv_bias=True)
        )
        return Call(wav2vec2(**variant), logits_and_hidden), (torch.randn(2, 400),)

    return build


def _clip() -> tuple[nn.Module, tuple[Any, ...]]:
    from tests.models.test_clip import clip, clip_inputs, similarity

    return Call(clip(), similarity), clip_inputs()


def _seq2seq(name: str) -> Build:
    def build() -> tuple[nn.Module, tuple[Any, ...]]:
        from tests.models import test_encoder_decoder as family

        model = Call(getattr(family, name)(), family.logits_and_encoder)
        if name == "whisper":
            return model, (torch.randn(2, 16, 32), torch.randint(3, family.VOCAB, (2, 8)))
        return model, family.text_inputs()

    return build


def _recurrent(cell: str, bidirectional: bool) -> Build:
    def build() -> tuple[nn.Module, tuple[Any, ...]]:
        from tests.models.test_torch_nn import Recurrent, recurrent_inputs

        kind = getattr(nn, cell)
        return (
            redraw_weights(Recurrent(kind, bidirectional), gain=2.0),
            recurrent_inputs(kind, bidirectional),
        )

    return build


def _unet() -> tuple[nn.Module, tuple[Any, ...]]:
    from tests.models.test_torch_nn import UNet

    return redraw_weights(UNet(), gain=1.2), (torch.randn(2, 3, 32, 32),)


def _transformer_encoder(norm_first: bool) -> Build:
    def build() -> tuple[nn.Module, tuple[Any, ...]]:
        from tests.models.test_torch_nn import Encoder

        padding = torch.zeros(2, 10, dtype=torch.bool)
        padding[1, 7:] = True
        return redraw_weights(Encoder(norm_first)), (torch.randn(2, 10, 64), padding)

    return build


#: (family, name) -> builder; the names listed in FAST run in the fast suite
MODELS: dict[tuple[str, str], Build] = {
    ("decoder_lm", "llama"): _decoder("llama"),
    **{
        ("decoder_lm", name): _decoder(name)
        for name in (
            "llama_eager",
            "mistral",
            "qwen2",
            "qwen3",
            "gemma",
            "gemma2",
            "phi",
            "phi3",
            "opt",
            "bloom",
            "gpt_neox",
            "falcon",
        )
    },
    ("decoder_lm", "gpt2"): two_layer_gpt2,
    **{
        ("moe_lm", name): _moe(name)
        for name in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")
    },
    ("encoder_lm", "bert"): _bert,
    **{
        ("encoder_lm", name): _encoder(name)
        for name in ("roberta_mlm", "distilbert_mlm", "bert_mlm", "albert", "deberta_v2")
    },
    **{
        ("vision", name): _vision(name)
        for name in (
            "vit",
            "dinov2",
            "beit",
            "swin",
            "convnext",
            "resnet",
            "mobilenet_v2",
            "efficientnet",
            "segformer",
        )
    },
    ("vision", "resnet18_layout"): _resnet18,
    ("audio", "wav2vec2_base"): _wav2vec2("group"),
    ("audio", "wav2vec2_stable_layer_norm"): _wav2vec2("layer"),
    ("clip", "clip"): _clip,
    **{("encoder_decoder", name): _seq2seq(name) for name in ("t5", "bart", "whisper")},
    ("torch_nn", "lstm"): _recurrent("LSTM", False),
    ("torch_nn", "lstm_bidirectional"): _recurrent("LSTM", True),
    ("torch_nn", "gru"): _recurrent("GRU", False),
    ("torch_nn", "gru_bidirectional"): _recurrent("GRU", True),
    ("torch_nn", "rnn_tanh"): _recurrent("RNN", False),
    ("torch_nn", "unet"): _unet,
    ("torch_nn", "transformer_encoder"): _transformer_encoder(False),
    ("torch_nn", "transformer_encoder_norm_first"): _transformer_encoder(True),
}
FAST = {
    (torch.float16, "llama"),
    (torch.bfloat16, "llama"),
    (torch.float16, "vit"),
    (torch.bfloat16, "resnet18_layout"),
    (torch.float16, "lstm"),
    (torch.bfloat16, "mixtral"),
}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _cases() -> list[Any]:
    cases = []
    for (family, name), build in MODELS.items():
        for label, dtype in DTYPES.items():
            marks = [] if (dtype, name) in FAST else [pytest.mark.slow]
            cases.append(pytest.param(family, build, dtype, id=f"{name}-{label}", marks=marks))
    return cases


def tolerance(family: str, dtype: torch.dtype) -> float:
    return TOLERANCE[family][0 if dtype == torch.float16 else 1]


def check_family(
    family: str, model: nn.Module, args: tuple[Any, ...], dtype: torch.dtype, **options: Any
) -> None:
    """Export ``model``, convert it in ``dtype`` (``options``: more converter arguments) and
    check it against float32 eager with the family's tolerance."""
    model = model.eval()
    ep = export_decomposed(model, args)
    converter = TorchConverter(compute_precision=dtype, **options)
    program = converter.add_exported_program(ep).to_coreai().optimize()
    rel, cos = check_half(model, args, program, rel=tolerance(family, dtype), cosine=COSINE)
    print(f"relative error {rel:.2e}  cosine {cos:.6f}")
    record_errors(1.0, rel, tolerance(family, dtype))


@pytest.mark.parametrize("family, build, dtype", _cases())
def test_model_family_in_half_precision(family: str, build: Build, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    check_family(family, *build(), dtype)


def in_gated_delta_rule(node: torch.fx.Node) -> bool:
    """The nodes of Qwen3-Next's chunked gated delta rule, which Hugging Face computes in
    float32 (their stack trace ends at the call in ``Qwen3NextGatedDeltaNet.forward``)."""
    return "self.chunk_gated_delta_rule(" in (node.meta.get("stack_trace") or "")


#: frontier model (tests/models/test_frontier.py) -> (family, converter options)
FRONTIER: dict[str, tuple[str, dict[str, Any]]] = {
    "llava": ("multimodal", {}),
    "bamba": ("hybrid_ssm", {}),
    "jamba": ("hybrid_ssm", {}),
    "qwen3_next": ("linear_attention", {"keep_fp32": in_gated_delta_rule}),
    "deepseek_v2": ("moe_lm", {}),
}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("name", list(FRONTIER))
def test_frontier_model_in_half_precision(
    name: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The frontier models with their documented patches (docs/frontier_models.md)."""
    from tests.models.test_frontier import FRONTIER as BUILDERS

    case = BUILDERS[name]()
    case.patch(monkeypatch)
    family, options = FRONTIER[name]
    check_family(family, case.model, case.args, dtype, **options)


@pytest.mark.parametrize(
    "dtype",
    [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.slow)],
    ids=list(DTYPES),
)
def test_moe_experts_as_gather_matmul_composites(dtype: torch.dtype) -> None:
    """Mixtral with every token gathering its experts, the expert projections externalized as
    ``gather_matmul`` composites: they take the half activations and half expert weights."""
    from coreai_torch import get_decomp_table
    from tests.externalize_support import composites

    model, args = _moe("mixtral", strategy="gather")()
    model = model.eval()
    specs = [s for s in default_specs() if s.target_class is GatherMatmul]
    converter = TorchConverter(compute_precision=dtype).add_pytorch_module(
        model,
        export_fn=lambda m: torch.export.export(m, args).run_decompositions(get_decomp_table()),
        externalize_modules=specs,
    )
    program = converter.to_coreai()
    gathers = composites(program, "gather_matmul")
    half = {torch.float16: "f16", torch.bfloat16: "bf16"}[dtype]
    assert gathers and all(
        re.search(rf"x{half}> {{coreai.name = \"{operand}\"}}", g.text.splitlines()[0])
        for g in gathers
        for operand in ("input", "weight")
    ), [g.text.splitlines()[0] for g in gathers]
    program.optimize()
    tol = tolerance("moe_lm", dtype)
    rel, cos = check_half(model, args, program, rel=tol, cosine=COSINE)
    print(f"relative error {rel:.2e}  cosine {cos:.6f}")
    record_errors(1.0, rel, tol)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("externalize", [None, pytest.param("composites", marks=pytest.mark.slow)])
def test_llm_prefill_and_decode_with_a_half_kv_cache(
    dtype: torch.dtype, externalize: str | None
) -> None:
    """Prefill + 3 decode steps of the KV-cache Llama: the cache states are stored in the
    half type and every step's logits match the float32 model."""
    from tests.models.test_llm_decode import PREFILL, _model, _stage

    model = _model()
    specs = None
    if externalize:
        specs = [s for s in default_specs() if s.composite_op_name != "gather_matmul"]
    converter = _stage(model, specs)
    converter.precision = TorchConverter(compute_precision=dtype).precision
    program = converter.to_coreai().optimize()
    initial = program.signatures["prefill"].initial_states
    assert {v.dtype for v in initial.values()} == {dtype}
    # one set of state buffers for both entry points, updated in place by every call
    states = {name: to_ndarray(value.clone()) for name, value in initial.items()}
    reference = _model()
    tol = tolerance("llm_decode", dtype)
    ids, positions = model.example_inputs(PREFILL)
    with Session(program) as session:
        feeds = [("prefill", ids, positions)]
        for step in range(4):
            name, token, pos = feeds[-1]
            out = session.run({"token_ids": token, "positions": pos}, entrypoint=name, state=states)
            with torch.no_grad():
                expected = reference(token, pos)
            actual = np.asarray(next(iter(out.values())), np.float64)
            err = float(np.abs(actual - expected.double().numpy()).max())
            peak = max(1.0, float(expected.abs().max()))
            record_errors(peak, err, tol * peak)
            assert err <= tol * peak, f"step {step}: error {err / peak:.2e} > {tol:.0e}"
            next_token = expected[:, -1:].argmax(-1)
            feeds.append(("decode", next_token, torch.tensor([PREFILL + step])))


NATIVE: dict[str, Build] = {
    "llama": _decoder("llama"),
    "bert": _bert,
    "resnet18_layout": _resnet18,
    "whisper": _seq2seq("whisper"),
}


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize(
    "name",
    [n if n == "llama" else pytest.param(n, marks=pytest.mark.slow) for n in NATIVE],
)
def test_model_already_in_half_precision(name: str, dtype: torch.dtype) -> None:
    """``model.to(dtype)`` with 16-bit inputs converts as it is (no ``compute_precision``)
    and matches its own eager output within a few units in the last place."""
    torch.manual_seed(0)
    model, args = NATIVE[name]()
    model = model.eval().to(dtype)
    args = tuple(a.to(dtype) if a.is_floating_point() else a for a in args)
    ep = export_decomposed(model, args)
    program = TorchConverter().add_exported_program(ep).to_coreai().optimize()
    expected = eager_outputs(model, args)
    with Session(program) as session:
        actual = run_entrypoint(session, program, args)
    for e, a in zip(expected, actual, strict=True):
        if not (isinstance(e, torch.Tensor) and e.is_floating_point()):
            continue
        assert str(np.asarray(a).dtype) == str(e.dtype).removeprefix("torch."), (a.dtype, e.dtype)
        ref = e.double().numpy()
        err = float(np.abs(np.asarray(a, np.float64) - ref).max())
        peak = max(1.0, float(np.abs(ref).max()))
        assert err <= 8 * torch.finfo(dtype).eps * peak, f"error {err / peak:.2e} of max|ref|"
