"""The graph walk behind :func:`quark_onnx.formats.importer.read_qdq`: find every quantization
pattern (QuantizeLinear/DequantizeLinear pairs, dequantized constants, float16/bfloat16 Cast pairs)
with its parameters, refuse what cannot be read back (naming the node), and remove the patterns to
leave the float model.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np
import onnx_ir as ir

from quark_onnx.config.enums import QuantType
from quark_onnx.errors import QuantizationError
from quark_onnx.graph.ir import NameGenerator, add_initializer, constant_array
from quark_onnx.params import qparams
from quark_onnx.params.qparams import QuantParams

_STANDARD = ("", "ai.onnx")
#: Domains whose QuantizeLinear/DequantizeLinear have the standard semantics.
_QDQ_DOMAINS = (*_STANDARD, "com.microsoft")
_Q = "QuantizeLinear"
_DQ = "DequantizeLinear"
#: Ops of the QOperator format / integer arithmetic: quantization fused into the operator.
_QOPERATOR = frozenset(
    {
        "QLinearConv",
        "QLinearMatMul",
        "MatMulInteger",
        "ConvInteger",
        "QLinearAdd",
        "QLinearMul",
        "QLinearSigmoid",
        "QLinearLeakyRelu",
        "QLinearAveragePool",
        "QLinearGlobalAveragePool",
        "QLinearConcat",
        "QLinearSoftmax",
        "QLinearReduceMean",
        "QLinearWhere",
        "QGemm",
        "QAttention",
        "QEmbedLayerNormalization",
        "DynamicQuantizeMatMul",
        "DynamicQuantizeLSTM",
        "MatMulIntegerToFloat",
        "MatMulNBits",
        "MatMulBnb4",
        "QOrderedMatMul",
    }
)
_CAST_TYPES = {
    ir.DataType.FLOAT16: QuantType.QFloat16,
    ir.DataType.BFLOAT16: QuantType.QBFloat16,
}
_DQ_SUFFIX = re.compile(r"_DequantizeLinear_Output(_\d+)?$")
_CAST_SUFFIX = re.compile(r"_Cast(Float)?_Output(_\d+)?$")


class QDQImportError(QuantizationError):
    """A QDQ model holds a construct that cannot be read back into float model + parameters."""


@dataclass
class _Found:
    key: str
    params: QuantParams
    shape: tuple[int, ...] | None
    order: tuple[float, int, int]
    node: str


def refuse_unsupported(graph: ir.Graph, label: str) -> None:
    for node in graph:
        name = node.name or f"<{node.op_type} node>"
        if node.op_type in _QOPERATOR:
            raise QDQImportError(
                f"{label}: node {name!r} is {node.op_type} (QOperator format: quantization fused "
                "into the operator), which cannot be read back as QDQ; export the model in QDQ "
                "format (onnxruntime: quant_format=QuantFormat.QDQ)"
            )
        quantish = any(k in node.op_type for k in ("Quantize", "Dequantize", "QLinear"))
        if quantish and node.domain not in _QDQ_DOMAINS:
            raise QDQImportError(
                f"{label}: node {name!r} is {node.op_type} of the custom domain "
                f"{node.domain!r}; only the standard QuantizeLinear/DequantizeLinear are read: "
                "export with standard-domain QDQ (AMD Quark: do not use the custom Vitis ops, "
                "e.g. extra option UseQDQVitisCustomOps=False or a standard quant type)"
            )
        if node.op_type == "DynamicQuantizeLinear" and node.domain not in _STANDARD:
            raise QDQImportError(
                f"{label}: node {name!r}: DynamicQuantizeLinear of domain "
                f"{node.domain!r} is not read"
            )


def _is(node: ir.Node | None, op_type: str) -> bool:
    if node is None or node.op_type != op_type:
        return False
    domains = _QDQ_DOMAINS if op_type in (_Q, _DQ) else _STANDARD
    return node.domain in domains


def _const(value: ir.Value | None) -> np.ndarray | None:
    return None if value is None else constant_array(value)


def _scale_and_zero(node: ir.Node) -> tuple[ir.Value | None, ir.Value | None]:
    """The (optional) scale and zero-point inputs of a QuantizeLinear/DequantizeLinear."""
    inputs = node.inputs
    return (inputs[1] if len(inputs) > 1 else None, inputs[2] if len(inputs) > 2 else None)


def _is_symmetric(zero: np.ndarray, qtype: QuantType) -> bool:
    """Every zero point is ``qtype``'s symmetric one (0, or the middle code when unsigned)."""
    return bool(np.all(zero.astype(np.int64) == qtype.symmetric_zero_point))


