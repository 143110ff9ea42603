"""One session for the outputs before and after a pass: those of two separate runs, bit for bit."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from conftest import make_model
from onnx import TensorProto as T
from onnx import helper as h

from quark_onnx.fidelity.paired_run import SUFFIX, combine, run_before_after
from quark_onnx.model_files.load import serialize_ir
from quark_onnx.passes.convert_avg_pool_to_dpu_version import ConvertAvgPoolToDPUVersion
from quark_onnx.passes.convert_clip_to_relu import ConvertClipToRelu
from quark_onnx.pipeline.prepare import _saturator, run_model, run_passes

RNG = np.random.default_rng(7)


def _conv_pool_model():
    """Conv -> Relu -> AveragePool 3x3 -> Flatten -> Gemm (``y``), and the Relu's output (``r``)."""
    return make_model(
        [
            h.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
            h.make_node("Relu", ["c"], ["r"]),
            h.make_node("AveragePool", ["r"], ["p"], kernel_shape=[3, 3], strides=[3, 3]),
            h.make_node("Flatten", ["p"], ["f"]),
            h.make_node("Gemm", ["f", "g"], ["y"], transB=1),
        ],
        [h.make_tensor_value_info("x", T.FLOAT, [1, 3, 6, 6])],
        [
            h.make_tensor_value_info("y", T.FLOAT, [1, 5]),
            h.make_tensor_value_info("r", T.FLOAT, [1, 4, 6, 6]),
        ],
        {
            "w": RNG.normal(size=(4, 3, 3, 3)).astype(np.float32),
            "b": RNG.normal(size=4).astype(np.float32),
            "g": RNG.normal(size=(5, 16)).astype(np.float32),
        },
    )


def _feeds(n: int) -> list[dict[str, np.ndarray]]:
    return [{"x": RNG.normal(size=(1, 3, 6, 6)).astype(np.float32)} for _ in range(n)]


def _assert_identical(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert list(g) == list(e)  # the same outputs in the same order
        for name in e:
            assert g[name].dtype == e[name].dtype
            np.testing.assert_array_equal(g[name], e[name])


def test_outputs_are_those_of_two_separate_runs_and_the_shared_part_runs_once():
    before = ir.serde.deserialize_model(_conv_pool_model())
    after = before.clone()
    assert ConvertAvgPoolToDPUVersion()(after).modified
    feeds = _feeds(3)
    pair = run_before_after(before, after, feeds)
    assert pair is not None
    _assert_identical(pair[0], run_model(before, feeds))
    _assert_identical(pair[1], run_model(after, feeds))
    assert not np.array_equal(pair[0][0]["y"], pair[1][0]["y"])  # the pass changed y
    # only what the pass changed is added: Conv and Relu (and so output r) are computed once
    combined, names = combine(serialize_ir(before), serialize_ir(after))
    added = [n for n in combined.graph.node if n.output[0].endswith(SUFFIX)]
    assert len(combined.graph.node) == len(before.graph) + len(added)
    assert {o for n in added for o in n.input} >= {"r"}
    assert not any(o.startswith(("c", "r")) for n in added for o in n.output)
    assert names == ["y" + SUFFIX, "r"]


def test_saturated_range_caps_run_as_in_their_own_sessions():
    """The ``edit`` (a Relu's range cap run as a Clip) is applied to each model before they
    are combined: the Relu ConvertClipToRelu writes saturates in the after part only."""
    proto = make_model(
        [
            h.make_node("MatMul", ["x", "m"], ["l"]),
            h.make_node("Clip", ["l", "lo", "hi"], ["c"]),
            h.make_node("Mul", ["c", "two"], ["y"]),
        ],
        [h.make_tensor_value_info("x", T.FLOAT, [1, 8])],
        [h.make_tensor_value_info("y", T.FLOAT, [1, 8])],
        {
            "m": RNG.normal(size=(8, 8)).astype(np.float32) * 4,
            "lo": np.array(0.0, dtype=np.float32),
            "hi": np.array(6.0, dtype=np.float32),
            "two": np.array(2.0, dtype=np.float32),
        },
    )
    before = ir.serde.deserialize_model(proto)
    after = before.clone()
    assert ConvertClipToRelu()(after).modified

    def saturation(cap: float) -> float:
        return cap + 1.5

    feeds = [{"x": RNG.normal(size=(1, 8)).astype(np.float32) * 3} for _ in range(4)]
    pair = run_before_after(before, after, feeds, _saturator(saturation))
    assert pair is not None
    _assert_identical(pair[0], run_model(before, feeds, saturation=saturation))
    _assert_identical(pair[1], run_model(after, feeds, saturation=saturation))
    assert max(float(np.max(r["y"])) for r in pair[1]) == pytest.approx(2 * 7.5)


def test_models_that_do_not_pair_simply_are_left_to_separate_runs():
    branch = h.make_graph(
        [h.make_node("Identity", ["x"], ["t"])],
        "branch",
        [],
        [h.make_tensor_value_info("t", T.FLOAT, [1])],
    )
    proto = make_model(
        [
            h.make_node("ReduceMax", ["x"], ["m"], keepdims=0),
            h.make_node("Greater", ["m", "zero"], ["cond"]),
            h.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=branch),
        ],
        [h.make_tensor_value_info("x", T.FLOAT, [1])],
        [h.make_tensor_value_info("y", T.FLOAT, [1])],
        {"zero": np.array(0.0, dtype=np.float32)},
    )
    model = ir.serde.deserialize_model(proto)
    assert run_before_after(model, model.clone(), [{"x": np.ones(1, np.float32)}]) is None


