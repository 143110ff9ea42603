"""DynamicMatMulInteger: dynamic-quantized MatMul in integer arithmetic (MatMulInteger).

The dynamic QDQ form InsertQDQ writes for a MatMul with a constant weight::

    x -> DynamicQuantizeLinear -> (x_q, x_scale, x_zero_point) -> DequantizeLinear -> x'
    W_quantized -> DequantizeLinear(W_scale, W_zero_point[, axis]) -> W'
    y = MatMul(x', W')

computes ``y = sum_k (x_q - x_zp) * x_scale * (W_q - W_zp) * W_scale`` in float. This pass
rewrites it into the integer form onnxruntime runs with its int8 GEMM kernels (and fuses further
into ``com.microsoft`` MatMulIntegerToFloat / DynamicQuantizeMatMul at its default optimization
level)::

    acc = MatMulInteger(x_q, W_quantized, x_zero_point, W_zero_point)       int32
    y   = Mul(Cast(acc, to=float), Mul(x_scale, W_scale))

The integer accumulation is exact, so ``y`` equals the QDQ form up to float32 rounding of the
products and sums (the QDQ form rounds every partial sum, this one rounds once).

Handled: a default-domain ``MatMul`` -- or ``Gemm`` with alpha = beta = 1 and transA = 0, whose
``C`` is then added in float and whose ``transB`` weight codes are stored transposed -- whose
input A is the DequantizeLinear of a ``DynamicQuantizeLinear`` (uint8) and whose input B is the
DequantizeLinear of a 2-D int8/uint8 constant, quantized per tensor or per output column. The
weight's initializers (codes, scale, zero point) stay as InsertQDQ wrote them -- a ``transB``
weight's codes are transposed in place -- and the MatMulInteger's ``doc_string`` names the op it
replaced, so :func:`restore_qdq` gives the QDQ form back exactly (``quark_onnx.formats.importer``
and recipes read it). Not handled (left as they are): a
weight quantized per group, a computed B (attention), other Gemm attributes, Conv (its DQ form
stays). Unused
DequantizeLinear nodes and weight initializers are removed. Cost O(nodes).
"""

from __future__ import annotations

import logging
import re

import numpy as np
import onnx_ir as ir

from quark_onnx.graph.ir import NameGenerator, constant_array, is_standard, remove_unread_dequantize
from quark_onnx.passes.base import QuarkPass

logger = logging.getLogger(__name__)

_INTEGER_CODES = (ir.DataType.INT8, ir.DataType.UINT8)
#: doc_string prefix of a MatMulInteger written here, followed by the op it replaced
_MARK = "quark_onnx:dynamic:"
_CODES_SUFFIX = re.compile(r"_quantized(_\d+)?$")


def _transpose_in_place(value: ir.Value) -> None:
    """Replace a 2-D initializer's data by its transpose (same name, same place)."""
    codes = np.ascontiguousarray(constant_array(value).T)
    value.const_value = ir.tensor(codes, name=value.name)
    value.shape = ir.Shape(codes.shape)


def _dynamic_source(value: ir.Value | None) -> ir.Node | None:
    """The DequantizeLinear producing ``value`` from a DynamicQuantizeLinear, or None."""
    dq = value.producer() if value is not None else None
    if not is_standard(dq, "DequantizeLinear") or len(dq.inputs) < 3:
        return None
    dql = dq.inputs[0].producer() if dq.inputs[0] is not None else None
    if not is_standard(dql, "DynamicQuantizeLinear"):
        return None
    if dq.inputs[1] is not dql.outputs[1] or dq.inputs[2] is not dql.outputs[2]:
        return None
    return dq


