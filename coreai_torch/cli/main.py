"""The ``coreai-torch`` command line.

    coreai-torch convert model.pt2 -o model.aimodel          # a torch.export.save()d program
    coreai-torch convert model.py:make -o model.aimodel      # make() -> (module, example_inputs)
    coreai-torch convert model.pt2 --compress int4 [--block-size 32]   # weights compressed
    coreai-torch verify model.aimodel model.py:make [--inputs x.npy] [--bisect]
    coreai-torch ops model.pt2                               # ops needed / supported / missing
    coreai-torch demo
    coreai-torch llm export MODEL_DIR -o model.aimodel [--max-context N]   # a causal LM
    coreai-torch llm generate model.aimodel --tokenizer MODEL_DIR --prompt "..."
    coreai-torch export --task text-generation MODEL_DIR -o OUT_DIR   # coreai_torch.hf classes
    coreai-torch eval perplexity OUT_DIR --text FILE --reference MODEL_DIR   # what compression cost
    coreai-torch serve MODEL [--host 127.0.0.1] [--port 8000]   # OpenAI-compatible HTTP API

A SOURCE is either a ``.pt2`` file written by ``torch.export.save`` or ``FILE.py:FUNCTION``
where ``FUNCTION()`` returns ``(module, example_inputs)`` or
``(module, example_inputs, dynamic_shapes)``.  Exit codes: 0 success, 1 mismatch (``verify``)
or missing ops (``ops``), 2 error.  The commands live in :mod:`~coreai_torch.cli.convert`,
:mod:`~coreai_torch.cli.llm`, :mod:`~coreai_torch.cli.export`, :mod:`~coreai_torch.cli.serve` and
:mod:`~coreai_torch.cli.demo`;
what they share in :mod:`~coreai_torch.cli.options`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import platform
import sys
import traceback
from collections.abc import Sequence

import torch

from coreai_torch import __version__
from coreai_torch.cli import convert, demo, eval, export, llm, serve
from coreai_torch.cli.options import EXIT_ERROR, EXIT_OK, one_line
from coreai_torch.torch_compat import ignore_torch_internal_warnings, quiet_import_noise

DEBUG_HELP = "show tracebacks of errors and the Core AI runtime's own messages"


def _version() -> str:
    return (
        f"coreai-torch {__version__} (torch {torch.__version__}, "
        f"coreai-core {importlib.metadata.version('coreai-core')}, "
        f"Python {platform.python_version()})"
    )


def _parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(add_help=False)
    top.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    top.add_argument("--json", action="store_true", help="print JSON instead of text")
    # the same options after the command (without resetting what was given before it)
    common = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    common.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    common.add_argument("--json", action="store_true", help="print JSON instead of text")

    parser = argparse.ArgumentParser(
        prog="coreai-torch",
        description="Convert PyTorch programs to Core AI programs, verify and inspect them.",
        epilog="SOURCE is FILE.pt2 (torch.export.save) or FILE.py:FUNCTION returning "
        "(module, example_inputs[, dynamic_shapes]).",
        parents=[top],
    )
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    convert.add_commands(commands, common)  # convert | verify | ops
    demo.add_command(commands, common)
    llm.add_commands(commands, common)  # llm export | llm generate
    export.add_command(commands, common)  # export --task (coreai_torch.hf)
    eval.add_command(commands, common)  # eval perplexity
    serve.add_command(commands, common)  # serve (OpenAI-compatible HTTP API)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    opts = _parser().parse_args(argv)
    ignore_torch_internal_warnings()
    if not opts.debug:
        quiet_import_noise()
    else:  # the runtime's messages (coreai_torch.runtime.chatter) on stderr
        logging.basicConfig(format="%(name)s: %(message)s")
        logging.getLogger("coreai_torch.runtime").setLevel(logging.DEBUG)
    try:
        return opts.func(opts)
    except KeyboardInterrupt:
        print("coreai-torch: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. piped into `head`
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the flush at exit
        return EXIT_OK
    except Exception as error:
        if opts.debug:
            traceback.print_exc()
        print(f"coreai-torch: error: {one_line(error)}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    raise SystemExit(main())
