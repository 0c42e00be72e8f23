"""Errors with a known fix in the project name it (``coreai_torch.frontend.hints``): a Hugging Face
mixture-of-experts block's expert loop -> ``rewrite_moe``, a recurrent layer with a dynamic
sequence length -> ``rewrite_recurrent``; other errors get no hint."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from coreai_torch import TorchConverter, analyze, get_decomp_table, rewrite_moe
from coreai_torch.errors import ConversionError, UnsupportedOpError
from coreai_torch.frontend.export import export_decomposed
from coreai_torch.importer.graph import find_unsupported, unsupported_op_error
from tests.models.test_moe import VOCAB, moe_causal_lm


class Logits(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, use_cache=False, return_dict=False)[0]


def _ids() -> tuple[torch.Tensor]:
    return (torch.randint(0, VOCAB, (1, 6)),)


@pytest.mark.slow
def test_an_moe_expert_loop_that_reaches_the_converter_names_rewrite_moe() -> None:
    """OLMoE's loop (torch.where(expert_mask[e])) exports with a nonzero of data-dependent
    size, which the nonzero lowering refuses."""
    model = Logits(moe_causal_lm("olmoe"))
    ep = export_decomposed(model, _ids())
    with pytest.raises(UnsupportedOpError) as info:
        TorchConverter().add_exported_program(ep).to_coreai()
    message = str(info.value)
    assert "aten::nonzero" in message
    assert "modeling_olmoe.py" in message  # the source line, as before
    assert "mixture-of-experts block OlmoeSparseMoeBlock at 'model.model.layers.0.mlp'" in message
    assert "call coreai_torch.rewrite_moe(model) before torch.export" in message
    # what the hint says works
    rewrite_moe(model.model)
    TorchConverter().add_exported_program(export_decomposed(model, _ids())).to_coreai()


def test_an_moe_model_that_fails_in_torch_export_names_rewrite_moe(tmp_path: Path) -> None:
    model = Logits(moe_causal_lm("mixtral"))
    with pytest.raises(Exception, match="data-dependent") as info:
        export_decomposed(model, _ids())
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "MixtralSparseMoeBlock at 'model.model.layers.0.block_sparse_moe'" in notes
    assert "coreai_torch.rewrite_moe(model)" in notes

    def export_fn(m: nn.Module) -> torch.export.ExportedProgram:
        ep = torch.export.export(m, _ids(), strict=False)
        return ep.run_decompositions(get_decomp_table())

    with pytest.raises(ConversionError, match=r"(?s)export_fn raised.*rewrite_moe\(model\)"):
        TorchConverter().add_pytorch_module(model, export_fn=export_fn)


def test_a_recurrent_layer_with_a_dynamic_length_names_rewrite_recurrent() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.GRU(8, 8, batch_first=True)).eval()
    x = torch.randn(2, 5, 4)
    dynamic = ({1: torch.export.Dim("seq", max=64)},)
    with pytest.raises(Exception, match="Constraints violated") as info:
        export_decomposed(model, (x,), dynamic_shapes=dynamic)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "recurrent layer (nn.GRU at '1')" in notes
    assert "coreai_torch.rewrite_recurrent(model)" in notes

    def export_fn(m: nn.Module) -> torch.export.ExportedProgram:
        ep = torch.export.export(m, (x,), dynamic_shapes=dynamic, strict=False)
        return ep.run_decompositions(get_decomp_table())

    with pytest.raises(ConversionError, match=r"(?s)nn\.GRU at '1'.*rewrite_recurrent\(model\)"):
        TorchConverter().add_pytorch_module(model, export_fn=export_fn)


def test_ops_of_a_recurrent_layer_without_a_lowering_name_rewrite_recurrent() -> None:
    model = nn.Sequential(nn.LSTM(4, 8, batch_first=True)).eval()
    ep = export_decomposed(model, (torch.randn(1, 3, 4),))
    missing = find_unsupported(ep, {})  # as if no op had a lowering
    message = str(unsupported_op_error(missing, "main"))
    assert "hint: the model has a recurrent layer (nn.LSTM at '0')" in message
    assert message.count("hint:") == 1
    report = analyze(ep, converter=SimpleNamespace(lowerings={}))
    assert any("rewrite_recurrent" in m.hint for m in report.missing)
    assert "rewrite_recurrent" in str(report)


def test_other_errors_get_no_hint() -> None:
    class Plain(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x[x > 0] * 2).sum()  # a data-dependent size, no MoE nor recurrence

    ep = export_decomposed(Plain(), (torch.randn(8),))
    with pytest.raises(ConversionError) as info:
        TorchConverter().add_exported_program(ep).to_coreai()
    assert "hint:" not in str(info.value)
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(Exception) as info:
        export_decomposed(model, (torch.randn(2, 5),))
    assert not getattr(info.value, "__notes__", [])
