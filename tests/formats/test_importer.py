"""Importing QDQ models: parameters and float model back from this project's, onnxruntime's and
hand-written QDQ graphs; re-export gives the same outputs; unsupported constructs are refused."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from conftest import make_model, run_ort, shared_path
from onnx import TensorProto, helper

from quark_onnx.config.enums import QuantType
from quark_onnx.formats.importer import QDQImportError, extract_params, read_qdq
from quark_onnx.formats.recipe import import_recipe, load_recipe
from quark_onnx.model_files.load import to_ir, to_proto
from quark_onnx.params.qparams import QuantParams, from_range, quantize, weight_params
from quark_onnx.passes.insert_qdq import InsertQDQ

F = TensorProto.FLOAT
RNG = np.random.default_rng(11)
W = RNG.normal(0, 0.5, (64, 16)).astype(np.float32)
B = RNG.normal(0, 0.1, 64).astype(np.float32)


def matmul_model() -> onnx.ModelProto:
    """x[2,16] -> MatMul(W^T) -> Add(B) -> Relu -> y (W as [16,64])."""
    nodes = [
        helper.make_node("MatMul", ["x", "wt"], ["m"], name="mm"),
        helper.make_node("Add", ["m", "b"], ["a"], name="add"),
        helper.make_node("Relu", ["a"], ["y"], name="relu"),
    ]
    return make_model(
        nodes,
        [helper.make_tensor_value_info("x", F, [2, 16])],
        [helper.make_tensor_value_info("y", F, [2, 64])],
        {"wt": np.ascontiguousarray(W.T), "b": B},
        opset=21,
    )


def _apply(model: onnx.ModelProto, params: dict[str, QuantParams]) -> onnx.ModelProto:
    ir_model = to_ir(model)
    InsertQDQ(params)(ir_model)
    return to_proto(ir_model)


X = RNG.normal(0, 1, (2, 16)).astype(np.float32)


def _same(a: QuantParams, b: QuantParams) -> bool:
    def eq(u, v):
        if u is None or v is None:
            return u is None and v is None
        return u.dtype == v.dtype and u.shape == v.shape and np.array_equal(u, v)

    return (
        a.qtype is b.qtype
        and a.axis == b.axis
        and a.block_size == b.block_size
        and a.dynamic == b.dynamic
        and (a.dynamic is False or a.symmetric == b.symmetric)
        and eq(a.scale, b.scale)
        and eq(a.zero_point, b.zero_point)
    )


PARAM_SETS = {
    "int8 per tensor": lambda: {
        "x": from_range(-3.0, 3.0, QuantType.QInt8),
        "wt": weight_params(W.T, QuantType.QInt8),
        "m": from_range(-10.0, 12.0, QuantType.QUInt8, symmetric=False),
        "y": from_range(0.0, 8.0, QuantType.QUInt8, symmetric=False),
    },
    "int4 per group, int16 activations": lambda: {
        "x": from_range(-3.0, 3.0, QuantType.QInt16),
        "wt": weight_params(W.T, QuantType.QUInt4, symmetric=False, axis=0, block_size=8),
    },
    "per channel int8 + float8": lambda: {
        "wt": weight_params(W.T, QuantType.QInt8, axis=1),
        "a": from_range(-9.0, 9.0, QuantType.QFLOAT8E4M3FN),
    },
    "bfloat16 and float16 casts": lambda: {
        "x": QuantParams(QuantType.QBFloat16),
        "wt": QuantParams(QuantType.QFloat16),
        "y": QuantParams(QuantType.QBFloat16),
    },
    "dynamic": lambda: {
        "x": QuantParams(QuantType.QInt8, dynamic=True),
        "wt": weight_params(W.T, QuantType.QInt8),
        "m": QuantParams(QuantType.QUInt8, dynamic=True, symmetric=False),
    },
}


@pytest.mark.parametrize("kind", list(PARAM_SETS))
def test_own_models_read_back_to_the_same_parameters(kind):
    float_model = matmul_model()
    params = PARAM_SETS[kind]()
    quantized = _apply(float_model, params)
    imported = read_qdq(quantized)
    assert set(imported.params) == set(params)
    for name, p in params.items():
        assert _same(imported.params[name], p), name
    # the float model is the original graph (weights at their dequantized values)
    fm = imported.float_model
    assert fm is not None
    ops = [n.op_type for n in fm.graph.node]
    assert ops == ["MatMul", "Add", "Relu"], ops
    assert [o.name for o in fm.graph.output] == ["y"]
    assert [i.name for i in fm.graph.input] == ["x"]
    # re-export rebuilds the quantized model (the order of the parameters is the writer's)
    rebuilt = _apply(fm, imported.params)
    assert rebuilt.SerializeToString() == quantized.SerializeToString()
    (expected,) = run_ort(quantized, {"x": X})
    (got,) = run_ort(rebuilt, {"x": X})
    np.testing.assert_array_equal(got, expected)


def test_graph_output_keeps_its_name():
    params = {"y": from_range(0.0, 8.0, QuantType.QUInt8, symmetric=False)}
    quantized = _apply(matmul_model(), params)
    producers = [o for n in quantized.graph.node for o in n.output]
    assert "y_QuantizeLinear_Input" in producers
    imported = read_qdq(quantized)
    assert list(imported.params) == ["y"]
    fm = imported.float_model
    assert [n.output[0] for n in fm.graph.node][-1] == "y"
    (a,) = run_ort(fm, {"x": X})
    (b,) = run_ort(matmul_model(), {"x": X})
    np.testing.assert_array_equal(a, b)


def test_float_model_is_not_touched():
    """A model without quantization: nothing found, the float model computes the same."""
    model = matmul_model()
    imported = read_qdq(model)
    assert imported.params == {}
    (a,) = run_ort(imported.float_model, {"x": X})
    (b,) = run_ort(model, {"x": X})
    np.testing.assert_array_equal(a, b)


def _foreign_qdq() -> onnx.ModelProto:
    """onnxruntime-style QDQ written by hand: a one-element 1-D int32 bias scale, the bias DQ
    writing the bias's own name, the output renamed through ``_QuantizeLinear_Input``."""
    s_x, s_w = np.float32(0.02), np.float32(0.01)
    wq = np.clip(np.rint(W.T / s_w), -127, 127).astype(np.int8)
    bq = np.rint(B / (s_x * s_w)).astype(np.int32)
    inits = {
        "x_scale": np.array(s_x),
        "x_zero_point": np.array(3, dtype=np.uint8),
        "wt_quantized": wq,
        "wt_scale": np.array(s_w),
        "wt_zero_point": np.array(0, dtype=np.int8),
        "b_quantized": bq,
        "b_quantized_scale": np.array([s_x * s_w], dtype=np.float32),
        "b_quantized_zero_point": np.array(0, dtype=np.int32),
        "y_scale": np.array(0.05, dtype=np.float32),
        "y_zero_point": np.array(0, dtype=np.uint8),
    }
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zero_point"], ["xq"], name="xq"),
        helper.make_node("DequantizeLinear", ["xq", "x_scale", "x_zero_point"], ["xd"]),
        helper.make_node(
            "DequantizeLinear", ["wt_quantized", "wt_scale", "wt_zero_point"], ["wt_dq"]
        ),
        helper.make_node(
            "DequantizeLinear",
            ["b_quantized", "b_quantized_scale", "b_quantized_zero_point"],
            ["b"],
            name="b_DequantizeLinear",
        ),
        helper.make_node("MatMul", ["xd", "wt_dq"], ["m"], name="mm"),
        helper.make_node("Add", ["m", "b"], ["y_QuantizeLinear_Input"], name="add"),
        helper.make_node(
            "QuantizeLinear", ["y_QuantizeLinear_Input", "y_scale", "y_zero_point"], ["yq"]
        ),
        helper.make_node("DequantizeLinear", ["yq", "y_scale", "y_zero_point"], ["y"]),
    ]
    return make_model(
        nodes,
        [helper.make_tensor_value_info("x", F, [2, 16])],
        [helper.make_tensor_value_info("y", F, [2, 64])],
        inits,
    )


