"""The functions of an asset and their inputs, outputs and states, in the runtime's order.

The app engines take a function's inputs *by position* (``descriptor.inputNames[0]`` is the
token ids), so the order here is the runtime's: inputs and outputs in the order of the graph's
non-state arguments and results, states in the order of its state (handle) arguments.  Read
from a program in memory (its IR, before anything is saved) or from a saved ``.aimodel``
(coreai-core's summary of the program without its weights: a few KB read, whatever the size).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coreai_torch._mlir import cai, ir
from coreai_torch.dtypes import to_torch
from coreai_torch.errors import CallingConventionError, InvalidAssetError
from coreai_torch.ir.assets import structure_summary


@dataclass(frozen=True)
class TensorSpec:
    """One input, output or state: its name, dtype (numpy name: ``float16``, ``int32``,
    ``uint16``, ``bfloat16``, ...) and shape (``None`` for a dimension of run-time size)."""

    name: str
    dtype: str
    shape: tuple[int | None, ...]

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def dynamic_dims(self) -> tuple[int, ...]:
        return tuple(i for i, d in enumerate(self.shape) if d is None)

    def static_shape(self) -> tuple[int, ...]:
        """The shape where every dimension is fixed (a :class:`CallingConventionError` when
        one has a run-time size)."""
        sizes = tuple(d for d in self.shape if d is not None)
        if len(sizes) != len(self.shape):
            raise CallingConventionError(f"{self} has a run-time size where a fixed one is needed")
        return sizes

    def __str__(self) -> str:
        dims = ", ".join("?" if d is None else str(d) for d in self.shape)
        return f"{self.name}: {self.dtype}[{dims}]"


def _required(spec: TensorSpec | None, missing: str) -> TensorSpec:
    if spec is None:
        raise CallingConventionError(missing)
    return spec


@dataclass(frozen=True)
class FunctionSignature:
    """A function of an asset: what the runtime's ``InferenceFunctionDescriptor`` reports."""

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    states: tuple[TensorSpec, ...]

    def input(self, name: str) -> TensorSpec | None:
        return next((t for t in self.inputs if t.name == name), None)

    def output(self, name: str) -> TensorSpec | None:
        return next((t for t in self.outputs if t.name == name), None)

    def state(self, name: str) -> TensorSpec | None:
        return next((t for t in self.states if t.name == name), None)

    def required_input(self, name: str) -> TensorSpec:
        """The input ``name`` (a :class:`CallingConventionError` when there is none)."""
        return _required(self.input(name), f"function '{self.name}' has no input '{name}'")

    def required_state(self, name: str) -> TensorSpec:
        """The state ``name`` (a :class:`CallingConventionError` when there is none)."""
        return _required(self.state(name), f"function '{self.name}' has no state '{name}'")

    def __str__(self) -> str:
        def show(specs: tuple[TensorSpec, ...]) -> str:
            return "(" + ", ".join(str(s) for s in specs) + ")"

        text = f"{self.name}{show(self.inputs)} -> {show(self.outputs)}"
        return text + (f", states {show(self.states)}" if self.states else "")


Signatures = Mapping[str, FunctionSignature]


def function_signatures(asset: Any) -> dict[str, FunctionSignature]:
    """The entry points of ``asset`` (an ``AIProgram`` or the path of a saved ``.aimodel``)."""
    if isinstance(asset, (str, os.PathLike)):
        return _from_summary(Path(asset))
    module = getattr(asset, "structural_module", None)
    if module is None:
        holder = getattr(asset, "_module", None)
        module = getattr(holder, "_mlir_module", None)
    if module is None:
        raise TypeError(
            "expected an AIProgram or the path of a saved .aimodel asset, got "
            f"{type(asset).__name__}"
        )
    return _from_module(module)


# ------------------------------------------------------------------------- from the IR ---


def _from_module(module: ir.Module) -> dict[str, FunctionSignature]:
    signatures = {}
    for op in module.body.operations:
        if op.operation.name != "coreai.graph":
            continue
        attrs = op.operation.attributes
        if "priv" in attrs or (
            "sym_visibility" in attrs and str(attrs["sym_visibility"]) == '"private"'
        ):
            continue
        name = ir.StringAttr(attrs["sym_name"]).value
        function_type = ir.FunctionType(ir.TypeAttr(attrs["function_type"]).value)
        arg_names = _names(attrs, "arg_attrs", len(function_type.inputs))
        result_names = _names(attrs, "res_attrs", len(function_type.results))
        inputs, states, outputs = [], [], []
        for arg_name, arg_type in zip(arg_names, function_type.inputs, strict=True):
            if cai.HandleType.isinstance(arg_type):
                states.append(_spec(arg_name, cai.HandleType(arg_type).inner_type))
            else:
                inputs.append(_spec(arg_name, arg_type))
        for result_name, result_type in zip(result_names, function_type.results, strict=True):
            if not cai.TokenType.isinstance(result_type):
                outputs.append(_spec(result_name, result_type))
        signatures[name] = FunctionSignature(name, tuple(inputs), tuple(outputs), tuple(states))
    return signatures


def _names(attrs: Any, key: str, count: int) -> list[str]:
    if key not in attrs:
        return [f"#{i}" for i in range(count)]
    names = []
    for i, entry in enumerate(ir.ArrayAttr(attrs[key])):
        entry = ir.DictAttr(entry)
        names.append(
            ir.StringAttr(entry["coreai.name"]).value if "coreai.name" in entry else f"#{i}"
        )
    return names


def _spec(name: str, type_: ir.Type) -> TensorSpec:
    tensor = ir.RankedTensorType(type_)
    dtype = str(to_torch(tensor.element_type)).removeprefix("torch.")
    shape = tuple(None if ir.ShapedType.is_dynamic_size(d) else int(d) for d in tensor.shape)
    return TensorSpec(name, dtype, shape)


# -------------------------------------------------------------------- from an asset ---

_NDARRAY = re.compile(r"^NDArray \((\w+),\s*(.*)\)$")


def _from_summary(path: Path) -> dict[str, FunctionSignature]:
    summary = structure_summary(path)
    signatures = {}
    for name in summary.function_names:
        signatures[name] = FunctionSignature(
            name,
            tuple(_parse(path, n, t) for n, t in summary.function_inputs(name)),
            tuple(_parse(path, n, t) for n, t in summary.function_outputs(name)),
            tuple(_parse(path, n, t) for n, t in summary.function_states(name)),
        )
    return signatures


def _parse(path: Path, name: str, text: str) -> TensorSpec:
    match = _NDARRAY.match(text.strip())
    if match is None:
        raise InvalidAssetError(f"{path}: cannot read the type {text!r} of {name!r}")
    dims = [d.strip() for d in match.group(2).split("×") if d.strip()]
    shape = tuple(None if d == "?" else int(d) for d in dims)
    return TensorSpec(name, match.group(1).lower(), shape)
