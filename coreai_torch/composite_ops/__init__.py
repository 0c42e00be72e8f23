"""Building blocks the converter can keep whole as composite ops.

Each class is an ordinary ``nn.Module`` (it runs in eager PyTorch and exports normally).
Externalize it with an ``ExternalizeSpec`` naming its composite op and attributes::

    ExternalizeSpec(RMSNormImpl, composite_op_name="rms_norm", composite_attrs=["axes", "eps"])

and the converter emits each instance as a private graph marked with
``#coreai.composite_declaration<"rms_norm" = {...}>``.  ``default_specs()`` returns the recommended
spec of every composite module here.  See ``docs/composite_ops.md``.
"""

from coreai_torch.composite_ops.attention import SDPA
from coreai_torch.composite_ops.moe import (
    GatedActivation,
    GatedExperts,
    GatherMatmul,
    SwiGLUExperts,
)
from coreai_torch.composite_ops.norm import RMSNorm, RMSNormImpl
from coreai_torch.composite_ops.rope import RoPE, rope_cos_sin
from coreai_torch.frontend.externalize import ExternalizeSpec

__all__ = [
    "SDPA",
    "GatedActivation",
    "GatedExperts",
    "GatherMatmul",
    "RMSNorm",
    "RMSNormImpl",
    "RoPE",
    "SwiGLUExperts",
    "default_specs",
    "rope_cos_sin",
]


def default_specs() -> list[ExternalizeSpec]:
    """An ``ExternalizeSpec`` for every composite op module of this package."""

    return [
        ExternalizeSpec(RMSNormImpl, "rms_norm", ["axes", "eps", "version"]),
        ExternalizeSpec(RoPE, "rope", ["interleaved", "version"]),
        ExternalizeSpec(SDPA, "sdpa", ["is_causal", "scale", "enable_gqa", "version"]),
        ExternalizeSpec(GatherMatmul, "gather_matmul", ["version"]),
    ]
