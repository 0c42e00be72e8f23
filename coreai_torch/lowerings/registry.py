"""The lowering contract and registry: qualified op name -> lowering callback.

Every lowering — built-in or registered by a user with
``TorchConverter.register_torch_lowering`` — lands in a :class:`LoweringTable` as the
documented callback::

    fn(values_map: dict[str, Value], node: torch.fx.Node, loc: Location) -> Value | list[Value]

Keys are qualified names with the overload: ``"aten::add.Tensor"``,
``"my_lib::scaled_add.default"``, ``"higher_order::cond"``.

A rule may be written in that form directly (the simple form: operands through
:func:`get_operand`), or like the built-ins, ``rule(cx, **arguments)``: :func:`schema_bound`
binds the node's arguments to the op's schema (defaults filled in, tensors replaced by their
Core AI values, unsupported non-default arguments rejected) and passes the node's
:class:`LoweringContext` as ``cx``.  Built-ins register that way with :func:`lowering`, users
with ``register_torch_lowering(name, bind=True)``.  Either way the importer checks what the
rule returns (count, type, dtype and shape against PyTorch's).
"""

from __future__ import annotations

import inspect
import keyword
import operator
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from coreai_torch._mlir import ir
from coreai_torch.errors import LoweringError, UnsupportedOpError
from coreai_torch.frontend.schema import bind_arguments
from coreai_torch.ir.values import constant
from coreai_torch.ir.weights import WeightStore
from coreai_torch.locations import describe, qualified_name

LoweringFn = Callable[[dict[str, ir.Value], torch.fx.Node, ir.Location], Any]

RESERVED_NAMESPACES = ("aten", "higher_order", "coreai", "coreaix")
_QUALIFIED_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*::[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)?$")


def _packet_name(name: str) -> str | None:
    """``"ns::op"`` for ``"ns::op.overload"`` (None when there is no overload)."""
    namespace, sep, op = name.partition("::")
    if not sep or "." not in op:
        return None
    return f"{namespace}::{op.rsplit('.', 1)[0]}"


class LoweringTable:
    """A mapping from qualified op names to lowerings, optionally in front of a fallback table.

    A converter owns one table whose fallback is :data:`BUILTIN_LOWERINGS`; what it registers
    never leaks into other converters or into the built-in table.
    """

    def __init__(self, fallback: LoweringTable | None = None) -> None:
        self._rules: dict[str, LoweringFn] = {}
        self._fallback = fallback

    def register(self, name: str, fn: LoweringFn, *, allow_override: bool = False) -> None:
        if not allow_override and name in self._rules:
            raise ValueError(f"a lowering for '{name}' is already registered")
        self._rules[name] = fn

    def get(self, name: str) -> LoweringFn | None:
        """The lowering for ``name``: this table's own rule for the exact overload, then its
        rule for the whole op (registered without an overload), then the fallback's."""
        if name in self._rules:
            return self._rules[name]
        packet = _packet_name(name)
        if packet is not None and packet in self._rules:
            return self._rules[packet]
        return self._fallback.get(name) if self._fallback else None

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.get(name) is not None

    def is_own_node(self, node: torch.fx.Node) -> bool:
        """Whether one of this table's own rules (not the fallback's) lowers ``node``."""
        key = lowering_key(node)
        return key is not None and self.is_own(key)

    def is_free_of_own_rules(self, node: torch.fx.Node) -> bool:
        """Whether no rule of this table's own lowers ``node`` (only such nodes may be
        absorbed into composite ops or fused)."""
        return not self.is_own_node(node)

    def is_own(self, name: str) -> bool:
        """Whether ``name`` is lowered by a rule registered in this table (not the fallback)."""
        packet = _packet_name(name)
        return name in self._rules or (packet is not None and packet in self._rules)

    def own_names(self) -> list[str]:
        """Names registered directly in this table (not in the fallback)."""
        return list(self._rules)

    def names(self) -> set[str]:
        names = set(self._rules)
        if self._fallback:
            names |= self._fallback.names()
        return names

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self.names()))


#: The built-in lowerings, shared (read-only) by every converter.
BUILTIN_LOWERINGS = LoweringTable()


class EmptyTensor:
    """Stands for a zero-element value that never reaches the runtime (which aborts on them).

    The importer stores one in ``values_map`` instead of lowering a node whose static result
    has zero elements, when every consumer drops it at conversion time: a node that is empty
    too, or an op listed in :data:`EMPTY_INPUT_OPS` (e.g. an input of ``cat``).
    """

    def __init__(self, shape: Sequence[int], dtype: torch.dtype) -> None:
        self.shape = list(shape)
        self.dtype = dtype

    def __repr__(self) -> str:
        return f"EmptyTensor({self.shape}, {self.dtype})"


