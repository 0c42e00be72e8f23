"""Externalization: ExternalizeSpec, composite and simple externalization, IR, state, errors."""

from __future__ import annotations

import copy
import re

import coreai.authoring as ca  # before the dialect import (coreai-core's import order)
import pytest
import torch
import torch.nn as nn
from coreai._compiler.dialects import coreai

import coreai_torch
from coreai_torch import ExternalizationError, ExternalizeSpec, TorchConverter, UnsupportedOpError
from coreai_torch._utils import get_operands
from coreai_torch.composite_ops import SDPA, RMSNorm, RMSNormImpl
from coreai_torch.runtime import Session
from coreai_torch.verify import compare, run_entrypoint, verify
from tests.externalize_support import (
    check_externalized,
    composites,
    convert_externalized,
    graphs,
)

assert ca  # imported for its side effect (import order)

RMS_SPEC = ExternalizeSpec(RMSNormImpl, "rms_norm", ["axes", "eps"])
SDPA_SPEC = ExternalizeSpec(SDPA, "sdpa", ["is_causal", "scale", "enable_gqa"])
HASHED = r"_[0-9a-f]{8}"


@pytest.fixture
def exports(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The class names of the modules torch.export.export is called on, in order."""
    log: list[str] = []
    real_export = torch.export.export

    def counting_export(*args, **kwargs):
        log.append(type(args[0]).__name__)
        return real_export(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counting_export)
    return log


def _export_fn(sample):
    return lambda m: torch.export.export(m, args=sample).run_decompositions(
        coreai_torch.get_decomp_table()
    )


# ------------------------------------------------------------------ composite externalization


class Norms(nn.Module):
    """Three RMSNorms (two configured alike) and attention with and without a mask."""

    def __init__(self) -> None:
        super().__init__()
        self.a = RMSNorm(8)
        self.b = RMSNorm(8)
        self.c = RMSNorm(8, eps=1e-3)
        self.attn = SDPA(scale=0.5)
        self.causal = SDPA(is_causal=True)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        y = self.c(self.b(self.a(x)))
        q = y.view(1, 2, 4, 4)
        return self.attn(q, q, q, attn_mask=mask) + self.causal(q, q, q)


def test_composite_graphs_names_attributes_instances_and_optional() -> None:
    model = Norms().eval()
    with torch.no_grad():
        for norm in (model.a, model.b, model.c):
            norm.weight.uniform_(0.5, 1.5)
    mask = torch.rand(4, 4) > 0.3
    mask[:, 0] = True
    program, report = check_externalized(model, (torch.randn(4, 8), mask), [RMS_SPEC, SDPA_SPEC])
    found = graphs(program)

    rms = composites(program, "rms_norm")
    # a and b are configured alike and share one graph; c (eps=1e-3) gets its own
    assert sorted(g.attrs["eps"] for g in rms) == ["1.000000e-03 : f32", "9.99999974E-6 : f32"]
    shared = next(g for g in rms if g.attrs["eps"] == "9.99999974E-6 : f32")
    assert re.fullmatch(r"a\.norm\.rms_norm" + HASHED, shared.name), shared.name
    other = next(g for g in rms if g is not shared)
    assert re.fullmatch(r"c\.norm\.rms_norm" + HASHED, other.name), other.name
    for g in rms:
        assert g.private and g.no_inline
        assert g.decl_inputs == g.input_names == ["input", "scale"]
        assert g.decl_outputs == g.output_names == ["output"]
        assert g.attrs["axes"] == "-1 : si64" and g.attrs["version"] == "1 : si64"

    sdpa = {g.name.split(".")[0]: g for g in composites(program, "sdpa")}
    assert set(sdpa) == {"attn", "causal"}
    # the optional mask is an input only where it was passed
    assert sdpa["attn"].decl_inputs == ["query", "key", "value", "attn_mask"]
    assert sdpa["causal"].decl_inputs == ["query", "key", "value"]
    assert sdpa["attn"].attrs == {
        "enable_gqa": "false",
        "is_causal": "false",
        "scale": "5.000000e-01 : f32",
        "version": "1 : si64",
    }
    # scale=None is left out; is_causal recorded per instance
    assert "scale" not in sdpa["causal"].attrs and sdpa["causal"].attrs["is_causal"] == "true"

    main = found["main"]
    assert not main.private and main.op is None
    assert main.invokes.count(shared.name) == 2 and main.invokes.count(other.name) == 1
    assert {sdpa["attn"].name, sdpa["causal"].name} <= set(main.invokes)
    # the body of each sdpa composite is the ATen scaled_dot_product_attention composite
    for g in sdpa.values():
        assert [found[c].op for c in g.invokes] == ["scaled_dot_product_attention"]
    # composite graphs come before the graph that calls them
    names = list(found)
    assert all(names.index(c) < names.index("main") for c in main.invokes)
    assert report.max_abs < 1e-5


class ExplicitNone(nn.Module):
    """Calls an optional tensor argument with an explicit ``None`` (keyword and positional)."""

    def __init__(self) -> None:
        super().__init__()
        self.kw = SDPA()
        self.pos = SDPA(is_causal=True)

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return self.kw(q, q, q, attn_mask=None) + self.pos(q, q, q, None)


def test_optional_argument_passed_as_explicit_none_is_left_out() -> None:
    program, report = check_externalized(
        ExplicitNone().eval(), (torch.randn(1, 2, 4, 4),), [SDPA_SPEC]
    )
    for g in composites(program, "sdpa"):
        assert g.decl_inputs == g.input_names == ["query", "key", "value"], g.name
    assert report.max_abs < 1e-5


class Linear2(nn.Module):
    """A module owning weights and a bias-like buffer; forward(x, extra=None)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.register_buffer("shift", torch.linspace(-1, 1, 6))

    def forward(self, x: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        y = self.fc(x) + self.shift
        return y if extra is None else y * extra


class TwoLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = Linear2()
        self.second = Linear2()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x), extra=x)


