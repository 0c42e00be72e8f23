"""Hand-written RMSNorm and rotary embeddings fused into one node each, before import.

:func:`fuse_patterns` rewrites a decomposed program so that each chain it recognises becomes a
single node: ``aten.rms_norm`` for an RMSNorm and ``coreai_torch::rope`` (an op defined here,
with a PyTorch implementation computing the same ops in the same order) for a rotary
embedding.  The importer then lowers them like any node, one node to one lowering, as the
``rms_norm`` and ``rope`` composite ops.

Hugging Face decoders (Llama, Mistral, Qwen, Gemma, T5, ...) write RMSNorm with raw ops rather
than ``F.rms_norm``, so it reaches the converter as::

    pow(x, 2) -> mean(dims, keepdim=True) -> add(eps) -> rsqrt -> mul(x, .) [-> mul(weight, .)]

:func:`find_rms_norms` finds these chains in an FX graph; each becomes an ``aten.rms_norm``
node, lowered as the ``rms_norm`` composite op (:mod:`coreai_torch.lowerings.norm`).
A chain is only taken where ``aten.rms_norm`` computes exactly the same values:

- every value is float32 or float64, of one dtype (no casts inside the chain: for 16-bit
  inputs Hugging Face multiplies by the weight after casting back, ATen before);
- the exponent is 2, the mean is over the trailing dimensions with ``keepdim=True`` and no
  dtype, ``eps`` is a Python number;
- the weight (optional) has exactly the normalized shape and the input's dtype;
- every intermediate value is used only by the next op of the chain (and by
  ``_assert_tensor_metadata`` checks, which emit nothing).

Rotary position embeddings are written the same way by every Hugging Face decoder
(``apply_rotary_pos_emb`` with ``rotate_half``)::

    add(mul(x, cos), mul(cat([neg(x[..., h:]), x[..., :h]], -1), sin))      h = x.shape[-1] / 2

:func:`find_ropes` finds these chains; each becomes a ``coreai_torch::rope`` node, lowered as
the ``rope`` composite op (the one :class:`coreai_torch.composite_ops.RoPE` externalizes,
``interleaved = false``), whose body computes the same ops in the same order.  ``x``,
``cos``, ``sin`` and the result share one float dtype, ``x``'s last dim is static and even,
``cos``/``sin`` have ``x``'s last dim and broadcast to ``x`` (the result has ``x``'s shape),
and every intermediate value is used only by the next op of the chain.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.export import ExportedProgram

from coreai_torch.frontend.schema import bind_arguments

aten = torch.ops.aten

_FLOATS = (torch.float32, torch.float64)


@dataclass
class RMSNormMatch:
    """One hand-written RMSNorm: its input, weight, attributes and the nodes it replaces."""

    input: torch.fx.Node
    weight: torch.fx.Node | None
    normalized_shape: list[int]
    eps: float
    #: the chain's other nodes (and the metadata checks on them), not lowered on their own
    absorbed: list[torch.fx.Node] = field(default_factory=list)


def _is_assert(node: torch.fx.Node) -> bool:
    return node.target is aten._assert_tensor_metadata.default


def _only_user(node: torch.fx.Node) -> torch.fx.Node | None:
    """The single user of ``node`` besides metadata checks, else None."""
    users = [u for u in node.users if not _is_assert(u)]
    return users[0] if len(users) == 1 else None


def _dtype(node: object) -> torch.dtype | None:
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return val.dtype if isinstance(val, torch.Tensor) else None


def _other(node: torch.fx.Node, known: torch.fx.Node) -> object:
    """The argument of binary ``node`` that is not ``known`` (None if neither is)."""
    a, b = node.args[:2]
    return b if a is known else a if b is known else None


def _normalized_dims(mean: torch.fx.Node, rank: int) -> int | None:
    """How many trailing dimensions ``mean`` reduces (with keepdim=True), else None."""
    if mean.target is not aten.mean.dim:
        return None
    args = bind_arguments(mean)
    if not args["keepdim"] or not args["dim"] or args["dtype"] is not None:
        return None
    normalized = sorted(d % rank for d in args["dim"])
    if normalized != list(range(rank - len(normalized), rank)):
        return None
    return len(normalized)


def _eps(add: torch.fx.Node, mean: torch.fx.Node) -> float | None:
    if add.target not in (aten.add.Tensor, aten.add.Scalar) or bind_arguments(add)["alpha"] != 1:
        return None
    eps = _other(add, mean)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        return None
    return float(eps)


def _match(
    pow_node: torch.fx.Node, usable: Callable[[torch.fx.Node], bool]
) -> tuple[torch.fx.Node, RMSNormMatch] | None:
    """The chain starting at ``pow(x, 2)``: (its last node, the match), else None."""
    if len(pow_node.args) < 2 or pow_node.args[1] != 2 or isinstance(pow_node.args[1], bool):
        return None
    x = pow_node.args[0]
    if not isinstance(x, torch.fx.Node):
        return None
    val = x.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype not in _FLOATS or val.dim() == 0:
        return None
    mean = _only_user(pow_node)
    add = _only_user(mean) if mean is not None else None
    rsqrt = _only_user(add) if add is not None else None
    scaled = _only_user(rsqrt) if rsqrt is not None else None
    if mean is None or add is None or rsqrt is None or scaled is None:
        return None
    if rsqrt.target is not aten.rsqrt.default:
        return None
    count = _normalized_dims(mean, val.dim())
    eps = _eps(add, mean)
    if count is None or eps is None:
        return None
    if scaled.target is not aten.mul.Tensor or _other(scaled, rsqrt) is not x:
        return None
    chain = [pow_node, mean, add, rsqrt, scaled]
    if any(_dtype(n) != val.dtype or not usable(n) for n in chain):
        return None
    shape = val.shape[val.dim() - count :]
    if not all(isinstance(d, int) for d in shape):
        return None
    normalized_shape = [int(d) for d in shape]
    last, weight = scaled, None
    scale = _only_user(scaled)
    if scale is not None and scale.target is aten.mul.Tensor and usable(scale):
        candidate = _other(scale, scaled)
        wval = candidate.meta.get("val") if isinstance(candidate, torch.fx.Node) else None
        if (
            isinstance(candidate, torch.fx.Node)
            and candidate not in chain
            and isinstance(wval, torch.Tensor)
            and wval.dtype == val.dtype
            and list(wval.shape) == normalized_shape
            and _dtype(scale) == val.dtype
        ):
            last, weight = scale, candidate
    absorbed = [n for n in chain if n is not last]
    absorbed += [u for n in absorbed for u in n.users if _is_assert(u)]
    return last, RMSNormMatch(x, weight, normalized_shape, eps, absorbed)


def find_rms_norms(
    graph: torch.fx.Graph, usable: Callable[[torch.fx.Node], bool]
) -> dict[torch.fx.Node, RMSNormMatch]:
    """Hand-written RMSNorms of ``graph``, by the node whose value each one computes.

    ``usable(node)`` says whether a node may be absorbed (e.g. not when the user registered
    their own lowering for its op, or when it is folded at conversion time).
    """
    found: dict[torch.fx.Node, RMSNormMatch] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is aten.pow.Tensor_Scalar:
            match = _match(node, usable)
            if match is not None:
                found[match[0]] = match[1]
    return found


# --------------------------------------------------------------------------------- RoPE ---


@dataclass
class RoPEMatch:
    """One hand-written rotary embedding: its input, ``cos``/``sin`` and absorbed nodes."""

    input: torch.fx.Node
    cos: torch.fx.Node
    sin: torch.fx.Node
    #: the chain's other nodes (and the metadata checks on them), not lowered on their own
    absorbed: list[torch.fx.Node] = field(default_factory=list)


def _shape(node: object) -> list[str] | None:
    """The node's shape with symbolic dims as text (compared without guards)."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return [str(d) for d in val.shape] if isinstance(val, torch.Tensor) else None


