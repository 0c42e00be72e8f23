"""What the ``coreai-torch`` commands share: sources, converter options, output, errors."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.export import ExportedProgram

from coreai_torch import compression
from coreai_torch.converter import TorchConverter
from coreai_torch.errors import ConversionError, UnsupportedOpError
from coreai_torch.frontend import hints
from coreai_torch.frontend.export import decomposed
from coreai_torch.locations import user_frame
from coreai_torch.precision import from_spec
from coreai_torch.progress import progress_bar, stderr_is_terminal

EXIT_OK, EXIT_MISMATCH, EXIT_ERROR = 0, 1, 2


SOURCE_HELP = "FILE.pt2 (torch.export.save) or FILE.py:FUNCTION returning (module, example_inputs)"


class CliError(Exception):
    """A problem with what was asked on the command line (reported without a traceback)."""


@dataclass
class Source:
    """A program to convert: a loaded ``.pt2`` or a factory's module exported here."""

    label: str
    exported: ExportedProgram
    #: the eager module (factory sources); ``.pt2`` sources run ``exported.module()``
    module: nn.Module | None = None
    args: tuple[Any, ...] | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    #: phase -> seconds ("load" or "export")
    timings: dict[str, float] = field(default_factory=dict)
    stem: str = "model"

    def reference(self) -> nn.Module:
        """The PyTorch model to compare with."""
        return self.module if self.module is not None else self.exported.module()


def load_source(spec: str) -> Source:
    """Load ``file.pt2`` or export ``file.py:function``'s module."""
    if spec.endswith(".pt2") and ":" not in Path(spec).name:
        return _load_pt2(Path(spec))
    path, sep, function = spec.rpartition(":")
    if not sep or not path.endswith(".py") or not function:
        raise CliError(
            f"source {spec!r} is neither a .pt2 file (torch.export.save) nor FILE.py:FUNCTION "
            "(a function returning (module, example_inputs[, dynamic_shapes]))"
        )
    return _load_factory(spec)


def make_converter(opts: argparse.Namespace) -> Any:
    """A ``TorchConverter`` in the ``--precision`` asked for (with ``--keep-fp32``), configured
    by ``--setup FILE.py:FUNCTION`` when given."""

    converter = TorchConverter(**precision_options(opts))
    if getattr(opts, "setup", None):
        _, setup = _function(opts.setup, "--setup")
        setup(converter)
    return converter


def precision_options(opts: argparse.Namespace) -> dict[str, Any]:
    """``TorchConverter`` keyword arguments from ``--precision`` and ``--keep-fp32``."""

    options: dict[str, Any] = {}
    spec = getattr(opts, "precision", None)
    if spec is not None:
        try:
            options["compute_precision"] = from_spec(spec)
        except ValueError as error:
            raise CliError(str(error)) from error
    keep = split_names(getattr(opts, "keep_fp32", None)) or []
    if keep and not options.get("compute_precision", from_spec(None)).is_half:
        raise CliError("--keep-fp32 needs --precision fp16 or bf16 (it keeps parts in float32)")
    options["keep_fp32_ops"] = [k for k in keep if "::" in k]
    options["keep_fp32_modules"] = [k for k in keep if "::" not in k]
    if getattr(opts, "no_check_range", False):
        options["check_range"] = False
    return options


def requested_precision(opts: argparse.Namespace) -> Any:
    """The ``Precision`` ``--precision`` / ``--keep-fp32`` ask for, or None (the
    ``precision=`` of ``llm.export`` and the ``coreai_torch.hf`` classes)."""
    options = precision_options(opts)
    options.pop("check_range", None)  # (a converter option, not the policy's)
    policy = options.pop("compute_precision", None)
    return None if policy is None else dataclasses.replace(policy, **options)


def _load_pt2(path: Path) -> Source:
    if not path.is_file():
        raise CliError(f"{path}: no such file")
    start = time.perf_counter()
    try:
        ep = torch.export.load(str(path))
    except Exception as error:
        raise CliError(
            f"{path}: not a program saved with torch.export.save ({type(error).__name__}: "
            f"{first_line(error)})"
        ) from error
    seconds = time.perf_counter() - start
    args, kwargs = None, {}
    if ep.example_inputs is not None:
        args, kwargs = tuple(ep.example_inputs[0]), dict(ep.example_inputs[1])
    return Source(str(path), ep, None, args, kwargs, {"load": seconds}, path.stem)


