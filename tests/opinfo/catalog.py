"""Which OpInfo entries the sweep runs, with which dtypes and which of their samples.

Everything here is deterministic: the same torch version gives the same entries, dtypes and
sample indices in every process, so a sample is identified by ``(opinfo id, dtype, index)``.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

#: float32 samples tested per OpInfo entry (evenly spread over its sample list).
FLOAT_CAP = 16
#: samples tested per OpInfo entry for the int and bool dtypes.
OTHER_CAP = 8

#: ops whose results are random numbers (left out of the sweep and of the coverage claim).
RANDOM_OPS = frozenset(
    {
        "bernoulli",
        "cauchy",
        "exponential",
        "geometric",
        "log_normal",
        "multinomial",
        "normal",
        "normal.in_place",
        "normal.number_mean",
        "uniform",
        "rand_like",
        "randint",
        "randint_like",
        "randn",
        "randn_like",
        "nn.functional.rrelu",
        "nn.functional.fractional_max_pool2d",
        "nn.functional.fractional_max_pool3d",
        "svd_lowrank",
        "pca_lowrank",
    }
)

#: ops that return uninitialised memory: only shape and dtype are compared.
UNINITIALIZED_OPS = frozenset(
    {"empty", "empty_like", "empty_permuted", "empty_strided", "new_empty", "new_empty_strided"}
)

#: the int dtype tried for each entry, in order of preference.
INT_DTYPES = (torch.int64, torch.int32)


def opinfo_id(op: Any) -> str:
    """``name`` or ``name.variant``: unique within ``op_db``."""
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


@functools.cache
def op_db_by_id() -> dict[str, Any]:
    from torch.testing._internal.common_methods_invocations import op_db

    return {opinfo_id(op): op for op in op_db}


def left_out_reason(op_id: str) -> str | None:
    """Why an entry is not part of the sweep at all (backward, random, dropout), or None."""
    if "backward" in op_id:
        return "backward op"
    if "dropout" in op_id:
        return "dropout"
    if op_id in RANDOM_OPS:
        return "random numbers"
    return None


def sweep_dtypes(op: Any) -> list[torch.dtype]:
    """float32, one int dtype and bool — those the entry supports on CPU."""
    supported = op.supported_dtypes("cpu")
    dtypes = [torch.float32] if torch.float32 in supported else []
    dtypes += [d for d in INT_DTYPES if d in supported][:1]
    if torch.bool in supported:
        dtypes.append(torch.bool)
    return dtypes


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    return getattr(torch, name)


def cap_for(dtype: torch.dtype) -> int:
    return FLOAT_CAP if dtype == torch.float32 else OTHER_CAP


def spread(count: int, cap: int) -> list[int]:
    """``cap`` indices evenly spread over ``range(count)`` (all of them if ``count <= cap``)."""
    if count <= cap:
        return list(range(count))
    return sorted({round(i * (count - 1) / (cap - 1)) for i in range(cap)})


def seed(value: int = 0) -> None:
    torch.manual_seed(value)
    random.seed(value)
    np.random.seed(value)


def all_samples(op: Any, dtype: torch.dtype) -> list[Any]:
    """Every sample input of ``op`` for ``dtype``, generated deterministically."""
    seed(0)
    return list(op.sample_inputs("cpu", dtype, requires_grad=False))


def describe_value(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        shape = "x".join(str(d) for d in value.shape) or "scalar"
        return f"{dtype_name(value.dtype)}[{shape}]"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(describe_value(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}={describe_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


def describe_sample(sample: Any, limit: int = 160) -> str:
    """A short, readable description of a SampleInput (shapes, dtypes, other arguments)."""
    parts = [describe_value(sample.input)]
    parts += [describe_value(a) for a in sample.args]
    parts += [f"{k}={describe_value(v)}" for k, v in sample.kwargs.items()]
    text = ", ".join(parts)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def sweep_ids(names: Sequence[str] | None = None) -> list[str]:
    """Ids of the entries the sweep runs (every entry that is not left out)."""
    ids = list(op_db_by_id()) if names is None else list(names)
    return [i for i in ids if left_out_reason(i) is None]
