"""``TorchConverter``: stage PyTorch programs, then convert them into one Core AI program."""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
import torch.nn as nn
from torch.export import ExportedProgram

from coreai_torch import _mlir
from coreai_torch._mlir import ir
from coreai_torch.errors import ConversionError, InvalidSignatureError
from coreai_torch.frontend import hints
from coreai_torch.frontend.checks import check_complex
from coreai_torch.frontend.export import check_decomposed
from coreai_torch.frontend.externalize import ExternalizeSpec, prepare_externalization
from coreai_torch.frontend.fusions import fuse_patterns
from coreai_torch.frontend.half_precision import to_half
from coreai_torch.frontend.precision_checks import (
    RangeCheck,
    check_selectors,
    plan_range_check,
    range_policy,
)
from coreai_torch.frontend.signature import ProgramSignature, analyze_signature
from coreai_torch.importer.externalized import import_externalized
from coreai_torch.importer.graph import (
    Diagnostics,
    GraphImporter,
    ProgramBuilder,
)
from coreai_torch.importer.metal import (
    METAL_KERNEL_OP,
    TorchMetalKernel,
    check_kernels_registered,
    register_kernels,
)
from coreai_torch.ir.checks import check_runtime_hazards, verify_module
from coreai_torch.locations import describe, names_in_location
from coreai_torch.lowerings import BUILTIN_LOWERINGS
from coreai_torch.lowerings.registry import (
    LoweringOptions,
    LoweringTable,
    check_user_lowering_name,
    context_parameter_problem,
    lowering_key,
    resolve_op,
    rule_parameter_problem,
    schema_bound,
)
from coreai_torch.passes import pipeline
from coreai_torch.precision.policy import ModuleSelector, NodePredicate, Precision, from_spec
from coreai_torch.program import AIProgram
from coreai_torch.progress import resolve as resolve_progress


@dataclass
class StagedProgram:
    """A program waiting for ``to_coreai()``, with its resolved signature."""

    entrypoint: str
    exported_program: ExportedProgram
    signature: ProgramSignature
    #: set by add_pytorch_module when submodules are externalized
    externalize: list[Any] = field(default_factory=list)
    module: nn.Module | None = None


@dataclass
class ConversionStats:
    """Timings of the last ``to_coreai()`` call, per entry point (seconds)."""

    seconds: dict[str, float] = field(default_factory=dict)
    verify_seconds: float = 0.0
    weight_bytes: int = 0
    #: half precision: the activation range check of each entry point (included in
    #: ``seconds``), see ``TorchConverter(check_range=...)``
    range_checks: dict[str, RangeCheck] = field(default_factory=dict)


def _check_entrypoint_name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise InvalidSignatureError(f"entrypoint_name must be a non-empty string, got {name!r}")
    if not all(c.isalnum() or c in "_.-" for c in name):
        raise InvalidSignatureError(
            f"entrypoint_name {name!r} may only contain letters, digits, '_', '.' and '-'"
        )
    return name


def _lowering_signature_problem(
    fn: Callable[..., Any], signature: inspect.Signature, name: str, bind: bool
) -> str | None:
    """Why ``fn`` cannot be called in its form (``""`` or ``": reason"``), None if it can.

    A ``bind=True`` lowering is checked against the op's schema when the op is defined now
    (else when it is first called).
    """
    if not bind:
        try:
            signature.bind(None, None, None)
        except TypeError:
            return ""
        return None
    op = resolve_op(name)
    problem = (
        context_parameter_problem(fn) if op is None else rule_parameter_problem(fn, op._schema)
    )
    return None if problem is None else f": {problem}"