def _function(spec: str, what: str) -> tuple[Path, Any]:
    """Import ``FILE.py`` (its directory on ``sys.path`` meanwhile) and return its FUNCTION."""
    path_text, sep, function = spec.rpartition(":")
    path = Path(path_text)
    if not sep or path.suffix != ".py" or not function:
        raise CliError(f"{what} {spec!r} is not FILE.py:FUNCTION")
    if not path.is_file():
        raise CliError(f"{path}: no such file")
    name = f"_coreai_torch_{path.stem}_{abs(hash(str(path.resolve())))}"
    pymodule = sys.modules.get(name)
    if pymodule is None:
        loader_spec = importlib.util.spec_from_file_location(name, path)
        if loader_spec is None or loader_spec.loader is None:
            raise CliError(f"{path}: cannot be imported as a Python module")
        pymodule = importlib.util.module_from_spec(loader_spec)
        sys.path.insert(0, str(path.resolve().parent))
        try:
            sys.modules[name] = pymodule
            loader_spec.loader.exec_module(pymodule)
        except Exception as error:
            del sys.modules[name]
            raise CliError(f"importing {path} failed: {type(error).__name__}: {error}") from error
        finally:
            sys.path.pop(0)
    found = getattr(pymodule, function, None)
    if not callable(found):
        raise CliError(f"{path} has no function {function!r}")
    return path, found


def _load_factory(spec: str) -> Source:
    path, factory = _function(spec, "source")
    function = factory.__name__
    try:
        result = factory()
    except Exception as error:
        raise CliError(
            f"{path}:{function}() raised {type(error).__name__}: {first_line(error)}"
        ) from error
    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise CliError(
            f"{path}:{function}() must return (module, example_inputs) or (module, "
            f"example_inputs, dynamic_shapes), got {type(result).__name__}"
        )
    module, example = result[0], result[1]
    dynamic_shapes = result[2] if len(result) == 3 else None
    if not isinstance(module, nn.Module):
        raise CliError(
            f"{path}:{function}() returned a {type(module).__name__} where an nn.Module is "
            "expected first"
        )
    args, kwargs = _split_example(example, f"{path}:{function}()")
    start = time.perf_counter()
    try:
        ep = torch.export.export(module, args, kwargs, dynamic_shapes=dynamic_shapes)
    except Exception as error:
        raise CliError(
            hints.with_hint(
                f"torch.export.export failed on {type(module).__name__}: "
                f"{type(error).__name__}: {first_line(error)}",
                hints.for_export_failure(module, error),
            )
        ) from error
    seconds = time.perf_counter() - start
    label = f"{path}:{function} ({type(module).__name__})"
    return Source(label, ep, module, args, kwargs, {"export": seconds}, path.stem)


def _split_example(example: Any, where: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(example, torch.Tensor):
        return (example,), {}
    if isinstance(example, (tuple, list)):
        return tuple(example), {}
    if isinstance(example, dict):
        return (), dict(example)
    raise CliError(
        f"{where} returned example inputs of type {type(example).__name__}; use a tensor, a "
        "tuple/list of forward() arguments or a dict of keyword arguments"
    )


def decomposed_source(
    source: Source, timings: dict[str, float], notes: list[str]
) -> ExportedProgram:
    """The source's program decomposed with ``get_decomp_table()`` (noted) unless it is."""

    start = time.perf_counter()
    ep, done_here = decomposed(source.exported)
    if done_here:
        timings["decompose"] = time.perf_counter() - start
        if source.module is None:
            notes.append(
                "the program was not decomposed: ran run_decompositions(get_decomp_table())"
            )
    return ep


def split_names(text: str | None) -> list[str] | None:
    if text is None:
        return None
    return [n.strip() for n in text.split(",") if n.strip()]


def compression_config(opts: argparse.Namespace) -> Any:
    """The compression ``--compress`` / ``--block-size`` / ``--target-bpw`` ask for, or None."""

    target = getattr(opts, "target_bpw", None)
    if opts.compress is None:
        if opts.block_size is not None:
            raise CliError("--block-size needs --compress (e.g. --compress int4 --block-size 64)")
        if target is not None:
            raise CliError("--target-bpw needs --compress mixed")
        if getattr(opts, "calibration", None) is not None:
            raise CliError("--calibration needs --compress (e.g. --compress int4)")
        return None
    try:
        config = compression.from_spec(opts.compress, opts.block_size, target_bpw=target)
    except ValueError as error:
        raise CliError(f"--compress: {error}") from None
    if target is not None and not isinstance(config, compression.Mixed):
        raise CliError(f"--target-bpw is the budget of --compress mixed, not of {opts.compress}")
    if isinstance(config, compression.Mixed) and getattr(opts, "calibration", None) is None:
        raise CliError("--compress mixed needs --calibration FILE (text the model reads)")
    return config


def add_progress_option(parser: argparse.ArgumentParser, what: str) -> None:
    """``--progress`` / ``--no-progress``: a progress bar on stderr while ``what`` runs."""
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"progress bar while {what} (default: when stderr is a terminal)",
    )


