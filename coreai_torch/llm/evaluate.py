"""What compression cost a language model: perplexity on a text, on the Core AI runtime,
next to the PyTorch model's.

    from coreai_torch.llm import evaluate
    result = evaluate.perplexity("smollm2-int4/", "held-out.txt", reference="SmolLM2-135M/")
    print(result)   # perplexity 26.31 on the Core AI runtime, 25.43 in PyTorch (+3.5 %), ...

The text is tokenized with the model's tokenizer and cut into windows of ``window`` tokens
(default 512, at most the model's ``max_context``); each window is predicted from its own
start (its first token is not scored), the same windows for both models.  The Core AI model
runs its ``forward`` entry point (every position's logits) once per window.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

#: tokens per window when none is given
DEFAULT_WINDOW = 512


@dataclass
class Perplexity:
    """Perplexity of the Core AI model (and of the PyTorch reference) on the same tokens."""

    coreai: float
    #: the PyTorch model's (None: no reference given)
    reference: float | None
    #: tokens scored
    tokens: int
    window: int

    @property
    def relative(self) -> float | None:
        """``coreai / reference - 1`` (None without a reference)."""
        return None if self.reference is None else self.coreai / self.reference - 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "perplexity": self.coreai,
            "reference_perplexity": self.reference,
            "relative": self.relative,
            "tokens": self.tokens,
            "window": self.window,
        }

    def __str__(self) -> str:
        text = f"perplexity {self.coreai:.3f} on the Core AI runtime"
        if self.reference is not None:
            text += f", {self.reference:.3f} in PyTorch ({self.relative:+.1%})"
        return text + f" over {self.tokens} tokens (windows of {self.window})"


def read_text(text: str | os.PathLike[str]) -> str:
    """The text of a file (``Path`` or an existing path), or the string itself."""
    if isinstance(text, os.PathLike) or (isinstance(text, str) and Path(text).is_file()):
        path = Path(text)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such text file")
        return path.read_text(encoding="utf-8")
    if not isinstance(text, str):
        raise TypeError(f"perplexity() takes a text or a text file, got {type(text).__name__}")
    return text


def windows(ids: list[int], window: int) -> list[list[int]]:
    """The token ids cut into windows of ``window`` (the last may be shorter; at least 2)."""
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    pieces = [ids[i : i + window] for i in range(0, len(ids), window)]
    pieces = [p for p in pieces if len(p) >= 2]
    if not pieces:
        raise ValueError(f"the text holds {len(ids)} token(s); perplexity needs at least 2")
    return pieces


def _negative_log_likelihood(logits: np.ndarray, ids: list[int]) -> float:
    """Σ -log p(ids[t+1] | ids[..t]) for the logits ``[T, vocab]`` of ``ids``."""
    values = torch.from_numpy(np.asarray(logits, dtype=np.float32))
    target = torch.tensor(ids[1:])
    return float(torch.nn.functional.cross_entropy(values[:-1], target, reduction="sum"))


def _load_coreai(model: Any) -> Any:
    from coreai_torch.hf.causal_lm import CoreAIModelForCausalLM

    if isinstance(model, CoreAIModelForCausalLM):
        return model
    if isinstance(model, (str, os.PathLike)):
        return CoreAIModelForCausalLM.from_pretrained(model)
    raise TypeError(
        "perplexity() takes a CoreAIModelForCausalLM or the directory it was saved to, got "
        f"{type(model).__name__}"
    )


def _load_reference(reference: Any) -> nn.Module:
    if isinstance(reference, nn.Module):
        return reference.eval()
    from coreai_torch.llm.export import load_causal_lm

    path = Path(reference)
    from transformers import AutoModelForCausalLM

    if not (path / "config.json").is_file():
        load_causal_lm(path)  # the same error as llm.export
    model: nn.Module = AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, dtype=torch.float32
    ).eval()
    return model


def tokenizer_for(model: Any, tokenizer: Any = None) -> Any:
    """The tokenizer given, or the one saved with the model (a bundle's ``tokenizer/``, else
    the files beside it)."""
    if tokenizer is not None:
        return tokenizer
    source = getattr(model, "_source_dir", None)
    if source is None:
        raise ValueError(
            "this model has no tokenizer beside it: pass tokenizer= (or the model's directory)"
        )
    from transformers import AutoTokenizer

    from coreai_torch.bundles import is_bundle_dir

    directory = Path(source) / "tokenizer" if is_bundle_dir(source) else source
    return AutoTokenizer.from_pretrained(directory, local_files_only=True)


def perplexity(
    model: Any,
    text: str | os.PathLike[str],
    *,
    reference: nn.Module | str | os.PathLike[str] | None = None,
    tokenizer: Any = None,
    window: int | None = None,
    max_tokens: int | None = None,
) -> Perplexity:
    """Perplexity of a Core AI causal LM (a ``CoreAIModelForCausalLM`` or the directory
    its ``save_pretrained`` wrote) on ``text`` (a string or a text file), and of the PyTorch
    ``reference`` (a causal LM or its Hugging Face directory) on the same windows."""
    coreai = _load_coreai(model)
    tok = tokenizer_for(coreai, tokenizer)
    ids = list(tok(read_text(text), add_special_tokens=False).input_ids)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    limit = coreai.max_context or DEFAULT_WINDOW
    size = min(window or DEFAULT_WINDOW, limit)
    pieces = windows(ids, size)
    scored = sum(len(p) - 1 for p in pieces)
    nll = 0.0
    for piece in pieces:
        out = coreai(input_ids=torch.tensor([piece]), use_cache=False)
        nll += _negative_log_likelihood(out.logits[0].numpy(), piece)
    reference_value = None
    if reference is not None:
        torch_model = _load_reference(reference)
        total = 0.0
        with torch.no_grad():
            for piece in pieces:
                logits = torch_model(torch.tensor([piece])).logits[0].float()
                total += _negative_log_likelihood(logits.numpy(), piece)
        reference_value = math.exp(total / scored)
    return Perplexity(math.exp(nll / scored), reference_value, scored, size)


# ------------------------------------------------------------------------ embedding models ---


@dataclass
class Cosine:
    """Cosine similarity between the Core AI model's sentence embeddings and the PyTorch
    model's, per text."""

    values: list[float]

    @property
    def mean(self) -> float:
        return float(np.mean(self.values))

    @property
    def minimum(self) -> float:
        return float(np.min(self.values))

    def to_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "min": self.minimum, "texts": len(self.values)}

    def __str__(self) -> str:
        return (
            f"cosine to the PyTorch model's embeddings: mean {self.mean:.4f}, min "
            f"{self.minimum:.4f} over {len(self.values)} text(s)"
        )


