"""Weight compression: configurations, fitting codes and palettes, applying them to a program.

    from coreai_torch import compression
    report = program.compress(compression.LinearQuantization(bits=4, block_size=32))

* :mod:`~coreai_torch.compression.config`: the public configurations (``LinearQuantization``,
  ``Palettization``, ``Pruning``, ``from_spec``);
* :mod:`~coreai_torch.compression.fitting`: codes, scales and palettes fitted to float weights;
* :mod:`~coreai_torch.compression.calibrated`: fits that minimise a layer's output error on
  calibration activations (GPTQ, activation-aware scales, weighted palettes);
* :mod:`~coreai_torch.compression.calibration`: ``calibrate(model, samples, config)``, the
  block-by-block calibration of a PyTorch model (and the bits allocation of ``Mixed``);
* :mod:`~coreai_torch.compression.checks`: what ``compress()`` refuses before it changes a
  weight (NaN/inf values, scales beyond their dtype);
* :mod:`~coreai_torch.compression.apply`: ``AIProgram.compress()`` itself and its report.

The IR of compressed weights (bit packing, decompression ops) is :mod:`coreai_torch.ir.compressed`.
"""

from coreai_torch.compression.calibration import (
    Calibration,
    CalibrationError,
    FittedWeight,
    calibrate,
)
from coreai_torch.compression.config import (
    MIXED_FORMS,
    NON_FINITE_POLICIES,
    SAFE_FORM,
    SCALE_DTYPES,
    SPECS,
    CompressionConfig,
    LinearQuantization,
    Mixed,
    Palettization,
    Pruning,
    WeightFilter,
    bits_per_weight,
    from_spec,
)

__all__ = [
    "MIXED_FORMS",
    "NON_FINITE_POLICIES",
    "SAFE_FORM",
    "SCALE_DTYPES",
    "SPECS",
    "Calibration",
    "CalibrationError",
    "CompressionConfig",
    "FittedWeight",
    "LinearQuantization",
    "Mixed",
    "Palettization",
    "Pruning",
    "WeightFilter",
    "bits_per_weight",
    "calibrate",
    "from_spec",
]
