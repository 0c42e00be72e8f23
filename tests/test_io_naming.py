"""IO naming and state (seed 000 "IO naming"): defaults, explicit names, ordering, validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

from coreai_torch import InvalidSignatureError, TorchConverter, get_decomp_table
from coreai_torch.runtime import Session


class Linear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(x)


class KVCache(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("kv_cache", torch.zeros(1, 4))  # state[0]
        self.register_buffer("pos_idx", torch.zeros(1))  # state[1]

    def forward(self, x, y, z):
        self.kv_cache.add_(x)  # buffer mutation
        self.pos_idx.add_(1)  # buffer mutation
        y.mul_(2)  # state[2]: mutated user input
        # non-mutated: x -> input[0], z -> input[1]
        return self.kv_cache + y, z * 3


class TwoOut(nn.Module):
    def forward(self, x, z):
        a, b = x + 1, z * 2
        return a + b, a * b


def _kv_ep():
    ep = torch.export.export(
        KVCache().eval(),
        args=(torch.randn(1, 4), torch.randn(1, 4), torch.randn(1, 4)),
    )
    return ep.run_decompositions(get_decomp_table())


def _desc(program, entrypoint="main"):
    with Session(program) as s:
        d = s.descriptor(entrypoint)
        return list(d.input_names), list(d.output_names), list(d.state_names)


def test_seed_stateless_linear_runs_with_its_names() -> None:
    model = Linear().eval()
    ep = torch.export.export(model, args=(torch.randn(1, 8),))
    ep = ep.run_decompositions(get_decomp_table())
    program = (
        TorchConverter()
        .add_exported_program(
            ep,
            input_names=["features"],
            output_names=["logits"],
        )
        .to_coreai()
        .optimize()
    )
    assert _desc(program) == (["features"], ["logits"], [])
    x = torch.randn(1, 8)
    with Session(program) as s:
        out = s.run({"features": x})
    with torch.no_grad():
        np.testing.assert_allclose(out["logits"], model(x).numpy(), atol=1e-4)


def test_default_names_follow_the_fx_graph() -> None:
    program = TorchConverter().add_exported_program(_kv_ep()).to_coreai()
    inputs, outputs, states = _desc(program)
    assert inputs == ["x", "z"]
    assert outputs == ["add_2", "mul_1"]
    assert states == ["b_kv_cache", "b_pos_idx", "y"]


def test_default_output_names_are_the_returned_node_names() -> None:
    ep = torch.export.export(TwoOut(), (torch.randn(2), torch.randn(2)))
    program = TorchConverter().add_exported_program(ep.run_decompositions(get_decomp_table()))
    inputs, outputs, states = _desc(program.to_coreai())
    assert (inputs, outputs, states) == (["x", "z"], ["add_1", "mul_1"], [])


def test_seed_stateful_kv_cache_runs_three_times_like_pytorch() -> None:
    program = (
        TorchConverter()
        .add_exported_program(
            _kv_ep(),
            state_names=["kv_cache", "pos_idx", "y_state"],
            input_names=["query", "context"],
            output_names=["attn_out", "scaled"],
        )
        .to_coreai()
        .optimize()
    )
    model = KVCache().eval()
    x, y, z = torch.randn(1, 4), torch.randn(1, 4), torch.randn(1, 4)
    y_torch = y.clone()
    state = {"kv_cache": torch.zeros(1, 4), "pos_idx": torch.zeros(1), "y_state": y.clone()}
    with Session(program) as s:
        d = s.descriptor()
        assert list(d.input_names) == ["query", "context"]
        assert list(d.output_names) == ["attn_out", "scaled"]
        assert list(d.state_names) == ["kv_cache", "pos_idx", "y_state"]
        for step in range(3):
            out = s.run({"query": x, "context": z}, state=state if step == 0 else None)
            attn, scaled = model(x, y_torch, z)
            np.testing.assert_allclose(out["attn_out"], attn.numpy(), atol=1e-4)
            np.testing.assert_allclose(out["scaled"], scaled.numpy(), atol=1e-4)
            current = s.state_values()
            np.testing.assert_allclose(current["kv_cache"], model.kv_cache.numpy(), atol=1e-4)
            np.testing.assert_allclose(current["pos_idx"], model.pos_idx.numpy(), atol=1e-6)
            np.testing.assert_allclose(current["y_state"], y_torch.numpy(), atol=1e-4)
    assert model.pos_idx.item() == 3


def test_state_ir_uses_handles_and_tokens() -> None:
    program = TorchConverter().add_exported_program(_kv_ep(), state_names=["a", "b", "c"])
    text = str(program.to_coreai())
    assert '!coreai.handle<tensor<1x4xf32>> {coreai.name = "a"}' in text
    assert '!coreai.handle<tensor<1xf32>> {coreai.name = "b"}' in text
    assert text.count("coreai.write_handle") == 3
    assert text.count("!coreai.token {coreai.name") == 3


def test_input_returned_unchanged_and_same_tensor_twice() -> None:
    class Echo(nn.Module):
        def forward(self, x):
            y = x * 2
            return x, y, y

    ep = torch.export.export(Echo(), (torch.randn(3),)).run_decompositions(get_decomp_table())
    program = TorchConverter().add_exported_program(ep).to_coreai()
    x = torch.randn(3)
    with Session(program) as s:
        assert list(s.descriptor().output_names) == ["x_1", "mul", "mul_1"]
        out = s.run({"x": x})
    np.testing.assert_allclose(out["x_1"], x.numpy())
    np.testing.assert_allclose(out["mul"], (x * 2).numpy())
    np.testing.assert_allclose(out["mul_1"], (x * 2).numpy())


def test_input_returned_twice() -> None:
    """``return x, x``: two outputs that are the same graph input get distinct default names
    and both hold the input."""

    class Twice(nn.Module):
        def forward(self, x):
            return x, x

    ep = torch.export.export(Twice(), (torch.randn(3),)).run_decompositions(get_decomp_table())
    program = TorchConverter().add_exported_program(ep).to_coreai()
    assert [o.name for o in program.signatures["main"].outputs] == ["x_1", "x_2"]
    x = torch.randn(3)
    with Session(program) as s:
        assert list(s.descriptor().output_names) == ["x_1", "x_2"]
        out = s.run({"x": x})
    np.testing.assert_array_equal(out["x_1"], x.numpy())
    np.testing.assert_array_equal(out["x_2"], x.numpy())
    named = TorchConverter().add_exported_program(ep, output_names=["a", "b"]).to_coreai()
    with Session(named) as s:
        out = s.run({"x": x})
    assert sorted(out) == ["a", "b"]
    np.testing.assert_array_equal(out["a"], out["b"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"input_names": ["a"]}, r"input_names has 1 name\(s\) but the program has 2"),
        ({"input_names": ["a", "b", "c"]}, r"input_names has 3 name\(s\)"),
        ({"output_names": ["o"]}, r"output_names has 1 name\(s\) but the program has 2"),
        ({"state_names": ["s1", "s2"]}, r"state_names has 2 name\(s\) but the program has 3"),
        ({"input_names": ["a", "a"]}, "input_names contains 'a' more than once"),
        (
            {"state_names": ["k", "k", "y"]},
            r"^state_names contains 'k' more than once: \['k', 'k', 'y'\]; every input, output "
            r"and state needs its own name$",
        ),
        (
            {"output_names": ["o", "o"]},
            r"^output_names contains 'o' more than once: \['o', 'o'\]; every input",
        ),
        ({"input_names": ["a", ""]}, "input_names contains an empty name"),
        ({"input_names": ["a", 3]}, "input_names must contain only strings"),
        ({"input_names": "ab"}, "input_names must be a sequence of strings"),
        (
            {"input_names": ["q", "c"], "output_names": ["q", "o"]},
            "name 'q' is used in both input_names and output_names",
        ),
        (
            {"state_names": ["k", "p", "y"], "input_names": ["k", "c"]},
            "name 'k' is used in both state_names and input_names",
        ),
        ({"output_names": ["x", "o"]}, "default name 'x' of one of the input_names collides"),
    ],
)
def test_name_validation_errors(kwargs, message) -> None:
    converter = TorchConverter()
    with pytest.raises(InvalidSignatureError, match=message):
        converter.add_exported_program(_kv_ep(), **kwargs)
    assert converter.entrypoints == []  # nothing half-staged
    converter.add_exported_program(_kv_ep())  # and it stays usable
    assert converter.entrypoints == ["main"]


def test_int64_token_ids_keep_their_dtype_at_the_boundary() -> None:
    class Tok(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(30, 4)

        def forward(self, ids):
            return self.emb(ids), ids + 1

    ids = torch.randint(0, 30, (2, 5))
    model = Tok().eval()
    ep = torch.export.export(model, (ids,)).run_decompositions(get_decomp_table())
    program = (
        TorchConverter()
        .add_exported_program(ep, input_names=["ids"], output_names=["emb", "next_ids"])
        .to_coreai()
    )
    assert 'tensor<2x5xsi64> {coreai.name = "ids"}' in str(program)
    with Session(program) as s:
        d = s.descriptor()
        assert d.input_descriptor("ids").dtype == "int64"
        assert d.output_descriptor("next_ids").dtype == "int64"
        out = s.run({"ids": ids})
    assert out["next_ids"].dtype == np.int64
    np.testing.assert_array_equal(out["next_ids"], (ids + 1).numpy())
    np.testing.assert_allclose(out["emb"], model.emb(ids).detach().numpy(), atol=1e-6)
