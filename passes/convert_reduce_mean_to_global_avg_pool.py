"""ConvertReduceMeanToGlobalAvgPool: spatial ``ReduceMean`` becomes ``GlobalAveragePool``.

Maths. For a 4-D tensor ``x`` of shape ``(N, C, H, W)``::

    ReduceMean(x, axes=(2, 3), keepdims=1)[n, c, 0, 0] = (1 / (H W)) sum_{h, w} x[n, c, h, w]
                                                      = GlobalAveragePool(x)[n, c, 0, 0]

so with ``keepdims=1`` the node is replaced one for one. With ``keepdims=0`` the ReduceMean output
is ``(N, C)``; the rewrite is ``Flatten(GlobalAveragePool(x), axis=1)``, and Flatten of
``(N, C, 1, 1)`` at axis 1 is exactly ``(N, C)`` for any ``N`` (no shape constant is needed).
Float-preserving: the sum is the same, onnxruntime may only accumulate in another order.

Handled: ``axes`` as an attribute (opset < 18) or as a constant second input (opset >= 18),
negative axes (normalised by the rank, so ``(-2, -1)`` counts), any order of the two axes.
Not rewritten: other axes (``(1,)``, ``(1, 2, 3)``), no axes (reduce over everything), a
run-time axes input, inputs whose rank is not 4 or not known even after shape inference, and
non-float tensors (GlobalAveragePool is float only).
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from quark_onnx.graph.ir import NameGenerator, constant_array, infer_shapes
from quark_onnx.passes.base import QuarkPass
from quark_onnx.passes.convert_clip_to_relu import remove_if_unused

logger = logging.getLogger(__name__)

_FLOAT_TYPES = frozenset(
    {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE, ir.DataType.BFLOAT16}
)
_SPATIAL = frozenset({2, 3})


def _reduce_axes(node: ir.Node) -> list[int] | None:
    """The ReduceMean's axes as written (attribute or constant input), or None if unknown/all."""
    if "axes" in node.attributes:
        return list(node.attributes.get_ints("axes"))
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        array = constant_array(node.inputs[1])
        if array is None:
            return None
        return [int(a) for a in np.asarray(array).reshape(-1)]
    return None  # no axes: reduce over every axis (or a no-op), never only H and W


def _is_spatial_mean(node: ir.Node) -> bool:
    x = node.inputs[0]
    if x.shape is None or x.shape.rank() != 4:
        return False
    if x.dtype is not None and x.dtype not in _FLOAT_TYPES:
        return False
    axes = _reduce_axes(node)
    if axes is None or len(axes) != 2:
        return False
    return {a % 4 for a in axes} == _SPATIAL


class ConvertReduceMeanToGlobalAvgPool(QuarkPass):
    """Replace ReduceMean over (H, W) of a 4-D tensor by GlobalAveragePool (+ Flatten)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        candidates = [
            node
            for node in ir.traversal.RecursiveGraphIterator(model.graph)
            if node.op_type == "ReduceMean"
            and node.domain == ""
            and node.inputs
            and node.inputs[0] is not None
        ]
        if not candidates:
            return ir.passes.PassResult(model, modified=False)
        if any(node.inputs[0].shape is None for node in candidates):
            infer_shapes(model, type(self).__name__)
        names = NameGenerator(model.graph)
        count = 0
        for node in candidates:
            if not _is_spatial_mean(node):
                continue
            x = node.inputs[0]
            keepdims = node.attributes.get_int("keepdims", 1)
            axes_input = node.inputs[1] if len(node.inputs) > 1 else None
            if keepdims:
                node.op_type = "GlobalAveragePool"
                node.resize_inputs(1)
                node.attributes.clear()
            else:
                base = node.name or "ReduceMean"
                pool = ir.Node(
                    "",
                    "GlobalAveragePool",
                    [x],
                    name=names(f"{base}/global_avg_pool"),
                )
                pooled = pool.outputs[0]
                pooled.name = names(f"{base}/global_avg_pool_output")
                pooled.type = x.type
                if x.type is not None and x.shape is not None:
                    pooled.shape = ir.Shape([x.shape[0], x.shape[1], 1, 1])
                node.graph.insert_before(node, pool)
                node.op_type = "Flatten"
                node.resize_inputs(1)
                node.replace_input_with(0, pooled)
                node.attributes.clear()
                node.attributes.add(ir.AttrInt64("axis", 1))
            if axes_input is not None:
                remove_if_unused(node.graph, axes_input)
            logger.debug(
                "ReduceMean %s over (H, W), keepdims=%d -> GlobalAveragePool", node.name, keepdims
            )
            count += 1
        if count:
            logger.info(
                "ConvertReduceMeanToGlobalAvgPool: %d ReduceMean -> GlobalAveragePool", count
            )
        return ir.passes.PassResult(model, modified=bool(count))
