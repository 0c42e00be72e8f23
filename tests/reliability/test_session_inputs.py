"""Catalogue: bad inputs to a converted program are rejected by ``coreai_torch.runtime.Session``
before the Core AI runtime sees them (it aborts on some).  Runs in a child process that must
survive."""

from __future__ import annotations

from typing import Any

import pytest

from tests.reliability.support import run_isolated

CHILD = """
import json, warnings
warnings.simplefilter("ignore")
import numpy as np, torch, torch.nn as nn
from coreai_torch import TorchConverter
from coreai_torch.runtime import Session
from coreai_torch.frontend.export import export_decomposed

class Cache(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("kv", torch.zeros(2, 3))
    def forward(self, x, ids):
        self.kv.add_(x)
        return self.kv * 2, ids + 1

ep = export_decomposed(Cache(), (torch.randn(2, 3), torch.tensor([1, 2])))
program = TorchConverter().add_exported_program(ep).to_coreai()
x, ids, kv = np.ones((2, 3), np.float32), np.array([1, 2]), np.zeros((2, 3), np.float32)
cases = {
    "wrong_dtype": lambda s: s.run({"x": x.astype(np.float64), "ids": ids}, state={"b_kv": kv}),
    "wrong_shape": lambda s: s.run(
        {"x": np.ones((3, 2), np.float32), "ids": ids}, state={"b_kv": kv}
    ),
    "wrong_rank": lambda s: s.run({"x": np.ones(6, np.float32), "ids": ids}, state={"b_kv": kv}),
    "int32_ids": lambda s: s.run({"x": x, "ids": ids.astype(np.int32)}, state={"b_kv": kv}),
    "missing": lambda s: s.run({"x": x}, state={"b_kv": kv}),
    "unknown": lambda s: s.run({"x": x, "ids": ids, "y": x}, state={"b_kv": kv}),
    "bad_state_shape": lambda s: s.run(
        {"x": x, "ids": ids}, state={"b_kv": np.zeros(3, np.float32)}
    ),
    "unknown_entrypoint": lambda s: s.run({"x": x, "ids": ids}, entrypoint="decode"),
}
out = {}
with Session(program) as fresh:  # states are kept between calls: a fresh session has none
    try:
        fresh.run({"x": x, "ids": ids})
        out["no_state"] = None
    except Exception as e:
        out["no_state"] = [type(e).__name__, str(e)]
with Session(program) as s:
    for name, call in cases.items():
        try:
            call(s)
            out[name] = None
        except Exception as e:
            out[name] = [type(e).__name__, str(e)]
    good = s.run({"x": x, "ids": ids}, state={"b_kv": kv})
    out["still_usable"] = sorted((k, v.tolist()) for k, v in good.items())
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def child() -> dict[str, Any]:
    return run_isolated(CHILD)


@pytest.mark.parametrize(
    ("case", "kind", "fragments"),
    [
        ("wrong_dtype", "ValueError", ["input 'x' of 'main' must be float32, got float64"]),
        ("wrong_shape", "ValueError", ["input 'x' of 'main' must have shape (2, 3), got (3, 2)"]),
        ("wrong_rank", "ValueError", ["must have shape (2, 3), got (6,)"]),
        ("int32_ids", "ValueError", ["input 'ids' of 'main' must be int64, got int32"]),
        ("missing", "ValueError", ["'main' takes inputs ['x', 'ids']; missing ['ids']"]),
        ("unknown", "ValueError", ["missing [], unknown ['y']"]),
        ("no_state", "ValueError", ["has states ['b_kv']; pass them with state={...}"]),
        ("bad_state_shape", "ValueError", ["state 'b_kv' of 'main' must have shape (2, 3)"]),
        (
            "unknown_entrypoint",
            "KeyError",
            ["the program has no entry point 'decode'; its entry points are ['main']"],
        ),
    ],
)
def test_bad_feeds_are_clear_errors(
    child: dict[str, Any], case: str, kind: str, fragments: list[str]
) -> None:
    assert child[case] is not None, f"{case} was accepted"
    got_kind, message = child[case]
    assert got_kind == kind, message
    for fragment in fragments:
        assert fragment in message, message


def test_session_stays_usable_after_bad_feeds(child: dict[str, Any]) -> None:
    assert [v for _, v in child["still_usable"]] == [[2, 3], [[2.0] * 3] * 2]
