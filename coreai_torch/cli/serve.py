"""``coreai-torch serve``: an OpenAI-compatible HTTP server for an exported LLM.

    coreai-torch serve model.aimodel --tokenizer MODEL_DIR [--host 127.0.0.1] [--port 8000]
    coreai-torch serve OUT_DIR                 # saved by CoreAIModelForCausalLM, or a bundle
    coreai-torch serve HF_MODEL_DIR [--max-context N] [--precision fp16] [--compress int4]

Binds to 127.0.0.1 unless ``--allow-remote`` is given (with another ``--host``); ``--api-key``
(or ``COREAI_TORCH_API_KEY``) makes every API request carry ``Authorization: Bearer KEY``.
Stops on Ctrl-C / SIGTERM, letting requests in flight finish (``--shutdown-timeout``).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from coreai_torch.cli.options import (
    EXIT_OK,
    CliError,
    add_compression_arguments,
    add_hash_option,
    add_precision_arguments,
    compression_config,
    requested_precision,
)


def cmd_serve(opts: argparse.Namespace) -> int:
    try:
        from coreai_torch.serve.app import ServerOptions, bind, create_app, is_loopback, run_server
    except ImportError as error:
        raise CliError(
            f"serving needs the 'serve' extra ({error}): pip install "
            "'coreai-torch-converter[serve]'"
        ) from None
    from coreai_torch.serve.engine import Engine
    from coreai_torch.serve.models import load_generator

    if not is_loopback(opts.host) and not opts.allow_remote:
        raise CliError(
            f"--host {opts.host} is reachable from other machines; pass --allow-remote to bind "
            "to it (and consider --api-key)"
        )
    api_key = opts.api_key or os.environ.get("COREAI_TORCH_API_KEY") or None
    sock = bind(opts.host, opts.port)  # fails early (port taken) before the model loads
    generator, name = load_generator(
        opts.model,
        tokenizer=opts.tokenizer,
        max_context=opts.max_context,
        precision=requested_precision(opts),
        compress=compression_config(opts),
        verify_hash=opts.verify_hash,
    )
    engine = Engine(
        generator,
        opts.model_name or name,
        concurrency=opts.concurrency,
        max_queue=opts.max_queue,
        max_tokens=opts.max_tokens,
    )
    app = create_app(engine, ServerOptions(api_key, opts.max_request_bytes))
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(
        f"coreai-torch: serving '{engine.name}' at http://{shown}:{port}/v1 "
        f"(concurrency {opts.concurrency}, queue {opts.max_queue}, context "
        f"{generator.max_context}{', API key required' if api_key else ''})",
        flush=True,
    )
    run_server(
        app,
        sock,
        shutdown_timeout=opts.shutdown_timeout,
        log_level="info" if opts.debug else "warning",
    )
    return EXIT_OK


def add_command(commands: Any, common: argparse.ArgumentParser) -> None:
    serve = commands.add_parser(
        "serve",
        parents=[common],
        help="serve an LLM over an OpenAI-compatible HTTP API",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    serve.add_argument(
        "model",
        metavar="MODEL",
        help="an .aimodel, a saved CoreAIModelForCausalLM directory, a bundle, or a Hugging Face "
        "model directory (exported on the fly)",
    )
    serve.add_argument("--tokenizer", metavar="DIR", help="tokenizer directory (an .aimodel)")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free)")
    serve.add_argument(
        "--allow-remote", action="store_true", help="allow a --host other machines can reach"
    )
    serve.add_argument(
        "--api-key", help="require 'Authorization: Bearer KEY' (default $COREAI_TORCH_API_KEY)"
    )
    serve.add_argument("--model-name", help="the model's name in the API (default: MODEL's)")
    serve.add_argument("--concurrency", type=int, default=4, help="generations at once (default 4)")
    serve.add_argument(
        "--max-queue",
        type=int,
        default=16,
        help="requests waiting for a generation slot; more get HTTP 429 (default 16)",
    )
    serve.add_argument(
        "--max-tokens", type=int, help="the most tokens a request may ask for (default: context)"
    )
    serve.add_argument(
        "--max-request-bytes",
        type=int,
        default=1 << 20,
        help="largest request body; larger get HTTP 413 (default 1 MiB)",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds requests in flight get to finish when stopping (default 10)",
    )
    serve.add_argument(
        "--max-context", type=int, help="KV-cache positions (a Hugging Face directory)"
    )
    add_precision_arguments(serve)
    add_compression_arguments(serve)
    add_hash_option(serve)
    serve.set_defaults(func=cmd_serve)