def _qtype_of(dtype: np.dtype, where: str) -> QuantType:
    for qtype in QuantType:
        if qtype in qparams.CAST_TYPES:
            continue
        if qparams.numpy_dtype(qtype) == dtype:
            return qtype
    raise QDQImportError(f"{where}: quantized type {dtype} is not supported")


def _static_shape(value: ir.Value) -> tuple[int, ...] | None:
    shape = value.shape
    if shape is None or not shape.is_static():
        return None
    return tuple(int(d) for d in shape)


def _constant_key(dq_out: ir.Value, fallback: str) -> str:
    name = dq_out.name or fallback
    stripped = _DQ_SUFFIX.sub("", name)
    return stripped or name


class QDQReader:
    """One pass over the graph: find the patterns, then (optionally) remove them."""

    def __init__(self, graph: ir.Graph, label: str) -> None:
        self.graph = graph
        self.label = label
        self.init_index = {name: i for i, name in enumerate(graph.initializers)}
        self.node_index = {id(n): i for i, n in enumerate(graph)}
        # removal work, recorded during the scan
        self.activations: list[tuple[ir.Value, list[ir.Value], list[ir.Node], str]] = []
        self.constants: list[tuple[str, ir.Value, np.ndarray, list[ir.Node], ir.DataType]] = []
        self.dead_inputs: list[ir.Value] = []

    # -- scanning ---------------------------------------------------------------------------

    def _where(self, node: ir.Node) -> str:
        return f"{self.label}: node {node.name or node.op_type!r}"

    def _order(self, node: ir.Node, values: Iterable[ir.Value | None]) -> tuple[float, int, int]:
        """Sort key reproducing the writer's processing order (see the module docstring).

        Patterns with initializers sort by the first one. The others sort after them by the
        position of their input's producer; the writer puts each pattern right after that
        producer, so of two patterns on one producer the later-written one comes first, and
        graph inputs' patterns (no producer) go before the first node in writing order.
        """
        idx = [
            self.init_index[v.name]
            for v in values
            if v is not None and v.name in self.init_index and v.is_initializer()
        ]
        position = self.node_index[id(node)]
        if idx:
            return float(min(idx)), 0, position
        source = node.inputs[0] if node.inputs else None
        producer = source.producer() if source is not None else None
        if producer is None or id(producer) not in self.node_index:
            return float("inf"), -1, position
        return float("inf"), self.node_index[id(producer)], -position

    def scan(self) -> list[_Found]:
        found: dict[str, _Found] = {}
        claimed_q: set[int] = set()
        for node in list(self.graph):
            item = None
            if _is(node, _DQ):
                item = self._dequantize(node, claimed_q)
            elif _is(node, "Cast"):
                item = self._cast(node)
            if item is None:
                continue
            previous = found.get(item.key)
            if previous is not None:
                if not _same_params(previous.params, item.params):
                    raise QDQImportError(
                        f"{self._where(node)}: tensor {item.key!r} is quantized twice with "
                        f"different parameters (also by node {previous.node!r}); one tensor has "
                        "one set of parameters in a recipe"
                    )
                continue
            found[item.key] = item
        for node in self.graph:
            if _is(node, _Q) and id(node) not in claimed_q:
                raise QDQImportError(
                    f"{self._where(node)}: QuantizeLinear output is not read by a "
                    "DequantizeLinear; integer tensors flowing into other ops (QOperator style) "
                    "cannot be read back"
                )
        return list(found.values())

    def _params_from(
        self, node: ir.Node, scale: np.ndarray | None, zero: np.ndarray | None, dtype: np.dtype
    ) -> QuantParams:
        where = self._where(node)
        qtype = _qtype_of(dtype, where)
        if scale is None:
            raise QDQImportError(f"{where}: the scale is not a constant")
        axis = None
        block = None
        if zero is not None and zero.shape != scale.shape and zero.size == scale.size:
            zero = zero.reshape(scale.shape)
        if scale.size == 1 and "axis" not in node.attributes:
            # a one-element 1-D scale (onnxruntime's int32 bias) is per tensor
            scale = scale.reshape(())
            zero = None if zero is None else zero.reshape(())
        if scale.ndim > 0:
            axis_attr = node.attributes.get("axis")
            axis = int(axis_attr.value) if axis_attr is not None else 1
            block_attr = node.attributes.get("block_size")
            block = int(block_attr.value) if block_attr is not None and block_attr.value else None
        if zero is None:
            zero = np.zeros(scale.shape, dtype=qparams.numpy_dtype(qtype))
        symmetric = _is_symmetric(zero, qtype)
        return QuantParams(
            qtype=qtype,
            scale=np.array(scale, copy=True),
            zero_point=np.array(zero, copy=True).astype(qparams.numpy_dtype(qtype)),
            axis=axis,
            block_size=block,
            symmetric=symmetric,
        )

    def _dequantize(self, dq: ir.Node, claimed_q: set[int]) -> _Found | None:
        where = self._where(dq)
        source = dq.inputs[0]
        if source is None:
            raise QDQImportError(f"{where}: DequantizeLinear without input")
        scale_v, zero_v = _scale_and_zero(dq)
        out = dq.outputs[0]
        codes = _const(source)
        if codes is not None:
            scale = _const(scale_v)
            zero = _const(zero_v)
            p = self._params_from(dq, scale, zero, codes.dtype)
            p = replace(p, codes=np.array(codes, copy=True))
            key = _constant_key(out, source.name or "")
            p.validate(tuple(codes.shape), key)
            folded = qparams.dequantize(codes, p)
            out_type = out.type.dtype if out.type is not None else ir.DataType.FLOAT
            self.constants.append((key, out, folded, [dq], out_type))
            return _Found(
                key,
                p,
                tuple(int(d) for d in codes.shape),
                self._order(dq, (source, scale_v, zero_v)),
                dq.name or "",
            )
        producer = source.producer()
        if _is(producer, _Q):
            return self._pair(producer, dq, claimed_q)
        if producer is not None and _is(producer, "DynamicQuantizeLinear"):
            x = producer.inputs[0]
            if list(dq.inputs[1:]) != list(producer.outputs[1:3]):
                raise QDQImportError(
                    f"{where}: reads DynamicQuantizeLinear {producer.name!r}'s codes with other "
                    "scale/zero point than it computed"
                )
            p = QuantParams(qtype=QuantType.QUInt8, dynamic=True, symmetric=False)
            key = self._activation_key(x, [out], where)
            self.activations.append((x, [out], [dq, producer], key))
            claimed_q.add(id(producer))
            return _Found(key, p, _static_shape(x), self._order(producer, ()), dq.name or "")
        if source.is_graph_input():
            raise QDQImportError(
                f"{where}: dequantizes the graph input {source.name!r} (the model takes "
                "quantized inputs); only float-input QDQ models can be read"
            )
        raise QDQImportError(
            f"{where}: its input {source.name!r} is neither a constant nor a QuantizeLinear "
            f"output (produced by {producer.op_type if producer else 'nothing'}); not a QDQ "
            "pattern this reader knows"
        )

    def _pair(self, q: ir.Node, dq: ir.Node, claimed_q: set[int]) -> _Found:
        where = self._where(dq)
        x = q.inputs[0]
        if x is None:
            raise QDQImportError(f"{self._where(q)}: QuantizeLinear without input")
        q_scale_v, q_zero_v = _scale_and_zero(q)
        dq_scale_v, dq_zero_v = _scale_and_zero(dq)
        q_scale, dq_scale = _const(q_scale_v), _const(dq_scale_v)
        q_zero, dq_zero = _const(q_zero_v), _const(dq_zero_v)
        q_out_type = q.outputs[0].type
        dynamic = q_scale is None
        if dynamic:
            if q_scale_v is not dq_scale_v or q_zero_v is not dq_zero_v:
                raise QDQImportError(
                    f"{where}: dequantizes with other run-time parameters than QuantizeLinear "
                    f"{q.name!r} used"
                )
            zero = q_zero
            if zero is not None:
                dtype = zero.dtype
            elif q_out_type is not None and q_zero_v is None:
                dtype = ir.DataType(q_out_type.dtype).numpy()
                zero = np.zeros((), dtype=dtype)
            else:
                raise QDQImportError(
                    f"{where}: a run-time zero point is not supported (only run-time scales)"
                )
            qtype = _qtype_of(np.dtype(dtype), where)
            symmetric = _is_symmetric(zero, qtype)
            p = QuantParams(qtype=qtype, dynamic=True, symmetric=symmetric)
        else:
            if not _same_array(q_scale, dq_scale) or not _same_array(q_zero, dq_zero):
                raise QDQImportError(
                    f"{where}: dequantizes with other parameters than QuantizeLinear {q.name!r} "
                    "(requantization); not one parameter set per tensor"
                )
            if q_zero is not None:
                dtype = q_zero.dtype
            elif q_out_type is not None:
                dtype = ir.DataType(q_out_type.dtype).numpy()
            else:
                dtype = np.dtype(np.uint8)  # QuantizeLinear's default
            p = self._params_from(q, q_scale, q_zero, np.dtype(dtype))
            for attr in ("axis", "block_size"):
                if _attr(q, attr) != _attr(dq, attr):
                    raise QDQImportError(
                        f"{where}: {attr} differs from QuantizeLinear {q.name!r}'s"
                    )
        q_uses = [u.node for u in q.outputs[0].uses()]
        dqs = [n for n in q_uses if _is(n, _DQ)]
        if len(dqs) != len(q_uses) or q.outputs[0].is_graph_output():
            raise QDQImportError(
                f"{self._where(q)}: QuantizeLinear output is also read by a node other than "
                "DequantizeLinear; cannot be read back"
            )
        key = self._activation_key(x, [d.outputs[0] for d in dqs], where)
        if id(q) not in claimed_q:
            claimed_q.add(id(q))
            self.activations.append((x, [d.outputs[0] for d in dqs], [*dqs, q], key))
        return _Found(
            key,
            p,
            _static_shape(x),
            self._order(q, (q_scale_v, q_zero_v)),
            q.name or "",
        )

    def _activation_key(self, x: ir.Value, outs: list[ir.Value], where: str) -> str:
        outputs = [o for o in outs if o.is_graph_output()]
        if not outputs:
            return x.name or ""
        if len(outputs) > 1:
            raise QDQImportError(f"{where}: one tensor dequantized into several graph outputs")
        if x.is_graph_input() or x.is_graph_output():
            raise QDQImportError(
                f"{where}: graph output {outputs[0].name!r} is the quantized copy of the graph "
                f"input/output {x.name!r}; the float model could not keep both names"
            )
        return outputs[0].name or ""

    def _cast(self, node: ir.Node) -> _Found | None:
        """``X -> Cast(f16|bf16) -> Cast(float)`` or a f16/bf16 constant -> Cast(float)."""
        if _cast_to(node) is not ir.DataType.FLOAT:
            return None
        x = node.inputs[0]
        if x is None:
            return None
        stored = _const(x)
        if stored is not None:
            dtype = ir.DataType.from_numpy(stored.dtype)
            if dtype not in _CAST_TYPES:
                return None
            key = _DQ_SUFFIX.sub("", _CAST_SUFFIX.sub("", node.outputs[0].name or "")) or (
                x.name or ""
            )
            p = QuantParams(qtype=_CAST_TYPES[dtype], codes=np.array(stored, copy=True))
            folded = stored.astype(np.float32)
            self.constants.append((key, node.outputs[0], folded, [node], ir.DataType.FLOAT))
            return _Found(
                key,
                p,
                tuple(int(d) for d in stored.shape),
                self._order(node, (x,)),
                node.name or "",
            )
        first = x.producer()
        if first is None or not _is(first, "Cast") or _cast_to(first) not in _CAST_TYPES:
            return None
        source = first.inputs[0]
        if source is None or (source.type is not None and source.type.dtype != ir.DataType.FLOAT):
            return None
        if len(list(x.uses())) != 1 or x.is_graph_output():
            return None  # the narrow value is used as such: part of the model, not a pair
        qtype = _CAST_TYPES[_cast_to(first)]
        out = node.outputs[0]
        key = self._activation_key(source, [out], self._where(node))
        self.activations.append((source, [out], [node, first], key))
        return _Found(
            key,
            QuantParams(qtype=qtype),
            _static_shape(source),
            self._order(first, ()),
            first.name or "",
        )

    # -- removal ----------------------------------------------------------------------------

    def remove_patterns(self) -> None:
        graph = self.graph
        removed: list[ir.Node] = []
        inputs_to_check: list[ir.Value] = []
        for x, outs, nodes, key in self.activations:
            for out in outs:
                as_output = out.is_graph_output()
                if x.type is None and out.type is not None:
                    x.type = out.type
                if x.shape is None and out.shape is not None:
                    x.shape = out.shape
                out.replace_all_uses_with(x, replace_graph_outputs=as_output)
            if x.name != key:
                x.name = key
            for n in nodes:
                inputs_to_check.extend(v for v in n.inputs if v is not None)
            removed.extend(nodes)
        for _, out, _, _, _ in self.constants:
            out.name = None  # the folded weight takes the dequantized output's place and name
        fresh = NameGenerator(graph)
        for key, out, folded, nodes, dtype in self.constants:
            for n in nodes:
                inputs_to_check.extend(v for v in n.inputs if v is not None)
            array = folded.astype(dtype.numpy()) if dtype in _FLOAT_TYPES else folded
            value = add_initializer(graph, fresh(key), array)
            out.replace_all_uses_with(value, replace_graph_outputs=out.is_graph_output())
            removed.extend(nodes)
        graph.remove(set(removed), safe=True)
        self._drop_dead(inputs_to_check)

    def _drop_dead(self, values: list[ir.Value]) -> None:
        """Remove initializers and nodes that fed only the removed patterns (scale, zero point,
        codes, run-time scale subgraphs), following producers upwards."""
        graph = self.graph
        stack = list(values)
        while stack:
            value = stack.pop()
            if value.uses() or value.is_graph_output() or value.is_graph_input():
                continue
            if value.is_initializer():
                if value.name in graph.initializers and graph.initializers[value.name] is value:
                    graph.initializers.pop(value.name)
                continue
            producer = value.producer()
            if producer is None or producer.graph is not graph:
                continue
            if any(o.uses() or o.is_graph_output() for o in producer.outputs):
                continue
            stack.extend(v for v in producer.inputs if v is not None)
            graph.remove(producer, safe=True)


_FLOAT_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE)


def _cast_to(node: ir.Node) -> ir.DataType | None:
    attr = node.attributes.get("to")
    if attr is None:
        return None
    try:
        return ir.DataType(int(attr.value))
    except ValueError:
        return None


def _attr(node: ir.Node, name: str) -> object:
    attr = node.attributes.get(name)
    return None if attr is None else attr.value


def _same_array(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


def _same_params(a: QuantParams, b: QuantParams) -> bool:
    return (
        a.qtype is b.qtype
        and a.axis == b.axis
        and a.block_size == b.block_size
        and a.dynamic == b.dynamic
        and _same_array(a.scale, b.scale)
        and _same_array(a.zero_point, b.zero_point)
        and _same_array(a.codes, b.codes)
    )
