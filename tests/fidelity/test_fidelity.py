"""Fidelity: per-output SQNR / cosine / top-1 agreement, the pass-cost warning, and the guard."""

from __future__ import annotations

import logging
import math

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import make_model, run_ort
from onnx import TensorProto as T
from onnx import helper as h

from quark_onnx import ArrayDataReader, Config, ModelQuantizer, get_default_config
from quark_onnx.errors import FidelityError
from quark_onnx.fidelity.verdict import compare_runs
from quark_onnx.passes import ReplaceClip6Relu
from quark_onnx.pipeline.prepare import PASS_MIN_SQNR_DB, run_passes

RNG = np.random.default_rng(0)


def test_compare_runs_matches_numpy():
    f = RNG.normal(size=(2, 4, 10)).astype(np.float32)  # two runs of [4, 10] score vectors
    noise = RNG.normal(scale=0.3, size=f.shape).astype(np.float32)
    q = f + noise
    box = RNG.normal(size=(2, 1, 5, 6)).astype(np.float32)
    before = [{"scores": f[i], "boxes": box[i]} for i in range(2)]
    after = [{"scores": q[i], "boxes": box[i] * 1.5} for i in range(2)]
    got = {o.name: o for o in compare_runs(before, after, min_sqnr_db=10, min_agreement=0.75)}

    f64, q64 = f.astype(np.float64), q.astype(np.float64)
    sqnr = 10 * math.log10(np.sum(f64**2) / np.sum((f64 - q64) ** 2))
    assert got["scores"].sqnr_db == pytest.approx(sqnr, rel=1e-9)
    cosine = np.sum(f64 * q64) / math.sqrt(np.sum(f64**2) * np.sum(q64**2))
    assert got["scores"].cosine == pytest.approx(cosine, rel=1e-9)
    agree = np.mean(f.reshape(8, 10).argmax(1) == q.reshape(8, 10).argmax(1))
    assert got["scores"].top1_agreement == pytest.approx(agree)
    assert got["scores"].rows == 8
    # boxes * 1.5: noise = 0.5 f, SQNR = 10 log10(4) = 6.02 dB < 10: not faithful; no top-1
    assert got["boxes"].sqnr_db == pytest.approx(10 * math.log10(4), rel=1e-6)
    assert got["boxes"].top1_agreement is None
    assert not got["boxes"].faithful
    assert got["scores"].faithful == (agree >= 0.75)  # a score vector is judged by its decision


def test_score_vector_with_low_sqnr_but_the_same_decisions_is_faithful():
    f = np.array([[5.0, 1.0, 0.0], [0.0, 4.0, 1.0]], dtype=np.float32)
    q = f * 2.0  # SQNR 0 dB, same argmax everywhere
    (out,) = compare_runs([{"p": f}], [{"p": q}])
    assert out.sqnr_db == pytest.approx(0.0, abs=1e-9) and out.top1_agreement == 1.0
    assert out.faithful


def test_agreement_below_threshold_is_unfaithful_even_with_high_sqnr():
    f = np.tile(np.array([[1.0, 1.001]], dtype=np.float32), (4, 1))
    q = np.tile(np.array([[1.001, 1.0]], dtype=np.float32), (4, 1))  # every row flips
    (out,) = compare_runs([{"p": f}], [{"p": q}])
    assert out.sqnr_db > 50 and out.top1_agreement == 0.0 and not out.faithful


# --- pass cost ------------------------------------------------------------------------------


def _layer_clip6() -> onnx.ModelProto:
    """``y = Clip(x @ I, 0, 6)`` (the identity MatMul makes the Clip a layer's activation)."""
    return make_model(
        [h.make_node("MatMul", ["x", "eye"], ["l"]), h.make_node("Clip", ["l", "lo", "hi"], ["y"])],
        [h.make_tensor_value_info("x", T.FLOAT, [1, 16])],
        [h.make_tensor_value_info("y", T.FLOAT, [1, 16])],
        {
            "eye": np.eye(16, dtype=np.float32),
            "lo": np.array(0.0, dtype=np.float32),
            "hi": np.array(6.0, dtype=np.float32),
        },
    )


def test_costly_pass_is_a_warning_naming_the_option(caplog):
    feeds = [{"x": np.linspace(-5, 60, 16, dtype=np.float32).reshape(1, 16)}]
    model = ir.serde.deserialize_model(_layer_clip6())
    with caplog.at_level(logging.WARNING):
        report = run_passes(model, [ReplaceClip6Relu()], sample_feeds=feeds)
    record = report.record("ReplaceClip6Relu")
    x = feeds[0]["x"].astype(np.float64)
    old, new = np.clip(x, 0, 6), np.maximum(x, 0)
    expected = 10 * math.log10(np.sum(old**2) / np.sum((new - old) ** 2))
    assert record.fidelity[0]["sqnr_db"] == pytest.approx(expected, rel=1e-6)
    assert expected < PASS_MIN_SQNR_DB
    assert record.warning and "ReplaceClip6Relu=False" in record.warning and "'y'" in record.warning
    assert "ReplaceClip6Relu=False" in caplog.text


