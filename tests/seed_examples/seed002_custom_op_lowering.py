# ruff: noqa: E402, I001
# fmt: off
"""Seed 002 ("Custom Op Lowering"): every code block in order, verbatim.

The ``# ==== check`` sections are not part of the guide; they run the converted programs on the
Core AI runtime and compare them with PyTorch.  Run as a script (tests/test_custom_lowering.py
does, in a fresh interpreter, because it defines the custom op ``my_lib::scaled_add``).
"""

# --- Step 1 ---
import torch


@torch.library.custom_op("my_lib::scaled_add", mutates_args=())
def scaled_add(x: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    """Eager implementation: runs on CPU during normal PyTorch inference."""
    return x + scale * y


@scaled_add.register_fake
def _(x: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    """Abstract implementation: called by torch.export to infer output shapes."""
    return torch.empty_like(x)

# --- Step 2 ---
import torch
import torch.nn as nn


class ScaledAddModel(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.ops.my_lib.scaled_add(x, y, 0.5)

# --- Step 3 ---
import torch
from coreai_torch import get_decomp_table

model = ScaledAddModel().eval()
example_inputs = (torch.randn(4, 8), torch.randn(4, 8))

exported = torch.export.export(model, args=example_inputs)
exported = exported.run_decompositions(get_decomp_table())

# --- Step 4 ---
from coreai._compiler.dialects import coreai

from coreai_torch import TorchConverter
from coreai_torch._utils import get_operands

converter = TorchConverter()


@converter.register_torch_lowering("my_lib::scaled_add.default")
def lower_scaled_add(values_map, node, loc):
    x, y = get_operands(values_map, node, [0, 1], loc)
    scale = node.args[2]  # plain Python float

    scale_val = coreai.constant(scale, dtype=x.type.element_type)
    scaled_y = coreai.broadcasting_mul(y, scale_val, loc=loc)
    return coreai.broadcasting_add(x, scaled_y, loc=loc)

# --- Step 5 ---
coreai_program = converter.add_exported_program(
    exported,
    input_names=["x", "y"],
    output_names=["result"],
).to_coreai()
coreai_program.optimize()

# --- Step 6 ---
print(str(coreai_program))

# ==== check: the single node survived decomposition and the program matches PyTorch
from coreai_torch.runtime import run_program
assert [str(n.target) for n in exported.graph.nodes if n.op == "call_function"] == [
    "my_lib.scaled_add.default"]
x_in, y_in = example_inputs
out = run_program(coreai_program, {"x": x_in, "y": y_in})["result"]
torch.testing.assert_close(torch.from_numpy(out), model(x_in, y_in), atol=1e-6, rtol=1e-6)
print("CHECK scaled_add ok")

# --- Overriding built-in lowerings ---
import torch
import torch.nn as nn
import numpy as np

from coreai_torch._utils import get_operand


# A model that uses adaptive_avg_pool2d
class PoolModel(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.adaptive_avg_pool2d(x, (1, 1))


pool_model = PoolModel().eval()
pool_input = (torch.randn(1, 3, 8, 8),)
pool_exported = torch.export.export(pool_model, args=pool_input)
pool_exported = pool_exported.run_decompositions(get_decomp_table())

converter = TorchConverter()


@converter.register_torch_lowering(
    "aten::_adaptive_avg_pool2d.default", allow_override=True
)
def lower_adaptive_avg_pool2d_static(values_map, node, loc):
    x = get_operand(values_map, node, 0, loc)
    output_h, output_w = node.args[1]
    input_h, input_w = x.type.shape[2], x.type.shape[3]
    stride_h, stride_w = input_h // output_h, input_w // output_w
    kernel_h = input_h - (output_h - 1) * stride_h
    kernel_w = input_w - (output_w - 1) * stride_w
    return coreai.broadcasting_divide(
        coreai.sumpool2d(
            x,
            kernel_size=np.array([kernel_h, kernel_w], dtype=np.uint32),
            strides=np.array([stride_h, stride_w], dtype=np.uint32),
            dilation=coreai.constant([1, 1], dtype=np.uint32),
        ),
        coreai.cast(float(kernel_h * kernel_w), x.type.element_type),
    )


coreai_program = converter.add_exported_program(pool_exported).to_coreai()
coreai_program.optimize()

# ==== check: the override was used (sum pooling, not the built-in mean) and matches PyTorch
text = str(coreai_program)
assert "coreai.sum_pool_2d" in text and "reduce_mean" not in text, text
(pool_x,) = pool_input
(out,) = run_program(coreai_program, {"x": pool_x}).values()
expected = pool_model(pool_x)
torch.testing.assert_close(torch.from_numpy(out), expected, atol=1e-5, rtol=1e-5)
print("CHECK adaptive_avg_pool2d override ok")
