"""LLM decoding with state: prefill + 3 decode steps of a Llama-style decoder with a static KV
cache in buffers, as two entry points of one program that share weights and states; a prefill
entry point with a dynamic number of tokens."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from coreai_torch import ExternalizeSpec, TorchConverter
from coreai_torch.composite_ops import default_specs
from coreai_torch.examples.llama import LlamaConfig, LlamaKV, init_weights
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.program import AIProgram
from coreai_torch.runtime import Session
from tests.externalize_support import graphs
from tests.models.common import model_tolerance, record_errors

PREFILL = 8


def _model() -> LlamaKV:
    torch.manual_seed(0)
    model = LlamaKV(LlamaConfig()).eval()
    init_weights(model, gain=1.5)
    return model


def _stage(model: LlamaKV, externalize: list | None) -> TorchConverter:
    """A converter with the prefill and decode entry points staged."""
    prefill_args = model.example_inputs(PREFILL)
    decode_args = model.example_inputs(1, start=PREFILL)
    converter = TorchConverter()
    if externalize:
        sample = {"prefill": prefill_args, "decode": decode_args}
        for name in ("prefill", "decode"):
            converter.add_pytorch_module(
                model,
                export_fn=lambda m, a=sample[name]: export_decomposed(m, a),
                externalize_modules=externalize,
                entrypoint_name=name,
            )
    else:
        converter.add_exported_program(
            export_decomposed(model, prefill_args), entrypoint_name="prefill"
        )
        converter.add_exported_program(
            export_decomposed(model, decode_args), entrypoint_name="decode"
        )
    model.reset_cache()  # exporting does not run the model, but be explicit
    return converter


def _check_logits(actual: np.ndarray, expected: torch.Tensor) -> None:
    """The model tolerance rule ``1e-4 * max(1, max|ref|)``, errors recorded like the other
    model tests."""
    tol = model_tolerance([expected])
    err = float(np.abs(actual - expected.numpy()).max())
    record_errors(float(expected.abs().max()), err, tol)
    assert err <= tol, f"max|err| {err:.3e} > tolerance {tol:.3e}"


def _fresh_states(program: AIProgram) -> dict:
    """The states' initial values, as the runtime takes them (one copy per prompt)."""
    from coreai.runtime import NDArray

    initial = program.signatures["prefill"].initial_states
    return {name: NDArray(value.clone().numpy()) for name, value in initial.items()}


def _prefill_then_decode(
    session: Session,
    states: dict,
    reference: LlamaKV,
    ids: torch.Tensor,
    positions: torch.Tensor,
    steps: int = 3,
) -> None:
    """Prefill ``ids`` at ``positions``, then ``steps`` greedy decode steps; every step's
    logits match ``reference`` (its own cache), and so do the caches at the end."""
    out = session.run(
        {"token_ids": ids, "positions": positions}, entrypoint="prefill", state=states
    )
    with torch.no_grad():
        expected = reference(ids, positions)
    assert expected.abs().max() > 1.0
    _check_logits(next(iter(out.values())), expected)
    token = expected[:, -1:].argmax(-1)
    for step in range(steps):
        pos = positions[-1:] + 1 + step
        out = session.run({"token_ids": token, "positions": pos}, entrypoint="decode", state=states)
        with torch.no_grad():
            expected = reference(token, pos)
        _check_logits(next(iter(out.values())), expected)
        token = expected[:, -1:].argmax(-1)
    # the runtime's caches hold exactly what PyTorch's buffers hold
    for name, value in session.state_values("decode" if steps else "prefill").items():
        layer, kind = re.match(r"b_layers_(\d+)_attn_(k|v)_cache", name).groups()
        buf = getattr(reference.layers[int(layer)].attn, f"{kind}_cache")
        np.testing.assert_allclose(value, buf.numpy(), atol=model_tolerance([buf]), rtol=0)


@pytest.mark.parametrize("externalize", [None, "composites"], ids=["inline", "composites"])
def test_prefill_then_three_decode_steps_match_pytorch(externalize) -> None:
    model = _model()
    specs: list[ExternalizeSpec] | None = None
    if externalize:  # the decoder uses every composite module but the MoE one
        specs = [s for s in default_specs() if s.composite_op_name != "gather_matmul"]
    program = _stage(model, specs).to_coreai().optimize()
    if externalize:
        text = str(program)
        assert "composite_decl" in text and "coreai.invoke" in text

    states = _fresh_states(program)
    with Session(program) as session:
        assert list(session.descriptor("prefill").state_names) == list(states)
        assert list(session.descriptor("decode").state_names) == list(states)
        # same weights as the converted model, its own cache
        _prefill_then_decode(session, states, _model(), *model.example_inputs(PREFILL))


def test_prefill_with_a_dynamic_number_of_tokens() -> None:
    """One prefill entry point for every prompt length (``torch.export.Dim`` on the tokens
    and their cache positions) next to the decode entry point; prompts of 8, 1, 17 and 29
    tokens, each from fresh caches, then two decode steps; a prompt prefilled in two chunks
    (12 tokens, then 5 more at positions 12-16)."""
    model = _model()
    tokens = torch.export.Dim("tokens", min=1, max=model.cfg.max_len - 2)
    prefill = export_decomposed(
        model, model.example_inputs(PREFILL), dynamic_shapes=({1: tokens}, {0: tokens})
    )
    decode = export_decomposed(model, model.example_inputs(1, start=PREFILL))
    program = (
        TorchConverter()
        .add_exported_program(prefill, entrypoint_name="prefill")
        .add_exported_program(decode, entrypoint_name="decode")
        .to_coreai()
        .optimize()
    )
    assert "tensor<1x?xsi64>" in str(program)  # one prefill graph for every length
    with Session(program) as session:
        for n in (8, 1, 17, 29):
            ids, positions = model.example_inputs(n)
            states = _fresh_states(program)
            _prefill_then_decode(session, states, _model(), ids, positions, steps=2)
        ids, positions = model.example_inputs(17)
        states, reference = _fresh_states(program), _model()
        _prefill_then_decode(session, states, reference, ids[:, :12], positions[:12], steps=0)
        _prefill_then_decode(session, states, reference, ids[:, 12:], positions[12:], steps=2)


def _asset_bytes(program: AIProgram, path: Path) -> int:
    program.save_asset(path)
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _resources(text: str) -> set[str]:
    return set(re.findall(r'dense_resource<"?([^">]+)"?>', text))


def test_prefill_and_decode_store_shared_weights_once(tmp_path) -> None:
    model = _model()
    converter = _stage(model, None)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    programs = {
        "both": converter.to_coreai().optimize(),
        "prefill": converter.to_coreai(entrypoints=["prefill"]).optimize(),
        "decode": converter.to_coreai(entrypoints=["decode"]).optimize(),
    }
    sizes = {k: _asset_bytes(p, tmp_path / f"{k}.aimodel") for k, p in programs.items()}
    assert min(sizes.values()) >= weight_bytes
    # Adding the decode entry point adds at most what a decode-only asset holds beyond the
    # weights (its IR and metadata): no weight is stored a second time.
    decode_ir = sizes["decode"] - weight_bytes
    assert decode_ir < 0.1 * weight_bytes
    assert sizes["both"] <= sizes["prefill"] + decode_ir, sizes
    # every weight resource is referenced by both graphs, under one name
    found = graphs(programs["both"])
    shared = _resources(found["prefill"].text)
    assert shared and shared == _resources(found["decode"].text)
    assert shared == _resources(str(programs["both"]))
