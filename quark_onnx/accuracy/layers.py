"""Layer discovery: the quantized layers the accuracy stages adjust, and small helpers on their
integer codes.

:func:`find_layers` lists the quantized Conv/ConvTranspose/Gemm nodes with their int8 weight (and
bias) initializers and positions, and the names of their input and output in both graphs (the
quantized graph keeps the float tensor names except that an activation read through a Q/DQ pair is
``T_DequantizeLinear_Output`` and a graph output's producer writes ``T_QuantizeLinear_Input``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir

from quark_onnx.errors import QuantizationError
from quark_onnx.npu.rules import position_of_scale

#: Op types whose weights (input 1) and bias (input 2) the accuracy stages adjust.
LAYER_OPS = frozenset({"Conv", "ConvTranspose", "Gemm"})


@dataclass
class Layer:
    """A quantized Conv/ConvTranspose/Gemm and where its pieces are in both graphs.

    ``input``/``output``: names in the quantized graph (the DQ output read at slot 0; the node's
    output). ``float_input``/``float_output``: the same tensors' names in the float model.
    ``weight``/``bias``: the int8 code initializers (``W_quantized``), with their positions.
    """

    name: str
    op_type: str
    node: ir.Node
    input: str
    output: str
    float_input: str
    float_output: str
    weight: ir.Value
    weight_position: int
    bias: ir.Value | None = None
    bias_position: int | None = None

    @property
    def weight_codes(self) -> np.ndarray:
        return self.weight.const_value.numpy()

    @property
    def bias_codes(self) -> np.ndarray | None:
        return None if self.bias is None else self.bias.const_value.numpy()


def _dq_constant(value: ir.Value | None) -> tuple[ir.Value, int] | None:
    """``(codes initializer, position)`` when ``value`` is ``DequantizeLinear(int codes, 2^-p)``
    of a constant read by exactly one node."""
    if value is None or len(value.uses()) != 1:
        return None
    dq = value.producer()
    if dq is None or dq.op_type != "DequantizeLinear" or len(dq.inputs) < 2:
        return None
    codes, scale = dq.inputs[0], dq.inputs[1]
    if codes is None or scale is None or codes.const_value is None or scale.const_value is None:
        return None
    if len(codes.uses()) != 1 or not codes.is_initializer():
        return None
    zp = dq.inputs[2] if len(dq.inputs) > 2 else None
    if zp is not None and (zp.const_value is None or np.any(zp.const_value.numpy() != 0)):
        return None
    if codes.const_value.numpy().dtype not in (np.int8, np.int32):
        return None
    s = scale.const_value.numpy()
    if s.size != 1:
        return None
    p = position_of_scale(float(s.reshape(-1)[0]))
    return None if p is None else (codes, p)


def float_name_of_input(value: ir.Value) -> str:
    """Float-model name of the activation a quantized node reads (through its Q/DQ pair)."""
    dq = value.producer()
    if dq is not None and dq.op_type == "DequantizeLinear" and not value.is_graph_output():
        q_out = dq.inputs[0]
        q = q_out.producer() if q_out is not None else None
        if q is not None and q.op_type == "QuantizeLinear" and q.inputs[0] is not None:
            return q.inputs[0].name or ""
    return value.name or ""


def float_name_of_output(value: ir.Value) -> str:
    """Float-model name of a quantized node's output (a graph output keeps its name on the DQ)."""
    for use in value.uses():
        q = use.node
        if q.op_type != "QuantizeLinear" or not q.outputs:
            continue
        for q_use in q.outputs[0].uses():
            dq = q_use.node
            if dq.op_type == "DequantizeLinear" and dq.outputs and dq.outputs[0].is_graph_output():
                return dq.outputs[0].name or ""
    return value.name or ""


def find_layers(
    model: ir.Model, float_names: Iterable[str] | None = None
) -> tuple[list[Layer], list[dict[str, str]]]:
    """Quantized Conv/ConvTranspose/Gemm nodes of ``model`` in graph order, and the skipped ones.

    A layer qualifies when its weight is ``DequantizeLinear(int8 initializer, 2^-p, 0)`` read by it
    alone, its bias (if any) likewise (int8 or int32 codes), and, when ``float_names`` is given,
    its input and output exist in the float model under the names found.
    """
    known = set(float_names) if float_names is not None else None
    layers: list[Layer] = []
    skipped: list[dict[str, str]] = []
    for index, node in enumerate(model.graph):
        if node.op_type not in LAYER_OPS or node.domain not in ("", "ai.onnx"):
            continue
        name = node.name or f"{node.op_type}_{index}"
        weight = _dq_constant(node.inputs[1] if len(node.inputs) > 1 else None)
        if weight is None or not node.inputs[0] or not node.outputs:
            skipped.append({"node": name, "reason": "weight is not a private int8 Q/DQ constant"})
            continue
        bias_in = node.inputs[2] if len(node.inputs) > 2 else None
        bias = _dq_constant(bias_in)
        if bias_in is not None and bias is None:
            skipped.append({"node": name, "reason": "bias is not a private quantized constant"})
            continue
        layer = Layer(
            name=name,
            op_type=node.op_type,
            node=node,
            input=node.inputs[0].name or "",
            output=node.outputs[0].name or "",
            float_input=float_name_of_input(node.inputs[0]),
            float_output=float_name_of_output(node.outputs[0]),
            weight=weight[0],
            weight_position=weight[1],
            bias=bias[0] if bias else None,
            bias_position=bias[1] if bias else None,
        )
        if known is not None and not {layer.float_input, layer.float_output} <= known:
            skipped.append({"node": name, "reason": "input or output not found in float model"})
            continue
        layers.append(layer)
    return layers, skipped


def tensor_names(proto: onnx.ModelProto) -> set[str]:
    """Every value name of ``proto``'s top-level graph (inputs, initializers, node outputs)."""
    g = proto.graph
    names = {v.name for v in g.input} | {t.name for t in g.initializer}
    for node in g.node:
        names.update(o for o in node.output if o)
    return names


def set_codes(value: ir.Value, codes: np.ndarray) -> None:
    """Replace the integer codes of a quantized weight/bias initializer in place."""
    old = value.const_value.numpy()
    if codes.shape != old.shape:
        raise QuantizationError(
            f"{value.name}: new codes have shape {codes.shape}, not {old.shape}"
        )
    value.const_value = ir.tensor(codes.astype(old.dtype), name=value.name)


def held_out_split(
    samples: Sequence[dict[str, np.ndarray]],
) -> tuple[Sequence[dict[str, np.ndarray]], Sequence[dict[str, np.ndarray]]]:
    """``(fit, check)``: the first half (rounded up) fits a technique, the rest judges it.

    With fewer than :data:`MIN_HELD_OUT` * 2 samples there is nothing to hold out: every sample
    fits and ``check`` is empty (the technique is then applied ungated).
    """
    if len(samples) < 2 * MIN_HELD_OUT:
        return samples, []
    cut = (len(samples) + 1) // 2
    return samples[:cut], samples[cut:]


#: Fewest held-out samples a model-output gate is decided on.
MIN_HELD_OUT = 2
