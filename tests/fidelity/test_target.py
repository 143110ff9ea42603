"""The FidelityTarget option: parsing, and the thresholds it sets."""

from __future__ import annotations

import pytest

from quark_onnx.config.options import resolve_extra_options
from quark_onnx.errors import ConfigError
from quark_onnx.fidelity.target import FidelityTarget, parse_target, with_target


def test_parse_and_thresholds():
    assert parse_target("") is None
    target = parse_target(" sqnr=20 , agreement=0.95")
    assert target == FidelityTarget(sqnr_db=20.0, agreement=0.95)
    assert parse_target("agreement=0.9").thresholds(10.0, 0.75) == (10.0, 0.9)
    options = with_target(resolve_extra_options({"FidelityTarget": "sqnr=20"}))
    assert (options.FidelityMinSQNR, options.FidelityMinAgreement) == (20.0, 0.75)
    plain = resolve_extra_options({})
    assert with_target(plain) is plain


@pytest.mark.parametrize(
    "text, words",
    [
        ("snr=20", "is not 'sqnr=DB'"),
        ("sqnr=high", "is not a number"),
        ("agreement=1.5", "outside [0, 1]"),
        ("sqnr=nan", "outside"),
        ("sqnr", "is not 'sqnr=DB'"),
    ],
)
def test_bad_targets_name_the_option_and_the_term(text, words):
    with pytest.raises(ConfigError, match="FidelityTarget") as err:
        resolve_extra_options({"FidelityTarget": text})
    assert words in str(err.value)


def test_mixed_precision_options_are_checked():
    with pytest.raises(ConfigError, match="MixedPrecisionBudget"):
        resolve_extra_options({"MixedPrecisionBudget": 1.5})
    with pytest.raises(ConfigError, match="MixedPrecisionTensors expects tensor names"):
        resolve_extra_options({"MixedPrecisionTensors": ["a", 3]})
