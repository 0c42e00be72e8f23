"""Core AI IR without torch: building and reading values (:mod:`~coreai_torch.ir.values`),
weights as resources (:mod:`~coreai_torch.ir.weights`), private and composite graphs
(:mod:`~coreai_torch.ir.composite`), compressed weights (:mod:`~coreai_torch.ir.compressed`),
the checks a program passes before it reaches the user (:mod:`~coreai_torch.ir.checks`),
saving it as an asset (:mod:`~coreai_torch.ir.saving`, :mod:`~coreai_torch.ir.bytecode`) and
checking a saved asset before the runtime reads it (:mod:`~coreai_torch.ir.assets`).
"""
