"""Embedding tables per row and INT8_DYNAMIC in integer ops, against numpy and float oracles."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest
from conftest import make_model, run_ort
from encoder_fixtures import SMALL, build_encoder, embedding_cosines, encoder_inputs
from onnx import TensorProto, helper, numpy_helper

from quark_onnx import ArrayDataReader, Config, ModelQuantizer, get_default_config
from quark_onnx.config.enums import QuantType
from quark_onnx.params import qparams


def gather_model(table: np.ndarray) -> onnx.ModelProto:
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["rows"], name="gather"),
        helper.make_node("MatMul", ["rows", "w"], ["y"], name="proj"),
    ]
    w = np.eye(table.shape[1], dtype=np.float32)
    return make_model(
        nodes,
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n", 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 5, table.shape[1]])],
        {"table": table, "w": w},
    )


def test_gathered_rows_equal_the_per_row_numpy_reference():
    rng = np.random.default_rng(0)
    table = (rng.standard_normal((300, 16)) * rng.uniform(0.01, 2.0, (300, 1))).astype(np.float32)
    model = gather_model(table)
    ids = rng.integers(0, 300, (6, 5)).astype(np.int64)
    qc = get_default_config("INT8_DYNAMIC")  # no calibration data needed
    quantizer = ModelQuantizer(Config(global_quant_config=qc))
    quantized = quantizer.quantize_model(model)
    params = quantizer.params["table"]
    assert params.axis == 0 and params.scale.shape == (300,)  # one scale per row
    ops = collections.Counter(n.op_type for n in quantized.graph.node)
    assert ops["Gather"] == 2 and "DequantizeLinear" not in ops  # codes and scales gathered
    inits = {i.name: numpy_helper.to_array(i) for i in quantized.graph.initializer}
    assert "table" not in inits and inits["table_quantized"].dtype == np.int8
    # the rows the graph computes are exactly the per-row fake-quantized table's rows
    reference = qparams.fake_quant(table, qparams.weight_params(table, QuantType.QInt8, axis=0))
    quantized.graph.output.append(helper.make_tensor_value_info("rows", TensorProto.FLOAT, None))
    _, rows = run_ort(quantized, {"ids": ids})
    np.testing.assert_array_equal(rows, reference[ids])


def test_float8_tables_keep_the_dequantize_linear_form():
    rng = np.random.default_rng(1)
    table = rng.standard_normal((64, 8)).astype(np.float32)
    model = gather_model(table)
    ids = rng.integers(0, 64, (4, 5)).astype(np.int64)
    reader = ArrayDataReader({"ids": ids})
    quantized = ModelQuantizer(
        Config(global_quant_config=get_default_config("FP8_E4M3"))
    ).quantize_model(model, None, reader)
    dq = [n for n in quantized.graph.node if n.op_type == "DequantizeLinear"]
    assert any(n.input[0] == "table_quantized" for n in dq)


def test_four_bit_weight_types_leave_tables_float():
    table = np.ones((40, 32), np.float32)
    quantized = ModelQuantizer(
        Config(global_quant_config=get_default_config("UINT4_WEIGHT_ONLY_G32"))
    ).quantize_model(gather_model(table))
    assert "table" in {i.name for i in quantized.graph.initializer}


@pytest.fixture(scope="module")
def dynamic_encoder():
    model = build_encoder(SMALL, seed=5)
    quantizer = ModelQuantizer(Config(global_quant_config=get_default_config("INT8_DYNAMIC")))
    return model, quantizer.quantize_model(model), quantizer


def test_int8_dynamic_runs_the_projections_as_matmul_integer(dynamic_encoder):
    _, quantized, quantizer = dynamic_encoder
    ops = collections.Counter(n.op_type for n in quantized.graph.node)
    assert ops["MatMulInteger"] == 6 * SMALL.layers
    # only the attention MatMuls (two computed operands) stay float, without Q/DQ around them
    assert ops["MatMul"] == 2 * SMALL.layers
    assert ops["DynamicQuantizeLinear"] == 4 * SMALL.layers  # x feeds q, k and v: one for three
    assert "QuantizeLinear" not in ops
    inits = {i.name: numpy_helper.to_array(i) for i in quantized.graph.initializer}
    for node in quantized.graph.node:
        if node.op_type == "MatMulInteger":
            assert inits[node.input[1]].dtype == np.int8
            assert not np.any(inits[node.input[3]])  # symmetric: zero points 0
    weight = quantizer.params["encoder/layer.0/attention/query.weight"]
    assert weight.axis == 1 and weight.scale.shape == (SMALL.hidden,)  # per output column


def test_int8_dynamic_matches_float_on_held_out_sentences(dynamic_encoder):
    model, quantized, _ = dynamic_encoder
    c = embedding_cosines(model, quantized, encoder_inputs(24, 2, SMALL))
    assert c.mean() >= 0.975 and c.min() >= 0.9


@pytest.mark.parametrize("trans_b", [0, 1])
def test_int8_dynamic_gemm_runs_as_matmul_integer(trans_b):
    """Gemm(x, W, C) with a constant W: MatMulInteger + scale + C, against numpy on the
    dequantized operands (integer sums are exact; the bound is float32 rounding of the sums)."""
    rng = np.random.default_rng(trans_b)
    k, n = 48, 24
    w = rng.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32)
    c = rng.standard_normal(n).astype(np.float32)
    nodes = [helper.make_node("Gemm", ["x", "w", "c"], ["y"], name="gemm", transB=trans_b)]
    model = make_model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])],
        {"w": w, "c": c},
    )
    quantizer = ModelQuantizer(Config(global_quant_config=get_default_config("INT8_DYNAMIC")))
    quantized = quantizer.quantize_model(model)
    ops = [node.op_type for node in quantized.graph.node]
    assert "MatMulInteger" in ops and "Gemm" not in ops
    x = rng.standard_normal((5, k)).astype(np.float32)
    (got,) = run_ort(quantized, {"x": x})
    xq = qparams.fake_quant(x, qparams.dynamic_params(x, QuantType.QUInt8, symmetric=False))
    wq = qparams.fake_quant(w, quantizer.params["w"])
    b = wq.T if trans_b else wq
    expected = xq.astype(np.float64) @ b.astype(np.float64) + c
    bound = (k + 3) * 2.0**-23 * (np.abs(xq) @ np.abs(b) + np.abs(c))
    assert np.all(np.abs(got - expected) <= bound)


def test_int8_dynamic_recipe_round_trips_byte_identically(dynamic_encoder, tmp_path):
    """The integer form and the gathered rows read back as QDQ (importer) and rebuild to the
    same bytes."""
    from quark_onnx import load_recipe, save_recipe

    model, quantized, _ = dynamic_encoder
    save_recipe(tmp_path / "rec", quantized, "INT8_DYNAMIC", model)
    rebuilt = load_recipe(tmp_path / "rec", model)
    assert rebuilt.SerializeToString() == quantized.SerializeToString()


@pytest.mark.parametrize("preset", ["A8W8", "BF16"])
def test_static_recipe_with_gathered_tables_round_trips(preset, tmp_path):
    from quark_onnx import load_recipe, save_recipe

    model = build_encoder(SMALL, seed=6)
    reader = ArrayDataReader(encoder_inputs(8, 1, SMALL), batch_size=4)
    quantized = ModelQuantizer(
        Config(global_quant_config=get_default_config(preset))
    ).quantize_model(model, None, reader)
    assert any(n.op_type == "Gather" and "_quantized" in n.input[0] for n in quantized.graph.node)
    save_recipe(tmp_path / "rec", quantized, preset, model)
    rebuilt = load_recipe(tmp_path / "rec", model)
    assert rebuilt.SerializeToString() == quantized.SerializeToString()
