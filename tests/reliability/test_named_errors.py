"""Inputs that used to fail deep inside (a pass, numpy, onnx_ir) with an error naming nothing are
refused before any work by a QuarkOnnxError naming the tensor, input, file or argument."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from fuzz_models import conv_chain, quantizer
from onnx import TensorProto
from onnx import helper as h

from quark_onnx import Config, ModelQuantizer, get_default_config
from quark_onnx.calibration import CalibrationResult
from quark_onnx.calibration.readers import NpzDataReader
from quark_onnx.errors import (
    CalibrationError,
    ConfigError,
    ModelLoadError,
    QuantizationError,
)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _with_weight_value(value: float) -> onnx.ModelProto:
    model = conv_chain()
    w = model.graph.initializer[0]
    array = onnx.numpy_helper.to_array(w).copy()
    array.flat[3] = value
    w.CopyFrom(onnx.numpy_helper.from_array(array, w.name))
    return model


@pytest.mark.parametrize("value, counts", [(np.nan, "1 NaN and 0"), (np.inf, "0 NaN and 1")])
def test_non_finite_weight_is_named_before_the_passes(value, counts):
    model = _with_weight_value(value)
    name = model.graph.initializer[0].name
    with pytest.raises(QuantizationError, match=f"initializer '{name}' holds {counts}.*index 3"):
        quantizer().quantize_model(model, None)


def test_non_finite_calibration_sample_is_named_before_the_passes():
    x = np.random.default_rng(0).normal(size=(4, 3, 8, 8)).astype(np.float32)
    x[0, 0, 0, 1] = np.nan
    q = quantizer(UseRandomData=False)
    with pytest.raises(CalibrationError, match=r"calibration input 'x', sample \d+: 1 NaN"):
        q.quantize_model(conv_chain(), None, {"x": x})


def test_an_infinite_mask_constant_outside_a_weight_is_accepted():
    """Must not fire: -inf in a constant that is not a weight (an attention mask) is legal."""
    model = conv_chain()
    mask = onnx.numpy_helper.from_array(np.full([1], -np.inf, np.float32), "mask")
    model.graph.initializer.append(mask)
    out = model.graph.output[0].name
    model.graph.node.append(h.make_node("Max", [out, "mask"], ["masked"], name="mask_max"))
    model.graph.output[0].name = "masked"
    quantizer().quantize_model(model, None)


def test_sparse_initializer_is_named(tmp_path):
    model = conv_chain()
    w = model.graph.initializer[0]
    array = onnx.numpy_helper.to_array(w)
    idx = np.flatnonzero(array)
    values = onnx.numpy_helper.from_array(array.flat[idx].astype(np.float32), w.name)
    indices = onnx.numpy_helper.from_array(idx.astype(np.int64), "i")
    del model.graph.initializer[0]
    model.graph.sparse_initializer.append(h.make_sparse_tensor(values, indices, array.shape))
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    before = sha(path)
    with pytest.raises(ModelLoadError, match=f"sparse initializer '{w.name}'"):
        quantizer().quantize_model(path, tmp_path / "q.onnx")
    assert sha(path) == before and sorted(tmp_path.iterdir()) == [path]


def test_string_initializer_is_named():
    model = conv_chain()
    model.graph.initializer.append(h.make_tensor("labels", TensorProto.STRING, [1], [b"cat"]))
    model.graph.node.append(h.make_node("Identity", ["labels"], ["names"], name="names"))
    model.graph.output.append(h.make_tensor_value_info("names", TensorProto.STRING, [1]))
    with pytest.raises(QuantizationError, match="initializer 'labels' holds strings"):
        quantizer().quantize_model(model, None)


def _matmul(x_shape: list[int], w_shape: list[int], y_shape: list[int]) -> onnx.ModelProto:
    w = onnx.numpy_helper.from_array(np.zeros(w_shape, np.float32), "W")
    graph = h.make_graph(
        [h.make_node("MatMul", ["x", "W"], ["y"], name="mm")],
        "g",
        [h.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)],
        [w],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize("preset", ["XINT8", "A8W8", "UINT4_WEIGHT_ONLY_G32"])
def test_zero_dimensions_are_named(preset):
    config = get_default_config(preset)
    config.extra_options["UseRandomData"] = True
    q = ModelQuantizer(Config(global_quant_config=config))
    with pytest.raises(QuantizationError, match=r"weight 'W' has shape \[4, 0\]"):
        q.quantize_model(_matmul([1, 4], [4, 0], [1, 0]), None)
    with pytest.raises(QuantizationError, match=r"graph input 'x' has shape \[0, 4\]"):
        q.quantize_model(_matmul([0, 4], [4, 4], [0, 4]), None)


def test_nan_ranges_in_a_saved_calibration_are_named(tmp_path):
    model = conv_chain()
    saved = tmp_path / "c.json"
    quantizer().quantize_model(model, None, save_calibration=saved)
    doc = json.loads(saved.read_text())
    first = next(iter(doc["tensors"]))
    doc["tensors"][first]["min"] = float("nan")
    saved.write_text(json.dumps(doc))
    with pytest.raises(CalibrationError, match=f"{saved}: holds NaN"):
        CalibrationResult.load(saved, model)


def test_negative_npy_dimension_is_named(tmp_path):
    path = tmp_path / "x.npy"
    np.save(path, np.zeros((2, 3), np.float32))
    data = path.read_bytes().replace(b"(2, 3)", b"(-2, 3)", 1)
    path.write_bytes(data)
    with pytest.raises(CalibrationError, match="negative dimension"):
        list(iter(NpzDataReader(path, input_name="x").get_next, None))


@pytest.mark.parametrize("shards", ["2", 2.0, True, 0])
def test_calibration_shards_of_the_wrong_type_is_a_config_error(shards):
    with pytest.raises(ConfigError, match=f"calibration_shards={shards!r}"):
        ModelQuantizer(
            Config(global_quant_config=get_default_config("XINT8")), calibration_shards=shards
        )
