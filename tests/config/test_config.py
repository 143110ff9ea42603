"""The Quark-shaped configuration API, presets as data, option validation."""

from __future__ import annotations

import subprocess
import sys

import pytest

import quark_onnx
from quark_onnx import (
    CalibrationMethod,
    Config,
    ConfigError,
    PowerOfTwoMethod,
    QuantizationConfig,
    QuantType,
    get_default_config,
)
from quark_onnx.config.options import ExtraOptions, option_doc, option_names
from quark_onnx.config.presets import preset_names


def test_seed_example_runs_with_imports_changed():
    # ../shared/seeds/004: the XINT8 example, verbatim but for the imports.
    quant_config = get_default_config("XINT8")
    quant_config.activation_type = QuantType.QInt8
    quant_config.optimize_model = False
    quant_config.extra_options["UseRandomData"] = True
    quant_config.extra_options["ConvertBNToConv"] = True
    quant_config.extra_options["ConvertSigmoidToHardSigmoid"] = False
    quant_config.extra_options["ConvertClipToRelu"] = True
    quant_config.extra_options["SplitLargeKernelPool"] = False
    quant_config.extra_options["ReplaceClip6Relu"] = True
    quant_config.extra_options["ConvertReduceMeanToGlobalAvgPool"] = False
    quant_config.extra_options["RemoveQDQConvClip"] = False
    quant_config.extra_options["RemoveQDQConvPRelu"] = False
    quant_config.extra_options["RemoveQDQConvRelu"] = False
    quant_config.extra_options["RemoveQDQConvLeakyRelu"] = False
    quantization_config = Config(global_quant_config=quant_config)
    quantizer = quark_onnx.ModelQuantizer(quantization_config)
    text = f"The configuration of the quantization is {quantization_config}"
    assert "ConvertSigmoidToHardSigmoid: False" in text
    assert "calibrate_method=PowerOfTwoMethod.MinMSE" in text
    assert quantizer.options.ReplaceClip6Relu is True
    assert quantizer.options.ConvertReduceMeanToGlobalAvgPool is False


def test_print_shows_every_effective_setting():
    text = str(get_default_config("XINT8"))
    for name in option_names():  # defaults that the preset does not set are shown too
        assert f"{name}:" in text
    for field in ("activation_type", "weight_type", "per_channel", "enable_npu_cnn"):
        assert f"{field}=" in text


def test_onnxruntime_quant_type_members_are_accepted():
    ort_quant = pytest.importorskip("onnxruntime.quantization")
    qc = QuantizationConfig()
    qc.activation_type = ort_quant.QuantType.QUInt8
    qc.weight_type = ort_quant.QuantType.QInt8
    assert qc.activation_type is QuantType.QUInt8
    assert qc.weight_type is QuantType.QInt8
    qc.calibrate_method = ort_quant.CalibrationMethod.Percentile
    assert qc.calibrate_method is CalibrationMethod.Percentile


def test_enum_names_as_strings():
    qc = QuantizationConfig(calibrate_method="minmse", activation_type="quint8")
    assert qc.calibrate_method is PowerOfTwoMethod.MinMSE
    assert qc.activation_type is QuantType.QUInt8


def test_unknown_extra_option_names_closest():
    qc = get_default_config("XINT8")
    qc.extra_options["ConvertBnToConvs"] = True
    with pytest.raises(ConfigError, match="'ConvertBNToConv'"):
        quark_onnx.ModelQuantizer(Config(global_quant_config=qc))


def test_wrong_type_names_key_and_expected_type():
    qc = get_default_config("XINT8")
    qc.extra_options["ConvertBNToConv"] = "yes"
    with pytest.raises(ConfigError, match=r"'ConvertBNToConv' expects bool"):
        quark_onnx.ModelQuantizer(Config(global_quant_config=qc))
    qc.extra_options["ConvertBNToConv"] = True
    qc.extra_options["CalibDataSize"] = 1.5
    with pytest.raises(ConfigError, match=r"'CalibDataSize' expects int"):
        qc.validate()


def test_unknown_field_and_enum_value_name_the_closest():
    qc = QuantizationConfig()
    with pytest.raises(ConfigError, match="'activation_type'"):
        qc.activaton_type = QuantType.QInt8
    with pytest.raises(ConfigError, match="'QInt8'"):
        qc.weight_type = "QInt88"
    with pytest.raises(ConfigError, match="expects bool"):
        qc.per_channel = 1


def test_unsupported_quark_option_warns_not_silent(caplog):
    qc = get_default_config("XINT8")
    qc.extra_options["FuseLayerNorm"] = True
    with caplog.at_level("WARNING"):
        qc.validate()
    assert "FuseLayerNorm" in caplog.text


def test_npu_conflicts_are_errors():
    qc = get_default_config("XINT8")
    qc.per_channel = True
    with pytest.raises(ConfigError, match="per_channel"):
        qc.validate()
    qc.per_channel = False
    qc.calibrate_method = CalibrationMethod.MinMax
    with pytest.raises(ConfigError, match="power-of-two"):
        qc.validate()


def test_presets_are_files_and_fresh_copies():
    assert "XINT8" in preset_names()
    a = get_default_config("xint8")
    a.extra_options["ConvertBNToConv"] = False
    assert get_default_config("XINT8").extra_options["ConvertBNToConv"] is True
    with pytest.raises(ConfigError, match="'XINT8'"):
        get_default_config("XINT9")


def test_every_option_is_documented():
    for name in option_names():
        assert len(option_doc(name)) > 20, name
    assert ExtraOptions().ConvertBNToConv is True


def test_import_is_fast_and_torch_free():
    code = (
        "import sys, time; t = time.perf_counter(); import quark_onnx; "
        "d = time.perf_counter() - t; "
        "print(d, 'torch' in sys.modules, 'onnxruntime' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    seconds, torch_loaded, ort_loaded = out.stdout.split()
    assert torch_loaded == "False"
    assert ort_loaded == "False"  # heavy modules load on first use
    assert float(seconds) < 1.0
