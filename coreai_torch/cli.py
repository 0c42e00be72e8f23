"""The ``coreai-torch`` command line.

    coreai-torch convert model.pt2 -o model.aimodel          # a torch.export.save()d program
    coreai-torch convert model.py:make -o model.aimodel      # make() -> (module, example_inputs)
    coreai-torch convert model.pt2 --compress int4 [--block-size 32]   # weights compressed
    coreai-torch verify model.aimodel model.py:make [--inputs x.npy] [--bisect]
    coreai-torch ops model.pt2                               # ops needed / supported / missing
    coreai-torch demo
    coreai-torch llm export MODEL_DIR -o model.aimodel [--max-context N]   # a causal LM
    coreai-torch llm generate model.aimodel --tokenizer MODEL_DIR --prompt "..."

A SOURCE is either a ``.pt2`` file written by ``torch.export.save`` or ``FILE.py:FUNCTION``
where ``FUNCTION()`` returns ``(module, example_inputs)`` or
``(module, example_inputs, dynamic_shapes)``.  Exit codes: 0 success, 1 mismatch (``verify``)
or missing ops (``ops``), 2 error.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.export import ExportedProgram

from coreai_torch.errors import ConversionError, UnsupportedOpError
from coreai_torch.torch_compat import ignore_torch_internal_warnings

EXIT_OK, EXIT_MISMATCH, EXIT_ERROR = 0, 1, 2
SOURCE_HELP = "FILE.pt2 (torch.export.save) or FILE.py:FUNCTION returning (module, example_inputs)"


class CliError(Exception):
    """A problem with what was asked on the command line (reported without a traceback)."""


# -------------------------------------------------------------------------------- sources ---


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
    from coreai_torch.converter import TorchConverter

    converter = TorchConverter(**_precision_options(opts))
    if getattr(opts, "setup", None):
        _, setup = _function(opts.setup, "--setup")
        setup(converter)
    return converter


def _precision_options(opts: argparse.Namespace) -> dict[str, Any]:
    """``TorchConverter`` keyword arguments from ``--precision`` and ``--keep-fp32``."""
    from coreai_torch.precision import from_spec

    options: dict[str, Any] = {}
    spec = getattr(opts, "precision", None)
    if spec is not None:
        try:
            options["compute_precision"] = from_spec(spec)
        except ValueError as error:
            raise CliError(str(error)) from error
    keep = _names(getattr(opts, "keep_fp32", None)) or []
    if keep and not options.get("compute_precision", from_spec(None)).is_half:
        raise CliError("--keep-fp32 needs --precision fp16 or bf16 (it keeps parts in float32)")
    options["keep_fp32_ops"] = [k for k in keep if "::" in k]
    options["keep_fp32_modules"] = [k for k in keep if "::" not in k]
    return options


def _load_pt2(path: Path) -> Source:
    if not path.is_file():
        raise CliError(f"{path}: no such file")
    start = time.perf_counter()
    try:
        ep = torch.export.load(str(path))
    except Exception as error:
        raise CliError(
            f"{path}: not a program saved with torch.export.save ({type(error).__name__}: "
            f"{_first_line(error)})"
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
            f"{path}:{function}() raised {type(error).__name__}: {_first_line(error)}"
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
            f"torch.export.export failed on {type(module).__name__}: {type(error).__name__}: "
            f"{_first_line(error)}"
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


def _decomposed(source: Source, timings: dict[str, float], notes: list[str]) -> ExportedProgram:
    """The source's program decomposed with ``get_decomp_table()`` (noted) unless it is."""
    from coreai_torch.analysis import decomposed

    start = time.perf_counter()
    ep, done_here = decomposed(source.exported)
    if done_here:
        timings["decompose"] = time.perf_counter() - start
        if source.module is None:
            notes.append(
                "the program was not decomposed: ran run_decompositions(get_decomp_table())"
            )
    return ep


def _names(text: str | None) -> list[str] | None:
    if text is None:
        return None
    return [n.strip() for n in text.split(",") if n.strip()]


