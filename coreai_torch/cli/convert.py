"""``coreai-torch convert | verify | ops``: convert a program, check an asset, list the ops.

coreai-torch convert model.pt2 -o model.aimodel          # a torch.export.save()d program
coreai-torch convert model.py:make -o model.aimodel      # make() -> (module, example_inputs)
coreai-torch convert model.pt2 --compress int4 [--block-size 32]   # weights compressed
coreai-torch verify model.aimodel model.py:make [--inputs x.npy] [--bisect]
coreai-torch ops model.pt2                               # ops needed / supported / missing
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree

from coreai_torch.analysis import analyze
from coreai_torch.cli.options import (
    EXIT_MISMATCH,
    EXIT_OK,
    SOURCE_HELP,
    CliError,
    Source,
    add_compression_arguments,
    add_hash_option,
    add_precision_arguments,
    add_progress_option,
    add_range_check_argument,
    add_setup_option,
    compression_config,
    decomposed_source,
    emit,
    load_source,
    make_converter,
    show_progress,
    split_names,
)
from coreai_torch.cli.report import ConversionReport, timed
from coreai_torch.frontend.signature import analyze_signature
from coreai_torch.runtime import Session
from coreai_torch.verify import VerifyReport, compare, find_divergence, half_tolerance, tolerances
from coreai_torch.verify.bisect import flat_user_args


def cmd_convert(opts: argparse.Namespace) -> int:
    compression = compression_config(opts)
    source = load_source(opts.source)
    output = Path(opts.output) if opts.output else Path(f"{source.stem}.aimodel")
    if output.suffix != ".aimodel":
        raise CliError(f"the output path must end in .aimodel, got {output}")
    timings = dict(source.timings)
    notes: list[str] = []
    ep = decomposed_source(source, timings, notes)
    converter = make_converter(opts)
    converter.progress = show_progress(opts)
    if converter.precision.is_half:
        name = converter.precision.name
        notes.append(f"computed in {name}: weights stored in {name}, float32 islands")
    converter.add_exported_program(
        ep,
        input_names=split_names(opts.input_names),
        output_names=split_names(opts.output_names),
        state_names=split_names(opts.state_names),
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
    emit(opts, report.to_dict(), str(report))
    return EXIT_OK


def cmd_ops(opts: argparse.Namespace) -> int:
    source = load_source(opts.source)
    notes: list[str] = []
    report = analyze(decomposed_source(source, {}, notes), make_converter(opts))
    text = "\n".join([source.label, *notes, str(report)])
    emit(opts, {"source": source.label, "notes": notes, **report.to_dict()}, text)
    return EXIT_OK if report.ok else EXIT_MISMATCH


def cmd_verify(opts: argparse.Namespace) -> int:
    asset = Path(opts.asset)
    if not asset.exists():
        raise CliError(f"{asset}: no such .aimodel")
    source = load_source(opts.source)
    ep = decomposed_source(source, {}, [])
    signature = analyze_signature(ep)
    args, kwargs, inputs_label = _inputs(opts, source)
    flat = flat_user_args(ep, args, kwargs)
    feeds, input_states = signature.feeds(flat)
    states = {k: v.detach().clone() for k, v in signature.initial_states.items()}
    states.update({k: v.detach().clone() for k, v in input_states.items()})

    expected_out, expected_states = _eager(source, signature, args, kwargs)
    converter = make_converter(opts)
    policy = converter.precision
    with Session(asset, verify_hash=opts.verify_hash) as session:
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
    emit(opts, data, "\n".join(text))
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


def add_commands(commands: Any, common: argparse.ArgumentParser) -> None:
    """Add ``convert``, ``verify`` and ``ops`` to the ``coreai-torch`` sub-commands."""
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
    add_precision_arguments(convert)
    add_range_check_argument(convert)
    add_compression_arguments(convert)
    add_progress_option(convert, "converting, optimizing and saving")
    add_setup_option(convert)
    convert.set_defaults(func=cmd_convert)

    verify = commands.add_parser(
        "verify", parents=[common], help="run an .aimodel and compare it with PyTorch"
    )
    verify.add_argument("asset", metavar="MODEL.aimodel")
    verify.add_argument("source", metavar="SOURCE", help="the program the asset came from")
    add_hash_option(verify)
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
    add_precision_arguments(verify)
    verify.add_argument("--entrypoint", default="main", help="function of the asset to run")
    verify.add_argument(
        "--bisect",
        action="store_true",
        help="on a mismatch, find the first FX node whose value diverges",
    )
    add_setup_option(verify)
    verify.set_defaults(func=cmd_verify)

    ops = commands.add_parser(
        "ops", parents=[common], help="list the ops a program needs and which are supported"
    )
    ops.add_argument("source", metavar="SOURCE", help=SOURCE_HELP)
    add_setup_option(ops)
    ops.set_defaults(func=cmd_ops)
