"""Shared pieces of the ``coreai_torch.hf`` tests: the step-by-step comparison of a
``generate`` on the runtime with Hugging Face's, and model directories saved here.

Nothing is downloaded: models are built from config classes with random weights and saved
with ``save_pretrained`` into temporary directories; tokenizers are trained here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from coreai_torch.ir import lazy
from coreai_torch.ir.lazy import WeightSource


@contextlib.contextmanager
def recording_binds() -> Iterator[list[torch.nn.Module]]:
    """Record the modules bound to a checkpoint (``WeightSource.bind``) inside the block."""
    bound: list[torch.nn.Module] = []
    bind = WeightSource.bind

    def spy(self: WeightSource, module: torch.nn.Module) -> torch.nn.Module:
        bound.append(module)
        return bind(self, module)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(WeightSource, "bind", spy)
        yield bound


def assert_streamed(bound: list[torch.nn.Module]) -> None:
    """One module was bound to its checkpoint and every parameter of it is lazy (read from
    the checkpoint while the asset is written)."""
    (model,) = bound
    assert all(lazy.is_lazy(p) for p in model.parameters())


#: fp32 logits agree within this many times max(1, max|ref|) at every step.
TOLERANCE = 1e-4


def check_generate(
    ours: Any, reference: Any, inputs: dict[str, Any], new_tokens: int = 16, **kwargs: Any
) -> torch.Tensor:
    """Greedy ``generate`` of ``ours`` equals ``reference.generate`` token for token, and each
    step's logits are within :data:`TOLERANCE`; returns the sequences."""
    args = dict(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        **kwargs,
    )
    with torch.no_grad():
        expected = reference.generate(**inputs, **args)
    actual = ours.generate(**inputs, **args)
    assert actual.sequences.tolist() == expected.sequences.tolist()
    assert len(actual.logits) == len(expected.logits) == new_tokens
    for step, (a, e) in enumerate(zip(actual.logits, expected.logits, strict=True)):
        tol = TOLERANCE * max(1.0, float(e.abs().max()))
        err = float((a - e).abs().max())
        assert err <= tol, f"step {step}: max|err| {err:.3e} > {tol:.3e}"
    return actual.sequences


WORDS = (
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "a",
    "core",
    "ai",
    "program",
    "runs",
    "on",
    "device",
    "language",
    "models",
    "generate",
    "one",
    "token",
    "at",
    "time",
    "cache",
    "keeps",
    "keys",
    "and",
    "values",
    "of",
    "every",
    "layer",
)


def bert_tokenizer(directory: Any) -> Any:
    """A WordPiece tokenizer over :data:`WORDS` (a ``vocab.txt`` written to ``directory``)."""
    from pathlib import Path

    from transformers import BertTokenizerFast

    path = Path(directory) / "vocab.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    return BertTokenizerFast(vocab_file=str(path))