def _weight_source(value: ir.Value | None, transposed: bool = False) -> ir.Node | None:
    """The DequantizeLinear of a 2-D int8/uint8 constant, per tensor or per output column
    (axis 1; axis 0 for a ``transposed`` [N, K] Gemm weight), or None."""
    dq = value.producer() if value is not None else None
    if not is_standard(dq, "DequantizeLinear") or len(dq.inputs) < 2:
        return None
    codes = constant_array(dq.inputs[0])
    scale = constant_array(dq.inputs[1])
    if codes is None or scale is None or codes.ndim != 2:
        return None
    if dq.inputs[0].dtype not in _INTEGER_CODES or "block_size" in dq.attributes:
        return None
    if transposed and (len(dq.inputs[0].uses()) != 1 or len(dq.outputs[0].uses()) != 1):
        return None  # its codes are transposed in place: nothing else may read them
    if scale.size != 1:
        axis = dq.attributes.get_int("axis", 1) % 2
        channel = 0 if transposed else 1
        if axis != channel or scale.shape != (codes.shape[channel],):
            return None
    return dq


def _plain_gemm(node: ir.Node) -> bool:
    """``Gemm`` computing ``A @ op(B) + C`` exactly (alpha = beta = 1, A not transposed)."""
    attrs = node.attributes
    return (
        is_standard(node, "Gemm")
        and attrs.get_float("alpha", 1.0) == 1.0
        and attrs.get_float("beta", 1.0) == 1.0
        and attrs.get_int("transA", 0) == 0
    )


