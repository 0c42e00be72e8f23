# ruff: noqa: E402, I001, F811
# fmt: off
"""Seed 001 ("Conversion Workflows"): every code block in order, verbatim.

The ``# ==== check`` sections are not part of the guide; they run the converted programs on the
Core AI runtime and compare them with PyTorch.
"""

# --- From an ExportedProgram ---
import torch
import torch.nn as nn

from coreai_torch import TorchConverter, get_decomp_table


class MyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(10, 5)

    def forward(self, x):
        return self.linear(x)


model = MyModel().eval()

ep = torch.export.export(model, args=(torch.randn(1, 10),))
ep = ep.run_decompositions(get_decomp_table())

converter = TorchConverter().add_exported_program(ep)
coreai_program = converter.to_coreai()
coreai_program.optimize()

# ==== check: runs on the runtime and matches PyTorch
from coreai_torch.verify import verify

report = verify(model, (torch.randn(1, 10),), program=coreai_program)
print(report)
assert report.ok

# --- From an nn.Module ---
import torch
import coreai_torch

model = MyModel().eval()
sample = (torch.randn(1, 10),)

converter = TorchConverter().add_pytorch_module(
    model,
    export_fn=lambda m: torch.export.export(m, args=sample).run_decompositions(
        coreai_torch.get_decomp_table()
    ),
)
coreai_program = converter.to_coreai()
coreai_program.optimize()

# ==== check
report = verify(model, sample, program=coreai_program)
print(report)
assert report.ok

# --- Composite op externalization ---
import torch
import torch.nn as nn
import coreai_torch
from coreai_torch import ExternalizeSpec, TorchConverter
from coreai_torch.composite_ops import RMSNormImpl


class RMSNorm(nn.Module):
    """Convenience wrapper that owns the learnable scale parameter."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.norm = RMSNormImpl(eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x, self.weight)


class ModelWithNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = RMSNorm(dim=10)
        self.linear = nn.Linear(10, 5)

    def forward(self, x):
        return self.linear(self.norm(x))


model = ModelWithNorm().eval()
sample = (torch.randn(1, 10),)

converter = TorchConverter().add_pytorch_module(
    model,
    export_fn=lambda m: torch.export.export(m, args=sample).run_decompositions(
        coreai_torch.get_decomp_table()
    ),
    externalize_modules=[
        ExternalizeSpec(
            target_class=RMSNormImpl,
            composite_op_name="rms_norm",
            composite_attrs=["axes", "eps"],
        )
    ],
)
coreai_program = converter.to_coreai()
coreai_program.optimize()

# ==== check: a composite graph is invoked from @main, and the numbers match
text = str(coreai_program)
assert "composite_decl" in text and '"rms_norm"' in text and "coreai.invoke" in text
report = verify(model, sample, program=coreai_program)
print(report)
assert report.ok
print("seed 001: all examples ran and matched PyTorch")
