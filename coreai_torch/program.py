"""``AIProgram``: what ``to_coreai()`` returns.

It *is* coreai-core's ``AIProgram`` (``save_asset``, ``set_static_shape_config``, ... work as
documented there) with an ``optimize()`` method and a readable ``str()``.  ``save_asset``
writes the same asset as coreai-core, through :mod:`coreai_torch.ir.saving` (streamed, hashed on
the way, weights stored transposed made as they are written).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path
from typing import Any, Self

from torch.export import ExportedProgram

from coreai_torch import progress as progress_events
from coreai_torch._mlir import ca, clone_module, ir
from coreai_torch.compression.apply import CompressionReport, compress
from coreai_torch.compression.calibration import Calibration
from coreai_torch.compression.config import CompressionConfig
from coreai_torch.frontend.signature import ProgramSignature
from coreai_torch.ir.checks import verify_module
from coreai_torch.ir.saving import save_program
from coreai_torch.ir.weights import WeightStore, referenced_resources
from coreai_torch.passes import pipeline
from coreai_torch.precision.policy import FP32, Precision


class AIProgram(ca.AIProgram):
    """A converted Core AI program (coreai-core's ``AIProgram`` plus :meth:`optimize`)."""

    #: the report of the last :meth:`compress` (None: not compressed here)
    compression_report: CompressionReport | None = None

    #: entry point -> its inputs, outputs and states (set by ``TorchConverter.to_coreai``)
    signatures: dict[str, ProgramSignature]
    #: the precision policy it was converted with (float32: as exported)
    precision: Precision
    #: entry point -> the ExportedProgram it was converted from (for a half-precision
    #: program: the rewritten one, which PyTorch runs in half precision too)
    exported_programs: dict[str, ExportedProgram]

    #: progress of compress(), optimize() and save_asset(), as ``TorchConverter.progress`` (which
    #: ``to_coreai`` copies here): None follows ``coreai_torch.progress`` blocks and the
    #: ``COREAI_TORCH_PROGRESS`` variable
    progress: Any

    def __init__(self, module: ca.Module) -> None:
        super().__init__(module)  # sets _module
        self.signatures = {}
        self.weights = None
        self.progress = None
        self.precision = FP32
        self.exported_programs = {}

    @property
    def weights(self) -> WeightStore | None:
        """The program's weights (set by ``TorchConverter.to_coreai``; None for other programs;
        shared with the program's copies)."""
        return self._weights

    @weights.setter
    def weights(self, store: WeightStore | None) -> None:
        self._weights = store
        if store is not None:
            store.share_with(self)

    @property
    def _module(self) -> ca.Module:
        """coreai-core's module holder, as coreai-core's own methods and outside tools read it
        (coreai-opt's passes walk ``program._module._mlir_module``): the pending data of the
        weights it references (weights ``optimize()`` stores transposed, lazy weights still in
        their checkpoint) is made first (see :attr:`mlir_module`), so that nothing outside reads
        their placeholders.  The package's own code reads :attr:`structural_module` instead."""
        if not getattr(self, "_keep_pending", False):
            self._materialize_weights()
        return self._holder

    @_module.setter
    def _module(self, module: ca.Module) -> None:
        self._holder = module

    @property
    def mlir_module(self) -> ir.Module:
        """The underlying MLIR module (shared, not a copy), its constants' data complete.

        Weights ``optimize()`` stores transposed are made when the asset is written; reading
        this property makes them now, in place (a copy of each), so that anything reading
        constants through MLIR sees their data.  A pass that only rewrites the program's
        structure, and reads weights through ``program.weights.tensor(name)``, may use
        :attr:`structural_module` and keep them deferred.
        """
        self._materialize_weights()
        return self._holder._mlir_module

    @property
    def structural_module(self) -> ir.Module:
        """The underlying MLIR module, where the data of weights stored transposed may still
        be placeholders (see :attr:`mlir_module`): for rewrites that never read a
        constant's data through MLIR."""
        return self._holder._mlir_module

    def _materialize_weights(self) -> None:
        """Make the pending transposed weights this program references (not those only its
        copies reference, nor those no longer referenced at all)."""
        store = getattr(self, "_weights", None)
        if store is not None and store.pending:
            store.materialize(referenced_resources(self.structural_module))

    @property
    def function_names(self) -> list[str]:
        """Names of the entry points (the runtime functions callers use), in order.

        Private graphs (composite ops) and the plain graphs of simple externalization are
        called from the entry points with ``coreai.invoke`` and are not listed.
        """
        names = []
        for op in self.structural_module.body.operations:
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
        # pending weights stay pending: those an op the rewrite folds reads are made by the
        # pipeline, and no other op reading one is folded (passes/weight_casts.py)
        module = self.structural_module
        listener = progress_events.resolve(self.progress)
        context = pipeline.PassContext(self.weights, transpose_weights=transpose_weights)
        total = len(pipeline.OPTIMIZE)
        with progress_events.phase(listener, "optimize", total, "steps") as report:
            with module.context:
                candidate = clone_module(module=module)
            try:
                pipeline.run(
                    pipeline.OPTIMIZE, candidate, context, when="after optimize()", progress=report
                )
            except pipeline.PassFailure as failure:
                reason = str(failure.error).strip().splitlines()[0][:300]
                warnings.warn(
                    "optimize(): Core AI's pre-compilation rewrite failed on this program, "
                    f"which is kept unoptimized (it is valid and runs as is): {reason}",
                    RuntimeWarning,
                    stacklevel=3,
                )
                return self
            self._holder._mlir_module = candidate
        if self.weights is not None:
            self.weights.prune()  # the weights now stored transposed
        return self

    def compress(
        self, config: CompressionConfig, *, calibration: Calibration | None = None
    ) -> CompressionReport:
        """Store the weights ``config`` selects compressed (int8/int4 linear quantization or
        palettes: :mod:`coreai_torch.compression`), in place; returns what was done.

        Either order with :meth:`optimize` works; compressing first saves memory (weights
        read transposed are compressed in the transposed layout directly, so ``optimize()``
        makes no transposed float copies of them).  Half-precision programs and the stacked
        expert weights of mixture-of-experts layers are compressed too.  Weights already
        compressed are left alone; see :mod:`coreai_torch.compression.apply`.  Reports its
        progress like :meth:`optimize` (``"compress"``, bytes of weights fitted).

        ``calibration``: the codes :func:`coreai_torch.compression.calibrate` fitted against
        calibration data (GPTQ, activation-aware scales, weighted palettes, or the forms of a
        :class:`~coreai_torch.compression.Mixed` budget), stored instead of fitting again.
        """
        report = compress(
            self.structural_module,  # weights are read from the store, never constant data
            self.weights,
            config,
            calibration=calibration,
            progress=self.progress,
        )
        if self.weights is not None:
            self.weights.prune()  # the transposes of weights now stored compressed
        self.compression_report = report
        return report

    def save_asset(
        self,
        path: str | os.PathLike[str],
        metadata: Any = None,
        minimum_os: Any = None,
        *,
        streaming: bool | None = None,
    ) -> ca.AIModelAsset:
        """Save the program as a Core AI asset directory ``path`` (``*.aimodel``).

        Writes what coreai-core's ``save_asset`` writes (it also accepts ``str`` paths), at
        about disk speed and without a second copy of the weights (:mod:`coreai_torch.ir.saving`);
        refuses to replace a file or a directory that is not a Core AI asset, and turns
        file-system failures into errors that name the path.  ``minimum_os`` as coreai-core's
        (default ``OSVersion.v27``); ``streaming``: see :func:`coreai_torch.ir.saving.save_program`.
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
        listener = progress_events.resolve(self.progress)
        try:
            with progress_events.phase(listener, "save", 0, "bytes") as report:
                return save_program(
                    self.structural_module,
                    target,
                    metadata=metadata,
                    weights=self.weights,
                    progress=report if listener is not None else None,
                    minimum_os=minimum_os,
                    streaming=streaming,
                )
        except OSError as error:
            raise type(error)(
                error.errno,
                f"save_asset could not write '{target}': {error.strerror or error}. Choose a "
                "path in a writable directory",
            ) from error

    def _save_bytecode(self, path: Path, **kwargs: Any) -> None:
        self._materialize_weights()
        super()._save_bytecode(path, **kwargs)

    def set_static_shape_config(
        self, entrypoint: str, shapes_config: dict[str, dict[str, tuple[int, ...]]]
    ) -> None:
        """coreai-core's ``set_static_shape_config``: ``entrypoint`` replaced by one clone per
        key of ``shapes_config`` (``<entrypoint>_<key>``, its named inputs and states given
        the static shapes), made by Core AI's pre-compilation rewrite -- run, as in
        :meth:`optimize`, after the guards that keep it numerics-preserving.  Call it before
        :meth:`optimize` (weights ``optimize()`` stores transposed would be made now).  The
        clones keep the entry point's signature, without its symbolic sizes."""
        # pending weights stay pending (a streamed model's stay in their checkpoint), as in
        # optimize(): the pipeline makes those an op the rewrite folds reads
        context = pipeline.PassContext(self.weights)
        module = self.structural_module
        pipeline.run(pipeline.BEFORE_REWRITE, module, context, when="set_static_shape_config()")
        self._keep_pending = True  # coreai-core's method reads _module
        try:
            super().set_static_shape_config(entrypoint, shapes_config)
        finally:
            self._keep_pending = False
        pipeline.run(pipeline.AFTER_REWRITE, module, context, when="set_static_shape_config()")
        signature = self.signatures.pop(entrypoint, None)
        if signature is not None:
            for key in shapes_config:
                clone = f"{entrypoint}_{key.strip(chr(34))}"
                self.signatures[clone] = dataclasses.replace(signature, sizes=None)

    def __deepcopy__(self, memo: dict[int, Any]) -> Self:
        # as coreai-core's, without reading ``_module`` (which would make every weight stored
        # transposed now): the copy makes those it reads when it is read or saved
        copy = self._from_mlir_module(clone_module(module=self.structural_module))
        memo[id(self)] = copy
        memo[id(self._holder)] = copy._holder
        memo[id(self.structural_module)] = copy.structural_module
        copy.signatures = dict(self.signatures)
        copy.weights = self.weights  # the same resources (and placeholders) as this program
        copy.progress = self.progress
        return copy

    def __repr__(self) -> str:
        self._materialize_weights()
        return super().__repr__()

    def verify(self) -> None:
        """Raise :class:`VerificationError` if the program is not valid Core AI IR."""
        verify_module(self.structural_module, "")

    def to_mlir(self, *, weights: bool = False, debug_info: bool = False) -> str:
        """The program as MLIR text; weight blobs are elided unless ``weights=True``."""
        if weights:
            text: str = self.mlir_module.operation.get_asm(enable_debug_info=debug_info)
            return text
        module = self.structural_module
        body = "\n".join(
            op.operation.get_asm(enable_debug_info=debug_info) for op in module.body.operations
        )
        indented = "\n".join(f"  {line}" if line else line for line in body.splitlines())
        return f"module {{\n{indented}\n}}\n"

    def __str__(self) -> str:
        """Readable IR: every graph, with weights shown by name (``dense_resource<fc.weight>``)."""
        return self.to_mlir()
