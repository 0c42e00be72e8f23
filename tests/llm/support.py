"""Shared pieces of the LLM tests: small configs of every architecture ``llm.export``
supports (random weights), a tokenizer trained here, and Hugging Face's greedy reference.

Nothing is downloaded: configs are built in code (``tests.models.common`` makes any attempt to
reach the hub fail), the tokenizer is trained on a few sentences.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from tests.models.common import MODEL_TOLERANCE, redraw_weights
from tests.models.test_decoder_lms import SLOW_MODELS, SMALL, VOCAB
from tests.models.test_moe import EAGER_ATTENTION
from tests.models.test_moe import MODELS as MOE_MODELS

MAX_CONTEXT = 64
NEW_TOKENS = 32

#: name -> (config class, model class, attention implementation, config overrides): the
#: decoder-LM test configs (sliding windows of 8, shorter than the prompts and generations;
#: Gemma 2's soft-capping needs the eager attention) plus SmolLM, a Llama whose head is tied
#: to the token embeddings.
ARCHITECTURES: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", "sdpa", {}),
    **{k: SLOW_MODELS[k] for k in ("mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3")},
    "smollm": ("LlamaConfig", "LlamaForCausalLM", "sdpa", dict(tie_word_embeddings=True)),
    # Gemma 3's text model: a sliding layer and a global one, each with its rotary base
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        "eager",
        dict(
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
}

#: The mixture-of-experts architectures, the configs of the MoE model tests (4 experts, top 2;
#: DeepSeek-V3 with multi-head latent attention and a dense first layer; GPT-OSS with
#: attention sinks, which need the eager attention).
MOE_ARCHITECTURES: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    name: (config, model, "eager" if name in EAGER_ATTENTION else "sdpa", overrides)
    for name, (config, model, overrides) in MOE_MODELS.items()
    if name != "deepseek_v2"  # its attention uses complex tensors (docs/frontier_models.md)
}

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a core ai program runs on the device",
    "language models generate one token at a time",
    "the cache keeps the keys and values of every layer",
]

#: Prompts of three lengths (in tokens of :func:`tiny_tokenizer`).
PROMPTS = [
    "the",
    "the quick brown fox",
    "language models generate one token at a time and the cache keeps the keys",
]


def causal_lm(name: str, seed: int = 0, **overrides: Any) -> nn.Module:
    """A small random-weight model of architecture ``name`` (its generation config has no
    end-of-sequence token, so greedy generation always runs ``max_new_tokens`` steps)."""
    import transformers

    config_name, model_name, attn, extra = {**ARCHITECTURES, **MOE_ARCHITECTURES}[name]
    # the end-of-sequence token is the tokenizer's (</s>; some configs default to ids beyond
    # the vocabulary, which a bundle refuses)
    config = getattr(transformers, config_name)(
        **{**SMALL, "use_cache": True, "bos_token_id": 1, "eos_token_id": 2, **extra, **overrides}
    )
    config._attn_implementation = attn
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    # A head tied to the token embeddings gets small embeddings, so logits stay O(1).
    redraw_weights(model, embedding_std=0.15 if config.tie_word_embeddings else 1.0)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def tiny_tokenizer() -> Any:
    """A BPE tokenizer trained on :data:`CORPUS` with ``tokenizers`` (vocabulary < VOCAB), as
    a ``transformers`` tokenizer (it saves with ``save_pretrained``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=100, special_tokens=["<unk>", "<s>", "</s>"])
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    assert tokenizer.get_vocab_size() <= VOCAB
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


@dataclass
class Reference:
    """Hugging Face's greedy generation: the new tokens and each step's logits."""

    tokens: list[int]
    logits: list[torch.Tensor] = field(default_factory=list)


def reference(
    model: nn.Module, ids: list[int], new_tokens: int = NEW_TOKENS, eos_token_id: int | None = None
) -> Reference:
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            eos_token_id=eos_token_id,
        )
    return Reference(out.sequences[0, len(ids) :].tolist(), [s[0] for s in out.logits])


#: the logits are float16 (the app's convention): their rounding, relative to the largest
HALF_LOGITS = 2.0**-10


