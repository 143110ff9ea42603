"""The graph forms InsertQDQ writes for one tensor (see :mod:`quark_onnx.passes.insert_qdq`).

One :class:`QDQWriter` per run: it names every value and node through one
:class:`~quark_onnx.graph.ir.NameGenerator` and places every node from the graph's order at
the start of the run, so the output is the same for the same input. It writes the static,
dynamic and Cast forms of an activation, the codes + DequantizeLinear (or Cast) form of a
constant, and embedding tables in the gathered-rows form (:mod:`._qdq_gathered`).
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from quark_onnx.config.enums import QuantType
from quark_onnx.graph.ir import NameGenerator, add_initializer
from quark_onnx.params import qparams
from quark_onnx.params.qparams import QuantParams
from quark_onnx.passes._qdq_gathered import _GATHERED_MARK, _gathers_rows

# the pass's logger: these are InsertQDQ's messages, and the CLI prints the logger's name
logger = logging.getLogger("quark_onnx.passes.insert_qdq")


def _replace_node_uses(value: ir.Value, out: ir.Value) -> None:
    """Point every node input reading ``value`` at ``out``; a graph output that is ``value``
    itself (a graph input or initializer listed as an output) keeps reading the float value
    (onnx_ir's ``replace_all_uses_with`` refuses graph outputs)."""
    for use in list(value.uses()):
        use.node.replace_input_with(use.idx, out)


def _ir_dtype(qtype: QuantType) -> ir.DataType:
    return ir.DataType.from_numpy(qparams.numpy_dtype(qtype))


def _granularity_attributes(params: QuantParams) -> dict[str, ir.Attr]:
    attrs: dict[str, ir.Attr] = {}
    if params.axis is not None:
        attrs["axis"] = ir.AttrInt64("axis", int(params.axis))
    if params.block_size is not None:
        attrs["block_size"] = ir.AttrInt64("block_size", int(params.block_size))
    return attrs


class QDQWriter:
    """Writes the Q/DQ forms into ``graph`` (one instance per run of the pass).

    Args:
        graph: the graph written; its node order is read once, here.
        quantized: filled with constant -> the initializer of its codes (the pass's
            :attr:`~quark_onnx.passes.insert_qdq.InsertQDQ.quantized`).
    """

    def __init__(self, graph: ir.Graph, quantized: dict[str, ir.Value]) -> None:
        self.quantized = quantized
        self._names = NameGenerator(graph)
        self._first = next(iter(graph), None)
        self._order = {id(node): i for i, node in enumerate(graph)}
        #: value -> the value that took its place (a Gather output rebuilt by _gathered_table)
        self.moved: dict[int, ir.Value] = {}

    def _parameters(
        self, graph: ir.Graph, base: str, params: QuantParams
    ) -> tuple[ir.Value, ir.Value]:
        assert params.scale is not None and params.zero_point is not None
        scale = add_initializer(
            graph, self._names(f"{base}_scale"), np.asarray(params.scale, dtype=np.float32)
        )
        zero_point = add_initializer(
            graph, self._names(f"{base}_zero_point"), np.asarray(params.zero_point)
        )
        return scale, zero_point

    def _output_value(self, value: ir.Value, suffix: str, input_suffix: str) -> ir.Value:
        """The value that replaces ``value`` for its consumers (and keeps a graph output's name).

        Must be called before the intermediate names are drawn (the legacy naming order).
        """
        name = value.name or ""
        if value.is_graph_output() and value.is_graph_input():
            logger.warning(
                "tensor %s is both a graph input and output; the output stays float", name
            )
        if value.is_graph_output() and not value.is_graph_input():
            value.name = self._names(f"{name}_{input_suffix}")
            return ir.Value(name=name, shape=value.shape, type=value.type)
        return ir.Value(name=self._names(f"{name}_{suffix}"), shape=value.shape, type=value.type)

    def _rewire(self, value: ir.Value, out: ir.Value) -> None:
        as_output = value.is_graph_output() and not value.is_graph_input()
        if value.is_graph_output() and not as_output:
            _replace_node_uses(value, out)
            return
        value.replace_all_uses_with(out, replace_graph_outputs=as_output)

    def _place_after(self, graph: ir.Graph, value: ir.Value, nodes: list[ir.Node]) -> None:
        producer = value.producer()
        if producer is not None and producer.graph is graph:
            graph.insert_after(producer, nodes)
        elif self._first is not None:
            graph.insert_before(self._first, nodes)
        else:
            graph.extend(nodes)

    def _qdq_nodes(
        self,
        value: ir.Value,
        name: str,
        params: QuantParams,
        scale: ir.Value,
        zero_point: ir.Value,
        dq_out: ir.Value,
    ) -> list[ir.Node]:
        q_out = ir.Value(
            name=self._names(f"{name}_QuantizeLinear_Output"),
            shape=value.shape,
            type=ir.TensorType(_ir_dtype(params.qtype)),
        )
        attrs = _granularity_attributes(params)
        q = ir.Node(
            "",
            "QuantizeLinear",
            [value, scale, zero_point],
            attributes=attrs,
            outputs=[q_out],
            name=self._names(f"{name}_QuantizeLinear"),
        )
        dq = ir.Node(
            "",
            "DequantizeLinear",
            [q_out, scale, zero_point],
            attributes=_granularity_attributes(params),
            outputs=[dq_out],
            name=self._names(f"{name}_DequantizeLinear"),
        )
        return [q, dq]

    def activation(self, graph: ir.Graph, value: ir.Value, params: QuantParams) -> None:
        name = value.name or ""
        scale, zero_point = self._parameters(graph, name, params)
        dq_out = self._output_value(value, "DequantizeLinear_Output", "QuantizeLinear_Input")
        self._rewire(value, dq_out)
        nodes = self._qdq_nodes(value, name, params, scale, zero_point, dq_out)
        self._place_after(graph, value, nodes)

    def dynamic_activation(self, graph: ir.Graph, value: ir.Value, params: QuantParams) -> None:
        name = value.name or ""
        qtype = params.qtype
        dq_out = self._output_value(value, "DequantizeLinear_Output", "QuantizeLinear_Input")
        self._rewire(value, dq_out)
        scalar = ir.Shape([])
        f32 = ir.TensorType(ir.DataType.FLOAT)
        if not params.symmetric:  # uint8: DynamicQuantizeLinear
            q_out = ir.Value(
                name=self._names(f"{name}_QuantizeLinear_Output"),
                shape=value.shape,
                type=ir.TensorType(ir.DataType.UINT8),
            )
            scale = ir.Value(name=self._names(f"{name}_scale"), shape=scalar, type=f32)
            zero_point = ir.Value(
                name=self._names(f"{name}_zero_point"),
                shape=scalar,
                type=ir.TensorType(ir.DataType.UINT8),
            )
            dyn = ir.Node(
                "",
                "DynamicQuantizeLinear",
                [value],
                outputs=[q_out, scale, zero_point],
                name=self._names(f"{name}_DynamicQuantizeLinear"),
            )
            dq = ir.Node(
                "",
                "DequantizeLinear",
                [q_out, scale, zero_point],
                outputs=[dq_out],
                name=self._names(f"{name}_DequantizeLinear"),
            )
            self._place_after(graph, value, [dyn, dq])
            return
        # symmetric codes span qmax - zero_code on each side (uint8: 127 around 128)
        zero_code = qtype.symmetric_zero_point
        qmax = add_initializer(
            graph,
            self._names(f"{name}_qmax"),
            np.array(qtype.qmax - zero_code, dtype=np.float32),
        )
        zero = add_initializer(graph, self._names(f"{name}_zero"), np.array(0, dtype=np.float32))
        one = add_initializer(graph, self._names(f"{name}_one"), np.array(1, dtype=np.float32))
        zero_point = add_initializer(
            graph,
            self._names(f"{name}_zero_point"),
            np.array(zero_code, dtype=qparams.numpy_dtype(qtype)),
        )

        def step(
            op: str,
            inputs: list[ir.Value],
            out: str,
            dtype: ir.DataType = ir.DataType.FLOAT,
            shape: ir.Shape = scalar,
            **attrs: int,
        ) -> tuple[ir.Node, ir.Value]:
            result = ir.Value(name=self._names(out), shape=shape, type=ir.TensorType(dtype))
            node = ir.node(
                op, inputs, attrs or None, outputs=[result], name=self._names(f"{name}_{op}")
            )
            return node, result

        abs_node, abs_out = step("Abs", [value], f"{name}_abs", shape=value.shape)
        max_node, amax = step("ReduceMax", [abs_out], f"{name}_amax", keepdims=0)
        div_node, ratio = step("Div", [amax, qmax], f"{name}_amax_over_qmax")
        gt_node, positive = step("Greater", [amax, zero], f"{name}_amax_positive", ir.DataType.BOOL)
        where_node, scale = step("Where", [positive, ratio, one], f"{name}_scale")
        nodes = [abs_node, max_node, div_node, gt_node, where_node]
        nodes += self._qdq_nodes(value, name, params, scale, zero_point, dq_out)
        self._place_after(graph, value, nodes)

    def cast_activation(self, graph: ir.Graph, value: ir.Value, params: QuantParams) -> None:
        name = value.name or ""
        out = self._output_value(value, "CastFloat_Output", "Cast_Input")
        self._rewire(value, out)
        low = _ir_dtype(params.qtype)
        cast_out = ir.Value(
            name=self._names(f"{name}_Cast_Output"), shape=value.shape, type=ir.TensorType(low)
        )
        cast = ir.node(
            "Cast", [value], {"to": low}, outputs=[cast_out], name=self._names(f"{name}_Cast")
        )
        back = ir.node(
            "Cast",
            [cast_out],
            {"to": ir.DataType.FLOAT},
            outputs=[out],
            name=self._names(f"{name}_CastFloat"),
        )
        self._place_after(graph, value, [cast, back])

    def constant(
        self, graph: ir.Graph, value: ir.Value, array: np.ndarray, params: QuantParams
    ) -> None:
        name = value.name or ""
        codes = params.codes if params.codes is not None else qparams.quantize(array, params)
        if _gathers_rows(value, array, params):
            self._gathered_table(graph, value, codes, params)
            return
        quantized = add_initializer(graph, self._names(f"{name}_quantized"), codes)
        self.quantized[name] = quantized
        if params.is_cast:
            out = ir.Value(
                name=self._names(f"{name}_CastFloat_Output"),
                shape=ir.Shape(array.shape),
                type=ir.TensorType(ir.DataType.FLOAT),
            )
            node = ir.node(
                "Cast",
                [quantized],
                {"to": ir.DataType.FLOAT},
                outputs=[out],
                name=self._names(f"{name}_CastFloat"),
            )
        else:
            scale, zero_point = self._parameters(graph, name, params)
            saturated = int(
                np.count_nonzero((codes == params.qtype.qmin) | (codes == params.qtype.qmax))
                if params.qtype.is_integer
                else 0
            )
            if saturated:
                logger.debug("constant %s: %d code(s) at the type's limits", name, saturated)
            out = ir.Value(
                name=self._names(f"{name}_DequantizeLinear_Output"),
                shape=ir.Shape(array.shape),
                type=ir.TensorType(ir.DataType.FLOAT),
            )
            node = ir.Node(
                "",
                "DequantizeLinear",
                [quantized, scale, zero_point],
                attributes=_granularity_attributes(params),
                outputs=[out],
                name=self._names(f"{name}_DequantizeLinear"),
            )
        consumers = [use.node for use in value.uses()]
        _replace_node_uses(value, out)  # an initializer that is also a graph output stays float
        local = [c for c in consumers if id(c) in self._order]
        anchor = min(local, key=lambda c: self._order[id(c)]) if local else self._first
        if anchor is not None:
            graph.insert_before(anchor, node)
        else:
            graph.append(node)
        if self._first is anchor and anchor is not None:
            self._first = node
        self._drop_if_unused(graph, value)

    def _gathered_table(
        self, graph: ir.Graph, value: ir.Value, codes: np.ndarray, params: QuantParams
    ) -> None:
        """An embedding table read only by ``Gather`` (axis 0): gather the rows' codes (and
        their scales), then dequantize only the gathered rows. ``Cast(q) * scale`` is what
        DequantizeLinear computes for a zero point of 0, so the values are the same as a
        DequantizeLinear of the whole table followed by the Gather, without dequantizing the
        whole table on every run."""
        name = value.name or ""
        quantized = add_initializer(graph, self._names(f"{name}_quantized"), codes)
        self.quantized[name] = quantized
        scale = None
        if not params.is_cast:
            assert params.scale is not None
            rows = np.asarray(params.scale, dtype=np.float32).reshape(-1, 1)
            scale = add_initializer(graph, self._names(f"{name}_scale"), rows)
        for use in list(value.uses()):
            gather = use.node
            indices = gather.inputs[1]
            out = gather.outputs[0]
            base = gather.name or name
            q_rows = ir.Value(name=self._names(f"{base}_quantized_rows"))
            new_gather = ir.node(
                "Gather",
                [quantized, indices],
                {"axis": 0},
                outputs=[q_rows],
                name=self._names(f"{base}_QuantizedGather"),
            )
            f32 = ir.TensorType(ir.DataType.FLOAT)
            rows = ir.Value(name=self._names(f"{base}_rows"), type=f32)
            cast = ir.node(
                "Cast",
                [q_rows],
                {"to": ir.DataType.FLOAT},
                outputs=[rows],
                name=self._names(f"{base}_Cast"),
            )
            cast.doc_string = _GATHERED_MARK + name  # restore_gathered_tables reads it back
            nodes = [new_gather, cast]
            if scale is not None:
                s_rows = ir.Value(name=self._names(f"{base}_row_scales"), type=f32)
                scale_gather = ir.node(
                    "Gather",
                    [scale, indices],
                    {"axis": 0},
                    outputs=[s_rows],
                    name=self._names(f"{base}_ScaleGather"),
                )
                values = ir.Value(name=self._names(f"{base}_dequantized"), type=f32)
                mul = ir.node(
                    "Mul",
                    [rows, s_rows],
                    outputs=[values],
                    name=self._names(f"{base}_Dequantize"),
                )
                nodes += [scale_gather, mul]
            last = nodes[-1]
            graph.insert_after(gather, nodes)
            if self._first is gather:
                self._first = new_gather
            # the last node takes over the Gather's output value (name, shape, consumers)
            out_name = out.name
            replacement = last.outputs[0]
            out.replace_all_uses_with(replacement, replace_graph_outputs=True)
            graph.remove(gather, safe=True)
            replacement.name = out_name
            replacement.shape = out.shape
            self.moved[id(out)] = replacement
        self._drop_if_unused(graph, value)

    def _drop_if_unused(self, graph: ir.Graph, value: ir.Value) -> None:
        if value.uses() or value.is_graph_output() or value.is_graph_input():
            return
        if value.is_initializer() and value.name in graph.initializers:
            graph.initializers.pop(value.name)
            return
        producer = value.producer()
        if producer is not None and producer.op_type == "Constant" and producer.graph is graph:
            if producer is self._first:
                nodes = list(graph)
                self._first = nodes[1] if len(nodes) > 1 else None
            graph.remove(producer, safe=True)
