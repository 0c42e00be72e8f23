"""Checks of a converted module before it reaches the user: the MLIR verifier
(:func:`verify_module`) and IR the Core AI runtime would abort on (:func:`check_runtime_hazards`).

The runtime kills the process (SIGILL/SIGABRT, no Python exception) on some programs that pass
the MLIR verifier.  :func:`check_runtime_hazards` scans a converted module for them, whichever
lowering (built-in or user) emitted the ops:

* a zero-element tensor that another op consumes as data;
* a tensor with 2**31 elements or more (the runtime's indices are 32-bit; it aborts when it
  cannot allocate storage);
* 16-bit integer index operands (axes, permutations, pads, starts, indices, ...);
* ``pad`` amounts of 2**31 or more (a negative amount stored as ``ui32``);
* integer division or remainder by a constant divisor that contains zero;
* ops the runtime's compiler cannot legalize (``reduce_index``, the generic ``reduce``);
* decompression ops whose operands break the rules the runtime relies on (a
  ``blockwise_shift_scale`` scale of another type than its output, or of another rank than its
  data: :func:`coreai_torch.ir.compressed.decompression_problems`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from coreai_torch._mlir import ir
from coreai_torch.errors import RuntimeHazardError, VerificationError
from coreai_torch.ir.compressed import decompression_problems
from coreai_torch.ir.values import constant_values
from coreai_torch.locations import names_in_location

#: Operand names (ODS accessors) that hold axes, shapes, sizes, positions or indices.
INDEX_OPERANDS = frozenset(
    {
        "axes",
        "axis",
        "dilation",
        "dim",
        "dim_sizes",
        "dimension",
        "dims",
        "end_indices",
        "groups",
        "indices",
        "kernel_size",
        "new_shape",
        "output_pad",
        "output_shape",
        "padding",
        "permutation",
        "result_shapes",
        "shape",
        "shape_1",
        "shape_2",
        "split_size_or_sections",
        "start_indices",
        "stride",
        "strides",
        "threads_per_grid",
        "threads_per_thread_group",
    }
)

_INT_DIVISIONS = frozenset(
    {
        "coreai.divide",
        "coreai.floor_divide",
        "coreai.modulo",
        "coreai.decomposable.broadcasting_divide",
        "coreai.decomposable.broadcasting_floor_divide",
        "coreai.decomposable.broadcasting_modulo",
    }
)

#: Ops the runtime's compiler cannot legalize: compiling them aborts the process.
_UNCOMPILABLE = {
    "coreai.reduce_index": "cannot be compiled by the Core AI runtime (compiling it aborts the "
    "process); use coreai.argmax (argmin = argmax of the negated input).",
    "coreai.reduce": "(the generic region reduction) cannot be compiled by the Core AI runtime "
    "(compiling it aborts the process); use reduce_sum/reduce_max/reduce_min/reduce_product.",
}

#: Index operands that are 16-bit by definition (the verifier demands si16 and the runtime
#: reads them correctly), by op name -> operand positions.
_16_BIT_INDEX_OPERANDS = {"coreai.lut_to_dense": frozenset({2})}

#: Largest number of elements a tensor may have.
MAX_ELEMENTS = 2**31 - 1


@dataclass(frozen=True)
class Hazard:
    """One op the runtime would abort on."""

    op_name: str
    location: str
    problem: str

    def __str__(self) -> str:
        return f"{self.location}: '{self.op_name}' {self.problem}"


def _walk(module: ir.Module) -> list[ir.Operation]:
    ops: list[ir.Operation] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        ops.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return ops


def _static_numel(t: ir.Type) -> int | None:
    if not ir.RankedTensorType.isinstance(t):
        return None
    ranked = ir.RankedTensorType(t)
    if not ranked.has_static_shape:
        return None
    return int(np.prod(ranked.shape, dtype=np.int64))


def _element_type(t: ir.Type) -> ir.Type | None:
    return ir.ShapedType(t).element_type if ir.ShapedType.isinstance(t) else None


def _int_width(t: ir.Type) -> int | None:
    element = _element_type(t)
    if element is None or not ir.IntegerType.isinstance(element):
        return None
    return ir.IntegerType(element).width


def _named_operands(op: ir.Operation) -> Iterator[tuple[str, ir.Value]]:
    """``(accessor name, value)`` for the op's operands that have an ODS name."""
    view = op.opview
    for name in dir(type(view)):
        if name.startswith("_") or not isinstance(getattr(type(view), name, None), property):
            continue
        try:
            value = getattr(view, name)
        except Exception:  # accessors of optional operands may raise when absent
            continue
        if isinstance(value, ir.Value) and any(value == o for o in op.operands):
            yield name, value


def _index_operands(op: ir.Operation) -> set[int]:
    """Positions of ``op``'s operands that are index-like (see :data:`INDEX_OPERANDS`)."""
    positions = set()
    for name, value in _named_operands(op):
        if name in INDEX_OPERANDS:
            positions |= {i for i, o in enumerate(op.operands) if o == value}
    return positions