#: Ops whose rules accept :class:`EmptyTensor` operands, by qualified name -> argument
#: positions that may be empty (e.g. the inputs of ``cat``).
EMPTY_INPUT_OPS: dict[str, tuple[int, ...]] = {}


def check_user_lowering_name(
    qualified_name: str, table: LoweringTable, allow_override: bool
) -> None:
    """Validate a name given to ``register_torch_lowering`` (raises ``ValueError``)."""
    if not isinstance(qualified_name, str) or not _QUALIFIED_NAME.match(qualified_name):
        raise ValueError(
            f"lowering name {qualified_name!r} is not in 'namespace::op_name' form "
            "(e.g. 'my_lib::my_op.default'; ops defined with @torch.library.custom_op use the "
            "'.default' overload)"
        )
    namespace = qualified_name.split("::", 1)[0]
    if namespace in RESERVED_NAMESPACES and not allow_override:
        raise ValueError(
            f"namespace '{namespace}' of {qualified_name!r} is reserved for built-in lowerings "
            f"({', '.join(RESERVED_NAMESPACES)}); pass allow_override=True to replace a "
            "built-in lowering"
        )
    if qualified_name in table.own_names() and not allow_override:
        raise ValueError(
            f"a lowering for {qualified_name!r} is already registered on this converter; "
            "pass allow_override=True to replace it"
        )


# --------------------------------------------------------------------------------------------
# Schema-bound built-in rules
# --------------------------------------------------------------------------------------------

# Arguments a rule may ignore whatever their value: they do not change the numbers.
_HARMLESS_ARGS = frozenset(
    {
        "device",
        "layout",
        "pin_memory",
        "memory_format",
        "non_blocking",
        "requires_grad",
        "copy",
        "generator",
    }
)


@dataclass(frozen=True)
class LoweringOptions:
    """The conversion options lowerings follow (from ``TorchConverter``'s arguments)."""

    #: emit ``layer_norm``, ``rms_norm``, attention, ... as composite ops (else inline them)
    aten_composites: bool = True
    #: products and sums of 16-bit floats accumulate in float32, like ATen's
    #: (:mod:`coreai_torch.lowerings.helpers.accumulation`)
    fp32_accumulation: bool = True


class LoweringContext:
    """What a rule gets besides its arguments.

    * ``cx.node``, ``cx.loc``, ``cx.values_map``: the FX node, its location (active while the
      rule runs) and the values of the nodes lowered so far;
    * ``cx.out``, ``cx.out_dtype``, ``cx.out_shape``: PyTorch's result for the node (what the
      rule must return; the importer checks it);
    * ``cx.unsupported(why)``: the error to raise for a use of the op the rule cannot lower (it
      names the op, the node and the model's source line);
    * ``cx.options`` (:class:`LoweringOptions`) and ``cx.weights``: the conversion's options and
      weight store.

    Rules written like the built-ins receive it as ``cx``; a rule in the simple form
    ``fn(values_map, node, loc)`` can build one: ``LoweringContext(values_map, node, loc)``.
    """

    def __init__(self, values_map: dict[str, ir.Value], node: torch.fx.Node, loc: ir.Location):
        self.values_map = values_map
        self.node = node
        self.loc = loc
        builder = getattr(self.importer, "builder", None)
        #: the conversion's options (defaults outside a conversion)
        self.options: LoweringOptions = getattr(builder, "options", None) or LoweringOptions()
        #: the program's weights (None outside a ``TorchConverter`` conversion)
        self.weights: WeightStore | None = getattr(builder, "weights", None)

    @property
    def importer(self) -> Any:
        """The graph importer (constants, sub-graphs), when lowering inside coreai-torch."""
        return getattr(self.values_map, "importer", None)

    @property
    def out(self) -> Any:
        """The node's example output (a FakeTensor, a tuple of them, or a SymInt)."""
        return self.node.meta.get("val")

    @property
    def out_dtype(self) -> torch.dtype:
        val = self.out
        if isinstance(val, (list, tuple)):
            val = val[0]
        return val.dtype

    @property
    def out_shape(self) -> list[int | None]:
        """Output shape with ``None`` for dynamic dimensions."""
        val = self.out
        if isinstance(val, (list, tuple)):
            val = val[0]
        return [d if isinstance(d, int) else None for d in val.shape]

    def input_example(self, index: int) -> Any:
        """The example value (a FakeTensor) of the node's positional tensor argument
        ``index``, as PyTorch traced it."""
        arg = self.node.args[index]
        if not isinstance(arg, torch.fx.Node):
            raise self.unsupported(f"argument {index} is not a tensor")
        return arg.meta["val"]

    def unsupported(self, why: str) -> UnsupportedOpError:
        """An error to raise when the rule cannot lower this particular use of the op."""

        return UnsupportedOpError(f"{describe(self.node)}: {why}")


def _python_name(name: str) -> str:
    return f"{name}_" if keyword.iskeyword(name) else name


