"""Check converted programs against eager PyTorch on the Core AI runtime.

    from coreai_torch.verify import verify, find_divergence
    report = verify(model, (x,))          # export, convert, run, compare (report.ok)
    found = find_divergence(model, (x,))  # the first FX node whose value diverges

* :mod:`~coreai_torch.verify.compare`: the comparison of outputs and its report;
* :mod:`~coreai_torch.verify.check`: :func:`verify` (convert, run, compare);
* :mod:`~coreai_torch.verify.bisect`: :func:`find_divergence` (bisect the graph).
"""

from coreai_torch.verify.bisect import Divergence, find_divergence
from coreai_torch.verify.check import run_entrypoint, verify
from coreai_torch.verify.compare import (
    HALF_TOLERANCE,
    OutputError,
    VerifyReport,
    compare,
    eager_outputs,
    half_tolerance,
    to_numpy,
    tolerances,
)

__all__ = [
    "HALF_TOLERANCE",
    "Divergence",
    "OutputError",
    "VerifyReport",
    "compare",
    "eager_outputs",
    "find_divergence",
    "half_tolerance",
    "run_entrypoint",
    "to_numpy",
    "tolerances",
    "verify",
]
