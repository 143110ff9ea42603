"""EqualizeGatedActivations: bit-identical float outputs, the scales it must choose, and where it
must not fire."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import make_model, run_ort, shared_path
from onnx import TensorProto, helper

from quark_onnx.passes import EqualizeGatedActivations

C = 8


def _conv(name, x, w, b, y, group=1, k=3):
    inputs = [x, w] if b is None else [x, w, b]
    return helper.make_node(
        "Conv", inputs, [y], name=name, kernel_shape=[k, k], pads=[k // 2] * 4, group=group
    )


def _weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Producer channels ranging 1 ... 2^10 apart, readers' channels the inverse (as BatchNorm
    folding leaves them): the equalizing scales are far from 1."""
    rng = np.random.default_rng(seed)
    spread = np.exp2(np.arange(C, dtype=np.float32) * 10 / (C - 1))
    w1 = rng.standard_normal((C, 3, 3, 3)).astype(np.float32) * spread.reshape(-1, 1, 1, 1)
    b1 = (rng.standard_normal(C) * spread).astype(np.float32)
    dw = rng.standard_normal((C, 1, 3, 3)).astype(np.float32) / spread.reshape(-1, 1, 1, 1)
    pw = rng.standard_normal((4, C, 1, 1)).astype(np.float32) / spread.reshape(1, -1, 1, 1)
    return {"w1": w1, "b1": b1, "dw": dw, "pw": pw}


def _silu_model(readers=("dw", "pw"), gate_input="x1") -> onnx.ModelProto:
    """Conv -> SiLU (Sigmoid, Mul) -> depthwise Conv and 1x1 Conv (outputs y_dw, y_pw)."""
    nodes = [
        _conv("conv1", "x", "w1", "b1", "x1"),
        helper.make_node("Sigmoid", [gate_input], ["g"], name="sig"),
        helper.make_node("Mul", ["x1", "g"], ["a"], name="mul"),
    ]
    outputs = []
    if "dw" in readers:
        nodes.append(_conv("dwconv", "a", "dw", None, "y_dw", group=C))
        outputs.append(helper.make_tensor_value_info("y_dw", TensorProto.FLOAT, [1, C, 8, 8]))
    if "pw" in readers:
        nodes.append(_conv("pwconv", "a", "pw", None, "y_pw", k=1))
        outputs.append(helper.make_tensor_value_info("y_pw", TensorProto.FLOAT, [1, 4, 8, 8]))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])]
    if gate_input != "x1":
        inputs.append(helper.make_tensor_value_info(gate_input, TensorProto.FLOAT, [1, C, 8, 8]))
    return make_model(nodes, inputs, outputs, _weights())


def _product_model(nodes: list, constants: dict[str, float]) -> onnx.ModelProto:
    """x -> Conv (x1) -> ``nodes`` (from x1 to the gated product ``a``) -> 1x1 Conv -> y."""
    w = _weights()
    return make_model(
        [_conv("conv1", "x", "w1", "b1", "x1"), *nodes, _conv("pwconv", "a", "pw", None, "y", k=1)],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        {
            "w1": w["w1"],
            "b1": w["b1"],
            "pw": w["pw"],
            **{k: np.array(v, np.float32) for k, v in constants.items()},
        },
    )


def _hardswish_model() -> onnx.ModelProto:
    """Conv -> x * Clip(x + 3, 0, 6) / 6 (PaddleOCR's form) -> 1x1 Conv."""
    nodes = [
        helper.make_node("Add", ["x1", "three"], ["t"], name="add"),
        helper.make_node("Clip", ["t", "lo", "hi"], ["c"], name="clip"),
        helper.make_node("Mul", ["x1", "c"], ["m"], name="mul"),
        helper.make_node("Div", ["m", "six"], ["a"], name="div"),
    ]
    return _product_model(nodes, {"three": 3.0, "lo": 0.0, "hi": 6.0, "six": 6.0})


def _apply(model: onnx.ModelProto, samples=None) -> tuple[onnx.ModelProto, bool]:
    result = EqualizeGatedActivations(samples)(ir.from_proto(model))
    out = ir.to_proto(result.model)
    onnx.checker.check_model(out)
    return out, result.modified


def _feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        i.name: (
            rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]) * 3
        ).astype(np.float32)
        for i in model.graph.input
    }


def _inits(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}


