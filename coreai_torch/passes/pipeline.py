"""The order in which the passes run: written here once, as ordered lists.

* :data:`POST_IMPORT`: run by ``TorchConverter.to_coreai()`` on the freshly imported module,
  before the verifier and the runtime-hazard checks;
* :data:`PLACEMENT`: where compressed weights are decompressed, run by
  ``AIProgram.compress()`` after replacing the weights and at the end of :data:`OPTIMIZE`;
* :data:`OPTIMIZE`: ``AIProgram.optimize()``, on a copy of the module that replaces the
  program's only when every pass succeeded;
* :data:`BEFORE_REWRITE` / :data:`AFTER_REWRITE`: around Core AI's pre-compilation rewrite
  wherever it runs (in :data:`OPTIMIZE`, and in ``AIProgram.set_static_shape_config()``).

A pass is a function ``fn(module, context) -> int`` (how many changes it made) that rewrites
the MLIR module, and the program's :class:`~coreai_torch.ir.weights.WeightStore` through the
context, never the FX graph.  The runner verifies the module after a pass that says so, when
it changed something (``verify="always"``: every time).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from coreai_torch._mlir import ir, run_pre_compilation_rewrite
from coreai_torch.errors import VerificationError
from coreai_torch.ir.checks import verify_module
from coreai_torch.ir.weights import WeightStore
from coreai_torch.passes import weight_casts  # (registers its fold guards)
from coreai_torch.passes.folded_weights import Readers, name_folded_weights, note_weight_readers
from coreai_torch.passes.placement import (
    decompress_to_float32,
    lookups_before_decompression,
    scales_after_matmul,
)
from coreai_torch.passes.pretranspose import is_dynamic_gather, pretranspose_weights
from coreai_torch.passes.safe_rewrite import protect_from_misfolds, protect_from_runtime_misfolds


@dataclass
class PassContext:
    """What passes may read besides the module: the program's weights and the options."""

    #: the program's weights (None for a program not converted by ``TorchConverter``)
    weights: WeightStore | None = None
    #: ``optimize(transpose_weights=...)``: store weights read transposed transposed
    transpose_weights: bool = True
    #: the weight each convolution / matmul read before the rewrite
    readers: Readers = field(default_factory=dict)


@dataclass(frozen=True)
class Pass:
    """One step of a pipeline."""

    name: str
    run: Callable[[ir.Module, PassContext], int]
    #: verify after it: "changed" (when it changed something), "always" or "never"
    verify: Literal["changed", "always", "never"] = "never"
    #: whether it may fail on a valid program (Core AI's own rewrite): its failure, or the
    #: verifier's after it, is raised as :class:`PassFailure`
    fallible: bool = False


class PassFailure(Exception):
    """A fallible pass failed; the module it ran on must be dropped."""

    def __init__(self, step: Pass, error: Exception) -> None:
        super().__init__(f"{step.name}: {error}")
        self.step = step
        self.error = error


def _module_pass(fn: Callable[[ir.Module], int]) -> Callable[[ir.Module, PassContext], int]:
    """A pass that needs nothing but the module, run in its context."""

    def run(module: ir.Module, context: PassContext) -> int:
        with module.context, ir.Location.unknown():
            return fn(module)

    run.__name__ = fn.__name__
    return run


def _transposed_gathered(module: ir.Module, context: PassContext) -> int:
    """Before the rewrite, weights read only by run-time gathers (mixture-of-experts stacks)
    are stored transposed: the rewrite folds their transposes into anonymous copies otherwise.
    Only those: it would fold other readers of the new constants from their placeholder bytes
    (:func:`~coreai_torch.passes.pretranspose.pretranspose_weights`)."""
    if not context.transpose_weights or context.weights is None:
        return 0
    return len(pretranspose_weights(module, context.weights, transposes_read_by=is_dynamic_gather))


def _transposed(module: ir.Module, context: PassContext) -> int:
    """Weights only read transposed (``nn.Linear``) stored transposed."""
    if not context.transpose_weights or context.weights is None:
        return 0
    return len(pretranspose_weights(module, context.weights))


def _folded_weights(module: ir.Module, context: PassContext) -> int:
    """Pending weights an op the rewrite folds reads, made now."""
    if context.weights is None:
        return 0
    return weight_casts.make_folded_weights(module, context.weights)


def _noted_readers(module: ir.Module, context: PassContext) -> int:
    """Which weight each convolution / matmul reads, to name what the rewrite folds."""
    if context.weights is not None:
        context.readers = note_weight_readers(module, context.weights)
    return 0


def _named_folded_weights(module: ir.Module, context: PassContext) -> int:
    """Weights the rewrite computed from others (batch norm folded into a kernel) moved into
    the store, named after the weights they came from (``compress()`` then finds them)."""
    if context.weights is None:
        return 0
    with module.context, ir.Location.unknown():
        return name_folded_weights(module, context.weights, context.readers)


def _pre_compilation_rewrite(module: ir.Module, context: PassContext) -> int:
    """Core AI's own rewrite: constant folding, CSE, DCE, canonicalisation."""
    run_pre_compilation_rewrite(module=module)
    return 1


POST_IMPORT: tuple[Pass, ...] = (
    Pass("runtime misfold guards", _module_pass(protect_from_runtime_misfolds)),
)

PLACEMENT: tuple[Pass, ...] = (
    Pass("int8 scales after matmuls", _module_pass(scales_after_matmul), "changed"),
    Pass("float32 decompression", _module_pass(decompress_to_float32), "changed"),
    Pass("lookups before decompression", _module_pass(lookups_before_decompression), "changed"),
)

#: What runs before Core AI's pre-compilation rewrite, wherever it runs (``optimize()``,
#: ``set_static_shape_config()``), and after it.
BEFORE_REWRITE: tuple[Pass, ...] = (
    Pass("rewrite misfold guards", _module_pass(protect_from_misfolds)),
    Pass("transposed gathered weights", _transposed_gathered),
    Pass("weights the rewrite folds", _folded_weights),
    Pass("weight readers noted", _noted_readers),
)
AFTER_REWRITE: tuple[Pass, ...] = (Pass("folded weights named", _named_folded_weights, "changed"),)

OPTIMIZE: tuple[Pass, ...] = (
    *BEFORE_REWRITE,
    Pass("pre-compilation rewrite", _pre_compilation_rewrite, "always", fallible=True),
    *AFTER_REWRITE,
    Pass("transposed weights", _transposed, "changed"),
    *PLACEMENT,
)


def run(
    passes: Sequence[Pass],
    module: ir.Module,
    context: PassContext,
    *,
    when: str,
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """Run ``passes`` in order on ``module``; returns how many changes they made.

    ``when`` names the pipeline in verifier errors ("after optimize()"); ``progress(done,
    total)`` is called after each pass.  A fallible pass that fails raises
    :class:`PassFailure` (the module may be half rewritten: run on a copy).
    """
    changes = 0
    for done, step in enumerate(passes, 1):
        try:
            changed = step.run(module, context)
            changes += changed
            if step.verify == "always" or (step.verify == "changed" and changed):
                verify_module(module, f"{when} ({step.name})")
        except (RuntimeError, VerificationError) as error:
            if step.fallible:
                raise PassFailure(step, error) from error
            raise
        if progress is not None:
            progress(done, len(passes))
    return changes
