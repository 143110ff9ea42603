"""Strategies, data types and granularity as config settings: valid presets, refused combinations,
and the seed's three example specs written with this project's API."""

from __future__ import annotations

import pytest

from quark_onnx import (
    CalibrationMethod,
    Config,
    ConfigError,
    ModelQuantizer,
    QuantizationConfig,
    QuantType,
    get_default_config,
)
from quark_onnx.config.presets import preset_descriptions, preset_names
from quark_onnx.config.quantization import QuantStrategy, quant_strategy

NEW_PRESETS = {
    "A8W8": QuantStrategy.STATIC,
    "A16W8": QuantStrategy.STATIC,
    "U8S8": QuantStrategy.STATIC,
    "BF16": QuantStrategy.STATIC,
    "FP16": QuantStrategy.STATIC,
    "FP8_E4M3": QuantStrategy.STATIC,
    "UINT4_WEIGHT_ONLY_G32": QuantStrategy.WEIGHT_ONLY,
    "INT8_DYNAMIC": QuantStrategy.DYNAMIC,
    "XINT8": QuantStrategy.STATIC,
}


# --- the seed's example specs (../shared/seeds/002), written with this project's API ------------


def seed_weight_only_uint4_g32() -> QuantizationConfig:
    """uint4, per group of 32, asymmetric, weight-only."""
    return QuantizationConfig(
        weight_type=QuantType.QUInt4,
        per_channel=True,
        extra_options={"WeightsOnly": True, "WeightBlockSize": 32, "WeightSymmetric": False},
    )


def seed_dynamic_int8() -> QuantizationConfig:
    """int8, per tensor, symmetric, dynamic (weights and activation inputs)."""
    return QuantizationConfig(
        activation_type=QuantType.QInt8,
        weight_type=QuantType.QInt8,
        use_dynamic_quant=True,
        extra_options={"ActivationSymmetric": True, "WeightSymmetric": True},
    )


def seed_static_fp8() -> QuantizationConfig:
    """float8 e4m3, per tensor, static (MinMax observer)."""
    return QuantizationConfig(
        calibrate_method=CalibrationMethod.MinMax,
        activation_type=QuantType.QFLOAT8E4M3FN,
        weight_type=QuantType.QFLOAT8E4M3FN,
    )


SEED_SPECS = {
    "weight_only_uint4_g32": (seed_weight_only_uint4_g32, QuantStrategy.WEIGHT_ONLY),
    "dynamic_int8": (seed_dynamic_int8, QuantStrategy.DYNAMIC),
    "static_fp8": (seed_static_fp8, QuantStrategy.STATIC),
}


@pytest.mark.parametrize("name", sorted(SEED_SPECS))
def test_seed_specs_validate_and_select_their_strategy(name):
    make, strategy = SEED_SPECS[name]
    qc = make()
    options = qc.validate()
    assert quant_strategy(qc, options) is strategy
    ModelQuantizer(Config(global_quant_config=qc))  # accepted by the entry point too


def test_every_preset_is_a_documented_file():
    assert set(NEW_PRESETS) <= set(preset_names())
    for name, text in preset_descriptions().items():
        assert len(text) > 30, name


@pytest.mark.parametrize("name", sorted(NEW_PRESETS))
def test_presets_validate_and_select_their_strategy(name):
    qc = get_default_config(name)
    assert quant_strategy(qc, qc.validate()) is NEW_PRESETS[name]


def test_preset_types_and_granularity():
    a16 = get_default_config("A16W8")
    assert (a16.activation_type, a16.weight_type) == (QuantType.QInt16, QuantType.QInt8)
    u8s8 = get_default_config("U8S8")
    assert u8s8.activation_type is QuantType.QUInt8
    assert u8s8.extra_options["ActivationSymmetric"] is False
    g32 = get_default_config("UINT4_WEIGHT_ONLY_G32")
    assert g32.per_channel and g32.resolved_options().WeightBlockSize == 32
    assert g32.weight_type is QuantType.QUInt4 and not g32.resolved_options().WeightSymmetric
    assert get_default_config("BF16").activation_type is QuantType.QBFloat16
    assert get_default_config("FP16").weight_type is QuantType.QFloat16
    assert get_default_config("FP8_E4M3").activation_type is QuantType.QFLOAT8E4M3FN
    assert get_default_config("INT8_DYNAMIC").use_dynamic_quant