def _expected_scales(w1: np.ndarray, readers: list[np.ndarray], r1=None) -> np.ndarray:
    """Reference: s = 2^k, k = round(log2 sqrt(r1 / r2)) minus the median's, within +-3."""
    r1 = np.abs(w1).reshape(C, -1).max(axis=1) if r1 is None else r1
    r2 = np.max([np.abs(np.moveaxis(w, 1, 0)).reshape(C, -1).max(axis=1) for w in readers], 0)
    # the depthwise reader is C x 1 x k x k: its input channel c is its row c
    k = np.round(0.5 * np.log2(r1.astype(np.float64) / r2))
    return np.exp2(np.clip(k - np.round(np.median(k)), -3, 3))


def test_silu_outputs_bit_identical_and_scales_exact():
    model = _silu_model()
    out, modified = _apply(model)
    assert modified
    feeds = _feeds(model)
    for before, after in zip(run_ort(model, feeds), run_ort(out, feeds), strict=True):
        np.testing.assert_array_equal(before, after)
    w, new = _weights(), _inits(out)
    dw_as_columns = np.moveaxis(w["dw"], 0, 1)  # reader ranges per input channel
    s = _expected_scales(w["w1"], [dw_as_columns, w["pw"]])
    assert s.min() < 1 < s.max()  # the case is not trivial
    np.testing.assert_array_equal(new["w1"], w["w1"] / s.reshape(-1, 1, 1, 1).astype(np.float32))
    np.testing.assert_array_equal(new["b1"], w["b1"] / s.astype(np.float32))
    np.testing.assert_array_equal(new["dw"], w["dw"] * s.reshape(-1, 1, 1, 1).astype(np.float32))
    np.testing.assert_array_equal(new["pw"], w["pw"] * s.reshape(1, -1, 1, 1).astype(np.float32))
    # the gate reads x1 * s through the new Mul, whose constant is s itself
    (gate_mul,) = [n for n in out.graph.node if n.op_type == "Mul" and n.name != "mul"]
    assert gate_mul.input[0] == "x1"
    np.testing.assert_array_equal(new[gate_mul.input[1]].reshape(-1), s.astype(np.float32))
    (sig,) = [n for n in out.graph.node if n.op_type == "Sigmoid"]
    assert sig.input[0] == gate_mul.output[0]
    # the producer's channel range spread shrinks from 2^10 to at most 2^4
    r1 = np.abs(new["w1"]).reshape(C, -1).max(axis=1)
    assert r1.max() / r1.min() < 2**4 < np.abs(w["w1"]).reshape(C, -1).max(1).max() / r1.min()


def test_silu_scales_from_the_samples_activation_ranges():
    model = _silu_model()
    # biases far above the weights' reach, in the reverse order of the weight ranges: the
    # activation ranges then disagree with the producer's weight ranges
    bias = np.exp2(np.arange(C, dtype=np.float32)[::-1] * 8 / (C - 1)) * 100
    for init in model.graph.initializer:
        if init.name == "b1":
            init.CopyFrom(onnx.numpy_helper.from_array(bias.astype(np.float32), "b1"))
    feeds = [_feeds(model), {"x": -_feeds(model)["x"]}]
    # oracle: the producer output's per-channel max |x1| over both samples, by onnxruntime
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.append(helper.make_tensor_value_info("x1", TensorProto.FLOAT, None))
    r1 = np.max([np.abs(run_ort(probe, f)[-1]).max(axis=(0, 2, 3)) for f in feeds], axis=0)
    out, modified = _apply(model, feeds)
    assert modified
    w = _weights()
    s = _expected_scales(w["w1"], [np.moveaxis(w["dw"], 0, 1), w["pw"]], r1.astype(np.float64))
    data_free = _expected_scales(w["w1"], [np.moveaxis(w["dw"], 0, 1), w["pw"]])
    assert not np.array_equal(s, data_free)  # the samples decide
    new = _inits(out)
    np.testing.assert_array_equal(new["w1"], w["w1"] / s.reshape(-1, 1, 1, 1).astype(np.float32))
    np.testing.assert_array_equal(new["b1"], bias / s.astype(np.float32))
    for before, after in zip(run_ort(model, feeds[0]), run_ort(out, feeds[0]), strict=True):
        np.testing.assert_array_equal(before, after)