class DynamicMatMulInteger(QuarkPass):
    """Rewrite dynamic-quantized MatMul layers into MatMulInteger (see the module docstring)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        names = NameGenerator(graph)
        rewritten = 0
        for node in list(graph):
            if is_standard(node, "MatMul") and len(node.inputs) == 2:
                transposed = False
            elif _plain_gemm(node) and len(node.inputs) >= 2:
                transposed = bool(node.attributes.get_int("transB", 0))
            else:
                continue
            a_dq = _dynamic_source(node.inputs[0])
            b_dq = _weight_source(node.inputs[1], transposed)
            if a_dq is None or b_dq is None:
                continue
            self._rewrite(graph, names, node, a_dq, b_dq, transposed)
            rewritten += 1
        if rewritten:
            remove_unread_dequantize(graph)
            logger.info("DynamicMatMulInteger: %d MatMul layer(s) now MatMulInteger", rewritten)
        return ir.passes.PassResult(model, rewritten > 0)

    def _rewrite(
        self,
        graph: ir.Graph,
        names: NameGenerator,
        matmul: ir.Node,
        a_dq: ir.Node,
        b_dq: ir.Node,
        transposed: bool = False,
    ) -> None:
        base = matmul.name or (matmul.outputs[0].name or "MatMul")
        x_q, x_scale, x_zero = a_dq.inputs[0], a_dq.inputs[1], a_dq.inputs[2]
        w_q, w_scale = b_dq.inputs[0], b_dq.inputs[1]
        if transposed:  # Gemm transB=1: MatMulInteger takes B as [K, N]; same initializer
            _transpose_in_place(w_q)
        w_zero = b_dq.inputs[2] if len(b_dq.inputs) > 2 else None
        # the weight's initializers stay as InsertQDQ wrote them (names, order): restore_qdq
        # reads the QDQ form back from them (recipes)
        inputs = [x_q, w_q, x_zero] + ([w_zero] if w_zero is not None else [])
        f32 = ir.TensorType(ir.DataType.FLOAT)
        acc = ir.Value(
            name=names(f"{base}_MatMulInteger_Output"), type=ir.TensorType(ir.DataType.INT32)
        )
        acc_f = ir.Value(name=names(f"{base}_MatMulInteger_Float"), type=f32)
        scale = ir.Value(name=names(f"{base}_output_scale"), type=f32)
        out = ir.Value(name=names(f"{base}_Output"), type=f32, shape=matmul.outputs[0].shape)
        bias = matmul.inputs[2] if len(matmul.inputs) > 2 else None
        product = ir.Value(name=names(f"{base}_Product"), type=f32) if bias is not None else out
        integer = ir.node(
            "MatMulInteger", inputs, outputs=[acc], name=names(f"{base}_MatMulInteger")
        )
        integer.doc_string = _MARK + (
            "MatMul"
            if matmul.op_type == "MatMul"
            else "Gemm" + (":transB" if transposed else "") + (":C" if bias is not None else "")
        )
        nodes = [
            integer,
            ir.node(
                "Cast",
                [acc],
                {"to": ir.DataType.FLOAT},
                outputs=[acc_f],
                name=names(f"{base}_Cast"),
            ),
            ir.node("Mul", [x_scale, w_scale], outputs=[scale], name=names(f"{base}_ScaleMul")),
            ir.node("Mul", [acc_f, scale], outputs=[product], name=names(f"{base}_OutputMul")),
        ]
        if bias is not None:  # Gemm's C, added in float as Gemm adds it
            nodes.append(ir.node("Add", [product, bias], outputs=[out], name=names(f"{base}_Add")))
        graph.insert_after(matmul, nodes)
        old = matmul.outputs[0]
        old_name = old.name
        old.replace_all_uses_with(out, replace_graph_outputs=True)
        graph.remove(matmul, safe=True)
        out.name = old_name  # consumers and graph outputs keep the MatMul output's name


def restore_qdq(graph: ir.Graph) -> int:
    """Undo :class:`DynamicMatMulInteger` in ``graph``: the DequantizeLinear form back, exactly as
    InsertQDQ wrote it (the weight initializers were never touched, a ``transB`` weight's codes
    are transposed back), so a reader of QDQ models sees the QDQ form. Returns the number of
    layers restored (MatMulInteger nodes this pass did not write are left alone)."""
    names = NameGenerator(graph)
    x_dq: dict[int, ir.Value] = {}
    restored = 0
    for node in list(graph):
        if node.op_type != "MatMulInteger" or not (node.doc_string or "").startswith(_MARK):
            continue
        kind = node.doc_string[len(_MARK) :]
        x_q, w_q, x_zero = node.inputs[0], node.inputs[1], node.inputs[2]
        w_zero = node.inputs[3] if len(node.inputs) > 3 else None
        dql = x_q.producer()
        cast = next(iter(node.outputs[0].uses())).node
        mul = next(iter(cast.outputs[0].uses())).node
        scale_mul = mul.inputs[1].producer()
        x_scale, w_scale = scale_mul.inputs[0], scale_mul.inputs[1]
        gemm = kind.startswith("Gemm")
        add = next(iter(mul.outputs[0].uses())).node if kind.endswith(":C") else None
        final = (add or mul).outputs[0]
        f32 = ir.TensorType(ir.DataType.FLOAT)
        if id(dql) not in x_dq:
            x_name = dql.inputs[0].name or "x"
            x_out = ir.Value(name=names(f"{x_name}_DequantizeLinear_Output"), type=f32)
            graph.insert_after(
                dql,
                ir.Node(
                    "",
                    "DequantizeLinear",
                    [x_q, x_scale, x_zero],
                    outputs=[x_out],
                    name=names(f"{x_name}_DequantizeLinear"),
                ),
            )
            x_dq[id(dql)] = x_out
        transposed = ":transB" in kind
        if transposed:
            _transpose_in_place(w_q)
        weight = _CODES_SUFFIX.sub("", w_q.name or "W")
        attrs = []
        if constant_array(w_scale).size != 1:
            attrs.append(ir.AttrInt64("axis", 0 if transposed else 1))
        w_out = ir.Value(name=names(f"{weight}_DequantizeLinear_Output"), type=f32)
        w_dq = ir.Node(
            "",
            "DequantizeLinear",
            [w_q, w_scale] + ([w_zero] if w_zero is not None else []),
            attributes=attrs,
            outputs=[w_out],
            name=names(f"{weight}_DequantizeLinear"),
        )
        base = (node.name or "MatMul").removesuffix("_MatMulInteger")
        out = ir.Value(name=names(f"{base}_restored"), type=f32, shape=final.shape)
        inputs = [x_dq[id(dql)], w_out] + ([add.inputs[1]] if add is not None else [])
        layer = ir.Node(
            "",
            "Gemm" if gemm else "MatMul",
            inputs,
            attributes=[ir.AttrInt64("transB", 1)] if transposed else [],
            outputs=[out],
            name=base,
        )
        graph.insert_before(node, [w_dq, layer])
        old_name = final.name
        final.replace_all_uses_with(out, replace_graph_outputs=True)
        for dead in (add, mul, scale_mul, cast, node):
            if dead is not None and not any(o.uses() for o in dead.outputs):
                graph.remove(dead, safe=True)
        out.name = old_name
        restored += 1
    return restored
