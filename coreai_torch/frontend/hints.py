"""Errors with a known fix in the project say what to call.

Some failures come from a model pattern that coreai-torch already has a rewrite for: the
expert loop of a Hugging Face mixture-of-experts block (``torch.where(expert_mask[e])``,
``nonzero`` sizes that depend on the data: ``coreai_torch.rewrite_moe``) and the recurrent
layers ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` with a dynamic sequence length
(``coreai_torch.rewrite_recurrent``).  The functions here recognise them from what an error
has at hand: the FX node (its op, its ``nn_module_stack`` and source line) for conversion
errors, the module for ``torch.export`` failures; they return one line to add, or None.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch.fx
from torch import nn

from coreai_torch.locations import clean_module_path, qualified_name, user_frame

#: ops that a Hugging Face expert loop leaves in an exported program
_MOE_OPS = ("aten::nonzero", "aten::index_put", "aten::index_add", "aten::_local_scalar_dense")
#: source lines of expert loops (transformers' MoE blocks and code written like them)
_EXPERT_SOURCE = re.compile(r"expert_mask|expert_hit|expert_idx|experts\[|num_experts|top_x")
_RECURRENT_CLASSES = {
    "torch.nn.modules.rnn.LSTM": "nn.LSTM",
    "torch.nn.modules.rnn.GRU": "nn.GRU",
    "torch.nn.modules.rnn.RNN": "nn.RNN",
}
_RECURRENT_OPS = ("aten::lstm", "aten::gru", "aten::rnn_tanh", "aten::rnn_relu")
#: ``module.qualname`` of the mixture-of-experts blocks rewrite_moe supports
#: (:data:`coreai_torch.rewrites.moe.REWRITES`, registered with :func:`register_moe_blocks`)
_MOE_BLOCKS: set[str] = set()
#: words of torch.export errors about dynamic sizes
_DYNAMIC_WORDS = re.compile(
    r"Constraints violated|specialized|Dim\b|dynamic|data-dependent|GuardOnDataDependent"
)


def _qualname(cls: Any) -> str:
    if isinstance(cls, type):
        return f"{cls.__module__}.{cls.__qualname__}"
    return str(cls)


def register_moe_blocks(qualnames: Iterable[str]) -> None:
    """Recognise the blocks ``qualnames`` (``module.qualname``) as ones ``rewrite_moe`` makes
    static: :mod:`coreai_torch.rewrites.moe`, a layer above this one, registers its own."""
    _MOE_BLOCKS.update(qualnames)


def _module_stack(node: torch.fx.Node) -> list[tuple[str, str]]:
    """``(module path, class qualname)`` from the root to the innermost module of ``node``."""
    stack = node.meta.get("nn_module_stack") or {}
    return [(clean_module_path(str(path)), _qualname(cls)) for path, cls in stack.values()]


def _source(node: torch.fx.Node) -> str:
    frame = user_frame(node)
    return (frame.code or "") if frame else ""


def _op(node: torch.fx.Node) -> str:
    return qualified_name(node.target) if node.op == "call_function" else ""


def for_node(node: torch.fx.Node) -> str | None:
    """The known fix for a node that cannot be converted, or None."""
    stack = _module_stack(node)
    op = _op(node)
    for path, cls in reversed(stack):
        if cls in _MOE_BLOCKS:
            return _moe_hint(cls.rsplit(".", 1)[1], path)
    if op.startswith(_MOE_OPS) and _EXPERT_SOURCE.search(_source(node)):
        cls = stack[-1][1].rsplit(".", 1)[1] if stack else ""
        return _moe_hint(cls, stack[-1][0] if stack else "", supported=False)
    for path, cls in reversed(stack):
        if cls in _RECURRENT_CLASSES:
            return _recurrent_hint(_RECURRENT_CLASSES[cls], path)
    if op.startswith(_RECURRENT_OPS):
        return _recurrent_hint(op.split("::")[1].split(".")[0], "")
    return None


def for_nodes(nodes: Iterable[torch.fx.Node]) -> list[str]:
    """The distinct known fixes for ``nodes``, in order."""
    found: list[str] = []
    for node in nodes:
        hint = for_node(node)
        if hint and hint not in found:
            found.append(hint)
    return found


def for_export_failure(module: nn.Module, error: BaseException) -> str | None:
    """The known fix for ``torch.export`` failing on ``module`` with ``error``, or None."""
    for path, sub in module.named_modules():
        if _qualname(type(sub)) in _MOE_BLOCKS:
            return _moe_hint(type(sub).__name__, path)
    if _DYNAMIC_WORDS.search(f"{type(error).__name__}: {error}"):
        for path, sub in module.named_modules():
            name = _RECURRENT_CLASSES.get(_qualname(type(sub)))
            if name:
                return _recurrent_hint(name, path)
    return None


def _where(path: str) -> str:
    return f" at '{path}'" if path else ""


def _moe_hint(cls: str, path: str, supported: bool = True) -> str:
    if supported:
        return (
            f"hint: this is the expert loop of the mixture-of-experts block {cls}{_where(path)}; "
            "call coreai_torch.rewrite_moe(model) before torch.export: it replaces the block "
            "with an exact one without data-dependent sizes (docs/frontier_models.md)"
        )
    what = f" ({cls}{_where(path)})" if cls else ""
    return (
        f"hint: this looks like a mixture-of-experts expert loop{what}; "
        "coreai_torch.rewrite_moe(model) makes the Hugging Face MoE blocks static (Mixtral, "
        "Qwen-MoE, OLMoE, DeepSeek, GPT-OSS, ...); other blocks need fixed-size routing, e.g. "
        "a coreai_torch.rewrites.moe.SparseMoE"
    )


def _recurrent_hint(name: str, path: str) -> str:
    return (
        f"hint: the model has a recurrent layer ({name}{_where(path)}), which torch.export "
        "unrolls to the example's length; call coreai_torch.rewrite_recurrent(model) before "
        "torch.export: it writes the loop over time as one scan that runs any length"
    )


def with_hint(message: str, hint: str | None) -> str:
    """``message`` with ``hint`` on a line of its own (unless it is there already)."""
    if not hint or hint in message:
        return message
    return f"{message}\n{hint}"


def add_note(error: BaseException, hint: str | None) -> None:
    """Attach ``hint`` to an exception coreai-torch does not own (shown under its traceback)."""
    if hint and hint not in getattr(error, "__notes__", ()):
        error.add_note(hint)