def _resolve(values_map: dict[str, ir.Value], arg: Any) -> Any:
    if isinstance(arg, torch.fx.Node):
        return values_map[arg.name]
    if isinstance(arg, (list, tuple)):
        return type(arg)(_resolve(values_map, a) for a in arg)
    return arg


def _defaults(schema: torch.FunctionSchema) -> dict[str, Any]:
    return {a.name: a.default_value for a in schema.arguments if a.has_default_value()}


def context_parameter_problem(rule: Callable[..., Any]) -> str | None:
    """Why ``rule(cx, ...)`` cannot take the context first (None if it can)."""
    params = list(inspect.signature(rule).parameters.values())
    if not params or params[0].kind not in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
        inspect.Parameter.VAR_POSITIONAL,
    ):
        return "it takes no positional first parameter for the LoweringContext (cx)"
    return None


def rule_parameter_problem(rule: Callable[..., Any], schema: torch.FunctionSchema) -> str | None:
    """Why ``rule(cx, **arguments)`` cannot take the arguments of ``schema`` (None if it can):
    no ``cx`` parameter, or a parameter the op does not have and that has no default."""
    problem = context_parameter_problem(rule)
    if problem is not None:
        return problem
    params = list(inspect.signature(rule).parameters.values())
    names = {_python_name(a.name) for a in schema.arguments}
    unknown = [
        p.name
        for p in params[1:]
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        and p.default is inspect.Parameter.empty
        and p.name not in names
    ]
    if params[0].name in names:
        unknown.insert(0, f"{params[0].name} (the first parameter receives the context, cx)")
    if not unknown:
        return None
    return (
        f"it declares {', '.join(unknown)}, which the op's schema does not have "
        f"(its arguments: {', '.join(_python_name(a.name) for a in schema.arguments)})"
    )


def schema_bound(rule: Callable[..., Any]) -> LoweringFn:
    """The documented callback for a rule written like a built-in: ``rule(cx, **arguments)``.

    The node's arguments are bound to the op's schema by name (defaults filled in; a Python
    keyword gets a trailing underscore, ``from_``): tensors arrive as Core AI values (lists of
    tensors as lists), everything else as Python values.  An argument the rule does not declare
    must keep its default (or be harmless, like ``device``); otherwise the node is reported as
    unsupported (:class:`~coreai_torch.errors.UnsupportedOpError`) instead of being lowered
    wrongly.  ``cx`` is the node's :class:`LoweringContext`.
    """
    params = inspect.signature(rule).parameters
    accepts_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    title = getattr(rule, "__qualname__", repr(rule))
    checked: set[Any] = set()  # the ops whose schema the rule's parameters were checked against

    def callback(values_map: dict[str, ir.Value], node: torch.fx.Node, loc: ir.Location) -> Any:
        cx = LoweringContext(values_map, node, loc)
        schema = getattr(node.target, "_schema", None)
        if schema is None:
            raise LoweringError(
                f"{describe(node)}: the lowering {title} takes the op's arguments by "
                "name, but the op has no schema to bind them to; write it in the simple form "
                "fn(values_map, node, loc)"
            )
        if node.target not in checked:
            problem = rule_parameter_problem(rule, schema)
            if problem is not None:
                raise LoweringError(
                    f"{describe(node)}: the lowering {title} cannot take the arguments of "
                    f"{qualified_name(node.target)}: {problem}"
                )
            checked.add(node.target)
        arguments = bind_arguments(node)
        defaults = _defaults(schema)
        kwargs: dict[str, Any] = {}
        for name, value in arguments.items():
            pname = _python_name(name)
            if accepts_all or pname in params:
                kwargs[pname] = _resolve(values_map, value)
            elif name not in _HARMLESS_ARGS and value != defaults.get(name, None):
                raise cx.unsupported(f"argument {name}={value!r} is not supported by this lowering")
        return rule(cx, **kwargs)

    callback.__name__ = getattr(rule, "__name__", "lowering")
    callback.__qualname__ = title
    callback.__doc__ = rule.__doc__
    callback.__wrapped__ = rule  # type: ignore[attr-defined]
    return callback


def lowering(*names: str, table: LoweringTable | None = None) -> Callable[[Callable], Callable]:
    """Register a built-in rule ``rule(cx, **schema_arguments)`` for ``names``
    (:func:`schema_bound`)."""
    target_table = table if table is not None else BUILTIN_LOWERINGS

    def decorate(rule: Callable) -> Callable:
        callback = schema_bound(rule)
        for name in names:
            target_table.register(name, callback)
        return rule

    return decorate


