"""InsertQDQ: the written form, exact numerics against a numpy oracle, determinism."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import make_model, run_ort
from onnx import TensorProto, helper

from quark_onnx.config.enums import QuantType
from quark_onnx.config.quantization import QuantizationConfig
from quark_onnx.params import pof2
from quark_onnx.passes import InsertQDQ
from quark_onnx.plan.build import build_plan

F = TensorProto.FLOAT


def vi(name, shape):
    return helper.make_tensor_value_info(name, F, shape)


def config(activation=QuantType.QInt8, **extra) -> QuantizationConfig:
    qc = QuantizationConfig()
    qc.calibrate_method = "NonOverflow"
    qc.enable_npu_cnn = True
    qc.activation_type = activation
    qc.extra_options.update(extra)
    return qc


def fq(x, p):
    """The numpy oracle: clip(round_half_even(x / s), -128, 127) * s."""
    s = np.float64(2.0**-p)
    return (np.clip(np.round(x.astype(np.float64) / s), -128, 127) * s).astype(np.float32)


def quantize(proto, qc, positions):
    model = ir.serde.deserialize_model(proto)
    plan = build_plan(model, qc)
    result = InsertQDQ(plan, positions)(model)
    out = ir.serde.serialize_model(result.model)
    onnx.checker.check_model(out, full_check=True)
    return out, plan, result.modified


def elementwise_model():
    k = np.linspace(-1.3, 2.1, 6, dtype=np.float32).reshape(1, 6)
    nodes = [
        helper.make_node("Add", ["x", "k"], ["a"], name="add"),
        helper.make_node("Relu", ["a"], ["r"], name="relu"),
        helper.make_node("Mul", ["r", "x"], ["y"], name="mul"),
    ]
    return make_model(nodes, [vi("x", [None, 6])], [vi("y", [None, 6])], {"k": k}), k


@pytest.mark.parametrize("activation", [QuantType.QInt8, QuantType.QUInt8])
def test_numerics_equal_the_numpy_oracle_exactly(activation):
    proto, k = elementwise_model()
    pos = {"x": 5, "k": 6, "a": 4, "r": 4, "y": 3}
    qproto, _, _ = quantize(proto, config(activation), pos)
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [rng.normal(scale=3, size=(200, 6)), (np.arange(-60, 60).reshape(20, 6) + 0.5) / 32]
    ).astype(np.float32)
    (got,) = run_ort(qproto, {"x": x})
    xq = fq(x, pos["x"])
    a = fq(xq + fq(k, pos["k"]), pos["a"])
    r = fq(np.maximum(a, 0), pos["r"])
    expected = fq(r * xq, pos["y"])
    np.testing.assert_array_equal(got, expected)
    assert np.any(got != run_ort(proto, {"x": x})[0])  # quantization did change the result


def test_written_form_names_types_and_values():
    proto, k = elementwise_model()
    pos = {"x": 5, "k": 6, "a": 4, "r": 4, "y": 3}
    qproto, _, modified = quantize(proto, config(), pos)
    assert modified
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in qproto.graph.initializer}
    assert "k" not in inits  # the float weight is gone
    np.testing.assert_array_equal(inits["k_quantized"], pof2.quantize(k, 6))
    assert inits["k_quantized"].dtype == np.int8
    for t, p in pos.items():
        assert inits[f"{t}_scale"].shape == () and inits[f"{t}_scale"].dtype == np.float32
        assert float(inits[f"{t}_scale"]) == 2.0**-p
        assert inits[f"{t}_zero_point"].dtype == np.int8 and int(inits[f"{t}_zero_point"]) == 0
    ops = [(n.op_type, n.name, list(n.output)) for n in qproto.graph.node]
    assert ops[:2] == [
        ("QuantizeLinear", "x_QuantizeLinear", ["x_QuantizeLinear_Output"]),
        ("DequantizeLinear", "x_DequantizeLinear", ["x_DequantizeLinear_Output"]),
    ]
    assert ("DequantizeLinear", "k_DequantizeLinear", ["k_DequantizeLinear_Output"]) in ops
    assert not any(n.op_type == "QuantizeLinear" and n.input[0].startswith("k") for n in
                   qproto.graph.node)  # fmt: skip
    # the graph output keeps its name, written by the last DequantizeLinear
    assert [o.name for o in qproto.graph.output] == ["y"]
    mul = next(n for n in qproto.graph.node if n.name == "mul")
    assert list(mul.output) == ["y_QuantizeLinear_Input"]
    assert ops[-1] == ("DequantizeLinear", "y_DequantizeLinear", ["y"])
    # every former consumer of x reads the DequantizeLinear output
    consumers = [n for n in qproto.graph.node if "x_DequantizeLinear_Output" in n.input]
    assert {n.name for n in consumers} == {"add", "mul"}


def test_uint8_activations_use_zero_point_128():
    proto, _ = elementwise_model()
    qproto, _, _ = quantize(proto, config(QuantType.QUInt8), {"x": 5, "k": 6, "a": 4, "r": 4,
                                                              "y": 3})  # fmt: skip
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in qproto.graph.initializer}
    assert inits["x_zero_point"].dtype == np.uint8 and int(inits["x_zero_point"]) == 128
    assert inits["k_zero_point"].dtype == np.int8  # weights stay int8


def conv_model():
    rng = np.random.default_rng(3)
    w = rng.normal(scale=0.4, size=(4, 3, 3, 3)).astype(np.float32)
    b = rng.normal(size=(4,)).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "W", "B"], ["c"], name="conv", kernel_shape=[3, 3],
                         pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["y"], name="relu"),
    ]  # fmt: skip
    return make_model(nodes, [vi("x", [1, 3, 6, 6])], [vi("y", [1, 4, 6, 6])], {"W": w, "B": b})


@pytest.mark.parametrize("int32", [False, True])
def test_bias_int8_or_int32_and_fused_relu(int32):
    proto = conv_model()
    pos = {"x": 5, "W": 7, "B": 4, "y": 4}
    if int32:
        pos["B"] = 12  # p_in + p_w, as the solver sets it
    qproto, plan, _ = quantize(proto, config(Int32Bias=int32, RemoveQDQConvRelu=True), pos)
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in qproto.graph.initializer}
    b = onnx.numpy_helper.to_array(next(i for i in proto.graph.initializer if i.name == "B"))
    assert inits["B_quantized"].dtype == (np.int32 if int32 else np.int8)
    np.testing.assert_array_equal(inits["B_quantized"], np.round(b * 2.0 ** pos["B"]))
    assert float(inits["B_scale"]) == 2.0 ** -pos["B"]
    # no pair between Conv and the fused Relu
    conv = next(n for n in qproto.graph.node if n.name == "conv")
    relu = next(n for n in qproto.graph.node if n.name == "relu")
    assert list(relu.input) == list(conv.output) == ["c"]
    assert "c" not in plan.tensors
    # numerics: conv over the dequantized values, exactly what the graph does
    x = np.random.default_rng(4).uniform(-2, 2, size=(1, 3, 6, 6)).astype(np.float32)
    (got,) = run_ort(qproto, {"x": x})
    assert np.all(np.abs(got / 2.0**-4 - np.round(got / 2.0**-4)) == 0)  # on the output grid


def test_graph_input_read_by_several_nodes_gets_one_pair():
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="r1"),
        helper.make_node("Relu", ["x"], ["b"], name="r2"),
        helper.make_node("Add", ["a", "b"], ["y"], name="add"),
    ]
    proto = make_model(nodes, [vi("x", [4])], [vi("y", [4])])
    qproto, _, _ = quantize(proto, config(), {"x": 2, "a": 2, "b": 2, "y": 1})
    assert sum(n.op_type == "QuantizeLinear" for n in qproto.graph.node) == 4
    assert sum("x_DequantizeLinear_Output" in n.input for n in qproto.graph.node) == 2


def test_nothing_to_quantize_leaves_the_model_alone():
    proto = make_model(
        [helper.make_node("Sigmoid", ["x"], ["y"], name="s")], [vi("x", [2])], [vi("y", [2])]
    )
    qproto, plan, modified = quantize(proto, config(), {})
    assert not modified and not plan.tensors
    assert [n.op_type for n in qproto.graph.node] == ["Sigmoid"]


def test_missing_position_is_an_error():
    from quark_onnx.errors import PassError

    proto, _ = elementwise_model()
    with pytest.raises(PassError, match="no position"):
        quantize(proto, config(), {"x": 1})


def test_output_is_byte_identical_for_the_same_input():
    proto = conv_model()
    pos = {"x": 5, "W": 7, "B": 4, "c": 4, "y": 4}
    first, _, _ = quantize(proto, config(), pos)
    second, _, _ = quantize(proto, config(), pos)
    assert first.SerializeToString() == second.SerializeToString()


def test_cost_is_linear_in_the_number_of_pairs():
    import time

    def chain(n):
        nodes = [helper.make_node("Relu", [f"t{i}"], [f"t{i + 1}"], name=f"r{i}") for i in range(n)]
        proto = make_model(nodes, [vi("t0", [2])], [vi(f"t{n}", [2])])
        model = ir.serde.deserialize_model(proto)
        plan = build_plan(model, config())
        start = time.perf_counter()
        InsertQDQ(plan, dict.fromkeys(plan.tensors, 3))(model)
        return time.perf_counter() - start

    chain(100)  # warm up
    small, large = chain(250), chain(2000)
    assert large < 8 * small * 3  # 8x the pairs: far below the 64x of a quadratic pass


@pytest.mark.real_model
@pytest.mark.slow
def test_digits_cnn_end_to_end_keeps_top1():
    """plan -> NonOverflow positions from onnxruntime activations -> solve -> insert -> top-1."""
    from conftest import shared_path

    from quark_onnx.graph.ir import constant_array
    from quark_onnx.params.solver import solve_positions
    from quark_onnx.passes import (
        ConvertAvgPoolToDPUVersion,
        ConvertHardSigmoidToDPUVersion,
        ConvertLeakyReluToDPUVersion,
        MakeConvAttributesExplicit,
    )

    proto = onnx.shape_inference.infer_shapes(onnx.load(shared_path("models", "digits_cnn.onnx")))
    calib = np.load(shared_path("models", "digits_calib.npz"))["x"][:16]
    test = np.load(shared_path("models", "digits_test.npz"))
    model = ir.serde.deserialize_model(proto)
    for simulate in (
        MakeConvAttributesExplicit(),
        ConvertLeakyReluToDPUVersion(),
        ConvertHardSigmoidToDPUVersion(),
        ConvertAvgPoolToDPUVersion(),
    ):
        simulate(model)
    qc = config(RemoveQDQConvRelu=True, RemoveQDQConvClip=True, RemoveQDQConvLeakyRelu=True)
    plan = build_plan(model, qc)
    float_proto = ir.serde.serialize_model(model)

    probe = onnx.ModelProto()
    probe.CopyFrom(float_proto)
    probe.graph.output.extend(
        helper.make_tensor_value_info(t, F, None) for t in plan.activation_names() if t != "logits"
    )
    acts = dict(
        zip([o.name for o in probe.graph.output], run_ort(probe, {"image": calib}), strict=True)
    )
    positions = {
        t: pof2.nonoverflow_position(float(acts[t].min()), float(acts[t].max()))
        for t in plan.activation_names()
    }
    constants = {}
    for node in model.graph:
        for v in node.inputs:
            if v is not None and v.name in plan.tensors:
                constants[v.name] = v
    for t in plan.weight_names():
        positions[t] = pof2.weight_position(constant_array(constants[t]), "NonOverflow")
    for t in plan.bias_names():
        positions[t] = pof2.bias_position(constant_array(constants[t]))
    result = solve_positions(plan, positions)
    assert result.ok, result.unfixable
    InsertQDQ(plan, result.positions)(model)
    quantized = ir.serde.serialize_model(model)
    onnx.checker.check_model(quantized)

    top1_float = float(
        (run_ort(float_proto, {"image": test["x"]})[0].argmax(1) == test["y"]).mean()
    )
    top1 = float((run_ort(quantized, {"image": test["x"]})[0].argmax(1) == test["y"]).mean())
    print(f"digits_cnn top-1: float {top1_float:.4f}, XINT8 {top1:.4f}")
    assert top1 >= 0.98
