"""Composite ops: private ``coreai.graph``s marked with a ``#coreai.composite_declaration``.

A composite op keeps an operation's boundary (RMSNorm, attention, layer_norm, ...) in the
converted program so the compiler can recognise it and substitute an optimized implementation.
It is a private, ``noinline`` graph whose body is the reference implementation, called with
``coreai.invoke``::

    coreai.graph private noinline @norm.rms_norm_1a2b3c4d(%arg0: ..., %arg1: ...) -> ...
        attributes {composite_decl = #coreai.composite_declaration<"rms_norm" = {
            input_names = ["input", "scale"],
            op_attrs = {axes = -1 : si64, eps = 9.99999974E-6 : f32, version = 1 : si64},
            output_names = ["output"]}>}

Both kinds of composites go through :func:`emit_composite`: module-class composites
(``ExternalizeSpec``) and ATen-derived ones (``layer_norm``, ``scaled_dot_product_attention``,
...).  A custom lowering can emit its own composite op the same way::

    @converter.register_torch_lowering("my_lib::my_norm.default")
    def lower_my_norm(values_map, node, loc):
        x, w = get_operands(values_map, node, [0, 1], loc)
        (y,) = emit_composite(
            "my_norm", [x, w], lambda x, w: ...,  # builds the body from the graph arguments
            input_names=["input", "weight"], op_attrs={"eps": node.args[2]},
        )
        return y

or build the declaration alone with :func:`generate_composite_decl` and create the graph
with ``coreai.authoring``'s ``GraphOp(..., private=True, no_inline=True, composite_decl=decl)``.
"""

from __future__ import annotations

import hashlib
import re
import weakref
from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from typing import Any

import torch

from coreai_torch import dtypes
from coreai_torch._mlir import cai, ir
from coreai_torch.frontend.composite_names import DEFAULT_VERSION, is_op_name

_ATTR_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")


# ----------------------------------------------------------------------------- attributes ---


def attribute(value: Any, what: str = "attribute") -> ir.Attribute:
    """A Python value as an MLIR attribute of a composite declaration.

    ``bool`` -> ``true``/``false``, ``int`` -> ``si64``, ``float`` -> ``f32``, ``str`` -> string,
    ``torch.dtype`` -> its element type, enums -> their name, lists/tuples -> arrays.
    """
    if isinstance(value, bool):
        return ir.BoolAttr.get(value)
    if isinstance(value, int):
        if not -(2**63) <= value < 2**63:
            raise ValueError(f"{what} = {value} does not fit in a signed 64-bit integer")
        return ir.IntegerAttr.get(ir.IntegerType.get_signed(64), value)
    if isinstance(value, float):
        return ir.FloatAttr.get(ir.F32Type.get(), value)
    if isinstance(value, str):
        return ir.StringAttr.get(value)
    if isinstance(value, torch.dtype):
        return ir.TypeAttr.get(dtypes.to_mlir(value))
    if isinstance(value, Enum):
        return ir.StringAttr.get(value.name)
    if isinstance(value, (list, tuple, torch.Size)):
        return ir.ArrayAttr.get([attribute(v, f"{what}[{i}]") for i, v in enumerate(value)])
    raise TypeError(
        f"{what} has type {type(value).__name__} ({value!r}); composite op attributes must be "
        "bool, int, float, str, torch.dtype, an enum, or a list/tuple of those"
    )


def op_attributes(attrs: Mapping[str, Any] | None) -> dict[str, ir.Attribute]:
    """``attrs`` converted with :func:`attribute`; ``None`` values are left out and a
    ``version`` (default 1) is always present."""
    result: dict[str, ir.Attribute] = {}
    for name, value in (attrs or {}).items():
        if not isinstance(name, str) or not _ATTR_NAME.match(name):
            raise ValueError(f"composite op attribute name {name!r} is not an identifier")
        if value is None:
            continue
        if isinstance(value, ir.Attribute):
            result[name] = value
        else:
            result[name] = attribute(value, f"attribute '{name}'")
    result.setdefault("version", attribute(DEFAULT_VERSION))
    return dict(sorted(result.items()))