# ------------------------------------------------------------------------------- commands ---


def cmd_convert(opts: argparse.Namespace) -> int:
    from coreai_torch.report import ConversionReport, timed

    compression = _compression(opts)
    source = load_source(opts.source)
    output = Path(opts.output) if opts.output else Path(f"{source.stem}.aimodel")
    if output.suffix != ".aimodel":
        raise CliError(f"the output path must end in .aimodel, got {output}")
    timings = dict(source.timings)
    notes: list[str] = []
    ep = _decomposed(source, timings, notes)
    converter = make_converter(opts)
    converter.progress = _show_progress(opts)
    if converter.precision.is_half:
        name = converter.precision.name
        notes.append(f"computed in {name}: weights stored in {name}, float32 islands")
    converter.add_exported_program(
        ep,
        input_names=_names(opts.input_names),
        output_names=_names(opts.output_names),
        state_names=_names(opts.state_names),
        entrypoint_name=opts.entrypoint,
    )
    with timed(timings, "to_coreai"):
        program = converter.to_coreai()
    compressed = None
    if compression is not None:  # before optimize(): no transposed float copies of weights
        with timed(timings, "compress"):
            compressed = program.compress(compression)
    if opts.no_optimize:
        notes.append("not optimized (--no-optimize)")
    else:
        with timed(timings, "optimize"):
            program.optimize()
    with timed(timings, "save"):
        program.save_asset(output)
    report = ConversionReport.build(
        converter, program, timings=timings, source=source.label, asset=output, notes=notes
    )
    report.compression = compressed
    _emit(opts, report.to_dict(), str(report))
    return EXIT_OK


def _compression(opts: argparse.Namespace) -> Any:
    """The compression ``--compress`` / ``--block-size`` ask for, or None."""
    from coreai_torch import compression

    if opts.compress is None:
        if opts.block_size is not None:
            raise CliError("--block-size needs --compress (e.g. --compress int4 --block-size 64)")
        return None
    try:
        return compression.from_spec(opts.compress, opts.block_size)
    except ValueError as error:
        raise CliError(f"--compress: {error}") from None


def _show_progress(opts: argparse.Namespace) -> bool:
    from coreai_torch.progress import stderr_is_terminal

    if opts.progress is not None:
        return opts.progress
    return stderr_is_terminal() and importlib.util.find_spec("rich") is not None


def cmd_ops(opts: argparse.Namespace) -> int:
    from coreai_torch.analysis import analyze

    source = load_source(opts.source)
    notes: list[str] = []
    report = analyze(_decomposed(source, {}, notes), make_converter(opts))
    text = "\n".join([source.label, *notes, str(report)])
    _emit(opts, {"source": source.label, "notes": notes, **report.to_dict()}, text)
    return EXIT_OK if report.ok else EXIT_MISMATCH


def cmd_demo(opts: argparse.Namespace) -> int:
    from coreai_torch import demo

    argv = ["--out", opts.out] if opts.out else []
    return demo.main(argv)


