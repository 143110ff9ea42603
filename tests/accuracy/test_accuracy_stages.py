"""Bias correction, AdaRound and per-layer error analysis on tiny Conv graphs.

Oracles: numpy references (im2col against onnxruntime's Conv, power-of-two arithmetic), the
float graph run by onnxruntime, and losses measured on held-out data the stages never saw.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
from conftest import make_model, run_ort
from onnx import TensorProto, helper

from quark_onnx.accuracy.adaround import AdaRoundSettings, adaround, learn_rounding
from quark_onnx.accuracy.bias_correction import correct_bias, requantize_bias
from quark_onnx.accuracy.error_analysis import (
    fallback_cost,
    layer_errors,
    sqnr_db,
    worst_layers,
)
from quark_onnx.accuracy.layer_statistics import im2col
from quark_onnx.accuracy.layers import find_layers
from quark_onnx.accuracy.replay import Replay
from quark_onnx.config.options import ExtraOptions
from quark_onnx.config.quantization import get_default_config
from quark_onnx.errors import ConfigError
from quark_onnx.model_files.load import to_ir, to_proto
from quark_onnx.npu.rules import position_of_scale
from quark_onnx.params import pof2
from quark_onnx.passes.insert_qdq import InsertQDQ
from quark_onnx.plan.build import build_plan

CONV = {
    "kernel_shape": [3, 3],
    "pads": [1, 1, 1, 1],
    "strides": [1, 1],
    "dilations": [1, 1],
    "group": 1,
}


def _conv_chain(rng: np.random.Generator, n: int = 2, bias: bool = True) -> onnx.ModelProto:
    """x (1,4,8,8) -> n x [Conv 3x3 (4->4) -> Relu] -> y."""
    nodes, inits = [], {}
    prev = "x"
    for i in range(n):
        w = rng.normal(0, 0.3, (4, 4, 3, 3)).astype(np.float32)
        w[0] *= 8.0  # one wide channel: per-tensor quantization is coarse for the others
        inits[f"w{i}"] = w
        ins = [prev, f"w{i}"]
        if bias:
            inits[f"b{i}"] = rng.normal(0, 0.2, 4).astype(np.float32)
            ins.append(f"b{i}")
        nodes.append(helper.make_node("Conv", ins, [f"c{i}"], name=f"conv{i}", **CONV))
        out = "y" if i == n - 1 else f"r{i}"
        nodes.append(helper.make_node("Relu", [f"c{i}"], [out], name=f"relu{i}"))
        prev = out
    return make_model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        inits,
    )


def _samples(rng: np.random.Generator, n: int, offset: float = 0.0) -> list[dict]:
    return [{"x": (rng.normal(offset, 1.0, (1, 4, 8, 8))).astype(np.float32)} for _ in range(n)]


def _smooth_samples(rng: np.random.Generator, n: int) -> list[dict]:
    """Spatially and channel-correlated inputs (like images): a 4x4 field upsampled to 8x8."""
    out = []
    for _ in range(n):
        field = np.kron(rng.normal(0, 1, (1, 1, 4, 4)), np.ones((1, 1, 2, 2)))
        mix = rng.normal(1, 0.3, (1, 4, 1, 1))
        x = field * mix + 0.1 * rng.normal(0, 1, (1, 4, 8, 8))
        out.append({"x": x.astype(np.float32)})
    return out


def _quantize(proto: onnx.ModelProto, samples: list[dict], **extra):
    """Plan + positions (MinMSE on the samples) + InsertQDQ, like the quantizer does."""
    qc = get_default_config("XINT8")
    qc.extra_options.update(extra)
    options = qc.validate()
    model = to_ir(proto)
    prepared = to_proto(model)
    plan = build_plan(model, qc, options)
    acts = plan.activation_names()
    from conftest import run_ort as _run

    m = onnx.ModelProto()
    m.CopyFrom(prepared)
    for t in acts:
        if t not in {o.name for o in m.graph.output}:
            m.graph.output.append(onnx.ValueInfoProto(name=t))
    names = [o.name for o in m.graph.output]
    values: dict[str, list[np.ndarray]] = {t: [] for t in acts}
    for s in samples:
        for name, arr in zip(names, _run(m, s), strict=True):
            if name in values:
                values[name].append(arr)
    consts = {t.name: onnx.numpy_helper.to_array(t) for t in prepared.graph.initializer}
    positions = {}
    for t, spec in plan.tensors.items():
        if t in values:
            positions[t] = pof2.minmse_position(np.concatenate([v.ravel() for v in values[t]]))
        elif spec.kind.value == "weight":
            positions[t] = pof2.weight_position(consts[t])
        else:
            positions[t] = pof2.bias_position(consts[t])
    from quark_onnx.params.solver import solve_positions

    solved = solve_positions(plan, positions, options)
    InsertQDQ(plan, solved.positions)(model)
    return prepared, model, plan, solved.positions, options


def _layer_mse(float_proto, quant_proto, samples, tensor="c0") -> float:
    """Mean squared error of a Conv output (quantized vs float model) over ``samples``."""
    err = []
    for s in samples:
        f = _outputs(float_proto, s, [tensor])[0]
        q = _outputs(quant_proto, s, [tensor])[0]
        err.append(np.mean((f - q) ** 2))
    return float(np.mean(err))


def _outputs(proto, feed, names):
    m = onnx.ModelProto()
    m.CopyFrom(proto)
    for n in names:
        if n not in {o.name for o in m.graph.output}:
            m.graph.output.append(onnx.ValueInfoProto(name=n))
    out_names = [o.name for o in m.graph.output]
    res = dict(zip(out_names, run_ort(m, feed), strict=True))
    return [res[n] for n in names]


# --- helpers -----------------------------------------------------------------------------------


def test_position_of_scale_exact_powers_only():
    assert position_of_scale(0.25) == 2
    assert position_of_scale(8.0) == -3
    assert position_of_scale(0.3) is None
    assert position_of_scale(0.0) is None


@pytest.mark.parametrize(
    "group,stride,dilation,pads", [(1, 1, 1, 1), (2, 2, 1, 0), (4, 1, 2, 2), (1, 2, 2, 1)]
)
def test_im2col_matches_onnxruntime_conv(group, stride, dilation, pads):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 4, 9, 7)).astype(np.float32)
    w = rng.normal(size=(6 if group != 4 else 4, 4 // group, 3, 3)).astype(np.float32)
    attrs = {
        "kernel_shape": [3, 3],
        "pads": [pads, pads, pads, pads],
        "strides": [stride, stride],
        "dilations": [dilation, dilation],
        "group": group,
    }
    model = make_model(
        [helper.make_node("Conv", ["x", "w"], ["y"], **attrs)],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None] * 4)],
        {"w": w},
    )
    (want,) = run_ort(model, {"x": x})

    from quark_onnx.accuracy.layer_statistics import _Geometry

    geo = _Geometry(group, (3, 3), (stride, stride), (dilation, dilation), (pads,) * 4)
    cols = im2col(x.astype(np.float64), geo)  # (g, K, N*P)
    wg = w.reshape(group, -1, cols.shape[1]).astype(np.float64)
    got = np.matmul(wg, cols)  # (g, O, N*P)
    n, p = x.shape[0], want.shape[2] * want.shape[3]
    got = got.reshape(group, wg.shape[1], n, p).transpose(2, 0, 1, 3).reshape(want.shape)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_replay_segments_equal_whole_model_and_run_each_node_once():
    rng = np.random.default_rng(1)
    proto = _conv_chain(rng, n=3)
    samples = _samples(rng, 3)
    replay = Replay(proto, samples, "test")
    (c0,) = replay.get(["c0"])
    (c2, y) = replay.get(["c2", "y"])
    for i, s in enumerate(samples):
        want = _outputs(proto, s, ["c0", "c2", "y"])
        # optimized conv kernels: equal up to float32 summation order
        np.testing.assert_allclose(c0[i], want[0], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(c2[i], want[1], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(y[i], want[2], rtol=1e-5, atol=1e-5)
    assert replay.runs == 2 * len(samples)  # two segments, each run once per sample
    with pytest.raises(Exception, match="no longer kept"):
        replay.get(["c0"])  # consumed earlier and dropped: memory stays bounded


# --- bias correction ---------------------------------------------------------------------------


def test_requantize_bias_rounds_and_saturates():
    codes = np.array([10, 120, -120], dtype=np.int8)
    new, saturated = requantize_bias(codes, 2, np.array([0.26, 3.0, -0.125]))
    # 10 + 1.04 -> 11; 120 + 12 -> 132 saturates at 127; -120 - 0.5 -> -120 (half to even)
    assert new.tolist() == [11, 127, -120]
    assert saturated == 1


def test_requantize_bias_keeps_codes_where_the_shift_is_not_finite():
    """NaN/Inf layer outputs (non-finite calibration data) give a non-finite mean shift; the
    code must stay as it was, not become whatever a NaN cast to int8 gives."""
    codes = np.array([10, -7, 3], dtype=np.int8)
    new, saturated = requantize_bias(codes, 2, np.array([np.nan, np.inf, 0.5]))
    assert new.tolist() == [10, -7, 5]
    assert saturated == 0


def test_bias_correction_reduces_mean_output_error_on_held_out_data():
    rng = np.random.default_rng(2)
    proto = _conv_chain(rng, n=2)  # the NPU checker wants at least two Conv nodes
    calib = _samples(rng, 16, offset=0.5)
    held_out = _samples(rng, 16, offset=0.5)
    prepared, model, plan, positions, options = _quantize(proto, calib)
    before = to_proto(model)
    found, _ = find_layers(model)
    old_codes = found[0].bias_codes.copy()

    def mean_error(quant_proto):
        diffs = [
            _outputs(prepared, s, ["c0"])[0] - _outputs(quant_proto, s, ["c0"])[0] for s in held_out
        ]
        per_channel = np.mean(np.stack(diffs), axis=(0, 1, 3, 4))
        return float(np.mean(np.abs(per_channel)))

    summary = correct_bias(prepared, model, calib, plan, positions, options)
    after = to_proto(model)
    assert summary["layers"] == 2 and summary["changed_channels"] > 0
    assert mean_error(after) < 0.5 * mean_error(before)
    # positions unchanged: the bias DQ scale is the same, only the codes moved
    new_codes = find_layers(model)[0][0].bias_codes
    assert new_codes.dtype == np.int8 and not np.array_equal(new_codes, old_codes)
    from quark_onnx.npu.readiness import check

    assert check(after).ready, check(after).summary()


def test_bias_correction_leaves_exact_layers_alone():
    """Weights already on the int8 grid and inputs on their grid: no shift, nothing changes."""
    rng = np.random.default_rng(3)
    w = (rng.integers(-20, 20, (4, 4, 1, 1)) / 16).astype(np.float32)
    b = (rng.integers(-20, 20, 4) / 16).astype(np.float32)
    proto = make_model(
        [helper.make_node("Conv", ["x", "w", "b"], ["y"], kernel_shape=[1, 1], name="conv")],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 4, 4])],
        {"w": w, "b": b},
    )
    samples = [
        {"x": (rng.integers(-60, 60, (1, 4, 4, 4)) / 16).astype(np.float32)} for _ in range(4)
    ]
    prepared, model, plan, positions, options = _quantize(proto, samples)
    summary = correct_bias(prepared, model, samples, plan, positions, options)
    assert summary["changed_channels"] == 0


def test_bias_correction_without_samples_reports_and_does_nothing():
    rng = np.random.default_rng(4)
    proto = _conv_chain(rng, n=1)
    prepared, model, plan, positions, options = _quantize(proto, _samples(rng, 4))
    summary = correct_bias(prepared, model, [], plan, positions, options)
    assert summary["layers"] == 0 and "skipped_reason" in summary


def test_bias_correction_skips_conv_without_bias():
    rng = np.random.default_rng(5)
    proto = _conv_chain(rng, n=1, bias=False)
    calib = _samples(rng, 4)
    prepared, model, plan, positions, options = _quantize(proto, calib)
    summary = correct_bias(prepared, model, calib, plan, positions, options)
    assert summary["layers"] == 0
    assert summary["skipped"][0]["node"] == "conv0"


def test_bias_correction_without_layers_builds_no_replay(monkeypatch):
    """A model without Conv/Gemm layers (an Add chain) has nothing to correct: no copy of the
    quantized model, no session."""
    from quark_onnx.accuracy import bias_correction
    from quark_onnx.runtime import sessions as runtime

    rng = np.random.default_rng(14)
    c = onnx.numpy_helper.from_array(rng.normal(0, 0.1, (1, 4, 8, 8)).astype(np.float32), "c")
    proto = helper.make_model(
        helper.make_graph(
            [helper.make_node("Add", ["x", "c"], ["y"], name="add0")],
            "adds",
            [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4, 8, 8])],
            [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4, 8, 8])],
            [c],
        ),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    calib = _samples(rng, 4)
    prepared, model, plan, positions, options = _quantize(proto, calib)

    def no_replay(*args, **kwargs):
        raise AssertionError("a replay was built")

    monkeypatch.setattr(bias_correction, "Replay", no_replay)
    sessions = runtime.COUNTS.sessions
    summary = correct_bias(prepared, model, calib, plan, positions, options)
    assert runtime.COUNTS.sessions == sessions
    assert summary["layers"] == 0 and summary["per_layer"] == [] and summary["segment_runs"] == 0


# --- AdaRound ----------------------------------------------------------------------------------


def test_learn_rounding_beats_nearest_on_its_quadratic():
    rng = np.random.default_rng(6)
    w = rng.normal(0, 0.5, (1, 8, 16))
    z = rng.normal(0, 1, (4, 400))  # correlated inputs: what rounding jointly can exploit
    x = rng.normal(0, 1, (16, 4)) @ z + 0.1 * rng.normal(0, 1, (16, 400))
    t = w[0] @ x
    gram = (x @ x.T)[None]
    cross = (x @ t.T)[None]
    res = learn_rounding(w, 4, gram, cross, float(np.sum(t * t)), iterations=400)
    assert res.accepted and res.loss_learned < 0.5 * res.loss_nearest
    # every code is the floor or the ceiling of w / s
    x_over_s = w * 16
    assert np.all((res.codes == np.floor(x_over_s)) | (res.codes == np.ceil(x_over_s)))


def test_learn_rounding_keeps_saturated_codes():
    w = np.array([[[10.0, -10.0, 0.3]]])  # at p=4: 160 and -160 are outside int8
    gram = np.eye(3)[None]
    cross = np.swapaxes(w, 1, 2)
    res = learn_rounding(w, 4, gram, cross, float(np.sum(w * w)), iterations=50)
    assert res.codes[0, 0, 0] == 127 and res.codes[0, 0, 1] == -128


def test_adaround_single_conv_beats_nearest_on_held_out_data():
    rng = np.random.default_rng(7)
    proto = _conv_chain(rng, n=2)
    calib = _smooth_samples(rng, 16)
    held_out = _smooth_samples(rng, 16)
    prepared, model, plan, positions, options = _quantize(proto, calib)
    nearest = to_proto(model)
    options = ExtraOptions(FastFinetune={"NumIterations": 500, "TimeBudgetPerLayer": 30.0})
    summary = adaround(prepared, model, calib, plan, positions, options)
    learned = to_proto(model)
    assert summary["layers"] == 2 and summary["accepted"] >= 1
    assert _layer_mse(prepared, learned, held_out) < 0.9 * _layer_mse(prepared, nearest, held_out)
    # positions unchanged: same scales in the graph, codes int8
    scales = lambda m: {  # noqa: E731
        t.name: onnx.numpy_helper.to_array(t).item()
        for t in m.graph.initializer
        if t.name.endswith("_scale")
    }
    assert scales(learned) == scales(nearest)
    from quark_onnx.npu.readiness import check

    assert check(learned).ready


@pytest.mark.parametrize("algorithm", ["gptq", "adaround"])
def test_rounding_skips_a_conv_transpose_with_bias(tmp_path, algorithm):
    """A ConvTranspose's weight is C_in x C_out/g x k x k: its bias has C_out values, not C_in.
    The rounding stages skip the layer (an unsupported form) instead of failing on the bias."""
    from quark_onnx import ArrayDataReader, Config, ModelQuantizer

    rng = np.random.default_rng(5)
    inits = {
        "w": rng.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32),
        "b": rng.normal(0, 0.1, 4).astype(np.float32),
        "wt": rng.normal(0, 0.3, (4, 1, 2, 2)).astype(np.float32),  # 4 in, 1 out
        "bt": np.array([0.2], np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", **{**CONV, "group": 1}),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("ConvTranspose", ["r", "wt", "bt"], ["y"], name="up", strides=[2, 2]),
    ]
    model = make_model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 16, 16])],
        inits,
    )
    src, out = tmp_path / "m.onnx", tmp_path / "q.onnx"
    onnx.save(model, src)
    qc = get_default_config("XINT8")
    qc.include_fast_ft = True
    qc.extra_options["FastFinetune"] = {"OptimAlgorithm": algorithm, "NumIterations": 20}
    quantizer = ModelQuantizer(Config(global_quant_config=qc))
    data = rng.normal(0, 1, (8, 3, 8, 8)).astype(np.float32)
    quantizer.quantize_model(str(src), str(out), ArrayDataReader({"x": data}))
    skipped = {s["node"]: s["reason"] for s in quantizer.report.adaround["skipped"]}
    assert skipped["up"] == "unsupported ConvTranspose form"
    assert out.exists()


def test_adaround_settings_are_validated():
    with pytest.raises(ConfigError, match="NumIterations"):
        AdaRoundSettings.from_options({"NumIteration": 10})
    with pytest.raises(ConfigError, match="expects int"):
        AdaRoundSettings.from_options({"NumIterations": 1.5})
    with pytest.raises(ConfigError, match="positive"):
        AdaRoundSettings.from_options({"LearningRate": 0})
    s = AdaRoundSettings.from_options({"LearningRate": 1, "NumBatches": 4})
    assert s.LearningRate == 1.0 and s.NumBatches == 4


# --- error analysis ----------------------------------------------------------------------------


def test_sqnr_db():
    assert sqnr_db(100.0, 1.0) == pytest.approx(20.0)
    assert sqnr_db(1.0, 0.0) == 200.0


def test_error_analysis_ranks_a_damaged_layer_worst():
    rng = np.random.default_rng(8)
    proto = _conv_chain(rng, n=3)
    calib = _samples(rng, 8)
    prepared, model, plan, _positions, _options = _quantize(proto, calib)
    # damage conv1: flip the sign of a third of its int8 weight codes
    layers, _ = find_layers(model)
    damaged = layers[1]
    codes = damaged.weight_codes.copy()
    flat = codes.reshape(-1)
    flat[::3] = -flat[::3]
    from quark_onnx.accuracy.layers import set_codes

    set_codes(damaged.weight, codes)
    errors = layer_errors(prepared, model, calib, plan)
    assert errors == sorted(errors, key=lambda e: e["sqnr_db"])
    assert {e["tensor"] for e in errors} >= {"x", "r0", "r1", "y"}
    assert worst_layers(errors, 1) == ["conv1"]
    assert len(worst_layers(errors, 2)) == 2
    assert worst_layers(errors, 0) == []


def test_error_analysis_of_a_large_graph_measures_a_subset_with_exact_drops():
    rng = np.random.default_rng(12)
    proto = _conv_chain(rng, n=6)
    calib = _samples(rng, 2)
    prepared, model, plan, _, _ = _quantize(proto, calib)
    full = {e["tensor"]: e for e in layer_errors(prepared, model, calib, plan)}
    subset = layer_errors(prepared, model, calib, plan, max_tensors=4)
    assert 0 < len(subset) <= 4 < len(full)
    ranked = [e for e in subset if e["node"] is not None]
    assert ranked  # the picked tensors, measured with their producer's inputs: exact drops
    for e in subset:
        assert e["sqnr_db"] == pytest.approx(full[e["tensor"]]["sqnr_db"], abs=1e-3)
    for e in ranked:
        assert e["drop_db"] == pytest.approx(full[e["tensor"]]["drop_db"], abs=1e-3)


def test_error_analysis_in_pieces_equals_the_whole_session_analysis(monkeypatch):
    """Graphs longer than one session run in pieces, samples in groups: the same sums, so the
    same entries to the last bit."""
    from quark_onnx.accuracy import error_analysis
    from quark_onnx.runtime import sessions as runtime

    rng = np.random.default_rng(13)
    proto = _conv_chain(rng, n=5)
    calib = _samples(rng, 7)
    prepared, model, plan, _, _ = _quantize(proto, calib)
    whole = layer_errors(prepared, model, calib, plan)
    before = runtime.COUNTS.sessions
    monkeypatch.setattr(runtime, "SEGMENT_NODES", 4)
    monkeypatch.setattr(error_analysis, "SEGMENT_SAMPLES", 3)
    pieces = layer_errors(prepared, model, calib, plan)
    # 3 groups of samples, each model in more than one piece
    assert runtime.COUNTS.sessions - before > 3 * 2 * 2
    assert pieces == whole


def test_error_analysis_without_damage_has_high_sqnr_everywhere():
    rng = np.random.default_rng(9)
    proto = _conv_chain(rng, n=2)
    calib = _samples(rng, 4)
    prepared, model, plan, _, _ = _quantize(proto, calib)
    errors = layer_errors(prepared, model, calib, plan)
    assert min(e["sqnr_db"] for e in errors) > 15.0


def test_fallback_cost_counts_partitions():
    rng = np.random.default_rng(10)
    proto = _conv_chain(rng, n=3)
    calib = _samples(rng, 2)
    prepared, _model, plan, _, _ = _quantize(proto, calib)
    none = fallback_cost(plan, prepared, [])
    assert none["partitions_before"] == none["partitions_after"] == 1
    mid = fallback_cost(plan, prepared, ["conv1"])
    assert mid["partitions_after"] == 2 and mid["boundary_edges_after"] == 2


def test_nodes_to_exclude_keeps_a_layer_float():
    rng = np.random.default_rng(11)
    proto = _conv_chain(rng, n=2)
    qc = get_default_config("XINT8")
    qc.nodes_to_exclude = ["conv1"]
    plan = build_plan(to_ir(proto), qc, qc.validate())
    assert "conv1" in {f.name for f in plan.float_nodes}
    assert "conv1" not in {n.name for n in plan.nodes}
    assert math.isfinite(len(plan.nodes))


# --- replay storage and memory budget ----------------------------------------------------------


def _qdq_chain(scale: float = 0.0625) -> onnx.ModelProto:
    """x -> Q/DQ -> Conv -> Relu -> Q/DQ -> Conv -> Add(the first DQ) -> y (all scales ``scale``).

    The first DQ output is read by the first Conv and, much later, by the Add: it crosses
    segment boundaries.
    """
    rng = np.random.default_rng(11)
    s = np.array(scale, np.float32)
    z = np.array(0, np.int8)
    inits = {"s": s, "z": z}
    for i in range(2):
        inits[f"w{i}"] = rng.normal(0, 0.3, (4, 4, 3, 3)).astype(np.float32)
        inits[f"b{i}"] = rng.normal(0, 0.2, 4).astype(np.float32)
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
        helper.make_node("Conv", ["xd", "w0", "b0"], ["c0"], name="conv0", **CONV),
        helper.make_node("Relu", ["c0"], ["r0"]),
        helper.make_node("QuantizeLinear", ["r0", "s", "z"], ["rq"]),
        helper.make_node("DequantizeLinear", ["rq", "s", "z"], ["rd"]),
        helper.make_node("Conv", ["rd", "w1", "b1"], ["c1"], name="conv1", **CONV),
        helper.make_node("Add", ["c1", "xd"], ["y"]),
    ]
    return make_model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        inits,
    )


def test_replay_keeps_a_dequantized_tensor_as_its_int8_codes_exactly():
    rng = np.random.default_rng(12)
    proto = _qdq_chain()
    samples = _samples(rng, 3)
    replay = Replay(proto, samples, "test")
    replay.get(["c0"])
    # xd is still needed (by the Add); it is kept as the int8 codes xq, not as float32
    assert "xd" not in replay.env and replay.env["xq"][0].dtype == np.int8
    (xd, y) = replay.get(["xd", "y"])
    for i, s in enumerate(samples):
        want_xd, want_y = _outputs(proto, s, ["xd", "y"])
        np.testing.assert_array_equal(xd[i], want_xd)  # dequantization is exact: same bits
        np.testing.assert_allclose(y[i], want_y, rtol=1e-5, atol=1e-5)


def test_replay_keeps_a_non_power_of_two_dequantized_tensor_as_float():
    """A DQ with scale 0.1 is not exact in any other order of operations: kept as computed."""
    rng = np.random.default_rng(13)
    proto = _qdq_chain(scale=0.1)
    replay = Replay(proto, _samples(rng, 2), "test")
    replay.get(["c0"])
    assert "xq" not in replay.env and replay.env["xd"][0].dtype == np.float32


def _replay_walk(proto, samples, budget, steps):
    """Values of c0 and y after adding ``steps`` to c0, with a given memory budget."""
    replay = Replay(proto, samples, "test", memory_budget=budget)
    (c0,) = replay.get(["c0"])
    c0 = [a.copy() for a in c0]
    replay.add_to("c0", steps)
    (y,) = replay.get(["y"])
    return replay, c0, y


def test_replay_under_a_memory_budget_recomputes_the_same_bits():
    rng = np.random.default_rng(14)
    proto = _qdq_chain()
    samples = _samples(rng, 4)
    step = rng.normal(0, 0.1, (1, 4, 1, 1)).astype(np.float32)
    free, c0_free, y_free = _replay_walk(proto, samples, None, step)
    tight, c0_tight, y_tight = _replay_walk(proto, samples, 0, step)
    for a, b in zip(c0_free + y_free, c0_tight + y_tight, strict=True):
        np.testing.assert_array_equal(a, b)
    # the patched c0 is not re-added: y differs from the unpatched walk
    _, _, y_plain = _replay_walk(proto, samples, None, np.zeros_like(step))
    assert not np.array_equal(y_plain[0], y_free[0])
    # the tight replay kept nothing but the inputs and ran the first segments again
    assert tight.checkpoint == 0 and tight.runs > free.runs
    assert free.checkpoint == free.cursor


def test_replay_of_an_ir_model_gives_the_bits_of_its_proto():
    """An ``ir.Model`` replays as its serialized form does, under a budget too, and a weight set
    before a segment is built is the one that segment runs (as for a proto); the model is not
    changed by the replay."""
    rng = np.random.default_rng(18)
    proto = _qdq_chain()
    samples = _samples(rng, 3)
    w1 = rng.normal(0, 0.3, (4, 4, 3, 3)).astype(np.float32)
    walks = []
    for model in (proto, to_ir(proto)):
        replay = Replay(model, samples, "test", memory_budget=0)
        (c0,) = replay.get(["c0"])
        replay.set_initializer("w1", w1)
        (xd, y) = replay.get(["xd", "y"])
        walks.append([*c0, *xd, *y])
        assert replay.coded.keys() == {"xd", "rd"}  # the int8 codes found from the IR too
    for a, b in zip(*walks, strict=True):
        np.testing.assert_array_equal(a, b)
    changed = onnx.ModelProto()
    changed.CopyFrom(proto)
    changed.graph.initializer[[t.name for t in proto.graph.initializer].index("w1")].CopyFrom(
        onnx.numpy_helper.from_array(w1, "w1")
    )
    for i, s in enumerate(samples):  # the set weight is used: y is that of the changed model
        np.testing.assert_allclose(walks[0][6 + i], _outputs(changed, s, ["y"])[0], atol=1e-5)
    model = to_ir(proto)
    Replay(model, samples, "test").get(["y"])
    assert to_proto(model).SerializeToString() == to_proto(to_ir(proto)).SerializeToString()


def test_replay_budget_moves_the_checkpoint_only_where_the_state_fits():
    rng = np.random.default_rng(15)
    proto = _qdq_chain()
    samples = _samples(rng, 2)
    codes_bytes = 2 * 4 * 8 * 8  # xq: int8, two samples
    replay = Replay(proto, samples, "test", memory_budget=codes_bytes)
    replay.get(["c0"])
    # split after the input's QuantizeLinear: only xq (int8) is live there, and it fits
    assert replay.checkpoint == 1 and set(replay.env) == {"xq"}


def test_replay_moves_past_the_budget_once_reruns_exceed_the_allowance():
    rng = np.random.default_rng(17)
    proto = _qdq_chain()
    samples = _samples(rng, 3)
    names = ["c0", "r0", "rd", "c1", "y"]  # one request per tensor, in graph order
    free = Replay(proto, samples, "test")
    expected = [free.get([n])[0] for n in names]
    for allowance, moves in ((None, False), (0.0, True)):
        replay = Replay(proto, samples, "test", memory_budget=0, rerun_allowance=allowance)
        for name, want in zip(names, expected, strict=True):
            (got,) = replay.get([name])
            for a, b in zip(got, want, strict=True):
                np.testing.assert_array_equal(a, b)
        # nothing fits a zero budget: only the allowance lets the checkpoint leave the input
        assert (replay.checkpoint > 0) is moves
        assert replay.runs > free.runs


def test_bias_correction_is_identical_with_and_without_the_memory_budget(monkeypatch):
    import quark_onnx.accuracy.bias_correction as bc

    rng = np.random.default_rng(16)
    proto = _conv_chain(rng, n=3)
    calib = _samples(rng, 8, offset=0.5)
    results = []
    for budget in (None, 0):
        monkeypatch.setattr(bc, "REPLAY_BUDGET", budget)
        monkeypatch.setattr(bc, "FLOAT_REPLAY_BUDGET", budget)
        prepared, model, plan, positions, options = _quantize(proto, calib)
        summary = correct_bias(prepared, model, calib, plan, positions, options)
        assert summary["changed_channels"] > 0
        summary.pop("seconds"), summary.pop("segment_runs")
        results.append((summary, to_proto(model).SerializeToString()))
    assert results[0] == results[1]


def test_bias_correction_replays_the_samples_an_activation_budget_allows(monkeypatch):
    """A sample's layer outputs times the samples over the budget: the first ones that fit are
    replayed (at least four), and the result is the one of those samples given alone."""
    import quark_onnx.accuracy.bias_correction as bc

    rng = np.random.default_rng(17)
    proto = onnx.shape_inference.infer_shapes(_conv_chain(rng, n=2))  # the sizes are the shapes
    calib = _samples(rng, 12, offset=0.5)
    per_sample = 2 * 4 * 4 * 8 * 8  # two layers' [1, 4, 8, 8] float32 outputs
    assert bc.replayed_samples(12, per_sample, budget=12 * per_sample) == 12  # must not fire
    assert bc.replayed_samples(12, per_sample, budget=6 * per_sample + 1) == 6
    assert bc.replayed_samples(12, per_sample, budget=0) == bc.MIN_SAMPLES
    assert bc.replayed_samples(2, per_sample, budget=0) == 2
    results = []
    for budget, given in ((6 * per_sample, calib), (bc.ACTIVATION_BUDGET, calib[:6])):
        monkeypatch.setattr(bc, "ACTIVATION_BUDGET", budget)
        prepared, model, plan, positions, options = _quantize(proto, calib)
        summary = correct_bias(prepared, model, given, plan, positions, options)
        assert summary["layer_output_bytes_per_sample"] == per_sample
        assert summary["samples"] == 6
        errors = [layer["shift_standard_error"] for layer in summary["per_layer"]]
        assert all(e is not None and 0 < e < 1 for e in errors)
        summary.pop("seconds"), summary.pop("segment_runs"), summary.pop("samples_available")
        results.append((summary, to_proto(model).SerializeToString()))
    assert results[0] == results[1]


def test_shift_standard_error_is_that_of_the_per_sample_means():
    means = np.array([[0.1, 1.0], [0.3, 1.0], [0.2, 1.0]])  # three samples, two channels
    sums = [means.sum(axis=0), (means**2).sum(axis=0)]
    want = np.mean(np.std(means, axis=0, ddof=1) / np.sqrt(3))
    from quark_onnx.accuracy.bias_correction import _standard_error

    assert _standard_error(sums, 3) == pytest.approx(want, rel=1e-12)
    assert _standard_error(sums, 1) is None