def show_progress(opts: argparse.Namespace) -> bool:
    if opts.progress is not None:
        return opts.progress
    return stderr_is_terminal() and importlib.util.find_spec("rich") is not None


@contextlib.contextmanager
def progress_reporting(opts: argparse.Namespace) -> Iterator[None]:
    """Inside the block, every phase of a conversion (loading, tracing, lowering, compressing,
    optimizing, saving) moves a progress bar on stderr when ``--progress`` asks for one."""
    if not show_progress(opts):
        yield
        return
    with progress_bar():
        yield


def emit(opts: argparse.Namespace, data: dict[str, Any], text: str) -> None:
    if opts.json:
        print(json.dumps(data, indent=2, default=str))
    else:
        print(text)


def first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def one_line(error: BaseException) -> str:
    """The error as one line of text."""
    if isinstance(error, UnsupportedOpError) and error.ops:
        parts = []
        for op, nodes in sorted(error.ops.items(), key=lambda kv: -len(kv[1])):
            frame = user_frame(nodes[0]) if isinstance(nodes[0], torch.fx.Node) else None
            parts.append(f"{op} x{len(nodes)}" + (f" (first at {frame})" if frame else ""))
        hints = [line.strip() for line in str(error).splitlines() if line.startswith("hint:")]
        return f"no Core AI lowering for {'; '.join([*parts, *hints])}"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = " ".join(lines) or type(error).__name__
    if isinstance(error, (CliError, ConversionError)):
        return text
    return f"{type(error).__name__}: {text}"


def add_precision_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--precision",
        metavar="fp16|bf16|fp32",
        help="compute precision: weights stored and activations computed in float16 or "
        "bfloat16, with float32 islands (verify: the precision the asset was converted in)",
    )
    parser.add_argument(
        "--keep-fp32",
        metavar="A,B",
        help="with --precision fp16|bf16: also keep these in float32 -- ATen ops "
        "('aten::mm'), module paths ('lm_head', 'layers.*.mlp') or module class names",
    )


def add_range_check_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--no-check-range",
        action="store_true",
        help="with --precision fp16|bf16: do not run the float32 program on the example "
        "inputs to keep the nodes whose values overflow the half type in float32",
    )


def add_compression_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--compress",
        metavar="FORM",
        help="store the weights compressed: int8 (per output channel), int4 (blocks of 32; "
        "int4-asym with zero points, int4-g64 blocks of 64, int4-pc per channel), palette4 "
        "(4-bit palettes per 16 output channels; palette4-pt one per weight), sparse50, "
        "mixed (a form per weight to --target-bpw, needs --calibration); int2..int8 / "
        "palette1..palette8 / sparse<percent>. Below 8 bits, embeddings and the output head "
        "stay int8",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        metavar="N",
        help="with --compress: weights per scale along the input axis (int), or output "
        "channels per palette (palette)",
    )


def add_calibration_arguments(parser: argparse.ArgumentParser) -> None:
    """``--calibration FILE`` and ``--target-bpw`` (causal LMs: text read with the model's
    tokenizer)."""
    parser.add_argument(
        "--calibration",
        metavar="FILE",
        help="with --compress: a text file the compressed weights are fitted against (GPTQ, "
        "activation-aware scales, weighted palettes; 32 x 256 tokens at most)",
    )
    parser.add_argument(
        "--target-bpw",
        type=float,
        metavar="BITS",
        help="with --compress mixed: bits per weight over every weight (default 4.5)",
    )


def add_hash_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--verify-hash",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compare the asset's bytecode with its main.hash before loading it (default; "
        "about 1.4 s per GB, hidden while the program compiles on Linux)",
    )


def add_setup_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--setup",
        metavar="FILE.py:FUNCTION",
        help="FUNCTION(converter) registers lowerings / Metal kernels on the converter",
    )
