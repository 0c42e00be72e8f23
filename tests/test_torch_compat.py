"""The torch-version module: the tested range agrees with the package metadata, an untested
torch is named, and the version differences it handles are handled on the installed torch.

Runs in ``make test`` (torch 2.13.0) and in every ``make test-compat`` run (other torch)."""

from __future__ import annotations

import importlib.metadata
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from packaging.requirements import Requirement
from packaging.version import Version

from coreai_torch import get_decomp_table, torch_compat
from tests.helpers import check_module


def test_tested_range_is_the_dependency_range_of_the_package() -> None:
    (torch_req,) = [
        Requirement(r)
        for r in importlib.metadata.requires("coreai-torch-converter") or []
        if Requirement(r).name == "torch" and Requirement(r).marker is None
    ]
    (oldest, oldest_minor), (newest, newest_minor) = torch_compat.TESTED_TORCH
    admitted = {
        f"{major}.{minor}.{patch}"
        for major in (oldest, newest)
        for minor in range(oldest_minor - 1, newest_minor + 2)
        for patch in (0, 1)
        if Version(f"{major}.{minor}.{patch}") in torch_req.specifier
    }
    expected = {
        f"{oldest}.{minor}.{patch}"
        for minor in range(oldest_minor, newest_minor + 1)
        for patch in (0, 1)
    }
    assert admitted == expected, f"{torch_req} vs TESTED_TORCH {torch_compat.TESTED_TORCH}"


def test_the_installed_torch_is_in_the_tested_range() -> None:
    assert torch_compat.untested_torch_message() is None, torch.__version__


@pytest.mark.parametrize(
    ("version", "parsed", "tested"),
    [
        ("2.12.1", (2, 12), True),
        ("2.13.0+cpu", (2, 13), True),
        ("2.14.1+cu130", (2, 14), True),
        ("2.11.0", (2, 11), False),
        ("2.15.0.dev20260101+cpu", (2, 15), False),
        ("3.0.0", (3, 0), False),
    ],
)
def test_versions_outside_the_range_are_named(
    version: str, parsed: tuple[int, int], tested: bool
) -> None:
    assert torch_compat.torch_version(version) == parsed
    message = torch_compat.untested_torch_message(version)
    if tested:
        assert message is None
    else:
        assert f"torch {version} is installed" in message
        assert "tested with torch 2.12 to 2.14" in message


def test_an_untested_torch_warns_once_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "__version__", "2.15.0")
    with pytest.warns(UserWarning, match=r"tested with torch 2\.12 to 2\.14; torch 2\.15\.0"):
        torch_compat.warn_if_untested_torch()
    with pytest.raises(ValueError, match="not a torch version: 'nightly'"):
        torch_compat.torch_version("nightly")


class Normalize(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.normalize(x, dim=-1), torch.linalg.vector_norm(x, ord=3, dim=(0, 2))


def test_linalg_vector_norm_stays_one_op_on_every_torch() -> None:
    """torch 2.14 added linalg_vector_norm to the default decompositions; it stays native."""
    table = get_decomp_table()
    for op in torch_compat.NATIVE_OPS_DECOMPOSED_BY_NEWER_TORCH:
        assert op not in table
    x = torch.randn(2, 3, 5)
    ep = torch_compat.run_decompositions(torch.export.export(Normalize(), (x,)), table)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.aten.linalg_vector_norm.default) == 2, targets
    check_module(Normalize(), (x,))


class Combinations(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.combinations(x, r=2)


def test_exports_combinations_says_whether_torch_exports_them() -> None:
    """torch 2.14 computes combinations with nonzero_static (converted like any program);
    2.12 and 2.13 with masked_select, which torch.export cannot export (the OpInfo sweep's
    expected failure holds there only)."""
    x = torch.arange(4.0)
    if torch_compat.EXPORTS_COMBINATIONS:
        check_module(Combinations(), (x,))
    else:
        with pytest.raises(RuntimeError):  # a data-dependent output size
            torch.export.export(Combinations(), (x,))


class NestedOutputs(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {"pair": (x.sin(), x.cos())}


def test_run_decompositions_hides_only_torch_internal_warnings() -> None:
    ep = torch.export.export(NestedOutputs(), (torch.randn(3),))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch_compat.run_decompositions(ep, get_decomp_table())
        warnings.warn("a warning of the user's own", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["a warning of the user's own"]


class TwoLayerLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(8, 16, num_layers=2, batch_first=True)

    def forward(
        self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        out, (h_n, c_n) = self.rnn(x, (h, c))
        return out, h_n, c_n


@pytest.mark.parametrize("batch", [1, 3])
def test_exported_lstm_states_have_their_eager_shapes(batch: int) -> None:
    """torch 2.12 traced h_n/c_n of a batch > 1 with an extra dimension (fix backported)."""
    model = TwoLayerLSTM().eval()
    args = (torch.randn(batch, 5, 8), torch.randn(2, batch, 16), torch.randn(2, batch, 16))
    ep = torch.export.export(model, args)
    traced = [tuple(n.meta["val"].shape) for n in ep.graph.output_node().args[0]]
    assert traced == [tuple(t.shape) for t in model(*args)]


class HalfState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(4, 8, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.total.add_(x)
        return self.total.t() * 2  # a transposed (non-contiguous) result as well


@pytest.mark.parametrize("dlpack_error", [None, BufferError], ids=["installed", "numpy-2.5"])
def test_bfloat16_outputs_and_states_read_back_with_every_numpy(
    monkeypatch: pytest.MonkeyPatch, dlpack_error: type[Exception] | None
) -> None:
    """numpy 2.5's ``from_dlpack`` raises ``BufferError`` for bfloat16, which coreai-core's
    fallback does not catch; ``Session`` reads such outputs and states all the same."""
    import numpy as np

    from coreai_torch import TorchConverter
    from coreai_torch.frontend.export import export_decomposed
    from coreai_torch.runtime import Session

    if dlpack_error is not None:
        original = np.from_dlpack

        def from_dlpack(x: object, *args: object, **kwargs: object) -> np.ndarray:
            try:
                result = original(x, *args, **kwargs)
            except RuntimeError as error:  # numpy < 2.5
                raise dlpack_error("Unsupported dtype in DLTensor.") from error
            if "bfloat16" in str(result.dtype):
                raise dlpack_error("Unsupported dtype in DLTensor.")
            return result

        monkeypatch.setattr(np, "from_dlpack", from_dlpack)
    x = torch.randn(4, 8).to(torch.bfloat16)
    model = HalfState()
    program = TorchConverter().add_exported_program(export_decomposed(model, (x,))).to_coreai()
    start = torch.ones(4, 8, dtype=torch.bfloat16)
    with Session(program) as session:
        (out,) = session.run({"x": x}, state={"b_total": start}).values()
        (state,) = session.state_values().values()
    total = (start + x).float()
    np.testing.assert_array_equal(np.asarray(out, dtype=np.float32), (total * 2).t().numpy())
    np.testing.assert_array_equal(np.asarray(state, dtype=np.float32), total.numpy())
