"""Built-in lowerings, grouped by op family; importing this package registers them all."""

from coreai_torch.lowerings import (  # noqa: F401  (imported for their registrations)
    activation,
    airy,
    attention,
    bitwise,
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
    linalg,
    linear_cross_entropy,
    matrix_exp,
    norm,
    padding,
    polynomials,
    quantized,
    recurrent,
    reduction,
    resize,
    scatter,
    segment,
    shape,
    sorting,
    special,
    symbolic,
    unary,
)
from coreai_torch.lowerings.registry import (
    BUILTIN_LOWERINGS,
    LoweringContext,
    LoweringTable,
    lowering,
    raw_lowering,
)

__all__ = ["BUILTIN_LOWERINGS", "LoweringContext", "LoweringTable", "lowering", "raw_lowering"]