def _equalized_bit_identically(model: onnx.ModelProto) -> onnx.ModelProto:
    """The pass's output for ``model``, checked to fire and to leave the float output's bits."""
    out, modified = _apply(model)
    assert modified
    feeds = _feeds(model)
    np.testing.assert_array_equal(run_ort(model, feeds)[0], run_ort(out, feeds)[0])
    return out


def test_hardswish_with_scalar_div_after_the_product():
    out = _equalized_bit_identically(_hardswish_model())
    (add,) = [n for n in out.graph.node if n.op_type == "Add"]
    assert add.input[0] != "x1"  # the gate reads the restored x


def _gelu_model() -> onnx.ModelProto:
    """Conv -> GELU as torch and paddle export it, ``x * (Erf(x / sqrt 2) + 1) * 0.5`` -> 1x1
    Conv."""
    nodes = [
        helper.make_node("Div", ["x1", "sqrt2"], ["t"], name="div"),
        helper.make_node("Erf", ["t"], ["e"], name="erf"),
        helper.make_node("Add", ["e", "one"], ["g"], name="add"),
        helper.make_node("Mul", ["x1", "g"], ["m"], name="mul"),
        helper.make_node("Mul", ["m", "half"], ["a"], name="half_mul"),
    ]
    return _product_model(nodes, {"sqrt2": np.sqrt(2.0), "one": 1.0, "half": 0.5})


def test_gelu_outputs_bit_identical_and_scales_exact():
    # GELU is x * Phi(x): the gate chain Div, Erf, Add reads x back through the restoring Mul
    out = _equalized_bit_identically(_gelu_model())
    w, new = _weights(), _inits(out)
    s = _expected_scales(w["w1"], [w["pw"]])
    assert s.min() < 1 < s.max()
    np.testing.assert_array_equal(new["w1"], w["w1"] / s.reshape(-1, 1, 1, 1).astype(np.float32))
    np.testing.assert_array_equal(new["pw"], w["pw"] * s.reshape(1, -1, 1, 1).astype(np.float32))
    (div,) = [n for n in out.graph.node if n.op_type == "Div"]
    (restore,) = [n for n in out.graph.node if n.output[0] == div.input[0]]
    assert restore.op_type == "Mul" and restore.input[0] == "x1"


def _concat_model(reader: str = "Conv") -> onnx.ModelProto:
    """SiLU output concatenated after 3 other channels (input z), read by a 1x1 Conv."""
    w = _weights()
    pw = np.random.default_rng(3).standard_normal((4, 3 + C, 1, 1)).astype(np.float32)
    pw[:, 3:] = w["pw"][:, :, :, :]
    nodes = [
        _conv("conv1", "x", "w1", "b1", "x1"),
        helper.make_node("Sigmoid", ["x1"], ["g"], name="sig"),
        helper.make_node("Mul", ["x1", "g"], ["a"], name="mul"),
        helper.make_node("Concat", ["z", "a"], ["cat"], axis=1, name="cat"),
    ]
    if reader == "Conv":
        nodes.append(_conv("pwconv", "cat", "pw", None, "y", k=1))
        out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])
    else:
        nodes.append(helper.make_node("Relu", ["cat"], ["y"], name="relu"))
        out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3 + C, 8, 8])
    model = make_model(
        nodes,
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 3, 8, 8]),
        ],
        [out],
        {"w1": w["w1"], "b1": w["b1"], "pw": pw},
    )
    return onnx.shape_inference.infer_shapes(model)


def test_through_a_channel_concat_read_by_convs():
    model = _concat_model()
    out, modified = _apply(model)
    assert modified
    feeds = _feeds(model)
    np.testing.assert_array_equal(run_ort(model, feeds)[0], run_ort(out, feeds)[0])
    w, pw = _weights(), _inits(model)["pw"]
    s = _expected_scales(w["w1"], [w["pw"]])
    new = _inits(out)["pw"]
    np.testing.assert_array_equal(new[:, :3], pw[:, :3])  # the other input's channels
    np.testing.assert_array_equal(new[:, 3:], pw[:, 3:] * s.reshape(1, -1, 1, 1).astype(np.float32))
    _, modified = _apply(_concat_model(reader="Relu"))  # a Concat read by anything else
    assert not modified


def test_second_run_changes_nothing():
    out, _ = _apply(_silu_model())
    again, modified = _apply(out)
    assert not modified
    assert _inits(again).keys() == _inits(out).keys()


