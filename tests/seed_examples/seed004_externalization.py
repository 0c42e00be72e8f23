# ruff: noqa: E402, F811
# fmt: off
"""Seed 004 ("Externalization"): the IR it shows, and every code block in order, verbatim.

The ``# ==== setup`` / ``# ==== check`` sections are not part of the guide: they build the
"model whose forward is linear(norm(x))" the guide's IR listings describe, check that the
converted IR has the documented shape, and run the programs on the Core AI runtime.
"""

# ==== setup: a model whose forward is linear(norm(x)) (seed 001's ModelWithNorm)
import re

import torch
import torch.nn as nn

import coreai_torch
from coreai_torch import ExternalizeSpec, TorchConverter
from coreai_torch.composite_ops import RMSNorm, RMSNormImpl
from coreai_torch.verify import verify


class ModelWithNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = RMSNorm(dim=10)
        self.linear = nn.Linear(10, 5)

    def forward(self, x):
        return self.linear(self.norm(x))


def convert(model, sample, externalize_modules):
    return TorchConverter().add_pytorch_module(
        model,
        export_fn=lambda m: torch.export.export(m, args=sample).run_decompositions(
            coreai_torch.get_decomp_table()
        ),
        externalize_modules=externalize_modules,
    ).to_coreai()


norm_model = ModelWithNorm().eval()
norm_sample = (torch.randn(1, 10),)

# ==== check: "What externalization produces" — composite op externalization
program = convert(
    norm_model, norm_sample, [ExternalizeSpec(RMSNormImpl, "rms_norm", ["axes", "eps"])]
)
text = str(program)
print(text)
graph = re.search(
    r"coreai\.graph private noinline @(norm\.norm\.rms_norm_[0-9a-f]{8})\(%arg0: tensor<1x10xf32> "
    r'\{coreai\.name = "input"\}, %arg1: tensor<10xf32> \{coreai\.name = "scale"\}\) -> '
    r'\(tensor<1x10xf32> \{coreai\.name = "output"\}\) attributes \{composite_decl = '
    r'#coreai\.composite_declaration<"rms_norm" = \{input_names = \["input", "scale"\], '
    r"op_attrs = \{axes = -1 : si64, eps = 9\.99999974E-6 : f32, version = 1 : si64\}, "
    r'output_names = \["output"\]\}>\}',
    text,
)
assert graph, text
assert re.search(
    r'coreai\.graph @main\(%arg0: tensor<1x10xf32> \{coreai\.name = "x"\}\) -> '
    r"\(tensor<1x5xf32>",
    text,
), text
assert re.search(
    rf"= coreai\.invoke @{re.escape(graph[1])}\(%arg0, %\d+\)\s+: \(tensor<1x10xf32>, "
    r"tensor<10xf32>\) -> tensor<1x10xf32>",
    text,
), text
assert text.index(graph[1]) < text.index("coreai.graph @main")  # defined before @main
program.optimize()
report = verify(norm_model, norm_sample, program=program)
print(report)
assert report.ok

# ==== check: "What externalization produces" — simple externalization
program = convert(norm_model, norm_sample, [RMSNorm])
text = str(program)
print(text)
graph = re.search(
    r"coreai\.graph noinline @(norm_[0-9a-f]{8})\(%arg0: tensor<1x10xf32> "
    r'\{coreai\.name = "x"\}\) -> \(tensor<1x10xf32> \{coreai\.name = "output"\}\) \{',
    text,
)
assert graph, text
assert "composite_decl" not in text, text
assert re.search(
    rf"= coreai\.invoke @{re.escape(graph[1])}\(%arg0\)\s+: \(tensor<1x10xf32>\) -> "
    r"tensor<1x10xf32>",
    text,
), text
program.optimize()
report = verify(norm_model, norm_sample, program=program)
print(report)
assert report.ok

# --- Composite Op Externalization ---
import torch
import torch.nn as nn

from coreai_torch import ExternalizeSpec


class RMSNormComposite(nn.Module):
    def __init__(self, axes=-1, eps=1e-5, version=1):
        super().__init__()
        self.axes = axes
        self.eps = eps
        self.version = version

    def forward(self, input: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        x_f32 = input.to(torch.float32)
        inv_rms = torch.rsqrt((x_f32 * x_f32).mean(self.axes, keepdim=True) + self.eps)
        return (input * inv_rms).to(input.dtype) * scale

model = RMSNormComposite().eval()
sample = (torch.randn(10), torch.randn(10))
import torch

import coreai_torch
from coreai_torch import ExternalizeSpec, TorchConverter

converter = TorchConverter().add_pytorch_module(
    model,
    export_fn=lambda m: torch.export.export(m, args=sample).run_decompositions(
        coreai_torch.get_decomp_table()
    ),
    externalize_modules=[
        ExternalizeSpec(
            target_class=RMSNormComposite,
            composite_op_name="rms_norm",
            composite_attrs=["axes", "eps", "version"],
        )
    ],
)
coreai_program = converter.to_coreai()
coreai_program.optimize()

# ==== check: the root module itself became the composite op that @main invokes
text = str(coreai_program)
print(text)
graph = re.search(
    r"coreai\.graph private noinline @(rms_norm_[0-9a-f]{8})\(%arg0: tensor<10xf32> "
    r'\{coreai\.name = "input"\}, %arg1: tensor<10xf32> \{coreai\.name = "scale"\}\)',
    text,
)
assert graph, text
assert (
    '#coreai.composite_declaration<"rms_norm" = {input_names = ["input", "scale"], op_attrs = '
    '{axes = -1 : si64, eps = 9.99999974E-6 : f32, version = 1 : si64}, output_names = '
    '["output"]}>'
) in text, text
assert re.search(rf"coreai\.invoke @{re.escape(graph[1])}\(%arg0, %arg1\)", text), text
report = verify(model, sample, program=coreai_program)
print(report)
assert report.ok
print("seed 004: all examples ran and matched PyTorch")
