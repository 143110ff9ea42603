"""Plans and QuantParams of the float-scale strategies, checked against numpy references."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import make_model
from onnx import TensorProto, helper
from transformer_block import block_inputs, build_block

from quark_onnx import QuantizationConfig, QuantType, get_default_config
from quark_onnx.calibration import calibrate
from quark_onnx.model_files.load import to_ir
from quark_onnx.params import qparams
from quark_onnx.params.strategy import calibrated_names, compute_params, needs_calibration
from quark_onnx.plan.build import build_plan
from quark_onnx.plan.types import TensorKind

LINEAR_WEIGHTS = ["wq", "wk", "wv", "wo", "w1", "w2"]


def block_plan(qc: QuantizationConfig, gelu: str = "op"):
    model = to_ir(build_block(gelu=gelu))
    return model, build_plan(model, qc, qc.validate())


def a8w8(**changes) -> QuantizationConfig:
    """Static int8 on every op, symmetric, per tensor (the mechanism these tests pin; the A8W8
    preset itself restricts the op types and uses per-channel weights, asymmetric activations)."""
    qc = get_default_config("A8W8")
    qc.op_types_to_quantize = []
    qc.per_channel = False
    qc.extra_options["ActivationSymmetric"] = True
    for key, value in changes.items():
        if key in qc.extra_options or key[0].isupper():
            qc.extra_options[key] = value
        else:
            setattr(qc, key, value)
    return qc


def test_static_plan_covers_the_transformer_ops():
    _, plan = block_plan(a8w8())
    assert plan.float_nodes == []
    planned_ops = {n.op_type for n in plan.nodes}
    assert {"MatMul", "Add", "LayerNormalization", "Softmax", "Gelu", "Div", "Transpose"} <= (
        planned_ops
    )
    assert "Reshape" in planned_ops
    assert sorted(plan.weight_names()) == sorted([*LINEAR_WEIGHTS, "sqrt_dh"])  # Div's constant
    assert [plan.tensors[w].axis for w in plan.weight_names()] == [None] * 7
    # MatMul+Add: the Add constant is the layer's bias, quantized at s_in * s_w
    assert plan.bias_names() == [w + "_b" for w in LINEAR_WEIGHTS]
    assert plan.bias_sources["wq_b"] == ("x", "wq")
    assert plan.bias_sources["w2_b"] == ("gelu", "w2")
    # the attention MatMuls read two activations
    scores = next(n for n in plan.nodes if n.name == "scores")
    assert scores.weight is None and scores.inputs == ("qh", "kt")
    # LayerNormalization: only X is quantized, Scale and B stay float
    ln = next(n for n in plan.nodes if n.name == "ln1")
    assert ln.inputs == ("res1", None, None)


def test_per_channel_and_per_group_axes_of_matmul_weights():
    _, plan = block_plan(a8w8(per_channel=True))
    assert {(plan.tensors[w].axis, plan.tensors[w].block_size) for w in LINEAR_WEIGHTS} == {
        (1, None)  # B is [K, N]: one scale per output column
    }
    assert plan.tensors["sqrt_dh"].axis is None
    _, plan = block_plan(a8w8(per_channel=True, WeightBlockSize=32))
    assert {(plan.tensors[w].axis, plan.tensors[w].block_size) for w in LINEAR_WEIGHTS} == {
        (0, 32)  # groups of 32 rows along K
    }


def test_power_of_two_plan_leaves_transformer_only_ops_float():
    """The XINT8 flow must not start quantizing Div/LayerNormalization/Gelu (must not fire)."""
    qc = get_default_config("XINT8")
    _, plan = block_plan(qc)
    floats = {f.op_type for f in plan.float_nodes}
    assert {"Div", "LayerNormalization", "Gelu"} <= floats
    assert plan.bias_sources == {}  # no MatMul+Add bias: the Add constant stays a weight
    assert plan.tensors["wq_b"].kind is TensorKind.WEIGHT


def test_weight_only_plan_has_only_layer_weights():
    _, plan = block_plan(get_default_config("UINT4_WEIGHT_ONLY_G32"))
    assert list(plan.tensors) == LINEAR_WEIGHTS
    assert all(
        s.kind is TensorKind.WEIGHT and s.qtype is QuantType.QUInt4 for s in plan.tensors.values()
    )
    assert {(s.axis, s.block_size, s.symmetric) for s in plan.tensors.values()} == {(0, 32, False)}
    assert [n.op_type for n in plan.nodes] == ["MatMul"] * 6
    assert not needs_calibration(plan)


def test_dynamic_plan_quantizes_layer_inputs_at_run_time():
    _, plan = block_plan(get_default_config("INT8_DYNAMIC"))
    acts = plan.activation_names()
    # the attention MatMuls (both operands computed) stay float
    assert acts == ["x", "merged", "ln1", "gelu"]
    assert all(plan.tensors[a].dynamic for a in acts)
    assert plan.weight_names() == LINEAR_WEIGHTS and plan.bias_names() == []
    assert all(n.output is None for n in plan.nodes)
    assert not needs_calibration(plan) and calibrated_names(plan) == []


def test_erf_gelu_is_quantized_at_its_input_and_output_only():
    _, plan = block_plan(a8w8(), gelu="erf")
    inner = {f.name for f in plan.float_nodes}
    assert inner == {"gelu_div", "gelu_erf", "gelu_add", "gelu_mul"}
    tail = next(n for n in plan.nodes if n.name == "gelu")
    assert tail.inputs == (None, None) and tail.output == "gelu"
    assert "h" in plan.tensors  # the Gelu input
    assert "gelu_erf" not in plan.tensors and "gelu_add" not in plan.tensors


def _erf_model(div_by: float, first_half: bool) -> onnx.ModelProto:
    f = TensorProto.FLOAT
    consts = {"c": np.array(div_by, np.float32), "one": np.array(1.0, np.float32)}
    consts["half"] = np.array(0.5, np.float32)
    nodes = [helper.make_node("Relu", ["x"], ["h"], name="relu")]
    nodes += [
        helper.make_node("Div", ["h", "c"], ["d"], name="div"),
        helper.make_node("Erf", ["d"], ["e"], name="erf"),
        helper.make_node("Add", ["e", "one"], ["a"], name="add"),
    ]
    if first_half:
        nodes += [
            helper.make_node("Mul", ["h", "half"], ["hh"], name="half_mul"),
            helper.make_node("Mul", ["hh", "a"], ["y"], name="out_mul"),
        ]
    else:
        nodes += [
            helper.make_node("Mul", ["a", "half"], ["ah"], name="half_mul"),
            helper.make_node("Mul", ["h", "ah"], ["y"], name="out_mul"),
        ]
    return make_model(
        nodes,
        [helper.make_tensor_value_info("x", f, [2, 8])],
        [helper.make_tensor_value_info("y", f, [2, 8])],
        consts,
    )


@pytest.mark.parametrize("first_half", [True, False])
def test_erf_gelu_arrangements(first_half):
    model = to_ir(_erf_model(np.sqrt(2.0), first_half))
    plan = build_plan(model, a8w8())
    assert {f.name for f in plan.float_nodes} == {"div", "erf", "add", "half_mul"}
    # not a Gelu (x / 2 inside Erf): every node is quantized on its own, the Erf too (an
    # activation: its own input and output positions)
    model = to_ir(_erf_model(2.0, first_half))
    plan = build_plan(model, a8w8())
    assert {f.name for f in plan.float_nodes} == set()
    assert {"d", "e"} <= set(plan.tensors)


def test_float8_does_not_requantize_relu_outputs():
    f = TensorProto.FLOAT
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("Conv", ["r", "w2"], ["y"], name="conv2"),
    ]
    rng = np.random.default_rng(0)
    proto = make_model(
        nodes,
        [helper.make_tensor_value_info("x", f, [1, 2, 4, 4])],
        [helper.make_tensor_value_info("y", f, [1, 2, 4, 4])],
        {
            "w": rng.standard_normal((2, 2, 1, 1)).astype(np.float32),
            "w2": rng.standard_normal((2, 2, 1, 1)).astype(np.float32),
        },
    )
    fp8 = build_plan(to_ir(proto), get_default_config("FP8_E4M3"))
    assert "r" not in fp8.tensors and "c" in fp8.tensors
    int8 = build_plan(to_ir(proto), get_default_config("A8W8"))
    assert "r" in int8.tensors


def _calibrated_params(qc: QuantizationConfig):
    proto = build_block()
    model = to_ir(proto)
    options = qc.validate()
    plan = build_plan(model, qc, options)
    result = None
    if needs_calibration(plan):
        result = calibrate(
            proto,
            calibrated_names(plan),
            {"x": block_inputs(8, 1)},
            method=qc.calibrate_method,
            options=options,
        )
    return proto, plan, result, compute_params(plan, result, model, qc, options)


def _array(proto: onnx.ModelProto, name: str) -> np.ndarray:
    return next(onnx.numpy_helper.to_array(i) for i in proto.graph.initializer if i.name == name)


def test_static_params_follow_the_numpy_references():
    qc = a8w8(per_channel=True)
    proto, plan, result, params = _calibrated_params(qc)
    assert list(params) == list(plan.tensors)  # plan order
    options = qc.resolved_options()
    for name in plan.activation_names():
        lo, hi = result.range(name, method=qc.calibrate_method, options=options)
        p = params[name]
        assert p.qtype is QuantType.QInt8 and p.zero_point == 0
        assert p.scale == np.float32(max(-lo, hi) / 127)
    wq = _array(proto, "wq")
    p = params["wq"]
    assert p.axis == 1 and p.scale.shape == (64,)
    np.testing.assert_array_equal(p.scale, (np.abs(wq).max(axis=0) / 127).astype(np.float32))
    np.testing.assert_array_equal(p.codes, qparams.quantize(wq, p))
    # bias at the accumulator scale, per channel like the weight
    b = params["wq_b"]
    assert b.qtype is QuantType.QInt32 and b.axis == 0
    np.testing.assert_array_equal(b.scale, params["x"].scale * params["wq"].scale)
    np.testing.assert_array_equal(b.codes, qparams.quantize(_array(proto, "wq_b"), b))
    assert np.all(b.zero_point == 0)


def test_bias_without_int32_gets_its_own_int8_scale():
    _, _, _, params = _calibrated_params(a8w8(Int32Bias=False))
    b = params["w1_b"]
    assert b.qtype is QuantType.QInt8 and b.axis is None


def test_asymmetric_uint8_activations_and_percentile_ranges():
    qc = get_default_config("U8S8")
    _, _, result, params = _calibrated_params(qc)
    options = qc.resolved_options()
    lo, hi = result.range("probs", method=qc.calibrate_method, options=options)
    assert lo >= 0  # Softmax output: one-sided, so the zero point sits at the bottom
    p = params["probs"]
    assert p.zero_point.dtype == np.uint8 and int(p.zero_point) == 0
    assert p.scale == np.float32(hi / 255)


def test_weight_only_params_are_block_uint4_with_codes():
    _, _, result, params = _calibrated_params(get_default_config("UINT4_WEIGHT_ONLY_G32"))
    assert result is None  # no calibration at all
    proto = build_block()
    for name in LINEAR_WEIGHTS:
        p, w = params[name], _array(proto, name)
        assert p.block_size == 32 and p.axis == 0
        assert p.scale.shape == (w.shape[0] // 32, w.shape[1])
        assert p.codes.dtype == qparams.numpy_dtype(QuantType.QUInt4)
        # asymmetric MinMax per group: every value within half a step of its code
        step = qparams.broadcast_parameter(p.scale, w.shape, 0, 32)
        err = np.abs(qparams.dequantize(p.codes, p) - w)
        assert np.all(err <= step / 2 * (1 + 1e-5))


def test_dynamic_and_cast_params_carry_no_scale():
    _, _, result, params = _calibrated_params(get_default_config("INT8_DYNAMIC"))
    assert result is None
    assert params["x"].dynamic and params["x"].scale is None
    _, _, result, params = _calibrated_params(get_default_config("BF16"))
    assert result is None
    assert {p.granularity for p in params.values()} == {"cast"}
    assert params["wq"].codes.dtype == qparams.numpy_dtype(QuantType.QBFloat16)


@pytest.mark.parametrize(("preset", "qmax"), [("A16W8", 32767.0), ("FP8_E4M3", 448.0)])
def test_int16_and_float8_activation_scales_follow_the_calibrated_range(preset, qmax):
    """The end-to-end error bounds are loose for these types (a 2x scale error stays within
    them), so their scales are pinned here: ``max(-lo, hi) / qmax`` of the calibrated range."""
    qc = get_default_config(preset)
    qc.optimize_model = False
    _, plan, result, params = _calibrated_params(qc)
    options = qc.resolved_options()
    names = plan.activation_names()
    assert names
    for name in names:
        lo, hi = result.range(name, method=qc.calibrate_method, options=options)
        p = params[name]
        assert p.qtype is qc.activation_type
        assert p.scale == np.float32(max(-lo, hi, 0.0) / qmax), name
