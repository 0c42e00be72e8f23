"""``coreai-torch eval``: what compression cost a model.

    coreai-torch eval perplexity MODEL_DIR --text held-out.txt [--reference HF_DIR]
    coreai-torch eval cosine MODEL_DIR --text sentences.txt --reference HF_DIR

``MODEL_DIR`` is a Core AI model directory (``CoreAIModelForCausalLM.save_pretrained``, or
``coreai-torch export --task text-generation``); the perplexity is computed on the Core AI
runtime and, with ``--reference`` (the Hugging Face model directory it was exported from), in
PyTorch on the same windows (:func:`coreai_torch.llm.evaluate.perplexity`).  ``cosine``
compares the sentence embeddings of a feature-extraction model with the PyTorch model's
(:func:`coreai_torch.llm.evaluate.cosine`).
"""

from __future__ import annotations

import argparse
from typing import Any

from coreai_torch.cli.options import EXIT_OK, CliError, emit


def cmd_perplexity(opts: argparse.Namespace) -> int:
    from coreai_torch.llm.evaluate import perplexity

    if opts.window is not None and opts.window < 2:
        raise CliError(f"--window must be at least 2 tokens, got {opts.window}")
    result = perplexity(
        opts.model,
        opts.text_file,
        reference=opts.reference,
        window=opts.window,
        max_tokens=opts.max_tokens,
    )
    emit(opts, result.to_dict(), str(result))
    return EXIT_OK


def cmd_cosine(opts: argparse.Namespace) -> int:
    from coreai_torch.llm.evaluate import cosine

    result = cosine(opts.model, opts.text_file, reference=opts.reference, pooling=opts.pooling)
    emit(opts, result.to_dict(), str(result))
    return EXIT_OK


def add_command(commands: Any, common: argparse.ArgumentParser) -> None:
    """The ``eval`` command and its sub-commands, on the top-level sub-parsers."""
    evaluate = commands.add_parser(
        "eval", parents=[common], help="measure an exported model's quality (perplexity)"
    )
    sub = evaluate.add_subparsers(dest="eval_command", required=True, metavar="COMMAND")
    ppl = sub.add_parser(
        "perplexity",
        parents=[common],
        help="perplexity of a Core AI causal LM on a text, next to the PyTorch model's",
    )
    ppl.add_argument("model", metavar="MODEL_DIR", help="a Core AI model directory")
    ppl.add_argument("--text", dest="text_file", required=True, metavar="FILE", help="the text")
    ppl.add_argument(
        "--reference", metavar="HF_DIR", help="the Hugging Face model directory to compare with"
    )
    ppl.add_argument("--window", type=int, help="tokens per window (default 512)")
    ppl.add_argument("--max-tokens", type=int, help="score at most this many tokens")
    ppl.set_defaults(func=cmd_perplexity)
    cos = sub.add_parser(
        "cosine",
        parents=[common],
        help="cosine of a Core AI embedding model's sentence embeddings to the PyTorch model's",
    )
    cos.add_argument("model", metavar="MODEL_DIR", help="a Core AI feature-extraction directory")
    cos.add_argument(
        "--text", dest="text_file", required=True, metavar="FILE", help="one text per line"
    )
    cos.add_argument("--reference", required=True, metavar="HF_DIR", help="the original model")
    cos.add_argument("--pooling", default="mean", choices=("mean", "cls", "last"))
    cos.set_defaults(func=cmd_cosine)
