"""Every QuantizationConfig field is honoured, or named in a warning when set to a non-default."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from conftest import make_model, run_ort
from onnx import TensorProto, helper

from quark_onnx import ArrayDataReader, Config, ModelQuantizer, get_default_config
from quark_onnx.calibration import collector
from quark_onnx.errors import ConfigError

UNSUPPORTED = {
    "input_nodes": ["conv1"],
    "output_nodes": ["y"],
    "reduce_range": True,
    "enable_npu_transformer": True,
}


def two_convs() -> onnx.ModelProto:
    """Conv-Relu-Conv with 16x16x3x3 weights (9 KiB each: above the external-data threshold)."""
    rng = np.random.default_rng(5)
    return make_model(
        [
            helper.make_node("Conv", ["x", "w1"], ["c1"], "conv1", pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["c1"], ["r1"], "relu1"),
            helper.make_node("Conv", ["r1", "w2"], ["y"], "conv2", pads=[1, 1, 1, 1]),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 8, 8])],
        {
            "w1": (rng.standard_normal((16, 16, 3, 3)) * 0.1).astype(np.float32),
            "w2": (rng.standard_normal((16, 16, 3, 3)) * 0.1).astype(np.float32),
        },
    )


def quantize(tmp_path, name: str, **fields):
    path = tmp_path / "float.onnx"
    if not path.exists():
        onnx.save(two_convs(), path)
    qc = get_default_config("XINT8")
    for key, value in fields.items():
        setattr(qc, key, value)
    x = np.random.default_rng(1).standard_normal((4, 16, 8, 8)).astype(np.float32)
    quantizer = ModelQuantizer(Config(global_quant_config=qc))
    out = tmp_path / f"{name}.onnx"
    quantizer.quantize_model(str(path), str(out), ArrayDataReader({"x": x}))
    return quantizer, out


def test_use_external_data_format_reaches_save(tmp_path):
    _, inline = quantize(tmp_path, "inline")
    _, split = quantize(tmp_path, "split", use_external_data_format=True)
    assert not (tmp_path / "inline.onnx.data").exists()
    assert (tmp_path / "split.onnx.data").is_file()
    header = onnx.load(split, load_external_data=False)
    external = [t.name for t in header.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    assert len(external) >= 2  # both weights' codes
    # the same model either way: equal outputs, bit for bit
    feed = {"x": np.random.default_rng(2).standard_normal((1, 16, 8, 8)).astype(np.float32)}
    a = run_ort(onnx.load(inline), feed)[0]
    b = run_ort(onnx.load(split), feed)[0]
    np.testing.assert_array_equal(a, b)


def test_execution_providers_reach_the_calibration_session(tmp_path, monkeypatch):
    seen = []
    original = collector.Collector.run

    def spy(self, *args, **kwargs):
        seen.append(list(self.providers))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(collector.Collector, "run", spy)
    quantize(tmp_path, "default")
    wanted = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    quantize(tmp_path, "cuda", execution_providers=wanted)
    assert seen == [["CPUExecutionProvider"], wanted]


@pytest.mark.parametrize("enabled", [True, False])
def test_print_summary_logs_the_report_summary(tmp_path, caplog, enabled):
    with caplog.at_level(logging.INFO, logger="quark_onnx.pipeline.quantizer"):
        quantizer, _ = quantize(tmp_path, "q", print_summary=enabled)
    summary = quantizer.report.summary()
    logged = [r.getMessage() for r in caplog.records if r.name == "quark_onnx.pipeline.quantizer"]
    assert any(summary in m for m in logged) is enabled


def test_defaults_warn_about_nothing(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        quantizer, _ = quantize(tmp_path, "q")
    assert quantizer.report.notes == []
    assert not [r for r in caplog.records if "not supported" in r.getMessage()]


@pytest.mark.parametrize(("field", "value"), sorted(UNSUPPORTED.items()))
def test_unsupported_field_is_named_in_a_warning_and_changes_nothing(
    tmp_path, caplog, field, value
):
    _, reference = quantize(tmp_path, "reference")
    with caplog.at_level(logging.WARNING, logger="quark_onnx.pipeline.quantizer"):
        quantizer, out = quantize(tmp_path, field, **{field: value})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    named = [w for w in warnings if f"{field}=" in w and "not supported" in w]
    assert len(named) == 1, warnings
    assert [n for n in quantizer.report.notes if n.startswith(f"{field}=")] != []
    assert out.read_bytes() == reference.read_bytes()


def test_an_unknown_execution_provider_is_a_named_config_error():
    qconfig = get_default_config("XINT8")
    with pytest.raises(ConfigError) as caught:
        qconfig.execution_providers = ["CUDAExecutionProvidr", "CPUExecutionProvider"]
    message = str(caught.value)
    assert "'CUDAExecutionProvidr'" in message and "did you mean 'CUDAExecutionProvider'" in message
    assert "CPUExecutionProvider" in message.split("known:")[1]  # the known ones are listed
    assert qconfig.execution_providers == ["CPUExecutionProvider"]  # unchanged


def test_an_unknown_provider_added_in_place_is_refused_by_the_quantizer():
    qconfig = get_default_config("XINT8")
    qconfig.execution_providers.append(7)
    with pytest.raises(ConfigError, match="list of strings, got 7"):
        ModelQuantizer(Config(global_quant_config=qconfig))
    qconfig.execution_providers[-1] = "NoSuchExecutionProvider"
    with pytest.raises(ConfigError, match="'NoSuchExecutionProvider' is not an onnxruntime"):
        ModelQuantizer(Config(global_quant_config=qconfig))


def test_a_known_provider_this_install_lacks_is_accepted():
    """The must-not-fire case: every name onnxruntime knows passes, available or not."""
    import onnxruntime as ort

    qconfig = get_default_config("XINT8")
    qconfig.execution_providers = list(ort.get_all_providers())
    ModelQuantizer(Config(global_quant_config=qconfig))
