"""RemoveInferenceDropout: identical outputs, node gone; kept when the mask or training is used."""

from __future__ import annotations

import numpy as np
import onnx
from conftest import make_model, run_ort

from quark_onnx.model_files.load import to_ir, to_proto
from quark_onnx.passes import RemoveInferenceDropout

X = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])
Y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])


def _ops(proto: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in proto.graph.node]


def test_dropout_in_the_middle_is_removed():
    nodes = [
        onnx.helper.make_node("Dropout", ["x"], ["d"], name="drop"),
        onnx.helper.make_node("Relu", ["d"], ["y"]),
    ]
    proto = make_model(nodes, [X], [Y])
    model = to_ir(proto)
    assert RemoveInferenceDropout()(model).modified
    out = to_proto(model)
    assert _ops(out) == ["Relu"]
    x = np.random.default_rng(0).normal(size=(1, 4)).astype(np.float32)
    np.testing.assert_array_equal(run_ort(out, {"x": x})[0], run_ort(proto, {"x": x})[0])


def test_dropout_writing_a_graph_output_becomes_identity():
    proto = make_model([onnx.helper.make_node("Dropout", ["x"], ["y"], name="drop")], [X], [Y])
    model = to_ir(proto)
    assert RemoveInferenceDropout()(model).modified
    out = to_proto(model)
    assert _ops(out) == ["Identity"] and out.graph.output[0].name == "y"
    x = np.ones((1, 4), np.float32)
    np.testing.assert_array_equal(run_ort(out, {"x": x})[0], x)


def test_dropout_whose_mask_is_used_is_kept():
    mask = onnx.helper.make_tensor_value_info("m", onnx.TensorProto.BOOL, [1, 4])
    proto = make_model(
        [onnx.helper.make_node("Dropout", ["x"], ["y", "m"], name="drop")], [X], [Y, mask]
    )
    assert not RemoveInferenceDropout()(to_ir(proto)).modified


def test_dropout_in_training_mode_is_kept():
    nodes = [onnx.helper.make_node("Dropout", ["x", "r", "t"], ["y"], name="drop")]
    inits = {"r": np.array(0.5, np.float32), "t": np.array(True)}
    proto = make_model(nodes, [X], [Y], inits)
    assert not RemoveInferenceDropout()(to_ir(proto)).modified
