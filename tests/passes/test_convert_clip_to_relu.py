"""ConvertClipToRelu: Clip(0, hi) -> Relu with ``hi`` kept as the output's range cap."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import make_model, run_ort
from onnx import TensorProto as T
from onnx import helper as h

from quark_onnx.graph.ir import RANGE_MAX_KEY
from quark_onnx.passes import ConvertClipToRelu

X = np.linspace(-10, 10, 2 * 3 * 4 * 4, dtype=np.float32).reshape(2, 3, 4, 4)
IN = h.make_tensor_value_info("x", T.FLOAT, [2, 3, 4, 4])
OUT = h.make_tensor_value_info("y", T.FLOAT, [2, 3, 4, 4])


def layer() -> onnx.NodeProto:
    """A 1x1 MaxPool (an identity) that makes the Clip after it a layer's activation."""
    return h.make_node("MaxPool", ["x"], ["l"], kernel_shape=[1, 1])


def clip_then_neg(lo: float | None, hi: float | None, form: str = "initializer"):
    """``y = Neg(Clip(MaxPool1x1(x), lo, hi))``: the Clip output is an inner value that can carry
    metadata."""
    if form == "attribute":
        attrs = {k: v for k, v in (("min", lo), ("max", hi)) if v is not None}
        nodes = [
            layer(),
            h.make_node("Clip", ["l"], ["c"], **attrs),
            h.make_node("Neg", ["c"], ["y"]),
        ]
        return make_model(nodes, [IN], [OUT], opset=6)
    nodes, inits, inputs = [layer()], {}, ["l"]
    for name, value in (("lo", lo), ("hi", hi)):
        if value is None:
            inputs.append("")
        elif form == "initializer":
            inits[name] = np.array(value, dtype=np.float32)
            inputs.append(name)
        else:
            tensor = onnx.numpy_helper.from_array(np.array(value, dtype=np.float32), name)
            nodes.append(h.make_node("Constant", [], [name], value=tensor))
            inputs.append(name)
    while inputs[-1] == "":
        inputs.pop()
    nodes += [h.make_node("Clip", inputs, ["c"]), h.make_node("Neg", ["c"], ["y"])]
    return make_model(nodes, [IN], [OUT], inits)


def _run_pass(model: onnx.ModelProto):
    ir_model = ir.serde.deserialize_model(model)
    result = ConvertClipToRelu()(ir_model)
    proto = ir.serde.serialize_model(ir_model)
    onnx.checker.check_model(proto)
    return result, ir_model, proto


def _range_cap(proto: onnx.ModelProto, name: str) -> str | None:
    for info in proto.graph.value_info:
        if info.name == name:
            return {p.key: p.value for p in info.metadata_props}.get(RANGE_MAX_KEY)
    return None


@pytest.mark.parametrize("form", ["initializer", "constant", "attribute"])
@pytest.mark.parametrize("hi", [6.0, 4.0, 0.3])
def test_clip_becomes_relu_with_range_cap(form, hi):
    result, ir_model, proto = _run_pass(clip_then_neg(0.0, hi, form))
    assert result.modified
    assert [n.op_type for n in proto.graph.node] == ["MaxPool", "Relu", "Neg"]
    assert not proto.graph.initializer
    (y,) = run_ort(proto, {"x": X})
    np.testing.assert_array_equal(y, -np.maximum(X, 0))  # the new numerics, exactly
    cap = _range_cap(proto, "c")  # survives serialization, on the Relu's output value
    assert cap is not None and float(cap) == float(np.float32(hi))
    relu = next(n for n in ir_model.graph if n.op_type == "Relu")
    assert float(relu.outputs[0].metadata_props[RANGE_MAX_KEY]) == float(np.float32(hi))
    assert ConvertClipToRelu.changes_numerics


def test_clip_without_max_is_a_plain_relu():
    result, _, proto = _run_pass(clip_then_neg(0.0, None))
    assert result.modified
    assert _range_cap(proto, "c") is None
    (y,) = run_ort(proto, {"x": X})
    np.testing.assert_array_equal(y, -np.maximum(X, 0))


def test_existing_cap_keeps_the_smaller_bound():
    model = clip_then_neg(0.0, 6.0)
    ir_model = ir.serde.deserialize_model(model)
    clip = next(n for n in ir_model.graph if n.op_type == "Clip")
    clip.outputs[0].metadata_props[RANGE_MAX_KEY] = "2.5"
    assert ConvertClipToRelu()(ir_model).modified
    assert clip.outputs[0].metadata_props[RANGE_MAX_KEY] == "2.5"


@pytest.mark.parametrize(
    "lo,hi,form",
    [
        (-1.0, 1.0, "initializer"),
        (-1.0, 1.0, "attribute"),
        (None, 6.0, "initializer"),
        (0.5, 6.0, "constant"),
        (0.0, -1.0, "initializer"),
    ],
)
def test_other_clips_are_left_alone(lo, hi, form):
    result, _, proto = _run_pass(clip_then_neg(lo, hi, form))
    assert not result.modified
    assert [n.op_type for n in proto.graph.node][-2:] == ["Clip", "Neg"]


def test_runtime_bounds_are_left_alone():
    # the upper bound is a graph input, so not a constant
    model = make_model(
        [layer(), h.make_node("Clip", ["l", "lo", "hi"], ["y"])],
        [IN, h.make_tensor_value_info("hi", T.FLOAT, [])],
        [OUT],
        {"lo": np.array(0.0, dtype=np.float32)},
    )
    result, _, _ = _run_pass(model)
    assert not result.modified
    # the lower bound is computed at run time
    model = make_model(
        [
            layer(),
            h.make_node("ReduceMin", ["x"], ["lo"], keepdims=0),
            h.make_node("Clip", ["l", "lo", "hi"], ["y"]),
        ],
        [IN],
        [OUT],
        {"hi": np.array(6.0, dtype=np.float32)},
    )
    result, _, _ = _run_pass(model)
    assert not result.modified


def test_hardswish_and_hardsigmoid_clips_are_left_alone():
    """``x * Clip(x + 3, 0, 6) / 6``: the Clip bounds a gate; as a Relu the product would grow as
    x^2 (calibration of deep networks then sees Inf)."""
    nodes = [
        layer(),
        h.make_node("Add", ["l", "three"], ["s"]),
        h.make_node("Clip", ["s", "lo", "hi"], ["c"]),
        h.make_node("Mul", ["l", "c"], ["m"]),
        h.make_node("Div", ["m", "six"], ["y"]),
    ]
    inits = {
        name: np.array(v, dtype=np.float32)
        for name, v in (("three", 3.0), ("lo", 0.0), ("hi", 6.0), ("six", 6.0))
    }
    result, _, proto = _run_pass(make_model(nodes, [IN], [OUT], inits))
    assert not result.modified
    assert "Clip" in [n.op_type for n in proto.graph.node]


def test_residual_add_activation_is_converted():
    """An Add of two computed tensors is a layer (residual): its Clip is an activation."""
    nodes = [
        layer(),
        h.make_node("Add", ["l", "x"], ["s"]),
        h.make_node("Clip", ["s", "lo", "hi"], ["y"]),
    ]
    inits = {"lo": np.array(0.0, dtype=np.float32), "hi": np.array(6.0, dtype=np.float32)}
    result, _, _ = _run_pass(make_model(nodes, [IN], [OUT], inits))
    assert result.modified
