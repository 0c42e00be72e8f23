"""Calibration data for the compression of a causal LM: a text file read with the model's
tokenizer, or token ids, cut into sequences of :data:`SEQUENCE_LENGTH` tokens and checked
against the vocabulary; and the calibrated fit of the model
(:func:`coreai_torch.compression.calibrate`, block by block over the decoder layers, on a
model streamed from its checkpoint too).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from coreai_torch.compression import (
    Calibration,
    CalibrationError,
    CompressionConfig,
    LinearQuantization,
    Palettization,
    calibrate,
)
from coreai_torch.compression.calibration import measure

if TYPE_CHECKING:
    from transformers import PreTrainedModel

#: tokens per calibration sequence
SEQUENCE_LENGTH = 256
#: sequences used at most (32 x 256 tokens)
MAX_SEQUENCES = 32

Calibrationdata = str | os.PathLike[str] | Sequence[Sequence[int]] | torch.Tensor


def calibration_tokens(
    calibration: Calibrationdata,
    vocab_size: int,
    *,
    tokenizer_dir: Path | None = None,
    length: int = SEQUENCE_LENGTH,
    max_sequences: int = MAX_SEQUENCES,
) -> torch.Tensor:
    """The calibration sequences ``[samples, length]`` (int64): a text file tokenized with the
    tokenizer saved in ``tokenizer_dir`` (the model directory), or token-id sequences (cut
    into pieces of ``length``; a tensor ``[samples, tokens]`` is taken as it is)."""
    if isinstance(calibration, (str, os.PathLike)):
        path = Path(calibration)
        if not path.is_file():
            raise FileNotFoundError(f"calibration={str(calibration)!r}: no such text file")
        if tokenizer_dir is None or not any(
            (tokenizer_dir / name).is_file()
            for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
        ):
            raise CalibrationError(
                f"calibration={str(path)!r} is text, but there is no tokenizer to read it "
                "with (export from the model's directory, which holds its tokenizer, or pass "
                "token ids: a list of lists of ints)"
            )
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
        ids = tokenizer(path.read_text(encoding="utf-8"), add_special_tokens=False).input_ids
        if len(ids) < length:
            raise CalibrationError(
                f"calibration text {str(path)!r} holds {len(ids)} tokens; give at least "
                f"{length} (a few thousand calibrate better)"
            )
        calibration = [ids]
    if isinstance(calibration, torch.Tensor):
        from coreai_torch.compression.calibration import token_batches

        return token_batches(calibration, vocab_size, length=None)[:max_sequences]
    if not isinstance(calibration, Sequence) or isinstance(calibration, (bytes, str)):
        raise TypeError(
            "calibration= takes the path of a text file or token ids (a list of lists of "
            f"ints, or a [samples, tokens] tensor), got {type(calibration).__name__}"
        )
    if calibration and all(isinstance(t, int) for t in calibration):
        calibration = [calibration]  # type: ignore[list-item]
    from coreai_torch.compression.calibration import token_batches

    longest = max((len(s) for s in calibration), default=0)
    size = min(length, longest) if longest else length
    return token_batches(calibration, vocab_size, length=size)[:max_sequences]


def vocab_size(model: PreTrainedModel) -> int:
    """The number of token ids the model's embedding table has."""
    embeddings = model.get_input_embeddings()
    return int(embeddings.weight.shape[0])


#: tokens per model call while calibrating: the sequences run a few at a time, so a block's
#: activations stay small (one call of 32 × 256 tokens through a 1B block's MLP holds 0.27 GB
#: per float32 intermediate, its attention scores 0.27 GB per head-sized tensor)
CALL_TOKENS = 2048


