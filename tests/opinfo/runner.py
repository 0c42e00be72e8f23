"""Run OpInfo samples through export -> decomposition -> conversion -> Core AI runtime.

This module does the work inside a sweep worker process (see ``pool.py``).  The samples of an
entry are exported together as one module (one output per sample) because ``torch.export``
plus ``run_decompositions`` cost about a second each whatever the graph size; when the
batch fails, the failure is attributed to the samples whose outputs depend on the failing
node, and the others are retried.

The runtime part (compile + call) runs in a forked child, so a runtime abort (SIGILL/SIGABRT)
only kills that child and is reported as the failure of the samples in it.  The worker
never initialises the runtime itself, which keeps forking safe.
"""

from __future__ import annotations

import copy
import linecache
import os
import pickle
import re
import select
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from coreai_torch import TorchConverter, get_decomp_table
from coreai_torch.errors import RuntimeHazardError, UnsupportedOpError
from coreai_torch.lowerings.registry import lowering_key
from tests.opinfo import catalog
from tests.opinfo.expected_failures import TOLERANCES
from tests.opinfo.pool import log_tail

#: time allowed for compiling and running one program on the runtime (seconds)
RUN_TIMEOUT = float(os.environ.get("OPINFO_RUN_TIMEOUT", "90"))

#: fault injection for the isolation tests: ``OPINFO_FAULT="abs:child-abort,exp:worker-abort"``
FAULTS = dict(
    item.split(":", 1) for item in os.environ.get("OPINFO_FAULT", "").split(",") if ":" in item
)

#: comparison tolerance (atol, rtol) by result dtype
DTYPE_TOLERANCE = {
    torch.float64: (1e-5, 1e-5),
    torch.float32: (1e-4, 1e-4),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (2e-2, 2e-2),
}

_DECOMP_TABLE: dict | None = None


def decomp_table() -> dict:
    global _DECOMP_TABLE
    if _DECOMP_TABLE is None:
        _DECOMP_TABLE = get_decomp_table()
    return dict(_DECOMP_TABLE)


# ----------------------------------------------------------------------------- samples ----


@dataclass
class Prepared:
    """One sample, flattened: tensor leaves become forward() inputs, the rest is baked in."""

    dtype: str
    index: int
    desc: str
    leaves: list[Any]
    spec: Any
    tensor_slots: list[int]
    expected: list[Any] = field(default_factory=list)

    @property
    def key(self) -> tuple[str, int]:
        return (self.dtype, self.index)

    def tensors(self) -> list[torch.Tensor]:
        return [self.leaves[i] for i in self.tensor_slots]

    def call(self, fn: Callable[..., Any], tensors: list[Any]) -> Any:
        leaves = list(self.leaves)
        for slot, tensor in zip(self.tensor_slots, tensors, strict=True):
            leaves[slot] = tensor
        inp, args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return fn(inp, *args, **kwargs)


def prepare(sample: Any, dtype: str, index: int) -> Prepared:
    leaves, spec = pytree.tree_flatten((sample.input, tuple(sample.args), dict(sample.kwargs)))
    slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    leaves = [leaf.detach().clone() if i in slots else leaf for i, leaf in enumerate(leaves)]
    return Prepared(dtype, index, catalog.describe_sample(sample), leaves, spec, slots)


def eager(fn: Callable[..., Any], sample: Prepared) -> list[Any]:
    tensors = copy.deepcopy(sample.tensors())
    with torch.no_grad():
        out = sample.call(fn, tensors)
    return [
        v.detach().clone() if isinstance(v, torch.Tensor) else v for v in pytree.tree_leaves(out)
    ]


def is_random(fn: Callable[..., Any], sample: Prepared) -> bool:
    """Whether the op gives other results with another random seed (dropout, sampling).

    Some entries re-seed the generator on every call (``wrapper_set_seed``); that is turned
    off here so their randomness shows.
    """
    import torch.testing._internal.common_methods_invocations as cmi

    saved = cmi.wrapper_set_seed
    cmi.wrapper_set_seed = lambda op, *args, **kwargs: op(*args, **kwargs)
    try:
        catalog.seed(1)
        first = eager(fn, sample)
        catalog.seed(2)
        return not same(eager(fn, sample), first)
    except Exception:  # cannot tell (e.g. dtypes torch.equal does not support)
        return False
    finally:
        cmi.wrapper_set_seed = saved
        catalog.seed(0)


