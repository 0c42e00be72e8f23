"""Test helpers: convert a module, run it on the Core AI runtime, compare with PyTorch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch.nn as nn

from coreai_torch import TorchConverter
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.program import AIProgram
from coreai_torch.verify import VerifyReport, verify


def convert(
    model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None, **names: Any
) -> AIProgram:
    """Export (decomposed) and convert ``model``; ``names`` go to add_exported_program."""
    ep = export_decomposed(model, args, kwargs)
    return TorchConverter().add_exported_program(ep, **names).to_coreai()


def check_module(
    model: nn.Module,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None = None,
    *,
    atol: float = 1e-4,
    rtol: float = 1e-4,
    optimize: bool = True,
) -> VerifyReport:
    """Convert ``model``, run it on the runtime and assert it matches eager PyTorch."""
    program = convert(model, args, kwargs)
    if optimize:
        program.optimize()
    report = verify(model, args, kwargs, program=program, atol=atol, rtol=rtol)
    assert report.ok, f"converted program does not match PyTorch:\n{report}\n\n{program}"
    return report


def asset_bytes(program: AIProgram) -> int:
    """Bytes of the asset ``program.save_asset`` writes (saved to a temporary directory)."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.aimodel"
        program.save_asset(path)
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def check_runs(
    model: nn.Module,
    program: AIProgram,
    runs: Sequence[Sequence[Any]],
    *,
    atol: float = 1e-4,
    rtol: float = 1e-4,
) -> list[VerifyReport]:
    """Call one converted program with several argument tuples (one runtime session) and
    assert that every call matches eager PyTorch."""
    from coreai_torch.runtime import Session
    from coreai_torch.verify import compare, eager_outputs, run_entrypoint

    names = [o.name for o in program.signatures["main"].outputs]
    reports = []
    with Session(program) as session:
        for args in runs:
            expected = eager_outputs(model, args)
            actual = run_entrypoint(session, program, args)
            report = VerifyReport(
                [
                    compare(n, e, a, atol=atol, rtol=rtol)
                    for n, e, a in zip(names, expected, actual, strict=True)
                ]
            )
            shapes = [tuple(a.shape) for a in args if hasattr(a, "shape")]
            assert report.ok, f"mismatch for inputs of shapes {shapes}:\n{report}\n\n{program}"
            reports.append(report)
    return reports


def run_program(program: AIProgram, feeds: Mapping[str, Any], entrypoint: str = "main") -> Any:
    """Run a one-output program on the runtime; returns that output (a numpy array)."""
    from coreai_torch.runtime import Session

    with Session(program) as session:
        out = session.run(dict(feeds), entrypoint=entrypoint)
    (value,) = out.values()
    return value


def check_half(
    model: nn.Module,
    args: Sequence[Any],
    program: AIProgram,
    *,
    rel: float,
    cosine: float = 0.999,
) -> tuple[float, float]:
    """Assert a (half-precision) ``program`` matches ``model`` in float32 eager: every
    floating output within ``rel * max(1, max|ref|)`` and with cosine similarity ``>= cosine``.
    Returns the largest relative error and the smallest cosine similarity."""
    import numpy as np
    import torch

    from coreai_torch.runtime import Session
    from coreai_torch.verify import eager_outputs, run_entrypoint

    expected = eager_outputs(model, args)
    with Session(program) as session:
        actual = run_entrypoint(session, program, args)
    worst_rel, worst_cos = 0.0, 1.0
    for e, a in zip(expected, actual, strict=True):
        if not (isinstance(e, torch.Tensor) and e.is_floating_point()):
            continue
        ref = e.detach().double().numpy()
        out = np.asarray(a, dtype=np.float64)
        assert np.isfinite(out).all(), f"non-finite outputs: {out}"
        err = float(np.abs(out - ref).max() / max(1.0, float(np.abs(ref).max())))
        cos = float((out * ref).sum() / (np.linalg.norm(out) * np.linalg.norm(ref) or 1.0))
        worst_rel, worst_cos = max(worst_rel, err), min(worst_cos, cos)
    assert worst_rel <= rel, f"relative error {worst_rel:.3e} > {rel:.1e}"
    assert worst_cos >= cosine, f"cosine similarity {worst_cos:.6f} < {cosine}"
    return worst_rel, worst_cos


def advised_calls(message: str) -> list[str]:
    """The ``coreai_torch.a.b(...)`` calls a message advises, as written (parentheses
    balanced)."""
    import re

    calls = []
    for match in re.finditer(r"(?<![\w.])coreai_torch(?:\.\w+)+\(", message):
        depth = 0
        for end in range(match.end() - 1, len(message)):
            depth += {"(": 1, ")": -1}.get(message[end], 0)
            if depth == 0:
                calls.append(message[match.start() : end + 1])
                break
    return calls


def run_advice(message: str, **names: Any) -> list[Any]:
    """Run every call ``message`` advises as a user would paste it after ``import
    coreai_torch``, with ``names`` (e.g. ``model``, ``args``) bound; returns their results."""
    import coreai_torch

    calls = advised_calls(message)
    assert calls, f"no coreai_torch call advised in: {message}"
    return [eval(call, {"coreai_torch": coreai_torch, **names}) for call in calls]
