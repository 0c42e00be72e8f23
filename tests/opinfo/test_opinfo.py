"""PyTorch's OpInfo samples, exported, converted, run on the Core AI runtime, compared.

One test per (OpInfo entry, dtype): float32, one int dtype and bool, where the entry supports
them.  Every sample runs in a worker process (a runtime abort is a failure of that sample,
not of the suite).  Known failures are listed in ``expected_failures.py`` and are strict
xfails.  ``FAST`` runs in ``make test``; the rest of ``op_db`` is marked slow
(``make test-all``, which also writes ``tests/opinfo/results.json``).
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.opinfo import catalog, runner
from tests.opinfo.expected_failures import EXPECTED_FAILURES

#: A representative subset: a few entries of every op family, in the fast suite.
FAST = (
    "add",
    "mul",
    "div.no_rounding_mode",
    "exp",
    "sigmoid",
    "pow",
    "clamp",
    "where",
    "eq",
    "logical_and",
    "nn.functional.gelu",
    "sum",
    "mean",
    "amax",
    "argmax",
    "softmax",
    "cumsum",
    "matmul",
    "nn.functional.linear",
    "nn.functional.conv2d",
    "nn.functional.max_pool2d",
    "nn.functional.avg_pool2d",
    "nn.functional.layer_norm",
    "cat",
    "reshape",
    "permute",
    "transpose",
    "squeeze",
    "expand",
    "select",
    "index_select",
    "gather",
    "nn.functional.embedding",
    "sort",
    "full",
    "nn.functional.pad.constant",
    "to",
    "nn.functional.scaled_dot_product_attention",
)


def expected_failure(op_id: str, dtype: str) -> str | None:
    entry = EXPECTED_FAILURES.get(op_id)
    if isinstance(entry, dict):
        return entry.get(dtype)
    return entry


def cases(ids: list[str]) -> Iterator[Any]:
    ops = catalog.op_db_by_id()
    for op_id in ids:
        for dtype in catalog.sweep_dtypes(ops[op_id]):
            name = catalog.dtype_name(dtype)
            marks = [pytest.mark.xdist_group(op_id)]
            reason = expected_failure(op_id, name)
            if reason:
                marks.append(pytest.mark.xfail(reason=reason, strict=True))
            yield pytest.param(op_id, name, id=f"{op_id}-{name}", marks=marks)


def check(summary: dict[str, Any], op_id: str, dtype: str) -> None:
    if summary["left_out"]:
        pytest.fail(
            f"{op_id}: {summary['left_out']}; add it to catalog.RANDOM_OPS if it is a random op"
        )
    info = summary["dtypes"].get(dtype)
    if summary["errors"] or info is None:
        pytest.fail(f"{op_id} [{dtype}]: the sweep could not run it: {summary['errors']}")
    if info["status"] == "pass":
        return
    lines = [f"{op_id} [{dtype}]: {info['status']}, samples {info['counts']}"]
    for group in info["failures"]:
        lines.append(
            f"  {group['status']} at {group['stage']} x{group['count']}: {group['reason']}\n"
            f"      e.g. sample {group['example']}"
        )
    pytest.fail("\n".join(lines), pytrace=False)


@pytest.mark.parametrize(("op_id", "dtype"), list(cases(list(FAST))))
def test_opinfo_fast(op_id: str, dtype: str, sweep: Any) -> None:
    check(sweep.summary(op_id), op_id, dtype)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("op_id", "dtype"), list(cases([i for i in catalog.sweep_ids() if i not in FAST]))
)
def test_opinfo(op_id: str, dtype: str, sweep: Any) -> None:
    check(sweep.summary(op_id), op_id, dtype)


def test_fast_subset_is_swept() -> None:
    missing = [i for i in FAST if i not in catalog.sweep_ids()]
    assert not missing, f"FAST names entries that are not in the sweep: {missing}"


def test_expected_failures_name_real_entries() -> None:
    ops = catalog.op_db_by_id()
    unknown = [i for i in EXPECTED_FAILURES if i not in ops or catalog.left_out_reason(i)]
    assert not unknown, f"expected_failures.py lists entries the sweep does not run: {unknown}"
    for op_id, entry in EXPECTED_FAILURES.items():
        if isinstance(entry, dict):
            tested = {catalog.dtype_name(d) for d in catalog.sweep_dtypes(ops[op_id])}
            assert set(entry) <= tested, f"{op_id}: dtypes {set(entry) - tested} are not swept"


def _decomposed(op_id: str, a: torch.Tensor) -> list[torch.Tensor]:
    if op_id == "linalg.eigh":
        return list(torch.linalg.eigh(a))
    if op_id == "linalg.svd":
        return list(torch.linalg.svd(a, full_matrices=True))
    return list(torch.svd(a))


@pytest.mark.parametrize("op_id", ["linalg.eigh", "linalg.svd", "svd"])
def test_decompositions_are_compared_up_to_the_signs_of_their_vectors(op_id: str) -> None:
    """LAPACK's eigen/singular vector signs depend on its algorithm and the processor: other
    signs (and another basis beyond the rank) are right, other vectors or values are not."""
    torch.manual_seed(0)
    a = torch.randn(2, 5, 3)
    a = a @ a.mT if op_id == "linalg.eigh" else a
    expected = _decomposed(op_id, a)
    sample = SimpleNamespace(expected=expected)
    flipped = [t.clone() for t in expected]
    vectors = 1 if op_id == "linalg.eigh" else 0
    flipped[vectors][..., 1] *= -1  # an eigenvector, or a pair of singular vectors
    if op_id != "linalg.eigh":
        if op_id == "svd":
            flipped[2][..., 1] *= -1  # V's column
        else:
            flipped[2][..., 1, :] *= -1  # Vh's row
            flipped[0][..., 4] *= -1  # beyond the rank: any orthonormal completion
    assert runner.vectors_agree(op_id, sample, [t.numpy() for t in flipped])
    wrong = [t.clone() for t in expected]
    wrong[vectors][..., 0, 0] += 0.1
    assert not runner.vectors_agree(op_id, sample, [t.numpy() for t in wrong])
    values = [t.clone() for t in expected]
    values[0 if op_id == "linalg.eigh" else 1][..., 0] += 0.1
    assert not runner.vectors_agree(op_id, sample, [t.numpy() for t in values])
    assert not runner.vectors_agree("linalg.qr", sample, [t.numpy() for t in flipped])
