"""Every emitted op carries a location: the FX node's name and the user's source line."""

from __future__ import annotations

import re

import torch
import torch.nn as nn

from coreai_torch import TorchConverter
from coreai_torch.frontend.export import export_decomposed

_OP_LINE = re.compile(r"^\s*(?:%\S+ = )?(coreai\.\S+).* loc\((.*)\)$")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc(x))  # LINE: relu
        return self.norm(h * 2 + x).softmax(-1)  # LINE: tail


def _line_of(marker: str) -> int:
    with open(__file__) as source:
        lines = source.read().splitlines()
    for number, text in enumerate(lines, 1):
        if text.endswith(f"# LINE: {marker}"):
            return number
    raise AssertionError(marker)


def test_every_op_has_a_location_naming_its_node_and_user_line() -> None:
    ep = export_decomposed(Block().eval(), (torch.randn(2, 8),))
    program = TorchConverter().add_exported_program(ep).to_coreai()
    text = program.to_mlir(debug_info=True)
    ops = [m.groups() for line in text.splitlines() if (m := _OP_LINE.match(line))]
    assert len(ops) > 10
    assert all(loc != "unknown" for _, loc in ops), text
    here = re.escape(__file__)
    user_lines = {int(m.group(1)) for _, loc in ops if (m := re.search(rf'"{here}":(\d+):0', loc))}
    assert user_lines == {_line_of("relu"), _line_of("tail")}, text
    # every op computed from a node (not a weight) points at one of the user's lines
    computed = [(op, loc) for op, loc in ops if '"weights"' not in loc and op != "coreai.output"]
    missing = [(op, loc) for op, loc in computed if __file__ not in loc]
    assert not missing, missing
