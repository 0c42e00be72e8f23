"""Check a converted program against eager PyTorch on the Core AI runtime.

    report = verify(model, (x,))                  # export, convert, run, compare
    print(report)                                 # per-output max abs / rel error
    assert report.ok

``verify`` works from an ``nn.Module`` (exported for you) or from an already converted
program plus the module it came from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch.nn as nn
import torch.utils._pytree as pytree

from coreai_torch.converter import TorchConverter
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.precision import from_spec
from coreai_torch.program import AIProgram
from coreai_torch.runtime import Session
from coreai_torch.verify.bisect import find_divergence
from coreai_torch.verify.compare import (
    VerifyReport,
    compare,
    eager_outputs,
    half_tolerance,
    tolerances,
)


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
    max|expected|)`` (default :data:`~coreai_torch.verify.compare.HALF_TOLERANCE`;
    ``atol``/``rtol`` do not apply), and when they do not match (and ``bisect``) the report
    names the first FX node that overflows or loses more than that, with its source line
    (``report.divergence``).  The program it converts itself skips the range check a
    conversion runs on its example inputs (``TorchConverter(check_range=False)``), which
    would keep the nodes overflowing on ``args`` in float32.
    """
    policy = from_spec(precision) if precision is not None else None
    if program is None:
        ep = export_decomposed(model, args, kwargs)
        # without the range check on the example inputs (they are ``args``): it would keep
        # in float32 the very nodes this is meant to find
        converter = TorchConverter(compute_precision=policy or "fp32", check_range=False)
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
