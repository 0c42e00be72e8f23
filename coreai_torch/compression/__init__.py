"""Weight compression: configurations, fitting codes and palettes, applying them to a program.

    from coreai_torch import compression
    report = program.compress(compression.LinearQuantization(bits=4, block_size=32))

* :mod:`~coreai_torch.compression.config`: the public configurations (``LinearQuantization``,
  ``Palettization``, ``Pruning``, ``from_spec``);
* :mod:`~coreai_torch.compression.fitting`: codes, scales and palettes fitted to float weights;
* :mod:`~coreai_torch.compression.checks`: what ``compress()`` refuses before it changes a
  weight (NaN/inf values, scales beyond their dtype);
* :mod:`~coreai_torch.compression.apply`: ``AIProgram.compress()`` itself and its report.

The IR of compressed weights (bit packing, decompression ops) is :mod:`coreai_torch.ir.compressed`.
"""

from coreai_torch.compression.config import (
    NON_FINITE_POLICIES,
    SCALE_DTYPES,
    SPECS,
    CompressionConfig,
    LinearQuantization,
    Palettization,
    Pruning,
    WeightFilter,
    from_spec,
)

__all__ = [
    "NON_FINITE_POLICIES",
    "SCALE_DTYPES",
    "SPECS",
    "CompressionConfig",
    "LinearQuantization",
    "Palettization",
    "Pruning",
    "WeightFilter",
    "from_spec",
]
