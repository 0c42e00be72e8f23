"""ATen ops kept whole as composite ops (named after the op they preserve: ``layer_norm``,
``group_norm``, ``pixel_shuffle``, ``scaled_dot_product_attention``, ...), so the Core AI
compiler can fuse them; with ``TorchConverter(aten_composites=False)`` the reference
implementation is emitted inline instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from coreai_torch._mlir import ir
from coreai_torch.ir.composite import emit_composite
from coreai_torch.locations import module_path
from coreai_torch.lowerings.registry import LoweringContext


def aten_composite(
    cx: LoweringContext,
    op_name: str,
    inputs: Mapping[str, ir.Value | None],
    op_attrs: Mapping[str, Any],
    body: Callable[..., ir.Value],
) -> ir.Value:
    """Emit an ATen op as composite op ``op_name`` (named after the op it preserves).

    ``inputs`` are the op's tensor arguments by schema name (``None`` ones are left out of
    the composite); ``body(**inputs)`` emits the reference implementation from the graph
    arguments.  The graph is named after the node's module path and ``op_name``.  With
    ATen composites switched off (``TorchConverter(aten_composites=False)``, read from
    ``cx.options``) the body is emitted inline.
    """
    if not cx.options.aten_composites:
        return body(**inputs)

    present = [(name, value) for name, value in inputs.items() if value is not None]

    def build(*args: ir.Value) -> ir.Value:
        values: dict[str, ir.Value | None] = dict.fromkeys(inputs)
        values.update(zip((name for name, _ in present), args, strict=True))
        return body(**values)

    path = module_path(cx.node)
    (result,) = emit_composite(
        op_name,
        [value for _, value in present],
        build,
        input_names=[name for name, _ in present],
        op_attrs=op_attrs,
        name=f"{path}.{op_name}" if path else op_name,
    )
    return result
