"""What :class:`~quark_onnx.accuracy.replay.Replay` reads of a model, in either form.

A ``ModelProto`` is read as it is. An ``ir.Model`` (the working model of the pipeline) is read
without serializing it: the replay sees each node as a :class:`IRNode` (the names of its inputs
and outputs) and each initializer as its ``ir.Value``; a node or tensor becomes a proto only when
a segment holding it builds its session (:func:`node_proto`, :func:`tensor_proto`), with the
value the model holds then. Both forms give the replay the same names, element types and
segment protos, so the values it computes are the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir

__all__ = ["IRNode", "ReplayGraph", "Tensor", "node_proto", "tensor_array", "tensor_proto"]

#: An initializer as the replay holds it.
Tensor = onnx.TensorProto | ir.Value


@dataclass(frozen=True)
class IRNode:
    """A node of an ``ir.Model`` seen as the replay reads a ``NodeProto`` (names of its inputs
    and outputs, ``""`` for an omitted one)."""

    node: ir.Node
    input: tuple[str, ...]
    output: tuple[str, ...]

    @classmethod
    def of(cls, node: ir.Node) -> IRNode:
        names = tuple((v.name or "") if v is not None else "" for v in node.inputs)
        return cls(node, names, tuple(v.name or "" for v in node.outputs))

    @property
    def op_type(self) -> str:
        return self.node.op_type

    @property
    def domain(self) -> str:
        return self.node.domain

    @property
    def name(self) -> str:
        return self.node.name or ""


@dataclass
class ReplayGraph:
    """The top-level graph of a model as the replay reads it.

    Attributes:
        nodes: in graph order, ``NodeProto`` or :class:`IRNode`.
        initializers: name -> ``TensorProto`` or ``ir.Value``.
        types: value name -> ONNX element type, where the model declares one (initializers:
            their tensor's type).
        opsets, ir_version: those of the model (for the segments' models).
        inputs, outputs: the graph's input and output names.
    """

    nodes: list[onnx.NodeProto | IRNode]
    initializers: dict[str, Tensor]
    types: dict[str, int]
    opsets: list[onnx.OperatorSetIdProto]
    ir_version: int
    inputs: list[str]
    outputs: list[str]

    @classmethod
    def of(cls, model: onnx.ModelProto | ir.Model) -> ReplayGraph:
        if isinstance(model, ir.Model):
            return cls._of_ir(model)
        g = model.graph
        types: dict[str, int] = {}
        for vi in [*g.input, *g.output, *g.value_info]:
            if vi.type.HasField("tensor_type"):
                types[vi.name] = vi.type.tensor_type.elem_type
        for t in g.initializer:
            types[t.name] = t.data_type
        return cls(
            list(g.node),
            {t.name: t for t in g.initializer},
            types,
            list(model.opset_import),
            model.ir_version,
            [v.name for v in g.input],
            [v.name for v in g.output],
        )

    @classmethod
    def _of_ir(cls, model: ir.Model) -> ReplayGraph:
        """What :meth:`of` reads from the model's serialized form: the types its value infos
        would declare (tensor-typed values), its initializers' tensor types."""
        graph = model.graph
        types: dict[str, int] = {}
        values = [*graph.inputs, *graph.outputs, *(o for node in graph for o in node.outputs)]
        for value in values:
            if value.name and isinstance(value.type, ir.TensorType):
                types[value.name] = value.type.dtype.value
        initializers: dict[str, Tensor] = {}
        for name, value in graph.initializers.items():
            if value.const_value is not None:  # (serialization skips those too)
                initializers[name] = value
                types[name] = value.const_value.dtype.value
        return cls(
            [IRNode.of(node) for node in graph],
            initializers,
            types,
            [onnx.helper.make_opsetid(d, v) for d, v in model.opset_imports.items()],
            model.ir_version,
            [v.name or "" for v in graph.inputs],
            [v.name or "" for v in graph.outputs],
        )


def tensor_array(tensor: Tensor) -> np.ndarray:
    """The values of an initializer."""
    if isinstance(tensor, ir.Value):
        assert tensor.const_value is not None
        return tensor.const_value.numpy()
    return onnx.numpy_helper.to_array(tensor)


def tensor_proto(name: str, tensor: Tensor) -> onnx.TensorProto:
    """An initializer as a ``TensorProto`` named ``name`` (an ``ir.Value``: serialized now)."""
    if not isinstance(tensor, ir.Value):
        return tensor
    assert tensor.const_value is not None
    proto = ir.serde.serialize_tensor(tensor.const_value)
    proto.name = name  # as the model's serialization names it
    return proto


def node_proto(node: onnx.NodeProto | IRNode) -> onnx.NodeProto:
    """A node as a ``NodeProto`` (an :class:`IRNode`: serialized now)."""
    return ir.serde.serialize_node(node.node) if isinstance(node, IRNode) else node