def same(a: list[Any], b: list[Any]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype:
                return False
            if x.is_complex() or x.is_floating_point():
                if not torch.equal(torch.nan_to_num(x), torch.nan_to_num(y)):
                    return False
                if not torch.equal(torch.isnan(x), torch.isnan(y)):
                    return False
            elif not torch.equal(x, y):
                return False
        elif x != y and not (x != x and y != y):
            return False
    return True


class Batch(nn.Module):
    """Calls the op once per sample; returns one output pytree per sample."""

    def __init__(self, fn: Callable[..., Any], samples: list[Prepared]) -> None:
        super().__init__()
        self.fn = fn
        self.samples = samples

    def forward(self, *tensors: torch.Tensor) -> tuple[Any, ...]:
        outs, pos = [], 0
        for sample in self.samples:
            n = len(sample.tensor_slots)
            outs.append(sample.call(self.fn, list(tensors[pos : pos + n])))
            pos += n
        return tuple(outs)


def batch_inputs(samples: list[Prepared]) -> tuple[torch.Tensor, ...]:
    return tuple(t.clone() for s in samples for t in s.tensors())


# ----------------------------------------------------------------------------- records ----


def record(
    sample: Prepared,
    status: str,
    stage: str = "",
    reason: str = "",
    ops: list[list[str]] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    rec = {
        "dtype": sample.dtype,
        "index": sample.index,
        "desc": sample.desc,
        "status": status,
        "stage": stage,
        "reason": reason,
        "ops": ops or [],
    }
    rec.update(extra)
    return rec


_NODE = re.compile(r"node '[^']*'(?: \(op (?P<op>[^)]*)\))?(?: in module '[^']*')?")
_FRAME = re.compile(
    r" at (?P<file>[^\s:]+):(?P<line>\d+) in \S+?(?=: |\s|$)|\(no source location recorded\)"
)


def _strip_frames(text: str) -> str:
    """Drop ' at file.py:12 in fn: <that line's code>' (the frames all point into this sweep)."""
    out, pos = [], 0
    for match in _FRAME.finditer(text):
        if match.start() < pos:
            continue
        out.append(text[pos : match.start()])
        pos = match.end()
        if match.group("file"):
            code = linecache.getline(match.group("file"), int(match.group("line"))).strip()
            if code and text.startswith(": " + code, pos):
                pos += len(code) + 2
    out.append(text[pos:])
    return "".join(out)


def short_reason(error: BaseException, limit: int = 400) -> str:
    """The error message without node names and source lines, so equal causes group."""
    text = str(error).strip() or type(error).__name__
    text = text.split("\nproduced by:")[0]
    text = _NODE.sub(lambda m: m.group("op") or "node", _strip_frames(text))
    text = re.sub(r"\s+", " ", text)
    if not text.startswith(type(error).__name__):
        text = f"{type(error).__name__}: {text}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ------------------------------------------------------------------------ attribution ----


def _node_dtype(node: torch.fx.Node) -> str:
    for arg in pytree.tree_leaves((node.args, node.kwargs)):
        if isinstance(arg, torch.fx.Node):
            val = arg.meta.get("val")
            if isinstance(val, torch.Tensor):
                return catalog.dtype_name(val.dtype)
    val = node.meta.get("val")
    if isinstance(val, (list, tuple)):
        val = next((v for v in val if isinstance(v, torch.Tensor)), None)
    return catalog.dtype_name(val.dtype) if isinstance(val, torch.Tensor) else "-"


class Ownership:
    """Which samples each node of a batched program belongs to."""

    def __init__(self, ep: torch.export.ExportedProgram, samples: list[Prepared]) -> None:
        from torch.export.graph_signature import InputKind, OutputKind

        graph = ep.graph
        self.owners: dict[str, set[int]] = {}
        counts = [len(s.tensor_slots) for s in samples]
        input_owner: list[int] = [k for k, n in enumerate(counts) for _ in range(n)]
        user_inputs = [
            spec.arg.name
            for spec in ep.graph_signature.input_specs
            if spec.kind == InputKind.USER_INPUT
        ]
        #: user input placeholder -> sample
        self.input_owner = dict(zip(user_inputs, input_owner, strict=False))
        output_counts = [len(s.expected) for s in samples]
        user_owner = [k for k, n in enumerate(output_counts) for _ in range(n)]
        output_node = next(n for n in graph.nodes if n.op == "output")
        outputs = list(output_node.args[0])
        #: output position -> sample (None: nobody's)
        self.output_owner: list[int | None] = []
        user_pos = 0
        for spec, value in zip(ep.graph_signature.output_specs, outputs, strict=False):
            if spec.kind == OutputKind.USER_OUTPUT:
                owner = user_owner[user_pos] if user_pos < len(user_owner) else None
                user_pos += 1
            elif spec.kind == OutputKind.USER_INPUT_MUTATION:
                owner = self.input_owner.get(spec.target)
            else:
                owner = None
            self.output_owner.append(owner)
            if owner is not None and isinstance(value, torch.fx.Node):
                self.owners.setdefault(value.name, set()).add(owner)
        for name, owner in self.input_owner.items():
            self.owners.setdefault(name, set()).add(owner)
        for node in reversed(list(graph.nodes)):
            mine = self.owners.setdefault(node.name, set())
            for user in node.users:
                if user.op != "output":
                    mine |= self.owners.get(user.name, set())
        for node in graph.nodes:  # side-effect nodes (asserts) belong to what they check
            if not self.owners[node.name] and node.op == "call_function":
                for arg in node.all_input_nodes:
                    self.owners[node.name] |= self.owners.get(arg.name, set())
        self.ops: list[set[tuple[str, str]]] = [set() for _ in samples]
        for node in graph.nodes:
            key = lowering_key(node)
            if key is None:
                continue
            for k in self.owners.get(node.name, ()):
                self.ops[k].add((key, _node_dtype(node)))

    def samples_of(self, node_names: list[str]) -> set[int]:
        found: set[int] = set()
        for name in node_names:
            found |= self.owners.get(name, set())
        return found

    def ops_of(self, k: int) -> list[list[str]]:
        return [list(p) for p in sorted(self.ops[k])]


def subprogram(
    ep: torch.export.ExportedProgram, owners: Ownership, keep: set[int]
) -> torch.export.ExportedProgram:
    """The part of a batched program that computes the samples in ``keep``."""
    from torch.export.graph_signature import ExportGraphSignature, InputKind

    gm = copy.deepcopy(ep.graph_module)
    graph = gm.graph
    nodes = {n.name: n for n in graph.nodes}
    output = next(n for n in graph.nodes if n.op == "output")
    sig = ep.graph_signature
    kept = [
        (spec, value)
        for spec, value, owner in zip(
            sig.output_specs, output.args[0], owners.output_owner, strict=True
        )
        if owner in keep
    ]
    output.args = (tuple(v for _, v in kept),)
    for node in reversed(list(graph.nodes)):
        if node.op in ("output", "placeholder") or owners.owners.get(node.name, set()) & keep:
            continue
        graph.erase_node(node)
    input_specs = []
    for spec in sig.input_specs:
        node = nodes[spec.arg.name]
        if spec.kind == InputKind.USER_INPUT:
            wanted = owners.input_owner.get(node.name) in keep
        else:
            wanted = bool(node.users)
        if wanted:
            input_specs.append(spec)
        else:
            graph.erase_node(node)
    graph.lint()
    gm.recompile()
    signature = ExportGraphSignature(input_specs=input_specs, output_specs=[s for s, _ in kept])
    return ep._update(gm, signature)


def failing_nodes(error: BaseException) -> list[str]:
    if isinstance(error, UnsupportedOpError) and getattr(error, "ops", None):
        return [n.name for nodes in error.ops.values() for n in nodes]
    return re.findall(r"node '([^']+)'", str(error))


# --------------------------------------------------------------------------- runtime ----


def feed_array(value: Any) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().contiguous()
        if value.dtype == torch.bfloat16:
            import ml_dtypes

            return value.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
        return value.numpy().copy()
    return np.asarray(value)


def _child_run(
    asset: str,
    inputs: dict,
    state: dict | None,
    out_fd: int,
    err_path: str,
    timeout: float,
    fault: str | None,
) -> None:
    signal.alarm(int(timeout) + 30)  # never outlive the worker's patience
    fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    os.dup2(fd, 1)
    if fault == "child-abort":
        os.write(2, b"Fatal error: injected fault\n")
        os.abort()
    if fault == "child-hang":
        time.sleep(3600)
    try:
        from coreai_torch.runtime import Session

        with Session(asset) as session:
            out = session.run(inputs, state=state or None)
        payload = ("ok", out)
    except BaseException as error:
        payload = ("error", f"{type(error).__name__}: {error}")
    data = pickle.dumps(payload)
    view = memoryview(data)
    while view:
        written = os.write(out_fd, view)
        view = view[written:]


def run_on_runtime(
    asset: str, inputs: dict, state: dict | None, timeout: float, fault: str | None = None
) -> tuple[str, Any]:
    """Compile and call the program in a forked child.

    Returns ``("ok", outputs)``, ``("error", message)``, ``("abort", message)`` or
    ``("timeout", message)``.
    """
    read_fd, write_fd = os.pipe()
    err_path = asset + ".stderr"
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.close(read_fd)
            _child_run(asset, inputs, state, write_fd, err_path, timeout, fault)
        finally:
            os._exit(0)
    os.close(write_fd)
    chunks, deadline, timed_out = [], time.monotonic() + timeout, False
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                os.kill(pid, signal.SIGKILL)
                break
            ready, _, _ = select.select([read_fd], [], [], left)
            if ready:
                chunk = os.read(read_fd, 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
    finally:
        os.close(read_fd)
        _, status = os.waitpid(pid, 0)
    if timed_out:
        return "timeout", f"compiling and running took more than {timeout:.0f} s"
    if os.WIFSIGNALED(status) or not chunks:
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        name = signal.Signals(sig).name if sig else f"exit status {os.WEXITSTATUS(status)}"
        return "abort", f"runtime process killed ({name}){log_tail(Path(err_path))}"
    return pickle.loads(b"".join(chunks))


# --------------------------------------------------------------------------- compare ----


def tolerance(op_id: str, dtype: torch.dtype) -> tuple[float, float]:
    base = DTYPE_TOLERANCE.get(dtype, (0.0, 0.0))
    override = TOLERANCES.get(op_id)
    if override is None or dtype not in DTYPE_TOLERANCE:
        return base
    return (max(base[0], override[0]), max(base[1], override[1]))


def _runtime_dtype_ok(expected: torch.dtype, got: np.dtype) -> bool:
    if expected == torch.bfloat16:
        return got.name == "bfloat16"
    return torch.empty(0, dtype=expected).numpy().dtype == got


def compare_sample(
    op_id: str, sample: Prepared, actual: list[Any], metadata_only: bool
) -> tuple[bool, str]:
    from coreai_torch.verify import compare

    if len(actual) != len(sample.expected):
        return False, f"program returned {len(actual)} value(s), PyTorch {len(sample.expected)}"
    problems = []
    for i, (exp, act) in enumerate(zip(sample.expected, actual, strict=True)):
        act = np.asarray(act)
        if isinstance(exp, torch.Tensor):
            if tuple(act.shape) != tuple(exp.shape):
                problems.append(f"output {i}: shape {tuple(act.shape)} != {tuple(exp.shape)}")
                continue
            if not _runtime_dtype_ok(exp.dtype, act.dtype):
                problems.append(f"output {i}: dtype {act.dtype} != {catalog.dtype_name(exp.dtype)}")
                continue
            if metadata_only:
                continue
            atol, rtol = tolerance(op_id, exp.dtype)
            result = compare(f"output {i}", exp, act, atol=atol, rtol=rtol)
        elif exp is None:
            continue
        else:
            result = compare(f"output {i}", np.asarray(exp), act, atol=1e-6, rtol=1e-6)
        if not result.ok:
            detail = result.problem or f"max abs err {result.max_abs:.3g}"
            if result.max_abs and not result.problem:
                detail += f" (max rel {result.max_rel:.3g})"
            if i == len(actual) - 1 and not problems and ties_reordered(op_id, sample, act):
                continue
            problems.append(f"output {i} ({result.dtype}): {detail}")
    if problems and vectors_agree(op_id, sample, actual):
        return True, ""
    return (not problems), "; ".join(problems[:3])


#: decompositions whose vectors are defined up to a sign -> how they return them: ``eigh``
#: (eigenvalues, eigenvectors), ``svd`` (U, S, Vh) or ``svd_v`` (U, S, V: ``torch.svd``)
_SIGN_FREE = {"linalg.eigh": "eigh", "linalg.svd": "svd", "svd": "svd_v"}


def vectors_agree(op_id: str, sample: Prepared, actual: list[Any]) -> bool:
    """Whether a decomposition's outputs differ from PyTorch's only in what it leaves free.

    An eigenvector (a pair of singular vectors) is defined up to its sign, and with
    ``full_matrices=True`` the columns of U (rows of Vh) beyond the matrix's rank are any
    orthonormal basis of the rest: which ones LAPACK returns depends on its algorithm and on
    the processor's kernels.  The values must match; the vectors match up to one sign per
    eigen- or singular value, and the complete factors must be orthonormal.  (OpInfo's random
    samples have distinct eigen- and singular values, which makes the vectors unique up to
    sign.)
    """
    kind = _SIGN_FREE.get(op_id)
    expected = sample.expected
    if kind is None or len(actual) != len(expected):
        return False
    if not all(isinstance(e, torch.Tensor) and e.is_floating_point() for e in expected):
        return False
    atol, rtol = tolerance(op_id, expected[0].dtype)
    exp = [e.detach().double().numpy() for e in expected]
    act = [np.asarray(a, np.float64) for a in actual]
    if any(a.shape != e.shape for a, e in zip(act, exp, strict=True)):
        return False

    def close(a: np.ndarray, e: np.ndarray) -> bool:
        return bool(np.allclose(a, e, atol=10 * atol, rtol=10 * rtol))

    def signs(a: np.ndarray, e: np.ndarray) -> np.ndarray:  # per column of a and e
        return np.where((a * e).sum(-2, keepdims=True) < 0, -1.0, 1.0)

    if kind == "eigh":
        (w_a, q_a), (w_e, q_e) = act, exp
        return close(w_a, w_e) and close(q_a * signs(q_a, q_e), q_e)
    (u_a, s_a, v_a), (u_e, s_e, v_e) = act, exp
    if kind == "svd_v":  # torch.svd's V -> Vh
        v_a, v_e = np.swapaxes(v_a, -1, -2), np.swapaxes(v_e, -1, -2)
    k = s_e.shape[-1]
    flip = signs(u_a[..., :k], u_e[..., :k])  # [..., 1, k]: a pair's sign
    rows_a, rows_e = np.swapaxes(v_a[..., :k, :], -1, -2), np.swapaxes(v_e[..., :k, :], -1, -2)

    def orthonormal(m: np.ndarray) -> bool:  # columns of m
        return close(np.swapaxes(m, -1, -2) @ m, np.eye(m.shape[-1]))

    return (
        close(s_a, s_e)
        and close(u_a[..., :k] * flip, u_e[..., :k])
        and close(rows_a * flip, rows_e)
        and orthonormal(u_a)
        and orthonormal(np.swapaxes(v_a, -1, -2))
    )


#: ops whose index output PyTorch leaves unspecified among equal values -> position of
#: ``dim`` in their arguments
_TIE_OPS = {
    "sort": 0,
    "argsort": 0,
    "topk": 1,
    "kthvalue": 1,
    "mode": 0,
    "median": 0,
    "nanmedian": 0,
}


def ties_reordered(op_id: str, sample: Prepared, indices: np.ndarray) -> bool:
    """Whether an index output differs from PyTorch's only in how it picks among equal values.

    PyTorch leaves that choice unspecified for these ops (``sort`` without ``stable=True``,
    ``topk``, ``kthvalue``, ``mode``, ``median``), and its CPU kernels do not pick the first.
    Any indices that select the same values (a permutation for sorts, distinct for topk) are
    right.
    """
    if op_id not in _TIE_OPS:
        return False
    inp, args, kwargs = pytree.tree_unflatten(sample.leaves, sample.spec)
    pos = _TIE_OPS[op_id]
    dim = kwargs.get("dim", args[pos] if len(args) > pos else -1)
    if not isinstance(inp, torch.Tensor) or inp.dim() == 0 or not isinstance(dim, int):
        return False
    dim %= inp.dim()
    got = torch.from_numpy(np.asarray(indices)).long()
    want = sample.expected[-1]
    if got.shape != want.shape or got.numel() == 0:
        return False
    if got.min() < 0 or got.max() >= inp.shape[dim]:
        return False
    if op_id in ("sort", "argsort"):
        if kwargs.get("stable", args[2] if len(args) > 2 else False):
            return False
        positions = torch.arange(inp.shape[dim]).view(
            [-1 if d == dim else 1 for d in range(inp.dim())]
        )
        if not torch.equal(got.sort(dim).values, positions.expand_as(got)):
            return False
    elif op_id == "topk":
        ordered = got.sort(dim).values
        if (ordered.diff(dim=dim) == 0).any():
            return False
    elif not kwargs.get("keepdim", args[pos + 1] if len(args) > pos + 1 else False):
        got, want = got.unsqueeze(dim), want.unsqueeze(dim)
    picked = torch.take_along_dim(inp, got, dim)
    return same([picked], [torch.take_along_dim(inp, want, dim)])


# ----------------------------------------------------------------------------- engine ----


class EntryRunner:
    """Runs a list of prepared samples of one OpInfo entry, batching as much as possible."""

    def __init__(self, op_id: str, fn: Callable[..., Any], workdir: str) -> None:
        self.op_id = op_id
        self.fn = fn
        self.workdir = workdir
        self.metadata_only = op_id in catalog.UNINITIALIZED_OPS
        self.records: dict[tuple[str, int], dict[str, Any]] = {}
        self.batches = 0

    def run(self, samples: list[Prepared]) -> list[dict[str, Any]]:
        self._process(samples)
        return [self.records[s.key] for s in samples]

    # -- stages ---------------------------------------------------------------------------

    def _export(self, samples: list[Prepared]) -> torch.export.ExportedProgram:
        return torch.export.export(Batch(self.fn, samples), batch_inputs(samples), strict=False)

    def _process(self, samples: list[Prepared]) -> None:
        if not samples:
            return
        self.batches += 1
        single = len(samples) == 1
        try:
            ep = self._export(samples)
        except Exception as error:
            if single:
                self._set(samples[0], "export-failed", "export", short_reason(error))
                return
            self._process_exportable(samples)
            return
        try:
            ep = ep.run_decompositions(decomp_table())
        except Exception as error:
            if single:
                self._decomposition_failed(samples[0], ep, error)
            else:
                self._singles(samples)
            return
        self._convert_and_run(ep, Ownership(ep, samples), samples, list(range(len(samples))))

    def _singles(self, samples: list[Prepared]) -> None:
        for sample in samples:
            self._process([sample])

    def _process_exportable(self, samples: list[Prepared]) -> None:
        ok = []
        for sample in samples:
            try:
                self._export([sample])
                ok.append(sample)
            except Exception as error:
                self._set(sample, "export-failed", "export", short_reason(error))
        if len(ok) == len(samples):
            self._singles(samples)
        else:
            self._process(ok)

    def _decomposition_failed(
        self, sample: Prepared, ep: torch.export.ExportedProgram, error: Exception
    ) -> None:
        # torch's own table failing too means torch cannot produce the program at all.
        try:
            self._export([sample]).run_decompositions(torch.export.default_decompositions())
        except Exception:
            self._set(sample, "export-failed", "decompose", short_reason(error))
            return
        self._set(sample, "fail", "decompose", short_reason(error))

    def _convert_and_run(
        self,
        ep: torch.export.ExportedProgram,
        owners: Ownership,
        samples: list[Prepared],
        keep: list[int],
    ) -> None:
        """Convert and run the samples ``keep`` of a batched program.

        A conversion failure is charged to the samples that own the failing node and the
        others are retried; a failure without a culprit, or any failure at run time, is
        retried one sample at a time.  Sub-programs are cut out of the batched program, so
        none of this exports again.
        """
        while keep:
            if len(keep) < len(samples):
                try:
                    sub = subprogram(ep, owners, set(keep))
                except Exception:  # cannot cut it: export those samples again
                    self._singles([samples[k] for k in keep])
                    return
            else:
                sub = ep
            try:
                program = TorchConverter().add_exported_program(sub).to_coreai().optimize()
            except Exception as error:
                hit = owners.samples_of(failing_nodes(error)) & set(keep)
                if not hit:
                    if len(keep) == 1:
                        self._conversion_failed(samples[keep[0]], owners.ops_of(keep[0]), error)
                    else:
                        for k in keep:
                            self._convert_and_run(ep, owners, samples, [k])
                    return
                for k in sorted(hit):
                    self._conversion_failed(samples[k], owners.ops_of(k), error)
                keep = [k for k in keep if k not in hit]
                continue
            failed = self._run(
                [samples[k] for k in keep], [owners.ops_of(k) for k in keep], program
            )
            if failed is not None:
                if len(keep) == 1:
                    stage, reason = failed
                    self._set(samples[keep[0]], "fail", stage, reason, owners.ops_of(keep[0]))
                else:
                    for k in keep:
                        self._convert_and_run(ep, owners, samples, [k])
            return

    def _conversion_failed(self, sample: Prepared, ops: list[list[str]], error: Exception) -> None:
        # A clear refusal is the specified behaviour for zero-element tensors, which the
        # Core AI runtime cannot execute; any other refusal is a failure.
        empty = isinstance(error, RuntimeHazardError) and "zero elements" in str(error)
        reason = short_reason(error)
        if isinstance(error, UnsupportedOpError) and getattr(error, "ops", None):
            # the error lists the ops of every sample of the batch: name this sample's
            used = {key for key, _ in ops}
            mine = ", ".join(sorted(key for key in error.ops if key in used) or sorted(error.ops))
            if "have no Core AI lowering" in str(error):
                reason = f"UnsupportedOpError: no lowering for {mine}"
            else:
                headline = str(error).splitlines()[0]
                headline = re.sub(r"^entry point '[^']*': |\b\d+ ", "", headline).rstrip(":")
                reason = f"UnsupportedOpError: {headline}: {mine}"
        self._set(sample, "rejected-empty" if empty else "fail", "convert", reason, ops)

    def _run(
        self, samples: list[Prepared], ops: list[list[list[str]]], program: Any
    ) -> tuple[str, str] | None:
        """Run a converted program and record every sample; ``(stage, why)`` if it failed."""
        sig = program.signatures["main"]
        try:
            inputs, input_states = sig.feeds(list(batch_inputs(samples)))
        except Exception as error:
            return "convert", short_reason(error)
        state = {k: v.clone() for k, v in sig.initial_states.items()}
        state.update(input_states)
        asset = tempfile.mkdtemp(dir=self.workdir) + "/program.aimodel"
        try:
            program.save_asset(Path(asset))
        except Exception as error:
            return "save", short_reason(error)
        status, payload = run_on_runtime(
            asset,
            {k: feed_array(v) for k, v in inputs.items()},
            {k: feed_array(v) for k, v in state.items()},
            RUN_TIMEOUT,
            FAULTS.get(self.op_id),
        )
        if status != "ok":
            stage = {"error": "run", "abort": "abort", "timeout": "timeout"}[status]
            if status == "error" and "zero elements" in str(payload) and len(samples) == 1:
                # refused before reaching the runtime: an input has zero elements
                self._set(samples[0], "rejected-empty", "run", str(payload)[:400], ops[0])
                return None
            return stage, str(payload)[:400]
        outputs = [payload[o.name] for o in sig.outputs]
        pos = 0
        for sample, sample_ops in zip(samples, ops, strict=True):
            n = len(sample.expected)
            mine = outputs[pos : pos + n]
            pos += n
            ok, why = compare_sample(self.op_id, sample, mine, self.metadata_only)
            if ok:
                self._set(sample, "pass", "", "", sample_ops)
            else:
                self._set(sample, "fail", "compare", why, sample_ops)
        return None

    def _set(
        self,
        sample: Prepared,
        status: str,
        stage: str,
        reason: str,
        ops: list[list[str]] | None = None,
    ) -> None:
        self.records[sample.key] = record(sample, status, stage, reason, ops)


# -------------------------------------------------------------------------- top level ----


_SAMPLE_CACHE: dict[tuple[str, str], list[Any]] = {}


def samples_for(op: Any, op_id: str, dtype: str) -> list[Any]:
    key = (op_id, dtype)
    if key not in _SAMPLE_CACHE:
        if len(_SAMPLE_CACHE) > 8:
            _SAMPLE_CACHE.clear()
        _SAMPLE_CACHE[key] = catalog.all_samples(op, catalog.dtype_from_name(dtype))
    return _SAMPLE_CACHE[key]


def plan(op_id: str, dtypes: list[str] | None = None) -> dict[str, Any]:
    """The samples a task covers: ``{dtype: {"total": n, "selected": [indices]}}``."""
    op = catalog.op_db_by_id()[op_id]
    names = dtypes or [catalog.dtype_name(d) for d in catalog.sweep_dtypes(op)]
    out = {}
    for name in names:
        total = len(samples_for(op, op_id, name))
        out[name] = {
            "total": total,
            "selected": catalog.spread(total, catalog.cap_for(catalog.dtype_from_name(name))),
        }
    return out


def run_task(task: dict[str, Any], workdir: str) -> dict[str, Any]:
    """Run one task ``{"op": id, "samples": [[dtype, index], ...]}``; returns its records."""
    op_id = task["op"]
    op = catalog.op_db_by_id()[op_id]
    if FAULTS.get(op_id) == "worker-abort":
        os.abort()
    start = time.perf_counter()
    prepared: list[Prepared] = []
    records: list[dict[str, Any]] = []
    check_random = op_id not in catalog.UNINITIALIZED_OPS
    for dtype, index in task["samples"]:
        sample = samples_for(op, op_id, dtype)[index]
        prep = prepare(sample, dtype, index)
        try:
            prep.expected = eager(op.op, prep)
        except Exception as error:
            records.append(record(prep, "eager-failed", "eager", short_reason(error)))
            continue
        if check_random and is_random(op.op, prep):
            records.append(record(prep, "random", "eager", "eager results differ between runs"))
            continue
        prepared.append(prep)
    left_out = None
    if not prepared and any(r["status"] == "random" for r in records):
        left_out = "random numbers (eager results differ between runs)"
    runner = EntryRunner(op_id, op.op, workdir)
    try:
        records += runner.run(prepared)
    except Exception as error:  # a bug in the sweep itself: report, don't hide
        trace = traceback.format_exc(limit=3)
        for prep in prepared:
            records.append(record(prep, "fail", "sweep", f"{short_reason(error)} | {trace}"))
    batches = runner.batches
    return {
        "op": op_id,
        "left_out": left_out,
        "records": records,
        "batches": batches,
        "seconds": round(time.perf_counter() - start, 3),
    }