def cmd_verify(opts: argparse.Namespace) -> int:
    from coreai_torch.debugging import flat_user_args
    from coreai_torch.runtime import Session
    from coreai_torch.signature import analyze_signature
    from coreai_torch.verify import VerifyReport, compare, half_tolerance, tolerances

    asset = Path(opts.asset)
    if not asset.exists():
        raise CliError(f"{asset}: no such .aimodel")
    source = load_source(opts.source)
    ep = _decomposed(source, {}, [])
    signature = analyze_signature(ep)
    args, kwargs, inputs_label = _inputs(opts, source)
    flat = flat_user_args(ep, args, kwargs)
    feeds, input_states = signature.feeds(flat)
    states = {k: v.detach().clone() for k, v in signature.initial_states.items()}
    states.update({k: v.detach().clone() for k, v in input_states.items()})

    expected_out, expected_states = _eager(source, signature, args, kwargs)
    converter = make_converter(opts)
    policy = converter.precision
    with Session(asset) as session:
        functions = list(session.model.function_names)
        if opts.entrypoint not in functions:
            raise CliError(f"{asset} has no entry point {opts.entrypoint!r}; it has {functions}")
        desc = session.descriptor(opts.entrypoint)
        names = _bind_names(desc, signature, asset, opts.entrypoint)
        feeds = {names[k]: _as_stored(v, desc.input_descriptor(names[k])) for k, v in feeds.items()}
        states = {
            names[k]: _as_stored(v, desc.state_descriptor(names[k])) for k, v in states.items()
        }
        out = session.run(feeds, entrypoint=opts.entrypoint, state=states or None)
        state_out = session.state_values(opts.entrypoint)
    atol, rtol = opts.atol, opts.rtol
    tolerance = opts.tolerance
    if policy.is_half and tolerance is None:
        tolerance = half_tolerance(policy)
    results = [
        compare(names[o.name], e, out[names[o.name]], **tolerances(e, atol, rtol, tolerance))
        for o, e in zip(signature.outputs, expected_out, strict=True)
    ]
    for state in signature.states:
        name = names[state.name]
        expected = expected_states[state.name]
        results.append(
            compare(
                f"{name} (state)",
                expected,
                state_out[name],
                **tolerances(expected, atol, rtol, tolerance),
            )
        )
    report = VerifyReport(results)
    header = f"{asset} vs {source.label} ({inputs_label})"
    if tolerance is not None:
        header += f"; {policy.name} tolerance {tolerance:g} x max(1, max|expected|)"
    text = [header, str(report)]
    text.append("MATCH" if report.ok else "MISMATCH")
    data: dict[str, Any] = {
        "ok": report.ok,
        "outputs": [asdict(o) | {"shape": list(o.shape)} for o in report.outputs],
    }
    if opts.bisect and not report.ok:
        from coreai_torch.debugging import find_divergence

        log = None if opts.json else print
        if log:
            print("\n".join(text))
            text = []
            print("bisecting: converting prefixes of the program ...")
        found = find_divergence(
            ep,
            args,
            kwargs,
            converter=converter,
            atol=atol,
            rtol=rtol,
            log=log,
            tolerance=tolerance,
        )
        data["divergence"] = found.to_dict() if found else None
        text.append(
            str(found)
            if found
            else f"converted afresh from {source.label}, the program matches PyTorch: the "
            "asset was converted differently (other weights, names, options or version)"
        )
    elif opts.bisect:
        text.append("outputs match: nothing to bisect")
    _emit(opts, data, "\n".join(text))
    return EXIT_OK if report.ok else EXIT_MISMATCH


def _as_stored(value: Any, descriptor: Any) -> Any:
    """A floating tensor in the floating dtype the asset takes (a half-precision asset's
    states, or its inputs with ``io_dtype``); anything else as it is."""
    dtype = getattr(torch, str(descriptor.dtype), None)
    if (
        isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and isinstance(dtype, torch.dtype)
        and dtype.is_floating_point
    ):
        return value.to(dtype)
    return value


def _bind_names(desc: Any, signature: Any, asset: Path, entrypoint: str) -> dict[str, str]:
    """Program names (defaults) -> the asset's names, matched by position."""
    pairs = (
        ("inputs", [i.name for i in signature.inputs], list(desc.input_names)),
        ("outputs", [o.name for o in signature.outputs], list(desc.output_names)),
        ("states", [s.name for s in signature.states], list(desc.state_names)),
    )
    names: dict[str, str] = {}
    for what, ours, theirs in pairs:
        if len(ours) != len(theirs):
            raise CliError(
                f"{asset} ('{entrypoint}') has {len(theirs)} {what} {theirs} but the source "
                f"program has {len(ours)} {ours}: is it the right source?"
            )
        names.update(zip(ours, theirs, strict=True))
    return names


