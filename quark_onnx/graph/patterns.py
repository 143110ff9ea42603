"""Graph patterns the planner recognises: constants (an initializer or a ``Constant`` node's
output), the Erf-based Gelu and the LayerNorm written op by op.

:func:`erf_gelu` matches ``x * 0.5 * (1 + Erf(x / sqrt 2))`` in the arrangements exporters write;
the planner then quantizes such a Gelu at its input and output only, like the Gelu op.
:func:`decomposed_layer_norm` matches ``(x - mean) / sqrt(var + eps)``; XINT8 treats it as the
LayerNormalization op (:mod:`quark_onnx.npu.placement`).
"""

from __future__ import annotations

import onnx_ir as ir

from quark_onnx.graph.ir import constant_array, is_standard, single_consumer

__all__ = ["decomposed_layer_norm", "erf_gelu", "is_constant"]


def is_constant(value: ir.Value) -> bool:
    if value.const_value is not None:
        return True
    producer = value.producer()
    return (
        producer is not None
        and producer.op_type == "Constant"
        and producer.domain in ("", "ai.onnx")
    )


_SQRT2 = 1.4142135623730951


def _scalar(value: ir.Value | None) -> float | None:
    """The value of a one-element constant, else None."""
    if value is None or not is_constant(value):
        return None
    array = constant_array(value)
    if array is None or array.size != 1 or array.dtype.kind != "f":
        return None
    return float(array.reshape(()))


def _close(value: float | None, target: float) -> bool:
    return value is not None and abs(value - target) <= 1e-3 * abs(target)


def _other(node: ir.Node, value: ir.Value) -> ir.Value | None:
    """The other input of a two-input node that reads ``value``."""
    if len(node.inputs) != 2:
        return None
    if node.inputs[0] is value:
        return node.inputs[1]
    return node.inputs[0] if node.inputs[1] is value else None


def erf_gelu(erf: ir.Node) -> tuple[ir.Value, list[ir.Node], ir.Node] | None:
    """Match ``x * 0.5 * (1 + Erf(x / sqrt 2))`` around ``erf``: (x, inner nodes, last node).

    Accepted arrangements: the Erf input is ``Div(x, sqrt 2)`` or ``Mul(x, 1/sqrt 2)``; then
    ``Add(., 1)``; then ``Mul(x, .)`` followed by ``Mul(., 0.5)``, or ``Mul(Mul(x, 0.5), .)``,
    or ``Mul(., 0.5)`` followed by ``Mul(x, .)``. Every intermediate has a single consumer.
    """
    if not erf.inputs or erf.inputs[0] is None or not erf.outputs:
        return None
    scaled = erf.inputs[0].producer()
    if scaled is None or len(scaled.inputs) != 2 or single_consumer(scaled.outputs[0]) is not erf:
        return None
    x = scaled.inputs[0]
    if x is None:
        return None
    c = _scalar(scaled.inputs[1])
    if not (
        (is_standard(scaled, "Div") and _close(c, _SQRT2))
        or (is_standard(scaled, "Mul") and _close(c, 1 / _SQRT2))
    ):
        return None
    add = single_consumer(erf.outputs[0])
    if not is_standard(add, "Add") or not _close(_scalar(_other(add, erf.outputs[0])), 1.0):
        return None
    m1 = single_consumer(add.outputs[0])
    if not is_standard(m1, "Mul"):
        return None
    t = _other(m1, add.outputs[0])
    if t is None:
        return None
    inner = [scaled, erf, add]
    if t is x:  # Mul(x, 1 + erf) then Mul(., 0.5)
        m2 = single_consumer(m1.outputs[0])
        if not is_standard(m2, "Mul") or not _close(_scalar(_other(m2, m1.outputs[0])), 0.5):
            return None
        return x, [*inner, m1], m2
    if _close(_scalar(t), 0.5):  # Mul(1 + erf, 0.5) then Mul(x, .)
        m2 = single_consumer(m1.outputs[0])
        if not is_standard(m2, "Mul") or _other(m2, m1.outputs[0]) is not x:
            return None
        return x, [*inner, m1], m2
    half = t.producer()  # Mul(Mul(x, 0.5), 1 + erf)
    if (
        is_standard(half, "Mul")
        and _other(half, x) is not None
        and _close(_scalar(_other(half, x)), 0.5)
        and single_consumer(t) is m1
    ):
        return x, [*inner, half], m1
    return None


def _reduce_axes(node: ir.Node) -> tuple[int, ...] | None:
    """The axes of a ReduceMean that keeps its dims (attribute, or input 1 from opset 18)."""
    if node.attributes.get_int("keepdims", 1) != 1:
        return None
    if "axes" in node.attributes:
        return tuple(node.attributes.get_ints("axes"))
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        array = constant_array(node.inputs[1])
        return None if array is None else tuple(int(a) for a in array.reshape(-1))
    return None


def _only_reader(value: ir.Value, op: str) -> ir.Node | None:
    node = single_consumer(value)
    return node if is_standard(node, op) else None


def decomposed_layer_norm(pow_node: ir.Node) -> list[ir.Node] | None:
    """Match the LayerNorm exporters write op by op around its ``Pow``: its nodes, or None.

    ``m = ReduceMean(x, A)``, ``d = Sub(x, m)``, ``Pow(d, 2)``, ``ReduceMean(., A)``,
    ``Add(., eps)``, ``Sqrt``, ``Div(d, .)`` (both ReduceMeans keep their dims and reduce the same
    axes ``A``; ``d`` is read by the Pow and the Div only, the rest by one node each). The scale
    and shift after it are ordinary ``Mul``/``Add`` and not part of the match.
    """
    if not is_standard(pow_node, "Pow") or len(pow_node.inputs) != 2:
        return None
    d = pow_node.inputs[0]
    sub = d.producer() if d is not None else None
    if not is_standard(sub, "Sub") or _scalar(pow_node.inputs[1]) != 2.0:
        return None
    x, m = sub.inputs
    mean = m.producer() if m is not None else None
    if not is_standard(mean, "ReduceMean") or mean.inputs[0] is not x:
        return None
    if single_consumer(m) is not sub or d.is_graph_output() or len(d.uses()) != 2:
        return None
    var = _only_reader(pow_node.outputs[0], "ReduceMean")
    if var is None or _reduce_axes(var) is None or _reduce_axes(var) != _reduce_axes(mean):
        return None
    add = _only_reader(var.outputs[0], "Add")
    if add is None or _scalar(_other(add, var.outputs[0])) is None:
        return None
    sqrt = _only_reader(add.outputs[0], "Sqrt")
    div = _only_reader(sqrt.outputs[0], "Div") if sqrt is not None else None
    if div is None or div.inputs[0] is not d or div.inputs[1] is not sqrt.outputs[0]:
        return None
    return [mean, sub, pow_node, var, add, sqrt, div]
