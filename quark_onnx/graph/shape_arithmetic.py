"""Shape arithmetic: the tensors that compute shapes, never data. They are never calibrated or
quantized, in every flow, and the readiness checker does not count their nodes as NPU nodes.

One rule, :func:`shape_values`, marks a value of a graph as shape arithmetic when

* its element type is not float (int64 shapes, indices, booleans), read from the value or, when
  shape inference left it unknown, from the producer's operator schema (``Shape`` -> int64,
  ``Cast`` -> its ``to``, ``Gather``/``Concat``/``Unsqueeze`` -> the type of the input with the
  same type variable); or
* it is computed from ``Shape``/``Size`` outputs and constants only, by shape arithmetic
  (casts, index and concatenation ops, elementwise arithmetic: ``Shape -> Cast(float) -> Div``
  is a float, but its values are a shape's, whatever reads them); or
* every path from it ends in a shape parameter: an input slot whose schema type admits no float
  type (``Reshape.shape``, ``Expand.shape``, ``Tile.repeats``, ``Slice`` starts/ends/axes/steps,
  ``Pad.pads``, ``TopK.K``, ``ConstantOfShape``, ``Unsqueeze``/``Squeeze``/``Reduce*`` axes,
  ``Resize.sizes`` ...), or one of the float parameters listed in :data:`FLOAT_PARAMETERS`
  (``Resize`` roi and scales, ``Upsample`` scales, ``OneHot`` depth), through nodes whose
  outputs are all shape arithmetic (``Div -> Cast(int64) -> Reshape.shape``).

A value read by ``Shape``/``Size`` is data (only its shape is read, so the path proves nothing),
and a graph output is data.
"""

from __future__ import annotations

import functools

import onnx
import onnx_ir as ir

__all__ = ["FLOAT_PARAMETERS", "is_float_value", "is_shape_parameter", "shape_values"]

_STANDARD = ("", "ai.onnx")
_FLOAT_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})
_FLOAT_TYPE_STRS = frozenset(
    {"tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)"}
)
#: ops that read only the shape of their input
_SHAPE_READERS = frozenset({"Shape", "Size"})

#: ops that compute a shape from a shape (and constants): a Gather only when it reads from the
#: shape (a Gather of a constant table at shape-derived indices is data, like position
#: embeddings); ops that build a tensor of a shape (ConstantOfShape, Range, Expand) are not here
_SHAPE_OPS = frozenset(
    {
        "Cast", "CastLike", "Identity", "Gather", "Unsqueeze", "Squeeze", "Concat", "Slice",
        "Reshape", "Add", "Sub", "Mul", "Div", "Mod", "Neg", "Abs", "Floor", "Ceil", "Round",
        "Sqrt", "Max", "Min", "ReduceProd", "ReduceSum", "ReduceMax", "ReduceMin", "Equal",
        "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Not", "And", "Or", "Where",
    }
)  # fmt: skip

#: ops whose integer inputs are quantized data, not parameters: a DequantizeLinear reads int8
#: codes, which are as much data as the float tensor they stand for
_QUANTIZED_DATA_OPS = frozenset(
    {
        "DequantizeLinear", "QuantizeLinear", "DynamicQuantizeLinear", "QLinearConv",
        "QLinearMatMul", "ConvInteger", "MatMulInteger",
    }
)  # fmt: skip

#: (op type, input slot) of float-typed parameters that only set shapes or sampling positions.
FLOAT_PARAMETERS = frozenset({("Resize", 1), ("Resize", 2), ("Upsample", 1), ("OneHot", 1)})


@functools.lru_cache(maxsize=512)
def _schema(op_type: str) -> onnx.defs.OpSchema | None:
    try:
        return onnx.defs.get_schema(op_type)
    except onnx.defs.SchemaError:
        return None


def _formal(formals, slot: int):
    """The schema formal of ``slot`` (the last one when it is variadic), or None."""
    if slot < len(formals):
        return formals[slot]
    if formals and formals[-1].option == onnx.defs.OpSchema.FormalParameterOption.Variadic:
        return formals[-1]
    return None


def _allowed(schema: onnx.defs.OpSchema, type_str: str) -> frozenset[str]:
    for constraint in schema.type_constraints:
        if constraint.type_param_str == type_str:
            return frozenset(constraint.allowed_type_strs)
    return frozenset({type_str})


