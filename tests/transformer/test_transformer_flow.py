"""The parts around quantization on a transformer: the XINT8 architecture warning, the report
summary for float-scale presets, multi-input npz calibration, compare with infinite noise."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest
from conftest import make_model
from encoder_fixtures import SMALL, build_encoder, encoder_inputs
from onnx import TensorProto, helper

from quark_onnx import ArrayDataReader, Config, ModelQuantizer, get_default_config
from quark_onnx.errors import CalibrationError, ConfigError
from quark_onnx.fidelity.compare import ErrorAccumulator


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("encoder")
    model = build_encoder(SMALL, seed=11)
    calib = encoder_inputs(8, 1, SMALL)
    npz = folder / "calib.npz"
    np.savez(npz, **calib)
    return model, calib, npz


def quantizer(preset: str) -> ModelQuantizer:
    return ModelQuantizer(Config(global_quant_config=get_default_config(preset)))


def test_xint8_on_a_conv_free_model_warns_before_work(encoder, caplog):
    model, calib, _ = encoder
    q = quantizer("XINT8")
    with pytest.raises(ConfigError, match="no Conv node.*A16W8"):
        q.quantize_model(model, None, ArrayDataReader(calib), require_ready=True)
    assert "prepare" not in q.report.timings  # refused before any work
    with caplog.at_level(logging.WARNING, logger="quark_onnx.pipeline.quantizer"):
        q.quantize_model(model, None, ArrayDataReader(calib))
    assert any("no Conv node" in r.getMessage() for r in caplog.records)


def test_xint8_on_a_cnn_does_not_warn(caplog):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 6, 6])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 6, 6])
    w = np.random.default_rng(0).standard_normal((2, 2, 3, 3)).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="c1", pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["c", "w"], ["y"], name="c2", pads=[1, 1, 1, 1]),
    ]
    model = make_model(nodes, [x], [y], {"w": w})
    feeds = {"x": np.random.default_rng(1).standard_normal((1, 2, 6, 6)).astype(np.float32)}
    with caplog.at_level(logging.WARNING, logger="quark_onnx.pipeline.quantizer"):
        quantizer("XINT8").quantize_model(model, None, ArrayDataReader(feeds), require_ready=True)
    assert not any("no Conv node" in r.getMessage() for r in caplog.records)


def test_float_scale_summary_has_no_xint8_findings(encoder):
    model, calib, _ = encoder
    q = quantizer("A8W8")
    q.quantize_model(model, None, ArrayDataReader(calib))
    assert q.report.check["findings"]  # the check ran (power-of-two rules fail, as expected)
    text = q.report.summary()
    assert "non_pof2_scale" not in text and "Vitis AI ready" not in text
    assert "not applicable to float-scale settings" in text
    assert "mask-like tensors kept float: " in text


def test_npu_summary_lists_the_findings(encoder):
    model, calib, _ = encoder
    q = quantizer("XINT8")
    q.quantize_model(model, None, ArrayDataReader(calib))
    assert "Vitis AI ready: False" in q.report.summary()
    assert q.report.check["findings"][0]["rule"] in q.report.summary()


def test_calibration_data_path_takes_a_multi_input_npz(encoder, tmp_path):
    model, calib, npz = encoder
    from_path = quantizer("A8W8").quantize_model(model, None, calibration_data_path=npz)
    from_reader = quantizer("A8W8").quantize_model(model, None, ArrayDataReader(calib))
    assert from_path.SerializeToString() == from_reader.SerializeToString()
    partial = tmp_path / "partial.npz"
    np.savez(partial, input_ids=calib["input_ids"])
    with pytest.raises(CalibrationError, match=r"missing \['attention_mask'\]"):
        quantizer("A8W8").quantize_model(model, None, calibration_data_path=partial)


@pytest.mark.parametrize(
    "f, q, expected",
    [
        ([1.0, 2.0], [np.inf, 2.0], -math.inf),  # infinite noise
        ([np.finfo(np.float32).min, 0.0], [-np.inf, 0.0], -math.inf),  # inf - inf: nan noise
        ([1.0, 2.0], [1.0, 2.0], math.inf),
        ([3.0, 4.0], [3.0, 4.0 + 1e-3], 10 * math.log10(25 / 1e-6)),
    ],
)
def test_sqnr_of_infinite_noise_is_minus_infinity_not_a_crash(f, q, expected):
    acc = ErrorAccumulator()
    acc.update(np.array(f, np.float32), np.array(q, np.float32), top1=False)
    sqnr = acc.result("t", "t").sqnr_db
    if math.isinf(expected):
        assert sqnr == expected
    else:
        assert sqnr == pytest.approx(expected, rel=1e-3)
