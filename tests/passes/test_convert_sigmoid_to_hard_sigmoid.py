"""ConvertSigmoidToHardSigmoid: Sigmoid -> HardSigmoid(1/6, 1/2) with the exact new numerics."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from conftest import make_model, run_ort
from onnx import TensorProto as T
from onnx import helper as h

from quark_onnx.passes import ConvertSigmoidToHardSigmoid

X = np.linspace(-8, 8, 4001, dtype=np.float32).reshape(1, 4001)


def _model(elem_type=T.FLOAT) -> onnx.ModelProto:
    return make_model(
        [h.make_node("Sigmoid", ["x"], ["s"]), h.make_node("Mul", ["x", "s"], ["y"])],
        [h.make_tensor_value_info("x", elem_type, [1, 4001])],
        [h.make_tensor_value_info("y", elem_type, [1, 4001])],
    )


def test_sigmoid_becomes_hard_sigmoid():
    model = _model()
    ir_model = ir.serde.deserialize_model(model)
    result = ConvertSigmoidToHardSigmoid()(ir_model)
    assert result.modified and ConvertSigmoidToHardSigmoid.changes_numerics
    proto = ir.serde.serialize_model(ir_model)
    onnx.checker.check_model(proto)
    node = proto.graph.node[0]
    assert node.op_type == "HardSigmoid"
    attrs = {a.name: a.f for a in node.attribute}
    assert attrs == {"alpha": np.float32(1 / 6), "beta": 0.5}
    (y,) = run_ort(proto, {"x": X})
    alpha = np.float32(1 / 6)
    expected = X * np.clip(X * alpha + np.float32(0.5), 0, 1)
    np.testing.assert_allclose(y, expected, rtol=0, atol=1e-6)


def test_largest_difference_to_sigmoid():
    """max |hard_sigmoid - sigmoid| = 0.0692 at |x| = 1.317 (documented in the pass)."""
    x = np.linspace(-8, 8, 160001)
    hard = np.clip(x / 6 + 0.5, 0, 1)
    diff = np.abs(hard - 1 / (1 + np.exp(-x)))
    assert abs(diff.max() - 0.06918) < 1e-4
    assert abs(abs(x[np.argmax(diff)]) - 1.317) < 2e-3


def test_custom_alpha_and_non_float_left_alone():
    ir_model = ir.serde.deserialize_model(_model())
    ConvertSigmoidToHardSigmoid(alpha=0.2, beta=0.4)(ir_model)
    node = next(iter(ir_model.graph))
    assert node.attributes.get_float("alpha") == np.float32(0.2)
    assert node.attributes.get_float("beta") == np.float32(0.4)

    model = make_model(
        [h.make_node("Sigmoid", ["x"], ["y"])],
        [h.make_tensor_value_info("x", T.BFLOAT16, [1, 4])],
        [h.make_tensor_value_info("y", T.BFLOAT16, [1, 4])],
    )
    assert not ConvertSigmoidToHardSigmoid()(ir.serde.deserialize_model(model)).modified

    model = make_model(
        [h.make_node("Tanh", ["x"], ["y"])],
        [h.make_tensor_value_info("x", T.FLOAT, [1, 4])],
        [h.make_tensor_value_info("y", T.FLOAT, [1, 4])],
    )
    assert not ConvertSigmoidToHardSigmoid()(ir.serde.deserialize_model(model)).modified
