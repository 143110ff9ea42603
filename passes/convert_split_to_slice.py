"""ConvertSplitToSlice: ``Split`` becomes one ``Slice`` per used output (the NPU has no Split).

Maths. ``Split(x, axis=a)`` with sizes ``(n_0, ..., n_{k-1})`` along ``a`` returns
``y_i = x[..., o_i : o_i + n_i, ...]`` (on axis ``a``) with offsets ``o_i = n_0 + ... + n_{i-1}``.
Each used ``y_i`` becomes ``Slice(x, starts=[o_i], ends=[o_i + n_i], axes=[a])`` (step 1). Slices
copy values, so the rewrite is exact.

The sizes come from, in order:

* the ``split`` input (opset >= 13), which must be a constant;
* the ``split`` attribute (opset 11);
* otherwise the size ``D`` of axis ``a``, which must be static: with ``num_outputs = k``
  (opset 18) or ``k`` outputs (opset < 18) the chunks are ``ceil(D / k)`` each and the last one
  ``D - (k - 1) ceil(D / k)`` (for ``k | D`` this is the equal split of opset 11/13).

A negative ``axis`` is normalised with the input's rank. Outputs nobody reads are not sliced.
Not rewritten: a run-time ``split`` input; no sizes given and the axis size unknown (even after
shape inference); sizes that do not match the number of outputs; opset < 10 (attribute-form
Slice).
"""

from __future__ import annotations

import logging
import math

import numpy as np
import onnx_ir as ir

from quark_onnx.graph.ir import NameGenerator, add_initializer, constant_array, infer_shapes
from quark_onnx.passes.base import QuarkPass
from quark_onnx.passes.convert_clip_to_relu import remove_if_unused

logger = logging.getLogger(__name__)

_UNKNOWN = object()


def _explicit_sizes(node: ir.Node) -> list[int] | object | None:
    """Sizes written on the node; None when not given; ``_UNKNOWN`` for a run-time input."""
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        array = constant_array(node.inputs[1])
        if array is None:
            return _UNKNOWN
        return [int(v) for v in np.asarray(array).reshape(-1)]
    if "split" in node.attributes:
        return [int(v) for v in node.attributes.get_ints("split")]
    return None


def _axis(node: ir.Node) -> int | None:
    axis = node.attributes.get_int("axis", 0)
    if axis >= 0:
        return axis
    shape = node.inputs[0].shape
    if shape is None:
        return None
    return axis + shape.rank()


def _split_sizes(node: ir.Node, axis: int) -> list[int] | None:
    sizes = _explicit_sizes(node)
    if sizes is _UNKNOWN:
        return None
    count = len(node.outputs)
    if sizes is None:
        shape = node.inputs[0].shape
        if shape is None or axis >= shape.rank() or not isinstance(shape[axis], int):
            return None
        dim = shape[axis]
        count = node.attributes.get_int("num_outputs", count)
        chunk = math.ceil(dim / count)
        sizes = [chunk] * (count - 1) + [dim - chunk * (count - 1)]
    if len(sizes) != len(node.outputs) or any(s < 0 for s in sizes):
        return None
    return sizes


def _needs_shape(node: ir.Node) -> bool:
    x = node.inputs[0]
    if x.shape is not None:
        return False
    return node.attributes.get_int("axis", 0) < 0 or _explicit_sizes(node) is None


class ConvertSplitToSlice(QuarkPass):
    """Replace Split by one Slice per used output."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        if model.opset_imports.get("", 13) < 10:
            return ir.passes.PassResult(model, modified=False)
        splits = [
            node
            for node in ir.traversal.RecursiveGraphIterator(model.graph)
            if node.op_type == "Split"
            and node.domain == ""
            and node.inputs
            and node.inputs[0] is not None
        ]
        if not splits:
            return ir.passes.PassResult(model, modified=False)
        if any(_needs_shape(node) for node in splits):
            infer_shapes(model, type(self).__name__)
        names = NameGenerator(model.graph)
        count = 0
        for node in splits:
            axis = _axis(node)
            sizes = None if axis is None else _split_sizes(node, axis)
            if sizes is None:
                logger.debug("Split %s: sizes or axis not static, left alone", node.name)
                continue
            self._rewrite(node, axis, sizes, names)
            count += 1
        if count:
            logger.info("ConvertSplitToSlice: %d Split -> Slice", count)
        return ir.passes.PassResult(model, modified=bool(count))

    @staticmethod
    def _rewrite(node: ir.Node, axis: int, sizes: list[int], names: NameGenerator) -> None:
        graph = node.graph
        x = node.inputs[0]
        base = node.name or "Split"
        axes = add_initializer(graph, names(f"{base}/axes"), np.array([axis], dtype=np.int64))
        renames: list[tuple[ir.Value, str | None]] = []
        offset = 0
        for i, (out, size) in enumerate(zip(node.outputs, sizes, strict=True)):
            start, offset = offset, offset + size
            if not (out.uses() or out.is_graph_output()):
                continue
            starts = add_initializer(
                graph, names(f"{base}/starts_{i}"), np.array([start], dtype=np.int64)
            )
            ends = add_initializer(
                graph, names(f"{base}/ends_{i}"), np.array([offset], dtype=np.int64)
            )
            slice_node = ir.Node(
                "", "Slice", [x, starts, ends, axes], name=names(f"{base}/slice_{i}")
            )
            sliced = slice_node.outputs[0]
            sliced.name = names(f"{base}/slice_{i}_output")
            sliced.type = out.type
            if out.type is not None:
                sliced.shape = out.shape
            sliced.metadata_props.update(out.metadata_props)
            graph.insert_before(node, slice_node)
            out.replace_all_uses_with(sliced, replace_graph_outputs=True)
            renames.append((sliced, out.name))
        dropped = [v for v in node.inputs[1:] if v is not None]
        graph.remove(node, safe=True)
        for sliced, name in renames:
            sliced.name = name
        for value in dropped:
            remove_if_unused(graph, value)
        if not axes.uses():
            graph.initializers.pop(axes.name)
