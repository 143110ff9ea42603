"""ReplaceClip6Relu: a layer's Clip(0, 6) -> Relu with range cap 6, whatever form the bounds take;
Clip(0, 4), a Clip that is no layer's activation and the Clip inside hardswish are untouched."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import make_model, run_ort
from onnx import TensorProto as T
from onnx import helper as h

from quark_onnx.graph.ir import RANGE_MAX_KEY
from quark_onnx.passes import ReplaceClip6Relu

X = np.linspace(-10, 10, 2 * 3 * 4 * 4, dtype=np.float32).reshape(2, 3, 4, 4)
IN = h.make_tensor_value_info("x", T.FLOAT, [2, 3, 4, 4])
OUT = h.make_tensor_value_info("y", T.FLOAT, [2, 3, 4, 4])


def layer() -> onnx.NodeProto:
    """A 1x1 MaxPool (an identity) that makes the Clip after it a layer's activation."""
    return h.make_node("MaxPool", ["x"], ["l"], kernel_shape=[1, 1])


def clip_model(lo: float | None, hi: float | None, form: str) -> onnx.ModelProto:
    """``y = Clip(MaxPool1x1(x), lo, hi)`` with the bounds as attributes, initializers or Constant
    nodes."""
    if form == "attribute":  # opset 6 Clip
        attrs = {k: v for k, v in (("min", lo), ("max", hi)) if v is not None}
        nodes = [layer(), h.make_node("Clip", ["l"], ["y"], **attrs)]
        return make_model(nodes, [IN], [OUT], opset=6)
    nodes, inits, inputs = [layer()], {}, ["l"]
    for name, value in (("lo", lo), ("hi", hi)):
        if value is None:
            inputs.append("")
            continue
        if form == "initializer":
            inits[name] = np.array(value, dtype=np.float32)
        else:
            tensor = onnx.numpy_helper.from_array(np.array(value, dtype=np.float32), name)
            nodes.append(h.make_node("Constant", [], [name], value=tensor))
        inputs.append(name)
    while inputs[-1] == "":
        inputs.pop()
    nodes.append(h.make_node("Clip", inputs, ["y"], name="clip"))
    return make_model(nodes, [IN], [OUT], inits)


def _run_pass(model: onnx.ModelProto):
    ir_model = ir.serde.deserialize_model(model)
    result = ReplaceClip6Relu()(ir_model)
    proto = ir.serde.serialize_model(ir_model)
    onnx.checker.check_model(proto)
    return result, proto


@pytest.mark.parametrize("form", ["attribute", "initializer", "constant"])
def test_clip6_becomes_relu(form):
    model = clip_model(0.0, 6.0, form)
    np.testing.assert_array_equal(run_ort(model, {"x": X})[0], np.clip(X, 0, 6))
    result, proto = _run_pass(model)
    assert result.modified
    assert [n.op_type for n in proto.graph.node] == ["MaxPool", "Relu"]  # bounds removed too
    assert not proto.graph.initializer
    (y,) = run_ort(proto, {"x": X})
    np.testing.assert_array_equal(y, np.maximum(X, 0))  # the new numerics, exactly
    assert ReplaceClip6Relu.changes_numerics


def test_the_bound_is_kept_as_range_cap():
    model = clip_model(0.0, 6.0, "initializer")
    model.graph.node.append(h.make_node("Neg", ["y"], ["z"]))
    model.graph.output[0].name = "z"
    ir_model = ir.serde.deserialize_model(model)
    assert ReplaceClip6Relu()(ir_model).modified
    relu = next(n for n in ir_model.graph if n.op_type == "Relu")
    assert float(relu.outputs[0].metadata_props[RANGE_MAX_KEY]) == 6.0


def _hardswish(shift_op: str = "Add") -> onnx.ModelProto:
    """``y = x * Clip(x + 3, 0, 6) / 6`` as exporters write hardswish (the Clip reads x + 3)."""
    nodes = [
        layer(),
        h.make_node(shift_op, ["l", "three"], ["s"]),
        h.make_node("Clip", ["s", "lo", "hi"], ["c"]),
        h.make_node("Mul", ["l", "c"], ["m"]),
        h.make_node("Div", ["m", "six"], ["y"]),
    ]
    inits = {
        name: np.array(v, dtype=np.float32)
        for name, v in (("three", 3.0), ("lo", 0.0), ("hi", 6.0), ("six", 6.0))
    }
    return make_model(nodes, [IN], [OUT], inits)


def test_hardswish_clip_is_left_alone():
    result, proto = _run_pass(_hardswish())
    assert not result.modified
    assert "Clip" in [n.op_type for n in proto.graph.node]


def test_clip_of_a_graph_input_is_no_layer_activation():
    model = make_model(
        [h.make_node("Clip", ["x", "lo", "hi"], ["y"])],
        [IN],
        [OUT],
        {"lo": np.array(0.0, dtype=np.float32), "hi": np.array(6.0, dtype=np.float32)},
    )
    result, _ = _run_pass(model)
    assert not result.modified


@pytest.mark.parametrize(
    "lo,hi,form",
    [
        (0.0, 4.0, "initializer"),
        (0.0, 4.0, "attribute"),
        (-1.0, 6.0, "constant"),
        (0.0, None, "initializer"),
        (None, 6.0, "initializer"),
        (0.0, 6.000001, "initializer"),
    ],
)
def test_other_clips_are_left_alone(lo, hi, form):
    result, proto = _run_pass(clip_model(lo, hi, form))
    assert not result.modified
    assert "Clip" in [n.op_type for n in proto.graph.node]


def test_runtime_bound_is_left_alone():
    model = make_model(
        [layer(), h.make_node("Clip", ["l", "lo", "hi"], ["y"])],
        [IN, h.make_tensor_value_info("hi", T.FLOAT, [])],
        [OUT],
        {"lo": np.array(0.0, dtype=np.float32)},
    )
    result, _ = _run_pass(model)
    assert not result.modified


@pytest.mark.real_model
def test_real_model_relu6_all_replaced(shared):
    from quark_onnx.model_files.load import load_ir

    model = load_ir(shared / "models" / "digits_cnn.onnx")
    clips = sum(n.op_type == "Clip" for n in model.graph)
    assert clips == 9
    assert ReplaceClip6Relu()(model).modified
    assert not any(n.op_type == "Clip" for n in model.graph)
    assert not any(n.op_type == "Constant" for n in model.graph)  # all 18 bounds dropped
