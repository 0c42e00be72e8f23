"""``rewrite_recurrent``: ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` with a dynamic sequence length.

``torch.export`` unrolls these modules' time steps while tracing (their ATen op is a
composite whose implementation loops in C++), so an exported program is fixed to the example's
length and a ``Dim`` on the sequence axis fails in export itself. :func:`rewrite_recurrent`
replaces each of them, in place, by a module computing the same recurrence with
``torch._higher_order_ops.scan`` over the module's own parameters (same names, same tensors:
``state_dict`` and ``load_state_dict`` keep working), which exports as one loop and converts to
a Core AI ``while`` loop that runs any length.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch._higher_order_ops.scan import scan

from coreai_torch.errors import UnsupportedModelError

Tensor = torch.Tensor
State = tuple[Tensor, ...]

_RECURRENT = (nn.LSTM, nn.GRU, nn.RNN)


class ScanRecurrent(nn.Module):
    """A batch of recurrent layers (the computation of ``nn.LSTM``, ``nn.GRU`` or ``nn.RNN``,
    in inference) with the loop over time written as ``scan``. Built by
    :func:`rewrite_recurrent`; takes and returns what the replaced module did (an initial state
    or ``None``; batched or unbatched input; ``batch_first``)."""

    def __init__(self, module: nn.RNNBase) -> None:
        super().__init__()
        self.mode: str = module.mode  # "LSTM", "GRU", "RNN_TANH" or "RNN_RELU"
        self.num_layers: int = module.num_layers
        self.hidden_size: int = module.hidden_size
        self.proj_size: int = module.proj_size
        self.batch_first: bool = module.batch_first
        self.directions: int = 2 if module.bidirectional else 1
        self.bias: bool = module.bias
        for name, parameter in module.named_parameters(recurse=False):
            self.register_parameter(name, parameter)  # the same tensors, under the same names

    def extra_repr(self) -> str:
        return (
            f"{self.mode}, hidden_size={self.hidden_size}, num_layers={self.num_layers}, "
            f"bidirectional={self.directions == 2}, batch_first={self.batch_first}"
        )

    def forward(
        self, x: Tensor, hx: Tensor | tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor | tuple[Tensor, Tensor]]:
        if isinstance(x, nn.utils.rnn.PackedSequence):
            raise TypeError("ScanRecurrent does not take a PackedSequence; pass a padded tensor")
        unbatched = x.dim() == 2
        if unbatched:
            x = x.unsqueeze(1 if not self.batch_first else 0)
        if self.batch_first:
            x = x.transpose(0, 1)  # (time, batch, features): scan runs over dim 0
        initial = self._initial_state(x, hx, unbatched)
        finals: list[list[Tensor]] = [[] for _ in initial]
        out = x
        for layer in range(self.num_layers):
            outputs = []
            for direction in range(self.directions):
                index = layer * self.directions + direction
                state = tuple(s[index] for s in initial)
                state, y = self._run(layer, direction, state, out)
                outputs.append(y)
                for kept, s in zip(finals, state, strict=True):
                    kept.append(s)
            out = outputs[0] if self.directions == 1 else torch.cat(outputs, -1)
        if self.batch_first:
            out = out.transpose(0, 1)
        last = tuple(torch.stack(kept) for kept in finals)
        if unbatched:
            out = out.squeeze(0 if self.batch_first else 1)
            last = tuple(s.squeeze(1) for s in last)
        return out, ((last[0], last[1]) if self.mode == "LSTM" else last[0])

    def _initial_state(
        self, x: Tensor, hx: Tensor | tuple[Tensor, Tensor] | None, unbatched: bool
    ) -> State:
        layers = self.num_layers * self.directions
        batch = x.shape[1]
        h_size = self.proj_size or self.hidden_size
        if hx is None:
            h = x.new_zeros(layers, batch, h_size)
            return (
                (h, x.new_zeros(layers, batch, self.hidden_size)) if self.mode == "LSTM" else (h,)
            )
        states = tuple(hx) if isinstance(hx, tuple | list) else (hx,)
        if unbatched:
            states = tuple(s.unsqueeze(1) for s in states)
        return states

    def _run(self, layer: int, direction: int, state: State, xs: Tensor) -> tuple[State, Tensor]:
        """One layer in one direction over the whole sequence ``xs`` (time, batch, features)."""
        suffix = f"_l{layer}" + ("_reverse" if direction else "")
        w_ih = getattr(self, "weight_ih" + suffix)
        w_hh = getattr(self, "weight_hh" + suffix)
        projected = xs @ w_ih.T  # the input projections of every step, in one matmul
        b_hh = None
        if self.bias:
            b_hh = getattr(self, "bias_hh" + suffix)
            b_ih = getattr(self, "bias_ih" + suffix)
            # GRU: the hidden bias of the new gate sits inside the reset product
            projected = projected + (b_ih if self.mode == "GRU" else b_ih + b_hh)
        w_hr = getattr(self, "weight_hr" + suffix) if self.proj_size else None
        step = self._step(w_hh, b_hh, w_hr)
        return scan(step, state, projected, reverse=bool(direction))

    def _step(
        self, w_hh: Tensor, b_hh: Tensor | None, w_hr: Tensor | None
    ) -> Callable[[State, Tensor], tuple[State, Tensor]]:
        mode = self.mode

        def lstm(carry: State, x_t: Tensor) -> tuple[State, Tensor]:
            h, c = carry
            i, f, g, o = (x_t + h @ w_hh.T).chunk(4, -1)
            c = f.sigmoid() * c + i.sigmoid() * g.tanh()
            h = o.sigmoid() * c.tanh()
            if w_hr is not None:
                h = h @ w_hr.T
            return (h, c), h.clone()

        def gru(carry: State, x_t: Tensor) -> tuple[State, Tensor]:
            (h,) = carry
            hidden = h @ w_hh.T
            if b_hh is not None:
                hidden = hidden + b_hh
            x_r, x_z, x_n = x_t.chunk(3, -1)
            h_r, h_z, h_n = hidden.chunk(3, -1)
            r = (x_r + h_r).sigmoid()
            z = (x_z + h_z).sigmoid()
            n = (x_n + r * h_n).tanh()
            h = (1 - z) * n + z * h
            return (h,), h.clone()

        def rnn(carry: State, x_t: Tensor) -> tuple[State, Tensor]:
            (h,) = carry
            h = x_t + h @ w_hh.T
            h = h.tanh() if mode == "RNN_TANH" else h.relu()
            return (h,), h.clone()

        return {"LSTM": lstm, "GRU": gru}.get(mode, rnn)


def rewrite_recurrent(model: nn.Module) -> nn.Module:
    """Replace every ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` in ``model`` (in place) with a
    :class:`ScanRecurrent` computing the same thing with ``scan``, so the program exports with
    a dynamic sequence length (``torch.export.Dim`` on the time axis) and runs any length.

    The rewrite is for inference: it raises :class:`~coreai_torch.errors.UnsupportedModelError`,
    before changing anything, for a module in training mode with ``dropout > 0``. Returns
    ``model`` (the new module when ``model`` is itself recurrent).
    """
    found = [(n, m) for n, m in model.named_modules() if type(m) in _RECURRENT]
    training = [n or "<model>" for n, m in found if m.training and m.dropout > 0]
    if training:
        raise UnsupportedModelError(
            "rewrite_recurrent computes inference: these recurrent modules are in training mode "
            f"with dropout between layers: {', '.join(training)}; call model.eval() first"
        )
    for name, module in found:
        scanned = ScanRecurrent(module)
        if not name:
            return scanned
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, scanned)
    return model
