"""Sharded calibration: K parts of the data in K processes, observers merged, same result."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from conftest import make_model, run_ort, shared_path
from onnx import TensorProto, helper

from quark_onnx.calibration import ArrayDataReader, calibrate
from quark_onnx.calibration.shards import calibrate_sharded, split_shards
from quark_onnx.config.enums import CalibrationMethod, PowerOfTwoMethod
from quark_onnx.config.options import ExtraOptions
from quark_onnx.errors import CalibrationError, ConfigError
from quark_onnx.params.pof2 import minmse_position, nonoverflow_position

NAMES = ["x", "h", "r", "c", "W"]


def _model(batch="N") -> onnx.ModelProto:
    """x[N,4] -> MatMul W -> h -> Relu -> r; Concat(h, r) -> c (r and c derived, not read)."""
    w = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Concat", ["h", "r"], ["c"], axis=1),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4])
    c = helper.make_tensor_value_info("c", TensorProto.FLOAT, [batch, 6])
    return make_model(nodes, [x], [c], {"W": w})


def _data(n: int, seed: int = 3) -> np.ndarray:
    return (np.random.default_rng(seed).standard_t(3, (n, 4)) * 2).astype(np.float32)


def test_split_shards_is_contiguous_balanced_and_aligned():
    feeds = [{"i": np.array([i])} for i in range(10)]
    index = [[int(f["i"][0]) for f in part] for part in split_shards(feeds, 3)]
    assert index == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    # cut only at multiples of 4 feeds: 3 units (4, 4, 2 feeds) for 2 shards
    index = [[int(f["i"][0]) for f in part] for part in split_shards(feeds, 2, align=4)]
    assert index == [[0, 1, 2, 3, 4, 5, 6, 7], [8, 9]]
    # more shards than feeds: one feed each, no empty shard
    assert [len(p) for p in split_shards(feeds[:2], 4)] == [1, 1]
    with pytest.raises(ConfigError, match="positive"):
        split_shards(feeds, 0)


@pytest.mark.parametrize("method", [PowerOfTwoMethod.MinMSE, PowerOfTwoMethod.NonOverflow])
def test_shards_give_the_single_process_statistics(method):
    data = _data(29)
    one = calibrate(
        _model(1),
        NAMES,
        ArrayDataReader({"x": data}),
        method=method,
        options=ExtraOptions(),
        progress=False,
    )
    sharded = calibrate_sharded(
        _model(1),
        NAMES,
        ArrayDataReader({"x": data}),
        method=method,
        options=ExtraOptions(),
        shards=3,
    )
    assert sharded.num_samples == one.num_samples == 29
    assert sharded.model_hash == one.model_hash and sharded.method == one.method
    for name in NAMES:
        a, b = one.observer(name).to_dict(), sharded.observer(name).to_dict()
        squares_a, squares_b = a.pop("square_sums", None), b.pop("square_sums", None)
        assert a == b, name  # counts, offset sums, min, max, batches: exact integers / values
        if squares_a is not None:
            np.testing.assert_allclose(squares_b, squares_a, rtol=1e-12)
        assert sharded.position(name, method=method) == one.position(name, method=method)
    # oracle: the position over all 29 samples of onnxruntime's h (numpy positions)
    h = np.concatenate([run_ort(_model(1), {"x": data[i : i + 1]})[0][:, :3] for i in range(29)])
    if method is PowerOfTwoMethod.MinMSE:
        assert sharded.position("h", method=method) == minmse_position(h)
    else:
        expected = nonoverflow_position(float(h.min()), float(h.max()))
        assert sharded.position("h", method=method) == expected


def test_shards_on_a_dynamic_batch_axis_keep_the_runs_of_one_process():
    """Feeds of one sample are run 8 at a time; shards are cut at multiples of 8 feeds."""
    data = _data(21)
    feeds = [{"x": data[i : i + 1]} for i in range(21)]
    one = calibrate(_model(), NAMES, feeds, method=PowerOfTwoMethod.MinMSE, options=ExtraOptions())
    sharded = calibrate_sharded(
        _model(), NAMES, feeds, method=PowerOfTwoMethod.MinMSE, options=ExtraOptions(), shards=2
    )
    for name in NAMES:
        a, b = one.observer(name).to_dict(), sharded.observer(name).to_dict()
        # 21 feeds in runs of 8, 8, 5 (Concat c: the runs of h and of r; W: observed once)
        assert a["batches"] == b["batches"] == {"c": 6, "W": 1}.get(name, 3), name
        a.pop("square_sums"), b.pop("square_sums")
        assert a == b, name


def test_limit_nonfinite_and_errors_are_about_all_the_data(caplog):
    data = _data(12)
    data[1, 0] = np.nan
    with caplog.at_level(logging.WARNING, logger="quark_onnx"):
        result = calibrate_sharded(
            _model(1),
            ["x"],
            ArrayDataReader({"x": data}),
            method=PowerOfTwoMethod.NonOverflow,
            options=ExtraOptions(CalibDataSize=6),
            shards=2,
        )
    assert result.num_samples == 6
    assert result.absmax("x") == float(np.nanmax(np.abs(data[:6])))
    assert caplog.text.count("'x': 1 non-finite values") == 2  # input and tensor, once each
    # all-NaN in one shard only is fine; all-NaN everywhere is the collector's error
    nan = np.full((4, 4), np.nan, np.float32)
    half = calibrate_sharded(
        _model(1),
        ["x"],
        ArrayDataReader({"x": np.concatenate([nan[:2], data[:2]])}),
        method=PowerOfTwoMethod.NonOverflow,
        options=ExtraOptions(),
        shards=2,
    )
    assert half.absmax("x") == float(np.nanmax(np.abs(data[:2])))
    with pytest.raises(CalibrationError, match="no finite value"):
        calibrate_sharded(
            _model(1),
            ["x"],
            ArrayDataReader({"x": nan}),
            method=PowerOfTwoMethod.NonOverflow,
            options=ExtraOptions(),
            shards=2,
        )
    with pytest.raises(ConfigError, match="CalibMovingAverage"):
        calibrate_sharded(
            _model(1),
            ["x"],
            ArrayDataReader({"x": data}),
            method=CalibrationMethod.MinMax,
            options=ExtraOptions(CalibMovingAverage=True),
            shards=2,
        )
    with pytest.raises(CalibrationError, match="no samples"):
        calibrate_sharded(
            _model(1),
            ["x"],
            [],
            method=PowerOfTwoMethod.NonOverflow,
            options=ExtraOptions(),
            shards=2,
        )


@pytest.mark.real_model
@pytest.mark.slow
def test_squeezenet_sharded_calibration_writes_the_same_bytes(tmp_path):
    from quark_onnx import (
        Config,
        ImageFolderDataReader,
        ModelQuantizer,
        PreprocessSpec,
        get_default_config,
    )

    model = shared_path("models", "squeezenet1.1.onnx")
    images = shared_path("data", "imagenet", "calib")
    spec = PreprocessSpec.parse("resize=256,crop=224,mean=104;117;123,order=BGR")
    written, positions = {}, {}
    for shards in (1, 2, 4):
        qconfig = get_default_config("XINT8")
        quantizer = ModelQuantizer(Config(global_quant_config=qconfig), calibration_shards=shards)
        out = tmp_path / f"k{shards}.onnx"
        reader = ImageFolderDataReader(images, model, spec, limit=16)
        quantizer.quantize_model(model, out, reader)
        # 4 of the 16 images are held out for the verdict, the same ones for every shard count
        assert quantizer.report.calibration == {"samples": 12, "method": "MinMSE"}
        written[shards] = out.read_bytes()
        positions[shards] = quantizer.report.positions
    assert written[2] == written[1] and written[4] == written[1]
    assert positions[2] == positions[1] and positions[4] == positions[1]
    assert len(set(positions[1].values())) > 3  # real, varied positions, not a trivial model