class _Scanner:
    def __init__(self, location_of: Callable[[ir.Operation], str]) -> None:
        self.location_of = location_of
        self.found: list[Hazard] = []
        self._index_cache: dict[int, set[int]] = {}

    def add(self, op: ir.Operation, problem: str) -> None:
        self.found.append(Hazard(op.name, self.location_of(op), problem))

    def index_positions(self, op: ir.Operation) -> set[int]:
        key = hash(op)
        if key not in self._index_cache:
            self._index_cache[key] = _index_operands(op)
        return self._index_cache[key]

    def scan(self, op: ir.Operation) -> None:
        if op.name in ("builtin.module", "coreai.graph", "coreai.output"):
            return
        if op.name in _UNCOMPILABLE:
            self.add(op, _UNCOMPILABLE[op.name])
        for problem in decompression_problems(op):
            self.add(op, problem)
        self._results(op)
        self._operands(op)

    def _results(self, op: ir.Operation) -> None:
        for result in op.results:
            numel = _static_numel(result.type)
            if numel is None:
                continue
            if numel > MAX_ELEMENTS:
                self.add(
                    op,
                    f"produces {result.type} with {numel} elements; Core AI tensors hold at "
                    f"most {MAX_ELEMENTS} elements (the runtime aborts when it cannot allocate "
                    "them). Reduce the sizes (e.g. padding or repeat counts).",
                )
            elif numel == 0 and op.name != "coreai.constant":
                for use in result.uses:
                    user = use.owner
                    if user.name in ("coreai.output", "coreai.yield"):
                        continue
                    if use.operand_number in self.index_positions(user):
                        continue
                    self.add(
                        op,
                        f"produces the zero-element {result.type}, which '{user.name}' "
                        "consumes; the Core AI runtime aborts on empty tensors. Avoid empty "
                        "slices/splits or sizes of 0 in the model.",
                    )
                    break

    def _operands(self, op: ir.Operation) -> None:
        has_16_bit = any(_int_width(o.type) == 16 for o in op.operands)
        positions = self.index_positions(op) if has_16_bit else set()
        for i in sorted(positions - _16_BIT_INDEX_OPERANDS.get(op.name, frozenset())):
            value = op.operands[i]
            if _int_width(value.type) == 16:
                self.add(
                    op,
                    f"takes the 16-bit index operand #{i} ({value.type}); the Core AI runtime "
                    "aborts on 16-bit axes/indices/shapes. Use si32 or ui32 "
                    "(coreai_torch.ir.values.i32/u32).",
                )
        if op.name == "coreai.pad":
            pads = constant_values(op.operands[1]) if len(op.operands) > 1 else None
            if pads is not None and pads.size and int(pads.max()) > MAX_ELEMENTS:
                self.add(
                    op,
                    f"pads by {int(pads.max())} elements (a negative amount stored as an "
                    "unsigned integer?); the Core AI runtime aborts on it. Crop with a slice "
                    "instead of padding by a negative amount.",
                )
        if op.name in _INT_DIVISIONS and len(op.operands) == 2:
            if _int_width(op.operands[0].type) is None:
                return
            divisor = constant_values(op.operands[1])
            if divisor is not None and (divisor == 0).any():
                self.add(
                    op,
                    "divides integers by a constant that contains 0; the Core AI runtime "
                    "aborts on integer division by zero (PyTorch raises ZeroDivisionError).",
                )


def find_runtime_hazards(
    module: ir.Module, location_of: Callable[[ir.Operation], str] | None = None
) -> list[Hazard]:
    """Every op of ``module`` that would abort the Core AI runtime (see module docstring)."""
    scanner = _Scanner(location_of or (lambda op: str(op.location)))
    for op in _walk(module):
        scanner.scan(op)
    return scanner.found


def check_runtime_hazards(module: ir.Module, describe_node: Callable[[str], str | None]) -> None:
    """Raise :class:`RuntimeHazardError` naming the source of every op of ``module`` that would
    abort the Core AI runtime (``describe_node``: the name an op's location carries -> the
    node it was converted from and its source line, or None)."""

    def location_of(op: ir.Operation) -> str:
        text = str(op.location)
        described = [d for n in names_in_location(text) if (d := describe_node(n)) is not None]
        return "; ".join(described) if described else text

    hazards = find_runtime_hazards(module, location_of)
    if hazards:
        listed = "\n".join(f"  - {h}" for h in hazards[:10])
        more = f"\n  ... and {len(hazards) - 10} more" if len(hazards) > 10 else ""
        raise RuntimeHazardError(
            f"the converted program would abort the Core AI runtime (nothing was run); "
            f"{len(hazards)} op(s) are unsafe:\n{listed}{more}\nFor a built-in lowering this is "
            "a coreai-torch bug (please report it); for your own lowering, change the ops it "
            "builds as described."
        )


def verify_module(module: ir.Module, when: str) -> None:
    """Run the MLIR verifier; raise :class:`VerificationError` with every diagnostic, saying
    ``when`` (e.g. "after optimize()")."""
    diagnostics: list[str] = []

    def collect(diagnostic: ir.Diagnostic) -> bool:
        diagnostics.append(f"{diagnostic.location}: {diagnostic.message}")
        return True

    handler = module.context.attach_diagnostic_handler(collect)
    try:
        module.operation.verify()
    except ir.MLIRError as error:
        found = [f"{d.location}: {d.message}" for d in error.error_diagnostics] or diagnostics
        raise VerificationError(
            f"the program failed MLIR verification {when}:\n  " + "\n  ".join(found)
        ) from error
    finally:
        handler.detach()
