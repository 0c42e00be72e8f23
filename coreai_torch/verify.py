"""Check a converted program against eager PyTorch on the Core AI runtime.

    report = verify(model, (x,))                  # export, convert, run, compare
    print(report)                                 # per-output max abs / rel error
    assert report.ok

``verify`` works from an ``nn.Module`` (exported for you) or from an already converted
program plus the module it came from.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.export import ExportedProgram

from coreai_torch.decomp import get_decomp_table
from coreai_torch.program import AIProgram
from coreai_torch.runtime import Session
from coreai_torch.torch_compat import run_decompositions


def export_decomposed(
    model: nn.Module,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None = None,
    *,
    dynamic_shapes: Any = None,
    strict: bool = False,
) -> ExportedProgram:
    """``torch.export`` + ``run_decompositions(get_decomp_table())`` in one call."""
    ep = torch.export.export(
        model, tuple(args), dict(kwargs or {}), dynamic_shapes=dynamic_shapes, strict=strict
    )
    return run_decompositions(ep, get_decomp_table())


def to_numpy(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.dtype == torch.bfloat16:
            value = value.float()
        return value.numpy()
    return np.asarray(value)


@dataclass
class OutputError:
    """How far one output of the converted program is from PyTorch."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    max_abs: float
    max_rel: float
    ok: bool
    problem: str = ""

    def __str__(self) -> str:
        status = "ok" if self.ok else "MISMATCH"
        extra = f"  ({self.problem})" if self.problem else ""
        return (
            f"{self.name:<24} {self.dtype:<8} {self.shape!s:<20} max|err| {self.max_abs:.3e}"
            f"  max rel {self.max_rel:.3e}  {status}{extra}"
        )


@dataclass
class VerifyReport:
    """Per-output comparison of one or more runs."""

    outputs: list[OutputError] = field(default_factory=list)
    #: for a half-precision program that does not match: the first FX node that overflows
    #: or loses too much (a ``coreai_torch.debugging.Divergence``), when it was searched
    divergence: Any = None

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.outputs)

    @property
    def max_abs(self) -> float:
        return max((o.max_abs for o in self.outputs), default=0.0)

    def __str__(self) -> str:
        lines = [str(o) for o in self.outputs]
        if self.divergence is not None:
            lines.append(str(self.divergence))
        return "\n".join(lines)


#: The default tolerance of a half-precision program against float32 PyTorch: every output
#: within ``tolerance * max(1, max|expected|)`` (docs/precision.md has what the model
#: families reach).
HALF_TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 5e-2}


def half_tolerance(precision: Any) -> float:
    """The default :data:`HALF_TOLERANCE` of a precision policy (or spec such as "fp16")."""
    from coreai_torch.precision import from_spec

    return HALF_TOLERANCE[from_spec(precision).compute]


def compare(
    name: str, expected: Any, actual: Any, *, atol: float = 1e-4, rtol: float = 1e-4
) -> OutputError:
    """Compare one output; NaN/Inf must appear in the same places, integers must be equal."""
    exp, act = to_numpy(expected), to_numpy(actual)
    shape = tuple(exp.shape)
    if tuple(act.shape) != shape:
        return OutputError(
            name,
            shape,
            str(exp.dtype),
            math.inf,
            math.inf,
            False,
            f"shape {tuple(act.shape)} != {shape}",
        )
    if exp.size == 0:
        return OutputError(name, shape, str(exp.dtype), 0.0, 0.0, True)
    if np.iscomplexobj(exp) or np.iscomplexobj(act):  # compare real and imaginary parts
        pairs = [np.stack([np.real(a), np.imag(a)], -1) for a in (exp, act)]
        result = compare(name, pairs[0], pairs[1], atol=atol, rtol=rtol)
        result.shape, result.dtype = shape, str(exp.dtype)
        return result
    if exp.dtype == np.bool_ or np.issubdtype(exp.dtype, np.integer):
        wrong = int(np.sum(exp != act.astype(exp.dtype)))
        diff = float(np.max(np.abs(exp.astype(np.float64) - act.astype(np.float64))))
        return OutputError(
            name,
            shape,
            str(exp.dtype),
            diff,
            diff,
            wrong == 0,
            f"{wrong} element(s) differ" if wrong else "",
        )
    e64, a64 = exp.astype(np.float64), act.astype(np.float64)
    nan_mismatch = np.isnan(e64) != np.isnan(a64)
    # an infinity on either side must be the same infinity on the other (a finite value
    # that became inf is a mismatch, not a skipped element)
    either_nan = np.isnan(e64) | np.isnan(a64)
    inf_mismatch = (np.isinf(e64) | np.isinf(a64)) & ~either_nan & (e64 != a64)
    finite = np.isfinite(e64) & np.isfinite(a64)
    with np.errstate(invalid="ignore"):  # inf - inf where both are inf; masked out below
        diff = np.abs(e64 - a64)[finite]
    max_abs = float(diff.max()) if diff.size else 0.0
    scale = max(1.0, float(np.abs(e64[finite]).max()) if finite.any() else 1.0)
    max_rel = max_abs / scale
    ok = bool(np.all(diff <= atol + rtol * np.abs(e64[finite]))) if diff.size else True
    problem = ""
    if nan_mismatch.any() or inf_mismatch.any():
        ok = False
        problem = "NaN/Inf placement differs"
    return OutputError(name, shape, str(exp.dtype), max_abs, max_rel, ok, problem)


