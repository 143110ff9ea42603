"""FoldConvAffine: per-channel scale/shift constants after a Conv folded into it; the float
outputs within float32 rounding, the folded weights against a numpy reference, and where it
must not fire."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import make_model, run_ort
from onnx import TensorProto, helper

from quark_onnx.model_io import to_ir, to_proto
from quark_onnx.passes import FoldConvAffine

C = 4
RNG = np.random.default_rng(11)
W = RNG.normal(0, 0.5, (C, 3, 3, 3)).astype(np.float32)
BIAS = RNG.normal(0, 0.2, (1, C, 1, 1)).astype(np.float32)  # paddle2onnx's bias Add
SCALE = np.array([1.7], np.float32)  # a learnable affine block's scale (one number)
SHIFT = RNG.normal(0, 0.3, (C, 1, 1)).astype(np.float32)
DIV = RNG.uniform(1, 2, (C,)).reshape(1, C, 1, 1).astype(np.float32)
X = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])
Y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, C, 8, 8])


def _model(extra_reader: bool = False, chain=("add", "mul", "sub", "div")) -> onnx.ModelProto:
    """x -> Conv (no bias) -> Add(bias) -> Mul(scale, .) -> Sub(., shift) -> Div(., d) -> Relu."""
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[3, 3], pads=[1] * 4)]
    prev = "c"
    ops = {
        "add": lambda v, o: helper.make_node("Add", [v, "bias"], [o]),
        "mul": lambda v, o: helper.make_node("Mul", ["scale", v], [o]),  # constant first
        "sub": lambda v, o: helper.make_node("Sub", [v, "shift"], [o]),
        "div": lambda v, o: helper.make_node("Div", [v, "div"], [o]),
        "rsub": lambda v, o: helper.make_node("Sub", ["shift", v], [o]),
    }
    for i, op in enumerate(chain):
        nodes.append(ops[op](prev, f"a{i}"))
        prev = f"a{i}"
    nodes.append(helper.make_node("Relu", [prev], ["y"]))
    outputs = [Y]
    if extra_reader:
        nodes.append(helper.make_node("Neg", ["c"], ["z"]))
        outputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, C, 8, 8]))
    inits = {"w": W, "bias": BIAS, "scale": SCALE, "shift": SHIFT, "div": DIV}
    used = {i for n in nodes for i in n.input}
    return make_model(nodes, [X], outputs, {k: v for k, v in inits.items() if k in used})


def _apply(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, bool]:
    model = to_ir(proto)
    modified = FoldConvAffine()(model).modified
    out = to_proto(model)
    onnx.checker.check_model(out)
    return out, modified


def test_a_bias_add_and_an_affine_chain_fold_into_the_conv():
    proto = _model()
    out, modified = _apply(proto)
    assert modified
    assert [n.op_type for n in out.graph.node] == ["Conv", "Relu"]
    # reference: y = ((c + bias) * scale - shift) / div, per channel, composed in float64
    m = SCALE.astype(np.float64) / DIV.reshape(-1)
    b = (BIAS.reshape(-1) * SCALE - SHIFT.reshape(-1)) / DIV.reshape(-1)
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in out.graph.initializer}
    conv = out.graph.node[0]
    np.testing.assert_allclose(inits[conv.input[1]], W * m.reshape(-1, 1, 1, 1), rtol=1e-6)
    np.testing.assert_allclose(inits[conv.input[2]], b, rtol=1e-6, atol=1e-7)
    x = RNG.normal(size=(1, 3, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(
        run_ort(out, {"x": x})[0], run_ort(proto, {"x": x})[0], rtol=1e-5, atol=1e-6
    )


def test_a_bias_add_alone_folds_bit_identically():
    proto = _model(chain=("add",))
    out, modified = _apply(proto)
    assert modified
    x = RNG.normal(size=(1, 3, 8, 8)).astype(np.float32)
    np.testing.assert_array_equal(run_ort(out, {"x": x})[0], run_ort(proto, {"x": x})[0])


@pytest.mark.parametrize("case", ["second_reader", "constant_minus_value", "broadcast_up"])
def test_does_not_fire(case):
    if case == "second_reader":
        proto = _model(extra_reader=True)  # the Conv output is read by a Neg too
    elif case == "constant_minus_value":
        proto = _model(chain=("rsub",))  # shift - c: not m c + b with the same sign
    else:
        proto = _model(chain=("add",))  # a bias of shape 1 x C x 8 x 1 broadcasts up
        bias = RNG.normal(size=(1, C, 8, 1)).astype(np.float32)
        for init in proto.graph.initializer:
            if init.name == "bias":
                init.CopyFrom(onnx.numpy_helper.from_array(bias, "bias"))
    out, modified = _apply(proto)
    assert not modified
    assert [n.op_type for n in out.graph.node] == [n.op_type for n in proto.graph.node]


def _bn_chain_model(order: tuple[str, ...]) -> onnx.ModelProto:
    """x -> Conv (no bias) -> the nodes of ``order`` ("add": bias Add, "bn": BatchNormalization,
    "mul": scale) -> Relu -> y."""
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[3, 3], pads=[1] * 4)]
    prev = "c"
    for i, op in enumerate(order):
        out = f"a{i}"
        if op == "bn":
            nodes.append(helper.make_node("BatchNormalization", [prev, "g", "b", "m", "v"], [out]))
        else:
            nodes.append(
                helper.make_node(op.capitalize(), [prev, "bias" if op == "add" else "scale"], [out])
            )
        prev = out
    nodes.append(helper.make_node("Relu", [prev], ["y"]))
    bn = {
        "g": RNG.uniform(0.5, 2, C).astype(np.float32),
        "b": RNG.normal(0, 0.2, C).astype(np.float32),
        "m": RNG.normal(0, 0.2, C).astype(np.float32),
        "v": RNG.uniform(0.5, 2, C).astype(np.float32),
    }
    return make_model(nodes, [X], [Y], {"w": W, "bias": BIAS, "scale": SCALE, **bn})


@pytest.mark.parametrize("order", [("add", "bn"), ("bn", "mul"), ("bn",)])
def test_a_batch_normalization_in_the_chain_folds_too(order):
    proto = _bn_chain_model(order)
    out, modified = _apply(proto)
    assert modified
    assert [n.op_type for n in out.graph.node] == ["Conv", "Relu"]
    x = RNG.normal(size=(1, 3, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(
        run_ort(out, {"x": x})[0], run_ort(proto, {"x": x})[0], rtol=1e-5, atol=1e-5
    )