def _names(names: Sequence[str], what: str) -> list[str]:
    if isinstance(names, str) or not all(isinstance(n, str) and n for n in names):
        raise TypeError(f"{what} must be a list of non-empty strings, got {names!r}")
    return list(names)


def generate_composite_decl(
    op_name: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    op_attrs: Mapping[str, Any] | None = None,
) -> ir.Attribute:
    """Build ``#coreai.composite_declaration<"op_name" = {input_names, op_attrs, output_names}>``.

    ``op_attrs`` values may be Python values (see :func:`attribute`) or MLIR attributes;
    ``None`` values are omitted and ``version = 1`` is added unless given.  Needs an active
    MLIR context (as inside a lowering function).  Pass the result as ``composite_decl=`` to
    ``GraphOp(..., private=True, no_inline=True)``, or use :func:`emit_composite`.
    """
    if not isinstance(op_name, str) or not is_op_name(op_name):
        raise ValueError(
            f"composite op name {op_name!r} must start with a letter or '_' and contain only "
            "letters, digits, '_', '.' and ':'"
        )
    try:
        context = ir.Context.current
    except ValueError:
        context = None
    if context is None:
        raise RuntimeError(
            "generate_composite_decl needs an active MLIR context (call it inside a lowering)"
        )
    decl = ir.DictAttr.get(
        {
            "input_names": ir.ArrayAttr.get(
                [ir.StringAttr.get(n) for n in _names(input_names, "input_names")]
            ),
            "op_attrs": ir.DictAttr.get(op_attributes(op_attrs)),
            "output_names": ir.ArrayAttr.get(
                [ir.StringAttr.get(n) for n in _names(output_names, "output_names")]
            ),
        }
    )
    return ir.Attribute.parse(f'#coreai.composite_declaration<"{op_name}" = {decl}>')


# ------------------------------------------------------------------------ graph emission ---


class _Graphs:
    """The private graphs emitted in one MLIR context."""

    def __init__(self) -> None:
        #: content hash -> graph name (identical graphs are shared)
        self.by_digest: dict[str, str] = {}
        #: graph name -> (argument types, result types)
        self.types: dict[str, tuple[list[ir.Type], list[ir.Type]]] = {}
        #: free-form per-context memo for callers (e.g. externalized call -> graph name)
        self.memo: dict[Any, Any] = {}


_GRAPHS: weakref.WeakKeyDictionary[ir.Context, _Graphs] = weakref.WeakKeyDictionary()
_SYMBOL = re.compile(r"[^A-Za-z0-9_.]")


def graphs() -> _Graphs:
    """The registry of private graphs of the current MLIR context."""
    context = ir.Context.current
    cache = _GRAPHS.get(context)
    if cache is None:
        cache = _GRAPHS[context] = _Graphs()
    return cache


def _top_level_op(ip: ir.InsertionPoint) -> ir.Operation:
    """The op directly inside the module that contains the insertion point."""
    op = ip.block.owner.operation
    while op.parent is not None and op.parent.name != "builtin.module":
        op = op.parent
    if op.parent is None:
        raise RuntimeError("composite ops can only be emitted inside a coreai.graph")
    return op


def symbol_name(prefix: str) -> str:
    """``prefix`` made into a bare MLIR symbol name (letters, digits, '_' and '.')."""
    name = _SYMBOL.sub("_", prefix).strip(".") or "composite"
    return name if name[0].isalpha() or name[0] == "_" else f"_{name}"


def default_output_names(count: int) -> list[str]:
    return ["output"] if count == 1 else [f"output_{i}" for i in range(count)]


