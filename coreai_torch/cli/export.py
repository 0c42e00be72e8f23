"""``coreai-torch export --task TASK MODEL_DIR -o OUT_DIR``: a Hugging Face model directory ->
a directory that the task's ``CoreAIModelFor…`` class loads with ``from_pretrained`` (the
``.aimodel``, ``config.json``, ``generation_config.json``, tokenizer / processor files;
:func:`coreai_torch.hf.export.export_directory`).

    coreai-torch export --task text-generation MODEL_DIR -o OUT_DIR [--max-context N] \\
        [--precision fp16] [--compress int4 [--block-size N]]
"""

from __future__ import annotations

import argparse
from typing import Any

from coreai_torch.cli.options import (
    EXIT_OK,
    CliError,
    add_compression_arguments,
    add_precision_arguments,
    add_progress_option,
    compression_config,
    emit,
    progress_reporting,
    requested_precision,
)
from coreai_torch.hf.tasks import CLASSES, TASKS


def cmd_export(opts: argparse.Namespace) -> int:
    from coreai_torch.hf.export import export_directory

    if opts.task == TEXT_TO_IMAGE:
        return _export_diffusion(opts)
    if opts.height is not None or opts.width is not None:
        raise CliError("--height / --width apply to --task text-to-image")
    if opts.max_context is not None and opts.task == "feature-extraction":
        raise CliError("--max-context applies to generative tasks, not feature-extraction")
    with progress_reporting(opts):
        data = export_directory(
            opts.task,
            opts.model_dir,
            opts.output,
            max_context=opts.max_context,
            precision=requested_precision(opts),
            compress=compression_config(opts),
        )
    form = ", ".join([data["precision"], *([data["compression"]] if data["compression"] else [])])
    context = f", KV cache of {data['max_context']} positions" if data.get("max_context") else ""
    text = (
        f"{opts.model_dir} -> {opts.output} ({data['asset_bytes'] / 2**20:.1f} MiB, {form}"
        f"{context}): load it with coreai_torch.hf.{CLASSES[opts.task]}.from_pretrained; "
        f"exported in {data['seconds']['export']:.1f} s"
    )
    emit(opts, data, text)
    return EXIT_OK


#: the diffusers pipelines' task (coreai_torch.diffusers)
TEXT_TO_IMAGE = "text-to-image"


def _export_diffusion(opts: argparse.Namespace) -> int:
    from coreai_torch.diffusers import export_pipeline

    if opts.max_context is not None:
        raise CliError("--max-context applies to generative language tasks, not text-to-image")
    with progress_reporting(opts):
        data = export_pipeline(
            opts.model_dir,
            opts.output,
            precision=requested_precision(opts),
            compress=compression_config(opts),
            height=opts.height,
            width=opts.width,
        )
    roles = ", ".join(f"{role}: {c['asset']}" for role, c in data["components"].items())
    text = (
        f"{opts.model_dir} -> {opts.output} ({data['pipeline_class']}, {data['precision']}, "
        f"{' / '.join(f'{h}x{w}' for h, w in data['resolutions'])}; {roles}): load it with "
        "coreai_torch.diffusers.CoreAIDiffusionPipeline.from_pretrained"
    )
    emit(opts, data, text)
    return EXIT_OK


def add_command(commands: Any, common: argparse.ArgumentParser) -> None:
    """The ``export`` command, on the top-level sub-parsers."""
    export = commands.add_parser(
        "export",
        parents=[common],
        help="a Hugging Face model directory -> a directory the CoreAIModelFor... classes load",
        description="Export a Hugging Face model directory for a task: "
        + "; ".join(
            f"{task}: {CLASSES[task]} ({', '.join(types)})" for task, types in TASKS.items()
        )
        + f"; {TEXT_TO_IMAGE}: a diffusers pipeline directory -> a diffusion bundle "
        "(CoreAIDiffusionPipeline)",
    )
    export.add_argument(
        "--task",
        required=True,
        choices=[*TASKS, TEXT_TO_IMAGE],
        help="what the model is used for",
    )
    export.add_argument("model_dir", metavar="MODEL_DIR", help="written by save_pretrained")
    export.add_argument("-o", "--output", required=True, metavar="OUT_DIR", help="a new directory")
    export.add_argument(
        "--max-context",
        type=int,
        help="KV-cache positions of generative tasks (default: the model's own limit, at most "
        "2048)",
    )
    export.add_argument("--height", type=int, help="text-to-image: the image height exported")
    export.add_argument("--width", type=int, help="text-to-image: the image width exported")
    add_precision_arguments(export)
    add_compression_arguments(export)
    add_progress_option(export, "loading, tracing, converting, compressing and saving")
    export.set_defaults(func=cmd_export)
