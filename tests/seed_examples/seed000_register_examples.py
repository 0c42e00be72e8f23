# ruff: noqa: E402, I001, F811
# fmt: off
"""Seed 000 (TorchConverter API reference): the ``register_torch_lowering`` and
``register_custom_kernels`` examples, verbatim and in order.

The examples assume a model, its inputs and an ``exported`` program; the ``# ==== glue``
sections provide them (and ``TorchConverter``, which the first example uses without importing
it).  The ``# ==== check`` sections run the results on the Core AI runtime and compare them with
PyTorch.  Run as a script in a fresh interpreter (it defines ``my_lib::scaled_add``).
"""

# ==== glue: what the examples take from the surrounding page
import torch
import torch.nn as nn

from coreai_torch import TorchConverter, get_decomp_table
from coreai_torch.runtime import run_program

# --- register_torch_lowering: a custom torch op ---
import torch
from coreai._compiler.dialects import coreai
from coreai_torch._utils import get_operands

@torch.library.custom_op("my_lib::scaled_add", mutates_args=())
def scaled_add(x: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    return x + scale * y

@scaled_add.register_fake
def _(x, y, scale):
    return torch.empty_like(x)

# ==== glue: the model and its export
class ScaledAddModel(nn.Module):
    def forward(self, x, y):
        return torch.ops.my_lib.scaled_add(x, y, 0.25)


model = ScaledAddModel().eval()
example_inputs = (torch.randn(2, 5), torch.randn(2, 5))
exported = torch.export.export(model, args=example_inputs).run_decompositions(get_decomp_table())

converter = TorchConverter()

@converter.register_torch_lowering("my_lib::scaled_add.default")
def lower_scaled_add(values_map, node, loc):
    x, y = get_operands(values_map, node, [0, 1], loc)
    scale = node.args[2]  # plain Python float
    scale_val = coreai.constant(scale, dtype=x.type.element_type)
    scaled_y = coreai.broadcasting_mul(y, scale_val, loc=loc)
    return coreai.broadcasting_add(x, scaled_y, loc=loc)

coreai_program = converter.add_exported_program(exported).to_coreai()
coreai_program.optimize()

# ==== check
out = run_program(coreai_program, {"x": example_inputs[0], "y": example_inputs[1]})
torch.testing.assert_close(torch.from_numpy(out["scaled_add"]), model(*example_inputs))
print("CHECK scaled_add ok")

# ==== glue: a model whose pooling output divides the input evenly
class Pool(nn.Module):
    def forward(self, x):
        return torch.nn.functional.adaptive_avg_pool2d(x, (2, 3))


model = Pool().eval()
example_inputs = (torch.randn(2, 4, 6, 9),)
exported = torch.export.export(model, args=example_inputs).run_decompositions(get_decomp_table())

# --- register_torch_lowering: override a built-in ATen op lowering ---
import numpy as np
from coreai._compiler.dialects import coreai
from coreai_torch._utils import get_operand

converter = TorchConverter()

@converter.register_torch_lowering("aten::_adaptive_avg_pool2d.default", allow_override=True)
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

coreai_program = converter.add_exported_program(exported).to_coreai()
coreai_program.optimize()

# ==== check: the override produced the program (stride 3x3 sum pooling) and matches PyTorch
text = str(coreai_program)
assert "coreai.sum_pool_2d" in text and "dense<3> : tensor<2xui32>" in text, text
(out,) = run_program(coreai_program, {"x": example_inputs[0]}).values()
torch.testing.assert_close(torch.from_numpy(out), model(*example_inputs), atol=1e-5, rtol=1e-5)
print("CHECK adaptive_avg_pool2d override ok")

# --- register_custom_kernels ---
import torch
from coreai_torch import TorchConverter, TorchMetalKernel, MetalParameter, get_decomp_table

def torch_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x + y

kernel = TorchMetalKernel(
    "vector_add",
    input_names=["x", "y"],
    result_names=["output"],
    src="output[id] = x[id] + y[id];",
    torch_defn=torch_add,
    metal_params=[MetalParameter("id", "uint", "thread_position_in_grid")],
)

converter = TorchConverter()
converter.register_custom_kernels([kernel])

# ==== glue: a model calling the kernel
class VectorAdd(nn.Module):
    def forward(self, x, y):
        return kernel(
            x, y, threads_per_grid=(16, 1, 1), threads_per_thread_group=(16, 1, 1),
            result_shapes=[(16,)],
        )


model = VectorAdd().eval()
example_inputs = (torch.randn(16), torch.randn(16))

exported = torch.export.export(model, args=example_inputs)
exported = exported.run_decompositions(get_decomp_table())
coreai_program = converter.add_exported_program(exported).to_coreai()
coreai_program.optimize()

# ==== check: eager runs torch_defn; the program holds the kernel, verifies and saves
import tempfile
from pathlib import Path

from coreai_torch import UnsupportedPlatformError

torch.testing.assert_close(model(*example_inputs), torch_add(*example_inputs))
text = str(coreai_program)
assert "coreai.metal4_kernel" in text and "output[id] = x[id] + y[id];" in text, text
coreai_program.verify()
with tempfile.TemporaryDirectory() as tmp:
    coreai_program.save_asset(Path(tmp) / "vector_add.aimodel")
    assert (Path(tmp) / "vector_add.aimodel").exists()
try:
    run_program(coreai_program, {"x": example_inputs[0], "y": example_inputs[1]})
except UnsupportedPlatformError as error:
    assert "Metal" in str(error)
    print("CHECK vector_add ok (saved; running it needs an Apple GPU)")
else:
    print("CHECK vector_add ok (ran)")