def _last_dim_slice(node: object, source: torch.fx.Node, rank: int) -> tuple[int, int] | None:
    """(start, end) when ``node`` is ``source[..., start:end]`` with step 1, else None."""
    if not isinstance(node, torch.fx.Node) or node.target is not aten.slice.Tensor:
        return None
    args = bind_arguments(node)
    if args["self"] is not source or args["step"] != 1 or args["dim"] % rank != rank - 1:
        return None
    start, end = args["start"], args["end"]
    if not isinstance(start, int) or not isinstance(end, int):
        return None
    return start, end


def _rope_match(
    cat: torch.fx.Node, usable: Callable[[torch.fx.Node], bool]
) -> tuple[torch.fx.Node, RoPEMatch] | None:
    """The chain around ``cat([neg(x[..., h:]), x[..., :h]], -1)``: (its add, the match)."""
    parts, dim = bind_arguments(cat)["tensors"], bind_arguments(cat)["dim"]
    if len(parts) != 2 or not all(isinstance(p, torch.fx.Node) for p in parts):
        return None
    neg, first = parts
    if neg.target is not aten.neg.default:
        return None
    second = neg.args[0]
    x = first.args[0] if first.target is aten.slice.Tensor else None
    if not isinstance(x, torch.fx.Node):
        return None
    val = x.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype not in (*_FLOATS, torch.float16):
        return None
    rank, width = val.dim(), val.shape[-1] if val.dim() else None
    if not isinstance(width, int) or width % 2 or dim % rank != rank - 1:
        return None
    half = width // 2
    if _last_dim_slice(first, x, rank) != (0, half):
        return None
    rest = _last_dim_slice(second, x, rank)
    if rest is None or rest[0] != half or rest[1] < width:
        return None
    times_sin = _only_user(cat)
    add = _only_user(times_sin) if times_sin is not None else None
    if times_sin is None or add is None or times_sin.target is not aten.mul.Tensor:
        return None
    if add.target is not aten.add.Tensor or bind_arguments(add)["alpha"] != 1:
        return None
    times_cos = _other(add, times_sin)
    if not isinstance(times_cos, torch.fx.Node) or times_cos.target is not aten.mul.Tensor:
        return None
    sin, cos = _other(times_sin, cat), _other(times_cos, x)
    if not isinstance(sin, torch.fx.Node) or not isinstance(cos, torch.fx.Node):
        return None
    chain = [first, second, neg, cat, times_sin, times_cos, add]
    if any(_only_user(n) is None for n in chain[:-1]) or not all(usable(n) for n in chain):
        return None
    if any(_dtype(n) != val.dtype for n in [*chain, cos, sin]):
        return None
    shape, cos_shape = _shape(x), _shape(cos)
    if shape is None or cos_shape is None:
        return None
    if _shape(add) != shape or cos_shape != _shape(sin) or cos_shape[-1] != shape[-1]:
        return None
    absorbed = chain[:-1] + [u for n in chain[:-1] for u in n.users if _is_assert(u)]
    return add, RoPEMatch(x, cos, sin, absorbed)