def _eager(
    source: Source, signature: Any, args: Sequence[Any], kwargs: dict[str, Any]
) -> tuple[list[Any], dict[str, torch.Tensor]]:
    """PyTorch's outputs, and its states after the call (buffers / mutated inputs)."""
    from coreai_torch.debugging import flat_user_args

    reference = source.reference()
    args_c, kwargs_c = pytree.tree_map(
        lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v),
        (tuple(args), dict(kwargs)),
    )
    buffers = {s.name: s.target for s in signature.states if s.kind == "buffer"}
    saved = {name: reference.get_buffer(t).detach().clone() for name, t in buffers.items()}
    with torch.no_grad():
        out = reference(*args_c, **kwargs_c)
    states = {name: reference.get_buffer(t).detach().clone() for name, t in buffers.items()}
    for name, target in buffers.items():  # leave the module as it was
        reference.get_buffer(target).copy_(saved[name])
    by_node = dict(
        zip(signature.user_inputs, flat_user_args(source.exported, args_c, kwargs_c), strict=True)
    )
    for s in signature.states:
        if s.kind == "user_input":
            states[s.name] = by_node[s.node]
    return pytree.tree_leaves(out), states


def _inputs(
    opts: argparse.Namespace, source: Source
) -> tuple[tuple[Any, ...], dict[str, Any], str]:
    """The forward() arguments to verify with (from files, or random like the examples) and
    a label saying which."""
    if opts.inputs:
        values: list[Any] = []
        for file in opts.inputs:
            values.extend(_read_input(Path(file)))
        return tuple(values), {}, "inputs " + ", ".join(opts.inputs)
    if source.args is None:
        raise CliError(
            f"{source.label} carries no example inputs to draw random inputs like; pass the "
            "inputs with --inputs FILE.npy|FILE.pt ..."
        )
    generator = torch.Generator().manual_seed(opts.seed)
    args, kwargs = pytree.tree_map(
        lambda v: _random_like(v, generator) if isinstance(v, torch.Tensor) else v,
        (source.args, source.kwargs),
    )
    return args, kwargs, f"random inputs, seed {opts.seed}"


def _read_input(path: Path) -> list[Any]:
    if not path.is_file():
        raise CliError(f"{path}: no such input file")
    if path.suffix == ".npy":
        import numpy as np

        return [torch.from_numpy(np.load(path, allow_pickle=False))]
    if path.suffix == ".pt":
        value = torch.load(path, weights_only=True)
        return list(value) if isinstance(value, (list, tuple)) else [value]
    raise CliError(f"{path}: input files must be .npy or .pt")


def _random_like(example: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random values shaped like ``example``: N(0, 1) floats, integers in the example's range."""
    shape, dtype = tuple(example.shape), example.dtype
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if example.numel():
        low, high = int(example.min()), int(example.max()) + 1
    else:
        low, high = 0, 2
    return torch.randint(low, high, shape, generator=generator, dtype=torch.int64).to(dtype)


def _emit(opts: argparse.Namespace, data: dict[str, Any], text: str) -> None:
    if opts.json:
        print(json.dumps(data, indent=2, default=str))
    else:
        print(text)


# ---------------------------------------------------------------------------------- main ----


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def _one_line(error: BaseException) -> str:
    """The error as one line of text."""
    if isinstance(error, UnsupportedOpError) and error.ops:
        from coreai_torch.locations import user_frame

        parts = []
        for op, nodes in sorted(error.ops.items(), key=lambda kv: -len(kv[1])):
            frame = user_frame(nodes[0])
            parts.append(f"{op} x{len(nodes)}" + (f" (first at {frame})" if frame else ""))
        return f"no Core AI lowering for {'; '.join(parts)}"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = " ".join(lines) or type(error).__name__
    if isinstance(error, (CliError, ConversionError)):
        return text
    return f"{type(error).__name__}: {text}"


def _precision_arguments(parser: argparse.ArgumentParser) -> None:
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


def _compression_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--compress",
        metavar="FORM",
        help="store the weights compressed: int8 (per output channel), int4 (blocks of 32), "
        "palette4 (4-bit k-means palettes), or int2..int8 / palette1..palette8",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        metavar="N",
        help="with --compress: weights per scale along the input axis (int), or output "
        "channels per palette (palette)",
    )


