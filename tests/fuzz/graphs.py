"""Random small PyTorch programs for property-based testing of the converter.

A :class:`Program` is a list of :class:`Step`s over a pool of tensors: the inputs first, then
one new tensor per step.  :func:`programs` is a ``hypothesis`` strategy that builds programs
step by step, running each candidate op eagerly on example inputs so that every step is valid
(shapes, dtypes, no empty tensors).  :class:`FuzzModule` replays a program as an ``nn.Module``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import strategies as st


@dataclass(frozen=True)
class Step:
    """``pool.append(OPS[op](pool[a] for a in args, **params))``."""

    op: str
    args: tuple[int, ...]
    params: tuple[tuple[str, Any], ...] = ()

    def __str__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.params)
        args = ", ".join(f"t{a}" for a in self.args)
        return f"{self.op}({args}{', ' if params and args else ''}{params})"


@dataclass(frozen=True)
class Program:
    """Inputs (shape, dtype), steps, and the pool indices returned."""

    inputs: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    steps: tuple[Step, ...]
    outputs: tuple[int, ...]
    seed: int = 0
    #: per-program value scale of the inputs
    extra: tuple[tuple[str, Any], ...] = field(default=())

    def __str__(self) -> str:
        n = len(self.inputs)
        lines = [f"t{i}: input {tuple(s)} {d}" for i, (s, d) in enumerate(self.inputs)]
        lines += [f"t{n + k} = {step}" for k, step in enumerate(self.steps)]
        lines.append("return " + ", ".join(f"t{i}" for i in self.outputs))
        return "\n".join(lines)

    @property
    def uses_half(self) -> bool:
        """Whether float16 values occur (compared with a looser tolerance)."""
        return any(d == torch.float16 for _, d in self.inputs) or any(
            s.op == "to_half" for s in self.steps
        )

    def example_inputs(self) -> tuple[torch.Tensor, ...]:
        gen = torch.Generator().manual_seed(self.seed)
        out = []
        for shape, dtype in self.inputs:
            if dtype.is_floating_point:
                out.append((torch.rand(shape, generator=gen) * 4 - 2).to(dtype))
            else:
                out.append(torch.randint(-9, 10, shape, generator=gen).to(dtype))
        return tuple(out)


def _weight(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=gen) - 0.5


# ---------------------------------------------------------------------------------- ops ----
# Each op: fn(module, step_index, *tensors, **params) -> tensor.  Ops that need weights create
# them in FuzzModule.__init__ from ``weights(step_index, tensors, params)``.

Op = Callable[..., torch.Tensor]
OPS: dict[str, Op] = {}
WEIGHTS: dict[str, Callable[..., dict[str, torch.Tensor]]] = {}


def op(name: str, weights: Callable[..., dict[str, torch.Tensor]] | None = None):
    def register(fn: Op) -> Op:
        OPS[name] = fn
        if weights is not None:
            WEIGHTS[name] = weights
        return fn

    return register


for _name, _fn in {
    "neg": torch.neg,
    "abs": torch.abs,
    "relu": torch.relu,
    "exp": torch.exp,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "sin": torch.sin,
    "cos": torch.cos,
    "sqrt": torch.sqrt,
    "log": torch.log,
    "rsqrt": torch.rsqrt,
    "square": torch.square,
    "gelu": F.gelu,
    "silu": F.silu,
    "floor": torch.floor,
    "round": torch.round,
    "sign": torch.sign,
    "reciprocal": torch.reciprocal,
}.items():
    op(_name)(lambda m, i, x, _fn=_fn: _fn(x))

op("clamp")(lambda m, i, x, lo, hi: torch.clamp(x, lo, hi))
op("add")(lambda m, i, x, y: x + y)
op("sub")(lambda m, i, x, y: x - y)
op("mul")(lambda m, i, x, y: x * y)
op("div")(lambda m, i, x, y: x / y)
op("maximum")(lambda m, i, x, y: torch.maximum(x, y))
op("minimum")(lambda m, i, x, y: torch.minimum(x, y))
op("where_gt")(lambda m, i, x, y: torch.where(x > y, x, y))
op("add_scalar")(lambda m, i, x, c: x + c)
op("mul_scalar")(lambda m, i, x, c: x * c)
op("rsub_scalar")(lambda m, i, x, c: c - x)
op("floordiv_scalar")(lambda m, i, x, c: x // c)
op("remainder_scalar")(lambda m, i, x, c: x % c)
op("pow_scalar")(lambda m, i, x, c: x**c)
op("sum")(lambda m, i, x, dim, keepdim: x.sum(dim, keepdim=keepdim))
op("mean")(lambda m, i, x, dim, keepdim: x.mean(dim, keepdim=keepdim))
op("amax")(lambda m, i, x, dim, keepdim: x.amax(dim, keepdim=keepdim))
op("amin")(lambda m, i, x, dim, keepdim: x.amin(dim, keepdim=keepdim))
op("argmax")(lambda m, i, x, dim, keepdim: x.argmax(dim, keepdim=keepdim))
op("sum_all")(lambda m, i, x: x.sum())
op("softmax")(lambda m, i, x, dim: torch.softmax(x, dim))
op("log_softmax")(lambda m, i, x, dim: torch.log_softmax(x, dim))
op("cumsum")(lambda m, i, x, dim: torch.cumsum(x, dim))
op("flatten")(lambda m, i, x, start: torch.flatten(x, start))
op("reshape")(lambda m, i, x, shape: x.reshape(shape))
op("permute")(lambda m, i, x, perm: x.permute(perm))
op("transpose")(lambda m, i, x, a, b: x.transpose(a, b))
op("slice")(
    lambda m, i, x, dim, start, stop, step: x[(slice(None),) * dim + (slice(start, stop, step),)]
)
op("select")(lambda m, i, x, dim, index: x.select(dim, index))
op("unsqueeze")(lambda m, i, x, dim: x.unsqueeze(dim))
op("squeeze")(lambda m, i, x, dim: x.squeeze(dim))
op("flip")(lambda m, i, x, dim: torch.flip(x, (dim,)))
op("cat")(lambda m, i, x, y, dim: torch.cat([x, y], dim))
op("expand")(lambda m, i, x, shape: x.expand(shape))
op("repeat")(lambda m, i, x, reps: x.repeat(reps))
op("to_float")(lambda m, i, x: x.float())
op("to_int")(lambda m, i, x: x.to(torch.int64))
op("matmul_self")(lambda m, i, x: x @ x.transpose(-1, -2))
op("matmul", lambda x, k, seed: {"w": _weight((x.shape[-1], k), seed)})(
    lambda m, i, x, k, seed: x @ getattr(m, f"w{i}")
)
op(
    "linear",
    lambda x, k, seed: {"w": _weight((k, x.shape[-1]), seed), "b": _weight((k,), seed + 1)},
)(lambda m, i, x, k, seed: F.linear(x, getattr(m, f"w{i}"), getattr(m, f"b{i}")))
op(
    "layer_norm",
    lambda x, seed: {"w": _weight(x.shape[-1:], seed) + 1, "b": _weight(x.shape[-1:], seed + 1)},
)(lambda m, i, x, seed: F.layer_norm(x, x.shape[-1:], getattr(m, f"w{i}"), getattr(m, f"b{i}")))
op("add_const", lambda x, seed: {"c": _weight(tuple(x.shape[1:]), seed)})(
    lambda m, i, x, seed: x + getattr(m, f"c{i}")
)
op(
    "conv2d",
    lambda x, out, k, stride, padding, groups, bias, seed: {
        "w": _weight((out, x.shape[1] // groups, k, k), seed),
        **({"b": _weight((out,), seed + 1)} if bias else {}),
    },
)(
    lambda m, i, x, out, k, stride, padding, groups, bias, seed: F.conv2d(
        x, getattr(m, f"w{i}"), getattr(m, f"b{i}", None), stride, padding, 1, groups
    )
)
op("max_pool2d")(lambda m, i, x, k, stride, padding: F.max_pool2d(x, k, stride, padding))
op("avg_pool2d")(lambda m, i, x, k, stride, padding: F.avg_pool2d(x, k, stride, padding))
op("adaptive_avg_pool2d")(lambda m, i, x, size: F.adaptive_avg_pool2d(x, size))


for _name, _fn in {
    "leaky_relu": lambda x: F.leaky_relu(x, 0.1),
    "elu": F.elu,
    "softplus": F.softplus,
    "hardtanh": F.hardtanh,
    "erf": torch.erf,
    "logical_not": torch.logical_not,
}.items():
    op(_name)(lambda m, i, x, _fn=_fn: _fn(x))

_COMPARE = {
    "gt": torch.gt,
    "lt": torch.lt,
    "ge": torch.ge,
    "le": torch.le,
    "eq": torch.eq,
    "ne": torch.ne,
}
op("compare")(lambda m, i, x, y, how: _COMPARE[how](x, y))
op("compare_scalar")(lambda m, i, x, how, c: _COMPARE[how](x, c))
op("logical")(lambda m, i, x, y, how: getattr(torch, f"logical_{how}")(x, y))
op("any_all")(lambda m, i, x, dim, how: getattr(torch, how)(x, dim))
op("where_mask")(lambda m, i, c, x, y: torch.where(c, x, y))
op("logsumexp")(lambda m, i, x, dim: torch.logsumexp(x, dim))
op("var")(lambda m, i, x, dim, correction: torch.var(x, dim, correction=correction))
op("prod")(lambda m, i, x, dim: torch.prod(x, dim))
op("topk")(lambda m, i, x, dim, k, largest: torch.topk(x, k, dim, largest)[0])
op("sort")(lambda m, i, x, dim, descending: torch.sort(x, dim, descending, stable=True)[0])
op("max_dim")(lambda m, i, x, dim, which: torch.max(x, dim)[which])
op("pad")(lambda m, i, x, pads, mode: F.pad(x, pads, mode))
op("interpolate")(
    lambda m, i, x, mode, size: F.interpolate(
        x, size=size, mode=mode, align_corners=False if mode in ("linear", "bilinear") else None
    )
)
op("index_select", lambda x, dim, idx: {"i": torch.tensor(idx)})(
    lambda m, i, x, dim, idx: torch.index_select(x, dim, getattr(m, f"i{i}"))
)
op("embedding", lambda x, n, d, seed: {"w": _weight((n, d), seed)})(
    lambda m, i, x, n, d, seed: F.embedding(torch.remainder(x, n), getattr(m, f"w{i}"))
)
op(
    "batch_norm",
    lambda x, seed: {
        "mean": _weight((x.shape[1],), seed),
        "var": _weight((x.shape[1],), seed + 1) + 1,
        "w": _weight((x.shape[1],), seed + 2) + 1,
        "b": _weight((x.shape[1],), seed + 3),
    },
)(
    lambda m, i, x, seed: F.batch_norm(
        x, getattr(m, f"mean{i}"), getattr(m, f"var{i}"), getattr(m, f"w{i}"), getattr(m, f"b{i}")
    )
)
op("group_norm")(lambda m, i, x, groups: F.group_norm(x, groups))
op("to_half")(lambda m, i, x: x.half())


class FuzzModule(nn.Module):
    """Replays a :class:`Program`."""

    def __init__(self, program: Program) -> None:
        super().__init__()
        self.program = program
        pool = list(program.example_inputs())
        for k, step in enumerate(program.steps):
            i = len(program.inputs) + k
            params = dict(step.params)
            tensors = [pool[a] for a in step.args]
            if step.op in WEIGHTS:
                for name, w in WEIGHTS[step.op](*tensors, **params).items():
                    self.register_buffer(f"{name}{i}", w)
            with torch.no_grad():
                pool.append(OPS[step.op](self, i, *tensors, **params))

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        pool = list(inputs)
        for k, step in enumerate(self.program.steps):
            i = len(self.program.inputs) + k
            tensors = [pool[a] for a in step.args]
            pool.append(OPS[step.op](self, i, *tensors, **dict(step.params)))
        return tuple(pool[i] for i in self.program.outputs)


class BatchModule(nn.Module):
    """Several programs side by side in one module (one export and conversion for all)."""

    def __init__(self, programs: list[Program]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(FuzzModule(p) for p in programs)
        self.arity = [len(p.inputs) for p in programs]

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs: list[torch.Tensor] = []
        start = 0
        for part, n in zip(self.parts, self.arity, strict=True):
            outputs += part(*inputs[start : start + n])
            start += n
        return tuple(outputs)


# ----------------------------------------------------------------------------- strategy ----

FLOAT_UNARY = [
    "neg",
    "abs",
    "relu",
    "exp",
    "tanh",
    "sigmoid",
    "sin",
    "cos",
    "sqrt",
    "log",
    "rsqrt",
    "square",
    "gelu",
    "silu",
    "floor",
    "round",
    "sign",
    "reciprocal",
]
INT_UNARY = ["neg", "abs", "square", "sign"]
MAX_NUMEL = 512


def _candidates(x: torch.Tensor) -> list[str]:
    r = x.dim()
    if x.dtype == torch.bool:
        ops = ["logical_not", "logical", "to_float", "to_int", "where_mask", "cat", "repeat"]
        if r >= 1:
            ops += ["any_all", "slice", "flip", "unsqueeze", "permute", "reshape", "expand"]
        return ops
    is_float = x.dtype.is_floating_point
    ops = ["unary", "binary", "scalar", "add_scalar", "mul_scalar", "cat", "repeat"]
    ops += ["compare", "compare_scalar"]
    if r >= 1:
        ops += ["reduce", "cumsum", "slice", "flip", "unsqueeze", "permute", "reshape", "expand"]
        ops += ["select"] if r >= 2 else []
        ops += ["squeeze"] if 1 in x.shape else []
        ops += ["argmax", "sum_all", "sort", "topk", "max_dim", "index_select", "prod"]
    if r >= 2:
        ops += ["transpose", "flatten"]
    if x.dtype == torch.float16:
        return ops + ["to_float", "to_int"]
    if is_float:
        ops += ["clamp", "to_int", "pow_scalar", "activation", "to_half"]
        if r >= 1:
            ops += ["softmax", "log_softmax", "matmul", "linear", "layer_norm", "add_const"]
            ops += ["logsumexp", "var", "pad"]
        if r >= 2:
            ops += ["matmul_self", "batch_norm"]
        if r >= 3:
            ops += ["group_norm", "interpolate"]
        if r == 4:
            ops += ["conv2d", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d"]
    else:
        ops += ["to_float", "floordiv_scalar", "remainder_scalar", "embedding"]
    return ops


@st.composite
def _step(draw: st.DrawFn, pool: list[torch.Tensor], seed: int) -> Step:
    a = draw(st.integers(0, len(pool) - 1))
    x = pool[a]
    kind = draw(st.sampled_from(_candidates(x)))
    r = x.dim()
    dim = draw(st.integers(-r, r - 1)) if r else 0
    if kind == "unary":
        return Step(
            draw(st.sampled_from(FLOAT_UNARY if x.dtype.is_floating_point else INT_UNARY)), (a,)
        )
    if kind == "binary":
        same = [b for b, t in enumerate(pool) if t.dtype == x.dtype and _broadcastable(x, t)]
        b = draw(st.sampled_from(same))
        names = ["add", "sub", "mul", "maximum", "minimum", "where_gt"]
        names += ["div"] if x.dtype.is_floating_point else []
        return Step(draw(st.sampled_from(names)), (a, b))
    if kind == "scalar":
        kind = draw(st.sampled_from(["add_scalar", "mul_scalar", "rsub_scalar"]))
    if kind in ("add_scalar", "mul_scalar", "rsub_scalar"):
        c = draw(
            st.sampled_from([-1.5, 0.5, 2.0, 3.0] if x.dtype.is_floating_point else [-3, 2, 5])
        )
        return Step(kind, (a,), (("c", c),))
    if kind in ("floordiv_scalar", "remainder_scalar"):
        return Step(kind, (a,), (("c", draw(st.sampled_from([-3, 2, 4]))),))
    if kind == "pow_scalar":
        return Step(kind, (a,), (("c", draw(st.sampled_from([2, 3, 0.5, -1]))),))
    if kind == "clamp":
        lo = draw(st.sampled_from([-1.0, -0.5, 0.0]))
        return Step(kind, (a,), (("lo", lo), ("hi", lo + draw(st.sampled_from([0.5, 1.0, 2.0])))))
    if kind == "reduce":
        names = ["sum", "amax", "amin"] + (["mean"] if x.dtype.is_floating_point else [])
        return Step(
            draw(st.sampled_from(names)), (a,), (("dim", dim), ("keepdim", draw(st.booleans())))
        )
    if kind == "argmax":
        return Step(kind, (a,), (("dim", dim), ("keepdim", draw(st.booleans()))))
    if kind in ("softmax", "log_softmax", "cumsum", "flip", "squeeze"):
        if kind == "squeeze":
            dim = draw(st.sampled_from([d for d in range(r) if x.shape[d] == 1]))
        return Step(kind, (a,), (("dim", dim),))
    if kind == "unsqueeze":
        return Step(kind, (a,), (("dim", draw(st.integers(-r - 1, r))),))
    if kind == "slice":
        d = dim % r
        n = x.shape[d]
        start = draw(st.integers(-n, n - 1))
        stop = draw(st.sampled_from([None, n, start % n + 1 + draw(st.integers(0, n))]))
        step = draw(st.sampled_from([1, 1, 2, 3]))
        return Step(kind, (a,), (("dim", d), ("start", start), ("stop", stop), ("step", step)))
    if kind == "select":
        d = dim % r
        return Step(
            kind, (a,), (("dim", d), ("index", draw(st.integers(-x.shape[d], x.shape[d] - 1))))
        )
    if kind == "permute":
        return Step(kind, (a,), (("perm", tuple(draw(st.permutations(range(r))))),))
    if kind == "transpose":
        return Step(kind, (a,), (("a", dim), ("b", draw(st.integers(-r, r - 1)))))
    if kind == "flatten":
        return Step(kind, (a,), (("start", draw(st.integers(0, r - 1))),))
    if kind == "reshape":
        shape = list(draw(st.permutations(list(x.shape))))
        if len(shape) >= 2 and draw(st.booleans()):
            shape = [shape[0] * shape[1]] + shape[2:]
        if draw(st.booleans()):
            shape[draw(st.integers(0, len(shape) - 1))] = -1
        return Step(kind, (a,), (("shape", tuple(shape)),))
    if kind == "expand":
        shape = tuple(draw(st.sampled_from([2, 3])) if s == 1 else s for s in x.shape)
        if draw(st.booleans()):
            shape = (2, *shape)
        return Step(kind, (a,), (("shape", shape),))
    if kind == "repeat":
        reps = tuple(draw(st.integers(1, 2)) for _ in range(max(r, 1) + draw(st.integers(0, 1))))
        return Step(kind, (a,), (("reps", reps),))
    if kind == "cat":
        d = dim % r if r else 0
        same = [
            b
            for b, t in enumerate(pool)
            if t.dtype == x.dtype
            and t.dim() == r
            and r > 0
            and all(t.shape[i] == x.shape[i] for i in range(r) if i != d)
        ]
        b = draw(st.sampled_from(same or [a]))
        if r == 0:
            return Step("unsqueeze", (a,), (("dim", 0),))
        return Step(kind, (a, b), (("dim", d),))
    if kind in ("to_int", "to_float", "sum_all", "matmul_self"):
        return Step(kind, (a,))
    if kind in ("matmul", "linear"):
        return Step(kind, (a,), (("k", draw(st.integers(1, 6))), ("seed", seed)))
    if kind in ("layer_norm", "add_const"):
        return Step(kind, (a,), (("seed", seed),))
    if kind == "conv2d":
        c, h, w = x.shape[1], x.shape[2], x.shape[3]
        groups = draw(st.sampled_from([g for g in (1, 2, c) if c % g == 0]))
        out = groups * draw(st.integers(1, 3))
        padding = draw(st.integers(0, 1))
        k = draw(st.integers(1, max(1, min(3, h + 2 * padding, w + 2 * padding))))
        return Step(
            kind,
            (a,),
            (
                ("out", out),
                ("k", k),
                ("stride", draw(st.integers(1, 2))),
                ("padding", padding),
                ("groups", groups),
                ("bias", draw(st.booleans())),
                ("seed", seed),
            ),
        )
    if kind in ("max_pool2d", "avg_pool2d"):
        k = draw(st.integers(1, max(1, min(3, x.shape[2], x.shape[3]))))
        padding = draw(st.integers(0, k // 2))
        return Step(
            kind, (a,), (("k", k), ("stride", draw(st.integers(1, 2))), ("padding", padding))
        )
    if kind == "adaptive_avg_pool2d":
        return Step(kind, (a,), (("size", draw(st.sampled_from([1, (1, 2), 2]))),))
    if kind == "activation":
        names = ["leaky_relu", "elu", "softplus", "hardtanh", "erf"]
        return Step(draw(st.sampled_from(names)), (a,))
    if kind in ("logical_not", "to_half"):
        return Step(kind, (a,))
    if kind == "compare":
        same = [b for b, t in enumerate(pool) if t.dtype == x.dtype and _broadcastable(x, t)]
        return Step(
            kind,
            (a, draw(st.sampled_from(same))),
            (("how", draw(st.sampled_from(list(_COMPARE)))),),
        )
    if kind == "compare_scalar":
        c = draw(st.sampled_from([0.0, 0.5, -1.0] if x.dtype.is_floating_point else [0, 1, -2]))
        return Step(kind, (a,), (("how", draw(st.sampled_from(list(_COMPARE)))), ("c", c)))
    if kind == "logical":
        same = [b for b, t in enumerate(pool) if t.dtype == torch.bool and _broadcastable(x, t)]
        return Step(
            kind,
            (a, draw(st.sampled_from(same))),
            (("how", draw(st.sampled_from(["and", "or", "xor"]))),),
        )
    if kind == "any_all":
        return Step(kind, (a,), (("dim", dim), ("how", draw(st.sampled_from(["any", "all"])))))
    if kind == "where_mask":
        floats = [
            b for b, t in enumerate(pool) if t.dtype == torch.float32 and _broadcastable(x, t)
        ]
        if not floats:
            return Step("to_float", (a,))
        return Step(kind, (a, draw(st.sampled_from(floats)), draw(st.sampled_from(floats))))
    if kind in ("logsumexp", "prod"):
        return Step(kind, (a,), (("dim", dim),))
    if kind == "var":
        return Step(kind, (a,), (("dim", dim), ("correction", draw(st.sampled_from([0, 1])))))
    if kind == "topk":
        k = draw(st.integers(1, x.shape[dim]))
        return Step(kind, (a,), (("dim", dim), ("k", k), ("largest", draw(st.booleans()))))
    if kind == "sort":
        return Step(kind, (a,), (("dim", dim), ("descending", draw(st.booleans()))))
    if kind == "max_dim":
        return Step(kind, (a,), (("dim", dim), ("which", draw(st.integers(0, 1)))))
    if kind == "index_select":
        n = x.shape[dim]
        idx = tuple(draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=4)))
        return Step(kind, (a,), (("dim", dim % r), ("idx", idx)))
    if kind == "embedding":
        return Step(
            kind,
            (a,),
            (("n", draw(st.integers(2, 7))), ("d", draw(st.integers(1, 4))), ("seed", seed)),
        )
    if kind == "pad":
        mode = draw(
            st.sampled_from(["constant", "reflect", "replicate"] if 2 <= r <= 4 else ["constant"])
        )
        dims = 1 if mode == "constant" else min(r - 1, draw(st.integers(1, 2)))
        pads = []
        for d in range(dims):
            size = x.shape[r - 1 - d]
            top = size - 1 if mode == "reflect" else 2
            lo, hi = (-1 if mode == "constant" else 0), max(0, min(2, top))
            pair = [draw(st.integers(lo, hi)), draw(st.integers(lo, hi))]
            if -sum(min(0, p) for p in pair) >= size:
                # a crop that empties the dim before padding it again: known failure,
                # see KNOWN_FAILURES["pad_after_cropping_a_dim_to_nothing"] in test_fuzz.py
                pair = [max(0, p) for p in pair]
            pads += pair
        return Step(kind, (a,), (("pads", tuple(pads)), ("mode", mode)))
    if kind == "batch_norm":
        return Step(kind, (a,), (("seed", seed),))
    if kind == "group_norm":
        c = x.shape[1]
        return Step(
            kind, (a,), (("groups", draw(st.sampled_from([g for g in (1, 2, c) if c % g == 0]))),)
        )
    if kind == "interpolate":
        mode = draw(st.sampled_from(["nearest", "linear"] if r == 3 else ["nearest", "bilinear"]))
        size = tuple(draw(st.integers(1, 6)) for _ in range(r - 2))
        return Step(kind, (a,), (("mode", mode), ("size", size)))
    raise AssertionError(kind)


def _broadcastable(x: torch.Tensor, y: torch.Tensor) -> bool:
    try:
        torch.broadcast_shapes(x.shape, y.shape)
    except RuntimeError:
        return False
    return True


def _valid(t: Any) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and 0 < t.numel() <= MAX_NUMEL
        and t.dim() <= 5
        and (not t.dtype.is_floating_point or bool(torch.isfinite(t).all()))
    )


@st.composite
def programs(draw: st.DrawFn, max_steps: int = 6) -> Program:
    """A random valid program of 1..``max_steps`` steps over 1..2 inputs."""
    seed = draw(st.integers(0, 2**16))
    n_inputs = draw(st.integers(1, 2))
    rank = draw(st.integers(0, 4))
    base = tuple(draw(st.integers(1, 5)) for _ in range(rank))
    inputs = []
    for k in range(n_inputs):
        shape = base if k == 0 else tuple(s if draw(st.booleans()) else 1 for s in base)
        dtype = draw(st.sampled_from([torch.float32] * 6 + [torch.int64] * 2 + [torch.float16]))
        inputs.append((shape, dtype))
    program = Program(tuple(inputs), (), (0,), seed)
    module_pool = list(program.example_inputs())
    steps: list[Step] = []
    for k in range(draw(st.integers(1, max_steps))):
        step = draw(_step(module_pool, seed + k))
        trial = Program(program.inputs, (*steps, step), (0,), seed)
        try:
            result = FuzzModule(trial)
            value = _last(result, trial)
        except Exception:
            continue  # not valid for these shapes (e.g. a reshape that does not fit)
        if not _valid(value):
            continue
        steps.append(step)
        module_pool.append(value)
    # return every result nothing else uses, so that no step is dead code
    used = {a for step in steps for a in step.args}
    n_inputs = len(program.inputs)
    outputs = tuple(i for i in range(n_inputs, n_inputs + len(steps)) if i not in used)
    return Program(program.inputs, tuple(steps), outputs or (0,), seed)


def _last(module: FuzzModule, program: Program) -> torch.Tensor:
    with torch.no_grad():
        pool = list(program.example_inputs())
        for k, step in enumerate(program.steps):
            i = len(program.inputs) + k
            pool.append(OPS[step.op](module, i, *[pool[a] for a in step.args], **dict(step.params)))
    return pool[-1]
