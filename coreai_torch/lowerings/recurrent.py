"""Recurrent layers: ``aten.lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu`` as ``coreai.while``.

``get_decomp_table()`` keeps these ops whole (``decomp.RECURRENT_OPS``): PyTorch's
decomposition unrolls every time step into a dozen ops, so graph size, export and compile
time grow with the sequence length.
Here each layer becomes one loop over time whose size does not depend on the sequence length:

* the input projection ``x W_ihᵀ + b`` of all time steps is one matmul before the loop;
* the loop carries the step counter, the hidden (and cell) state of every direction and the
  output sequence; a step reads its projected input with ``gather_nd`` (forward directions at
  ``t``, reverse ones at ``T - 1 - t``), applies the cell and writes the new hidden state into
  the output with ``scatter_nd``;
* the directions of a layer share one loop; the next layer reads their concatenated outputs.

16-bit layers compute in float32 inside, like the norms (and as their products accumulate
everywhere, :mod:`coreai_torch.lowerings.helpers.accumulation`): the input and the initial
states are cast once, the weights once before the loops (they stay stored in 16 bits), and
the results are rounded to the half type once, at the end.  The loops then run exactly as in
a float32 program: the Linux runtime's float16 matmuls are slow as well as inexact (one step
of a 256-unit LSTM: 28 ms against 0.5 ms in float32), and each step in 16 bits made float16
LSTMs 60 to 280 times slower than float32 ones.

Packed sequences (the ``.data`` overloads) and training-mode dropout between layers are not
supported.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from coreai_torch._mlir import cai, ir
from coreai_torch.ir.values import (
    cast,
    constant,
    dtype_of,
    i32,
    known_sizes,
    reshape,
    shape_of,
    static_dim,
    static_shape_of,
    transpose,
    u32,
    unsqueeze,
)
from coreai_torch.lowerings.helpers.accumulation import accumulation_dtype
from coreai_torch.lowerings.registry import LoweringContext, lowering


@dataclass(frozen=True)
class Cell:
    """One recurrent cell kind: op name, whether it carries a cell state, its step."""

    name: str
    has_cell_state: bool
    step: Callable[..., tuple[ir.Value, ir.Value | None]]


@dataclass
class Weights:
    """The parameters of one direction of one layer (matrices already transposed)."""

    w_hh_t: ir.Value  # (H_out, gates * H)
    b_hh: ir.Value | None  # (gates * H,), only GRU keeps it apart from the input projection
    w_hr_t: ir.Value | None  # (H, P) LSTM projection


def _split(x: ir.Value, parts: int) -> list[ir.Value]:
    """Split the last axis of ``x`` into ``parts`` equal chunks."""
    size = static_dim(x, -1) // parts
    pieces = cai.split(x, np.uint32(size), np.int32(-1))
    return list(pieces) if parts > 1 else [pieces]


def _lstm_step(
    xw: ir.Value, h: ir.Value, c: ir.Value | None, w: Weights
) -> tuple[ir.Value, ir.Value | None]:
    gates = cai.add(xw, cai.batch_matmul(h, w.w_hh_t))
    i, f, g, o = _split(gates, 4)
    c_next = cai.add(cai.mul(cai.sigmoid(f), c), cai.mul(cai.sigmoid(i), cai.tanh(g)))
    h_next = cai.mul(cai.sigmoid(o), cai.tanh(c_next))
    if w.w_hr_t is not None:
        h_next = cai.batch_matmul(h_next, w.w_hr_t)
    return h_next, c_next


def _gru_step(
    xw: ir.Value, h: ir.Value, c: ir.Value | None, w: Weights
) -> tuple[ir.Value, ir.Value | None]:
    hw = cai.batch_matmul(h, w.w_hh_t)
    if w.b_hh is not None:
        hw = cai.broadcasting_add(hw, w.b_hh)
    x_r, x_z, x_n = _split(xw, 3)
    h_r, h_z, h_n = _split(hw, 3)
    r = cai.sigmoid(cai.add(x_r, h_r))
    z = cai.sigmoid(cai.add(x_z, h_z))
    n = cai.tanh(cai.add(x_n, cai.mul(r, h_n)))
    # (1 - z) * n + z * h  ==  n + z * (h - n)
    return cai.add(n, cai.mul(z, cai.sub(h, n))), None


def _rnn_step(activation: Callable[[ir.Value], ir.Value]) -> Callable[..., tuple]:
    def step(
        xw: ir.Value, h: ir.Value, c: ir.Value | None, w: Weights
    ) -> tuple[ir.Value, ir.Value | None]:
        return activation(cai.add(xw, cai.batch_matmul(h, w.w_hh_t))), None

    return step


LSTM = Cell("lstm", True, _lstm_step)
GRU = Cell("gru", False, _gru_step)
RNN_TANH = Cell("rnn_tanh", False, _rnn_step(cai.tanh))
RNN_RELU = Cell("rnn_relu", False, _rnn_step(cai.relu))


def _rows(x: ir.Value) -> list[ir.Value]:
    """``x[k]`` for every k of the first axis (static)."""
    n = static_dim(x, 0)
    pieces = list(cai.split(x, np.uint32(1), np.int32(0))) if n > 1 else [x]
    return [reshape(p, static_shape_of(p)[1:]) for p in pieces]


def _recurrent(
    cx: LoweringContext,
    cell: Cell,
    input: ir.Value,
    hx: Sequence[ir.Value],
    params: Sequence[ir.Value],
    has_biases: bool,
    num_layers: int,
    dropout: float,
    train: bool,
    bidirectional: bool,
    batch_first: bool,
) -> list[ir.Value]:
    if train and dropout > 0.0 and num_layers > 1:
        raise cx.unsupported("dropout between recurrent layers (export the model in eval mode)")
    shape = known_sizes(shape_of(input))
    if shape is None:
        raise cx.unsupported("recurrent layers with dynamic input shapes")
    if len(shape) != 3:
        raise cx.unsupported("unbatched recurrent input (add a batch dimension)")
    dirs = 2 if bidirectional else 1
    per_direction = len(params) // (num_layers * dirs)
    has_projection = per_direction == (4 if has_biases else 2) + 1
    if per_direction * num_layers * dirs != len(params) or (has_projection and cell is not LSTM):
        raise cx.unsupported(f"unexpected recurrent parameter list of length {len(params)}")

    dtype = dtype_of(input)
    compute = accumulation_dtype(cx, dtype)  # float32 for 16-bit layers (module docstring)
    x = cast(transpose(input, [1, 0, 2]) if batch_first else input, compute)  # (T, B, I)
    steps = static_dim(x, 0)
    h0 = _rows(cast(hx[0], compute))
    c0 = _rows(cast(hx[1], compute)) if cell.has_cell_state else [None] * len(h0)
    h_last: list[ir.Value] = []
    c_last: list[ir.Value] = []
    for layer in range(num_layers):
        projected, weights = [], []
        for d in range(dirs):
            k = layer * dirs + d
            group = list(params[k * per_direction : (k + 1) * per_direction])
            w_ih, w_hh = group[0], group[1]
            b_ih, b_hh = (
                (cast(group[2], compute), cast(group[3], compute)) if has_biases else (None, None)
            )
            w_ih_t = cast(transpose(w_ih, [1, 0]), compute)
            xw = cai.broadcasting_batch_matmul(x, w_ih_t)  # (T, B, G*H)
            if b_ih is not None:
                # GRU needs b_hh inside r * (W_hn h + b_hn); the other cells fold it here.
                bias = b_ih if cell is GRU else cai.add(b_ih, b_hh)
                xw = cai.broadcasting_add(xw, bias)
            projected.append(xw)
            weights.append(
                Weights(
                    w_hh_t=cast(transpose(w_hh, [1, 0]), compute),
                    b_hh=b_hh if cell is GRU else None,
                    w_hr_t=cast(transpose(group[-1], [1, 0]), compute) if has_projection else None,
                )
            )
        first = layer * dirs
        outs, hs, cs = _time_loop(
            cell, steps, projected, weights, h0[first : first + dirs], c0[first : first + dirs]
        )
        x = outs[0] if dirs == 1 else cai.concat(np.int32(-1), outs)
        h_last += hs
        c_last += cs
    output = transpose(x, [1, 0, 2]) if batch_first else x
    results = [output, cai.concat(np.int32(0), [unsqueeze(h, [0]) for h in h_last])]
    if cell.has_cell_state:
        results.append(cai.concat(np.int32(0), [unsqueeze(c, [0]) for c in c_last]))
    return [cast(r, dtype) for r in results]


def _time_loop(
    cell: Cell,
    steps: int,
    projected: list[ir.Value],
    weights: list[Weights],
    h0: list[ir.Value],
    c0: list[ir.Value | None],
) -> tuple[list[ir.Value], list[ir.Value], list[ir.Value]]:
    """One ``coreai.while`` over time for the directions of one layer (the second direction,
    if any, runs backwards).  Returns per direction: outputs (T, B, H_out), last h, last c."""
    dirs = len(projected)
    dtype = dtype_of(h0[0])
    outputs0 = [
        cai.broadcast_to(constant(0.0, dtype), u32([steps, *static_shape_of(h)])) for h in h0
    ]
    cells0 = [c for c in c0 if c is not None]
    inits = [cai.constant(np.int32(0)), *h0, *cells0, *outputs0]
    types = [v.type for v in inits]
    loop, (before, after) = cai.while_(types, inits)
    with before:
        t = before.arguments[0]
        cai.condition(cai.greater(cai.constant(np.int32(steps)), t), *before.arguments)
    with after:
        args = list(after.arguments)
        t = args[0]
        hs = args[1 : 1 + dirs]
        cs = args[1 + dirs : 1 + dirs + len(cells0)] or [None] * dirs
        outs = args[1 + dirs + len(cells0) :]
        last = cai.constant(np.int32(steps - 1))
        new_h, new_c, new_out = [], [], []
        for d in range(dirs):
            index = cai.reshape(t if d == 0 else cai.sub(last, t), i32([1]))
            xw = cai.gather_nd(projected[d], index)  # (B, G*H)
            h, c = cell.step(xw, hs[d], cs[d], weights[d])
            new_h.append(h)
            if c is not None:
                new_c.append(c)
            new_out.append(
                cai.scatter_nd(outs[d], cai.reshape(index, i32([1, 1])), unsqueeze(h, [0]))
            )
        cai.yield_([cai.add(t, cai.constant(np.int32(1))), *new_h, *new_c, *new_out])
    results = list(loop.results) if hasattr(loop, "results") else list(loop)
    h_last = results[1 : 1 + dirs]
    c_last = results[1 + dirs : 1 + dirs + len(cells0)]
    outs = results[1 + dirs + len(cells0) :]
    return outs, h_last, c_last


def _rule(cell: Cell) -> Callable[..., list[ir.Value]]:
    """The lowering of one recurrent op (``hx`` is a list for LSTM, a tensor otherwise)."""

    def rule(
        cx: LoweringContext,
        input: ir.Value,
        hx: ir.Value | list[ir.Value],
        params: list[ir.Value],
        **flags: Any,
    ) -> list[ir.Value]:
        states = hx if isinstance(hx, list) else [hx]
        return _recurrent(cx, cell, input, states, params, **flags)

    rule.__doc__ = f"{cell.name}: one ``coreai.while`` over time per layer."
    return rule


for _cell in (LSTM, GRU, RNN_TANH, RNN_RELU):
    lowering(f"aten::{_cell.name}.input")(_rule(_cell))
