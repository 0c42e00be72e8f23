"""Externalization: marked submodules become private graphs called with ``coreai.invoke``.

How a submodule boundary survives ``torch.export``:

1. While ``export_fn`` runs, every instance of an externalized class has its ``forward``
   replaced by a wrapper that calls one opaque custom op, ``coreai_torch::externalized``,
   with the forward's tensor arguments followed by the module's parameters and buffers, and a
   key naming the call.  The op's implementation (eager and fake) runs the original forward,
   so export sees the right shapes; ``run_decompositions`` leaves the op alone, so it stays a
   single node of the exported program.  Buffers or arguments the forward mutates in place
   are returned as extra results and copied back by the wrapper, so export records the
   mutation (the program's state machinery then handles it like any other).
2. When the program is converted, the op's lowering exports the submodule on its own (with the
   same argument shapes and dtypes), lowers that program into a private ``noinline`` graph
   (a composite op for an ``ExternalizeSpec`` with ``composite_op_name``) and emits a
   ``coreai.invoke`` of it.  Instances configured identically share one export; identical
   graphs are emitted once.  Externalized modules may contain other externalized modules.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import warnings
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
import torch.fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode

from coreai_torch.errors import (
    ConversionError,
    ExternalizationError,
)
from coreai_torch.frontend.composite_names import DEFAULT_VERSION, is_op_name
from coreai_torch.frontend.export import get_decomp_table
from coreai_torch.locations import clean_module_path
from coreai_torch.torch_compat import run_decompositions

# ----------------------------------------------------------------------------------- spec ---


@dataclass
class ExternalizeSpec:
    """Which submodule class to externalize, and as which composite op.

    ``target_class``: the ``nn.Module`` subclass to match; every instance in the model (the
    root module included) is externalized into its own graph.
    ``composite_op_name``: if set, the graph is marked as this named composite op so the
    compiler can recognise and optimize it; if ``None`` the graph is a plain boundary
    (simple externalization, experimental).
    ``composite_attrs``: names of instance attributes recorded as the composite op's
    attributes (with ``version``, taken from the instance's ``version`` attribute or 1).
    """

    target_class: type
    composite_op_name: str | None = None
    composite_attrs: list[str] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.target_class, nn.Module):
            cls = type(self.target_class).__qualname__
            raise TypeError(
                f"ExternalizeSpec.target_class must be an nn.Module subclass, got an instance "
                f"of {cls}; pass the class {cls}, not an instance (every instance in the model "
                "is externalized)"
            )
        if not (isinstance(self.target_class, type) and issubclass(self.target_class, nn.Module)):
            raise TypeError(
                "ExternalizeSpec.target_class must be an nn.Module subclass, got "
                f"{self.target_class!r}"
            )
        name = self.composite_op_name
        if name is not None and (not isinstance(name, str) or not is_op_name(name)):
            raise ValueError(
                f"ExternalizeSpec.composite_op_name {self.composite_op_name!r} must be a "
                "non-empty name made of letters, digits, '_', '.' or ':' (e.g. 'rms_norm')"
            )
        if self.composite_attrs is not None:
            attrs = self.composite_attrs
            if isinstance(attrs, str) or not all(isinstance(a, str) and a for a in attrs):
                raise TypeError(
                    "ExternalizeSpec.composite_attrs must be a list of attribute names "
                    f"(non-empty strings, e.g. ['eps']), got {attrs!r}"
                )
            if len(set(attrs)) != len(attrs):
                twice = sorted({a for a in attrs if attrs.count(a) > 1})
                raise ValueError(
                    f"ExternalizeSpec.composite_attrs lists {', '.join(map(repr, twice))} more "
                    f"than once: {attrs}; list each attribute once"
                )
            if self.composite_op_name is None:
                raise ValueError(
                    "ExternalizeSpec.composite_attrs needs composite_op_name: attributes are "
                    "only recorded on composite ops"
                )
            self.composite_attrs = list(attrs)

    @property
    def is_composite(self) -> bool:
        return self.composite_op_name is not None


def normalize_specs(specs: Any) -> list[ExternalizeSpec]:
    """``externalize_modules`` as ``ExternalizeSpec``s (bare classes = simple externalization)."""
    if isinstance(specs, (ExternalizeSpec, type)) or not isinstance(specs, (list, tuple)):
        raise TypeError(
            "externalize_modules must be a list of ExternalizeSpec objects (or nn.Module "
            f"classes), got {type(specs).__name__}"
        )
    result: list[ExternalizeSpec] = []
    for item in specs:
        if isinstance(item, ExternalizeSpec):
            result.append(item)
        elif isinstance(item, type) and issubclass(item, nn.Module):
            result.append(ExternalizeSpec(item))
        else:
            raise TypeError(
                "externalize_modules entries must be ExternalizeSpec objects or nn.Module "
                f"subclasses, got {item!r}"
            )
    seen: dict[type, ExternalizeSpec] = {}
    for spec in result:
        if spec.target_class in seen:
            raise ValueError(
                f"externalize_modules lists {spec.target_class.__qualname__} more than once; "
                "give one ExternalizeSpec per class (it applies to every instance)"
            )
        seen[spec.target_class] = spec
    return result


# ------------------------------------------------------------------------ the custom op ---

_MISSING = object()
_CALLS: weakref.WeakValueDictionary[str, ExternalizedCall] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


def call_for_key(key: str) -> ExternalizedCall:
    call = _CALLS.get(key)
    if call is None:
        raise ConversionError(
            f"externalized module call '{key}' is unknown: programs with externalized "
            "submodules can only be run or converted while the TorchConverter that staged "
            "them (add_pytorch_module) is alive; keep a reference to that converter, or stage "
            "the module again with add_pytorch_module(..., externalize_modules=...)"
        )
    return call


@torch.library.custom_op("coreai_torch::externalized", mutates_args=())
def externalized(operands: list[torch.Tensor | None], key: str) -> list[torch.Tensor]:
    """One call of an externalized submodule (see the module docstring)."""
    return call_for_key(key).execute(operands)


@externalized.register_fake
def _externalized_fake(operands: list[torch.Tensor | None], key: str) -> list[torch.Tensor]:
    return call_for_key(key).execute(operands)


class _WriteRecorder(TorchDispatchMode):
    """Records the storages that in-place / out= ops write to."""

    def __init__(self) -> None:
        super().__init__()
        self.written: set[StorageWeakRef] = set()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        schema = getattr(func, "_schema", None)
        if schema is not None:
            for i, arg in enumerate(schema.arguments):
                if arg.alias_info is None or not arg.alias_info.is_write:
                    continue
                value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
                for t in value if isinstance(value, (list, tuple)) else [value]:
                    if isinstance(t, torch.Tensor):
                        self.written.add(StorageWeakRef(t.untyped_storage()))
        return func(*args, **kwargs)

    def wrote(self, tensor: torch.Tensor) -> bool:
        return StorageWeakRef(tensor.untyped_storage()) in self.written


# ------------------------------------------------------------------------------ targets ---


class _Slot:
    """Placeholder for the i-th tensor in a recorded argument / output structure."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"<tensor {self.index}>"


def _present(operand: torch.Tensor | None, label: str) -> torch.Tensor:
    """An operand of an externalized call, which the module's forward needs as a tensor."""
    if operand is None:
        raise ExternalizationError(f"{label} got None for one of its tensor operands")
    return operand


def _fill(structure: Any, tensors: Sequence[Any]) -> Any:
    return pytree.tree_map(
        lambda x: tensors[x.index] if isinstance(x, _Slot) else x,
        structure,
        is_leaf=lambda x: isinstance(x, _Slot),
    )


def _key_name(key: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _meta(t: torch.Tensor) -> tuple[Any, ...]:
    shape = tuple(d if isinstance(d, int) else ("sym", str(d)) for d in t.shape)
    return (t.dtype, shape)


def _hint(d: Any) -> int:
    if isinstance(d, int):
        return d
    hint = getattr(getattr(d, "node", None), "hint", None)
    return int(hint) if hint is not None else 2


_ATTR_TYPES = (bool, int, float, str, torch.dtype, Enum)


def _check_attr_value(value: Any) -> bool:
    if value is None or isinstance(value, _ATTR_TYPES):
        return True
    if isinstance(value, (list, tuple, torch.Size)):
        return all(v is not None and _check_attr_value(v) for v in value)
    return False


def _freeze(value: Any, depth: int = 0) -> Hashable:
    """A hashable summary of a module attribute for sharing exports between instances."""
    if value is None or isinstance(value, (bool, int, str, torch.dtype, torch.device)):
        return (type(value).__name__, value)
    if isinstance(value, float):
        return ("float", repr(value))
    if isinstance(value, Enum):
        return ("enum", type(value).__qualname__, value.name)
    if depth < 4 and isinstance(value, (list, tuple, torch.Size)):
        return (type(value).__name__, tuple(_freeze(v, depth + 1) for v in value))
    if depth < 4 and isinstance(value, (set, frozenset)):
        return (type(value).__name__, tuple(sorted(repr(_freeze(v, depth + 1)) for v in value)))
    if depth < 4 and isinstance(value, dict):
        return ("dict", tuple((repr(k), _freeze(v, depth + 1)) for k, v in value.items()))
    return ("object", id(value))


_MODULE_INTERNALS = {"_parameters", "_buffers", "_modules", "forward"}


def _fingerprint(module: nn.Module) -> Hashable:
    """Instances with equal fingerprints trace to the same graph (weights aside)."""
    parts = []
    for name, sub in module.named_modules():
        attrs = tuple(
            (k, _freeze(v)) for k, v in sorted(vars(sub).items()) if k not in _MODULE_INTERNALS
        )
        tensors = tuple(
            (n, tuple(t.shape), t.dtype, t.requires_grad)
            for n, t in itertools.chain(
                sub.named_parameters(recurse=False), sub.named_buffers(recurse=False)
            )
            if t is not None
        )
        parts.append((name, type(sub), attrs, tensors))
    return tuple(parts)


class ExternalizedModule:
    """One externalized submodule instance."""

    def __init__(
        self, plan: ExternalizationPlan, module: nn.Module, path: str, spec: ExternalizeSpec
    ) -> None:
        self.plan = plan
        self.module = module
        self.path = path
        self.spec = spec
        self.original_forward = module.forward
        self.signature = inspect.signature(self.original_forward)
        self.param_names = [n for n, _ in module.named_parameters()]
        self.buffer_names = [n for n, _ in module.named_buffers()]
        self.calls: dict[Any, ExternalizedCall] = {}
        #: the instance's own ``forward`` attribute while the wrapper is installed
        self.saved: Any = _MISSING
        self._fingerprint: Hashable | None = None
        self._validate()

    @property
    def label(self) -> str:
        where = f"at '{self.path}'" if self.path else "(the root module)"
        return f"{type(self.module).__qualname__} {where}"

    @property
    def state_names(self) -> list[str]:
        return self.param_names + self.buffer_names

    def state_tensors(self) -> list[torch.Tensor]:
        return [self.state_tensor(n) for n in self.state_names]

    def state_tensor(self, name: str) -> torch.Tensor:
        """A parameter or buffer by name (also while swapped for plain tensors)."""
        owner, _, attr = name.rpartition(".")
        tensor: torch.Tensor = getattr(
            self.module.get_submodule(owner) if owner else self.module, attr
        )
        return tensor

    @property
    def fingerprint(self) -> Hashable:
        if self._fingerprint is None:
            self._fingerprint = (id(self.spec), _fingerprint(self.module))
        return self._fingerprint

    def _validate(self) -> None:
        spec = self.spec
        if not spec.is_composite:
            return
        for attr in spec.composite_attrs or []:
            if not hasattr(self.module, attr):
                available = sorted(
                    k
                    for k, v in vars(self.module).items()
                    if not k.startswith("_") and k != "training" and _check_attr_value(v)
                )
                raise ExternalizationError(
                    f"composite_attrs of the '{spec.composite_op_name}' ExternalizeSpec names "
                    f"'{attr}', which is not an attribute of {self.label}; composite_attrs must "
                    f"name instance attributes (available: {', '.join(available) or 'none'})"
                )
            value = getattr(self.module, attr)
            if not _check_attr_value(value):
                raise ExternalizationError(
                    f"composite attribute '{attr}' of {self.label} is a "
                    f"{type(value).__name__}; composite op attributes must be bool, int, "
                    "float, str, torch.dtype, an enum, None, or a list/tuple of those "
                    "(tensors are inputs: pass them to forward() or register them as "
                    "parameters/buffers)"
                )
        version = getattr(self.module, "version", DEFAULT_VERSION)
        if not isinstance(version, int) or isinstance(version, bool):
            raise ExternalizationError(
                f"the 'version' attribute of {self.label} must be an int, got {version!r}"
            )
        for param in self.signature.parameters.values():
            if isinstance(param.default, torch.Tensor):
                raise ExternalizationError(
                    f"forward() argument '{param.name}' of {self.label} has a tensor default "
                    "value; composite op modules have no default tensor values: declare "
                    f"optional tensors as `{param.name}: torch.Tensor | None = None`"
                )

    def op_attrs(self) -> dict[str, Any]:
        attrs = {a: getattr(self.module, a) for a in self.spec.composite_attrs or []}
        attrs.setdefault("version", getattr(self.module, "version", DEFAULT_VERSION))
        return attrs

    # -- calls -------------------------------------------------------------------------------

    def bind(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[ExternalizedCall, list[torch.Tensor]]:
        """The recorded call matching these arguments (created on first use) and its tensors."""
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as error:
            raise ExternalizationError(f"cannot call {self.label}: {error}") from error
        tensors: list[torch.Tensor] = []
        names: list[str] = []
        structure: dict[str, Any] = {}
        composite_op = self.spec.is_composite
        for name, value in bound.arguments.items():
            kind = self.signature.parameters[name].kind
            if isinstance(value, torch.Tensor):
                structure[name] = _Slot(len(tensors))
                tensors.append(value)
                names.append(name)
                continue
            if value is None:
                structure[name] = None
                continue
            leaves, spec = pytree.tree_flatten_with_path(value)
            if composite_op and kind not in (
                inspect.Parameter.VAR_POSITIONAL,
                inspect.Parameter.VAR_KEYWORD,
            ):
                raise ExternalizationError(
                    f"forward() argument '{name}' of {self.label} is a "
                    f"{type(value).__name__} ({_short(value)}){_call_site()}; composite op "
                    "forward arguments must be tensors. Store scalar configuration as an "
                    "instance attribute and list it in ExternalizeSpec.composite_attrs"
                )
            new_leaves = []
            for path, leaf in leaves:
                keys = [_key_name(k) for k in path]
                leaf_name = "_".join(
                    keys if kind is inspect.Parameter.VAR_KEYWORD else [name, *keys]
                )
                if isinstance(leaf, torch.Tensor):
                    new_leaves.append(_Slot(len(tensors)))
                    tensors.append(leaf)
                    names.append(leaf_name)
                elif composite_op and leaf is not None:
                    raise ExternalizationError(
                        f"forward() argument '{leaf_name}' of {self.label} is a "
                        f"{type(leaf).__name__} ({_short(leaf)}){_call_site()}; composite op "
                        "forward arguments must be tensors. Store scalar configuration as an "
                        "instance attribute and list it in ExternalizeSpec.composite_attrs"
                    )
                else:
                    new_leaves.append(leaf)
            structure[name] = pytree.tree_unflatten(new_leaves, spec)
        descriptor = (repr(structure), tuple(_meta(t) for t in tensors))
        call = self.calls.get(descriptor)
        if call is None:
            call = ExternalizedCall(self, descriptor, structure, names, tensors)
            self.calls[descriptor] = call
        return call, tensors

    def counterpart(self, call: ExternalizedCall) -> ExternalizedCall:
        """This instance's call matching ``call`` of an identically configured instance."""
        found = self.calls.get(call.descriptor)
        if found is None:
            found = ExternalizedCall(self, call.descriptor, call.structure, call.input_names, [])
            found.metas = call.metas
            found.record(call.output_structure, call.output_names, call.mutated)
            self.calls[call.descriptor] = found
        return found

    def wrapper(self) -> Callable[..., Any]:
        """The forward installed on the instance (with the original's signature)."""

        @functools.wraps(self.original_forward)
        def forward(*args: Any, **kwargs: Any) -> Any:
            return self.forward(*args, **kwargs)

        allowed: Callable[..., Any] = torch._dynamo.allow_in_graph(forward)
        return allowed

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Call the externalized op in place of the original forward (hooks stay outside)."""
        call, tensors = self.bind(args, kwargs)
        results = externalized([*tensors, *self.state_tensors()], call.key)
        n_out = call.num_outputs
        with torch.no_grad():
            for (kind, ref), new in zip(call.mutated, results[n_out:], strict=True):
                target = self.state_tensor(ref) if kind == "state" else tensors[ref]
                target.copy_(new)
        return _fill(call.output_structure, results[:n_out])


def _call_site() -> str:
    """`` (called at file:line: code)`` for the innermost user frame calling a module."""
    import os
    import traceback

    skip = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(__file__) + os.sep)
    for frame in reversed(traceback.extract_stack()):
        if not frame.filename.startswith(skip) and not frame.filename.startswith("<"):
            code = f": {frame.line.strip()}" if frame.line else ""
            return f" (called at {frame.filename}:{frame.lineno}{code})"
    return ""


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass
class SubProgram:
    """The export of one externalized call (shared by identically configured instances)."""

    ep: ExportedProgram
    #: the instance that was exported (its nested externalized calls are in the program)
    owner: ExternalizedModule
    #: user input placeholder names, in tensor-slot order
    user_inputs: list[str]


class ExternalizedCall:
    """One distinct way an instance is called (argument structure, shapes and dtypes)."""

    def __init__(
        self,
        target: ExternalizedModule,
        descriptor: Hashable,
        structure: dict[str, Any],
        names: list[str],
        examples: list[torch.Tensor],
    ) -> None:
        self.target = target
        self.descriptor = descriptor
        self.key = f"{next(_KEYS)}"
        _CALLS[self.key] = self
        self.structure = structure
        self.input_names = names
        self.metas = [
            (t.dtype, [_hint(d) for d in t.shape], [not isinstance(d, int) for d in t.shape])
            for t in examples
        ]
        self.output_structure: Any = None
        self.output_names: list[str] = []
        #: ("state", name) / ("arg", slot) written in place by the forward, in result order
        self.mutated: list[tuple[str, Any]] = []
        self.num_outputs = 0
        self._recorded = False

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """forward() arguments with ``tensors`` in the slots."""
        arguments = _fill(self.structure, tensors)
        bound = inspect.BoundArguments(self.target.signature, arguments)
        return bound.args, bound.kwargs

    def execute(self, operands: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        """The op's implementation: run the original forward (eagerly or on fake tensors)."""
        target = self.target
        n = len(self.input_names)
        present = [_present(t, target.label) for t in operands]
        # buffers and arguments are copied (the op must not mutate its inputs), parameters not
        args = [t.clone() for t in present[:n]]
        params = set(target.param_names)
        state = {
            name: t if name in params else t.clone()
            for name, t in zip(target.state_names, present[n:], strict=True)
        }
        call_args, call_kwargs = self.rebuild(args)
        recorder = _WriteRecorder()
        with _reparametrize_module(target.module, state), recorder:
            out = target.original_forward(*call_args, **call_kwargs)
        written = [name for name in target.param_names if recorder.wrote(state[name])]
        if written:
            raise ExternalizationError(
                f"{target.label} changes its parameter(s) {written} in place; Core AI programs "
                "only update buffers and inputs (register them as buffers instead)"
            )
        leaves, spec = pytree.tree_flatten_with_path(out)
        tensors: list[torch.Tensor] = []
        names: list[str] = []
        new_leaves = []
        for path, leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                new_leaves.append(_Slot(len(tensors)))
                tensors.append(leaf)
                names.append("_".join(["output", *(_key_name(k) for k in path)]))
            elif isinstance(leaf, torch.SymInt | torch.SymFloat | torch.SymBool):
                raise ExternalizationError(
                    f"{target.label} returns a symbolic {type(leaf).__name__} (a size known "
                    "only at run time); externalized modules must return tensors: compute the "
                    "size outside the module (e.g. from the returned tensor's shape)"
                )
            else:
                new_leaves.append(leaf)
        if isinstance(out, torch.Tensor):
            names = ["output"]
        mutated: list[tuple[str, Any]] = [
            ("state", name) for name in target.buffer_names if recorder.wrote(state[name])
        ]
        mutated += [("arg", i) for i, t in enumerate(args) if recorder.wrote(t)]
        if self._recorded and mutated != self.mutated:
            raise ExternalizationError(
                f"{target.label} mutates {_mutations(mutated)} in this call but "
                f"{_mutations(self.mutated)} in an earlier call with the same "
                "arguments; an externalized module must update the same buffers and arguments "
                "every time it is called: make the update unconditional (e.g. with "
                "torch.where) or move it out of the module"
            )
        self.record(pytree.tree_unflatten(new_leaves, spec), names, mutated)
        mutated_values = [state[ref] if kind == "state" else args[ref] for kind, ref in mutated]
        return [t.clone() for t in tensors] + mutated_values

    def record(self, structure: Any, names: list[str], mutated: list[tuple[str, Any]]) -> None:
        """What the forward returned (tensors replaced by slots) and what it mutated."""
        self.output_structure = structure
        self.output_names = names
        self.num_outputs = len(names)
        self.mutated = mutated
        self._recorded = True

    # -- conversion ---------------------------------------------------------------------------

    def program(self) -> SubProgram:
        """The submodule exported on its own for this call (cached per configuration)."""
        target = self.target
        plan = target.plan
        cache_key = (
            target.fingerprint,
            tuple((dtype, tuple(shape), tuple(dyn)) for dtype, shape, dyn in self.metas),
            repr(self.structure),
        )
        cached = plan.programs.get(cache_key)
        if cached is not None:
            return cached
        examples = [_example(dtype, shape) for dtype, shape, _ in self.metas]
        dynamic = [
            {i: torch.export.Dim.AUTO for i, d in enumerate(dyn) if d} or None
            for _, _, dyn in self.metas
        ]
        callee = _Callee(self)
        try:
            with plan.installed():
                ep = torch.export.export(
                    callee,
                    (examples,),
                    dynamic_shapes=(dynamic,) if any(dynamic) else None,
                    strict=False,
                )
                ep = run_decompositions(ep, plan.decomp_table())
        except ConversionError:
            raise
        except Exception as error:
            raise ExternalizationError(
                f"exporting externalized module {target.label} on its own failed: "
                f"{type(error).__name__}: {error}"
            ) from error
        _rebase_module_paths(ep, target)
        user_inputs = [
            spec.arg.name
            for spec in ep.graph_signature.input_specs
            if spec.kind == InputKind.USER_INPUT
        ]
        program = SubProgram(ep, target, user_inputs)
        plan.programs[cache_key] = program
        return program


def _mutations(mutated: Sequence[tuple[str, Any]]) -> str:
    """``buffer 'count'`` / ``argument 0`` / ``nothing`` for a recorded list of mutations."""
    if not mutated:
        return "nothing"
    return ", ".join(
        f"buffer '{ref}'" if kind == "state" else f"argument {ref}" for kind, ref in mutated
    )


def _example(dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


class _Callee(nn.Module):
    """Root module for exporting one externalized call on its own."""

    def __init__(self, call: ExternalizedCall) -> None:
        super().__init__()
        self.target = call.target.module
        self._call = [call]  # not a submodule / attribute torch.export should look at

    def forward(self, tensors: list[torch.Tensor]) -> Any:
        call = self._call[0]
        args, kwargs = call.rebuild(tensors)
        return call.target.original_forward(*args, **kwargs)


def _rebase_module_paths(ep: ExportedProgram, target: ExternalizedModule) -> None:
    """Module paths in the sub-program's metadata: ``target.x`` -> ``<path>.x``, and the
    target's own ops under ``<path>`` (so names and error messages point into the model)."""

    module = type(target.module)
    own = (target.path, f"{module.__module__}.{module.__qualname__}")
    for node in ep.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if node.op != "call_function" or stack is None:
            continue
        rebased = {"L__externalized__": own} if target.path else {}
        for key, (p, cls) in stack.items():
            clean = clean_module_path(str(p))
            if clean == "target" or clean.startswith("target."):
                rest = clean[len("target") :].lstrip(".")
                rebased[key] = (".".join(x for x in (target.path, rest) if x), cls)
        node.meta["nn_module_stack"] = rebased


# --------------------------------------------------------------------------------- plan ---


class ExternalizationPlan:
    """The externalization plan of one ``add_pytorch_module`` call."""

    def __init__(self, root: nn.Module, specs: list[ExternalizeSpec]) -> None:
        self.root = root
        self.specs = specs
        self.targets: list[ExternalizedModule] = []
        self.programs: dict[Hashable, SubProgram] = {}
        self._depth = 0
        self._decomp_table: dict[torch._ops.OperatorBase, Callable[..., Any]] | None = None
        matched: dict[int, int] = {id(s): 0 for s in specs}
        for path, module in root.named_modules():
            spec = self._spec_for(module)
            if spec is None:
                continue
            matched[id(spec)] += 1
            self.targets.append(ExternalizedModule(self, module, path, spec))
        self.by_module = {id(t.module): t for t in self.targets}
        for spec in specs:
            if not matched[id(spec)]:
                warnings.warn(
                    f"ExternalizeSpec for {spec.target_class.__qualname__} matches no module "
                    f"of {type(root).__qualname__}; nothing is externalized for it",
                    UserWarning,
                    stacklevel=5,
                )

    def decomp_table(self) -> dict[torch._ops.OperatorBase, Callable[..., Any]]:
        """``get_decomp_table()``, built once for the plan's exports."""
        if self._decomp_table is None:
            self._decomp_table = get_decomp_table()
        return self._decomp_table

    def _spec_for(self, module: nn.Module) -> ExternalizeSpec | None:
        mro = type(module).__mro__
        best = None
        for spec in self.specs:
            if spec.target_class in mro and (
                best is None or mro.index(spec.target_class) < mro.index(best.target_class)
            ):
                best = spec
        return best

    @contextmanager
    def installed(self) -> Iterator[None]:
        """Replace the targets' forward with the externalizing wrapper (re-entrant)."""
        if self._depth == 0:
            for target in self.targets:
                module = target.module
                target.saved = module.__dict__.get("forward", _MISSING)
                module.forward = target.wrapper()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                for target in self.targets:
                    if target.saved is _MISSING:
                        target.module.__dict__.pop("forward", None)
                    else:
                        target.module.forward = target.saved

    def check_called(self) -> None:
        """Warn about matched instances that the export never called."""
        unused = [t for t in self.targets if not t.calls]
        if unused and len(unused) == len(self.targets):
            warnings.warn(
                "none of the externalized modules ("
                + ", ".join(t.label for t in unused[:5])
                + ") was called while export_fn ran; nothing is externalized",
                UserWarning,
                stacklevel=5,
            )


@contextmanager
def prepare_externalization(
    module: nn.Module, specs: Sequence[ExternalizeSpec | type[nn.Module]] | None
) -> Iterator[list[Any]]:
    """Validate ``externalize_modules`` and keep the matching submodules whole during export.

    Yields the plan to store with the staged program (an empty list without specs).
    """
    if specs is None:
        yield []
        return
    normalized = normalize_specs(specs)
    if not normalized:
        yield []
        return
    plan = ExternalizationPlan(module, normalized)
    if not plan.targets:
        yield []
        return
    with plan.installed():
        yield [plan]
    plan.check_called()
