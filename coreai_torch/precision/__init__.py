"""Half precision: convert a float32 model into a float16 / bfloat16 program.

    converter = TorchConverter(compute_precision=torch.float16)     # fp32 islands by default
    converter = TorchConverter(compute_precision=precision.from_spec("bf16"),
                               keep_fp32_modules=["lm_head"])

:mod:`~coreai_torch.precision.policy` holds the policy (:class:`Precision`, :func:`from_spec`,
the default fp32 islands); :mod:`~coreai_torch.frontend.half_precision` applies it to a decomposed
``ExportedProgram`` before import.  See ``docs/precision.md``.
"""

from coreai_torch.precision.policy import (
    DEFAULT_FP32_MODULES,
    DEFAULT_FP32_OPS,
    Precision,
    from_spec,
)

__all__ = ["DEFAULT_FP32_MODULES", "DEFAULT_FP32_OPS", "Precision", "from_spec"]
