"""``AIProgram``: what ``to_coreai()`` returns.

It *is* coreai-core's ``AIProgram`` (``save_asset``, ``set_static_shape_config``, ... work as
documented there) with an ``optimize()`` method and a readable ``str()``.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Self

from coreai_torch._mlir import ca, clone_module, ir, run_pre_compilation_rewrite
from coreai_torch.errors import VerificationError
from coreai_torch.passes.pretranspose import pretranspose_weights
from coreai_torch.passes.safe_rewrite import protect_from_misfolds
from coreai_torch.signature import ProgramSignature
from coreai_torch.weights import WeightStore


def _verify(module: ir.Module, when: str) -> None:
    diagnostics: list[str] = []

    def collect(diagnostic: object) -> bool:
        diagnostics.append(f"{diagnostic.location}: {diagnostic.message}")  # type: ignore[attr-defined]
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


class AIProgram(ca.AIProgram):
    """A converted Core AI program (coreai-core's ``AIProgram`` plus :meth:`optimize`)."""

    #: entry point -> its inputs, outputs and states (set by ``TorchConverter.to_coreai``)
    signatures: dict[str, ProgramSignature]
    #: the program's weights (set by ``TorchConverter.to_coreai``; None for other programs)
    weights: WeightStore | None

    def __init__(self, module: ca.Module) -> None:
        super().__init__(module)
        self.signatures = {}
        self.weights = None

    @property
    def mlir_module(self) -> ir.Module:
        """The underlying MLIR module (shared, not a copy)."""
        return self._module._mlir_module

    @property
    def function_names(self) -> list[str]:
        """Names of the entry points (the runtime functions callers use), in order.

        Private graphs (composite ops) and the plain graphs of simple externalization are
        called from the entry points with ``coreai.invoke`` and are not listed.
        """
        names = []
        for op in self.mlir_module.body.operations:
            if op.operation.name == "coreai.graph":
                attrs = op.operation.attributes
                if "priv" in attrs or (
                    "sym_visibility" in attrs and str(attrs["sym_visibility"]) == '"private"'
                ):
                    continue
                name = ir.StringAttr(attrs["sym_name"]).value
                if not self.signatures or name in self.signatures:
                    names.append(name)
        return names

    def optimize(self, *, transpose_weights: bool = True) -> Self:
        """Run Core AI's pre-compilation rewrite (constant folding, CSE, DCE, canonicalisation),
        then store weights that are only read transposed (``nn.Linear``) transposed.

        Idempotent and numerics-preserving: patterns the rewrite folds wrongly are put into an
        equivalent form first (:mod:`coreai_torch.passes.safe_rewrite`), and the rewrite works on a
        copy, so a program it cannot handle stays as it was (valid and runnable) with a
        warning.  ``transpose_weights=False`` keeps those weights zero-copy and transposed at
        run time (see :mod:`coreai_torch.passes.pretranspose` for the trade-off).  Modifies the
        program in place and returns it.
        """
        module = self.mlir_module
        with module.context:
            candidate = clone_module(module=module)
            protect_from_misfolds(candidate)
            if transpose_weights and self.weights is not None:
                # before the rewrite too: it folds a weight's transpose feeding a gather (MoE
                # experts) into an anonymous copy, which then no longer is a named weight
                pretranspose_weights(candidate, self.weights)
            try:
                run_pre_compilation_rewrite(module=candidate)
                _verify(candidate, "after optimize()")
            except (RuntimeError, VerificationError) as error:
                reason = str(error).strip().splitlines()[0][:300]
                warnings.warn(
                    "optimize(): Core AI's pre-compilation rewrite failed on this program, "
                    f"which is kept unoptimized (it is valid and runs as is): {reason}",
                    RuntimeWarning,
                    stacklevel=2,
                )
                return self
        if (
            transpose_weights
            and self.weights is not None
            and pretranspose_weights(candidate, self.weights)
        ):
            _verify(candidate, "after storing weights transposed")
        self._module._mlir_module = candidate
        return self

    def save_asset(
        self, path: str | os.PathLike[str], metadata: Any = None, **kwargs: Any
    ) -> ca.AIModelAsset:
        """Save the program as a Core AI asset directory ``path`` (``*.aimodel``).

        Like coreai-core's ``save_asset`` (it also accepts ``str`` paths), but refuses to
        replace a file or a directory that is not a Core AI asset, and turns file-system
        failures into errors that name the path.
        """
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(
                f"save_asset expects a path (str or pathlib.Path) ending in '.aimodel', got "
                f"{type(path).__name__} {path!r}"
            )
        target = Path(path)
        if target.suffix != ".aimodel":
            raise ValueError(
                f"save_asset path must end in '.aimodel' (Core AI assets are directories named "
                f"*.aimodel), got '{target}'; use e.g. '{target.with_suffix('.aimodel')}'"
            )
        replaceable = target.is_dir() and (
            not any(target.iterdir()) or ca.AIModelAsset.is_valid(target)
        )
        if target.exists() and not replaceable:
            kind = "directory" if target.is_dir() else "file"
            raise FileExistsError(
                f"save_asset: '{target}' exists and is a {kind}, not a Core AI asset; refusing "
                "to replace it. Remove it or choose another path."
            )
        try:
            return super().save_asset(target, metadata, **kwargs)
        except OSError as error:
            raise type(error)(
                error.errno,
                f"save_asset could not write '{target}': {error.strerror or error}. Choose a "
                "path in a writable directory",
            ) from error

    def verify(self) -> None:
        """Raise :class:`VerificationError` if the program is not valid Core AI IR."""
        _verify(self.mlir_module, "")

    def to_mlir(self, *, weights: bool = False, debug_info: bool = False) -> str:
        """The program as MLIR text; weight blobs are elided unless ``weights=True``."""
        module = self.mlir_module
        if weights:
            return module.operation.get_asm(enable_debug_info=debug_info)
        body = "\n".join(
            op.operation.get_asm(enable_debug_info=debug_info) for op in module.body.operations
        )
        indented = "\n".join(f"  {line}" if line else line for line in body.splitlines())
        return f"module {{\n{indented}\n}}\n"

    def __str__(self) -> str:
        """Readable IR: every graph, with weights shown by name (``dense_resource<fc.weight>``)."""
        return self.to_mlir()
