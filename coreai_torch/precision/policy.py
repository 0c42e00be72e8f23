"""The precision policy: which dtype a program computes in, and what stays in float32.

A :class:`Precision` says

* ``compute``: the dtype activations are computed in and floating weights are stored in
  (``torch.float16``, ``torch.bfloat16``, or ``torch.float32`` for the program as exported);
* ``io_dtype``: the dtype of the program's floating-point inputs and outputs (``None`` keeps
  the exported program's own dtypes, with casts at the edges);
* which nodes stay in float32: the default *fp32 islands* (``fp32_islands=True``) plus the
  nodes the user selects by op (``keep_fp32_ops``), by module path or class
  (``keep_fp32_modules``) or by a predicate on the FX node (``keep_fp32``);
* ``fp32_accumulation``: whether products of 16-bit operands (matmuls, linear layers,
  attention) accumulate in float32 and round once, as in ATen
  (:mod:`coreai_torch.lowerings.helpers.accumulation`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.fx

from coreai_torch.locations import clean_module_path, qualified_name

aten = torch.ops.aten

HALF_DTYPES = (torch.float16, torch.bfloat16)

#: ATen ops that compute in float32 by default in a half-precision program: what overflows or
#: loses too much in 16 bits (softmax, exponentials and powers of unbounded inputs, sums,
#: means and variances, cumulative sums and products).  The reductions inside composite
#: norms (layer/group/batch/RMS norm) and attention already run in float32 in their lowerings.
DEFAULT_FP32_OPS: frozenset[str] = frozenset(
    qualified_name(op)
    for op in (
        aten._softmax.default,
        aten._log_softmax.default,
        aten._safe_softmax.default,
        aten.exp.default,
        aten.exp2.default,
        aten.expm1.default,
        aten.log.default,
        aten.log2.default,
        aten.log10.default,
        aten.log1p.default,
        aten.logsumexp.default,
        aten.logaddexp.default,
        aten.logcumsumexp.default,
        aten.pow.Tensor_Scalar,
        aten.pow.Tensor_Tensor,
        aten.pow.Scalar,
        aten.cumsum.default,
        aten.cumprod.default,
        aten.sum.default,
        aten.sum.dim_IntList,
        aten.mean.default,
        aten.mean.dim,
        aten.var.correction,
        aten.var_mean.correction,
        aten.std.correction,
        aten.prod.default,
        aten.prod.dim_int,
        aten.linalg_vector_norm.default,
    )
)

#: modules that compute in float32 by default (qualified class names): the mixture-of-experts
#: routers :func:`coreai_torch.rewrite_moe` puts in.  Router logits rounded to 16 bits tie
#: (bfloat16 keeps 8 significant bits), and a tie picks another expert than float32 would:
#: a different expert's output, not a rounding error.  The router is a small matmul.
DEFAULT_FP32_MODULES: tuple[str, ...] = tuple(
    f"coreai_torch.rewrites.moe.{name}"
    for name in ("SoftmaxTopKRouter", "TopKSoftmaxRouter", "GroupLimitedRouter")
)

#: sums over at least this many elements (or a dynamic number) are fp32 islands
LARGE_SUM = 64
_SUMS = frozenset(qualified_name(op) for op in (aten.sum.default, aten.sum.dim_IntList))


def _summed_elements(node: torch.fx.Node) -> float:
    """How many elements each result of a ``sum`` node adds up (inf when dynamic)."""
    source = node.args[0] if node.args else None
    val = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return float("inf")
    # sum.dim_IntList(self, dim, ...): the summed dims, all of them when absent or empty
    given = cast("Sequence[int] | None", node.args[1] if len(node.args) > 1 else None)
    dims = given if given else range(val.dim())
    count = 1
    for d in dims:
        size = val.shape[d]
        if not isinstance(size, int):
            return float("inf")
        count *= size
    return count


_NAMES = {
    torch.float16: ("fp16", "float16", "half", "f16"),
    torch.bfloat16: ("bf16", "bfloat16", "b16"),
    torch.float32: ("fp32", "float32", "float", "f32"),
}
_BY_NAME = {name: dtype for dtype, names in _NAMES.items() for name in names}

ModuleSelector = str | type
NodePredicate = Callable[[torch.fx.Node], bool]


def _check_dtype(value: object, what: str, allow_none: bool = False) -> torch.dtype | None:
    if value is None and allow_none:
        return None
    if isinstance(value, str):
        value = _BY_NAME.get(value.lower(), value)
    if value not in (*HALF_DTYPES, torch.float32):
        allowed = "torch.float16, torch.bfloat16, torch.float32" + (
            " or None" if allow_none else ""
        )
        raise ValueError(
            f"{what} must be one of {allowed} (or 'fp16'/'bf16'/'fp32'), got {value!r}"
        )
    return value


def _op_names(ops: Iterable[object]) -> frozenset[str]:
    if isinstance(ops, str):
        raise TypeError(
            f"keep_fp32_ops must be a collection of op names, got the string {ops!r}; "
            f"use {{{ops!r}}}"
        )
    names = set()
    for op in ops:
        if isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            names.add(qualified_name(op))
        elif isinstance(op, str) and "::" in op:
            names.add(op)
        else:
            raise TypeError(
                f"keep_fp32_ops entries are qualified ATen op names such as "
                f"'aten::mm.default' or 'aten::mm' (every overload), or torch.ops.aten "
                f"ops; got {op!r}"
            )
    return frozenset(names)


def _modules(selectors: Iterable[object]) -> tuple[ModuleSelector, ...]:
    if isinstance(selectors, (str, type)):
        selectors = [selectors]
    result: list[ModuleSelector] = []
    for item in selectors:
        if (isinstance(item, type) and issubclass(item, torch.nn.Module)) or (
            isinstance(item, str) and item
        ):
            result.append(item)
        else:
            raise TypeError(
                "keep_fp32_modules entries are module paths (e.g. 'lm_head', "
                "'model.layers.0.mlp', globs like 'model.layers.*.mlp'), class names "
                f"(e.g. 'LlamaRMSNorm') or nn.Module subclasses; got {item!r}"
            )
    return tuple(result)


@dataclass(frozen=True)
class Precision:
    """What a converted program computes in (see the module docstring)."""

    compute: torch.dtype = torch.float32
    io_dtype: torch.dtype | None = None
    keep_fp32_ops: frozenset[str] = field(default_factory=frozenset)
    keep_fp32_modules: tuple[ModuleSelector, ...] = ()
    keep_fp32: NodePredicate | None = None
    fp32_islands: bool = True
    fp32_accumulation: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "compute", _check_dtype(self.compute, "compute_precision"))
        object.__setattr__(self, "io_dtype", _check_dtype(self.io_dtype, "io_dtype", True))
        object.__setattr__(self, "keep_fp32_ops", _op_names(self.keep_fp32_ops))
        object.__setattr__(self, "keep_fp32_modules", _modules(self.keep_fp32_modules))
        if self.keep_fp32 is not None and not callable(self.keep_fp32):
            raise TypeError(
                f"keep_fp32 must be a function of the FX node returning bool, got "
                f"{self.keep_fp32!r}"
            )
        for name in ("fp32_islands", "fp32_accumulation"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def is_half(self) -> bool:
        """Whether the program computes in a 16-bit float type."""
        return self.compute in HALF_DTYPES

    @property
    def name(self) -> str:
        """``fp16``, ``bf16`` or ``fp32``."""
        return _NAMES[self.compute][0]

    def selects(self, node: torch.fx.Node) -> bool:
        """Whether the user's selectors keep ``node`` in float32."""
        key = qualified_name(node.target)
        if key in self.keep_fp32_ops or key.rsplit(".", 1)[0] in self.keep_fp32_ops:
            return True
        if self.keep_fp32_modules and in_modules(node, self.keep_fp32_modules):
            return True
        return bool(self.keep_fp32 is not None and self.keep_fp32(node))

    def is_default_island(self, node: torch.fx.Node) -> bool:
        """Whether ``node`` is one of the default fp32 islands (when they are on): an op of
        :data:`DEFAULT_FP32_OPS`, sums only over :data:`LARGE_SUM` elements or more (16-bit
        sums accumulate in float32 anyway; a large one can overflow its 16-bit result), and
        everything inside the modules of :data:`DEFAULT_FP32_MODULES`."""
        if not self.fp32_islands:
            return False
        if in_modules(node, DEFAULT_FP32_MODULES):
            return True
        key = qualified_name(node.target)
        if key not in DEFAULT_FP32_OPS:
            return False
        return key not in _SUMS or _summed_elements(node) >= LARGE_SUM