def calibrated(
    model: nn.Module, tokens: torch.Tensor, config: CompressionConfig, dtype: torch.dtype
) -> Calibration:
    """``config`` fitted on the model's activations for ``tokens`` (``[sequences, length]``,
    run :data:`CALL_TOKENS` tokens at a time), scales and palettes rounded to ``dtype`` (the
    program's weight type)."""
    step = max(1, CALL_TOKENS // tokens.shape[1])
    calls = [
        {"input_ids": tokens[first : first + step], "use_cache": False}
        for first in range(0, tokens.shape[0], step)
    ]
    return calibrate(model, calls, config, scale_dtype=dtype)


#: a data-free compression of a model with more parameters than this is not measured (its
#: measurement reads and rounds every weight once more: on 2 cores about 30 s for 1 B
#: parameters); the report says so
MEASURE_MAX_PARAMETERS = 4_000_000_000
#: the example sequences a compression without calibration data is measured on: at most
#: ``EXAMPLE_SEQUENCES`` of ``EXAMPLE_TOKENS`` tokens of :data:`EXAMPLE_TEXT` (read with the
#: model's tokenizer) or, without a tokenizer, of token ids drawn with a fixed seed
EXAMPLE_SEQUENCES = 2
EXAMPLE_TOKENS = 64
#: plain English prose to measure a data-free compression on (random token ids are far
#: easier on a compressed model than text: on SmolLM2-135M the data-free `int4` preset changes the
#: logits of random ids by 2 %, of text by 29 %)
EXAMPLE_TEXT = (
    "The library opens at nine in the morning and closes at six in the evening. On weekdays "
    "most visitors come to read the newspapers, borrow a few books or use the computers near "
    "the window. Children arrive after school, and the reading room fills with the sound of "
    "pages turning. In winter the old building is warm and quiet, and people stay longer than "
    "they planned. The librarian has worked there for twenty years; she knows which shelves "
    "hold the history books, which novels are never returned on time, and which students will "
    "ask for help with their homework. Last spring the town voted to repair the roof and to "
    "add a small garden behind the building, where readers can sit when the weather is good. "
    "Nobody expected that the garden would become the most popular place in the neighborhood, "
    "but by the end of the summer there were concerts on Friday evenings and a market on "
    "Saturday mornings."
)


def example_tokens(
    vocab: int, max_context: int, tokenizer_dir: Path | None = None
) -> tuple[torch.Tensor, str]:
    """Token ids ``[sequences, tokens]`` to measure a data-free compression on, and what they
    are: pieces of :data:`EXAMPLE_TEXT` read with the tokenizer saved in ``tokenizer_dir``
    when there is one, else ids drawn uniformly from the vocabulary with a fixed seed."""
    length = max(1, min(EXAMPLE_TOKENS, max_context))
    ids: list[int] = []
    if tokenizer_dir is not None and any(
        (tokenizer_dir / name).is_file()
        for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
        ids = list(tokenizer(EXAMPLE_TEXT, add_special_tokens=False).input_ids)
    pieces = [ids[i : i + length] for i in range(0, len(ids) - length + 1, length)]
    pieces = pieces[:EXAMPLE_SEQUENCES]
    if pieces and all(0 <= t < vocab for piece in pieces for t in piece):
        return torch.tensor(pieces, dtype=torch.int64), "English text"
    generator = torch.Generator().manual_seed(0)
    ids_drawn = torch.randint(0, vocab, (EXAMPLE_SEQUENCES, length), generator=generator)
    return ids_drawn, "random token ids"


def measured(
    model: nn.Module,
    config: CompressionConfig,
    dtype: torch.dtype,
    max_context: int,
    tokenizer_dir: Path | None = None,
) -> Calibration | None:
    """The whole model's output error under the data-free codes of ``config`` (what
    ``compress()`` fits without data), measured on :func:`example_tokens` so that a
    compression that destroys the model says so; no codes are kept (``compress()`` fits its
    own).  None for the forms without data-free codes to measure (pruning)."""
    if not isinstance(config, (LinearQuantization, Palettization)):
        return None
    parameters = sum(p.numel() for p in model.parameters())
    if parameters > MEASURE_MAX_PARAMETERS:
        return Calibration(
            config.describe(),
            not_measured=(
                f"{parameters / 1e9:.1f} B parameters, more than the "
                f"{MEASURE_MAX_PARAMETERS / 1e9:g} B a data-free export measures (the "
                "measurement costs about what compressing costs); pass calibration= (a text "
                "file or token ids), or measure the exported model with coreai-torch eval "
                "perplexity"
            ),
        )
    tokens, source = example_tokens(vocab_size(model), max_context, tokenizer_dir)
    try:
        fitted = measure(
            model, {"input_ids": tokens, "use_cache": False}, config, scale_dtype=dtype
        )
    except Exception as error:  # the measurement is advisory: the export goes on without it
        warnings.warn(
            f"compress({config.describe()}): the compressed model's output error could not be "
            f"measured on example inputs ({type(error).__name__}: {error}); measure its "
            "quality before shipping it (coreai-torch eval perplexity)",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    fitted.measured_on = f"{tokens.shape[0]} example inputs of {source} (no calibration)"
    return fitted


def describe(calibration: Any) -> str | None:
    """What ``calibration=`` was, for ``coreai_config.json``."""
    if calibration is None:
        return None
    if isinstance(calibration, (str, os.PathLike)):
        return Path(calibration).name
    return "token ids"
