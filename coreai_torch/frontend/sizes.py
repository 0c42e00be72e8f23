"""Symbolic sizes that could be 0 when the program runs (the Core AI runtime aborts on those).

The Core AI runtime kills the process (SIGILL, no Python exception) when an op consumes a
tensor with zero elements.  Static sizes are checked at conversion time (``importer``,
``hazards``); symbolic sizes are handled here, by where their value comes from:

* **Sizes the program's inputs determine** -- dimensions of inputs made dynamic with
  ``torch.export.Dim``, dynamic Python ``int`` arguments, and ``.item()`` of an input.  The
  converter records them (:class:`InputSizes`, on the entry point's signature) and
  :class:`coreai_torch.runtime.Session` evaluates them for every call: a feed outside the ranges
  the program was exported for, or one that makes a value some op consumes empty, is rejected
  with a ``ValueError`` before the runtime is called.
* **Sizes from ``.item()`` of computed values** (unbacked SymInts) cannot be known before the
  program runs, and Core AI has no run-time assertion op to stop it.  Every such size must be
  provably at least 1 from the ranges torch.export recorded (``torch._check(k >= 1)`` in the
  model becomes one); :func:`check_data_dependent_sizes` rejects the program at conversion time
  with a :class:`RuntimeHazardError` otherwise.

Values that are only returned (possibly through slices, transposes and casts) may be empty:
the runtime returns empty outputs without aborting (``flows_only_to_outputs``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import sympy
import torch
import torch.fx
from torch.export import ExportedProgram

from coreai_torch.errors import RuntimeHazardError
from coreai_torch.locations import describe, user_frame

_aten = torch.ops.aten
#: Consumers that only read the size of a (possibly empty) result.
SIZE_READERS = frozenset({_aten.sym_size.int, _aten.sym_numel.default})
#: Ops whose Core AI lowering (slice, shrink/expand_dims, transpose, cast) was verified to run
#: on a dynamically empty input without aborting.
VIEW_LIKE = frozenset(
    {
        _aten.slice.Tensor,
        _aten.select.int,
        _aten.squeeze.dims,
        _aten.squeeze.dim,
        _aten.unsqueeze.default,
        _aten.permute.default,
        _aten._to_copy.default,
        _aten.clone.default,
        _aten.alias.default,
    }
)
#: Consumers verified to run with a dynamically empty operand: a concatenation skips it (a
#: KV cache's rows before the new tokens, none in a prompt's first call).  Its own result is
#: checked like any other value.
EMPTY_OPERANDS_OK = frozenset({_aten.cat.default})
_ITEM = (_aten._local_scalar_dense.default, _aten.item.default)


def flows_only_to_outputs(node: torch.fx.Node) -> bool:
    """Whether ``node``'s result (possibly empty at run time) only flows to the outputs (or
    into concatenations, which skip it)."""
    for user in node.users:
        if user.op == "output" or user.target in SIZE_READERS | EMPTY_OPERANDS_OK:
            continue
        if user.target in VIEW_LIKE and flows_only_to_outputs(user):
            continue
        return False
    return True


def _graph_modules(ep: ExportedProgram) -> Iterable[torch.fx.GraphModule]:
    for _, module in ep.graph_module.named_modules():
        if isinstance(module, torch.fx.GraphModule):
            yield module


def _sym_expr(value: Any) -> sympy.Expr | None:
    """The sympy expression of a symbolic int (None for plain ints and other values)."""
    if isinstance(value, torch.SymInt):
        expr = value.node.expr
        return None if isinstance(expr, sympy.Integer) else expr
    return None


def _bound(value: Any) -> int | None:
    """A range bound as an int (None for +-infinity)."""
    if not getattr(value, "is_finite", True):
        return None
    try:
        number = int(value)
    except Exception:  # sympy infinities (int_oo) and non-numbers
        return None
    return number if abs(number) < 2**62 else None


def _range_text(lower: int | None, upper: int | None) -> str:
    return f"[{'-inf' if lower is None else lower}, {'inf' if upper is None else upper}]"


def _shape_text(val: torch.Tensor) -> str:
    return "(" + ", ".join(str(d) for d in val.shape) + ("," if val.dim() == 1 else "") + ")"


# ----------------------------------------------------------------- sizes inputs determine ----


@dataclass(frozen=True)
class SizeBinding:
    """A fed quantity that is a symbolic size: a dimension, a dynamic int or an ``.item()``."""

    input: str  # runtime input name
    kind: str  # "dim", "int" or "item"
    dim: int | None
    expr: sympy.Expr

    def describe(self) -> str:
        if self.kind == "dim":
            return f"dimension {self.dim} of input '{self.input}'"
        if self.kind == "item":
            return f"the value of input '{self.input}' (read with .item())"
        return f"input '{self.input}'"

    def read(self, array: Any) -> int:
        if self.kind == "dim":
            return int(array.shape[self.dim])
        values = np.asarray(array.numpy() if hasattr(array, "numpy") else array)
        return int(values.reshape(-1)[0])


@dataclass(frozen=True)
class SizeUse:
    """A symbolic size of a value that some op consumes (so it must not be 0)."""

    expr: sympy.Expr
    where: str  # describe(node)
    shape: tuple[int | sympy.Expr, ...]


INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
#: Entries of the table the first ``.item()`` guard gathers from; guard ``j`` of an entry point
#: uses ``GUARD_TABLE + j`` entries, so the runtime's error ("Index i is out of range [-n, n)")
#: tells which guard failed and ``i`` encodes the value (see ``lowerings.symbolic.item``).
GUARD_TABLE = 251
_OUT_OF_RANGE = re.compile(r"Index (-?\d+) is out of range \[-(\d+), (\d+)\)")


@dataclass(frozen=True)
class ItemGuard:
    """A run-time check that an ``.item()`` value lies in the range torch.export recorded.

    Core AI has no assertion op; the lowering of ``.item()`` gathers from a table of
    ``table`` entries at index 0 when the value is in range and at ``+-(table + 1) * excess``
    otherwise, which makes the runtime fail with a recoverable error before the value is used.
    """

    node: str
    lower: int | None
    upper: int | None
    table: int
    where: str

    @property
    def most(self) -> int:
        """The largest excess the gather index encodes exactly (larger ones are clamped)."""
        return min(INT32_MAX // (self.table + 1) - 1, 2**24)

    def value(self, index: int) -> str:
        """The ``.item()`` value that made the guard gather at ``index``, as text."""
        excess = index // (self.table + 1)
        if excess < 0:
            limit = self.lower if self.lower is not None else 0
            return f"at most {limit + excess}" if -excess >= self.most else str(limit + excess)
        limit = self.upper if self.upper is not None else 0
        return f"at least {limit + excess}" if excess >= self.most else str(limit + excess)


@dataclass
class InputSizes:
    """What :class:`~coreai_torch.runtime.Session` checks about the feeds of one entry point."""

    bindings: list[SizeBinding] = field(default_factory=list)
    #: expression (usually a symbol) -> (lower, upper) bounds the program was exported for
    ranges: dict[sympy.Expr, tuple[int | None, int | None]] = field(default_factory=dict)
    uses: list[SizeUse] = field(default_factory=list)
    #: run-time range checks of the .item() values of the main graph
    guards: list[ItemGuard] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.bindings or self.guards)

    def guard(self, node: str) -> ItemGuard | None:
        """The range check of ``.item()`` node ``node``, if it has one."""
        return next((g for g in self.guards if g.node == node), None)

    def explain(self, error: BaseException, entrypoint: str) -> ValueError | None:
        """The failed ``.item()`` range check behind a runtime error, as a ``ValueError``."""
        match = _OUT_OF_RANGE.search(str(error))
        if not match or "gather_nd" not in str(error):
            return None
        table = int(match.group(3))
        guard = next((g for g in self.guards if g.table == table), None)
        if guard is None:
            return None
        value = guard.value(int(match.group(1)))
        return ValueError(
            f"'{entrypoint}': the value read with .item() by {guard.where} was {value} when "
            f"the program ran, outside the range {_range_text(guard.lower, guard.upper)} the "
            "model's torch._check calls allow (PyTorch raises for these inputs too); the "
            "program stopped before using it. Feed inputs for which the checks hold, or "
            "change the torch._check calls and export again."
        )

    def check(self, feeds: Mapping[str, Any], entrypoint: str) -> None:
        """Raise ``ValueError`` for feeds the runtime would abort on or that are outside the
        ranges the program was exported for."""
        symbols: dict[sympy.Symbol, int] = {}
        origin: dict[sympy.Symbol, SizeBinding] = {}
        pending: list[tuple[SizeBinding, int]] = []
        for binding in self.bindings:
            if binding.input not in feeds:
                continue
            fed = binding.read(feeds[binding.input])
            self._check_range(binding, fed, entrypoint)
            if isinstance(binding.expr, sympy.Symbol):
                known = symbols.get(binding.expr)
                if known is not None and known != fed:
                    raise ValueError(
                        f"'{entrypoint}': {binding.describe()} is {fed} but "
                        f"{origin[binding.expr].describe()} is {known}; the program was exported "
                        f"with both equal (the same torch.export.Dim). Feed equal sizes."
                    )
                symbols[binding.expr] = fed
                origin[binding.expr] = binding
            else:
                pending.append((binding, fed))
        for binding, fed in pending:  # derived dims (e.g. 2 * batch): solve, then compare
            unknown = [s for s in binding.expr.free_symbols if s not in symbols]
            if len(unknown) == 1:
                try:
                    solutions = sympy.solve(sympy.Eq(binding.expr, fed), unknown[0])
                except Exception:  # e.g. FloorDiv/Mod sympy cannot invert: compare below
                    solutions = []
                whole = [s for s in solutions if s.is_integer]
                if whole:
                    symbols[unknown[0]] = int(whole[0])
                    origin[unknown[0]] = binding
            value = self._evaluate(binding.expr, symbols)
            if value is not None and value != fed:
                legend = ", ".join(
                    f"{s} being {origin[s].describe()} = {symbols[s]}"
                    for s in sorted(binding.expr.free_symbols, key=str)
                )
                raise ValueError(
                    f"'{entrypoint}': {binding.describe()} is {fed}, but the program was "
                    f"exported with it equal to {binding.expr} = {value} ({legend}; a derived "
                    "torch.export.Dim). Feed sizes that satisfy the relation."
                )
        for expr, (lower, upper) in self.ranges.items():
            value = self._evaluate(expr, symbols)
            if value is None or (
                (lower is None or value >= lower) and (upper is None or value <= upper)
            ):
                continue
            sources = ", ".join(
                f"{origin[s].describe()} = {symbols[s]}"
                for s in sorted(expr.free_symbols, key=str)
                if s in origin
            )
            raise ValueError(
                f"'{entrypoint}': the size {expr} = {value} ({sources}) is outside the range "
                f"{_range_text(lower, upper)} the program was exported for. Feed values "
                "within the range, or export again with wider bounds."
            )
        for use in self.uses:
            value = self._evaluate(use.expr, symbols)
            if value is None or value > 0:
                continue
            ordered = sorted(use.expr.free_symbols, key=str)
            fed_sizes = ", ".join(f"{origin[s].describe()} = {symbols[s]}" for s in ordered)
            legend = ", ".join(f"{s} being {origin[s].describe()}" for s in ordered)
            shape = tuple(
                d if isinstance(d, int) else self._evaluate(d, symbols) for d in use.shape
            )
            raise ValueError(
                f"'{entrypoint}': with {fed_sizes}, {use.where} would have zero elements (shape "
                f"{shape}); the Core AI runtime aborts the process when an op consumes an empty "
                "tensor, so the program was not run. Feed values that keep its size "
                f"{use.expr} at least 1 ({legend}), or reject such values in the model with "
                "torch._check(... >= 1) on that size and export again."
            )

    def _check_range(self, binding: SizeBinding, fed: int, ep: str) -> None:
        if binding.expr not in self.ranges:
            return
        lower, upper = self.ranges[binding.expr]
        if (lower is None or fed >= lower) and (upper is None or fed <= upper):
            return
        why = {
            "dim": "its torch.export.Dim bounds",
            "int": "the range torch.export derived for this dynamic int",
            "item": "the model's torch._check calls on the .item() value; PyTorch raises too",
        }[binding.kind]
        raise ValueError(
            f"'{ep}': {binding.describe()} is {fed}, outside the range "
            f"{_range_text(lower, upper)} the program was exported for ({why}). Feed a value "
            "within the range, or export again with other bounds."
        )

    @staticmethod
    def _evaluate(expr: sympy.Expr, symbols: Mapping[sympy.Symbol, int]) -> int | None:
        if not expr.free_symbols <= set(symbols):
            return None
        try:
            value = expr.xreplace({s: sympy.Integer(v) for s, v in symbols.items()})
            return int(value)
        except Exception:  # not a number (e.g. a division by zero in the expression)
            return None


def input_sizes(ep: ExportedProgram, inputs: Mapping[str, str]) -> InputSizes:
    """Record the symbolic sizes ``ep``'s runtime inputs determine.

    ``inputs`` maps the placeholder names of the runtime inputs to their input names.
    """
    result = InputSizes()
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    for node_name, name in inputs.items():
        val = placeholders[node_name].meta.get("val")
        if isinstance(val, torch.Tensor):
            for d, size in enumerate(val.shape):
                expr = _sym_expr(size)
                if expr is not None:
                    result.bindings.append(SizeBinding(name, "dim", d, expr))
        elif (expr := _sym_expr(val)) is not None:
            result.bindings.append(SizeBinding(name, "int", None, expr))
    for expr, bounds in ep.range_constraints.items():
        result.ranges[expr] = (_bound(bounds.lower), _bound(bounds.upper))
    for node in ep.graph.nodes:
        expr = _sym_expr(node.meta.get("val")) if node.target in _ITEM else None
        if not isinstance(expr, sympy.Symbol):
            continue
        source = node.args[0] if node.args else None
        if isinstance(source, torch.fx.Node) and source.name in inputs:
            result.bindings.append(SizeBinding(inputs[source.name], "item", None, expr))
        lower, upper = result.ranges.get(expr, (None, None))
        lower = lower if lower is not None and lower > INT32_MIN else None
        upper = upper if upper is not None and upper < INT32_MAX else None
        if lower is not None or upper is not None:
            table = GUARD_TABLE + len(result.guards)
            result.guards.append(ItemGuard(node.name, lower, upper, table, describe(node)))
    if not result.bindings:
        return result
    bound = set().union(*(b.expr.free_symbols for b in result.bindings))
    seen: set[sympy.Expr] = set()
    for gm in _graph_modules(ep):
        for node in gm.graph.nodes:
            val = node.meta.get("val")
            if node.op != "call_function" or not isinstance(val, torch.Tensor):
                continue
            exprs = [e for e in map(_sym_expr, val.shape) if e is not None]
            new = [e for e in exprs if e not in seen and e.free_symbols <= bound]
            if new and not flows_only_to_outputs(node):
                for expr in new:
                    seen.add(expr)
                    shape = tuple(d if isinstance(d, int) else d.node.expr for d in val.shape)
                    result.uses.append(SizeUse(expr, describe(node), shape))
    return result


# ------------------------------------------------------------- sizes from .item() values ----

_ASSIGNED = re.compile(r"^\s*(\w+)\s*(?::[^=]+)?=[^=].*\.(?:item|tolist)\(\)")


def _item_symbols(ep: ExportedProgram) -> dict[sympy.Symbol, torch.fx.Node]:
    found: dict[sympy.Symbol, torch.fx.Node] = {}
    for gm in _graph_modules(ep):
        for node in gm.graph.nodes:
            if node.target in _ITEM:
                expr = _sym_expr(node.meta.get("val"))
                if isinstance(expr, sympy.Symbol):
                    found.setdefault(expr, node)
    return found


def _variable(node: torch.fx.Node) -> str | None:
    """The Python variable the user assigned an ``.item()`` to (``k`` in ``k = n.item()``)."""
    frame = user_frame(node)
    match = _ASSIGNED.match(frame.code) if frame and frame.code else None
    return match.group(1) if match else None


def check_data_dependent_sizes(ep: ExportedProgram, entrypoint: str) -> None:
    """Reject values whose size comes from ``.item()`` and may be 0 when the program runs,
    unless they are only returned (see module docstring)."""
    items = _item_symbols(ep)
    if not items:
        return
    from torch.utils._sympy.value_ranges import bound_sympy

    ranges = dict(ep.range_constraints)
    problems: list[str] = []
    conditions: list[str] = []
    for gm in _graph_modules(ep):
        for node in gm.graph.nodes:
            val = node.meta.get("val")
            if node.op != "call_function" or not isinstance(val, torch.Tensor):
                continue
            for size in val.shape:
                expr = _sym_expr(size)
                if expr is None or not expr.free_symbols & set(items):
                    continue
                lower = bound_sympy(expr, ranges).lower
                if (_bound(lower) is not None and lower >= 1) or flows_only_to_outputs(node):
                    continue
                sources = []
                names: dict[sympy.Symbol, sympy.Symbol] = {}
                for symbol in sorted(expr.free_symbols & set(items), key=str):
                    item = items[symbol]
                    frame = user_frame(item)
                    known = ranges.get(symbol)
                    span = _range_text(_bound(known.lower), _bound(known.upper)) if known else "?"
                    variable = _variable(item)
                    if variable:
                        names[symbol] = sympy.Symbol(variable, integer=True)
                    at = f" at {frame}" if frame else ""
                    sources.append(f"{symbol} = .item(){at}; exported range {span}")
                condition = f"torch._check({expr.xreplace(names)} >= 1)"
                conditions.append(condition)
                problems.append(
                    f"  - {describe(node)}: size {expr} of shape {_shape_text(val)} can be "
                    f"{_bound(lower) if _bound(lower) is not None else 'negative'} "
                    f"({'; '.join(sources)})"
                )
                break
    if not problems:
        return
    listed = "\n".join(problems[:10])
    more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
    raise RuntimeHazardError(
        f"entry point '{entrypoint}': {len(problems)} value(s) have a size computed from "
        ".item() that may be 0 when the program runs, and the Core AI runtime aborts the "
        f"process when an op consumes an empty tensor:\n{listed}{more}\n"
        "Tell torch.export that the size is at least 1 and export again: add "
        f"{conditions[0]} right after the .item() call in the model (torch.export turns "
        "torch._check into a range constraint). Only returning such a value (possibly sliced "
        "or cast) is allowed without it."
    )