def test_composite_inputs_from_parameters_buffers_and_signature() -> None:
    model = TwoLinear().eval()
    program, _ = check_externalized(
        model, (torch.randn(3, 6),), [ExternalizeSpec(Linear2, "affine")]
    )
    by_path = {g.name.split(".")[0]: g for g in composites(program, "affine")}
    assert by_path["first"].decl_inputs == ["x", "fc.weight", "fc.bias", "shift"]
    assert by_path["second"].decl_inputs == ["x", "extra", "fc.weight", "fc.bias", "shift"]
    # the weights are operands (constants of @main), not baked into the composite
    assert "dense_resource" not in by_path["first"].text
    assert by_path["first"].attrs == {"version": "1 : si64"}


def test_version_attribute_and_hooks() -> None:
    model = RMSNorm(4).eval()
    model.norm.version = 3
    # hooks of an externalized module run once, around the composite op
    model.norm.register_forward_pre_hook(lambda module, args: (args[0] * 3, *args[1:]))
    model.norm.register_forward_hook(lambda module, args, out: out + 1)
    program, _ = check_externalized(model, (torch.randn(2, 4),), [RMS_SPEC])
    (graph,) = composites(program, "rms_norm")
    assert graph.attrs["version"] == "3 : si64"
    # the hooks are not inside the composite but around its invocation in @main
    assert "3.000000e+00" not in graph.text and "3.000000e+00" in graphs(program)["main"].text


# --------------------------------------------------------------------- simple externalization