def find_ropes(
    graph: torch.fx.Graph, usable: Callable[[torch.fx.Node], bool]
) -> dict[torch.fx.Node, RoPEMatch]:
    """Hand-written rotary embeddings of ``graph``, by the node whose value each computes
    (``usable`` as for :func:`find_rms_norms`)."""
    found: dict[torch.fx.Node, RoPEMatch] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is aten.cat.default:
            match = _rope_match(node, usable)
            if match is not None:
                found[match[0]] = match[1]
    return found


# ------------------------------------------------------------------------------- fusion ---


@torch.library.custom_op("coreai_torch::rope", mutates_args=())
def rope(input: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """A rotary embedding, ``interleaved = false``: ``input * cos + rotate_half(input) * sin``
    with the ops in Hugging Face's order (what :func:`find_ropes` replaces)."""
    half = input.shape[-1] // 2
    rotated = torch.cat([-input[..., half:], input[..., :half]], dim=-1)
    return input * cos + rotated * sin


@rope.register_fake
def _rope_fake(input: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(input)


#: the ops :func:`fuse_patterns` creates (conversion-time folding may evaluate them too)
FUSED_OPS = (aten.rms_norm.default, torch.ops.coreai_torch.rope.default)


def _fuse(
    last: torch.fx.Node,
    target: Any,
    args: tuple,
    absorbed: list[torch.fx.Node],
    order: dict[torch.fx.Node, int],
) -> None:
    """Make ``last`` compute the whole chain as ``target(*args)`` and erase the chain's other
    nodes, users first (``order``: the nodes' positions in the graph)."""
    last.target = target
    last.args = args
    last.kwargs = {}
    for node in sorted(absorbed, key=order.__getitem__, reverse=True):
        last.graph.erase_node(node)


def fuse_patterns(
    ep: ExportedProgram, usable: Callable[[torch.fx.Node], bool] = lambda node: True
) -> ExportedProgram:
    """``ep`` with its hand-written RMSNorms and rotary embeddings fused (a new program
    sharing ``ep``'s weights; ``ep`` itself when there is nothing to fuse).

    ``usable(node)`` says whether a node may be absorbed (False where the user registered
    their own lowering for its op).  Only the top-level graph is rewritten.
    """
    rms_norms = find_rms_norms(ep.graph, usable)
    ropes = find_ropes(ep.graph, usable)
    if not rms_norms and not ropes:
        return ep
    graph = torch.fx.Graph()
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    output = graph.graph_copy(ep.graph, copies)
    graph.output(output, type_expr=ep.graph.output_node().type)
    order = {node: i for i, node in enumerate(graph.nodes)}
    for last, match in rms_norms.items():
        weight = copies[match.weight] if match.weight is not None else None
        args = (copies[match.input], match.normalized_shape, weight, match.eps)
        absorbed = [copies[n] for n in match.absorbed]
        _fuse(copies[last], aten.rms_norm.default, args, absorbed, order)
    for last, rope in ropes.items():
        rope_args = (copies[rope.input], copies[rope.cos], copies[rope.sin])
        absorbed = [copies[n] for n in rope.absorbed]
        _fuse(copies[last], torch.ops.coreai_torch.rope.default, rope_args, absorbed, order)
    return ExportedProgram(
        root=ep.graph_module,  # its sub-graphs (control flow) are the new program's too
        graph=graph,
        graph_signature=ep.graph_signature,
        state_dict=ep.state_dict,
        range_constraints=ep.range_constraints,
        module_call_graph=ep.module_call_graph,
        constants=ep.constants,
        verifiers=ep.verifiers,
    )
