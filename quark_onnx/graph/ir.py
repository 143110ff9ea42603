"""Small graph helpers shared by the passes (use-def based, no node-list searches by name)."""

from __future__ import annotations

import itertools
import logging

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import ShapeInferencePass

logger = logging.getLogger(__name__)

#: Metadata key on a value: the largest value the quantization range of that tensor must cover
#: (ConvertClipToRelu writes it; the planner and the equalization passes read it).
RANGE_MAX_KEY = "quark_onnx.range_max"


def constant_array(value: ir.Value | None) -> np.ndarray | None:
    """The value's data if it is an initializer or the output of a Constant node, else None."""
    if value is None:
        return None
    if value.const_value is not None:
        return value.const_value.numpy()
    producer = value.producer()
    if (
        producer is not None
        and producer.op_type == "Constant"
        and producer.domain in ("", "ai.onnx")
    ):
        attr = producer.attributes.get("value")
        if attr is not None:
            return attr.as_tensor().numpy()
        for key, dtype in (("value_float", np.float32), ("value_int", np.int64)):
            if key in producer.attributes:
                return np.array(producer.attributes[key].value, dtype=dtype)
        for key, dtype in (("value_floats", np.float32), ("value_ints", np.int64)):
            if key in producer.attributes:
                return np.array(list(producer.attributes[key].value), dtype=dtype)
    return None


def single_consumer(value: ir.Value) -> ir.Node | None:
    """The only node reading ``value`` (and only once), or None; graph outputs count as readers."""
    if value.is_graph_output():
        return None
    uses = list(value.uses())
    if len(uses) != 1:
        return None
    return uses[0].node


class NameGenerator:
    """Fresh value/node names that do not clash with anything in the graph (built once per pass)."""

    def __init__(self, graph: ir.Graph) -> None:
        self._taken: set[str] = set()
        for v in itertools.chain(graph.inputs, graph.initializers.values()):
            if v.name:
                self._taken.add(v.name)
        for node in ir.traversal.RecursiveGraphIterator(graph):
            if node.name:
                self._taken.add(node.name)
            for out in node.outputs:
                if out.name:
                    self._taken.add(out.name)

    def __call__(self, base: str) -> str:
        name, i = base, 0
        while name in self._taken:
            i += 1
            name = f"{base}_{i}"
        self._taken.add(name)
        return name


def add_initializer(graph: ir.Graph, name: str, array: np.ndarray) -> ir.Value:
    """Register ``array`` as a new initializer called ``name`` (which must be fresh)."""
    value = ir.Value(
        name=name,
        const_value=ir.tensor(array, name=name),
        shape=ir.Shape(array.shape),
        type=ir.TensorType(ir.DataType.from_numpy(array.dtype)),
    )
    graph.register_initializer(value)
    return value


def is_standard(node: ir.Node | None, op: str) -> bool:
    """True when ``node`` is the standard-domain op ``op``."""
    return node is not None and node.op_type == op and node.domain in ("", "ai.onnx")


def remove_unread_dequantize(graph: ir.Graph) -> None:
    """Drop the DequantizeLinear nodes nothing reads any more, then the initializers nothing
    reads (graph inputs stay): what a rewrite that replaced Q/DQ weights by packed ones leaves."""
    for node in list(graph):
        unread = not any(o.uses() or o.is_graph_output() for o in node.outputs)
        if is_standard(node, "DequantizeLinear") and unread:
            graph.remove(node, safe=True)
    for name in [n for n, v in graph.initializers.items() if not v.uses()]:
        if not graph.initializers[name].is_graph_input():
            graph.initializers.pop(name)


def store_constant_input(
    graph: ir.Graph,
    node: ir.Node,
    index: int,
    array: np.ndarray,
    names: NameGenerator,
    suffix: str,
) -> str:
    """Put ``array`` on input ``index`` of ``node``; returns the name of the stored tensor.

    An initializer read only by this input is rewritten in place; one shared with other readers
    (or a graph input/output, or a Constant node's output) is left as it is for them and a fresh
    initializer ``<name>_<suffix>`` is made for ``node``; the old one is dropped once unread.
    """
    value = node.inputs[index]
    exclusive = (
        value.is_initializer()
        and not value.is_graph_input()
        and not value.is_graph_output()
        and len(value.uses()) == 1
    )
    if exclusive:
        value.const_value = ir.tensor(array, name=value.name)
        return value.name
    new = add_initializer(graph, names(f"{value.name or node.name}_{suffix}"), array)
    node.replace_input_with(index, new)
    if not value.uses() and not value.is_graph_output():
        producer = value.producer()
        if producer is not None and producer.op_type == "Constant":
            producer.graph.remove(producer, safe=True)
        elif value.is_initializer() and not value.is_graph_input():
            graph.initializers.pop(value.name)
    return new.name


class _Failure(logging.Filter):
    """Takes onnx_ir's shape-inference failure record (a warning with a traceback) away from the
    log and keeps its exception."""

    def __init__(self) -> None:
        super().__init__()
        self.error: BaseException | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            self.error = record.exc_info[1]
            return False
        return True


def infer_shapes(model: ir.Model, who: str, *, strict: bool = False) -> bool:
    """Run onnx's shape inference on ``model`` in place (onnx_ir's ``ShapeInferencePass``);
    False when it failed, the model left as it was.

    A failure (a bfloat16 Conv, an op the checker does not know) is one warning naming ``who``
    (the pass) and the node the checker names; onnx_ir would log it with a traceback, which is
    kept for the DEBUG level."""
    failure = _Failure()
    source = logging.getLogger("onnx_ir.passes.common.shape_inference")
    source.addFilter(failure)
    try:
        ShapeInferencePass(strict_mode=strict)(model)
    finally:
        source.removeFilter(failure)
    if failure.error is None:
        return True
    text = " ".join(str(failure.error).split())[:400]
    logger.warning(
        "%s: shape inference failed, shapes left unknown: %s: %s",
        who,
        type(failure.error).__name__,
        text,
    )
    logger.debug("%s: shape inference failed", who, exc_info=failure.error)
    return False
