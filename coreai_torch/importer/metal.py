"""Custom Metal kernels: ``TorchMetalKernel`` and ``MetalParameter``.

A ``TorchMetalKernel`` pairs a Metal kernel *body* with a PyTorch reference implementation::

    kernel = TorchMetalKernel(
        "vector_add",
        input_names=["x", "y"],
        result_names=["output"],
        src="output[id] = x[id] + y[id];",
        torch_defn=lambda x, y: x + y,
        metal_params=[MetalParameter("id", "uint", "thread_position_in_grid")],
    )

    class Model(nn.Module):
        def forward(self, x, y):
            return kernel(x, y, threads_per_grid=(8, 1, 1), threads_per_thread_group=(8, 1, 1),
                          result_shapes=[(8,)])

In eager PyTorch the call runs ``torch_defn``.  Under ``torch.export`` it stays one node of the
custom op ``coreai_torch::metal_kernel`` (decompositions leave it alone), which a converter
that has the kernel registered (``TorchConverter.register_custom_kernels``) lowers to
``coreai.metal4_kernel`` with the full Metal source generated for the tensors' dtypes and ranks.
Metal kernels only execute on Apple GPUs: on other platforms the program verifies and saves,
but cannot be run.
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
import torch.fx
from coreai.authoring.metal import CustomMetalKernel, TensorMeta
from coreai.authoring.metal import MetalParameter as _CoreMetalParameter
from torch.export import ExportedProgram

from coreai_torch import dtypes
from coreai_torch._mlir import cai, ir
from coreai_torch.errors import UnsupportedOpError
from coreai_torch.locations import describe

__all__ = ["METAL_KERNEL_OP", "MetalParameter", "TorchMetalKernel"]

#: Qualified name of the op every kernel call becomes in an exported program.
METAL_KERNEL_OP = "coreai_torch::metal_kernel.default"

#: Element types the ``coreai.metal4_kernel`` verifier accepts for inputs and results ("Metal 4
#: supported element type"); coreai-core's Metal type table also maps si64, ui64 and i1, which
#: the verifier rejects (tests/test_metal.py checks this list against the verifier).
METAL_ELEMENT_TYPES = ("bf16", "f16", "f32", "si8", "ui8", "si16", "ui16", "si32", "ui32")

#: Metal accepts at most this many kernel parameters (tensors + attribute parameters).
PARAMETER_LIMIT = 31
#: Apple GPUs run at most this many threads per threadgroup.
MAX_THREADS_PER_THREADGROUP = 1024

#: Attributes of Metal kernel-function input arguments (Metal Shading Language spec).
METAL_ATTRIBUTES = frozenset(
    {
        "dispatch_quadgroups_per_threadgroup",
        "dispatch_simdgroups_per_threadgroup",
        "dispatch_threads_per_threadgroup",
        "grid_origin",
        "grid_size",
        "quadgroup_index_in_threadgroup",
        "quadgroups_per_threadgroup",
        "simdgroup_index_in_threadgroup",
        "simdgroups_per_threadgroup",
        "thread_execution_width",
        "thread_index_in_quadgroup",
        "thread_index_in_simdgroup",
        "thread_index_in_threadgroup",
        "thread_position_in_grid",
        "thread_position_in_threadgroup",
        "threadgroup_position_in_grid",
        "threadgroups_per_grid",
        "threads_per_grid",
        "threads_per_simdgroup",
        "threads_per_threadgroup",
    }
)

# Words a kernel, tensor or parameter name cannot be: C++ keywords and Metal's own names.
_RESERVED_TEXT = """
    auto bool break case char class const constant constexpr continue default delete device do
    double else enum explicit extern false float for goto half if inline int kernel long metal
    namespace new operator private protected public register return short signed sizeof static
    struct switch template this thread threadgroup true typedef typename uint union unsigned
    using virtual void volatile while bfloat tensor vec mpp
