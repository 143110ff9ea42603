"""InsertQDQ(params): any QuantParams written in standard ONNX ops, checked against numpy oracles.

The oracle of a written model is the float graph run by onnxruntime on fake-quantized tensors
(``qparams.fake_quant`` of the input and the weights), with ``fake_quant`` applied to the output:
exactly what the Q/DQ graph computes. onnxruntime's QuantizeLinear divides by the scale like the
numpy reference (measured: 0 mismatches over 2^20 Cauchy values for every type, float scales), so
the comparisons are exact.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import make_model, run_ort
from onnx import TensorProto, helper

from quark_onnx.config.enums import QuantType as Q
from quark_onnx.errors import PassError
from quark_onnx.params import qparams
from quark_onnx.params.qparams import QuantParams
from quark_onnx.passes import InsertQDQ
from quark_onnx.passes.insert_qdq import required_opset

F = TensorProto.FLOAT


def vi(name, shape, dtype=F):
    return helper.make_tensor_value_info(name, dtype, shape)


def write(proto: onnx.ModelProto, params) -> tuple[onnx.ModelProto, bool]:
    model = ir.serde.deserialize_model(proto)
    result = InsertQDQ(params)(model)
    out = ir.serde.serialize_model(result.model)
    onnx.checker.check_model(out, full_check=True)
    return out, result.modified


def with_constant(proto: onnx.ModelProto, name: str, array: np.ndarray) -> onnx.ModelProto:
    """A copy of ``proto`` whose initializer ``name`` holds ``array``."""
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    for i, init in enumerate(out.graph.initializer):
        if init.name == name:
            out.graph.initializer[i].CopyFrom(onnx.numpy_helper.from_array(array, name))
    return out


def matmul_model(k: int = 64, n: int = 8, opset: int = 17):
    rng = np.random.default_rng(1)
    w = rng.normal(scale=0.3, size=(k, n)).astype(np.float32)
    b = rng.normal(scale=0.5, size=(n,)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"], name="matmul"),
        helper.make_node("Add", ["m", "B"], ["y"], name="add"),
    ]
    proto = make_model(nodes, [vi("x", [4, k])], [vi("y", [4, n])], {"W": w, "B": b}, opset)
    return proto, w


def inputs(shape=(4, 64), seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(scale=1.5, size=shape).astype(np.float32)


# granularity of the weight W (64 x 8, read as MatMul's B: channels are axis 1, K is axis 0)
GRANULARITIES = {
    "tensor": {},
    "channel": {"axis": 1},
    "group16": {"axis": 0, "block_size": 16},
}
INTEGER_TYPES = [Q.QInt8, Q.QUInt8, Q.QInt16, Q.QUInt16, Q.QInt4, Q.QUInt4]


def case_params(qtype, granularity, symmetric, w, x, y_float):
    """Weight, activation-in and activation-out parameters for one test case."""
    wp = qparams.weight_params(w, qtype, symmetric=symmetric, **GRANULARITIES[granularity])
    xp = qparams.from_range(x.min(), x.max(), qtype, symmetric=symmetric)
    yp = qparams.from_range(y_float.min(), y_float.max(), qtype, symmetric=symmetric)
    return {"x": xp, "W": wp, "y": yp}


@pytest.mark.parametrize("granularity", list(GRANULARITIES))
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("qtype", INTEGER_TYPES)
def test_integer_types_equal_the_fake_quant_oracle(qtype, symmetric, granularity):
    proto, w = matmul_model()
    x = inputs()
    (y_float,) = run_ort(proto, {"x": x})
    params = case_params(qtype, granularity, symmetric, w, x, y_float)
    qproto, modified = write(proto, params)
    assert modified
    (got,) = run_ort(qproto, {"x": x})
    oracle = with_constant(proto, "W", qparams.fake_quant(w, params["W"]))
    (inner,) = run_ort(oracle, {"x": qparams.fake_quant(x, params["x"])})
    expected = qparams.fake_quant(inner, params["y"])
    np.testing.assert_array_equal(got, expected)
    assert np.any(got != y_float)  # the quantization did change the result
    opset = {o.domain: o.version for o in qproto.opset_import}[""]
    assert opset == max(17, required_opset(params["W"]))


@pytest.mark.parametrize("granularity", list(GRANULARITIES))
def test_float8_e4m3fn_static(granularity):
    proto, w = matmul_model()
    x = inputs()
    (y_float,) = run_ort(proto, {"x": x})
    params = case_params(Q.QFLOAT8E4M3FN, granularity, True, w, x, y_float)
    qproto, _ = write(proto, params)
    assert {o.domain: o.version for o in qproto.opset_import}[""] == (
        21 if granularity == "group16" else 19
    )
    assert qproto.ir_version >= 9
    (got,) = run_ort(qproto, {"x": x})
    oracle = with_constant(proto, "W", qparams.fake_quant(w, params["W"]))
    (inner,) = run_ort(oracle, {"x": qparams.fake_quant(x, params["x"])})
    np.testing.assert_array_equal(got, qparams.fake_quant(inner, params["y"]))


def test_uint4_g32_on_a_matmul_weight_stores_the_codes_and_beats_per_tensor():
    proto, w = matmul_model(k=96)
    x = inputs((4, 96))
    (y_float,) = run_ort(proto, {"x": x})
    group = qparams.weight_params(w, Q.QUInt4, symmetric=False, axis=0, block_size=32)
    qproto, _ = write(proto, {"W": group})
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in qproto.graph.initializer}
    assert "W" not in inits
    assert inits["W_scale"].shape == (3, 8) and inits["W_zero_point"].shape == (3, 8)
    np.testing.assert_array_equal(
        inits["W_quantized"].astype(np.int32), qparams.quantize(w, group).astype(np.int32)
    )
    dq = next(n for n in qproto.graph.node if n.name == "W_DequantizeLinear")
    attrs = {a.name: helper.get_attribute_value(a) for a in dq.attribute}
    assert attrs == {"axis": 0, "block_size": 32}
    (got,) = run_ort(qproto, {"x": x})
    oracle = with_constant(proto, "W", qparams.fake_quant(w, group))
    np.testing.assert_array_equal(got, run_ort(oracle, {"x": x})[0])
    tensor = qparams.weight_params(w, Q.QUInt4, symmetric=False)
    (per_tensor,) = run_ort(write(proto, {"W": tensor})[0], {"x": x})
    assert np.abs(got - y_float).mean() < np.abs(per_tensor - y_float).mean()


def test_given_codes_are_written_as_they_are():
    proto, w = matmul_model()
    wp = qparams.weight_params(w, Q.QInt8, axis=1)
    codes = qparams.quantize(w, wp)
    codes[0, 0] = codes[0, 0] + 1  # a code re-quantizing would not reproduce (AdaRound, import)
    given = QuantParams(Q.QInt8, wp.scale, wp.zero_point, axis=1, codes=codes)
    qproto, _ = write(proto, {"W": given})
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in qproto.graph.initializer}
    np.testing.assert_array_equal(inits["W_quantized"], codes)
    x = inputs()
    oracle = with_constant(proto, "W", qparams.dequantize(codes, given))
    np.testing.assert_array_equal(run_ort(qproto, {"x": x})[0], run_ort(oracle, {"x": x})[0])


def test_per_channel_activation_and_conv_weight():
    rng = np.random.default_rng(5)
    w = rng.normal(scale=0.4, size=(4, 3, 3, 3)).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["y"], name="conv", kernel_shape=[3, 3],
                         pads=[1, 1, 1, 1]),
    ]  # fmt: skip
    proto = make_model(nodes, [vi("x", [1, 3, 6, 6])], [vi("y", [1, 4, 6, 6])], {"W": w})
    x = rng.uniform(-2, 2, size=(1, 3, 6, 6)).astype(np.float32)
    x[0, 1] *= 0.1  # channels of different ranges
    lo, hi = x.min(axis=(0, 2, 3)), x.max(axis=(0, 2, 3))
    xp = qparams.from_range(lo, hi, Q.QUInt8, symmetric=False, axis=1)
    wp = qparams.weight_params(w, Q.QInt8, axis=0)
    qproto, _ = write(proto, {"x": xp, "W": wp})
    oracle = with_constant(proto, "W", qparams.fake_quant(w, wp))
    expected = run_ort(oracle, {"x": qparams.fake_quant(x, xp)})[0]
    np.testing.assert_array_equal(run_ort(qproto, {"x": x})[0], expected)


def test_constant_node_output_is_quantized_and_the_constant_removed():
    k = np.linspace(-1, 1, 6, dtype=np.float32).reshape(1, 6)
    nodes = [
        helper.make_node("Constant", [], ["k"], name="c", value=onnx.numpy_helper.from_array(k)),
        helper.make_node("Add", ["x", "k"], ["y"], name="add"),
    ]
    proto = make_model(nodes, [vi("x", [2, 6])], [vi("y", [2, 6])])
    kp = qparams.weight_params(k, Q.QInt8)
    qproto, _ = write(proto, {"k": kp})
    assert [n.op_type for n in qproto.graph.node] == ["DequantizeLinear", "Add"]
    x = inputs((2, 6))
    np.testing.assert_array_equal(
        run_ort(qproto, {"x": x})[0], x + qparams.fake_quant(k, kp)
    )  # fmt: skip


def test_names_follow_the_contract_and_outputs_keep_their_names():
    proto, w = matmul_model()
    params = {
        "x": qparams.from_range(-2, 2, Q.QInt8),
        "W": qparams.weight_params(w, Q.QInt8, axis=1),
        "y": qparams.from_range(-4, 4, Q.QUInt8, symmetric=False),
    }
    qproto, _ = write(proto, params)
    nodes = {n.name: (n.op_type, list(n.input), list(n.output)) for n in qproto.graph.node}
    assert nodes["x_QuantizeLinear"] == (
        "QuantizeLinear", ["x", "x_scale", "x_zero_point"], ["x_QuantizeLinear_Output"]
    )  # fmt: skip
    assert nodes["x_DequantizeLinear"][2] == ["x_DequantizeLinear_Output"]
    assert nodes["W_DequantizeLinear"] == (
        "DequantizeLinear", ["W_quantized", "W_scale", "W_zero_point"],
        ["W_DequantizeLinear_Output"],
    )  # fmt: skip
    assert nodes["add"][2] == ["y_QuantizeLinear_Input"]
    assert nodes["y_DequantizeLinear"][2] == ["y"]
    assert [o.name for o in qproto.graph.output] == ["y"]
    # the mapping's order is the writing order, and the result is deterministic
    again, _ = write(proto, params)
    assert again.SerializeToString() == qproto.SerializeToString()


def test_empty_params_leave_the_graph_unchanged():
    proto, _ = matmul_model()
    qproto, modified = write(proto, {})
    assert not modified
    assert (
        qproto.graph.SerializeToString()
        == ir.serde.serialize_model(ir.serde.deserialize_model(proto)).graph.SerializeToString()
    )


def test_unknown_tensor_is_a_pass_error_naming_it():
    proto, _ = matmul_model()
    with pytest.raises(PassError, match="not_there"):
        write(proto, {"not_there": qparams.from_range(-1, 1, Q.QInt8)})


@pytest.mark.parametrize(
    "bad, match",
    [
        (QuantParams(Q.QInt8, np.ones(3, np.float32), np.zeros(3, np.int8), axis=1), "W.*shape"),
        (QuantParams(Q.QInt8, np.array(0.0, np.float32), np.array(0, np.int8)), "W.*positive"),
        (QuantParams(Q.QInt8, np.array(1.0, np.float32), np.array(0, np.uint8)), "W.*dtype"),
        (
            QuantParams(
                Q.QInt8, np.array(1.0, np.float32), np.array(0, np.int8),
                codes=np.zeros((2, 2), np.int8),
            ),
            "W.*codes shape",
        ),
        (
            QuantParams(
                Q.QInt8, np.array(1.0, np.float32), np.array(0, np.int8),
                codes=np.zeros((64, 8), np.uint8),
            ),
            "W.*codes dtype",
        ),
    ],
)  # fmt: skip
def test_bad_constant_params_are_a_pass_error_naming_the_tensor(bad, match):
    proto, _ = matmul_model()
    with pytest.raises(PassError, match=match):
        write(proto, {"W": bad})


@pytest.mark.parametrize(
    "bad, match",
    [
        (
            QuantParams(Q.QInt8, np.array(1.0, np.float32), np.array(0, np.int8),
                        codes=np.zeros((4, 64), np.int8)),
            "activation x carries codes",
        ),
        (QuantParams(Q.QInt32, np.array(1.0, np.float32), np.array(0, np.int32)), "x.*int32"),
        (QuantParams(Q.QInt8, dynamic=True, symmetric=False), "x.*asymmetric"),
        (QuantParams(Q.QFLOAT8E4M3FN, dynamic=True), "x.*integer types"),
        (QuantParams(Q.QBFloat16, np.array(1.0, np.float32), np.array(0, np.int8)), "x.*scale"),
    ],
)  # fmt: skip
def test_bad_activation_params_are_a_pass_error_naming_the_tensor(bad, match):
    proto, _ = matmul_model()
    with pytest.raises(PassError, match=match):
        write(proto, {"x": bad})


def test_legacy_plan_call_is_unchanged():
    """InsertQDQ(plan, positions) still takes positions and writes from_position parameters."""
    from quark_onnx.config.quantization import QuantizationConfig
    from quark_onnx.plan.build import build_plan

    proto, _ = matmul_model()
    qc = QuantizationConfig()
    qc.calibrate_method = "NonOverflow"
    qc.enable_npu_cnn = True
    model = ir.serde.deserialize_model(proto)
    plan = build_plan(model, qc)
    positions = dict.fromkeys(plan.tensors, 4)
    InsertQDQ(plan, positions)(model)
    legacy = ir.serde.serialize_model(model)
    params = {t: qparams.from_position(4, s.qtype) for t, s in plan.tensors.items()}
    again, _ = write(proto, params)
    assert again.SerializeToString() == legacy.SerializeToString()


# -- float16 / bfloat16 Cast pairs ----------------------------------------------------------------


def cast_inputs():
    x = inputs()
    # exact ties of both types (round half to even decides them) and values beyond float16's range
    x[0, :4] = [1 + 2.0**-8, 1 + 3 * 2.0**-8, 1 + 2.0**-11, 70000.0]
    return x


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
@pytest.mark.parametrize("qtype", [Q.QFloat16, Q.QBFloat16])
def test_cast_pairs_for_activations_and_constants(qtype):
    proto, w = matmul_model()
    params = {"x": QuantParams(qtype), "W": QuantParams(qtype), "y": QuantParams(qtype)}
    qproto, _ = write(proto, params)
    nodes = {n.name: (n.op_type, list(n.input), list(n.output)) for n in qproto.graph.node}
    assert nodes["x_Cast"] == ("Cast", ["x"], ["x_Cast_Output"])
    assert nodes["x_CastFloat"] == ("Cast", ["x_Cast_Output"], ["x_CastFloat_Output"])
    assert nodes["W_CastFloat"] == ("Cast", ["W_quantized"], ["W_CastFloat_Output"])
    assert nodes["add"][2] == ["y_Cast_Input"] and nodes["y_CastFloat"][2] == ["y"]
    assert not any(n.op_type.endswith("QuantizeLinear") for n in qproto.graph.node)
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in qproto.graph.initializer}
    assert inits["W_quantized"].dtype == qparams.numpy_dtype(qtype)
    np.testing.assert_array_equal(inits["W_quantized"], w.astype(qparams.numpy_dtype(qtype)))
    x = cast_inputs()
    (got,) = run_ort(qproto, {"x": x})
    oracle = with_constant(proto, "W", qparams.fake_quant(w, params["W"]))
    (inner,) = run_ort(oracle, {"x": qparams.fake_quant(x, params["x"])})
    np.testing.assert_array_equal(got, qparams.fake_quant(inner, params["y"]))


# -- dynamic activations ------------------------------------------------------------------------


def dynamic_inputs():
    rng = np.random.default_rng(7)
    return {
        "normal": rng.normal(size=(4, 64)).astype(np.float32),
        "heavy_tailed": rng.standard_cauchy(size=(4, 64)).astype(np.float32),
        "positive": rng.uniform(0.5, 3.0, size=(4, 64)).astype(np.float32),
        "negative": -rng.exponential(size=(4, 64)).astype(np.float32),
        "tiny": (rng.normal(size=(4, 64)) * 1e-30).astype(np.float32),
        "zeros": np.zeros((4, 64), np.float32),
    }


DYNAMIC = [
    (Q.QUInt8, False),
    (Q.QInt8, True),
    (Q.QInt16, True),
    (Q.QUInt8, True),
    (Q.QUInt16, True),
    (Q.QInt4, True),
]


@pytest.mark.parametrize("qtype, symmetric", DYNAMIC)
def test_dynamic_runtime_scale_equals_the_reference(qtype, symmetric):
    """The scale (and zero point) the graph computes equal ``dynamic_params`` bit for bit."""
    proto, w = matmul_model()
    wp = qparams.weight_params(w, Q.QInt8, axis=1)
    params = {"x": QuantParams(qtype, dynamic=True, symmetric=symmetric), "W": wp}
    qproto, _ = write(proto, params)
    assert {o.domain: o.version for o in qproto.opset_import}[""] == max(
        17, required_opset(params["x"])
    )
    ops = [n.op_type for n in qproto.graph.node]
    if symmetric:
        assert "DynamicQuantizeLinear" not in ops and "ReduceMax" in ops
    else:
        # uint8: DynamicQuantizeLinear feeding MatMulInteger (integer accumulation)
        assert ops.count("DynamicQuantizeLinear") == 1 and ops.count("MatMulInteger") == 1
        assert "MatMul" not in ops
    # expose the run-time scale and zero point (onnxruntime returns no int4 arrays: the scale only)
    qproto.graph.output.append(vi("x_scale", []))
    if qtype.bits > 4:
        elem = helper.np_dtype_to_tensor_dtype(qparams.numpy_dtype(qtype))
        qproto.graph.output.append(vi("x_zero_point", [], elem))
    oracle = with_constant(proto, "W", qparams.fake_quant(w, wp))
    for case, x in dynamic_inputs().items():
        got, scale, *zero_point = run_ort(qproto, {"x": x})
        ref = qparams.dynamic_params(x, qtype, symmetric)
        assert scale.dtype == np.float32 and scale.shape == ()
        assert zero_point in ([], [ref.zero_point]), (case, zero_point, ref.zero_point)
        if case == "zeros":
            # all-zero input: the symmetric graph's guard and onnxruntime's
            # DynamicQuantizeLinear both give scale 1, as the reference does
            assert scale == 1.0 and ref.scale == 1.0
            np.testing.assert_array_equal(got, run_ort(oracle, {"x": x})[0])
            continue
        assert scale == ref.scale, (case, scale, ref.scale)
        xq = qparams.fake_quant(x, ref)
        (expected,) = run_ort(oracle, {"x": xq})
        if symmetric:
            np.testing.assert_array_equal(got, expected, err_msg=case)
        else:
            # MatMulInteger sums exactly, the float oracle rounds each of the K partial sums:
            # |difference| <= (K + 2) * eps * sum_k |x'_k w'_k| (plus the final two roundings)
            wq = np.abs(qparams.fake_quant(w, wp)).astype(np.float64)
            bound = (w.shape[0] + 2) * 2.0**-23 * (np.abs(xq).astype(np.float64) @ wq)
            assert np.all(np.abs(got.astype(np.float64) - expected) <= bound), case


# -- opset ----------------------------------------------------------------------------------------


def reduce_mean_model(opset: int):
    """MatMul then ReduceMean with an ``axes`` attribute (it becomes an input at opset 18)."""
    rng = np.random.default_rng(2)
    w = rng.normal(size=(64, 8)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"], name="matmul"),
        helper.make_node("ReduceMean", ["m"], ["y"], name="mean", axes=[1], keepdims=1),
    ]
    return make_model(nodes, [vi("x", [4, 64])], [vi("y", [4, 1])], {"W": w}, opset), w


def test_opset_is_raised_by_conversion_and_other_nodes_keep_their_meaning():
    proto, w = reduce_mean_model(13)
    wp = qparams.weight_params(w, Q.QUInt4, symmetric=False, axis=0, block_size=32)
    qproto, _ = write(proto, {"W": wp})
    assert {o.domain: o.version for o in qproto.opset_import}[""] == 21
    assert qproto.ir_version >= 10
    mean = next(n for n in qproto.graph.node if n.name == "mean")
    assert len(mean.input) == 2 and not mean.attribute[1:]  # axes moved to an input
    x = inputs()
    oracle = with_constant(proto, "W", qparams.fake_quant(w, wp))
    np.testing.assert_array_equal(run_ort(qproto, {"x": x})[0], run_ort(oracle, {"x": x})[0])


def test_opset_already_high_enough_is_left_alone():
    proto, w = reduce_mean_model(13)
    qproto, _ = write(proto, {"W": qparams.weight_params(w, Q.QInt8, axis=1)})
    assert {o.domain: o.version for o in qproto.opset_import}[""] == 13
    assert qproto.ir_version == proto.ir_version


def test_unsafe_conversion_is_a_pass_error_naming_tensor_type_and_opset():
    """GroupNormalization-18 (per-group scale) converted to 21 (per-channel) would break: refused.

    (onnx's checker already calls schema 18 deprecated, so the model is built unchecked.)
    """
    nodes = [
        helper.make_node("GroupNormalization", ["x", "s", "b"], ["g"], name="gn", num_groups=2),
        helper.make_node("Relu", ["g"], ["y"], name="relu"),
    ]
    inits = [
        onnx.numpy_helper.from_array(np.ones(2, np.float32), "s"),
        onnx.numpy_helper.from_array(np.zeros(2, np.float32), "b"),
    ]
    graph = helper.make_graph(nodes, "gn", [vi("x", [1, 4, 3, 3])], [vi("y", [1, 4, 3, 3])], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model = ir.serde.deserialize_model(proto)
    with pytest.raises(PassError, match=r"tensor g \(QInt16.*opset 21.*GroupNormalization"):
        InsertQDQ({"g": qparams.from_range(-1, 1, Q.QInt16)})(model)
    # int8 needs no conversion: written as usual
    InsertQDQ({"g": qparams.from_range(-1, 1, Q.QInt8)})(model)
    assert model.opset_imports[""] == 18


def test_failed_conversion_is_a_pass_error(monkeypatch):
    def refuse(model, target):
        raise RuntimeError("no adapter")

    monkeypatch.setattr(onnx.version_converter, "convert_version", refuse)
    proto, w = matmul_model()
    wp = qparams.weight_params(w, Q.QFLOAT8E4M3FN)
    with pytest.raises(PassError, match=r"tensor W \(QFLOAT8E4M3FN.*opset 19.*no adapter"):
        write(proto, {"W": wp})


@pytest.mark.parametrize(
    "granularity",
    [{"axis": 0}, {"axis": -2}, {"axis": 1, "block_size": 16}, {"axis": 0, "block_size": 3}],
)
def test_activation_per_channel_and_per_group_on_any_axis(granularity):
    proto, _ = matmul_model()
    x = inputs()
    x[1] *= 0.05  # rows and groups of different ranges
    lo, hi = qparams.weight_range(x, **granularity)  # the activation's range, shaped like a scale
    xp = qparams.from_range(lo, hi, Q.QInt8, **granularity)
    qproto, _ = write(proto, {"x": xp})
    q = next(n for n in qproto.graph.node if n.name == "x_QuantizeLinear")
    attrs = {a.name: helper.get_attribute_value(a) for a in q.attribute}
    assert attrs == granularity
    (got,) = run_ort(qproto, {"x": x})
    np.testing.assert_array_equal(got, run_ort(proto, {"x": qparams.fake_quant(x, xp)})[0])