def is_shape_parameter(node: ir.Node, slot: int) -> bool:
    """Input ``slot`` of ``node`` takes a shape or index parameter: its schema type admits no
    float type, or it is one of :data:`FLOAT_PARAMETERS`."""
    if node.domain not in _STANDARD or node.op_type in _QUANTIZED_DATA_OPS:
        return False
    if (node.op_type, slot) in FLOAT_PARAMETERS:
        return True
    schema = _schema(node.op_type)
    formal = _formal(schema.inputs, slot) if schema is not None else None
    if formal is None:
        return False
    allowed = _allowed(schema, formal.type_str)
    if not any(t in _FLOAT_TYPE_STRS for t in allowed):
        # a parameter slot of an op that computes on float data (not an integer op's input)
        return any(
            any(t in _FLOAT_TYPE_STRS for t in _allowed(schema, f.type_str))
            for f in (*schema.inputs, *schema.outputs)
        )
    return False


def is_float_value(value: ir.Value, _memo: dict[int, bool | None] | None = None) -> bool:
    """``value`` holds floats, or its type is unknown even to the producer's schema."""
    known = _float_kind(value, {} if _memo is None else _memo)
    return known is not False


def _float_kind(value: ir.Value, memo: dict[int, bool | None]) -> bool | None:
    """True/False: float or not; None: unknown."""
    if value.dtype is not None:
        return value.dtype in _FLOAT_TYPES
    key = id(value)
    if key in memo:
        return memo[key]
    memo[key] = None  # a cycle (never in a valid graph) stays unknown
    memo[key] = kind = _schema_kind(value, memo)
    return kind


def _schema_kind(value: ir.Value, memo: dict[int, bool | None]) -> bool | None:
    node = value.producer()
    if node is None or node.domain not in _STANDARD:
        return None
    if node.op_type == "Cast":
        to = node.attributes.get_int("to", None)
        return None if to is None else ir.DataType(to) in _FLOAT_TYPES
    if node.op_type == "CastLike" and len(node.inputs) > 1 and node.inputs[1] is not None:
        return _float_kind(node.inputs[1], memo)
    schema = _schema(node.op_type)
    if schema is None:
        return None
    index = next((i for i, out in enumerate(node.outputs) if out is value), None)
    formal = _formal(schema.outputs, index) if index is not None else None
    if formal is None:
        return None
    allowed = _allowed(schema, formal.type_str)
    if not any(t in _FLOAT_TYPE_STRS for t in allowed):
        return False
    if len(allowed) == 1:
        return True
    for slot, inp in enumerate(node.inputs):
        in_formal = _formal(schema.inputs, slot)
        if inp is not None and in_formal is not None and in_formal.type_str == formal.type_str:
            kind = _float_kind(inp, memo)
            if kind is not None:
                return kind
    return None


def _is_constant(value: ir.Value) -> bool:
    if value.const_value is not None:
        return True
    node = value.producer()
    return node is not None and node.op_type == "Constant" and node.domain in _STANDARD


def shape_values(graph: ir.Graph) -> set[int]:
    """``id`` of every value of ``graph``'s top level that is shape arithmetic (module doc)."""
    nodes = list(graph)
    memo: dict[int, bool | None] = {}
    not_float: set[int] = set()
    shapes: set[int] = set()  # derived from shapes, or read only as shapes
    # forward: computed from Shape/Size outputs and constants only
    for node in nodes:
        derived = node.domain in _STANDARD and (
            node.op_type in _SHAPE_READERS
            or (
                node.op_type in _SHAPE_OPS
                and any(v is not None and id(v) in shapes for v in node.inputs)
                and all(v is None or id(v) in shapes or _is_constant(v) for v in node.inputs)
                and (node.op_type != "Gather" or id(node.inputs[0]) in shapes)
            )
        )
        for out in node.outputs:
            if derived:
                shapes.add(id(out))
            if _float_kind(out, memo) is False:
                not_float.add(id(out))
    # backward (consumers first): every path ends in a shape parameter
    for node in reversed(nodes):
        for out in node.outputs:
            if id(out) not in shapes and _feeds_only_shapes(out, shapes):
                shapes.add(id(out))
    for value in graph.inputs:
        if _float_kind(value, memo) is False:
            not_float.add(id(value))
    return shapes | not_float


def _feeds_only_shapes(value: ir.Value, shapes: set[int]) -> bool:
    if value.is_graph_output():
        return False
    uses = list(value.uses())
    if not uses:
        return False
    for use in uses:
        node, slot = use.node, use.idx
        if node.domain not in _STANDARD or node.op_type in _SHAPE_READERS:
            return False
        if is_shape_parameter(node, slot):
            continue
        if not node.outputs or not all(id(out) in shapes for out in node.outputs):
            return False
    return True
