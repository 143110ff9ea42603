"""FoldConvAffine: per-channel scale/shift constants after a Conv, and power-of-two scales
before one, folded into it; the float outputs within float32 rounding, the folded weights
against a numpy reference, and where it must not fire."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import make_model, run_ort
from onnx import TensorProto, helper

from quark_onnx.model_files.load import to_ir, to_proto
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


def _input_scale_model(k: np.ndarray, op: str = "Mul", other_reader: str = "") -> onnx.ModelProto:
    """x -> Relu -> ``op``(., k) -> a grouped Conv (2 groups) and a ConvTranspose -> y, z;
    ``other_reader``: an op that reads the scaled value as well."""
    cin = 4
    w_grouped = RNG.normal(0, 0.5, (6, cin // 2, 3, 3)).astype(np.float32)
    w_transposed = RNG.normal(0, 0.5, (cin, 3, 2, 2)).astype(np.float32)
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node(op, ["r", "k"], ["s"]),
        helper.make_node("Conv", ["s", "wg"], ["y"], kernel_shape=[3, 3], pads=[1] * 4, group=2),
        helper.make_node("ConvTranspose", ["s", "wt"], ["z"], kernel_shape=[2, 2], strides=[2, 2]),
    ]
    outputs = [
        helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6, 8, 8]),
        helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 3, 16, 16]),
    ]
    if other_reader:
        nodes.append(helper.make_node(other_reader, ["s"], ["o"]))
        outputs.append(helper.make_tensor_value_info("o", TensorProto.FLOAT, [1, cin, 8, 8]))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, cin, 8, 8])
    return make_model(nodes, [x], outputs, {"k": k, "wg": w_grouped, "wt": w_transposed})


@pytest.mark.parametrize(
    ("k", "op"),
    [
        (np.array(0.5, np.float32), "Mul"),  # GELU's * 0.5
        (np.array([2.0], np.float32), "Div"),
        (np.array([0.25, -2.0, 1.0, 8.0], np.float32).reshape(4, 1, 1), "Mul"),  # per channel
    ],
)
def test_a_power_of_two_scale_before_convs_folds_into_their_weights(k, op):
    proto = _input_scale_model(k, op)
    out, modified = _apply(proto)
    assert modified
    assert [n.op_type for n in out.graph.node] == ["Relu", "Conv", "ConvTranspose"]
    assert all(n.input[0] == "r" for n in out.graph.node[1:])
    # reference: input channel c of each reader's weights times the scale of channel c
    factor = np.broadcast_to((k if op == "Mul" else 1 / k).reshape(-1), (4,))
    before = {i.name: onnx.numpy_helper.to_array(i) for i in proto.graph.initializer}
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in out.graph.initializer}
    conv, transposed = out.graph.node[1], out.graph.node[2]
    wg = before["wg"].reshape(2, 3, 2, 3, 3) * factor.reshape(2, 1, 2, 1, 1)  # group g: c = 2g + j
    np.testing.assert_array_equal(inits[conv.input[1]], wg.reshape(6, 2, 3, 3))
    np.testing.assert_array_equal(
        inits[transposed.input[1]], before["wt"] * factor.reshape(4, 1, 1, 1)
    )
    assert "k" not in inits
    x = RNG.normal(size=(1, 4, 8, 8)).astype(np.float32)
    for got, want in zip(run_ort(out, {"x": x}), run_ort(proto, {"x": x}), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "case", ["not_a_power_of_two", "constant_over_value", "other_reader", "broadcasts_up"]
)
def test_an_input_scale_does_not_fold(case):
    k, op, other = np.array(0.5, np.float32), "Mul", ""
    if case == "not_a_power_of_two":
        k, op = np.array(6.0, np.float32), "Div"  # hardswish's / 6 (measured lower folded)
    elif case == "other_reader":
        other = "Sigmoid"  # would need the unscaled and the scaled value at once
    elif case == "broadcasts_up":
        k = np.full((1, 1, 8, 8), 0.5, np.float32)  # one per position, not per channel
        k[0, 0, 0, 0] = 2.0
    proto = _input_scale_model(k, op, other)
    if case == "constant_over_value":
        for node in proto.graph.node:
            if node.op_type == "Mul":
                node.op_type, node.input[0], node.input[1] = "Div", "k", "r"  # k / r
    out, modified = _apply(proto)
    assert not modified
    assert [n.op_type for n in out.graph.node] == [n.op_type for n in proto.graph.node]
