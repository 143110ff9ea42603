"""InsertQDQ: write the plan's quantization into the graph as QuantizeLinear/DequantizeLinear.

The form written (the one :mod:`quark_onnx.check` reads), with ``s = 2^-p`` a float32 0-d
initializer and the zero point a 0-d initializer:

* activation ``T`` (graph input or node output)::

      T -> QuantizeLinear(T, T_scale, T_zero_point) -> T_QuantizeLinear_Output
        -> DequantizeLinear(..., T_scale, T_zero_point) -> T_DequantizeLinear_Output -> consumers

  int8 zero point 0, or uint8 zero point 128 for ``QuantType.QUInt8`` (same representable values).
  When ``T`` is a graph output its producer now writes ``T_QuantizeLinear_Input`` and the
  DequantizeLinear writes ``T``, so output names do not change.
* weight ``W`` (constant): ``W_quantized = clip(round_half_even(W / s), -128, 127)`` as an int8
  initializer -> ``DequantizeLinear(W_quantized, W_scale, W_zero_point)`` ->
  ``W_DequantizeLinear_Output``. No QuantizeLinear. The float initializer is removed when unused.
* bias: int8 with its own position, or int32 at ``s_in * s_w`` (position ``p_in + p_w``, as the
  solver sets it with ``Int32Bias``), same pattern as a weight.
* fused intermediates (Conv -> Relu with a RemoveQDQ* option, pool -> DPU Mul) are not in the plan
  and get nothing.

Names are made unique with one :class:`~quark_onnx.passes._graph.NameGenerator`; tensors are
processed in plan order and every pair is placed right after its producer (weights: right before
their first consumer), so the output is byte-identical for the same input. The value index is
built once, so the pass costs O(number of Q/DQ pairs + nodes).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
import onnx_ir as ir

from quark_onnx import pof2
from quark_onnx.enums import QuantType
from quark_onnx.errors import PassError
from quark_onnx.passes._graph import NameGenerator, add_initializer, constant_array
from quark_onnx.passes.base import QuarkPass
from quark_onnx.plan import QuantPlan, TensorKind, TensorSpec

logger = logging.getLogger(__name__)


class InsertQDQ(QuarkPass):
    """Insert Q/DQ pairs, quantized weights and biases for ``plan`` at ``positions``.

    Args:
        plan: from :func:`quark_onnx.plan.build_plan` on this model.
        positions: tensor -> power-of-two position (``SolveResult.positions``), one per planned
            tensor.
    """

    changes_numerics = True

    def __init__(self, plan: QuantPlan, positions: Mapping[str, int]) -> None:
        super().__init__()
        self.plan = plan
        self.positions = dict(positions)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        missing = [n for n in self.plan.tensors if n not in self.positions]
        if missing:
            raise PassError(
                f"InsertQDQ: no position for {len(missing)} planned tensor(s) "
                f"({', '.join(missing[:5])}); pass the solver's positions for every tensor"
            )
        for name, spec in self.plan.tensors.items():
            if not spec.power_of_two:
                raise PassError(
                    f"InsertQDQ: tensor {name} is planned with a float scale; this pass writes "
                    "power-of-two (XINT8) scales only"
                )
        values: dict[str, ir.Value] = {}
        for v in graph.inputs:
            values[v.name or ""] = v
        for name, v in graph.initializers.items():
            values.setdefault(name, v)
        order: dict[int, int] = {}
        for i, node in enumerate(graph):
            order[id(node)] = i
            for out in node.outputs:
                if out.name:
                    values[out.name] = out
        self._names = NameGenerator(graph)
        self._first = next(iter(graph), None)
        self._order = order
        modified = False
        for name, spec in self.plan.tensors.items():
            value = values.get(name)
            if value is None:
                raise PassError(
                    f"InsertQDQ: planned tensor {name} is not in graph {graph.name!r}; build the "
                    "plan on the same model"
                )
            p = self.positions[name]
            if spec.kind is TensorKind.ACTIVATION:
                self._activation(graph, value, spec, p)
            else:
                self._constant(graph, value, spec, p)
            modified = True
        logger.info("InsertQDQ: %d tensor(s) quantized", len(self.plan.tensors))
        return ir.passes.PassResult(model, modified)

    def _parameters(
        self, graph: ir.Graph, base: str, p: int, qtype: QuantType
    ) -> tuple[ir.Value, ir.Value]:
        scale = add_initializer(graph, self._names(f"{base}_scale"), np.array(pof2.scale_of(p)))
        zero = np.array(pof2.zero_point(qtype), dtype=pof2.numpy_dtype(qtype))
        zero_point = add_initializer(graph, self._names(f"{base}_zero_point"), zero)
        return scale, zero_point

    def _activation(self, graph: ir.Graph, value: ir.Value, spec: TensorSpec, p: int) -> None:
        name = value.name or ""
        scale, zero_point = self._parameters(graph, name, p, spec.qtype)
        as_output = value.is_graph_output() and not value.is_graph_input()
        if value.is_graph_output() and value.is_graph_input():
            logger.warning(
                "tensor %s is both a graph input and output; the output stays float", name
            )
        if as_output:
            value.name = self._names(f"{name}_QuantizeLinear_Input")
            dq_out = ir.Value(name=name, shape=value.shape, type=value.type)
        else:
            dq_name = self._names(f"{name}_DequantizeLinear_Output")
            dq_out = ir.Value(name=dq_name, shape=value.shape, type=value.type)
        value.replace_all_uses_with(dq_out, replace_graph_outputs=as_output)
        q_out = ir.Value(
            name=self._names(f"{name}_QuantizeLinear_Output"),
            shape=value.shape,
            type=ir.TensorType(ir.DataType.from_numpy(pof2.numpy_dtype(spec.qtype))),
        )
        q = ir.Node(
            "",
            "QuantizeLinear",
            [value, scale, zero_point],
            outputs=[q_out],
            name=self._names(f"{name}_QuantizeLinear"),
        )
        dq = ir.Node(
            "",
            "DequantizeLinear",
            [q_out, scale, zero_point],
            outputs=[dq_out],
            name=self._names(f"{name}_DequantizeLinear"),
        )
        producer = value.producer()
        if producer is not None and producer.graph is graph:
            graph.insert_after(producer, [q, dq])
        elif self._first is not None:
            graph.insert_before(self._first, [q, dq])
        else:
            graph.extend([q, dq])

    def _constant(self, graph: ir.Graph, value: ir.Value, spec: TensorSpec, p: int) -> None:
        name = value.name or ""
        array = constant_array(value)
        if array is None:
            raise PassError(f"InsertQDQ: {spec.kind.value} {name} is not a constant")
        codes = pof2.quantize(array.astype(np.float32), p, spec.qtype)
        quantized = add_initializer(graph, self._names(f"{name}_quantized"), codes)
        scale, zero_point = self._parameters(graph, name, p, spec.qtype)
        saturated = int(np.count_nonzero((codes == spec.qtype.qmin) | (codes == spec.qtype.qmax)))
        if saturated and spec.kind is TensorKind.BIAS:
            logger.info("bias %s: %d value(s) saturate at position %d", name, saturated, p)
        dq_out = ir.Value(
            name=self._names(f"{name}_DequantizeLinear_Output"),
            shape=ir.Shape(array.shape),
            type=ir.TensorType(ir.DataType.FLOAT),
        )
        consumers = [use.node for use in value.uses()]
        value.replace_all_uses_with(dq_out)
        dq = ir.Node(
            "",
            "DequantizeLinear",
            [quantized, scale, zero_point],
            outputs=[dq_out],
            name=self._names(f"{name}_DequantizeLinear"),
        )
        local = [c for c in consumers if id(c) in self._order]
        anchor = min(local, key=lambda c: self._order[id(c)]) if local else self._first
        if anchor is not None:
            graph.insert_before(anchor, dq)
        else:
            graph.append(dq)
        if self._first is anchor and anchor is not None:
            self._first = dq
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
