"""Helpers the lowering families share; a family module imports helpers only from here, the
registry and :mod:`coreai_torch.ir` — never from another family.

* :mod:`.operands` — PyTorch's operand conversions and type promotion (wrapping integers,
  ``opmath``, symbolic scalars);
* :mod:`.arithmetic` — elementwise building blocks: comparisons, NaN/inf tests, sign,
  rounding, clamping;
* :mod:`.float_math` — composed float functions several families evaluate (Horner
  polynomials, ``log1p``/``expm1``/``erfc``, ``lgamma``, ``frexp``);
* :mod:`.loops` — per-element loops (series, continued fractions, recurrences);
* :mod:`.reductions` — reductions, arg-max/min, scans and the size limit of pairwise
  formulations;
* :mod:`.layout` — data movement on static sizes: slices, gathers by constant tables,
  contractions, constants, advanced-indexing layouts;
* :mod:`.accumulation` — the float32 accumulation of 16-bit products;
* :mod:`.matrices` — matrix products and the unrolled building blocks of the factorizations;
* :mod:`.composite` — ATen ops kept whole as composite ops;
* :mod:`.weights` — weights read at conversion time and their compressed form.
"""