def test_foreign_qdq_model_imports_and_reexports_equivalently(tmp_path):
    qdq = _foreign_qdq()
    imported = read_qdq(qdq)
    assert set(imported.params) == {"x", "wt_dq", "b", "y"}
    bias = imported.params["b"]
    assert bias.qtype is QuantType.QInt32 and bias.scale.shape == () and bias.codes is not None
    assert imported.params["x"].symmetric is False  # zero point 3
    fm = imported.float_model
    assert {n.op_type for n in fm.graph.node} == {"MatMul", "Add"}
    folded = {i.name: onnx.numpy_helper.to_array(i) for i in fm.graph.initializer}
    np.testing.assert_array_equal(
        folded["b"], (imported.params["b"].codes * imported.params["b"].scale).astype(np.float32)
    )
    (expected,) = run_ort(qdq, {"x": X})
    (got,) = run_ort(_apply(fm, imported.params), {"x": X})
    np.testing.assert_array_equal(got, expected)
    # the same through the recipe files
    import_recipe(qdq, tmp_path / "rec")
    (via_recipe,) = run_ort(load_recipe(tmp_path / "rec"), {"x": X})
    np.testing.assert_array_equal(via_recipe, expected)


def _with_node(node: onnx.NodeProto, opset_domain=None) -> onnx.ModelProto:
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", F, [2, 16])],
        [helper.make_tensor_value_info("y", F, None)],
    )
    opsets = [helper.make_opsetid("", 21)]
    if opset_domain:
        opsets.append(helper.make_opsetid(opset_domain, 1))
    return helper.make_model(graph, opset_imports=opsets)