class Counter(nn.Module):
    """Owns weights and a buffer it increments on every call."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return self.fc(x) * self.calls


class CounterModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.counter = Counter()
        self.norm = RMSNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.counter(x))


def _run_steps(model: nn.Module, program, steps: list[tuple]) -> float:
    """Run ``program`` once per step (one session: states persist) against eager ``model``."""
    worst = 0.0
    with Session(program) as session:
        for args in steps:
            actual = run_entrypoint(session, program, args)
            with torch.no_grad():
                expected = model(*args)
            expected = expected if isinstance(expected, tuple) else (expected,)
            for name, e, a in zip(["out"] * len(actual), expected, actual, strict=True):
                error = compare(name, e, a)
                assert error.ok, error
                worst = max(worst, error.max_abs)
    return worst


def test_simple_externalization_bakes_weights_and_threads_state() -> None:
    model = CounterModel().eval()
    reference = copy.deepcopy(model)
    program = convert_externalized(model, (torch.randn(2, 8),), [Counter, RMS_SPEC])
    found = graphs(program)
    (counter,) = (g for g in found.values() if g.name.startswith("counter_"))
    assert re.fullmatch("counter" + HASHED, counter.name)
    assert not counter.private and counter.no_inline and counter.op is None  # seed 004
    assert "composite_decl" not in counter.text
    # weights are constants inside the graph; the mutated buffer is an input and an output
    assert "dense_resource<counter.fc.weight>" in counter.text
    assert counter.input_names == ["x", "calls"]
    assert counter.output_names == ["output", "calls_out"]
    assert "coreai.write_handle" in found["main"].text
    program.optimize()
    steps = [(torch.randn(2, 8),) for _ in range(3)]
    assert _run_steps(reference, program, steps) < 1e-4
    assert reference.counter.calls.item() == 3


class CacheWrite(nn.Module):
    """Writes ``new`` into row ``pos`` of the ``cache`` it is given (an argument)."""

    def forward(self, new: torch.Tensor, cache: torch.Tensor, pos: torch.Tensor):
        cache.index_copy_(1, pos.view(1), new.unsqueeze(1))
        return {"total": cache.sum(-1), "none": None}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = RMSNorm(4)
        self.write = CacheWrite()
        self.register_buffer("cache", torch.zeros(2, 3, 4))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.write(self.norm(x), self.cache, pos)
        return out["total"], x * 2


class Top(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.norm = RMSNorm(4)

    def forward(self, x: torch.Tensor, pos: torch.Tensor):
        total, doubled = self.block(x, pos)
        # the same module called twice with different shapes
        return total, self.norm(doubled), self.norm(torch.cat([x, x]))


def test_nested_externalization_argument_mutation_and_repeated_calls() -> None:
    model = Top().eval()
    reference = copy.deepcopy(model)
    sample = (torch.randn(2, 4), torch.tensor(0))
    program = convert_externalized(model, sample, [Block, CacheWrite, RMS_SPEC])
    found = graphs(program)
    block = next(g for g in found.values() if g.name.startswith("block_"))
    write = next(g for g in found.values() if g.name.startswith("block.write_"))
    # the block graph invokes the composite norm and the cache write it contains
    assert [found[c].op for c in block.invokes] == ["rms_norm", None]
    assert block.invokes[1] == write.name
    assert block.input_names == ["x", "pos", "cache"]
    assert block.output_names == ["output_0", "output_1", "cache_out"]
    assert write.input_names == ["new", "cache", "pos"]
    assert write.output_names == ["output_total", "cache_out"]
    # norm is called with (2, 4) and (4, 4) inputs: one graph per shape
    shapes = sorted(re.search(r"tensor<(\dx4)xf32>", g.text)[1] for g in composites(program))
    assert shapes == ["2x4", "4x4"]
    program.optimize()
    steps = [(torch.randn(2, 4), torch.tensor(i)) for i in range(3)]
    assert _run_steps(reference, program, steps) < 1e-4


def test_root_module_simple_externalization() -> None:
    model = Counter().eval()
    program = convert_externalized(model, (torch.randn(2, 8),), [Counter])
    found = graphs(program)
    (graph,) = (g for g in found.values() if g.name != "main")
    assert re.fullmatch("Counter" + HASHED, graph.name)
    assert not graph.private and graph.no_inline
    assert program.function_names == ["main"]
    assert found["main"].invokes == [graph.name]


def test_identical_instances_share_one_export(exports: list[str]) -> None:
    model = nn.Sequential(*[RMSNorm(4) for _ in range(4)]).eval()
    program = convert_externalized(model, (torch.randn(2, 4),), [RMS_SPEC])
    (graph,) = composites(program, "rms_norm")
    assert graphs(program)["main"].invokes == [graph.name] * 4
    assert exports == ["Sequential", "_Callee"]  # the model, then RMSNormImpl once


def test_dynamic_batch_dimension() -> None:
    model = RMSNorm(8).eval()
    batch = torch.export.Dim("batch", min=1, max=16)
    program = convert_externalized(
        model, (torch.randn(3, 8),), [RMS_SPEC], dynamic_shapes=({0: batch},)
    )
    (graph,) = composites(program, "rms_norm")
    assert "tensor<?x8xf32>" in graph.text
    program.optimize()
    with Session(program) as session:
        for n in (1, 5):
            x = torch.randn(n, 8)
            (actual,) = run_entrypoint(session, program, (x,))
            assert compare("out", model(x), actual).ok


def test_strict_export() -> None:
    model = CounterModel().eval()
    program = convert_externalized(model, (torch.randn(2, 8),), [RMS_SPEC], strict=True)
    assert len(composites(program, "rms_norm")) == 1


# ------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (
            lambda: ExternalizeSpec(int),
            TypeError,
            "ExternalizeSpec.target_class must be an nn.Module subclass, got <class 'int'>",
        ),
        (
            lambda: ExternalizeSpec(RMSNormImpl()),
            TypeError,
            "ExternalizeSpec.target_class must be an nn.Module subclass, got an instance of "
            "RMSNormImpl; pass the class RMSNormImpl, not an instance (every instance in the "
            "model is externalized)",
        ),
        (
            lambda: ExternalizeSpec(RMSNormImpl, "rms norm"),
            ValueError,
            "ExternalizeSpec.composite_op_name 'rms norm' must be a non-empty name made of "
            "letters, digits, '_', '.' or ':' (e.g. 'rms_norm')",
        ),
        (
            lambda: ExternalizeSpec(RMSNormImpl, "", None),
            ValueError,
            "ExternalizeSpec.composite_op_name '' must be a non-empty name made of letters, "
            "digits, '_', '.' or ':' (e.g. 'rms_norm')",
        ),
        (
            lambda: ExternalizeSpec(RMSNormImpl, composite_attrs=["eps"]),
            ValueError,
            "ExternalizeSpec.composite_attrs needs composite_op_name: attributes are only "
            "recorded on composite ops",
        ),
        (
            lambda: ExternalizeSpec(RMSNormImpl, "rms_norm", "eps"),
            TypeError,
            "ExternalizeSpec.composite_attrs must be a list of attribute names (non-empty "
            "strings, e.g. ['eps']), got 'eps'",
        ),
        (
            lambda: ExternalizeSpec(RMSNormImpl, "rms_norm", [1]),
            TypeError,
            "ExternalizeSpec.composite_attrs must be a list of attribute names (non-empty "
            "strings, e.g. ['eps']), got [1]",
        ),
        (
            lambda: ExternalizeSpec(RMSNormImpl, "rms_norm", [""]),
            TypeError,
            "ExternalizeSpec.composite_attrs must be a list of attribute names (non-empty "
            "strings, e.g. ['eps']), got ['']",
        ),
        (
            lambda: ExternalizeSpec(RMSNormImpl, "rms_norm", ["eps", "axes", "eps"]),
            ValueError,
            "ExternalizeSpec.composite_attrs lists 'eps' more than once: ['eps', 'axes', "
            "'eps']; list each attribute once",
        ),
    ],
)
def test_invalid_spec(make, error: type, message: str) -> None:
    with pytest.raises(error) as info:
        make()
    assert str(info.value) == message


def _stage(model: nn.Module, sample: tuple, specs) -> TorchConverter:
    return TorchConverter().add_pytorch_module(
        model, export_fn=_export_fn(sample), externalize_modules=specs
    )


@pytest.mark.parametrize(
    ("specs", "error", "message"),
    [
        (RMS_SPEC, TypeError, "must be a list of ExternalizeSpec"),
        ([RMS_SPEC, "rms_norm"], TypeError, "entries must be ExternalizeSpec"),
        (
            [RMS_SPEC, ExternalizeSpec(RMSNormImpl)],
            ValueError,
            r"^externalize_modules lists RMSNormImpl more than once; give one ExternalizeSpec "
            r"per class \(it applies to every instance\)$",
        ),
        (
            [ExternalizeSpec(RMSNormImpl, "rms_norm", ["eps", "epsilon"])],
            ExternalizationError,
            r"names 'epsilon', which is not an attribute of RMSNormImpl at 'norm'.*available: "
            r"axes, eps, version",
        ),
    ],
)
def test_invalid_externalize_modules(specs, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        _stage(RMSNorm(4), (torch.randn(2, 4),), specs)


class ScalarArg(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = torch.ones(3)

    def forward(self, x: torch.Tensor, alpha: float = 1.0, bias: torch.Tensor = None):
        return x * alpha


class UsesScalarArg(nn.Module):
    def __init__(self, alpha: object) -> None:
        super().__init__()
        self.op = ScalarArg()
        self.alpha = alpha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, self.alpha)


def test_forward_arguments_must_be_tensors() -> None:
    with pytest.raises(
        ExternalizationError,
        match=r"forward\(\) argument 'alpha' of ScalarArg at 'op' is a float \(0\.5\) \(called "
        r"at .*test_externalize\.py:\d+: return self\.op\(x, self\.alpha\)\); composite op "
        "forward arguments must be tensors",
    ):
        _stage(UsesScalarArg(0.5), (torch.randn(2),), [ExternalizeSpec(ScalarArg, "scaled")])
    with pytest.raises(
        ExternalizationError, match=r"argument 'alpha' of ScalarArg at 'op' is a list"
    ):
        _stage(
            UsesScalarArg([torch.ones(2)]),
            (torch.randn(2),),
            [ExternalizeSpec(ScalarArg, "scaled")],
        )


class TensorDefault(nn.Module):
    def forward(self, x: torch.Tensor, bias: torch.Tensor = torch.zeros(2)) -> torch.Tensor:  # noqa: B008
        return x + bias


def test_forward_tensor_defaults_are_rejected() -> None:
    with pytest.raises(ExternalizationError, match=r"'bias' of TensorDefault.*tensor default"):
        _stage(TensorDefault(), (torch.randn(2),), [ExternalizeSpec(TensorDefault, "add")])


def test_composite_attribute_types_are_checked() -> None:
    with pytest.raises(ExternalizationError, match=r"composite attribute 'table' .* a Tensor"):
        _stage(UsesScalarArg(0.5), (torch.randn(2),), [ExternalizeSpec(ScalarArg, "s", ["table"])])
    model = UsesScalarArg(0.5)
    model.op.version = "2"
    with pytest.raises(ExternalizationError, match=r"'version' attribute .* must be an int"):
        _stage(model, (torch.randn(2),), [ExternalizeSpec(ScalarArg, "s")])


def test_simple_externalization_accepts_scalar_arguments() -> None:
    model = UsesScalarArg(0.5).eval()
    program, _ = check_externalized(model, (torch.randn(3),), [ScalarArg])
    assert len([g for g in graphs(program).values() if g.name != "main" and not g.private]) == 1


def test_spec_matching_nothing_warns() -> None:
    model = RMSNorm(4).eval()
    with pytest.warns(UserWarning, match="ExternalizeSpec for SDPA matches no module of RMSNorm"):
        program = _stage(model, (torch.randn(2, 4),), [RMS_SPEC, SDPA_SPEC]).to_coreai()
    assert len(composites(program, "rms_norm")) == 1


class Unused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = RMSNormImpl()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def test_matched_but_never_called_warns() -> None:
    with pytest.warns(UserWarning, match=r"none of the externalized modules .* was called"):
        _stage(Unused(), (torch.randn(2),), [RMS_SPEC])


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc(x))


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        self.norm = RMSNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.inner(x)) + x


def test_shared_export_keeps_each_instances_nested_weights(exports: list[str]) -> None:
    model = nn.Sequential(Outer(), Outer()).eval()
    program, _ = check_externalized(model, (torch.randn(2, 8),), [Outer, Inner, RMS_SPEC])
    # Outer, Inner and RMSNormImpl are exported once each for the two identical layers ...
    assert exports == ["Sequential", "_Callee", "_Callee", "_Callee"]
    found = graphs(program)
    # (symbol names start with "_" where the module path starts with a digit)
    outers = [g for g in found.values() if re.fullmatch(r"_\d" + HASHED, g.name)]
    inners = [g for g in found.values() if re.fullmatch(r"_\d\.inner" + HASHED, g.name)]
    # ... but each layer's graphs hold its own weights
    assert len(outers) == len(inners) == 2
    weight = re.compile(r'dense_resource<"(\d)\.inner\.fc\.weight(?:\.T)?">')
    assert {weight.search(g.text)[1] for g in inners} == {"0", "1"}
    assert sorted(found["main"].invokes) == sorted(g.name for g in outers)


def test_entry_points_share_identical_composite_graphs() -> None:
    model = CounterModel().eval()
    converter = TorchConverter()
    for name, rows in (("first", 2), ("second", 2), ("long", 5)):
        sample = (torch.randn(rows, 8),)
        converter.add_pytorch_module(
            model, _export_fn(sample), externalize_modules=[RMS_SPEC], entrypoint_name=name
        )
    program = converter.to_coreai()
    found = graphs(program)
    rms = composites(program, "rms_norm")
    assert len(rms) == 2  # (2, 8) shared by "first" and "second", (5, 8) for "long"
    assert found["first"].invokes == found["second"].invokes
    assert found["first"].invokes != found["long"].invokes
    assert program.function_names == ["first", "second", "long"]
    program.optimize()
    with Session(program) as session:
        for name, rows in (("first", 2), ("long", 5)):
            x = torch.randn(rows, 8)
            (actual,) = run_entrypoint(session, program, (x,), entrypoint=name)
            with torch.no_grad():
                assert compare(name, copy.deepcopy(model)(x), actual).ok


@torch.library.custom_op("externalize_test::double", mutates_args=())
def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@double.register_fake
def _(x):
    return torch.empty_like(x)


class Doubler(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return double(x) + 1


def test_ops_inside_externalized_modules_use_the_converters_lowerings() -> None:
    model = nn.Sequential(Doubler()).eval()
    sample = (torch.randn(3),)
    with pytest.raises(
        UnsupportedOpError,
        match=r"(?s)externalized module Doubler at '0': 1 op\(s\) have no Core AI lowering.*"
        r"externalize_test::double\.default .*test_externalize\.py:\d+ in forward",
    ):
        _stage(model, sample, [ExternalizeSpec(Doubler, "doubler")]).to_coreai()
    converter = _stage(model, sample, [ExternalizeSpec(Doubler, "doubler")])

    @converter.register_torch_lowering("externalize_test::double.default")
    def lower_double(values_map, node, loc):
        (x,) = get_operands(values_map, node, [0], loc)
        return coreai.broadcasting_add(x, x, loc=loc)

    program = converter.to_coreai()
    assert len(composites(program, "doubler")) == 1
    assert verify(model, sample, program=program.optimize()).ok


class EmptySlice(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.nn.functional.pad(x[:0], (1, 2)).sum()  # pads an empty slice


def test_zero_element_values_inside_externalized_modules_are_rejected() -> None:
    from coreai_torch import RuntimeHazardError

    converter = _stage(nn.Sequential(EmptySlice()), (torch.randn(3),), [EmptySlice])
    with pytest.raises(
        RuntimeHazardError, match=r"externalized module EmptySlice at '0': 1 value\(s\) have zero"
    ):
        converter.to_coreai()


class ParameterUpdate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.scale.mul_(2)
        return x * self.scale


def test_parameter_mutation_inside_externalized_modules_is_rejected() -> None:
    with pytest.raises(ExternalizationError, match=r"changes its parameter\(s\) \['scale'\]"):
        _stage(nn.Sequential(ParameterUpdate()), (torch.randn(3),), [ParameterUpdate])


class CountsEverySecondCall(nn.Module):
    """Updates its buffer only on every second call: not one fixed graph."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(1))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls % 2 == 0:
            self.count.add_(1)
        return x + self.count


class CallsTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = CountsEverySecondCall()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(self.inner(x))


def test_mutating_different_tensors_from_call_to_call_is_rejected() -> None:
    with pytest.raises(ExternalizationError) as info:
        _stage(CallsTwice(), (torch.randn(3),), [CountsEverySecondCall])
    assert str(info.value) == (
        "CountsEverySecondCall at 'inner' mutates buffer 'count' in this call but nothing in "
        "an earlier call with the same arguments; an externalized module must update the same "
        "buffers and arguments every time it is called: make the update unconditional (e.g. "
        "with torch.where) or move it out of the module"
    )


class ReturnsSize(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        return x * 2, x.shape[0]


class UsesSize(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = ReturnsSize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, n = self.inner(x)
        return y * n


def test_returning_a_symbolic_size_is_rejected() -> None:
    rows = torch.export.Dim("rows", min=2, max=8)

    def export_fn(m: nn.Module) -> torch.export.ExportedProgram:
        ep = torch.export.export(m, (torch.randn(3, 2),), dynamic_shapes=({0: rows},))
        return ep.run_decompositions(coreai_torch.get_decomp_table())

    with pytest.raises(ExternalizationError) as info:
        TorchConverter().add_pytorch_module(
            UsesSize(), export_fn=export_fn, externalize_modules=[ReturnsSize]
        )
    assert str(info.value) == (
        "ReturnsSize at 'inner' returns a symbolic SymInt (a size known only at run time); "
        "externalized modules must return tensors: compute the size outside the module (e.g. "
        "from the returned tensor's shape)"
    )


def test_a_module_that_cannot_be_exported_on_its_own_is_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each externalized module is exported again on its own; a failure there names it."""
    real_export = torch.export.export

    def export(module: nn.Module, *args, **kwargs):
        if type(module).__name__ == "_Callee":
            raise RuntimeError("cannot trace this")
        return real_export(module, *args, **kwargs)

    monkeypatch.setattr(torch.export, "export", export)
    converter = _stage(nn.Sequential(RMSNorm(4)), (torch.randn(2, 4),), [RMS_SPEC])
    with pytest.raises(ExternalizationError) as info:
        converter.to_coreai()
    assert str(info.value) == (
        "exporting externalized module RMSNormImpl at '0.norm' on its own failed: "
        "RuntimeError: cannot trace this"
    )
    assert isinstance(info.value.__cause__, RuntimeError)
    monkeypatch.setattr(torch.export, "export", real_export)
    assert len(composites(converter.to_coreai(), "rms_norm")) == 1  # the converter recovers


def test_exported_program_outliving_its_converter() -> None:
    """The staged program's externalized calls refer to the converter that staged it."""
    import gc

    converter = _stage(nn.Sequential(RMSNorm(4)), (torch.randn(2, 4),), [RMS_SPEC])
    ep = converter._staged["main"].exported_program
    del converter
    gc.collect()
    for use in (
        lambda: ep.module()(torch.randn(2, 4)),
        lambda: TorchConverter().add_exported_program(ep).to_coreai(),
    ):
        with pytest.raises(coreai_torch.ConversionError) as info:
            use()
        assert re.fullmatch(
            r"externalized module call '\d+' is unknown: programs with externalized submodules "
            r"can only be run or converted while the TorchConverter that staged them "
            r"\(add_pytorch_module\) is alive; keep a reference to that converter, or stage "
            r"the module again with add_pytorch_module\(\.\.\., externalize_modules=\.\.\.\)",
            str(info.value),
        ), str(info.value)
