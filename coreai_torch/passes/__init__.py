"""Rewrites of a converted program (the MLIR module and its ``WeightStore``).

Each pass is a module with one entry point, run by ``AIProgram.optimize()`` or by its own API.
A pass never reads the FX graph: data flows torch side → importer → program → passes → asset.
"""