@pytest.mark.parametrize(
    "case",
    ["gate_reads_other_input", "read_by_concat", "product_is_output", "already_balanced"],
)
def test_does_not_fire(case):
    if case == "gate_reads_other_input":
        # Mul(x1, Sigmoid(z)): a squeeze-excite style product, not x * g(x)
        model = _silu_model(gate_input="z")
    elif case == "read_by_concat":
        model = _silu_model(readers=("pw",))
        concat = helper.make_node("Concat", ["a", "a"], ["cat"], axis=1, name="cat")
        model.graph.node.append(concat)
        model.graph.output.append(
            helper.make_tensor_value_info("cat", TensorProto.FLOAT, [1, 2 * C, 8, 8])
        )
    elif case == "product_is_output":
        model = _silu_model()
        model.graph.output.append(
            helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, C, 8, 8])
        )
    else:
        model = _silu_model(readers=("pw",))
        w1 = np.ones((C, 3, 3, 3), np.float32)
        pw = np.ones((4, C, 1, 1), np.float32)
        for init in model.graph.initializer:
            if init.name in ("w1", "pw"):
                init.CopyFrom(
                    onnx.numpy_helper.from_array(w1 if init.name == "w1" else pw, init.name)
                )
    out, modified = _apply(model)
    assert not modified
    assert out.graph.node[0].input == model.graph.node[0].input
    assert len(out.graph.node) == len(model.graph.node)


@pytest.mark.real_model
def test_person_detector_bit_identical():
    path = shared_path("models", "person_detector_192.onnx")
    model = onnx.shape_inference.infer_shapes(onnx.load(str(path)))
    out, modified = _apply(model)
    assert modified
    added = len(out.graph.node) - len(model.graph.node)
    # the 74 SiLUs read only by Convs and the 17 read by Concats that only Convs read (the
    # others feed Add, Resize, MaxPool or a head Concat)
    assert added == 74 + 17
    x = np.random.default_rng(0).uniform(0, 255, (1, 3, 192, 192)).astype(np.float32)
    np.testing.assert_array_equal(run_ort(model, {"images": x})[0], run_ort(out, {"images": x})[0])


def test_samples_are_run_only_when_the_pattern_is_there(caplog):
    bogus = [{"not_an_input": np.zeros((1, 3, 8, 8), np.float32)}]  # onnxruntime would refuse it
    relu = _silu_model(readers=("pw",))
    for node in relu.graph.node:
        if node.op_type == "Sigmoid":
            node.op_type = "Relu"  # Mul(x1, Relu(x1)) ...
    relu.graph.node[2].op_type = "Add"  # ... made x1 + Relu(x1): no product
    with caplog.at_level("WARNING"):
        _, modified = _apply(relu, bogus)
    assert not modified and not caplog.records
    with caplog.at_level("WARNING"):
        out, modified = _apply(_silu_model(), bogus)
    assert modified  # the producer's weight ranges stand in for the samples'
    assert "cannot run the model on the samples" in caplog.text
    s = _expected_scales(_weights()["w1"], [np.moveaxis(_weights()["dw"], 0, 1), _weights()["pw"]])
    np.testing.assert_array_equal(
        _inits(out)["w1"], _weights()["w1"] / s.reshape(-1, 1, 1, 1).astype(np.float32)
    )


def _native_hardswish_model(output_too: bool = False) -> onnx.ModelProto:
    """Conv -> HardSwish (the op, as torch's nn.Hardswish exports it) -> depthwise and 1x1 Convs;
    ``output_too``: the HardSwish output is also a graph output."""
    w = _weights()
    nodes = [
        _conv("conv1", "x", "w1", "b1", "x1"),
        helper.make_node("HardSwish", ["x1"], ["a"], name="hswish"),
        _conv("dwconv", "a", "dw", None, "y_dw", group=C),
        _conv("pwconv", "a", "pw", None, "y_pw", k=1),
    ]
    outputs = [
        helper.make_tensor_value_info("y_dw", TensorProto.FLOAT, [1, C, 8, 8]),
        helper.make_tensor_value_info("y_pw", TensorProto.FLOAT, [1, 4, 8, 8]),
    ]
    if output_too:
        outputs.append(helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, C, 8, 8]))
    return make_model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        outputs,
        w,
        opset=17,
    )


