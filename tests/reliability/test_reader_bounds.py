"""What the quantizer reads from a user's calibration reader: never more samples than
``CalibDataSize`` (the fidelity verdict's held-out ones included), and nothing at all when the
settings need no calibration data."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from fuzz_models import IMAGE, conv_chain
from onnx import TensorProto
from onnx import helper as h

from quark_onnx import Config, ModelQuantizer, get_default_config
from quark_onnx.config.presets import preset_names


class EndlessReader:
    """A reader of unknown length that counts the samples it hands out."""

    def __init__(self, batch: int = 1) -> None:
        self.rng = np.random.default_rng(0)
        self.batch = batch
        self.rows = 0

    def get_next(self) -> dict[str, np.ndarray]:
        self.rows += self.batch
        return {"x": self.rng.standard_normal([self.batch, *IMAGE[1:]]).astype(np.float32)}


class UntouchableReader:
    def get_next(self) -> dict[str, np.ndarray]:
        raise AssertionError("get_next must not be called")


def _quantize(preset: str, reader, model: onnx.ModelProto, **extra) -> ModelQuantizer:
    qc = get_default_config(preset)
    qc.optimize_model = False
    qc.extra_options.update(extra)
    quantizer = ModelQuantizer(Config(global_quant_config=qc))
    quantizer.quantize_model(model, None, reader)
    return quantizer


@pytest.mark.parametrize("preset", ["XINT8", "A8W8"])
def test_calib_data_size_bounds_every_sample_read_the_verdicts_included(preset):
    reader = EndlessReader()
    quantizer = _quantize(preset, reader, conv_chain(), CalibDataSize=5)
    assert reader.rows == 5  # not the 16 held-out samples of FidelityHoldout on top
    report = quantizer.report
    # the verdict holds out a quarter of what may be read, calibration the rest
    assert report.fidelity["held_out"] is True
    assert report.fidelity["samples"] == 1
    assert report.calibration["samples"] == 4


def _dynamic_batch_chain() -> onnx.ModelProto:
    model = conv_chain()
    for value in (*model.graph.input, *model.graph.output):
        value.type.tensor_type.shape.dim[0].dim_param = "N"
    return model


def test_a_batched_feed_is_cut_at_the_cap():
    reader = EndlessReader(batch=4)
    quantizer = _quantize("A8W8", reader, _dynamic_batch_chain(), CalibDataSize=5)
    assert reader.rows == 8  # two feeds asked for; the second one is cut to the 5th sample
    assert quantizer.report.calibration["samples"] == 5
    # two feeds are too few to hold one out: the verdict says it is measured on fitted samples
    assert quantizer.report.fidelity["held_out"] is False


def test_without_a_cap_the_verdict_holds_out_its_samples():
    """The must-not-fire case: no CalibDataSize, FidelityHoldout=16 is taken from a reader."""
    batch = {"x": np.random.default_rng(1).standard_normal([40, *IMAGE[1:]]).astype(np.float32)}
    quantizer = _quantize("A8W8", batch, conv_chain())
    assert quantizer.report.fidelity["samples"] == 10  # a quarter of 40
    assert quantizer.report.calibration["samples"] == 30


NO_DATA_PRESETS = [
    name for name in preset_names() if not get_default_config(name).needs_calibration_data()
]


def _matmul_model() -> onnx.ModelProto:
    weight = np.random.default_rng(2).standard_normal((64, 32)).astype(np.float32)
    graph = h.make_graph(
        [h.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "mm",
        [h.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32])],
        [onnx.numpy_helper.from_array(weight, "w")],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def test_the_no_data_presets_are_the_expected_ones():
    assert set(NO_DATA_PRESETS) == {"UINT4_WEIGHT_ONLY_G32", "INT8_DYNAMIC", "BF16", "FP16"}


@pytest.mark.parametrize("preset", NO_DATA_PRESETS)
def test_a_preset_that_needs_no_data_never_touches_the_reader(preset, caplog):
    with caplog.at_level(logging.INFO, logger="quark_onnx.pipeline.quantizer"):
        quantizer = _quantize(preset, UntouchableReader(), _matmul_model())
    assert quantizer.report.calibration == {"samples": 0, "method": None}
    assert any("not read" in r.getMessage() for r in caplog.records)
