"""FX graph -> Core AI graph, one FX node -> one lowering (:mod:`~coreai_torch.importer.graph`),
with externalized submodules as private graphs (:mod:`~coreai_torch.importer.externalized`)
and custom Metal kernels (:mod:`~coreai_torch.importer.metal`).
"""