def build_graph(
    name: str,
    input_types: Sequence[ir.Type],
    input_names: Sequence[str],
    body: Callable[..., ir.Value | Sequence[ir.Value]],
    *,
    op_name: str | None = None,
    op_attrs: Mapping[str, Any] | None = None,
    output_names: Sequence[str] | None = None,
    private: bool = True,
) -> str:
    """Build a ``noinline`` graph (private unless said otherwise) and return its symbol name.

    The graph is inserted in front of the graph currently being built; ``body`` receives the
    graph arguments and returns the results.  With ``op_name`` the graph carries a composite
    declaration.  The name is ``name`` plus a hash of the graph's content; a graph identical
    to one already emitted is not duplicated (its name is returned instead).
    """
    input_names = _names(input_names, "input_names")
    if len(input_names) != len(input_types):
        raise ValueError(f"{len(input_types)} inputs but {len(input_names)} input names")
    cache = graphs()
    ip = ir.InsertionPoint.current
    pending = f"__pending_composite_{len(cache.types)}"
    with ir.InsertionPoint(_top_level_op(ip)):
        graph = cai.GraphOp(
            pending, list(input_types), [], input_names, private=private, no_inline=True
        )
    try:
        with graph.block:
            results = body(*graph.arguments)
            results = [results] if isinstance(results, ir.Value) else list(results)
            names = (
                default_output_names(len(results))
                if output_names is None
                else _names(output_names, "output_names")
            )
            if len(names) != len(results):
                raise ValueError(f"{len(results)} results but {len(names)} output names")
            graph.outputs_spec = list(zip(names, results, strict=True))
        if op_name is not None:
            graph.operation.attributes["composite_decl"] = generate_composite_decl(
                op_name, input_names, names, op_attrs
            )
    except BaseException:
        graph.operation.erase()
        raise
    graph.operation.attributes["sym_name"] = ir.StringAttr.get("__composite__")
    text = graph.operation.get_asm(assume_verified=True)
    digest = hashlib.sha256(text.encode()).hexdigest()
    existing = cache.by_digest.get(digest)
    if existing is not None:
        graph.operation.erase()
        return existing
    final = f"{symbol_name(name)}_{digest[:8]}"
    graph.operation.attributes["sym_name"] = ir.StringAttr.get(final)
    fn = ir.FunctionType(ir.TypeAttr(graph.operation.attributes["function_type"]).value)
    cache.by_digest[digest] = final
    cache.types[final] = (list(fn.inputs), list(fn.results))
    return final


def invoke(
    name: str, operands: Sequence[ir.Value], result_types: Sequence[ir.Type]
) -> list[ir.Value]:
    """``coreai.invoke @name(operands)``."""
    return list(cai.invoke(list(result_types), name, list(operands)))


def graph_types(name: str) -> tuple[list[ir.Type], list[ir.Type]]:
    """Argument and result types of the graph ``name`` built by :func:`build_graph`."""
    return graphs().types[name]


def call_graph(name: str, operands: Sequence[ir.Value]) -> list[ir.Value]:
    """Invoke graph ``name``, casting operands whose static shape differs from its arguments."""
    arg_types, result_types = graph_types(name)
    fixed = [
        v if v.type == t else cai.cast(v, ir.RankedTensorType(t))
        for v, t in zip(operands, arg_types, strict=True)
    ]
    return invoke(name, fixed, result_types)


def emit_composite(
    op_name: str | None,
    inputs: Sequence[ir.Value],
    body: Callable[..., ir.Value | Sequence[ir.Value]],
    *,
    input_names: Sequence[str],
    output_names: Sequence[str] | None = None,
    op_attrs: Mapping[str, Any] | None = None,
    name: str | None = None,
) -> list[ir.Value]:
    """Emit composite op ``op_name`` applied to ``inputs`` and return its results.

    Builds (or reuses) a private ``noinline`` graph whose body ``body(*arguments)`` emits, marked
    with ``generate_composite_decl(op_name, input_names, output_names, op_attrs)``, and calls it
    with ``coreai.invoke`` at the current insertion point.  ``op_name=None`` builds a plain
    private graph without declaration.  ``name`` (default ``op_name``) prefixes the graph's
    symbol name.  ``output_names`` defaults to ``["output"]`` or ``["output_0", ...]``.
    """
    inputs = list(inputs)
    graph = build_graph(
        name or op_name or "graph",
        [v.type for v in inputs],
        input_names,
        body,
        op_name=op_name,
        op_attrs=op_attrs,
        output_names=output_names,
    )
    _, result_types = graph_types(graph)
    return invoke(graph, inputs, result_types)
