"""calibrate(): onnxruntime session, streaming, validation, derived tensors, results on disk."""

from __future__ import annotations

import io
import json
import logging
import threading

import numpy as np
import onnx
import pytest
from conftest import make_model, run_ort, shared_path
from onnx import TensorProto, helper

from quark_onnx.calibration import (
    ArrayDataReader,
    CalibrationResult,
    NpzDataReader,
    RandomDataReader,
    calibrate,
    model_hash,
    reader_for,
)
from quark_onnx.config.enums import CalibrationMethod, PowerOfTwoMethod, QuantType
from quark_onnx.config.options import ExtraOptions
from quark_onnx.errors import CalibrationError
from quark_onnx.params.pof2 import minmse_position, nonoverflow_position
from quark_onnx.runtime.progress import Progress

OPTS = ExtraOptions()


def _model(batch="N") -> onnx.ModelProto:
    """x[N,4] -> MatMul W -> h -> Relu -> r; Concat(h, r) -> c; Reshape(c) -> y."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 3)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("Concat", ["h", "r"], ["c"], axis=1),
        helper.make_node("Flatten", ["c"], ["y"], axis=1),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 6])
    return make_model(nodes, [x], [y], {"W": w})


def _feeds(n=37, seed=1):
    rng = np.random.default_rng(seed)
    return (rng.standard_t(3, (n, 4)) * 2).astype(np.float32)


NAMES = ["x", "h", "r", "c", "y", "W"]


def _reference(model, data):
    h, r, c, y = [], [], [], []
    m2 = onnx.ModelProto()
    m2.CopyFrom(model)
    for name in ("h", "r", "c"):
        m2.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
    outs = run_ort(m2, {"x": data})
    y, h, r, c = outs
    w = onnx.numpy_helper.to_array(model.graph.initializer[0])
    return {"x": data, "h": h, "r": r, "c": c, "y": y, "W": w}


@pytest.mark.parametrize("batch_size", [1, 5, 37])
@pytest.mark.parametrize(
    "method", [PowerOfTwoMethod.NonOverflow, PowerOfTwoMethod.MinMSE, CalibrationMethod.MinMax]
)
def test_results_equal_numpy_over_all_data(batch_size, method):
    model = _model()
    data = _feeds()
    ref = _reference(model, data)
    result = calibrate(
        model,
        NAMES,
        ArrayDataReader({"x": data}, batch_size=batch_size),
        method=method,
        options=OPTS,
        progress=False,
    )
    assert result.num_samples == 37
    assert result.names() == NAMES
    for name, values in ref.items():
        assert result.absmax(name) == float(np.abs(values).max()), name
        assert result.position(name, method=PowerOfTwoMethod.NonOverflow) == nonoverflow_position(
            float(values.min()), float(values.max())
        )
        lo, hi = result.range(
            name, method=CalibrationMethod.MinMax, options=ExtraOptions(ActivationSymmetric=False)
        )
        assert (lo, hi) == (float(values.min()), float(values.max()))
        if method is PowerOfTwoMethod.MinMSE:
            for q in (QuantType.QInt8, QuantType.QUInt8):
                assert result.position(name, method=method, qtype=q) == minmse_position(values, q)
    if method is not PowerOfTwoMethod.MinMSE:
        with pytest.raises(CalibrationError, match="needs a histogram"):
            result.position("h", method=PowerOfTwoMethod.MinMSE)


def test_feeds_are_batched_on_a_dynamic_batch_axis():
    model = _model()
    runs = []
    from quark_onnx.calibration.collector import Collector

    c = Collector(model, ["h", "r"], method=PowerOfTwoMethod.MinMSE, options=OPTS, max_batch=8)
    assert c.combine and c.sources == ["h"]  # r derives from h
    original = c._run

    def spy(feed, first):
        runs.append(feed["x"].shape[0])
        return original(feed, first)

    c._run = spy
    c.run(ArrayDataReader({"x": _feeds(20)}, batch_size=3), progress=False)
    assert runs == [6, 6, 8]  # whole feeds of 3 rows, at most 8 rows per run
    # a fixed batch axis: one feed per run, nothing concatenated
    fixed = Collector(_model(batch=1), ["h"], method=PowerOfTwoMethod.MinMSE, options=OPTS)
    assert not fixed.combine


def test_calib_data_size_limits_samples():
    data = _feeds(37)
    result = calibrate(
        _model(),
        ["x"],
        ArrayDataReader({"x": data}, batch_size=5),
        method=PowerOfTwoMethod.NonOverflow,
        options=ExtraOptions(CalibDataSize=12),
        progress=False,
    )
    assert result.num_samples == 12
    assert result.absmax("x") == float(np.abs(data[:12]).max())


def test_moving_average_per_feed():
    data = _feeds(9)
    result = calibrate(
        _model(),
        ["x", "h"],
        ArrayDataReader({"x": data}, batch_size=3),
        method=CalibrationMethod.MinMax,
        options=ExtraOptions(CalibMovingAverage=True, CalibMovingAverageConstant=0.25),
        progress=False,
    )
    ema = None
    for i in range(0, 9, 3):
        b = data[i : i + 3]
        cur = np.array([b.min(), b.max()], np.float64)
        ema = cur if ema is None else ema + 0.25 * (cur - ema)
    opts = ExtraOptions(
        CalibMovingAverage=True, CalibMovingAverageConstant=0.25, ActivationSymmetric=False
    )
    np.testing.assert_allclose(
        result.range("x", method=CalibrationMethod.MinMax, options=opts), ema
    )
    with pytest.raises(CalibrationError, match="constant"):
        result.range(
            "x",
            method=CalibrationMethod.MinMax,
            options=ExtraOptions(CalibMovingAverage=True, CalibMovingAverageConstant=0.5),
        )


def test_percentile_and_entropy_ranges_symmetric():
    result = calibrate(
        _model(),
        ["h"],
        ArrayDataReader({"x": _feeds(200)}),
        method=CalibrationMethod.Percentile,
        options=OPTS,
        progress=False,
    )
    lo, hi = result.range("h", method=CalibrationMethod.Percentile, options=OPTS)
    assert lo == -hi and 0 < hi <= result.absmax("h")
    lo, hi = result.range("h", method=CalibrationMethod.Entropy, options=OPTS)
    assert lo == -hi and 0 < hi <= result.absmax("h")
    lo, hi = result.range("h", method=CalibrationMethod.MSE, options=OPTS)
    assert lo == -hi and 0 < hi <= result.absmax("h")


# --- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("feed", "match"),
    [
        ({"X": np.zeros((1, 4), np.float32)}, r"'X' is not an input.*did you mean 'x'"),
        ({"x": np.zeros((1, 4), np.float64)}, r"'x' has dtype float64, expected float32"),
        ({"x": np.zeros((1, 5), np.float32)}, r"'x'.*dimension 1 must be 4"),
        ({"x": np.zeros((4,), np.float32)}, r"'x'.*expected rank 2"),
        ({}, r"input 'x' is missing"),
    ],
)
def test_bad_feeds_are_rejected_with_name_and_index(feed, match):
    good = {"x": np.zeros((1, 4), np.float32)}
    with pytest.raises(CalibrationError, match=match) as info:
        calibrate(
            _model(),
            ["h"],
            ArrayDataReader([good, good, feed]),
            method=PowerOfTwoMethod.NonOverflow,
            options=OPTS,
            progress=False,
        )
    assert "feed #2" in str(info.value)


def test_no_samples_and_no_reader():
    with pytest.raises(CalibrationError, match="no samples"):
        calibrate(
            _model(),
            ["h"],
            ArrayDataReader([]),
            method=PowerOfTwoMethod.NonOverflow,
            options=OPTS,
            progress=False,
        )
    with pytest.raises(CalibrationError, match="UseRandomData"):
        reader_for(_model(), None, OPTS)


def test_unknown_and_non_float_tensor_names():
    with pytest.raises(CalibrationError, match=r"'hh'.*did you mean 'h'"):
        calibrate(
            _model(), ["hh"], [], method=PowerOfTwoMethod.NonOverflow, options=OPTS, progress=False
        )


def test_nonfinite_values_warn_and_are_ignored(caplog):
    data = _feeds(10)
    data[3, 1] = np.nan
    data[5, 0] = np.inf
    with caplog.at_level(logging.WARNING, logger="quark_onnx"):
        result = calibrate(
            _model(),
            ["x", "h"],
            ArrayDataReader({"x": data}),
            method=PowerOfTwoMethod.MinMSE,
            options=OPTS,
            progress=False,
        )
    finite = data[np.isfinite(data)]
    assert result.absmax("x") == float(np.abs(finite).max())
    assert result.observer("x").nonfinite == 2
    text = caplog.text
    assert "'x': 2 non-finite values" in text and "'h':" in text and "ignored" in text
    # a tensor with no finite value at all is an error, not a silent scale
    with pytest.raises(CalibrationError, match="no finite value"):
        calibrate(
            _model(),
            ["x"],
            ArrayDataReader({"x": np.full((2, 4), np.nan, np.float32)}),
            method=PowerOfTwoMethod.NonOverflow,
            options=OPTS,
            progress=False,
        )


# --- random data ---------------------------------------------------------------------------------


def test_random_reader_is_reproducible_and_shaped():
    model = _model()
    a = RandomDataReader(model, num_samples=3, seed=7, shapes={"x": [2, 4]}, ranges={"x": [-1, 1]})
    b = RandomDataReader(model, num_samples=3, seed=7, shapes={"x": [2, 4]}, ranges={"x": [-1, 1]})
    fa = [a.get_next() for _ in range(4)]
    fb = [b.get_next() for _ in range(4)]
    assert fa[3] is None and fb[3] is None
    for x, y in zip(fa[:3], fb[:3], strict=True):
        np.testing.assert_array_equal(x["x"], y["x"])
        assert x["x"].shape == (2, 4) and x["x"].dtype == np.float32
        assert x["x"].min() >= -1 and x["x"].max() < 1
    default = RandomDataReader(model, num_samples=1).get_next()
    assert default["x"].shape == (1, 4)  # dynamic batch defaults to 1
    with pytest.raises(CalibrationError, match="does not match"):
        RandomDataReader(model, shapes={"x": [2, 5]})
    opts = ExtraOptions(UseRandomData=True, RandomDataSamples=5, RandomDataSeed=3)
    result = calibrate(
        model, ["h"], None, method=PowerOfTwoMethod.MinMSE, options=opts, progress=False
    )
    assert result.num_samples == 5


def test_npz_reader_binds_to_model_input(tmp_path):
    data = _feeds(11)
    path = tmp_path / "calib.npz"
    np.savez(path, images=data, labels=np.arange(11))
    with pytest.raises(CalibrationError, match="say which one"):
        NpzDataReader(path)
    reader = reader_for(_model(), NpzDataReader(path, key="images", batch_size=4), OPTS)
    feeds = []
    while (f := reader.get_next()) is not None:
        feeds.append(f["x"])
    np.testing.assert_array_equal(np.concatenate(feeds), data)
    reader.rewind()
    assert reader.get_next()["x"].shape == (4, 4)


# --- results on disk ------------------------------------------------------------------------------


def test_save_load_roundtrip_and_refuse_other_model(tmp_path):
    model = _model()
    result = calibrate(
        model,
        NAMES,
        ArrayDataReader({"x": _feeds()}),
        method=PowerOfTwoMethod.MinMSE,
        options=OPTS,
        progress=False,
    )
    path = tmp_path / "calib.json"
    result.save(path)
    loaded = CalibrationResult.load(path, model)
    assert loaded.model_hash == model_hash(model) == result.model_hash
    for name in NAMES:
        for m in PowerOfTwoMethod:
            assert loaded.position(name, method=m) == result.position(name, method=m)
        assert loaded.range(name, method=CalibrationMethod.Percentile, options=OPTS) == (
            result.range(name, method=CalibrationMethod.Percentile, options=OPTS)
        )
        curve, loaded_curve = result.error_function(name), loaded.error_function(name)
        assert [loaded_curve(p) for p in range(-2, 12)] == [curve(p) for p in range(-2, 12)]
    other = _model()
    other.graph.initializer[0].raw_data = np.ones((4, 3), np.float32).tobytes()
    with pytest.raises(CalibrationError, match="another model"):
        CalibrationResult.load(path, other)
    # renaming a node or editing a doc string does not change the identity
    same = _model()
    same.graph.node[0].name = "renamed"
    same.doc_string = "edited"
    assert model_hash(same) == model_hash(model)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(CalibrationError, match="not a quark_onnx calibration result"):
        CalibrationResult.load(bad, model)
    old = json.loads(path.read_text()) | {"format": "quark_onnx.calibration/1"}
    bad.write_text(json.dumps(old))
    with pytest.raises(CalibrationError, match="older format.*calibrate again"):
        CalibrationResult.load(bad, model)


# --- progress -------------------------------------------------------------------------------------


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_modes(caplog):
    seen = []
    tty = _Tty()
    with Progress(10, desc="calibrating", stream=tty, callback=lambda *a: seen.append(a)) as p:
        p.update(4)
        p.update(6)
    assert "calibrating: " in tty.getvalue() and "/10 samples" in tty.getvalue()
    assert tty.getvalue().endswith("\n")
    assert [s[0] for s in seen] == [4, 10] and seen[-1][1] == 10
    pipe = io.StringIO()
    with (
        caplog.at_level(logging.INFO, logger="quark_onnx.runtime.progress"),
        Progress(3, stream=pipe) as p,
    ):
        p.update(3)
    assert pipe.getvalue() == ""  # no terminal: log lines instead
    assert "3/3 samples" in caplog.text
    quiet = _Tty()
    with Progress(3, stream=quiet, enabled=False) as p:
        p.update(3)
    assert quiet.getvalue() == ""


def test_progress_callback_from_calibrate():
    seen = []
    calibrate(
        _model(),
        ["h"],
        ArrayDataReader({"x": _feeds(10)}, batch_size=4),
        method=PowerOfTwoMethod.NonOverflow,
        options=OPTS,
        progress=lambda done, total, rate: seen.append(done),
    )
    assert seen[-1] == 10


@pytest.mark.real_model
def test_digits_cnn_minmse_matches_numpy(shared):
    model = onnx.load(shared_path("models", "digits_cnn.onnx"))
    data = np.load(shared_path("models", "digits_calib.npz"))["x"][:40]
    names = ["image"] + [o for n in model.graph.node for o in n.output if n.op_type == "Conv"]
    result = calibrate(
        model,
        names,
        ArrayDataReader({"image": data}, batch_size=3),
        method=PowerOfTwoMethod.MinMSE,
        options=OPTS,
        progress=False,
    )
    m2 = onnx.ModelProto()
    m2.CopyFrom(model)
    for name in names[1:]:
        m2.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
    outs = dict(zip([o.name for o in m2.graph.output], run_ort(m2, {"image": data}), strict=True))
    outs["image"] = data
    for name in names:
        assert result.position(name, method=PowerOfTwoMethod.MinMSE) == minmse_position(
            outs[name]
        ), name


def test_two_folding_threads_give_exactly_the_one_thread_result():
    from quark_onnx.calibration.collector import Collector

    rng = np.random.default_rng(3)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("Tanh", ["h"], ["s"]),
        helper.make_node("Mul", ["s", "h"], ["y"]),
    ]
    model = make_model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        {"W": rng.standard_normal((4, 3)).astype(np.float32)},
    )
    data = _feeds(40)
    results = []
    released = []
    for parallel, pipeline in ((True, True), (False, False)):
        c = Collector(
            model,
            ["x", "h", "s", "y"],
            method=PowerOfTwoMethod.MinMSE,
            options=OPTS,
            max_batch=1,
            pipeline=pipeline,
            parallel=parallel,
        )
        original = c._run
        runs = []

        def spy(feed, first, original=original, runs=runs):
            outputs = original(feed, first)
            runs.append(outputs)
            return outputs

        c._run = spy
        fold, threads = c._fold, set()

        def fold_spy(outputs, indices, fold=fold, threads=threads):
            threads.add(threading.get_ident())
            fold(outputs, indices)

        c._fold = fold_spy
        assert c.sources == ["h", "s", "y"]
        results.append(c.run(ArrayDataReader({"x": data}, batch_size=1), progress=False))
        released.append(all(o is None for outputs in runs for o in outputs) and len(runs) == 40)
        assert len(threads) == (2 if parallel else 1)
    assert len(results[0].observers) == 4
    assert results[0].to_dict() == results[1].to_dict()
    assert released == [True, True]  # every output is dropped once folded