def check_steps(
    tokens: list[int],
    steps: list[np.ndarray],
    expected: Reference,
    ids: list[int],
    tolerance: float = MODEL_TOLERANCE,
) -> None:
    """``tokens`` (and each step's logits ``steps``) equal the reference's token for token,
    every step's logits within ``tolerance * max(1, max|ref|)`` of eager PyTorch's plus the
    float16 logits' rounding.

    The tokens may part only where the reference's two best logits are closer than the
    comparison can tell apart: within the float16 logits' rounding, or (a half-precision or
    compressed program against the eager model in the same precision with the same weights)
    within the tolerance.  The comparison stops there, after checking it is such a near tie."""
    assert len(tokens) == len(expected.tokens) and len(steps) == len(tokens), (
        tokens,
        expected.tokens,
    )
    for step, (actual, ref) in enumerate(zip(steps, expected.logits, strict=True)):
        ref = ref.float()
        largest = max(1.0, float(ref.abs().max()))
        tol = tolerance * largest + HALF_LOGITS * largest
        err = float(np.abs(actual.astype(np.float32) - ref.numpy()).max())
        assert err <= tol, f"prompt {ids}, step {step}: max|err| {err:.3e} > {tol:.3e}"
        if tokens[step] != expected.tokens[step]:
            margin = float(ref[expected.tokens[step]] - ref[tokens[step]])
            tie = HALF_LOGITS * largest if tolerance <= MODEL_TOLERANCE else 2 * tol
            assert margin <= tie, (
                f"prompt {ids}: {tokens} != {expected.tokens} (step {step}: logit margin "
                f"{margin:.3e}, tolerance {tie:.3e})"
            )
            return


def check_generation(
    generator: Any,
    model: nn.Module,
    ids: list[int],
    new_tokens: int = NEW_TOKENS,
    tolerance: float = MODEL_TOLERANCE,
) -> None:
    """Greedy generation with a :class:`~coreai_torch.llm.Generator` equals Hugging Face's
    (:func:`check_steps`)."""
    expected = reference(model, ids, new_tokens)
    steps: list[np.ndarray] = []
    tokens = list(generator.generate(ids, new_tokens, eos_token_id=[], on_logits=steps.append))
    check_steps(tokens, steps, expected, ids, tolerance)


def check_engine(
    engine: Any,
    model: nn.Module,
    ids: list[int],
    new_tokens: int = NEW_TOKENS,
    tolerance: float = MODEL_TOLERANCE,
) -> list[int]:
    """Greedy generation by an engine of the reference driver (as the app runs the bundle;
    opened with ``stop_token_ids=[]``) equals Hugging Face's (:func:`check_steps`); returns
    the tokens."""
    expected = reference(model, ids, new_tokens)
    steps: list[np.ndarray] = []
    tokens = engine.generate(ids, new_tokens, on_logits=steps.append)
    check_steps(tokens, steps, expected, ids, tolerance)
    return tokens


def export_bundle(
    model: nn.Module, root: Path, name: str = "bundle", **options: Any
) -> tuple[Path, Any]:
    """``llm.export(model, bundle=root / name, tokenizer=...)`` with :func:`tiny_tokenizer`
    (``options`` passed on; ``max_context`` :data:`MAX_CONTEXT` by default): ``(bundle
    directory, program)``."""
    from coreai_torch import llm

    tokenizer_dir = root / "tokenizer_source"
    if not tokenizer_dir.is_dir():
        tiny_tokenizer().save_pretrained(tokenizer_dir)
    options = {"max_context": MAX_CONTEXT, **options}
    program = llm.export(model, bundle=root / name, tokenizer=tokenizer_dir, **options)
    return root / name, program


def save_model_dir(root: Path, **overrides: Any) -> tuple[nn.Module, Any, Path]:
    """A Llama (``overrides`` on its config) and :func:`tiny_tokenizer` saved with
    ``save_pretrained`` in ``root / "model"``: ``(model, tokenizer, directory)``."""
    model, tokenizer = causal_lm("llama", **overrides), tiny_tokenizer()
    model_dir = root / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return model, tokenizer, model_dir


def asset_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