class TorchConverter:
    """Converts ``torch.export`` programs and ``nn.Module``s into a Core AI ``AIProgram``.

    Stage programs with :meth:`add_exported_program` / :meth:`add_pytorch_module` (each becomes
    one entry point), then call :meth:`to_coreai`.

    The keyword-only options switch IR simplifications off (both are on by default), e.g. to
    measure what they buy or to hand a compiler the plainest IR:

    - ``fold_constants``: evaluate input-independent nodes (masks, rotary tables, position
      ids, ...) with PyTorch at conversion time (:mod:`coreai_torch.frontend.folding`).
    - ``aten_composites``: emit ``layer_norm``, ``rms_norm``, ``group_norm``,
      ``instance_norm``, ``pixel_shuffle`` and ``scaled_dot_product_attention`` as composite
      ops; ``False`` inlines their reference implementation.

    Half precision (``docs/precision.md``): ``compute_precision=torch.float16`` or
    ``torch.bfloat16`` (or a :class:`~coreai_torch.precision.Precision`) stores floating weights
    in that type and computes in it, with the default fp32 islands (softmax, exp/log/pow,
    sums and means, cumulative sums, attention scores; ``fp32_islands=False`` drops them) and
    whatever ``keep_fp32_ops`` (``{"aten::mm"}``), ``keep_fp32_modules`` (module paths,
    class names or classes: ``["lm_head", LlamaRMSNorm]``) and ``keep_fp32`` (a predicate on
    the FX node) select; a selector naming no op or module of the program is an error.
    Weights beyond the half type's range stay in float32 (with a warning), and the float32
    program runs once on the ``torch.export`` program's example inputs (when its weights take
    at most ``precision_checks.AUTO_MAX_WEIGHT_BYTES``, for at most ``AUTO_MAX_SECONDS``) to
    keep the nodes whose values overflow the half type in float32 (with a warning naming
    them): ``check_range=sample_inputs`` (forward() arguments; a dict per entry point when
    there are several) runs it on those instead, ``True`` on the example inputs whatever it
    costs, ``False`` not at all (``last_stats.range_checks`` says what ran).  Inputs and
    outputs keep their dtypes unless ``io_dtype`` says otherwise.  The default,
    ``torch.float32``, converts the program as exported.  Products of 16-bit operands
    accumulate in float32 like ATen's (``fp32_accumulation=False``: in 16 bits).
    """

    def __init__(
        self,
        *,
        fold_constants: bool = True,
        aten_composites: bool = True,
        compute_precision: torch.dtype | Precision | str = torch.float32,
        io_dtype: torch.dtype | None = None,
        keep_fp32_ops: Collection[str] = (),
        keep_fp32_modules: Collection[ModuleSelector] = (),
        keep_fp32: NodePredicate | None = None,
        fp32_islands: bool = True,
        fp32_accumulation: bool = True,
        check_range: Sequence[Any] | Mapping[str, Sequence[Any]] | bool | None = None,
    ) -> None:
        self.fold_constants = fold_constants
        #: the inputs a half-precision conversion runs the float32 program on, keeping the
        #: nodes whose values leave the half type's range in float32 (``docs/precision.md``):
        #: None the exported programs' example inputs (within a cost cap), True the same
        #: without the cap, False none, or sample inputs
        self.check_range = check_range
        self.aten_composites = aten_composites
        #: the precision policy (``coreai_torch.precision.Precision``)
        self.precision = _precision(
            compute_precision,
            io_dtype=io_dtype,
            keep_fp32_ops=keep_fp32_ops,
            keep_fp32_modules=keep_fp32_modules,
            keep_fp32=keep_fp32,
            fp32_islands=fp32_islands,
            fp32_accumulation=fp32_accumulation,
        )
        if check_range not in (None, False, True) and not self.precision.is_half:
            raise ValueError(
                "check_range= is for half-precision conversions: it keeps in float32 the "
                "nodes whose values leave the half type's range; give compute_precision='fp16' "
                "or 'bf16' too"
            )
        #: whether to_coreai() checks that the precision selectors match the staged programs
        #: (not for the partial programs ``find_divergence`` converts)
        self._check_selectors = True
        self._staged: dict[str, StagedProgram] = {}
        self._lowerings = LoweringTable(fallback=BUILTIN_LOWERINGS)
        self._kernels: dict[str, TorchMetalKernel] = {}
        #: timings of the last to_coreai() call
        self.last_stats = ConversionStats()
        #: modules of earlier conversions that ran this converter's own lowerings: kept alive
        #: so that values a lowering wrongly kept between calls are reported, not dereferenced
        #: after they were freed (which would crash the process)
        self._kept_modules: list[ir.Module] = []
        #: progress of to_coreai(): None (follow ``coreai_torch.progress`` blocks and the
        #: COREAI_TORCH_PROGRESS variable), True (a progress bar), False, or a listener /
        #: ``callback(entrypoint, done, total)``
        self.progress: Any = None

    # -- staging ------------------------------------------------------------------------------

    def add_exported_program(
        self,
        exported_program: ExportedProgram,
        input_names: Sequence[str] | None = None,
        output_names: Sequence[str] | None = None,
        state_names: Sequence[str] | None = None,
        entrypoint_name: str = "main",
    ) -> TorchConverter:
        """Stage a decomposed ``ExportedProgram`` as entry point ``entrypoint_name``.

        ``exported_program`` must have been through ``run_decompositions(get_decomp_table())``.
        Returns ``self`` for chaining.
        """
        self._stage(exported_program, input_names, output_names, state_names, entrypoint_name)
        return self

    def add_pytorch_module(
        self,
        module: nn.Module,
        export_fn: Callable[[nn.Module], ExportedProgram],
        externalize_modules: Sequence[ExternalizeSpec | type[nn.Module]] | None = None,
        input_names: Sequence[str] | None = None,
        output_names: Sequence[str] | None = None,
        state_names: Sequence[str] | None = None,
        entrypoint_name: str = "main",
    ) -> TorchConverter:
        """Export ``module`` with ``export_fn`` (which must decompose) and stage the result.

        ``externalize_modules`` lists ``ExternalizeSpec``s (or bare classes) of submodules to
        keep as separate (composite) graphs.  Returns ``self`` for chaining.
        """
        if not isinstance(module, nn.Module):
            raise TypeError(f"add_pytorch_module expects an nn.Module, got {type(module).__name__}")
        if not callable(export_fn):
            raise TypeError(
                "export_fn must be a callable taking the module and returning a decomposed "
                "ExportedProgram, e.g. lambda m: torch.export.export(m, args=sample)"
                ".run_decompositions(coreai_torch.get_decomp_table())"
            )
        _check_entrypoint_name(entrypoint_name)
        self._check_unique(entrypoint_name)

        with prepare_externalization(module, externalize_modules) as plan:
            try:
                exported = export_fn(module)
            except ConversionError:
                raise
            except Exception as error:
                raise ConversionError(
                    hints.with_hint(
                        f"export_fn raised {type(error).__name__} while exporting "
                        f"{type(module).__name__}: {error}",
                        hints.for_export_failure(module, error),
                    )
                ) from error
        if exported is None:
            raise ConversionError(
                "export_fn returned None; it must return the decomposed ExportedProgram, e.g. "
                "lambda m: torch.export.export(m, args=sample).run_decompositions("
                "coreai_torch.get_decomp_table())"
            )
        staged = self._stage(exported, input_names, output_names, state_names, entrypoint_name)
        staged.module = module
        staged.externalize = plan
        return self

    def _check_unique(self, entrypoint_name: str) -> None:
        if entrypoint_name in self._staged:
            raise InvalidSignatureError(
                f"entrypoint_name '{entrypoint_name}' is already staged; every program needs "
                f"a unique entry point name (staged: {list(self._staged)})"
            )

    def _stage(
        self,
        ep: ExportedProgram,
        input_names: Sequence[str] | None,
        output_names: Sequence[str] | None,
        state_names: Sequence[str] | None,
        entrypoint_name: str,
    ) -> StagedProgram:
        if not isinstance(ep, ExportedProgram):
            hint = (
                " — for an nn.Module use add_pytorch_module(module, export_fn=...)"
                if isinstance(ep, nn.Module)
                else ""
            )
            raise TypeError(
                f"expected a torch.export.ExportedProgram, got {type(ep).__name__}{hint}"
            )
        _check_entrypoint_name(entrypoint_name)
        self._check_unique(entrypoint_name)
        check_decomposed(ep)
        check_kernels_registered(ep, self._kernels)
        signature = analyze_signature(ep, input_names, output_names, state_names)
        staged = StagedProgram(entrypoint_name, ep, signature)
        self._staged[entrypoint_name] = staged
        return staged

    @property
    def entrypoints(self) -> list[str]:
        """Names of the staged programs, in staging order."""
        return list(self._staged)

    def clear(self, *, entrypoints: Sequence[str] | None = None) -> None:
        """Remove staged programs (all, or those named); registered lowerings are kept."""
        if entrypoints is None:
            self._staged.clear()
            return
        names = self._select(entrypoints, "clear")
        for name in names:
            del self._staged[name]

    def _select(self, entrypoints: Sequence[str], what: str) -> list[str]:
        if isinstance(entrypoints, str):
            raise TypeError(
                f"{what}(entrypoints=...) expects a sequence of names, got the string "
                f"{entrypoints!r}; use entrypoints=[{entrypoints!r}]"
            )
        try:
            names = list(entrypoints)
        except TypeError:
            raise TypeError(
                f"{what}(entrypoints=...) expects a sequence of entry point names, got "
                f"{type(entrypoints).__name__} {entrypoints!r}; use e.g. "
                f"entrypoints={list(self._staged)[:1]!r}"
            ) from None
        repeated = sorted({n for n in names if names.count(n) > 1}, key=names.index)
        if repeated:
            raise InvalidSignatureError(
                f"{what}(entrypoints=...) names {', '.join(repr(n) for n in repeated)} more than "
                f"once: {names!r}; list each entry point once (staged entry points are "
                f"{list(self._staged)})"
            )
        unknown = [n for n in names if n not in self._staged]
        if unknown:
            raise InvalidSignatureError(
                f"{what}(entrypoints=...): unknown entry point(s) {unknown}; staged entry "
                f"points are {list(self._staged)}"
            )
        return names

    # -- lowerings ----------------------------------------------------------------------------

    def register_torch_lowering(
        self, qualified_name: str, allow_override: bool = False, *, bind: bool = False
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator registering a lowering for ``qualified_name`` on this converter.

        The simple form (``bind=False``, the default) registers ``fn(values_map, node, loc) ->
        Value | list[Value]``.  With ``bind=True`` the lowering is written like the built-in
        ones, ``fn(cx, **arguments)``: the node's arguments are bound to the op's schema by name
        (tensors as Core AI values, defaults filled in), ``cx`` is the node's
        :class:`~coreai_torch.lowerings.LoweringContext`, and an argument ``fn`` does not
        declare must keep its default, otherwise the node is reported as unsupported.  In both
        forms what the lowering returns is checked against PyTorch's result.

        The name is ``"namespace::op_name.overload"`` (ops defined with
        ``@torch.library.custom_op`` use ``.default``); without the overload the lowering
        applies to every overload of the op.  Lowerings belong to this converter only, take
        precedence over the built-in ones and survive :meth:`clear`.

        Raises ``ValueError`` for a malformed name, any name in a reserved namespace (``aten``,
        ``higher_order``, ``coreai``, ``coreaix``) or a name already registered here, unless
        ``allow_override=True`` (which replaces silently); ``TypeError`` for a lowering that
        cannot be called in its form (with ``bind=True``, one whose parameters the op's schema
        does not have, when the op is defined by then).
        """
        if callable(qualified_name):
            fn_name = getattr(qualified_name, "__name__", repr(qualified_name))
            raise TypeError(
                f"register_torch_lowering was applied directly to {fn_name!r}; it needs the "
                "op's qualified name: decorate with "
                "@converter.register_torch_lowering('namespace::op_name.overload') (with "
                "parentheses)"
            )
        for flag, value in (("allow_override", allow_override), ("bind", bind)):
            if not isinstance(value, bool):
                raise TypeError(
                    f"register_torch_lowering: {flag} must be True or False, got "
                    f"{type(value).__name__} {value!r}"
                )
        check_user_lowering_name(qualified_name, self._lowerings, allow_override)

        def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
            expected = (
                "fn(cx, **arguments) with the op's arguments by name"
                if bind
                else "fn(values_map, node, loc) returning a Core AI value (or a list of them)"
            )
            if not callable(fn):
                raise TypeError(
                    f"register_torch_lowering({qualified_name!r}) decorates a lowering "
                    f"function {expected}; got {type(fn).__name__} {fn!r}"
                )
            try:
                signature = inspect.signature(fn)
            except (TypeError, ValueError):  # builtins without a signature: trust the caller
                signature = None
            if signature is not None:
                problem = _lowering_signature_problem(fn, signature, qualified_name, bind)
                if problem is not None:
                    raise TypeError(
                        f"register_torch_lowering({qualified_name!r}): the lowering "
                        f"{getattr(fn, '__qualname__', fn)!r} takes {signature}, but lowerings "
                        f"{'registered with bind=True ' if bind else ''}are called as "
                        f"{expected}{problem}"
                    )
            check_user_lowering_name(qualified_name, self._lowerings, allow_override)
            callback = schema_bound(fn) if bind else fn
            self._lowerings.register(qualified_name, callback, allow_override=True)
            return fn

        return decorate

    def register_custom_kernels(self, kernels: Sequence[TorchMetalKernel]) -> TorchConverter:
        """Register the ``TorchMetalKernel``s the model calls, so their calls lower to
        ``coreai.metal4_kernel``.  Call it before staging the program; returns ``self``."""
        register_kernels(self, kernels)
        return self

    def is_supported(self, node: torch.fx.Node) -> bool:
        """Whether this converter has a lowering for ``node`` (structural nodes always pass).

        A lowering may still reject particular arguments while converting.
        """
        key = lowering_key(node)
        return key is None or key in self._lowerings

    @property
    def lowerings(self) -> LoweringTable:
        """This converter's lowering table (its own registrations in front of the built-ins)."""
        return self._lowerings

    # -- conversion ---------------------------------------------------------------------------

    def to_coreai(self, *, entrypoints: Sequence[str] | None = None) -> AIProgram:
        """Convert the staged programs (all, or those named) into one ``AIProgram``."""
        if not self._staged:
            raise ConversionError(
                "nothing to convert: stage a program with add_exported_program() or "
                "add_pytorch_module() before calling to_coreai()"
            )
        names = (
            list(self._staged) if entrypoints is None else self._select(entrypoints, "to_coreai")
        )
        if not names:
            raise ConversionError("to_coreai(entrypoints=[]) selects no program to convert")

        context = _mlir.new_context()
        diagnostics = Diagnostics(context)
        stats = ConversionStats()
        progress = resolve_progress(self.progress)
        builder: ProgramBuilder | None = None
        try:
            with context, ir.Location.unknown():
                module = ir.Module.create()
                builder = ProgramBuilder(
                    context,
                    module,
                    diagnostics,
                    progress=progress,
                    fold_constants=self.fold_constants,
                    precision=self.precision,
                    options=LoweringOptions(
                        aten_composites=self.aten_composites,
                        fp32_accumulation=self.precision.fp32_accumulation,
                    ),
                )
                # (externalized modules are traced while importing: their nodes are not known)
                externalized = any(s.externalize for s in self._staged.values())
                if self.precision.is_half and self._check_selectors and not externalized:
                    check_selectors(
                        self.precision, [s.exported_program for s in self._staged.values()]
                    )
                imported = {}
                for name in names:
                    staged = self._staged[name]
                    start = time.perf_counter()
                    check_complex(
                        staged.exported_program, name, user_lowered=self._lowerings.is_own_node
                    )
                    imported[name] = self._import(builder, staged, stats, progress)
                    stats.seconds[name] = time.perf_counter() - start
                start = time.perf_counter()
                pipeline.run(
                    pipeline.POST_IMPORT,
                    module,
                    pipeline.PassContext(builder.weights),
                    when="after conversion",
                )
                _verify_with_sources(module, builder, self._lowerings)
                nodes = builder.nodes
                check_runtime_hazards(module, lambda n: describe(nodes[n]) if n in nodes else None)
                stats.verify_seconds = time.perf_counter() - start
                stats.weight_bytes = builder.weights.total_bytes
        finally:
            diagnostics.detach()
            if progress is not None:
                progress.close()
            if builder is not None and builder.ran_own_lowerings:
                self._kept_modules.append(builder.module)
        self.last_stats = stats
        program = AIProgram._from_mlir_module(module)
        program.signatures = {name: staged.signature for name, staged in imported.items()}
        program.exported_programs = {
            name: staged.exported_program for name, staged in imported.items()
        }
        program.weights = builder.weights
        program.progress = self.progress
        program.precision = self.precision
        return program

    def _import(
        self,
        builder: ProgramBuilder,
        staged: StagedProgram,
        stats: ConversionStats,
        progress: Any = None,
    ) -> StagedProgram:
        """Import one staged program; returns it as converted (in half precision: the
        rewritten program and its signature)."""
        if self.precision.is_half:
            name = staged.entrypoint
            check = plan_range_check(
                self.check_range, staged.exported_program, name, self.entrypoints
            )
            if check is not None:
                stats.range_checks[name] = check

            def report(done: int, total: int) -> None:
                if progress is not None:
                    progress.update(f"range check {name}", done, total, "nodes run")

            policy = range_policy(
                staged.exported_program, self.precision, check=check, progress=report
            )
            ep, signature = to_half(
                staged.exported_program,
                staged.signature,
                policy,
                builder.half_weights,
                usable=self._lowerings.is_free_of_own_rules,
            )
            staged = dataclasses.replace(staged, exported_program=ep, signature=signature)
        fused = fuse_patterns(staged.exported_program, self._lowerings.is_free_of_own_rules)
        importer = GraphImporter(
            builder, fused, staged.signature, self._lowerings, staged.entrypoint
        )
        if staged.externalize:
            import_externalized(staged.externalize, importer)
        else:
            importer.run()
        return staged


def _precision(compute: torch.dtype | Precision | str, **options: Any) -> Precision:
    """The converter's precision policy from its keyword arguments (given options add to /
    override those of a ``Precision`` passed as ``compute_precision``)."""

    policy = from_spec(compute)
    given = Precision(policy.compute, **options)  # validates the options
    defaults = Precision(policy.compute)
    changed = {k: getattr(given, k) for k in options if getattr(given, k) != getattr(defaults, k)}
    if "keep_fp32_ops" in changed:
        changed["keep_fp32_ops"] = policy.keep_fp32_ops | changed["keep_fp32_ops"]
    if "keep_fp32_modules" in changed:
        changed["keep_fp32_modules"] = (*policy.keep_fp32_modules, *changed["keep_fp32_modules"])
    return dataclasses.replace(policy, **changed) if changed else policy


def _verify_with_sources(
    module: ir.Module, builder: ProgramBuilder, lowerings: LoweringTable | None = None
) -> None:
    """Verify; on failure name the FX node and the user's source line of each bad op."""
    try:
        verify_module(module, "after conversion")
    except ConversionError as error:
        text = str(error)
        nodes, own, kernels = [], [], []
        for name in names_in_location(text):
            node = builder.nodes.get(name)
            if node is not None:
                nodes.append(f"  - {describe(node)}")
                key = lowering_key(node)
                if key == METAL_KERNEL_OP:
                    kernels.append(str(node.args[1]))
                    continue
                registered = lowerings.own_names() if lowerings is not None else []
                if key and (key in registered or key.rsplit(".", 1)[0] in registered):
                    own.append(key)
        if nodes:
            text += "\nproduced by:\n" + "\n".join(nodes)
        if kernels:
            fix = (
                f"\nThe call of Metal kernel '{kernels[0]}' (registered with "
                "register_custom_kernels) built this invalid coreai.metal4_kernel op: check the "
                "dtypes and shapes of the tensors passed to the kernel and returned by its "
                "torch_defn against the verifier message, then call to_coreai() again."
            )
        elif own:
            fix = (
                f"\nThe lowering registered with register_torch_lowering({own[0]!r}) built "
                "this invalid op: fix the operands it passes (types, ranks, index dtypes) as "
                "the verifier message says, then call to_coreai() again."
            )
        else:
            fix = (
                "\nA lowering produced invalid Core AI IR (for a built-in lowering this is a "
                "coreai-torch bug; please report it)."
            )
        raise type(error)(text + fix) from error