def test_native_hardswish_is_written_as_its_product_form_and_equalized():
    model = _native_hardswish_model()
    out, modified = _apply(model)
    assert modified
    ops = [n.op_type for n in out.graph.node]
    assert "HardSwish" not in ops and ops.count("HardSigmoid") == 1
    (hsig,) = [n for n in out.graph.node if n.op_type == "HardSigmoid"]
    attrs = {a.name: a.f for a in hsig.attribute}
    assert attrs == pytest.approx({"alpha": 1 / 6, "beta": 0.5})
    feeds = _feeds(model)
    for before, after in zip(run_ort(model, feeds), run_ort(out, feeds), strict=True):
        np.testing.assert_array_equal(after, before)  # the same float operations
    w, new = _weights(), _inits(out)
    s = _expected_scales(w["w1"], [np.moveaxis(w["dw"], 0, 1), w["pw"]])
    assert s.min() < 1 < s.max()
    np.testing.assert_array_equal(new["w1"], w["w1"] / s.reshape(-1, 1, 1, 1).astype(np.float32))


def test_native_hardswish_left_alone_where_nothing_is_equalized():
    """Its output is also a graph output (the readers' scales cannot hold): the op stays."""
    model = _native_hardswish_model(output_too=True)
    out, modified = _apply(model)
    assert not modified
    assert [n.op_type for n in out.graph.node] == [n.op_type for n in model.graph.node]


def test_through_constant_shifts_on_both_sides_of_a_native_hardswish():
    """PP-LCNetV3's learnable affine blocks: Conv -> Add(k1) -> HardSwish -> Mul(a) -> Add(k2)
    -> Conv. The shifts' constants become one per channel (k / s), so the outputs stay
    bit-identical while the Conv's and the reader's channels are equalized."""
    w = _weights()
    init = {
        "w1": w["w1"],
        "b1": w["b1"],
        "pw": w["pw"],
        "k1": np.array([0.75], np.float32),
        "a": np.array([1.5], np.float32),
        "k2": np.array([-0.25], np.float32),
    }
    model = make_model(
        [
            _conv("conv1", "x", "w1", "b1", "c1"),
            helper.make_node("Add", ["c1", "k1"], ["x1"], name="shift_in"),
            helper.make_node("HardSwish", ["x1"], ["h"], name="hswish"),
            helper.make_node("Mul", ["h", "a"], ["m"], name="scale"),
            helper.make_node("Add", ["m", "k2"], ["z"], name="shift_out"),
            _conv("pwconv", "z", "pw", None, "y", k=1),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        init,
    )
    out, modified = _apply(model)
    assert modified
    feeds = _feeds(model)
    np.testing.assert_array_equal(run_ort(model, feeds)[0], run_ort(out, feeds)[0])
    s = _expected_scales(w["w1"], [w["pw"]])
    assert s.min() < 1 < s.max()
    new = _inits(out)
    np.testing.assert_array_equal(new["w1"], w["w1"] / s.reshape(-1, 1, 1, 1).astype(np.float32))
    for node_name, k in (("shift_in", 0.75), ("shift_out", -0.25)):
        shift = next(n for n in out.graph.node if n.name == node_name)
        constant = new[shift.input[1]]
        assert constant.shape == (C, 1, 1)
        np.testing.assert_array_equal(constant.reshape(-1), (k / s).astype(np.float32))
    np.testing.assert_array_equal(new["a"], init["a"])  # a scalar scale commutes with s


def test_power_of_two_scales_rounding_offset():
    """The offset moves every channel's rounding boundary by the same amount (numpy reference);
    0 is the plain rounding the passes use."""
    from quark_onnx.passes._channel_scaling import power_of_two_scales

    r1 = np.exp2(np.array([0.1, 1.3, 2.6, 3.9, 5.2]))
    r2 = np.ones(5)
    exact = 0.5 * np.log2(r1)  # 0.05, 0.65, 1.3, 1.95, 2.6
    for offset in (0.0, 0.25, 0.5):
        k = np.round(exact + offset)
        expected = np.exp2(np.clip(k - np.round(np.median(k)), -3, 3))
        np.testing.assert_array_equal(power_of_two_scales(r1, r2, offset=offset), expected)
    assert not np.array_equal(power_of_two_scales(r1, r2), power_of_two_scales(r1, r2, offset=0.5))
