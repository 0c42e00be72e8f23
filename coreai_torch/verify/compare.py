"""Comparing outputs with eager PyTorch: per-output errors, tolerances, reports.

:func:`compare` is the one comparison the project uses (tests, the OpInfo sweep, the fuzzer,
``verify``, ``find_divergence``, the CLI): NaN and Inf must appear in the same places,
integers must be equal, floats within ``atol + rtol * |expected|``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree

from coreai_torch.precision import from_spec


def to_numpy(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.dtype == torch.bfloat16:
            value = value.float()
        array: np.ndarray = value.numpy()
        return array
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
    #: or loses too much (a ``coreai_torch.verify.bisect.Divergence``), when it was searched
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
        errors = np.abs(e64 - a64)[finite]
    max_abs = float(errors.max()) if errors.size else 0.0
    scale = max(1.0, float(np.abs(e64[finite]).max()) if finite.any() else 1.0)
    max_rel = max_abs / scale
    ok = bool(np.all(errors <= atol + rtol * np.abs(e64[finite]))) if errors.size else True
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


def tolerances(
    expected: Any, atol: float, rtol: float, tolerance: float | None
) -> dict[str, float]:
    """``atol``/``rtol`` for one output: relative to its peak when ``tolerance`` is given."""
    if tolerance is None or not isinstance(expected, torch.Tensor) or not expected.numel():
        return {"atol": atol, "rtol": rtol}
    peak = float(expected.detach().abs().float().max())
    return {"atol": tolerance * max(1.0, peak if math.isfinite(peak) else 1.0), "rtol": 0.0}
