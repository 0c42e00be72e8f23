"""Lowerings: the rules that turn FX nodes into Core AI ops, and the contract they follow.

What extension authors use (docs/extending.md), the same contract the built-in rules follow:

* :class:`LoweringContext` — what a rule gets besides its arguments (the node, PyTorch's result
  ``out_dtype`` / ``out_shape``, ``unsupported(why)``, the conversion's options);
* :func:`get_operand` / :func:`get_operands` — operands of a rule in the simple form
  ``fn(values_map, node, loc)``;
* :func:`constant`, :func:`cast`, :func:`dtype_of`, :func:`shape_of` — Core AI values in
  torch dtypes (a constant of ``float16``, a cast to ``torch.int32``, ...).

Rules are registered with ``TorchConverter.register_torch_lowering``: ``fn(values_map, node,
loc)`` (the simple form) or, with ``bind=True``, ``fn(cx, **arguments)`` bound to the op's
schema like a built-in (:func:`~coreai_torch.lowerings.registry.schema_bound`).

The built-in rules are grouped by op family, one module each; importing this package registers
them all.  What families share lives in :mod:`coreai_torch.lowerings.helpers`.
"""

from coreai_torch.ir.values import cast, constant, dtype_of, shape_of
from coreai_torch.lowerings import (  # noqa: F401  (imported for their registrations)
    activation,
    airy,
    attention,
    bitwise,
    cholesky,
    control_flow,
    conv_pool,
    coreai_ops,
    creation,
    cumulative,
    elementwise,
    histogram,
    incomplete_gamma,
    indexing,
    ldl,
    linear_cross_entropy,
    lu,
    matmul,
    matrix_exp,
    norm,
    padding,
    pixel_shuffle,
    polynomials,
    qr,
    quantized,
    recurrent,
    reduction,
    resize,
    scatter,
    segment,
    shape,
    sorting,
    special,
    spectral,
    symbolic,
    triangular,
    unary,
)
from coreai_torch.lowerings.registry import (
    BUILTIN_LOWERINGS,
    LoweringContext,
    LoweringOptions,
    LoweringTable,
    get_operand,
    get_operands,
    lowering,
    raw_lowering,
    schema_bound,
)

__all__ = [
    "BUILTIN_LOWERINGS",
    "LoweringContext",
    "LoweringOptions",
    "LoweringTable",
    "cast",
    "constant",
    "dtype_of",
    "get_operand",
    "get_operands",
    "lowering",
    "raw_lowering",
    "schema_bound",
    "shape_of",
]
