"""Torch tensors whose data lives elsewhere: lazy tensors read from a checkpoint (``lazy``).

Below both the frontend and the IR: tracing reads their shapes, compression and saving read
their data.  No Core AI IR here.
"""
