"""Folding a per-channel affine map ``y = m x + b`` into the Conv/ConvTranspose/Gemm producing
``x`` (ConvertBNToConv, FoldConvAffine): the folded weights and bias, and the rewiring.

The products are taken in float64 and cast back to the weight's dtype once: the folded layer
differs from the unfolded pair by float32 rounding only (about 1e-7 relative).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from quark_onnx.graph.ir import NameGenerator, add_initializer, constant_array
from quark_onnx.passes.convert_clip_to_relu import remove_if_unused


class Constants:
    """Constant data of values, built once per pass run.

    An initializer also listed as a graph input can be overridden at run time, so it is not a
    constant, except in IR version < 4 models, where every initializer had to be listed as an
    input.
    """

    def __init__(self, model: ir.Model) -> None:
        legacy = model.ir_version is not None and model.ir_version < 4
        self._overridable: frozenset[ir.Value] = frozenset(
            () if legacy else (v for graph in model.graphs() for v in graph.inputs)
        )

    def __call__(self, value: ir.Value | None) -> np.ndarray | None:
        if value is None or value in self._overridable:
            return None
        return constant_array(value)


def bn_affine(node: ir.Node, const: Constants) -> tuple[np.ndarray, np.ndarray] | None:
    """``(m, b)`` in float64 with ``y = m x + b`` per channel, or None when not constant."""
    params = [const(v) for v in node.inputs[1:5]]
    if any(p is None for p in params):
        return None
    gamma, beta, mean, var = (np.asarray(p, dtype=np.float64).reshape(-1) for p in params)
    if not gamma.size == beta.size == mean.size == var.size:
        return None
    eps = node.attributes.get_float("epsilon", 1e-5)
    m = gamma / np.sqrt(var + eps)
    return m, beta - mean * m


def is_inference_bn(node: ir.Node) -> bool:
    """A BatchNormalization in inference mode (no training outputs in use, ``spatial=1``)."""
    if len(node.inputs) < 5 or any(v is None for v in node.inputs[:5]):
        return False
    if node.attributes.get_int("training_mode", 0) != 0:
        return False
    if node.attributes.get_int("spatial", 1) != 1:
        return False
    return all(not (out.uses() or out.is_graph_output()) for out in node.outputs[1:])


def bias_or_zeros(node: ir.Node, const: Constants, channels: int) -> np.ndarray | None:
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        bias = const(node.inputs[2])
        return None if bias is None else np.asarray(bias, dtype=np.float64).reshape(-1)
    return np.zeros(channels, dtype=np.float64)


def folded_conv(
    node: ir.Node, const: Constants, m: np.ndarray, b: np.ndarray
) -> tuple[np.ndarray, np.ndarray] | None:
    weight = const(node.inputs[1] if len(node.inputs) > 1 else None)
    if weight is None or not np.issubdtype(weight.dtype, np.floating) or weight.ndim < 3:
        return None
    channels = m.size
    spatial = (1,) * (weight.ndim - 2)
    w = weight.astype(np.float64)
    if node.op_type == "Conv":
        if weight.shape[0] != channels:
            return None
        w = w * m.reshape(channels, 1, *spatial)
    else:  # ConvTranspose: W[Cin, Cout/group, k...]
        group = node.attributes.get_int("group", 1)
        cin, cout_g = weight.shape[0], weight.shape[1]
        if cout_g * group != channels or cin % group:
            return None
        view = w.reshape(group, cin // group, cout_g, *weight.shape[2:])
        w = (view * m.reshape(group, 1, cout_g, *spatial)).reshape(weight.shape)
    bias = bias_or_zeros(node, const, channels)
    if bias is None or bias.size != channels:
        return None
    return w.astype(weight.dtype), (bias * m + b).astype(weight.dtype)


def folded_gemm(
    node: ir.Node, const: Constants, m: np.ndarray, b: np.ndarray
) -> tuple[np.ndarray, np.ndarray] | None:
    weight = const(node.inputs[1])
    if weight is None or weight.ndim != 2 or not np.issubdtype(weight.dtype, np.floating):
        return None
    channels = m.size
    if node.attributes.get_int("transB", 0):
        if weight.shape[0] != channels:
            return None
        w = weight.astype(np.float64) * m[:, None]
    else:
        if weight.shape[1] != channels:
            return None
        w = weight.astype(np.float64) * m[None, :]
    beta = node.attributes.get_float("beta", 1.0)
    if len(node.inputs) > 2 and node.inputs[2] is not None and beta != 0.0:
        c = const(node.inputs[2])
        if c is None or c.ndim > 2:
            return None
        c = beta * c.astype(np.float64)
    else:
        c = np.zeros(channels, dtype=np.float64)
    try:
        bias = c * m + b
    except ValueError:  # C does not broadcast against N
        return None
    return w.astype(weight.dtype), bias.astype(weight.dtype)


def bypass(node: ir.Node, x: ir.Value) -> None:
    """Make ``x`` take the place (readers, graph-output slot, name) of ``node``'s output, and
    remove ``node``."""
    y = node.outputs[0]
    name = y.name
    shape = y.shape if y.shape is not None else x.shape
    value_type = y.type if y.type is not None else x.type
    metadata = dict(y.metadata_props)
    y.replace_all_uses_with(x, replace_graph_outputs=True)
    node.graph.remove(node, safe=True)
    y.name = None
    x.name = name
    x.type = value_type
    x.shape = shape
    x.metadata_props.update(metadata)


def set_weight(producer: ir.Node, weight: np.ndarray, names: NameGenerator, tag: str) -> None:
    """Give ``producer`` the folded ``weight`` as a new initializer (the old one goes when
    nothing else reads it; a weight another node shares stays for that node)."""
    graph = producer.graph
    assert graph is not None
    old = producer.inputs[1]
    base = producer.name or producer.op_type
    producer.replace_input_with(1, add_initializer(graph, names(f"{base}.{tag}_weight"), weight))
    if old is not None:
        remove_if_unused(graph, old)


def set_weight_and_bias(
    producer: ir.Node, weight: np.ndarray, bias: np.ndarray, names: NameGenerator, tag: str
) -> None:
    """Give ``producer`` the folded ``weight`` and ``bias`` as new initializers (the old ones go
    when nothing else reads them); a Gemm's ``beta`` becomes 1 (the bias holds it)."""
    graph = producer.graph
    assert graph is not None
    base = producer.name or producer.op_type
    old_inputs = [v for v in producer.inputs[1:] if v is not None]
    producer.replace_input_with(1, add_initializer(graph, names(f"{base}.{tag}_weight"), weight))
    if len(producer.inputs) < 3:
        producer.resize_inputs(3)
    producer.replace_input_with(2, add_initializer(graph, names(f"{base}.{tag}_bias"), bias))
    if producer.op_type == "Gemm":
        producer.attributes.add(ir.AttrFloat32("beta", 1.0))
    for value in old_inputs:
        remove_if_unused(graph, value)