def texts_of(text: str | os.PathLike[str] | list[str]) -> list[str]:
    """A list of texts as it is, or the non-empty lines of a text (or text file)."""
    if isinstance(text, list):
        return text
    lines = [line.strip() for line in read_text(text).splitlines() if line.strip()]
    if not lines:
        raise ValueError("no text to embed")
    return lines


def cosine(
    model: Any,
    text: str | os.PathLike[str] | list[str],
    *,
    reference: nn.Module | str | os.PathLike[str],
    tokenizer: Any = None,
    pooling: str = "mean",
    batch_size: int = 8,
) -> Cosine:
    """Cosine similarity between the sentence embeddings (``pooling`` of the last hidden
    state) of a Core AI feature-extraction model (a ``CoreAIModelForFeatureExtraction`` or the
    directory it was saved to) and of the PyTorch ``reference`` (a model or its Hugging Face
    directory), for each text (a list, or the lines of a text or text file)."""
    from transformers import AutoModel

    from coreai_torch.hf.feature_extraction import CoreAIModelForFeatureExtraction, pool

    coreai = (
        model
        if isinstance(model, CoreAIModelForFeatureExtraction)
        else CoreAIModelForFeatureExtraction.from_pretrained(model)
    )
    tok = tokenizer_for(coreai, tokenizer)
    torch_model = (
        reference.eval()
        if isinstance(reference, nn.Module)
        else AutoModel.from_pretrained(reference, local_files_only=True, dtype=torch.float32)
    )
    limit = int(coreai.coreai_config.get("max_length") or 512)
    values: list[float] = []
    items = texts_of(text)
    for start in range(0, len(items), batch_size):
        batch = tok(
            items[start : start + batch_size],
            padding=True,
            truncation=True,
            max_length=limit,
            return_tensors="pt",
        )
        mask = batch["attention_mask"]
        ours = pool(coreai(**batch).last_hidden_state.float(), mask, pooling)
        with torch.no_grad():
            theirs = pool(torch_model(**batch).last_hidden_state.float(), mask, pooling)
        values += torch.nn.functional.cosine_similarity(ours, theirs).tolist()
    return Cosine(values)
