"""RemoveIdentity: the same output bits, the Identity nodes gone; kept between graph input and
output."""

from __future__ import annotations

import numpy as np
import onnx
from conftest import make_model, run_ort

from quark_onnx.model_files.load import to_ir, to_proto
from quark_onnx.passes import RemoveIdentity

X = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])
Y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])


def test_identities_between_layers_and_before_the_output_are_removed():
    nodes = [
        onnx.helper.make_node("Identity", ["x"], ["i0"]),
        onnx.helper.make_node("Relu", ["i0"], ["r"]),
        onnx.helper.make_node("Identity", ["r"], ["i1"]),
        onnx.helper.make_node("Neg", ["i1"], ["n"]),
        onnx.helper.make_node("Identity", ["n"], ["y"]),
    ]
    proto = make_model(nodes, [X], [Y])
    model = to_ir(proto)
    assert RemoveIdentity()(model).modified
    out = to_proto(model)
    assert [n.op_type for n in out.graph.node] == ["Relu", "Neg"]
    assert out.graph.output[0].name == "y"  # the output keeps its name
    x = np.random.default_rng(0).normal(size=(1, 4)).astype(np.float32)
    np.testing.assert_array_equal(run_ort(out, {"x": x})[0], run_ort(proto, {"x": x})[0])


def test_identity_from_graph_input_to_graph_output_stays():
    proto = make_model([onnx.helper.make_node("Identity", ["x"], ["y"])], [X], [Y])
    assert not RemoveIdentity()(to_ir(proto)).modified