def test_run_passes_reports_the_same_costs_as_separate_runs():
    """A measured pass after a float-preserving one that changed the graph (no outputs known
    before it): its cost is measured on the pair and equals the cost of two separate runs."""
    model = ir.serde.deserialize_model(_conv_pool_model())
    feeds = _feeds(4)
    expected_before = run_model(model, feeds)
    expected_after = run_model(ConvertAvgPoolToDPUVersion()(model.clone()).model, feeds)
    report = run_passes(model, [ConvertAvgPoolToDPUVersion()], sample_feeds=feeds)
    record = report.record("ConvertAvgPoolToDPUVersion")
    for name in ("y", "r"):
        diff = max(
            float(np.max(np.abs(a[name].astype(np.float64) - b[name].astype(np.float64))))
            for a, b in zip(expected_before, expected_after, strict=True)
        )
        assert record.max_abs_diff[name] == diff
    assert record.max_abs_diff["r"] == 0.0 and record.max_abs_diff["y"] > 0.0


def test_samples_that_do_not_run_warn_once_and_leave_the_passes_unmeasured(caplog):
    """The pair fails on samples onnxruntime rejects: the separate run before the pass names
    what failed, once; neither this pass nor a later one is measured."""
    from quark_onnx.passes.convert_sigmoid_to_hard_sigmoid import ConvertSigmoidToHardSigmoid
    from quark_onnx.passes.replace_clip6_relu import ReplaceClip6Relu

    proto = make_model(
        [
            h.make_node("MatMul", ["x", "eye"], ["l"]),  # the Clip is a layer's activation
            h.make_node("Clip", ["l", "lo", "hi"], ["c"]),
            h.make_node("Sigmoid", ["c"], ["y"]),
        ],
        [h.make_tensor_value_info("x", T.FLOAT, [1, 4])],
        [h.make_tensor_value_info("y", T.FLOAT, [1, 4])],
        {
            "eye": np.eye(4, dtype=np.float32),
            "lo": np.array(0.0, dtype=np.float32),
            "hi": np.array(6.0, dtype=np.float32),
        },
    )
    model = ir.serde.deserialize_model(proto)
    wrong = [{"x": np.zeros((1, 5), np.float32)}]  # onnxruntime rejects the shape
    with caplog.at_level("WARNING", logger="quark_onnx.pipeline.prepare"):
        report = run_passes(
            model, [ReplaceClip6Relu(), ConvertSigmoidToHardSigmoid()], sample_feeds=wrong
        )
    assert [r.modified for r in report.passes] == [True, True]
    assert all(r.max_abs_diff == {} and r.fidelity == [] for r in report.passes)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "before ReplaceClip6Relu" in warnings[0]