def eager_outputs(
    model: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any] | None = None
) -> list[Any]:
    """Run the model in eager mode on copies of the inputs; returns flattened outputs."""
    args_copy, kwargs_copy = pytree.tree_map(
        lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v),
        (tuple(args), dict(kwargs or {})),
    )
    with torch.no_grad():
        out = model(*args_copy, **kwargs_copy)
    return pytree.tree_leaves(out)


def run_entrypoint(
    session: Session,
    program: AIProgram,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None = None,
    *,
    entrypoint: str = "main",
    state: Mapping[str, Any] | None = None,
) -> list[np.ndarray]:
    """Call ``entrypoint`` with forward()-style arguments; returns outputs in return order."""
    sig = program.signatures[entrypoint]
    flat = pytree.tree_leaves((tuple(args), dict(kwargs or {})))
    inputs, input_states = sig.feeds(flat)
    if state is None and entrypoint not in session.states:
        state = {**{k: v.clone() for k, v in sig.initial_states.items()}, **input_states}
    out = session.run(inputs, entrypoint=entrypoint, state=state)
    return [out[o.name] for o in sig.outputs]


def verify(
    model: nn.Module,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None = None,
    *,
    program: AIProgram | None = None,
    atol: float = 1e-4,
    rtol: float = 1e-4,
    entrypoint: str = "main",
    precision: Any = None,
    tolerance: float | None = None,
    bisect: bool = True,
) -> VerifyReport:
    """Convert ``model`` (unless ``program`` is given), run it on the runtime, compare.

    The comparison allows ``atol + rtol * |expected|`` per element.

    Half precision: ``precision="fp16"`` / ``"bf16"`` (or a ``Precision``) converts in that
    precision; a given ``program`` converted in half precision is checked as such.  The
    outputs are compared with the model in float32, within ``tolerance * max(1,
    max|expected|)`` (default :data:`HALF_TOLERANCE`; ``atol``/``rtol`` do not apply), and
    when they do not match (and ``bisect``) the report names the first FX node that
    overflows or loses more than that, with its source line (``report.divergence``).
    """
    from coreai_torch.converter import TorchConverter
    from coreai_torch.precision import from_spec

    policy = from_spec(precision) if precision is not None else None
    if program is None:
        ep = export_decomposed(model, args, kwargs)
        converter = TorchConverter(compute_precision=policy or "fp32")
        program = converter.add_exported_program(ep, entrypoint_name=entrypoint).to_coreai()
    policy = policy or getattr(program, "precision", None)
    half = policy is not None and policy.is_half
    if half and tolerance is None:
        tolerance = half_tolerance(policy)
    expected = eager_outputs(model, args, kwargs)
    with Session(program) as session:
        actual = run_entrypoint(session, program, args, kwargs, entrypoint=entrypoint)
    names = [o.name for o in program.signatures[entrypoint].outputs]
    report = VerifyReport(
        [
            compare(n, e, a, **tolerances(e, atol, rtol, tolerance))
            for n, e, a in zip(names, expected, actual, strict=True)
        ]
    )
    if half and bisect and not report.ok:
        report.divergence = find_divergence(
            model, args, kwargs, precision=policy, tolerance=tolerance
        )
    return report


def tolerances(
    expected: Any, atol: float, rtol: float, tolerance: float | None
) -> dict[str, float]:
    """``atol``/``rtol`` for one output: relative to its peak when ``tolerance`` is given."""
    if tolerance is None or not isinstance(expected, torch.Tensor) or not expected.numel():
        return {"atol": atol, "rtol": rtol}
    peak = float(expected.detach().abs().float().max())
    return {"atol": tolerance * max(1.0, peak if math.isfinite(peak) else 1.0), "rtol": 0.0}


def find_divergence(
    model_or_ep: nn.Module | ExportedProgram,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None = None,
    **options: Any,
) -> Any:
    """The first FX node whose converted value diverges from PyTorch (a
    ``coreai_torch.debugging.Divergence``), or None when the outputs match.

    Bisects over prefixes of the graph; ``options``: ``converter`` (whose lowerings to use),
    ``atol``, ``rtol``, ``optimize``, ``log``.  See :mod:`coreai_torch.debugging`.
    """
    from coreai_torch.debugging import find_divergence as find

    return find(model_or_ep, args, kwargs, **options)