def _setup_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--setup",
        metavar="FILE.py:FUNCTION",
        help="FUNCTION(converter) registers lowerings / Metal kernels on the converter",
    )


def _version() -> str:
    from coreai_torch import __version__

    return (
        f"coreai-torch {__version__} (torch {torch.__version__}, "
        f"coreai-core {importlib.metadata.version('coreai-core')}, "
        f"Python {platform.python_version()})"
    )


def _parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(add_help=False)
    top.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    top.add_argument("--json", action="store_true", help="print JSON instead of text")
    # the same options after the command (without resetting what was given before it)
    common = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    common.add_argument("--debug", action="store_true", help="show tracebacks of errors")
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

    convert = commands.add_parser(
        "convert", parents=[common], help="convert a program to an .aimodel and print a report"
    )
    convert.add_argument("source", metavar="SOURCE", help=SOURCE_HELP)
    convert.add_argument("-o", "--output", help="the .aimodel to write (default: <stem>.aimodel)")
    convert.add_argument("--input-names", metavar="A,B", help="names of the non-state inputs")
    convert.add_argument("--output-names", metavar="A,B", help="names of the outputs")
    convert.add_argument("--state-names", metavar="A,B", help="names of the states")
    convert.add_argument("--entrypoint", default="main", help="entry point name (default main)")
    convert.add_argument("--no-optimize", action="store_true", help="skip program.optimize()")
    _precision_arguments(convert)
    _compression_arguments(convert)
    convert.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar while converting, optimizing and saving (default: when stderr is a "
        "terminal)",
    )
    _setup_option(convert)
    convert.set_defaults(func=cmd_convert)

    verify = commands.add_parser(
        "verify", parents=[common], help="run an .aimodel and compare it with PyTorch"
    )
    verify.add_argument("asset", metavar="MODEL.aimodel")
    verify.add_argument("source", metavar="SOURCE", help="the program the asset came from")
    verify.add_argument(
        "--inputs",
        nargs="+",
        metavar="FILE",
        help="forward() arguments in order, as .npy or .pt files (a .pt may hold a tuple); "
        "default: random inputs like the example inputs",
    )
    verify.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    verify.add_argument("--atol", type=float, default=1e-4)
    verify.add_argument("--rtol", type=float, default=1e-4)
    verify.add_argument(
        "--tolerance",
        type=float,
        metavar="REL",
        help="compare each output within REL * max(1, max|expected|) instead of --atol/--rtol "
        "(default for --precision fp16: 0.01, bf16: 0.05)",
    )
    _precision_arguments(verify)
    verify.add_argument("--entrypoint", default="main", help="function of the asset to run")
    verify.add_argument(
        "--bisect",
        action="store_true",
        help="on a mismatch, find the first FX node whose value diverges",
    )
    _setup_option(verify)
    verify.set_defaults(func=cmd_verify)

    ops = commands.add_parser(
        "ops", parents=[common], help="list the ops a program needs and which are supported"
    )
    ops.add_argument("source", metavar="SOURCE", help=SOURCE_HELP)
    _setup_option(ops)
    ops.set_defaults(func=cmd_ops)

    demo = commands.add_parser(
        "demo", parents=[common], help="convert a small transformer, run it, compare"
    )
    demo.add_argument("--out", help="directory for the .aimodel (default build/demo)")
    demo.set_defaults(func=cmd_demo)

    from coreai_torch.llm.cli import add_commands as add_llm_commands

    add_llm_commands(commands, common)  # llm export | llm generate
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    opts = _parser().parse_args(argv)
    ignore_torch_internal_warnings()
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
        print(f"coreai-torch: error: {_one_line(error)}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    raise SystemExit(main())