def test_capped_relu_is_measured_at_its_saturation():
    """With ``saturation``, the Relu that keeps the cap runs as Clip(0, saturation(6))."""
    feeds = [{"x": np.linspace(-5, 60, 16, dtype=np.float32).reshape(1, 16)}]
    model = ir.serde.deserialize_model(_layer_clip6())
    report = run_passes(
        model, [ReplaceClip6Relu()], sample_feeds=feeds, saturation=lambda cap: 7.9375
    )
    record = report.record("ReplaceClip6Relu")
    x = feeds[0]["x"].astype(np.float64)
    old, new = np.clip(x, 0, 6), np.clip(x, 0, 7.9375)
    assert record.max_abs_diff["y"] == pytest.approx(np.max(np.abs(new - old)))
    expected = 10 * math.log10(np.sum(old**2) / np.sum((new - old) ** 2))
    assert record.fidelity[0]["sqnr_db"] == pytest.approx(expected, rel=1e-6)
    # the model itself keeps the Relu (the saturation is only how it is measured)
    assert [n.op_type for n in model.graph] == ["MatMul", "Relu"]


def test_cheap_pass_is_silent():
    feeds = [{"x": np.linspace(-5, 5.5, 16, dtype=np.float32).reshape(1, 16)}]  # never above 6
    model = ir.serde.deserialize_model(_layer_clip6())
    record = run_passes(model, [ReplaceClip6Relu()], sample_feeds=feeds).record("ReplaceClip6Relu")
    assert record.modified and record.warning is None
    assert record.fidelity[0]["sqnr_db"] == "inf"


# --- the guard after quantization ---------------------------------------------------------------


def _two_channel_model(big: float, small: float) -> onnx.ModelProto:
    """x -> Conv(2 channels: weights ``big`` and ``small``) -> Clip(0, 6) -> Conv 1x1 -> y.

    The second conv reads channel 0 with 0.01 / big and channel 1 with 1 / small, so y ~ x
    whatever the weights. With big = 1000 and small = 0.01 the two channels of the ReLU6 output
    are 600 apart and one power-of-two int8 scale rounds channel 1, which carries the output, to
    zero; with big = small = 1 they share one range. (Through a Relu the preset's cross-layer
    equalization would undo the spread; ReLU6 is not positively homogeneous.)"""
    w1 = np.array([big, small], dtype=np.float32).reshape(2, 1, 1, 1)
    w2 = np.array([0.01 / big, 1.0 / small], dtype=np.float32).reshape(1, 2, 1, 1)
    nodes = [
        h.make_node("Conv", ["x", "w1"], ["c1"], kernel_shape=[1, 1]),
        h.make_node("Clip", ["c1", "lo", "hi"], ["r1"]),
        h.make_node("Conv", ["r1", "w2"], ["y"], kernel_shape=[1, 1]),
    ]
    return make_model(
        nodes,
        [h.make_tensor_value_info("x", T.FLOAT, [1, 1, 8, 8])],
        [h.make_tensor_value_info("y", T.FLOAT, [1, 1, 8, 8])],
        {"w1": w1, "w2": w2, "lo": np.float32(0.0), "hi": np.float32(6.0)},
    )


BAD = {"big": 1000.0, "small": 0.01}
GOOD = {"big": 1.0, "small": 1.0}


def _calibration(n: int = 64) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [{"x": rng.uniform(0, 1, size=(1, 1, 8, 8)).astype(np.float32)} for _ in range(n)]


def _xint8(**extra) -> ModelQuantizer:
    config = get_default_config("XINT8")
    config.extra_options.update(extra)
    return ModelQuantizer(Config(global_quant_config=config))


def test_guard_is_silent_on_a_faithful_model(tmp_path, caplog):
    model = _two_channel_model(**GOOD)
    quantizer = _xint8()
    with caplog.at_level(logging.WARNING):
        quantizer.quantize_model(model, tmp_path / "q.onnx", ArrayDataReader(_calibration()))
    fid = quantizer.report.fidelity
    assert fid["faithful"] is True and fid["samples"] == 16
    assert "does not follow the float model" not in caplog.text
    assert "faithful to the float model: yes" in quantizer.report.summary()


