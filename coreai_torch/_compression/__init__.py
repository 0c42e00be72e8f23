"""The interface coreai-opt (Apple's compression library) expects from a Core AI converter.

coreai-opt's finalizers (``finalize(backend=ExportBackend.CoreAI)``), its graph-mode quantizer
and its ``coreai_opt.coreai_utils`` passes import these modules by name.  They are a thin
compatibility surface over the project's own compression machinery: the modules build the
``torch.ops.coreai`` ops (:mod:`.ops`), which :mod:`coreai_torch.lowerings.coreai_ops` lowers
through :mod:`coreai_torch.ir.compressed` -- the one representation of compressed weights -- to
Core AI's native decompression ops.  See ``docs/compression.md``.

* :mod:`.custom_layers`: ``PalettizeModule``, ``ScaledPalettizeModule``,
  ``WeightDequantizeModule``, ``SparseModule``, ``ActivationQuantizeModule``,
  ``ActivationDequantizeModule``;
* :mod:`.utils`: ``wrap_for_parametrization``;
* :mod:`._floatx`: ``SubbyteTensor``, ``Float4Tensor`` (packed FP4 weights);
* :mod:`._types`, :mod:`._intx`: element types by name, sub-byte packing (IR passes).
"""

from coreai_torch._compression import ops  # noqa: F401  (registers torch.ops.coreai)
