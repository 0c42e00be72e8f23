# ruff: noqa: E402, I001, F811, RUF015
# fmt: off
"""Seed 003 ("Composite Ops Guide"): every code block in order, verbatim.

The ``# ==== setup`` / ``# ==== check`` sections are not part of the guide: the generic
skeleton uses placeholders (``model``, ``sample``, ``SomeOp``) that the setup defines, and the
checks inspect the IR and run the programs on the Core AI runtime.  The guide's top-level
``await run_and_compare(...)`` runs with ``asyncio.run``.
"""

# ==== setup: the skeleton's placeholders
import torch
import torch.nn as nn


class SomeOp(nn.Module):
    def __init__(self, attr1=2, attr2=0.5):
        super().__init__()
        self.attr1 = attr1
        self.attr2 = attr2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.attr1 + self.attr2


class SkeletonModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.op = SomeOp()
        self.linear = nn.Linear(8, 4)

    def forward(self, x):
        return self.linear(self.op(x))


model = SkeletonModel().eval()
sample = (torch.randn(2, 8),)

# --- The General Pattern: generic skeleton ---
import torch
import torch.nn as nn
import coreai_torch
from coreai_torch import ExternalizeSpec, TorchConverter
from coreai_torch.composite_ops import RMSNormImpl
import torch
import coreai_torch
from coreai_torch import ExternalizeSpec, TorchConverter
coreai_program = (
TorchConverter()
.add_pytorch_module(
model,
export_fn=lambda m: torch.export.export(m, args=sample).run_decompositions(
coreai_torch.get_decomp_table()
),
externalize_modules=[
ExternalizeSpec(
target_class=SomeOp,
composite_op_name="some_op",
composite_attrs=["attr1", "attr2"],
)
],
)
.to_coreai()
)
coreai_program.optimize()

# ==== check: the skeleton's composite op, and the numbers
import re

from coreai_torch.verify import verify

text = str(coreai_program)
print(text)
assert re.search(r"coreai\.graph private noinline @op\.some_op_[0-9a-f]{8}\(", text), text
assert (
    '#coreai.composite_declaration<"some_op" = {input_names = ["x"], op_attrs = {attr1 = 2 : '
    'si64, attr2 = 5.000000e-01 : f32, version = 1 : si64}, output_names = ["output"]}>'
) in text, text
assert re.search(r"coreai\.invoke @op\.some_op_[0-9a-f]{8}\(%arg0\)", text), text
report = verify(model, sample, program=coreai_program)
print(report)
assert report.ok

# --- Worked Example: RMSNorm / Define a model ---
import torch
import torch.nn as nn
from coreai_torch.composite_ops import RMSNormImpl


class RMSNorm(nn.Module):
    """Convenience wrapper that owns the learnable scale parameter."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.norm = RMSNormImpl(eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x, self.weight)


class FeedForwardBlock(nn.Module):
    def __init__(self, dim: int, ff_dim: int, eps: float = 1e-5):
        super().__init__()
        self.norm = RMSNorm(dim=dim, eps=eps)
        self.fc1 = nn.Linear(dim, ff_dim, bias=False)
        self.fc2 = nn.Linear(ff_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.norm(x))))


model = FeedForwardBlock(dim=64, ff_dim=256).eval()
sample = (torch.randn(2, 16, 64),)

# --- Convert ---
import torch
import coreai_torch

coreai_program = (
    TorchConverter()
    .add_pytorch_module(
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
    .to_coreai()
)
coreai_program.optimize()

# ==== check: the rms_norm composite takes the wrapper's weight as its `scale` input
text = str(coreai_program)
print(text)
match = re.search(
    r"coreai\.graph private noinline @(norm\.norm\.rms_norm_[0-9a-f]{8})\(%arg0: "
    r'tensor<2x16x64xf32> \{coreai\.name = "input"\}, %arg1: tensor<64xf32> '
    r'\{coreai\.name = "scale"\}\)',
    text,
)
assert match, text
assert (
    '#coreai.composite_declaration<"rms_norm" = {input_names = ["input", "scale"], op_attrs = '
    '{axes = -1 : si64, eps = 9.99999974E-6 : f32, version = 1 : si64}, output_names = '
    '["output"]}>'
) in text, text
assert re.search(rf"coreai\.invoke @{re.escape(match[1])}\(%arg0, %\d+\)", text), text
assert "dense_resource<norm.weight>" in text, text

# --- Verify numerical correctness ---
import tempfile
import torch
from pathlib import Path
import numpy as np
from coreai.runtime import NDArray


async def run_and_compare(coreai_program, model, sample):
    with tempfile.TemporaryDirectory() as tmpdir:
        asset = coreai_program.save_asset(Path(tmpdir) / "rms_norm_example.aimodel")
        async with asset.executable() as ai_model:
            function = ai_model.load_function("main")
            x = sample[0]
            coreai_out = await function({"x": NDArray(x)})
            coreai_np = list(coreai_out.values())[0].numpy()
            with torch.no_grad():
                torch_np = model(x).numpy()
            print(f"Max abs error: {np.abs(torch_np - coreai_np).max():.2e}")
            print(f"Outputs match: {np.allclose(torch_np, coreai_np, atol=1e-4)}")


# (the guide writes `await run_and_compare(coreai_program, model, sample)` at top level)
import asyncio
import contextlib
import io

captured = io.StringIO()
with contextlib.redirect_stdout(captured):
    asyncio.run(run_and_compare(coreai_program, model, sample))

# ==== check: the guide's own comparison says the outputs match
print(captured.getvalue())
assert "Outputs match: True" in captured.getvalue()
error = float(re.search(r"Max abs error: (\S+)", captured.getvalue())[1])
assert error < 1e-4
print(f"seed 003: all examples ran and matched PyTorch (max abs error {error:.2e})")
