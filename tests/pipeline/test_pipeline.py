"""The prepare pipeline: passes chosen from the config, run in order, numerics changes measured."""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import make_model, shared_path
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

from quark_onnx import PassError, QuantizationConfig, get_default_config
from quark_onnx.config.options import ExtraOptions
from quark_onnx.model_files.load import load_ir, upgrade
from quark_onnx.passes.base import QuarkPass
from quark_onnx.pipeline.prepare import (
    GraphCleanup,
    PipelineReport,
    prepare_passes,
    run_model,
    run_passes,
)

ALL_PREPARE = [
    "SimplifyWithOnnxsim",
    "RemoveInferenceDropout",
    "RemoveIdentity",
    "ConvertSplitToSlice",
    "FoldConvAffine",
    "ConvertBNToConv",
    "FoldConstantChannels",
    "ReplaceClip6Relu",
    "EqualizeGatedActivations",
    "EqualizeResidualStreams",
    "ConvertClipToRelu",
    "ConvertReduceMeanToGlobalAvgPool",
    "SplitLargeKernelPool",
    "ConvertGlobalAvgPoolToDepthwiseConv",
    "ConvertSigmoidToHardSigmoid",
    "GraphCleanup",
]


def _names(passes) -> list[str]:
    return [type(p).__name__ for p in passes]


def _xint8(**changes) -> tuple[QuantizationConfig, ExtraOptions]:
    qconfig = get_default_config("XINT8")
    return qconfig, dataclasses.replace(qconfig.resolved_options(), **changes)


# -- prepare_passes ----------------------------------------------------------------------------


def test_xint8_pipeline_order():
    qconfig, options = _xint8()
    assert _names(prepare_passes(qconfig, options)) == [
        "SimplifyWithOnnxsim",
        "RemoveInferenceDropout",
        "RemoveIdentity",
        "ConvertSplitToSlice",
        "FoldConvAffine",
        "ConvertBNToConv",
        "FoldConstantChannels",
        "CrossLayerEqualization",
        "EqualizeGatedActivations",
        "EqualizeResidualStreams",
        "ConvertReduceMeanToGlobalAvgPool",
        "SplitLargeKernelPool",
        "ConvertGlobalAvgPoolToDepthwiseConv",
        "ConvertSigmoidToHardSigmoid",
        "GraphCleanup",
    ]


def test_every_switch_is_honoured():
    qconfig, options = _xint8(ReplaceClip6Relu=True, ConvertClipToRelu=True)
    qconfig.include_cle = False  # a QuantizationConfig field, not a switch: see the order test
    assert _names(prepare_passes(qconfig, options)) == ALL_PREPARE
    always = {"RemoveInferenceDropout", "RemoveIdentity", "GraphCleanup"}
    switch = {"FoldConvAffine": "ConvertBNToConv"}  # the option that turns it on, if not its own
    for name in ALL_PREPARE[1:]:
        if name in always:
            continue
        option = switch.get(name, name)
        _, off = _xint8(**{"ReplaceClip6Relu": True, "ConvertClipToRelu": True, option: False})
        expected = [p for p in ALL_PREPARE if p in always or switch.get(p, p) != option]
        assert _names(prepare_passes(qconfig, off)) == expected
    qconfig.optimize_model = False
    assert _names(prepare_passes(qconfig, options)) == ALL_PREPARE[1:]
    assert all(isinstance(p, QuarkPass) for p in prepare_passes(qconfig, options))


# -- run_passes ----------------------------------------------------------------------------------


def _clip_sigmoid_model() -> onnx.ModelProto:
    """``y = Sigmoid(Clip(x @ I, 0, 6))``, ``z = Clip(x @ I, 0, 6) * 2``: two outputs (the identity
    MatMul makes the Clip a layer's activation)."""
    return make_model(
        [
            h.make_node("MatMul", ["x", "eye"], ["l"]),
            h.make_node("Clip", ["l", "lo", "hi"], ["c"]),
            h.make_node("Sigmoid", ["c"], ["y"]),
            h.make_node("Mul", ["c", "two"], ["z"]),
        ],
        [h.make_tensor_value_info("x", T.FLOAT, [1, 64])],
        [
            h.make_tensor_value_info("y", T.FLOAT, [1, 64]),
            h.make_tensor_value_info("z", T.FLOAT, [1, 64]),
        ],
        {
            "lo": np.array(0.0, dtype=np.float32),
            "hi": np.array(6.0, dtype=np.float32),
            "two": np.array(2.0, dtype=np.float32),
            "eye": np.eye(64, dtype=np.float32),
        },
    )


