"""Weights as zero-copy resource constants.

A parameter, buffer or lifted constant becomes a ``coreai.constant dense_resource<name>``
whose blob *is* the tensor's memory (``DenseResourceElementsAttr.get_from_buffer``): nothing is
copied at conversion time.  The tensors must stay alive and unmodified until the program is
saved; the MLIR context keeps a reference to each buffer.

One :class:`WeightStore` serves every graph of a program, so a tensor used by several entry
points (e.g. prefill and decode) is stored once.  It stays with the program, so that
``AIProgram.optimize()`` can store a weight transposed (:meth:`WeightStore.transposed`).
"""

from __future__ import annotations

import re

import numpy as np
import torch

from coreai_torch import dtypes
from coreai_torch._mlir import cai, ir

#: Tensors with fewer elements than this are emitted inline (``dense<...>``) so the compiler
#: can fold them; larger ones are zero-copy resources.
INLINE_LIMIT = 64


def _buffer(tensor: torch.Tensor) -> np.ndarray:
    """A C-contiguous numpy view of the tensor's memory (a copy only if it is strided)."""
    t = tensor.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy()
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return t.view(torch.uint8).numpy()
    return t.numpy()


class WeightStore:
    """Creates (and shares) the resource attributes of a program's weights."""

    def __init__(self) -> None:
        self._attrs: dict[tuple, ir.Attribute] = {}
        self._names: set[str] = set()
        #: every tensor handed in stays alive while the store lives: keys are addresses
        self._tensors: list[torch.Tensor] = []
        #: resource name -> the tensor it holds
        self.by_name: dict[str, torch.Tensor] = {}
        self.total_bytes = 0
        #: resource name -> the buffer of a derived constant (see :meth:`derived`)
        self.derived_by_name: dict[str, np.ndarray] = {}
        self.derived_bytes = 0

    @staticmethod
    def _key(tensor: torch.Tensor) -> tuple:
        return (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.dtype,
        )

    def _unique_name(self, name: str) -> str:
        name = re.sub(r"[^A-Za-z0-9_.]", "_", name) or "weight"
        candidate, k = name, 1
        while candidate in self._names:
            candidate = f"{name}_{k}"
            k += 1
        self._names.add(candidate)
        return candidate

    def constant(self, tensor: torch.Tensor, name: str) -> ir.Value:
        """A ``coreai.constant`` holding ``tensor`` (inline when tiny, zero-copy otherwise)."""
        if tensor.is_sparse or tensor.device.type != "cpu":
            tensor = tensor.to_dense().cpu() if tensor.is_sparse else tensor.cpu()
        ttype = dtypes.tensor_type(list(tensor.shape), tensor.dtype)
        if tensor.numel() < INLINE_LIMIT:
            if tensor.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
                return cai.constant(tensor.detach().float().numpy(), dtype=ttype.element_type)
            return cai.constant(tensor.detach().numpy().copy(), dtype=ttype.element_type)
        key = self._key(tensor)
        attr = self._attrs.get(key)
        if attr is None:
            self._tensors.append(tensor)
            attr = self._resource(tensor, name)
            self._attrs[key] = attr
            self.total_bytes += tensor.numel() * tensor.element_size()
        return cai.ConstantOp(value=attr).result

    def _resource(self, tensor: torch.Tensor, name: str) -> ir.Attribute:
        ttype = dtypes.tensor_type(list(tensor.shape), tensor.dtype)
        unique = self._unique_name(name)
        self.by_name[unique] = tensor
        return ir.DenseResourceElementsAttr.get_from_buffer(_buffer(tensor), unique, ttype)

    def transposed(self, name: str, perm: tuple[int, ...]) -> ir.Attribute | None:
        """A new resource holding weight ``name`` permuted by ``perm`` (one copy, made now),
        named ``<name>.T``; None if ``name`` is not a weight of this store."""
        tensor = self.by_name.get(name)
        if tensor is None or len(perm) != tensor.dim():
            return None
        copy = tensor.detach().permute(perm).contiguous()
        self._tensors.append(copy)
        return self._resource(copy, f"{name}.T")

    def derived(
        self, data: np.ndarray, name: str, tensor_type: ir.RankedTensorType
    ) -> ir.Attribute:
        """A resource of ``tensor_type`` over the bytes of ``data``, a buffer computed from
        weights at conversion time (bit-packed codes, scales, palettes), for
        ``coreai.constant`` ops (any number of them, in any graph of the program).

        ``data`` is kept alive (not copied) and must hold exactly the bytes the type needs:
        ``ceil(elements * bits / 8)``, sub-byte types bit-packed.  Derived constants are not
        :attr:`by_name` weights: passes that re-lay weights (``pretranspose``) leave them alone.
        """
        element = tensor_type.element_type
        bits = (
            ir.IntegerType(element).width
            if ir.IntegerType.isinstance(element)
            else ir.FloatType(element).width
        )
        numel = int(np.prod(tensor_type.shape, dtype=np.int64))
        expected = -(-numel * bits // 8)
        buffer = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        if buffer.size != expected:
            raise ValueError(
                f"derived constant '{name}' of type {tensor_type} needs {expected} bytes, got "
                f"{buffer.size}"
            )
        unique = self._unique_name(name)
        self.derived_by_name[unique] = buffer
        self.derived_bytes += buffer.size
        return ir.DenseResourceElementsAttr.get_from_buffer(buffer, unique, tensor_type)
