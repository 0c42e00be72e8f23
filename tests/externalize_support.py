"""Helpers for externalization tests: convert with externalize_modules, read the graphs."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

import coreai_torch
from coreai_torch import TorchConverter
from coreai_torch.program import AIProgram
from coreai_torch.verify import VerifyReport, verify


def convert_externalized(
    model: nn.Module,
    sample: Sequence[Any],
    externalize_modules: list,
    *,
    dynamic_shapes: Any = None,
    strict: bool = False,
    **names: Any,
) -> AIProgram:
    """``add_pytorch_module`` with ``externalize_modules`` + ``to_coreai()``."""
    return (
        TorchConverter()
        .add_pytorch_module(
            model,
            export_fn=lambda m: torch.export.export(
                m, tuple(sample), dynamic_shapes=dynamic_shapes, strict=strict
            ).run_decompositions(coreai_torch.get_decomp_table()),
            externalize_modules=externalize_modules,
            **names,
        )
        .to_coreai()
    )


def check_externalized(
    model: nn.Module,
    sample: Sequence[Any],
    externalize_modules: list,
    *,
    atol: float = 1e-4,
    rtol: float = 1e-4,
) -> tuple[AIProgram, VerifyReport]:
    """Convert with externalization, optimize, run on the runtime and compare with PyTorch."""
    program = convert_externalized(model, sample, externalize_modules)
    text = str(program)
    program.optimize()
    report = verify(model, sample, program=program, atol=atol, rtol=rtol)
    assert report.ok, f"converted program does not match PyTorch:\n{report}\n\n{text}"
    return program, report


@dataclass
class Graph:
    """One ``coreai.graph`` of a program, as printed."""

    name: str
    private: bool
    no_inline: bool
    input_names: list[str]
    output_names: list[str]
    #: composite op name, or None without composite_decl
    op: str | None = None
    decl_inputs: list[str] = field(default_factory=list)
    decl_outputs: list[str] = field(default_factory=list)
    #: op_attrs as printed: {"eps": "9.99999974E-6 : f32", ...}
    attrs: dict[str, str] = field(default_factory=dict)
    #: callees of the coreai.invoke ops in the body, in order
    invokes: list[str] = field(default_factory=list)
    text: str = ""


_HEADER = re.compile(r"coreai\.graph (?P<mods>(?:\w+ )*)@(?P<name>[\w.\"]+)\((?P<args>.*?)\) -> ")
_DECL = re.compile(
    r'#coreai\.composite_declaration<"(?P<op>[^"]+)" = \{input_names = \[(?P<ins>[^\]]*)\], '
    r"op_attrs = \{(?P<attrs>.*?)\}, output_names = \[(?P<outs>[^\]]*)\]\}>"
)


def _strings(text: str) -> list[str]:
    return re.findall(r'"([^"]*)"', text)


def _attrs(text: str) -> dict[str, str]:
    result = {}
    for part in re.split(r", (?=\w+ = )", text):
        if part:
            key, value = part.split(" = ", 1)
            result[key] = value
    return result


def graphs(program: AIProgram) -> dict[str, Graph]:
    """Every graph of ``program`` by symbol name."""
    result = {}
    for op in program.mlir_module.body.operations:
        text = op.operation.get_asm()
        header = text.split("\n", 1)[0]
        match = _HEADER.search(header)
        assert match, header
        mods = match["mods"].split()
        outputs = header[match.end() :].split(" attributes", 1)[0]
        graph = Graph(
            name=match["name"].strip('"'),
            private="private" in mods,
            no_inline="noinline" in mods,
            input_names=re.findall(r'coreai\.name = "([^"]*)"', match["args"]),
            output_names=re.findall(r'coreai\.name = "([^"]*)"', outputs),
            invokes=re.findall(r"coreai\.invoke @([\w.]+)\(", text),
            text=text,
        )
        decl = _DECL.search(header)
        if decl:
            graph.op = decl["op"]
            graph.decl_inputs = _strings(decl["ins"])
            graph.decl_outputs = _strings(decl["outs"])
            graph.attrs = _attrs(decl["attrs"])
        result[graph.name] = graph
    return result


def composites(program: AIProgram, op: str | None = None) -> list[Graph]:
    """The graphs carrying a composite declaration (of op ``op``, if given)."""
    return [g for g in graphs(program).values() if g.op and (op is None or g.op == op)]