def test_report_measures_numerics_changing_passes():
    qconfig, options = _xint8(ReplaceClip6Relu=True)
    qconfig.optimize_model = False
    model = ir.serde.deserialize_model(_clip_sigmoid_model())
    x = np.linspace(-10, 10, 64, dtype=np.float32).reshape(1, 64)
    report = run_passes(model, prepare_passes(qconfig, options), sample_feeds={"x": x})
    assert isinstance(report, PipelineReport)
    assert [r.name for r in report.passes] == _names(prepare_passes(qconfig, options))
    assert report.modified and report.seconds >= 0

    clip6 = report.record("ReplaceClip6Relu")
    assert clip6.modified and clip6.changes_numerics
    c_old, c_new = np.clip(x, 0, 6), np.maximum(x, 0)
    assert clip6.max_abs_diff["z"] == pytest.approx(float(np.max(2 * (c_new - c_old))))
    sigmoid = lambda v: 1 / (1 + np.exp(-v.astype(np.float64)))  # noqa: E731
    assert clip6.max_abs_diff["y"] == pytest.approx(
        float(np.max(np.abs(sigmoid(c_new) - sigmoid(c_old)))), abs=1e-6
    )
    hard = report.record("ConvertSigmoidToHardSigmoid")
    expected = np.max(np.abs(np.clip(c_new * np.float32(1 / 6) + 0.5, 0, 1) - sigmoid(c_new)))
    assert hard.max_abs_diff["y"] == pytest.approx(float(expected), abs=1e-6)
    assert hard.max_abs_diff["z"] == 0.0
    # float-preserving passes are not measured
    assert report.record("ConvertBNToConv").max_abs_diff == {}

    out = run_model(model, {"x": x})
    np.testing.assert_allclose(out["z"], 2 * c_new)


def test_no_sample_feeds_no_measurement():
    qconfig, options = _xint8(ReplaceClip6Relu=True)
    qconfig.optimize_model = False
    model = ir.serde.deserialize_model(_clip_sigmoid_model())
    report = run_passes(model, prepare_passes(qconfig, options))
    assert report.record("ReplaceClip6Relu").modified
    assert all(r.max_abs_diff == {} for r in report.passes)


class _Broken(QuarkPass):
    def call(self, model):
        raise KeyError("boom")


def test_failing_pass_raises_pass_error():
    model = ir.serde.deserialize_model(_clip_sigmoid_model())
    with pytest.raises(PassError, match=r"_Broken failed on model 'test'.*boom"):
        run_passes(model, [GraphCleanup(), _Broken()])


def test_graph_cleanup_removes_dead_nodes():
    model = make_model(
        [h.make_node("Neg", ["x"], ["dead"]), h.make_node("Relu", ["x"], ["y"])],
        [h.make_tensor_value_info("x", T.FLOAT, [2])],
        [h.make_tensor_value_info("y", T.FLOAT, [2])],
        {"unused": np.zeros(3, dtype=np.float32)},
    )
    ir_model = ir.serde.deserialize_model(model)
    assert GraphCleanup()(ir_model).modified
    assert [n.op_type for n in ir_model.graph] == ["Relu"]
    assert not ir_model.graph.initializers
    assert not GraphCleanup()(ir_model).modified


def test_graph_cleanup_keeps_the_measured_outputs(monkeypatch):
    """After GraphCleanup changed the graph, the next measured pass is measured against the
    outputs from before it (bit-identical) instead of a new run: same records, and only the model
    after the pass runs (not the pair before and after)."""
    import quark_onnx.pipeline.prepare as pipeline
    from quark_onnx.passes import ConvertSigmoidToHardSigmoid, ReplaceClip6Relu

    proto = _clip_sigmoid_model()
    proto.graph.node.insert(0, h.make_node("Neg", ["x"], ["dead"]))
    x = np.linspace(-10, 10, 64, dtype=np.float32).reshape(1, 64)
    runs: list[str] = []
    real, real_pair = pipeline._try_run, pipeline._try_run_pair

    def counted(model, feeds, when, saturation):
        runs.append(when)
        return real(model, feeds, when, saturation)

    def counted_pair(before, after, feeds, name, saturation):
        runs.append(f"pair {name}")
        return real_pair(before, after, feeds, name, saturation)

    monkeypatch.setattr(pipeline, "_try_run", counted)
    monkeypatch.setattr(pipeline, "_try_run_pair", counted_pair)
    records = {}
    for keeps in (True, False):
        monkeypatch.setattr(GraphCleanup, "preserves_outputs", keeps)
        runs.clear()
        passes = [ReplaceClip6Relu(), GraphCleanup(), ConvertSigmoidToHardSigmoid()]
        report = run_passes(ir.serde.deserialize_model(proto), passes, sample_feeds={"x": x})
        assert report.record("GraphCleanup").modified
        records[keeps] = (report.record("ConvertSigmoidToHardSigmoid"), list(runs))
    (kept, kept_runs), (rerun, rerun_runs) = records[True], records[False]
    assert kept.max_abs_diff == rerun.max_abs_diff and kept.max_abs_diff["y"] > 0
    assert kept.fidelity == rerun.fidelity
    pair, after = "pair ConvertSigmoidToHardSigmoid", "after ConvertSigmoidToHardSigmoid"
    assert pair in rerun_runs and after not in rerun_runs
    assert kept_runs == [after if r == pair else r for r in rerun_runs]