def test_guard_warns_names_output_and_layer_and_measures_against_float(tmp_path, caplog):
    model = _two_channel_model(**BAD)
    out = tmp_path / "q.onnx"
    quantizer = _xint8()
    with caplog.at_level(logging.WARNING):
        quantizer.quantize_model(model, out, ArrayDataReader(_calibration()))
    fid = quantizer.report.fidelity
    assert fid["faithful"] is False and out.exists()  # written, but not called faithful
    assert "does not follow the float model" in caplog.text and "output 'y'" in caplog.text
    # int8 activations: the advice
    assert "16-bit activations for the whole model (preset A16W8)" in caplog.text
    assert fid["worst_layers"] and fid["worst_layers"][0]["op_type"] in ("Conv", "Relu")
    # the verdict's SQNR is the float model's against the written model's, on the 16 held-out
    # samples (every second one of the first 32: calibration never read them)
    assert fid["held_out"] is True and fid["samples"] == 16
    samples = _calibration()[1:32:2]
    f = np.concatenate([run_ort(model, s)[0] for s in samples]).astype(np.float64)
    q = np.concatenate([run_ort(onnx.load(out), s)[0] for s in samples]).astype(np.float64)
    sqnr = 10 * math.log10(np.sum(f**2) / np.sum((f - q) ** 2))
    assert fid["outputs"][0]["sqnr_db"] == pytest.approx(sqnr, abs=1e-6)
    assert sqnr < 10
    assert "faithful to the float model: NO" in quantizer.report.summary()


def test_no_16_bit_advice_when_the_activations_are_16_bit(tmp_path, caplog):
    config = get_default_config("A16W8")
    config.extra_options["FidelityMinSQNR"] = 200.0  # unreachable: the guard fires
    quantizer = ModelQuantizer(Config(global_quant_config=config))
    with caplog.at_level(logging.WARNING):
        quantizer.quantize_model(
            _two_channel_model(**GOOD), tmp_path / "q.onnx", ArrayDataReader(_calibration())
        )
    assert "does not follow the float model" in caplog.text
    assert "A16W8" not in caplog.text


def test_require_fidelity_raises_and_writes_nothing(tmp_path):
    out = tmp_path / "q.onnx"
    with pytest.raises(FidelityError, match="output 'y'.*no model was written"):
        _xint8(RequireFidelity=True).quantize_model(
            _two_channel_model(**BAD), out, ArrayDataReader(_calibration())
        )
    assert not out.exists()


def test_guard_off(tmp_path):
    quantizer = _xint8(FidelityCheck=False)
    quantizer.quantize_model(
        _two_channel_model(**BAD), tmp_path / "q.onnx", ArrayDataReader(_calibration())
    )
    assert quantizer.report.fidelity == {}


def test_hardware_simulation_is_reported_never_warned_or_undone():
    """LeakyRelu alpha 0.001 is 0/256 on the NPU: the simulation changes the output completely,
    which is the hardware's doing, not an approximation the user can turn off."""
    from quark_onnx.passes import ConvertLeakyReluToDPUVersion

    model = make_model(
        [h.make_node("LeakyRelu", ["x"], ["y"], alpha=0.001)],
        [h.make_tensor_value_info("x", T.FLOAT, [1, 8])],
        [h.make_tensor_value_info("y", T.FLOAT, [1, 8])],
    )
    ir_model = ir.serde.deserialize_model(model)
    feeds = [{"x": -np.arange(1, 9, dtype=np.float32).reshape(1, 8)}]
    report = run_passes(
        ir_model, [ConvertLeakyReluToDPUVersion()], sample_feeds=feeds, revert_costly=True
    )
    record = report.record("ConvertLeakyReluToDPUVersion")
    assert record.modified and record.fidelity and not record.fidelity[0]["faithful"]
    assert record.warning is None and not record.reverted
    # the model keeps the NPU's arithmetic: alpha 0.001 -> round(0.256) / 256 = 0
    (y,) = run_ort(ir.serde.serialize_model(ir_model), feeds[0])
    np.testing.assert_array_equal(y, np.zeros_like(feeds[0]["x"]))


def test_costly_optional_pass_is_undone_with_revert_costly():
    feeds = [{"x": np.linspace(-5, 60, 16, dtype=np.float32).reshape(1, 16)}]
    model = ir.serde.deserialize_model(_layer_clip6())
    report = run_passes(model, [ReplaceClip6Relu()], sample_feeds=feeds, revert_costly=True)
    record = report.record("ReplaceClip6Relu")
    assert record.reverted and "undone" in record.warning
    assert [n.op_type for n in model.graph] == ["MatMul", "Clip"]
    np.testing.assert_array_equal(
        run_ort(ir.serde.serialize_model(model), feeds[0])[0], np.clip(feeds[0]["x"], 0, 6)
    )
