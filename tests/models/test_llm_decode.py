"""LLM decoding with state: prefill + 3 decode steps of a Llama-style decoder with a static KV
cache in buffers, as two entry points of one program that share weights and states."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from coreai_torch import ExternalizeSpec, TorchConverter
from coreai_torch.composite_ops import default_specs
from coreai_torch.examples.llama import LlamaConfig, LlamaKV, init_weights
from coreai_torch.runtime import Session
from coreai_torch.verify import export_decomposed

PREFILL = 8


def _model() -> LlamaKV:
    torch.manual_seed(0)
    model = LlamaKV(LlamaConfig()).eval()
    init_weights(model, gain=1.5)
    return model


def _convert(model: LlamaKV, externalize: list | None):
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
    return converter.to_coreai().optimize(), prefill_args


@pytest.mark.parametrize("externalize", [None, "composites"], ids=["inline", "composites"])
def test_prefill_then_three_decode_steps_match_pytorch(externalize) -> None:
    from coreai.runtime import NDArray

    model = _model()
    specs: list[ExternalizeSpec] | None = None
    if externalize:  # the decoder uses every composite module but the MoE one
        specs = [s for s in default_specs() if s.composite_op_name != "gather_matmul"]
    program, (ids, positions) = _convert(model, specs)
    text = str(program)
    if externalize:
        assert "composite_decl" in text and "coreai.invoke" in text

    reference = _model()  # same weights, its own cache
    states = {
        name: NDArray(value.clone().numpy())
        for name, value in program.signatures["prefill"].initial_states.items()
    }
    with Session(program) as session:
        assert list(session.descriptor("prefill").state_names) == list(states)
        assert list(session.descriptor("decode").state_names) == list(states)
        out = session.run(
            {"token_ids": ids, "positions": positions}, entrypoint="prefill", state=states
        )
        logits = next(iter(out.values()))
        with torch.no_grad():
            expected = reference(ids, positions)
        assert expected.abs().max() > 1.0
        np.testing.assert_allclose(logits, expected.numpy(), atol=1e-4, rtol=1e-4)
        token = expected[:, -1:].argmax(-1)
        for step in range(3):
            pos = torch.tensor([PREFILL + step])
            out = session.run(
                {"token_ids": token, "positions": pos}, entrypoint="decode", state=states
            )
            with torch.no_grad():
                expected = reference(token, pos)
            np.testing.assert_allclose(
                next(iter(out.values())), expected.numpy(), atol=1e-4, rtol=1e-4
            )
            token = expected[:, -1:].argmax(-1)
        # the runtime's caches hold exactly what PyTorch's buffers hold
        for name, value in session.state_values("decode").items():
            layer, kind = re.match(r"b_layers_(\d+)_attn_(k|v)_cache", name).groups()
            buf = getattr(reference.layers[int(layer)].attn, f"{kind}_cache")
            np.testing.assert_allclose(value, buf.numpy(), atol=1e-4, rtol=1e-4)


def test_prefill_and_decode_store_shared_weights_once(tmp_path) -> None:
    model = _model()
    program, _ = _convert(model, None)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    asset = tmp_path / "llm.aimodel"
    program.save_asset(asset)
    size = (asset / "main.mlirb").stat().st_size
    assert size < 1.15 * weight_bytes, (size, weight_bytes)
    text = str(program)
    # each weight is referenced by both graphs under one resource name
    assert text.count("dense_resource<lm_head.weight>") == 2