# -- real models -------------------------------------------------------------------------------


def _digits():
    model = load_ir(shared_path("models", "digits_cnn.onnx"))
    data = np.load(shared_path("models", "digits_test.npz"))
    return model, data["x"], data["y"]


def _spatial_reduce_means(model: ir.Model) -> int:
    count = 0
    for node in model.graph:
        if node.op_type == "ReduceMean":
            axes = node.attributes.get_ints("axes", None)
            count += axes is not None and {a % 4 for a in axes} == {2, 3}
    return count


@pytest.mark.real_model
@pytest.mark.slow
def test_digits_xint8_prepare_is_float_exact():
    model, x, labels = _digits()
    assert _spatial_reduce_means(model) == 3
    assert sum(n.op_type == "BatchNormalization" for n in model.graph) == 13
    ref = run_model(model, {"image": x})["logits"]
    qconfig, options = _xint8(ConvertSigmoidToHardSigmoid=False)  # numerics-changing passes off
    report = run_passes(model, prepare_passes(qconfig, options))
    ops = collections.Counter(n.op_type for n in model.graph)
    assert ops["BatchNormalization"] == 0
    # the three spatial means became pools, then depthwise Convs (all within the kernel limit)
    assert ops["ReduceMean"] == 0 and ops["GlobalAveragePool"] == 0
    assert report.record("ConvertReduceMeanToGlobalAvgPool").modified
    assert report.record("ConvertGlobalAvgPoolToDepthwiseConv").modified
    out = run_model(model, {"image": x})["logits"]
    assert np.max(np.abs(out - ref)) <= 1e-4  # measured 1.05e-5 on the 719 test images
    assert (out.argmax(1) == labels).mean() == (ref.argmax(1) == labels).mean()


@pytest.mark.real_model
def test_digits_bn_folding_without_onnxsim():
    model, x, _ = _digits()
    x = x[:64]
    ref = run_model(model, {"image": x})["logits"]
    qconfig, options = _xint8(ConvertSigmoidToHardSigmoid=False)
    qconfig.optimize_model = False
    report = run_passes(model, prepare_passes(qconfig, options))
    assert report.record("FoldConvAffine").modified  # every BN follows a Conv
    assert not any(n.op_type == "BatchNormalization" for n in model.graph)
    # all 13 folded, none added; the three spatial means became depthwise Convs
    assert sum(n.op_type == "Conv" for n in model.graph) == 19 + 3
    out = run_model(model, {"image": x})["logits"]
    assert np.max(np.abs(out - ref)) <= 1e-4


@pytest.mark.real_model
@pytest.mark.slow
def test_digits_numerics_changing_passes_are_measured():
    model, x, _ = _digits()
    x = x[:128]
    ref = run_model(model, {"image": x})["logits"]
    qconfig, options = _xint8(ConvertClipToRelu=True)
    report = run_passes(model, prepare_passes(qconfig, options), sample_feeds={"image": x})
    clip = report.record("ConvertClipToRelu").max_abs_diff["logits"]
    hard = report.record("ConvertSigmoidToHardSigmoid").max_abs_diff["logits"]
    # On the full 719-image test set: 1.93 (Clip(0, 6) -> Relu) and 1.86 (then HardSigmoid).
    assert 0.1 < clip < 5 and 0.1 < hard < 5
    total = np.max(np.abs(run_model(model, {"image": x})["logits"] - ref))
    assert total <= clip + hard + 1e-5
    caps = [
        n.outputs[0].metadata_props.get("quark_onnx.range_max")
        for n in model.graph
        if n.op_type == "Relu"
    ]
    assert caps.count("6.0") == 9  # every ReLU6 keeps its bound for the quantizer


