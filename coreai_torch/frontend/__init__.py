"""The torch side of a conversion: everything done to an ``ExportedProgram`` (never to IR).

Export and decompositions (:mod:`~coreai_torch.frontend.export`), the program's inputs,
outputs, states and weights (:mod:`~coreai_torch.frontend.signature`), conversion-time
folding (:mod:`~coreai_torch.frontend.folding`), symbolic sizes
(:mod:`~coreai_torch.frontend.sizes`), checks before import
(:mod:`~coreai_torch.frontend.checks`), the half-precision rewrite
(:mod:`~coreai_torch.frontend.half_precision`) and its checks against the program
(:mod:`~coreai_torch.frontend.precision_checks`), RMSNorm / RoPE fusion
(:mod:`~coreai_torch.frontend.fusions`), the torch side of externalization
(:mod:`~coreai_torch.frontend.externalize`) and the known fixes errors name
(:mod:`~coreai_torch.frontend.hints`).
"""
