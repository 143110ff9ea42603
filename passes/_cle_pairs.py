"""Which convolutions CLE can equalize: the ops through which per-channel scaling is float-exact,
and every conv reading a conv's channels through them (see the pass's module docstring for the
rules: positively homogeneous per-channel ops, channel Concats, constant float weights).
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from quark_onnx.graph.channels import value_channels

# a range cap written by ConvertClipToRelu is valid only for the unscaled channels, so CLE does
# not equalize through such a value
from quark_onnx.graph.ir import RANGE_MAX_KEY, constant_array

_FLOAT_DTYPES = (np.float16, np.float32, np.float64)

# Per-channel, positively homogeneous ops that may sit between the two convs (op -> data input 0).
_ALWAYS_HOMOGENEOUS = frozenset(
    {"Relu", "LeakyRelu", "PRelu", "Identity", "AveragePool", "GlobalAveragePool", "GlobalMaxPool"}
)


def _label(node: ir.Node) -> str:
    """The node's name, or ``<op>:<first output name>`` for an unnamed node."""
    return node.name or f"{node.op_type}:{node.outputs[0].name}"


def _is_float_array(array: np.ndarray | None) -> bool:
    return array is not None and array.dtype in _FLOAT_DTYPES


def _is_homogeneous_bound(node: ir.Node, index: int, attr: str) -> bool | None:
    """True if a Clip bound is absent, 0 or infinite; False if finite non-zero; None if unknown."""
    if attr in node.attributes:
        bound = node.attributes.get_float(attr)
        return bound == 0.0 or math.isinf(bound)
    if len(node.inputs) <= index or node.inputs[index] is None:
        return True
    array = constant_array(node.inputs[index])
    if array is None or array.size != 1:
        return None
    bound = float(array.reshape(()))
    return bound == 0.0 or math.isinf(bound)


def homogeneity_problem(node: ir.Node) -> str | None:
    """None if ``node`` is per-channel and positively homogeneous in input 0, else the reason."""
    if node.domain not in ("", "ai.onnx"):
        return f"{node.op_type} {_label(node)!r} is not a known positively homogeneous op"
    op = node.op_type
    extra_outputs_used = any(out.uses() or out.is_graph_output() for out in node.outputs[1:])
    if op in _ALWAYS_HOMOGENEOUS or op == "MaxPool":
        if extra_outputs_used:
            return f"{op} {_label(node)!r} has a second output in use"
        return None
    if op == "Clip":
        lo = _is_homogeneous_bound(node, 1, "min")
        hi = _is_homogeneous_bound(node, 2, "max")
        if lo and hi:
            return None
        if lo is None or hi is None:
            return f"Clip {_label(node)!r} has a bound that is not a constant scalar"
        return (
            f"Clip {_label(node)!r} has a finite non-zero bound (ReLU6?) and is not positively "
            "homogeneous (ReplaceClip6Relu keeps the bound as a range cap, which blocks the pair "
            "too)"
        )
    if op == "Pad":
        mode = node.attributes.get_string("mode", "constant")
        if mode != "constant":
            return None
        if node.attributes.get_float("value", 0.0) != 0.0:  # opset < 11
            return f"Pad {_label(node)!r} pads with a non-zero value"
        if len(node.inputs) > 2 and node.inputs[2] is not None:
            value = constant_array(node.inputs[2])
            if value is None or np.any(value != 0):
                return f"Pad {_label(node)!r} pads with a non-zero or non-constant value"
        return None
    return f"{op} {_label(node)!r} is not a known positively homogeneous op"


def _concat_offset(node: ir.Node, index: int) -> tuple[int, int] | str:
    """``(first channel of input index, total channels)`` of a channel (axis 1) Concat."""
    rank = node.outputs[0].shape.rank() if node.outputs[0].shape is not None else None
    axis = node.attributes.get_int("axis", 0)
    if not (axis == 1 or (rank is not None and axis == 1 - rank)):
        return f"Concat {_label(node)!r} does not concatenate channels (axis 1)"
    counts = []
    for value in node.inputs:
        count = value_channels(value) if value is not None else None
        if count is None:
            return f"Concat {_label(node)!r}: the channel count of an input is unknown"
        counts.append(count)
    return sum(counts[:index]), sum(counts)


def _conv_weights(node: ir.Node) -> tuple[np.ndarray, np.ndarray | None] | str:
    """The constant float weight and bias of a Conv, or the reason they cannot be rewritten."""
    if len(node.inputs) < 2 or node.inputs[1] is None:
        return f"Conv {_label(node)!r} has no weight input"
    w_value = node.inputs[1]
    if w_value.is_graph_input():
        return f"Conv {_label(node)!r} weight {w_value.name!r} is a graph input (not constant)"
    weight = constant_array(w_value)
    if not _is_float_array(weight) or weight.ndim < 3:
        return f"Conv {_label(node)!r} weight {w_value.name!r} is not a constant float tensor"
    bias = None
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        b_value = node.inputs[2]
        bias = None if b_value.is_graph_input() else constant_array(b_value)
        if not _is_float_array(bias) or bias.shape != (weight.shape[0],):
            return f"Conv {_label(node)!r} bias {b_value.name!r} is not a constant float vector"
    return weight, bias


def _follow(first: ir.Node) -> tuple[list, tuple[str, ...], tuple] | str:
    """Every conv reading ``first``'s channels through homogeneous ops and channel Concats,
    with the input channel each reads, or why the channels cannot be rescaled."""
    first_arrays = _conv_weights(first)
    if isinstance(first_arrays, str):
        return first_arrays
    channels = first_arrays[0].shape[0]
    readers: list[tuple[ir.Node, np.ndarray, tuple]] = []
    through: list[str] = []
    # (value, channel index of first's channels in it, channel count of the value)
    stack = [(first.outputs[0], np.arange(channels), channels)]
    while stack:
        value, idx, width = stack.pop()
        if value.is_graph_output():
            return f"{value.name!r} is a graph output"
        if value is not first.outputs[0] and RANGE_MAX_KEY in value.metadata_props:
            return (
                f"{value.name!r} carries a range cap ({RANGE_MAX_KEY}) that rescaling its "
                "channels would invalidate; run CLE before ConvertClipToRelu"
            )
        uses = list(value.uses())
        if not uses:
            return f"{value.name!r} has no reader"
        for use in uses:
            consumer, index = use.node, use.idx
            standard = consumer.domain in ("", "ai.onnx")
            if standard and consumer.op_type == "Concat":
                offset = _concat_offset(consumer, index)
                if isinstance(offset, str):
                    return offset
                start, total = offset
                if "Concat" not in through:
                    through.append("Concat")
                stack.append((consumer.outputs[0], idx + start, total))
                continue
            if index != 0:
                return f"{value.name!r} is input {index} of {consumer.op_type} {_label(consumer)!r}"
            if standard and consumer.op_type == "Conv":
                arrays = _conv_weights(consumer)
                if isinstance(arrays, str):
                    return arrays
                group = consumer.attributes.get_int("group", 1)
                w2 = arrays[0]
                if group < 1 or w2.shape[1] * group != width or w2.shape[0] % group:
                    return (
                        f"Conv {_label(consumer)!r} (group {group}, weight {w2.shape}) does "
                        f"not read {width} channels"
                    )
                readers.append((consumer, idx, arrays))
                continue
            problem = homogeneity_problem(consumer)
            if problem is not None:
                return problem
            if consumer.op_type not in through:
                through.append(consumer.op_type)
            stack.append((consumer.outputs[0], idx, width))
    return readers, tuple(through), first_arrays
