"""``coreai-torch llm export|generate``: export a Hugging Face causal LM to the bundle Apple's
app runtimes load, generate text with it.

    coreai-torch llm export MODEL_DIR -o out/MyModel [--max-context N] [--precision fp16] \\
        [--compress int4 [--block-size N]] [--engine static [--contexts 256,512] \\
        [--query-lengths 8,16,64]]
    coreai-torch llm generate out/MyModel --prompt "..." [--max-new-tokens N] \\
        [--chat [--system "..."]]
    coreai-torch llm generate out/MyModel --interactive               # a conversation
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from coreai_torch.bundles import Bundle, function_signatures
from coreai_torch.cli.options import (
    EXIT_OK,
    CliError,
    add_calibration_arguments,
    add_compression_arguments,
    add_hash_option,
    add_precision_arguments,
    add_progress_option,
    compression_config,
    emit,
    progress_reporting,
    requested_precision,
)
from coreai_torch.llm.export import export
from coreai_torch.llm.generate import Generator, decode
from coreai_torch.llm.text import TextStream, chat_ids, eos_ids


def cmd_export(opts: argparse.Namespace) -> int:
    output = Path(opts.output)
    if output.suffix in (".aimodel", ".aimodelc"):
        raise CliError(
            f"-o names the bundle directory the app loads (e.g. out/MyModel), which holds the "
            f".aimodel, metadata.json and tokenizer/; got {output}"
        )
    precision, compression = requested_precision(opts), compression_config(opts)
    start = time.perf_counter()
    with progress_reporting(opts):
        program = export(
            opts.model_dir,
            max_context=opts.max_context,
            precision=precision,
            compress=compression,
            calibration=opts.calibration,
            engine=opts.engine,
            contexts=_sizes(opts.contexts, "--contexts"),
            query_lengths=_sizes(opts.query_lengths, "--query-lengths"),
            bundle=output,
            tokenizer=opts.tokenizer,
            name=opts.name,
            overwrite=opts.overwrite,
        )
    bundle = Bundle.load(output, check_assets=False)
    asset = bundle.asset_path("main")
    size = sum(f.stat().st_size for f in asset.rglob("*") if f.is_file())
    states = sorted({s.name for f in function_signatures(program).values() for s in f.states})
    data: dict[str, Any] = {
        "model": str(opts.model_dir),
        "bundle": str(output),
        "asset": str(asset),
        "asset_bytes": size,
        "max_context": bundle.language.max_context_length,
        "engine": opts.engine,
        "functions": program.function_names,
        "states": states,
        "precision": program.precision.name,
        "compression": compression.describe() if compression is not None else None,
        "stop_token_ids": sorted(bundle.tokenizer.stop_token_ids),
        "seconds": {"total": round(time.perf_counter() - start, 3)},
    }
    form = ", ".join([program.precision.name, *([data["compression"]] if compression else [])])
    functions = data["functions"]
    shown = ", ".join(functions[:6]) + (f", ... ({len(functions)})" if len(functions) > 6 else "")
    text = (
        f"{opts.model_dir} -> {output} ({size / 2**20:.1f} MiB, {form}): {opts.engine} engine, "
        f"functions {shown}, states {', '.join(states)}, context {data['max_context']}; "
        f"written in {data['seconds']['total']:.1f} s"
    )
    emit(opts, data, text)
    return EXIT_OK


def _sizes(text: str | None, option: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise CliError(f"{option} takes integers separated by commas, got {text!r}") from None


def cmd_generate(opts: argparse.Namespace) -> int:
    if opts.interactive:
        return _chat_session(opts)
    if opts.prompt is None:
        raise CliError("--prompt is needed (or --interactive for a conversation)")
    prompt: Any = [int(t) for t in opts.prompt.split(",")] if _is_ids(opts.prompt) else opts.prompt
    with _generator(opts) as generator:
        if opts.chat and generator.tokenizer is None:
            raise CliError(
                "--chat formats the prompt with the tokenizer's chat template: pass "
                "--tokenizer MODEL_DIR (a bundle embeds its own)"
            )
        if generator.tokenizer is None and not _is_ids(opts.prompt):
            raise CliError(
                "--prompt is text: pass --tokenizer MODEL_DIR (or give token ids: 1,2,3)"
            )
        if opts.chat:
            prompt = _chat_ids(generator.tokenizer, _messages(opts.system, [("user", opts.prompt)]))
        stream = sys.stdout if not opts.json else None
        tokens = _generate(generator, prompt, opts, stream)
        stats = generator.stats
        text = _text(generator.tokenizer, tokens)
    if stream is not None:
        stream.write("\n")
    data = {
        "tokens": tokens,
        "text": text,
        "prompt_tokens": stats.prompt_tokens,
        "prefill_tokens_per_second": round(stats.prefill_tokens_per_second, 2),
        "decode_tokens_per_second": round(stats.decode_tokens_per_second, 2),
    }
    emit(opts, data, str(stats))
    return EXIT_OK


def _generator(opts: argparse.Namespace) -> Generator:
    """The generator of ``opts.model`` (a bundle directory, or an asset)."""
    return Generator(
        opts.model,
        tokenizer=opts.tokenizer,
        max_context=opts.max_context,
        verify_hash=opts.verify_hash,
    )


def _generate(generator: Generator, prompt: Any, opts: argparse.Namespace, stream: Any) -> list:
    """Generate for ``prompt`` as the options say, writing the text to ``stream`` as it comes
    (the end-of-sequence token not shown); the token ids."""
    tokens: list[int] = []
    text = TextStream(generator.tokenizer, eos_ids(generator.tokenizer))
    for token in generator.generate(
        prompt,
        max_new_tokens=opts.max_new_tokens,
        do_sample=opts.do_sample,
        temperature=opts.temperature,
        top_k=opts.top_k,
        top_p=opts.top_p,
        seed=opts.seed,
    ):
        tokens.append(token)
        if stream is not None:
            stream.write(text.push(token))
            stream.flush()
    if stream is not None:
        stream.write(text.finish())
    return tokens


def _text(tokenizer: Any, tokens: list[int]) -> str | None:
    if tokenizer is None:
        return None
    stop = eos_ids(tokenizer)
    return decode(tokenizer, [t for t in tokens if t not in stop])


def _chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    try:
        return chat_ids(tokenizer, messages)
    except ValueError as error:
        raise CliError(f"{error}; drop --chat and give the prompt as text") from None


def _messages(system: str | None, turns: list[tuple[str, str]]) -> list[dict[str, str]]:
    head = [{"role": "system", "content": system}] if system else []
    return head + [{"role": role, "content": content} for role, content in turns]


def _chat_session(opts: argparse.Namespace) -> int:
    """``--interactive``: a conversation on the terminal (one line per message; an empty line,
    ``/exit`` or end of input ends it).  The whole conversation is the prompt of each reply;
    the oldest turns are dropped when it no longer fits the context."""
    with _generator(opts) as generator:
        if generator.tokenizer is None:
            raise CliError(
                "--interactive needs a tokenizer with a chat template: a bundle's own, or "
                "--tokenizer MODEL_DIR"
            )
        turns: list[tuple[str, str]] = []
        pending = opts.prompt
        while True:
            if pending is None:
                if sys.stdin.isatty():
                    print("> ", end="", file=sys.stderr, flush=True)
                line = sys.stdin.readline()
                if not line or line.strip() in ("", "/exit"):
                    break
                pending = line.rstrip("\n")
            turns.append(("user", pending))
            pending = None
            prompt = _chat_ids(generator.tokenizer, _messages(opts.system, turns))
            context = generator.max_context or sys.maxsize
            while len(prompt) + opts.max_new_tokens - 1 > context and len(turns) > 1:
                turns = turns[2:] if len(turns) > 2 else turns[-1:]
                print(
                    "coreai-torch: the conversation outgrew the context; dropped the oldest turn",
                    file=sys.stderr,
                )
                prompt = _chat_ids(generator.tokenizer, _messages(opts.system, turns))
            tokens = _generate(generator, prompt, opts, sys.stdout)
            sys.stdout.write("\n")
            sys.stdout.flush()
            turns.append(("assistant", _text(generator.tokenizer, tokens) or ""))
    return EXIT_OK


def _is_ids(prompt: str) -> bool:
    return all(part.strip().isdigit() for part in prompt.split(","))


def add_commands(commands: Any, common: argparse.ArgumentParser) -> None:
    """The ``llm`` command and its sub-commands, on the top-level sub-parsers."""

    llm = commands.add_parser(
        "llm", parents=[common], help="export a Hugging Face causal LM, generate text with it"
    )
    sub = llm.add_subparsers(dest="llm_command", required=True, metavar="COMMAND")

    export = sub.add_parser(
        "export",
        parents=[common],
        help="a model directory (save_pretrained) -> the bundle Apple's app runtimes load",
    )
    export.add_argument("model_dir", metavar="MODEL_DIR", help="written by save_pretrained")
    export.add_argument(
        "-o", "--output", required=True, metavar="BUNDLE_DIR", help="the bundle directory to write"
    )
    export.add_argument(
        "--max-context",
        type=int,
        help="the most positions a generation holds (default: the model's "
        "max_position_embeddings, at most 2048)",
    )
    add_precision_arguments(export)
    add_compression_arguments(export)
    add_calibration_arguments(export)
    export.add_argument(
        "--engine",
        choices=["dynamic", "static"],
        default="dynamic",
        help="dynamic: the function main of the macOS engines (default); static: the "
        "static-shape functions of the iOS / Neural Engine engine",
    )
    export.add_argument("--contexts", help="--engine static: cache lengths, e.g. 256,512,1024")
    export.add_argument("--query-lengths", help="--engine static: query lengths, e.g. 8,16,64")
    export.add_argument("--tokenizer", metavar="DIR", help="the tokenizer (default: MODEL_DIR's)")
    export.add_argument("--name", help="the bundle's name (default: the directory's)")
    export.add_argument("--overwrite", action="store_true", help="replace an existing bundle")
    add_progress_option(export, "loading, tracing, converting, compressing and saving")
    export.set_defaults(func=cmd_export)

    generate = sub.add_parser(
        "generate", parents=[common], help="generate tokens with an exported bundle"
    )
    generate.add_argument("model", metavar="BUNDLE_DIR", help="a bundle (or an .aimodel)")
    generate.add_argument(
        "--tokenizer", metavar="MODEL_DIR", help="the tokenizer (default: the bundle's own)"
    )
    generate.add_argument(
        "--max-context", type=int, help="an .aimodel's context (a bundle records its own)"
    )
    generate.add_argument("--prompt", help="text (with --tokenizer) or token ids: 1,2,3")
    generate.add_argument(
        "--chat",
        action="store_true",
        help="the prompt is a user message, formatted with the tokenizer's chat template",
    )
    generate.add_argument(
        "-i",
        "--interactive",
        action="store_true",
        help="a conversation: read messages from the terminal, keep the turns (implies --chat)",
    )
    generate.add_argument("--system", help="with --chat / --interactive: a system message")
    generate.add_argument("--max-new-tokens", type=int, default=32)
    generate.add_argument("--do-sample", action="store_true", help="sample instead of greedy")
    generate.add_argument("--temperature", type=float, default=1.0)
    generate.add_argument("--top-k", type=int)
    generate.add_argument("--top-p", type=float)
    generate.add_argument("--seed", type=int, help="seed of the sampling")
    add_hash_option(generate)
    generate.set_defaults(func=cmd_generate)
