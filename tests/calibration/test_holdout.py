"""The held-out split of the calibration data: the verdict's samples are never read by
calibration, the accuracy stages or any choice (CalibrationSource.hold_out, the quantizer)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import conv_relu_conv_model

from quark_onnx import Config, ModelQuantizer, get_default_config
from quark_onnx.calibration import sources
from quark_onnx.calibration.readers import ArrayDataReader
from quark_onnx.calibration.sources import CalibrationSource


class _Unsized:
    """A reader without a length (a generator-backed user reader)."""

    def __init__(self, n: int) -> None:
        self.feeds = [{"x": np.full((1, 2), i, np.float32)} for i in range(n)]

    def get_next(self):
        return self.feeds.pop(0) if self.feeds else None


def _tags(feeds) -> list[int]:
    return [int(f["x"].flat[0]) for f in feeds]


def _drain(source: CalibrationSource) -> list[int]:
    tags = []
    while (feed := source.get_next()) is not None:
        tags.append(int(feed["x"].flat[0]))
    return tags


@pytest.mark.parametrize(
    ("total", "count", "held"),
    [
        (100, 16, list(range(1, 32, 2))),  # every second one of the first 32
        (40, 16, list(range(1, 20, 2))),  # a quarter of a source of known length: 10
        (3, 16, []),  # too few to hold any out
    ],
)
def test_hold_out_takes_every_second_sample_and_calibration_never_reads_them(total, count, held):
    source = CalibrationSource(ArrayDataReader({"x": np.arange(total, dtype=np.float32)[:, None]}))
    got = _tags(source.hold_out(count))
    assert got == held
    rest = _drain(source)
    assert sorted(rest + got) == list(range(total)) and not set(rest) & set(got)
    assert rest == sorted(rest)  # calibration keeps its order


def test_hold_out_of_a_reader_without_length_caps_at_a_quarter_of_what_it_has():
    source = CalibrationSource(_Unsized(12))
    assert _tags(source.hold_out(16)) == [1, 3, 5]
    assert _drain(source) == [0, 2, 4, 6, 7, 8, 9, 10, 11]


def test_the_verdict_samples_are_never_calibrated_on(monkeypatch):
    """A quantization that records every sample calibration and the accuracy stages read: none
    of the verdict's samples is among them, and the report says how many judged it."""
    read: list[int] = []
    original = sources.CalibrationSource.get_next

    def recording(self):
        feed = original(self)
        if feed is not None:
            read.append(int(feed["x"][0, 0, 0, 0]))
        return feed

    monkeypatch.setattr(sources.CalibrationSource, "get_next", recording)
    data = np.random.default_rng(0).normal(size=(48, 3, 8, 8)).astype(np.float32)
    data[:, 0, 0, 0] = np.arange(48)  # each sample's tag
    held_tags = set(range(1, 24, 2))  # FidelityHoldout 16, capped at 48 // 4 = 12
    config = get_default_config("XINT8")
    config.extra_options["FidelityRepair"] = False
    quantizer = ModelQuantizer(Config(global_quant_config=config))
    quantizer.quantize_model(conv_relu_conv_model(), None, ArrayDataReader({"x": data}))
    fid = quantizer.report.fidelity
    assert fid["held_out"] is True and fid["samples"] == 12
    assert "selection" not in fid  # nothing chose on the first calibration samples
    assert read and not set(read) & held_tags
    assert set(read) == set(range(48)) - held_tags


def test_without_a_holdout_the_verdict_says_it_is_on_calibration_samples(caplog):
    data = np.random.default_rng(1).normal(size=(24, 3, 8, 8)).astype(np.float32)
    config = get_default_config("XINT8")
    config.extra_options.update(FidelityRepair=False, FidelityHoldout=0)
    quantizer = ModelQuantizer(Config(global_quant_config=config))
    quantizer.quantize_model(conv_relu_conv_model(), None, ArrayDataReader({"x": data}))
    assert quantizer.report.fidelity["held_out"] is False
    assert "calibration sample(s)" in quantizer.report.summary()


def test_random_data_loses_no_calibration_sample_to_the_verdict():
    """Random data is drawn anew for the verdict (the next seed): calibration reads all of
    RandomDataSamples, and the verdict's feeds are none of them."""
    config = get_default_config("XINT8")
    config.extra_options.update(UseRandomData=True, RandomDataSamples=12, FidelityRepair=False)
    quantizer = ModelQuantizer(Config(global_quant_config=config))
    quantizer.quantize_model(conv_relu_conv_model(), None)
    report = quantizer.report
    assert report.calibration["samples"] == 12
    # as many as calibration reads at most
    assert report.fidelity["held_out"] is True and report.fidelity["samples"] == 12
