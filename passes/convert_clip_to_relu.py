"""ConvertClipToRelu: ``Clip(x, 0, hi)`` becomes ``Relu(x)``, the bound kept as a range cap.

Maths. ``Clip(x, lo=0, hi) = min(max(x, 0), hi)`` and ``Relu(x) = max(x, 0)``; they agree wherever
``x <= hi`` and differ by ``x - hi`` above it. The upper bound is not thrown away: it is written as
the metadata entry ``quark_onnx.range_max`` (the bound as a decimal string, ``repr`` of the float,
so it round-trips exactly) on the Relu's output value. The quantization plan caps that tensor's
range at ``hi``, so the quantized model saturates at ``hi`` (to within one quantization step),
like the original Clip. When the value already carries a cap, the smaller one is kept.

A Clip with no upper bound (``hi`` absent, +inf or float32's max) is exactly a Relu; no metadata
is written.

Only a Clip that is a layer's activation is rewritten (:func:`is_layer_activation`): its input is
produced by an op the NPU fuses an activation into (Conv, Gemm, MatMul, an Add of two computed
tensors, a pool; BatchNormalization before it is folded). The Clip of hardswish and hardsigmoid
(``x * Clip(x + 3, 0, 6) / 6``) reads an Add with a constant and is left alone: it bounds a gate,
and as a Relu the product grows as ``x^2`` layer after layer until calibration sees Inf.

Handled: bounds as attributes (opset < 11), as initializers or as ``Constant`` node outputs
(opset >= 11), absent bounds (empty optional inputs). Not rewritten:

* a Clip that is not a layer's activation (a graph input, an ``Add`` of a constant, ...);
* ``lo`` absent or not exactly 0 (``Clip(-1, 1)``);
* a bound that is not a constant (computed at run time), or not a scalar;
* ``hi < 0`` (the Clip is then constant ``hi``, not a Relu);
* non-float tensors.

``changes_numerics = True``: the float model's outputs change wherever the clip was active.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from quark_onnx.graph.ir import RANGE_MAX_KEY, constant_array
from quark_onnx.npu.op_sets import FUSING_PRODUCERS
from quark_onnx.passes.base import QuarkPass

logger = logging.getLogger(__name__)

_FLOAT_TYPES = frozenset(
    {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE, ir.DataType.BFLOAT16}
)

_FLOAT32_MAX = float(np.finfo(np.float32).max)

#: Sentinel: the bound exists but is not a compile-time constant scalar.
NOT_CONSTANT = object()


def clip_bounds(node: ir.Node) -> tuple[object, object]:
    """``(lo, hi)`` of a Clip node: a float, ``None`` when absent, or :data:`NOT_CONSTANT`.

    Reads the ``min``/``max`` attributes (opset < 11) when present, else the optional inputs 1
    and 2 (initializers or Constant nodes, which must hold a single element).
    """
    if "min" in node.attributes or "max" in node.attributes:
        lo = node.attributes.get_float("min", None)
        hi = node.attributes.get_float("max", None)
        return lo, hi

    def bound(index: int) -> object:
        if len(node.inputs) <= index or node.inputs[index] is None:
            return None
        array = constant_array(node.inputs[index])
        if array is None or array.size != 1:
            return NOT_CONSTANT
        return float(np.asarray(array).reshape(()))

    return bound(1), bound(2)


def is_float_tensor(value: ir.Value) -> bool:
    """True when the value's element type is a float type (or unknown)."""
    return value.dtype is None or value.dtype in _FLOAT_TYPES


def make_relu_in_place(node: ir.Node) -> list[ir.Value]:
    """Turn a Clip node into a Relu on the same input and output; return the dropped bounds."""
    dropped = [v for v in node.inputs[1:] if v is not None]
    node.op_type = "Relu"
    node.resize_inputs(1)
    node.attributes.clear()
    return dropped


def is_layer_activation(node: ir.Node) -> bool:
    """True when ``node``'s first input is produced by a layer an NPU activation fuses into.

    Layers: :data:`quark_onnx.npu.op_sets.FUSING_PRODUCERS` and BatchNormalization (a Conv once
    folded); an Add or Sub counts only when neither operand is a constant, because ``x + 3`` is
    the shift inside hardswish/hardsigmoid, not a residual connection.
    """
    producer = node.inputs[0].producer() if node.inputs and node.inputs[0] is not None else None
    if producer is None or producer.domain not in ("", "ai.onnx"):
        return False
    if producer.op_type in ("Add", "Sub"):
        return all(constant_array(v) is None for v in producer.inputs)
    return producer.op_type in FUSING_PRODUCERS or producer.op_type == "BatchNormalization"


def record_range_cap(value: ir.Value, hi: float) -> None:
    """Write ``hi`` as ``value``'s range cap (the smaller one when it already has a cap)."""
    previous = value.metadata_props.get(RANGE_MAX_KEY)
    cap = hi if previous is None else min(hi, float(previous))
    value.metadata_props[RANGE_MAX_KEY] = repr(float(cap))


def remove_if_unused(graph: ir.Graph, value: ir.Value) -> None:
    """Drop an initializer or Constant node whose value nothing reads any more."""
    if value.uses() or value.is_graph_output() or value in graph.inputs:
        return
    producer = value.producer()
    if producer is not None:
        if producer.op_type == "Constant" and producer.graph is graph:
            graph.remove(producer, safe=True)
    elif value.is_initializer() and value.name in graph.initializers:
        graph.initializers.pop(value.name)


def float_clips(model: ir.Model) -> list[tuple[ir.Node, object, object]]:
    """Every standard-domain Clip on a float tensor, with its bounds (see :func:`clip_bounds`)."""
    found = []
    for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
        if node.op_type != "Clip" or node.domain != "":
            continue
        if not node.inputs or node.inputs[0] is None or not is_float_tensor(node.inputs[0]):
            continue
        found.append((node, *clip_bounds(node)))
    return found


def replace_by_relu(node: ir.Node) -> None:
    """Turn the Clip ``node`` into a Relu in place and drop bound constants nothing else reads."""
    graph = node.graph
    dropped = make_relu_in_place(node)
    if graph is not None:
        for value in dropped:
            remove_if_unused(graph, value)


class ConvertClipToRelu(QuarkPass):
    """Replace ``Clip(x, 0, hi)`` by ``Relu(x)`` and record ``hi`` as the output's range cap."""

    changes_numerics = True

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        count = 0
        for node, lo, hi in float_clips(model):
            if lo is NOT_CONSTANT or hi is NOT_CONSTANT or lo is None or lo != 0.0:
                continue
            if (hi is not None and hi < 0.0) or not is_layer_activation(node):
                continue
            replace_by_relu(node)
            if hi is not None and hi < _FLOAT32_MAX:
                record_range_cap(node.outputs[0], hi)
            logger.debug("Clip %s (0, %s) -> Relu", node.name, hi)
            count += 1
        if count:
            logger.info("ConvertClipToRelu: %d Clip(0, hi) -> Relu (hi kept as range cap)", count)
        return ir.passes.PassResult(model, modified=bool(count))