"""
_RESERVED_WORDS = frozenset(_RESERVED_TEXT.split())
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _check_identifier(what: str, name: object) -> str:
    if not isinstance(name, str) or not _IDENTIFIER.match(name):
        raise ValueError(f"{what} must be a C identifier (letters, digits, '_'), got {name!r}")
    if name in _RESERVED_WORDS or name.startswith("__"):
        raise ValueError(f"{what} {name!r} is a reserved word in Metal; choose another name")
    return name


def _check_names(what: str, names: object) -> list[str]:
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise TypeError(f"{what} must be a list of names, got {names!r}")
    return [_check_identifier(f"{what} entry", n) for n in names]


@dataclass(frozen=True)
class MetalParameter:
    """An extra Metal kernel parameter bound to a Metal attribute.

    ``MetalParameter("id", "uint", "thread_position_in_grid")`` adds
    ``uint id [[thread_position_in_grid]]`` to the generated kernel signature.
    """

    #: the parameter's name inside the kernel source
    name: str
    #: its Metal type, e.g. ``"uint"``, ``"uint2"``, ``"ushort3"``
    type: str
    #: the Metal attribute it is bound to, e.g. ``"thread_position_in_grid"``
    attribute: str

    def __post_init__(self) -> None:
        _check_identifier("MetalParameter name", self.name)
        if not isinstance(self.type, str) or not _IDENTIFIER.match(self.type):
            raise ValueError(
                f"MetalParameter {self.name!r}: type must be a Metal type name such as 'uint' "
                f"or 'uint3', got {self.type!r}"
            )
        attribute = self.attribute
        if isinstance(attribute, str):
            attribute = attribute.strip().removeprefix("[[").removesuffix("]]").strip()
        if attribute not in METAL_ATTRIBUTES:
            raise ValueError(
                f"MetalParameter {self.name!r}: unknown Metal attribute {self.attribute!r}; "
                f"expected one of {', '.join(sorted(METAL_ATTRIBUTES))}"
            )
        object.__setattr__(self, "attribute", attribute)


#: kernel key -> kernel, for the op's eager and fake implementations
_KERNELS: dict[int, TorchMetalKernel] = {}
_KEYS = itertools.count()


def _positional_arity(fn: Callable[..., Any]) -> tuple[int, int | None] | None:
    """(required, maximum) positional arguments of ``fn`` (maximum None for ``*args``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    positional = [
        p
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    required = sum(1 for p in positional if p.default is inspect.Parameter.empty)
    variadic = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    return required, None if variadic else len(positional)


class TorchMetalKernel:
    """A custom Metal kernel with a PyTorch reference implementation (``torch_defn``).

    Call it inside a model as ``kernel(*tensors, threads_per_grid=(x, y, z),
    threads_per_thread_group=(x, y, z), result_shapes=[...])``: eagerly it runs
    ``torch_defn(*tensors)``; converted (after ``register_custom_kernels``) it becomes a
    ``coreai.metal4_kernel`` whose Metal source is ``src`` inside a signature generated from
    ``input_names``, ``result_names`` and ``metal_params``.
    """

    def __init__(
        self,
        name: str,
        input_names: Sequence[str],
        result_names: Sequence[str],
        src: str,
        torch_defn: Callable[..., Any],
        metal_params: Sequence[MetalParameter] | None = None,
        *,
        helper_src: str | None = None,
        template_dtypes: dict[str, str] | None = None,
    ) -> None:
        self.name = _check_identifier("kernel name", name)
        self.input_names = _check_names(f"kernel '{name}': input_names", input_names)
        self.result_names = _check_names(f"kernel '{name}': result_names", result_names)
        if not self.result_names:
            raise ValueError(f"kernel '{name}': result_names must name at least one result")
        if not isinstance(src, str) or not src.strip():
            raise ValueError(f"kernel '{name}': src must be the kernel body as a non-empty string")
        if helper_src is not None and not isinstance(helper_src, str):
            raise TypeError(f"kernel '{name}': helper_src must be a string, got {helper_src!r}")
        self.src = src
        self.helper_src = helper_src
        if not callable(torch_defn):
            raise TypeError(
                f"kernel '{name}': torch_defn must be a function computing the kernel's "
                f"results with PyTorch ops, got {torch_defn!r}"
            )
        arity = _positional_arity(torch_defn)
        n_inputs = len(self.input_names)
        if arity is not None and not (
            arity[0] <= n_inputs and (arity[1] is None or n_inputs <= arity[1])
        ):
            raise ValueError(
                f"kernel '{name}': torch_defn {getattr(torch_defn, '__name__', torch_defn)!r} "
                f"takes {arity[0] if arity[0] == arity[1] else f'{arity[0]}..{arity[1]}'} "
                f"positional argument(s), but the kernel has {n_inputs} input(s) "
                f"{self.input_names}"
            )
        self.torch_defn = torch_defn
        params = list(metal_params or [])
        for param in params:
            if not isinstance(param, MetalParameter):
                raise TypeError(
                    f"kernel '{name}': metal_params must be MetalParameter objects, got {param!r}"
                )
        self.metal_params = params
        names = [*self.input_names, *self.result_names, *(p.name for p in params)]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(
                f"kernel '{name}': names must be unique across inputs, results and metal_params; "
                f"{duplicates} appear more than once"
            )
        if len(names) > PARAMETER_LIMIT:
            raise ValueError(
                f"kernel '{name}' has {len(names)} parameters (inputs + results + metal_params); "
                f"Metal kernels accept at most {PARAMETER_LIMIT}"
            )
        self.core = CustomMetalKernel(
            name,
            input_names=list(self.input_names),
            result_names=list(self.result_names),
            src=src,
            metal_params=[_CoreMetalParameter(p.name, p.type, p.attribute) for p in params],
            helper_src=helper_src,
            template_dtypes=dict(template_dtypes or {}),
        )
        self.key = next(_KEYS)
        _KERNELS[self.key] = self

    def __repr__(self) -> str:
        return (
            f"TorchMetalKernel({self.name!r}, input_names={self.input_names}, "
            f"result_names={self.result_names})"
        )

    # -- calling ------------------------------------------------------------------------------

    def __call__(
        self,
        *tensors: torch.Tensor,
        threads_per_grid: Sequence[int],
        threads_per_thread_group: Sequence[int],
        result_shapes: Sequence[Sequence[int]] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Run the kernel: ``torch_defn`` eagerly, one ``coreai_torch::metal_kernel`` node
        under ``torch.export``.  Returns a tensor, or a tuple for several results.

        ``result_shapes`` (one shape per result) defaults to the shapes ``torch_defn``
        computes.
        """
        if len(tensors) != len(self.input_names):
            raise TypeError(
                f"kernel '{self.name}' takes {len(self.input_names)} tensor(s) "
                f"{self.input_names}, got {len(tensors)}"
            )
        for input_name, tensor in zip(self.input_names, tensors, strict=True):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(
                    f"kernel '{self.name}': input '{input_name}' must be a torch.Tensor, got "
                    f"{type(tensor).__name__}"
                )
        grid = self._threads("threads_per_grid", threads_per_grid)
        group = self._threads("threads_per_thread_group", threads_per_thread_group)
        if (
            all(isinstance(t, int) for t in group)
            and math.prod(group) > MAX_THREADS_PER_THREADGROUP
        ):
            raise ValueError(
                f"kernel '{self.name}': threads_per_thread_group {tuple(group)} has "
                f"{math.prod(group)} threads; Metal allows at most "
                f"{MAX_THREADS_PER_THREADGROUP} per threadgroup"
            )
        flat: list[Any] = []
        ranks: list[int] = []
        if result_shapes is not None:
            for shape in self._shapes(result_shapes):
                flat.extend(shape)
                ranks.append(len(shape))
        results = torch.ops.coreai_torch.metal_kernel(
            list(tensors), self.name, self.key, grid, group, flat, ranks
        )
        return results[0] if len(results) == 1 else tuple(results)

    def _threads(self, what: str, value: object) -> list[Any]:
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or len(value) != 3:
            raise ValueError(
                f"kernel '{self.name}': {what} must be 3 thread counts (x, y, z), got {value!r}"
            )
        counts = list(value)
        for count in counts:
            if isinstance(count, bool) or not isinstance(count, (int, torch.SymInt)):
                raise ValueError(f"kernel '{self.name}': {what} must hold integers, got {value!r}")
            if isinstance(count, int) and count < 1:
                raise ValueError(
                    f"kernel '{self.name}': {what} must be positive thread counts, got {value!r}"
                )
        return counts

    def _shapes(self, result_shapes: object) -> list[list[Any]]:
        if isinstance(result_shapes, (str, bytes)) or not isinstance(result_shapes, Sequence):
            raise ValueError(
                f"kernel '{self.name}': result_shapes must be a list with one shape per result "
                f"{self.result_names}, got {result_shapes!r}"
            )
        shapes = list(result_shapes)
        if len(shapes) != len(self.result_names) or not all(
            isinstance(s, Sequence) and not isinstance(s, (str, bytes)) for s in shapes
        ):
            raise ValueError(
                f"kernel '{self.name}': result_shapes must be a list with one shape (a sequence "
                f"of sizes) per result {self.result_names}, got {result_shapes!r}"
            )
        for shape in shapes:
            for size in shape:
                if isinstance(size, bool) or not isinstance(size, (int, torch.SymInt)):
                    raise ValueError(
                        f"kernel '{self.name}': result shape {tuple(shape)} must hold integers"
                    )
                if isinstance(size, int) and size < 1:
                    raise ValueError(
                        f"kernel '{self.name}': result shape {tuple(shape)} has a size < 1; "
                        "Core AI cannot run zero-element tensors"
                    )
        return [list(s) for s in shapes]

    # -- reference implementation ---------------------------------------------------------------

    def _reference(
        self, inputs: Sequence[torch.Tensor], flat_shapes: Sequence[Any], ranks: Sequence[int]
    ) -> list[torch.Tensor]:
        """``torch_defn``'s results, checked against the kernel's result names and shapes."""
        try:
            out = self.torch_defn(*inputs)
        except Exception as error:
            raise RuntimeError(
                f"kernel '{self.name}': torch_defn raised {type(error).__name__}: {error}"
            ) from error
        results = list(out) if isinstance(out, (list, tuple)) else [out]
        if len(results) != len(self.result_names) or not all(
            isinstance(r, torch.Tensor) for r in results
        ):
            raise ValueError(
                f"kernel '{self.name}': torch_defn must return {len(self.result_names)} "
                f"tensor(s) {self.result_names}, got {_summary(out)}"
            )
        if ranks:
            offsets = np.cumsum([0, *ranks])
            for i, result in enumerate(results):
                shape = list(flat_shapes[offsets[i] : offsets[i + 1]])
                if not _same_shape(result.shape, shape):
                    raise ValueError(
                        f"kernel '{self.name}': result '{self.result_names[i]}' has "
                        f"result_shapes entry {tuple(shape)}, but torch_defn returns shape "
                        f"{tuple(result.shape)}"
                    )
        return results

    # -- lowering -------------------------------------------------------------------------------

    def emit(
        self,
        inputs: Sequence[ir.Value],
        threads_per_grid: Sequence[int],
        threads_per_thread_group: Sequence[int],
        result_types: Sequence[ir.RankedTensorType],
    ) -> list[ir.Value]:
        """Build the ``coreai.metal4_kernel`` (and its buffer copies) at the insertion point."""
        mapping = self.core.metal_type_mappings
        input_meta = [
            TensorMeta(name, ir.RankedTensorType(v.type).rank, mapping[_element(v.type)])
            for name, v in zip(self.input_names, inputs, strict=True)
        ]
        result_meta = [
            TensorMeta(name, t.rank, mapping[_element(t)])
            for name, t in zip(self.result_names, result_types, strict=True)
        ]
        # A stable kernel name (the source's hash) keeps the program reproducible.
        digest = hashlib.sha1(
            self.core.template_kernel_src(self.name, input_meta, result_meta).encode()
        ).hexdigest()[:8]
        kernel_id = f"{self.name}_{digest}"
        source = self.core.template_kernel_src(kernel_id, input_meta, result_meta)
        signature = tuple((m.rank, m.metal_dtype) for m in (*input_meta, *result_meta))
        self.core.kernel_cache[signature] = (kernel_id, source)
        u32 = [
            cai.constant(np.array(threads_per_grid, np.uint32)),
            cai.constant(np.array(threads_per_thread_group, np.uint32)),
            *(cai.constant(np.array(t.shape, np.uint32)) for t in result_types),
        ]
        return list(self.core._construct_kernel_op([*inputs, *u32], list(result_types)))


def _element(t: ir.Type) -> str:
    return str(ir.RankedTensorType(t).element_type)


def _torch_dtype_text(element: ir.Type | str) -> str:
    """`` (torch.int64)`` for an element type that has a torch dtype."""
    try:
        return f" ({dtypes.to_torch(element)})"
    except TypeError:
        return ""


def _dtype_list(elements: Sequence[str]) -> str:
    return ", ".join(str(dtypes.to_torch(e)) for e in elements)


def _summary(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of {len(value)} item(s)"
    return type(value).__name__


def _same_shape(actual: Sequence[Any], expected: Sequence[Any]) -> bool:
    if len(actual) != len(expected):
        return False
    return all(
        not (isinstance(a, int) and isinstance(b, int)) or a == b
        for a, b in zip(actual, expected, strict=True)
    )


def _kernel(key: int, name: str) -> TorchMetalKernel:
    """The kernel a call refers to: by key, or (for programs loaded from disk) by its name."""
    kernel = _KERNELS.get(key)
    if kernel is not None and kernel.name == name:
        return kernel
    named = [k for k in _KERNELS.values() if k.name == name]
    if len(named) != 1:
        raise RuntimeError(
            f"Metal kernel '{name}' is "
            + ("defined more than once" if named else "not defined")
            + " in this process; create its TorchMetalKernel before running the program"
        )
    return named[0]


# ---------------------------------------------------------------------------------- the op ---


@torch.library.custom_op(
    "coreai_torch::metal_kernel",
    mutates_args=(),
    schema=(
        "(Tensor[] inputs, str kernel, int key, SymInt[] threads_per_grid, "
        "SymInt[] threads_per_thread_group, SymInt[] result_shapes, int[] result_ranks) "
        "-> Tensor[]"
    ),
)
def _metal_kernel_op(
    inputs: list[torch.Tensor],
    kernel: str,
    key: int,
    threads_per_grid: list[int],
    threads_per_thread_group: list[int],
    result_shapes: list[int],
    result_ranks: list[int],
) -> list[torch.Tensor]:
    """Eager implementation: the kernel's ``torch_defn``."""
    results = _kernel(key, kernel)._reference(inputs, result_shapes, result_ranks)
    storages = {t.untyped_storage().data_ptr() for t in inputs}
    # A custom op's results must not alias its inputs.
    return [r.clone() if r.untyped_storage().data_ptr() in storages else r for r in results]


@_metal_kernel_op.register_fake
def _metal_kernel_fake(*args: Any) -> list[torch.Tensor]:
    """Shapes from ``result_shapes`` (or ``torch_defn``), dtypes from ``torch_defn``."""
    inputs, kernel, key, _grid, _group, result_shapes, result_ranks = args
    results = _kernel(key, kernel)._reference(inputs, result_shapes, result_ranks)
    if not result_ranks:
        return [torch.empty_like(r, memory_format=torch.contiguous_format) for r in results]
    offsets = np.cumsum([0, *result_ranks])
    return [
        r.new_empty(list(result_shapes[offsets[i] : offsets[i + 1]])) for i, r in enumerate(results)
    ]


# ---------------------------------------------------------------------------- conversion ---


def _is_kernel_node(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.coreai_torch.metal_kernel.default


def kernel_nodes(ep: ExportedProgram) -> list[torch.fx.Node]:
    """Every Metal kernel call in ``ep`` (sub-graphs included)."""
    return [
        node
        for _, module in ep.graph_module.named_modules()
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
        if _is_kernel_node(node)
    ]


def check_kernels_registered(ep: ExportedProgram, kernels: dict[str, TorchMetalKernel]) -> None:
    """Raise if ``ep`` calls a Metal kernel the converter does not have registered."""
    missing = [n for n in kernel_nodes(ep) if n.args[1] not in kernels]
    if missing:
        listed = "\n".join(f"  - kernel '{n.args[1]}': {describe(n)}" for n in missing)
        raise UnsupportedOpError(
            f"the program calls Metal kernel(s) this converter does not know:\n{listed}\n"
            "Register them before staging the program: "
            "converter.register_custom_kernels([kernel, ...])",
            ops={METAL_KERNEL_OP: list(missing)},
        )


def register_kernels(converter: Any, kernels: Sequence[TorchMetalKernel]) -> None:
    """``TorchConverter.register_custom_kernels``: remember the kernels and lower their calls."""
    if isinstance(kernels, TorchMetalKernel):
        raise TypeError("register_custom_kernels expects a list of kernels: pass [kernel]")
    if isinstance(kernels, (str, bytes)) or not isinstance(kernels, Sequence):
        raise TypeError(
            f"register_custom_kernels expects a list of TorchMetalKernel, got {kernels!r}"
        )
    registered: dict[str, TorchMetalKernel] = converter._kernels
    new: dict[str, TorchMetalKernel] = {}
    for kernel in kernels:
        if not isinstance(kernel, TorchMetalKernel):
            raise TypeError(
                f"register_custom_kernels expects TorchMetalKernel objects, got {kernel!r}"
            )
        known = new.get(kernel.name) or registered.get(kernel.name)
        if known is not None and known is not kernel:
            raise ValueError(
                f"a different Metal kernel named '{kernel.name}' is already registered on this "
                "converter; kernel names must be unique"
            )
        new[kernel.name] = kernel
    registered.update(new)

    def lower_metal_kernel(
        values_map: dict[str, ir.Value], node: torch.fx.Node, loc: ir.Location
    ) -> list[ir.Value]:
        return _lower(registered, values_map, node)

    converter._lowerings.register(METAL_KERNEL_OP, lower_metal_kernel, allow_override=True)


def _lower(
    kernels: dict[str, TorchMetalKernel], values_map: dict[str, ir.Value], node: torch.fx.Node
) -> list[ir.Value]:
    # (inputs, name, key, grid, group, shapes, ranks): the op's schema (METAL_KERNEL_OP)
    inputs = cast("list[torch.fx.Node]", node.args[0])
    name = cast(str, node.args[1])
    grid, group = cast("tuple[Sequence[int | torch.fx.Node], ...]", node.args[3:5])
    kernel = kernels.get(name)
    if kernel is None:
        raise UnsupportedOpError(
            f"{describe(node)}: Metal kernel '{name}' is not registered on this converter; "
            "call converter.register_custom_kernels([...]) before add_exported_program()"
        )

    def fail(why: str) -> UnsupportedOpError:
        return UnsupportedOpError(f"{describe(node)}: Metal kernel '{name}': {why}")

    supported = [t for t in METAL_ELEMENT_TYPES if t in kernel.core.metal_type_mappings]
    accepted = _dtype_list(supported)
    values = [values_map[arg.name] for arg in inputs]
    for input_name, value in zip(kernel.input_names, values, strict=True):
        t = ir.RankedTensorType(value.type)
        if not t.has_static_shape:
            raise fail(
                f"input '{input_name}' has a dynamic shape ({t}); Metal kernels need static "
                "shapes: export without dynamic dimensions for the kernel's inputs"
            )
        if _element(t) not in supported:
            raise fail(
                f"input '{input_name}' has element type {t.element_type}"
                f"{_torch_dtype_text(t.element_type)}, which Metal kernels do not support "
                f"(supported: {accepted}); cast it before the call, e.g. "
                f"{input_name}.to(torch.int32)"
            )
    thread_counts: list[tuple[int, ...]] = []
    for what, counts in (("threads_per_grid", grid), ("threads_per_thread_group", group)):
        fixed = tuple(c for c in counts if isinstance(c, int))
        thread_counts.append(fixed)
        if len(fixed) != len(counts):
            shown = tuple(str(c.meta.get("val", c)) if hasattr(c, "meta") else c for c in counts)
            raise fail(
                f"{what} must be static thread counts, got {shown} (computed from sizes that "
                "are only known at run time); pass fixed counts (e.g. for the largest size) "
                "and guard the kernel body against threads beyond the data"
            )
    result_types = []
    for result_name, val in zip(kernel.result_names, node.meta["val"], strict=True):
        if not all(isinstance(d, int) for d in val.shape):
            raise fail(f"result '{result_name}' has a dynamic shape {tuple(val.shape)}")
        if not dtypes.is_supported(val.dtype):
            raise fail(f"result '{result_name}' has unsupported dtype {val.dtype}")
        t = dtypes.tensor_type(list(val.shape), val.dtype)
        if _element(t) not in supported:
            raise fail(
                f"result '{result_name}' has dtype {val.dtype} (torch_defn's result), which "
                f"Metal kernels do not support (supported: {accepted}); make torch_defn return "
                "a supported dtype (e.g. .to(torch.int32) or .to(torch.uint8) for booleans) and "
                "convert the result after the call"
            )
        result_types.append(t)
    grid_counts, group_counts = thread_counts
    return kernel.emit(values, grid_counts, group_counts, result_types)