def raw_lowering(
    *names: str, table: LoweringTable | None = None
) -> Callable[[LoweringFn], LoweringFn]:
    """Register a rule that already has the documented ``fn(values_map, node, loc)`` form."""
    target_table = table if table is not None else BUILTIN_LOWERINGS

    def decorate(fn: LoweringFn) -> LoweringFn:
        for name in names:
            target_table.register(name, fn)
        return fn

    return decorate


# --------------------------------------------------------------------------------------------
# Operands of the simple form
# --------------------------------------------------------------------------------------------


def _scalar_dtype(node: torch.fx.Node, value: bool | int | float) -> torch.dtype:
    """The dtype a Python scalar operand should take inside ``node``."""
    tensor_dtypes = [
        a.meta["val"].dtype
        for a in node.all_input_nodes
        if isinstance(a.meta.get("val"), torch.Tensor)
    ]
    out = node.meta.get("val")
    if isinstance(out, torch.Tensor):
        tensor_dtypes.append(out.dtype)
    for dtype in tensor_dtypes:
        if isinstance(value, bool) and dtype == torch.bool:
            return dtype
        if isinstance(value, int) and not isinstance(value, bool) and not dtype.is_complex:
            return dtype
        if isinstance(value, float) and dtype.is_floating_point:
            return dtype
    if isinstance(value, bool):
        return torch.bool
    if isinstance(value, int):
        return torch.int64
    return torch.get_default_dtype()


_MISSING = object()


def _argument(node: torch.fx.Node, index: int) -> Any:
    """``node.args[index]``, or the keyword / schema default for that position."""
    if index < len(node.args):
        return node.args[index]
    schema = getattr(node.target, "_schema", None)
    if schema is not None and index < len(schema.arguments):
        argument = schema.arguments[index]
        if argument.name in node.kwargs:
            return node.kwargs[argument.name]
        if argument.has_default_value():
            return argument.default_value
    return _MISSING


def _value_of(values_map: dict[str, ir.Value], node: torch.fx.Node, index: int, arg: Any) -> Any:
    if isinstance(arg, torch.fx.Node):
        try:
            return values_map[arg.name]
        except KeyError:
            raise LoweringError(
                f"operand {index} of {describe(node)} ('{arg.name}') has no Core AI value yet"
            ) from None
    if isinstance(arg, (bool, int, float)):
        return constant(arg, _scalar_dtype(node, arg))
    if isinstance(arg, (list, tuple)) and all(isinstance(a, torch.fx.Node) for a in arg):
        return [_value_of(values_map, node, index, a) for a in arg]
    kind = "list" if isinstance(arg, (list, tuple)) else type(arg).__name__
    raise LoweringError(
        f"operand {index} of {describe(node)} is a {kind} ({arg!r}), not a tensor or a "
        "scalar; read it from node.args directly"
    )


def get_operand(
    values_map: dict[str, ir.Value], node: torch.fx.Node, index: int, loc: ir.Location | None = None
) -> ir.Value:
    """The Core AI value of positional argument ``index`` of ``node``.

    A tensor argument gives its value from ``values_map``; a Python scalar becomes a constant
    of the dtype of the tensors around it (``0.5`` next to ``float16`` tensors is a ``float16``
    constant); a list of tensors gives a list of values.  An argument passed by keyword or left
    at its default is found through the op's schema.
    """
    arg = _argument(node, index)
    if arg is _MISSING:
        raise LoweringError(
            f"{describe(node)} has {len(node.args)} positional argument(s); index {index} "
            "is out of range"
        )
    if loc is None:
        loc = ir.Location.current or ir.Location.unknown()
    with loc:
        return _value_of(values_map, node, index, arg)


def get_operands(
    values_map: dict[str, ir.Value],
    node: torch.fx.Node,
    indices: Sequence[int],
    loc: ir.Location | None = None,
) -> list[ir.Value]:
    """``[get_operand(values_map, node, i, loc) for i in indices]``."""
    return [get_operand(values_map, node, i, loc) for i in indices]


def resolve_op(name: str) -> torch._ops.OpOverload | None:
    """The torch op ``"namespace::op.overload"`` names, if it is defined now (else None)."""
    namespace, sep, rest = name.partition("::")
    op, dot, overload = rest.partition(".")
    if not (sep and dot):
        return None
    try:
        found = getattr(getattr(getattr(torch.ops, namespace), op), overload)
    except (AttributeError, RuntimeError):
        return None
    return found if isinstance(found, torch._ops.OpOverload) else None


def op_names(ops: Sequence[Any]) -> list[str]:
    """Qualified names for a list of OpOverloads (helper for registering op families)."""

    return [qualified_name(op) for op in ops]


#: Node targets the importer handles itself (no lowering needed).
STRUCTURAL = {operator.getitem}


def lowering_key(node: torch.fx.Node) -> str | None:
    """The registry key of a ``call_function`` node, or None for nodes handled structurally."""
    if node.op != "call_function" or node.target in STRUCTURAL:
        return None
    return qualified_name(node.target)
