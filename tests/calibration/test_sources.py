"""One calibration source: the API, the CLI and calibration read the same samples."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from conftest import make_model
from onnx import TensorProto, helper

from quark_onnx import Config, ModelQuantizer, get_default_config
from quark_onnx.calibration import readers
from quark_onnx.calibration.sources import CalibrationSource, calibration_source, open_reader
from quark_onnx.cli import calibration_reader
from quark_onnx.cli.settings import QuantizeSettings
from quark_onnx.config.options import ExtraOptions
from quark_onnx.errors import CalibrationError

F = TensorProto.FLOAT


def _two_inputs() -> onnx.ModelProto:
    return make_model(
        [helper.make_node("Add", ["a", "b"], ["y"])],
        [helper.make_tensor_value_info(n, F, ["N", 2]) for n in ("a", "b")],
        [helper.make_tensor_value_info("y", F, ["N", 2])],
    )


def _feeds(reader) -> list[dict[str, np.ndarray]]:
    return list(iter(reader.get_next, None))


def test_api_and_cli_read_a_multi_input_npz_alike(tmp_path):
    model = _two_inputs()
    onnx.save(model, tmp_path / "two.onnx")
    a = np.arange(8, dtype=np.float32).reshape(4, 2)
    b = -a
    np.savez(tmp_path / "calib.npz", b=b, a=a)  # archive order is not the input order
    api = calibration_source(None, tmp_path / "calib.npz", ExtraOptions(), model=model)
    cli = calibration_reader(
        QuantizeSettings(calib=str(tmp_path / "calib.npz")), tmp_path / "two.onnx", None
    )
    got_api, got_cli = _feeds(api), _feeds(cli)
    assert len(got_api) == len(got_cli) == 4
    for i, (x, y) in enumerate(zip(got_api, got_cli, strict=True)):
        assert sorted(x) == sorted(y) == ["a", "b"]
        np.testing.assert_array_equal(x["a"], a[i : i + 1])
        np.testing.assert_array_equal(x["b"], b[i : i + 1])
        for name in x:
            np.testing.assert_array_equal(x[name], y[name])
    np.savez(tmp_path / "partial.npz", a=a)
    with pytest.raises(CalibrationError, match=r"missing \['b'\]"):
        calibration_source(None, tmp_path / "partial.npz", ExtraOptions(), model=model)


def test_calibration_takes_the_source_as_it_is():
    model = _two_inputs()
    options = ExtraOptions(UseRandomData=True, RandomDataSamples=3)
    source = calibration_source(None, None, options, model=model, keep=2)
    assert isinstance(source, CalibrationSource)
    # calibration's reader_for neither wraps nor replaces it: the samples it reads are the kept ones
    assert readers.reader_for(model, source, options) is source
    read = _feeds(readers.reader_for(model, source, options))
    assert len(read) == 3 and len(source.kept) == 2
    for kept, seen in zip(source.kept, read, strict=False):
        for name in ("a", "b"):
            np.testing.assert_array_equal(kept[name], seen[name])
    # the same random data the CLI's comparison draws (same seed, first samples alike)
    again = _feeds(open_reader(None, model, options, random_samples=2))
    for name in ("a", "b"):
        np.testing.assert_array_equal(again[1][name], read[1][name])


def test_random_calibration_keeps_the_samples_it_calibrated_on(tmp_path):
    w = np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32)
    model = make_model(
        [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])],
        [helper.make_tensor_value_info("x", F, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", F, [1, 4, 8, 8])],
        {"w": w},
    )
    qc = get_default_config("XINT8")
    # without a held-out verdict the kept samples are the calibrated ones
    qc.extra_options.update(UseRandomData=True, RandomDataSamples=4, FidelityHoldout=0)
    quantizer = ModelQuantizer(Config(global_quant_config=qc))
    quantizer.keep_samples = 4
    quantizer.quantize_model(model, None)
    assert quantizer.report.calibration["samples"] == 4
    expected = _feeds(open_reader(None, model, quantizer.options))
    assert len(quantizer.kept_samples) == 4 and not quantizer.kept_held_out
    for kept, drawn in zip(quantizer.kept_samples, expected, strict=True):
        np.testing.assert_array_equal(kept["x"], drawn["x"])
    # with one, they are the verdict's: drawn anew with the next seed, none calibrated on
    qc.extra_options["FidelityHoldout"] = 4
    quantizer = ModelQuantizer(Config(global_quant_config=qc))
    quantizer.keep_samples = 4
    quantizer.quantize_model(model, None)
    assert quantizer.report.calibration["samples"] == 4 and quantizer.kept_held_out
    options = dataclasses.replace(
        quantizer.options, RandomDataSeed=quantizer.options.RandomDataSeed + 1
    )
    expected = _feeds(open_reader(None, model, options, random_samples=4))
    for kept, drawn in zip(quantizer.kept_samples, expected, strict=True):
        np.testing.assert_array_equal(kept["x"], drawn["x"])