def in_modules(node: torch.fx.Node, selectors: tuple[ModuleSelector, ...]) -> bool:
    """Whether ``node`` was traced inside a module that one of ``selectors`` names."""
    for path, cls in (node.meta.get("nn_module_stack") or {}).values():
        path = clean_module_path(str(path))
        cls_name = cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"
        short = cls_name.rsplit(".", 1)[-1]
        for selector in selectors:
            if isinstance(selector, type):
                if cls_name == f"{selector.__module__}.{selector.__qualname__}":
                    return True
            elif (
                path == selector
                or path.endswith("." + selector)
                or fnmatch.fnmatchcase(path, selector)
                or selector in (short, cls_name)
            ):
                return True
    return False


FP32 = Precision()


def from_spec(spec: object) -> Precision:
    """A :class:`Precision` from ``"fp16"`` / ``"bf16"`` / ``"fp32"`` (also ``"float16"``,
    ``"half"``, ``"bfloat16"``, ``"float32"``), a torch dtype, a ``Precision`` (returned as is)
    or ``None`` (float32)."""
    if spec is None:
        return FP32
    if isinstance(spec, Precision):
        return spec
    if isinstance(spec, str) and spec.lower() not in _BY_NAME:
        names = ", ".join(repr(n) for n in ("fp16", "bf16", "fp32"))
        raise ValueError(f"unknown precision {spec!r}; use one of {names}")
    return Precision(spec)  # type: ignore[arg-type]
