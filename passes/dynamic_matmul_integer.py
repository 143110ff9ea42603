"""DynamicMatMulInteger: dynamic-quantized MatMul in integer arithmetic (MatMulInteger).

The dynamic QDQ form InsertQDQ writes for a MatMul with a constant weight::

    x -> DynamicQuantizeLinear -> (x_q, x_scale, x_zero_point) -> DequantizeLinear -> x'
    W_quantized -> DequantizeLinear(W_scale, W_zero_point[, axis]) -> W'
    y = MatMul(x', W')

computes ``y = sum_k (x_q - x_zp) * x_scale * (W_q - W_zp) * W_scale`` in float. This pass
rewrites it into the integer form onnxruntime runs with its int8 GEMM kernels (and fuses further
into ``com.microsoft`` MatMulIntegerToFloat / DynamicQuantizeMatMul at its default optimization
level)::

    acc = MatMulInteger(x_q, W_quantized, x_zero_point[, W_zero_point])     int32
    y   = Mul(Cast(acc, to=float), Mul(x_scale, W_scale))

The integer accumulation is exact, so ``y`` equals the QDQ form up to float32 rounding of the
products and sums (the QDQ form rounds every partial sum, this one rounds once).

Handled: a default-domain ``MatMul`` whose input A is the DequantizeLinear of a
``DynamicQuantizeLinear`` (uint8) and whose input B is the DequantizeLinear of a 2-D int8/uint8
constant, quantized per tensor or per output column (``axis`` 1 or -1). A zero point of all
zeros is omitted (MatMulInteger's default). Not handled (left as they are): a weight quantized
per group, a computed B (attention), Gemm and Conv (their DQ form stays). Unused
DequantizeLinear nodes and weight initializers are removed. Cost O(nodes).
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from quark_onnx.passes._graph import NameGenerator, add_initializer, constant_array
from quark_onnx.passes.base import QuarkPass

logger = logging.getLogger(__name__)

_INTEGER_CODES = (ir.DataType.INT8, ir.DataType.UINT8)


def _std(node: ir.Node | None, op: str) -> bool:
    return node is not None and node.op_type == op and node.domain in ("", "ai.onnx")


def _dynamic_source(value: ir.Value | None) -> ir.Node | None:
    """The DequantizeLinear producing ``value`` from a DynamicQuantizeLinear, or None."""
    dq = value.producer() if value is not None else None
    if not _std(dq, "DequantizeLinear") or len(dq.inputs) < 3:
        return None
    dql = dq.inputs[0].producer() if dq.inputs[0] is not None else None
    if not _std(dql, "DynamicQuantizeLinear"):
        return None
    if dq.inputs[1] is not dql.outputs[1] or dq.inputs[2] is not dql.outputs[2]:
        return None
    return dq


def _weight_source(value: ir.Value | None) -> ir.Node | None:
    """The DequantizeLinear of a 2-D int8/uint8 constant (per tensor or per column), or None."""
    dq = value.producer() if value is not None else None
    if not _std(dq, "DequantizeLinear") or len(dq.inputs) < 2:
        return None
    codes = constant_array(dq.inputs[0])
    scale = constant_array(dq.inputs[1])
    if codes is None or scale is None or codes.ndim != 2:
        return None
    if dq.inputs[0].dtype not in _INTEGER_CODES or "block_size" in dq.attributes:
        return None
    if scale.size != 1:
        axis = dq.attributes.get_int("axis", 1)
        if axis not in (1, -1) or scale.shape != (codes.shape[1],):
            return None
    return dq


class DynamicMatMulInteger(QuarkPass):
    """Rewrite dynamic-quantized MatMul layers into MatMulInteger (see the module docstring)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        names = NameGenerator(graph)
        rewritten = 0
        for node in list(graph):
            if not _std(node, "MatMul") or len(node.inputs) != 2:
                continue
            a_dq = _dynamic_source(node.inputs[0])
            b_dq = _weight_source(node.inputs[1])
            if a_dq is None or b_dq is None:
                continue
            self._rewrite(graph, names, node, a_dq, b_dq)
            rewritten += 1
        if rewritten:
            for node in list(graph):  # DequantizeLinear nodes nothing reads any more
                unused = not any(o.uses() or o.is_graph_output() for o in node.outputs)
                if _std(node, "DequantizeLinear") and unused:
                    graph.remove(node, safe=True)
            for name in [n for n, v in graph.initializers.items() if not v.uses()]:
                if not graph.initializers[name].is_graph_input():
                    graph.initializers.pop(name)
            logger.info("DynamicMatMulInteger: %d MatMul layer(s) now MatMulInteger", rewritten)
        return ir.passes.PassResult(model, rewritten > 0)

    def _rewrite(
        self,
        graph: ir.Graph,
        names: NameGenerator,
        matmul: ir.Node,
        a_dq: ir.Node,
        b_dq: ir.Node,
    ) -> None:
        base = matmul.name or (matmul.outputs[0].name or "MatMul")
        x_q, x_scale, x_zero = a_dq.inputs[0], a_dq.inputs[1], a_dq.inputs[2]
        w_q, w_scale = b_dq.inputs[0], b_dq.inputs[1]
        w_zero = b_dq.inputs[2] if len(b_dq.inputs) > 2 else None
        zero = constant_array(w_zero)
        inputs = [x_q, w_q, x_zero]
        if zero is not None and np.any(zero != 0):
            if zero.size != 1:  # per column: MatMulInteger takes a 1-D [N] zero point
                w_zero = add_initializer(
                    graph, names(f"{base}_b_zero_point"), zero.reshape(-1).copy()
                )
            inputs.append(w_zero)
        f32 = ir.TensorType(ir.DataType.FLOAT)
        acc = ir.Value(
            name=names(f"{base}_MatMulInteger_Output"), type=ir.TensorType(ir.DataType.INT32)
        )
        acc_f = ir.Value(name=names(f"{base}_MatMulInteger_Float"), type=f32)
        scale = ir.Value(name=names(f"{base}_output_scale"), type=f32)
        out = ir.Value(name=names(f"{base}_Output"), type=f32, shape=matmul.outputs[0].shape)
        nodes = [
            ir.node("MatMulInteger", inputs, outputs=[acc], name=names(f"{base}_MatMulInteger")),
            ir.node(
                "Cast",
                [acc],
                {"to": ir.DataType.FLOAT},
                outputs=[acc_f],
                name=names(f"{base}_Cast"),
            ),
            ir.node("Mul", [x_scale, w_scale], outputs=[scale], name=names(f"{base}_ScaleMul")),
            ir.node("Mul", [acc_f, scale], outputs=[out], name=names(f"{base}_OutputMul")),
        ]
        graph.insert_after(matmul, nodes)
        old = matmul.outputs[0]
        old_name = old.name
        old.replace_all_uses_with(out, replace_graph_outputs=True)
        graph.remove(matmul, safe=True)
        out.name = old_name  # consumers and graph outputs keep the MatMul output's name