def _zoo_with_random_weights(name: str, seed: int = 0) -> onnx.ModelProto:
    """A zoo_light model with its ConstantOfShape weights replaced by random initializers.

    Weights get He-normal values, BatchNormalization scales and variances U(0.5, 1.5), other
    vectors small normals; the Softmax input is exposed as an extra output (the probabilities
    saturate and would hide differences). Upgraded to opset 13.
    """
    rng = np.random.default_rng(seed)
    model = onnx.load(str(shared_path("models", "zoo_light", f"{name}.onnx")))
    original_inits = {t.name: t for t in model.graph.initializer}
    readers = collections.defaultdict(list)
    for node in model.graph.node:
        for i, value in enumerate(node.input):
            readers[value].append((node.op_type, i))
    nodes, random_inits = [], []
    for node in model.graph.node:
        if node.op_type != "ConstantOfShape":
            nodes.append(node)
            continue
        shape = tuple(int(v) for v in numpy_helper.to_array(original_inits[node.input[0]]))
        op, index = (readers[node.output[0]] or [("", 0)])[0]
        if op == "BatchNormalization" and index in (1, 4):
            data = rng.uniform(0.5, 1.5, shape)
        elif len(shape) >= 2:
            data = rng.normal(0, np.sqrt(2.0 / np.prod(shape[1:])), shape)
        else:
            data = rng.normal(0, 0.05, shape)
        random_inits.append(numpy_helper.from_array(data.astype(np.float32), node.output[0]))
    used = {v for node in nodes for v in node.input}
    kept = [t for t in model.graph.initializer if t.name in used]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept + random_inits)
    data_inputs = [i for i in model.graph.input if i.name not in original_inits]
    data_inputs = [i for i in data_inputs if i.name not in {t.name for t in random_inits}]
    del model.graph.input[:]
    model.graph.input.extend(data_inputs)
    softmax = next(n for n in model.graph.node if n.op_type == "Softmax")
    model.graph.output.append(onnx.ValueInfoProto(name=softmax.input[0]))
    model.ir_version = max(model.ir_version, 4)
    return upgrade(model, 13)


def _compare_after_pipeline(model: ir.Model, qconfig, options) -> PipelineReport:
    graph_input = model.graph.inputs[0]
    x = np.random.default_rng(1).normal(0, 1, list(graph_input.shape)).astype(np.float32)
    feeds = {graph_input.name: x}
    before = run_model(model, feeds)
    report = run_passes(model, prepare_passes(qconfig, options))
    onnx.checker.check_model(ir.serde.serialize_model(model))
    after = run_model(model, feeds)
    for name, ref in before.items():
        scale = max(float(np.ptp(ref)), float(np.abs(ref).max()), 1e-12)
        assert np.max(np.abs(after[name] - ref)) <= 1e-4 * scale, name
    return report


@pytest.mark.real_model
@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet50", "shufflenet", "squeezenet", "inception_v1"])
def test_zoo_light_models(name):
    model = ir.serde.deserialize_model(_zoo_with_random_weights(name))
    bns = sum(n.op_type == "BatchNormalization" for n in model.graph)
    # all float-preserving passes, without onnxsim so that BN folding has work to do (a BN
    # after a Conv is folded by FoldConvAffine, any other by ConvertBNToConv)
    qconfig, options = _xint8(ConvertSigmoidToHardSigmoid=False)
    qconfig.optimize_model = False
    report = _compare_after_pipeline(model, qconfig, options)
    folded = report.record("FoldConvAffine").modified or report.record("ConvertBNToConv").modified
    assert folded == (bns > 0)
    assert not any(n.op_type == "BatchNormalization" for n in model.graph)
    # and the full preset (onnxsim first) runs on the result as well
    qconfig, options = _xint8(ReplaceClip6Relu=True, ConvertClipToRelu=True)
    run_passes(model, prepare_passes(qconfig, options))


@pytest.mark.real_model
@pytest.mark.slow
def test_squeezenet_1_1():
    model = load_ir(shared_path("models", "squeezenet1.1.onnx"))
    qconfig, options = _xint8(ConvertSigmoidToHardSigmoid=False)
    report = _compare_after_pipeline(model, qconfig, options)
    assert report.record("SimplifyWithOnnxsim").modified
    ops = collections.Counter(n.op_type for n in model.graph)
    # the 13x13 global pool became a depthwise Conv
    assert ops["Conv"] == 26 + 1 and ops["GlobalAveragePool"] == 0


def test_pass_costs_are_measured_on_the_samples_whose_outputs_fit():
    from quark_onnx.pipeline.prepare import (
        MEASURE_MIN_SAMPLES,
        MEASURE_OUTPUT_BYTES,
        measured_samples,
    )

    samples = [{"x": None}] * 16
    small = [{"y": np.zeros((1, 10), np.float32)}] * 16
    assert measured_samples(samples, small) == 16  # small outputs: every sample
    assert measured_samples(samples, None) == 16  # sizes unknown: every sample
    big = np.zeros(MEASURE_OUTPUT_BYTES // 5 // 4, np.float32)  # a fifth of the budget
    assert measured_samples(samples, [{"y": big}] * 16) == 5
    huge = np.zeros(MEASURE_OUTPUT_BYTES // 4 + 1, np.float32)  # over the budget on its own
    assert measured_samples(samples, [{"y": huge}] * 16) == MEASURE_MIN_SAMPLES
    assert measured_samples(samples[:2], [{"y": huge}] * 2) == 2