def _dequantized_graph_input() -> onnx.ModelProto:
    """A DequantizeLinear of a graph input (the model takes int8 inputs)."""
    graph = helper.make_graph(
        [helper.make_node("DequantizeLinear", ["xi", "s"], ["y"], name="dq_in")],
        "g",
        [helper.make_tensor_value_info("xi", TensorProto.INT8, [2, 16])],
        [helper.make_tensor_value_info("y", F, [2, 16])],
        [onnx.numpy_helper.from_array(np.array(0.1, np.float32), "s")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (
            _with_node(helper.make_node("QLinearMatMul", ["x"] * 8, ["y"], name="qmm")),
            "'qmm' is QLinearMatMul",
        ),
        (
            _with_node(
                helper.make_node(
                    "VitisQuantizeLinear", ["x"], ["y"], name="vq", domain="com.vai.quantize"
                ),
                opset_domain="com.vai.quantize",
            ),
            "'vq' is VitisQuantizeLinear of the custom domain",
        ),
        (_dequantized_graph_input(), "'dq_in': dequantizes the graph input 'xi'"),
    ],
)
def test_unsupported_constructs_are_refused_naming_the_node(model, message):
    with pytest.raises(QDQImportError) as err:
        read_qdq(model)
    assert message in str(err.value)


def test_requantization_and_integer_consumers_are_refused():
    qdq = _foreign_qdq()
    # the output DequantizeLinear reads another scale than its QuantizeLinear wrote
    for node in qdq.graph.node:
        if node.output[0] == "y":
            node.input[1] = "x_scale"
    with pytest.raises(QDQImportError, match="requantization"):
        read_qdq(qdq)
    qdq = _foreign_qdq()
    qdq.graph.node.append(helper.make_node("Identity", ["xq"], ["xq_copy"], name="peek"))
    qdq.graph.output.append(helper.make_tensor_value_info("xq_copy", TensorProto.UINT8, [2, 16]))
    with pytest.raises(QDQImportError, match="other than DequantizeLinear"):
        read_qdq(qdq)


def test_extract_params_matches_read_qdq_and_keeps_codes():
    params = {"wt": weight_params(W.T, QuantType.QInt4, axis=0, block_size=16)}
    quantized = _apply(matmul_model(), params)
    found = extract_params(quantized)
    codes = found["wt"].codes
    assert codes is not None and codes.dtype == ml_dtypes.int4 and codes.shape == (16, 64)
    # the codes InsertQDQ wrote (numpy reference), and what read_qdq finds
    expected = quantize(W.T, params["wt"])
    np.testing.assert_array_equal(codes.astype(np.int8), expected.astype(np.int8))
    read = read_qdq(quantized).params
    assert list(read) == list(found)
    np.testing.assert_array_equal(read["wt"].codes.astype(np.int8), codes.astype(np.int8))


@pytest.mark.real_model
@pytest.mark.slow
def test_onnxruntime_quantize_static_digits_imports_within_1e6(tmp_path):
    """onnxruntime's own quantizer is the foreign producer (used here only)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    model = shared_path("models", "digits_cnn.onnx")
    calib = np.load(shared_path("models", "digits_calib.npz"))["x"][:8]
    test_x = np.load(shared_path("models", "digits_test.npz"))["x"]

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter([{"image": calib[i : i + 1]} for i in range(len(calib))])

        def get_next(self):
            return next(self.it, None)

    ort_path = tmp_path / "ort_qdq.onnx"
    quantize_static(str(model), str(ort_path), Reader(), quant_format=QuantFormat.QDQ)
    ort_model = onnx.load(ort_path)
    import_recipe(ort_path, tmp_path / "rec")
    rebuilt = load_recipe(tmp_path / "rec", output=tmp_path / "rebuilt.onnx")
    (expected,) = run_ort(ort_model, {"image": test_x})
    (got,) = run_ort(rebuilt, {"image": test_x})
    assert float(np.max(np.abs(got - expected))) <= 1e-6
    # the import found every pair: the float model holds no quantization op
    float_model = onnx.load(tmp_path / "rec" / "float_model.onnx")
    assert not {"QuantizeLinear", "DequantizeLinear"} & {n.op_type for n in float_model.graph.node}
    counts = {}
    for n in ort_model.graph.node:
        counts[n.op_type] = counts.get(n.op_type, 0) + 1
    assert len(read_qdq(ort_model, float_model=False).params) == counts["DequantizeLinear"]