def _config(settings: dict, extra: dict) -> QuantizationConfig:
    qc = QuantizationConfig()
    for key, value in settings.items():
        setattr(qc, key, value)
    qc.extra_options.update(extra)
    return qc


REFUSED = [
    # (settings, extra options, the setting named, the fix named)
    (
        {"calibrate_method": "MinMSE", "enable_npu_cnn": True, "activation_type": "QInt4"},
        {},
        "activation_type=QuantType.QInt4",
        "set activation_type to QuantType.QInt8",
    ),
    (
        {"calibrate_method": "NonOverflow", "weight_type": "QFLOAT8E4M3FN"},
        {},
        "weight_type=QuantType.QFLOAT8E4M3FN",
        "float calibrate_method",
    ),
    ({"per_channel": False}, {"WeightBlockSize": 32}, "WeightBlockSize=32", "per_channel=True"),
    ({"per_channel": True}, {"WeightBlockSize": -1}, "WeightBlockSize=-1", ">= 1"),
    (
        {"use_dynamic_quant": True, "activation_type": "QFLOAT8E4M3FN"},
        {},
        "use_dynamic_quant=True with activation_type",
        "use_dynamic_quant=False",
    ),
    (
        {"use_dynamic_quant": True, "activation_type": "QInt8"},
        {"ActivationSymmetric": False},
        "ActivationSymmetric=False",
        "activation_type=QuantType.QUInt8",
    ),
    ({"use_dynamic_quant": True}, {"WeightsOnly": True}, "WeightsOnly", "choose one"),
    (
        {"calibrate_method": "MinMSE", "enable_npu_cnn": True},
        {"WeightsOnly": True},
        "WeightsOnly=True conflicts with enable_npu_cnn",
        "remove WeightsOnly",
    ),
    (
        {"calibrate_method": "MinMSE", "enable_npu_cnn": True, "use_dynamic_quant": True},
        {},
        "use_dynamic_quant=True conflicts with enable_npu_cnn",
        "set use_dynamic_quant=False",
    ),
    (
        {"weight_type": "QBFloat16", "per_channel": True},
        {},
        "weight_type=QuantType.QBFloat16",
        "set per_channel=False",
    ),
    (
        {"activation_type": "QFLOAT8E4M3FN"},
        {"ActivationSymmetric": False},
        "QFLOAT8E4M3FN has no zero point",
        "ActivationSymmetric=True",
    ),
    (
        {"include_bias_correction": True},
        {},
        "include_bias_correction=True",
        "include_bias_correction=False",
    ),
    (
        {"calibrate_method": "NonOverflow", "per_channel": True},
        {},
        "per_channel=True conflicts with calibrate_method",
        "per_channel=False",
    ),
]


@pytest.mark.parametrize(("settings", "extra", "setting", "fix"), REFUSED)
def test_invalid_combinations_name_the_setting_and_the_fix(settings, extra, setting, fix):
    qc = _config(settings, extra)
    with pytest.raises(ConfigError) as info:
        ModelQuantizer(Config(global_quant_config=qc))
    message = str(info.value)
    assert setting in message and fix in message, message


@pytest.mark.parametrize(
    ("settings", "extra"),
    [
        ({"activation_type": "QInt4", "weight_type": "QInt4"}, {}),  # int4 static without NPU
        ({"activation_type": "QUInt16", "weight_type": "QUInt8"}, {"ActivationSymmetric": False}),
        ({"use_dynamic_quant": True, "activation_type": "QUInt8"}, {"ActivationSymmetric": False}),
        ({"weight_type": "QInt4", "per_channel": True}, {"WeightsOnly": True}),
        ({"activation_type": "QBFloat16", "weight_type": "QInt8", "per_channel": True}, {}),
    ],
)
def test_valid_combinations_are_accepted(settings, extra):
    _config(settings, extra).validate()
