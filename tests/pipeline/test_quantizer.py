"""ModelQuantizer end to end: the seed's XINT8 example on real models, checked against oracles."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import (
    SNIPPET_OPTIONS,
    box_and_score_model,
    make_model,
    quantize_xint8_and_check,
    shared_path,
)

from quark_onnx import (
    ArrayDataReader,
    Config,
    ModelQuantizer,
    QuantizationError,
    QuantType,
    get_default_config,
)
from quark_onnx.npu.readiness import check
from quark_onnx.npu.rules import position_of_scale

SEED_OPTIONS = SNIPPET_OPTIONS


def seed_config() -> Config:
    """The XINT8 example of the Vitis AI documentation, with real data instead of random."""
    quant_config = get_default_config("XINT8")
    quant_config.activation_type = QuantType.QInt8
    quant_config.optimize_model = False
    quant_config.extra_options.update(SEED_OPTIONS)
    return Config(global_quant_config=quant_config)


def top1(model: str | onnx.ModelProto, x: np.ndarray, y: np.ndarray) -> float:
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    logits = [session.run(None, {name: x[i : i + 1]})[0].reshape(1, -1) for i in range(len(x))]
    return float((np.concatenate(logits).argmax(axis=1) == y).mean())


def assert_npu_form(model: onnx.ModelProto) -> None:
    """Every Q/DQ scale is an exact power of two and the readiness check finds no error."""
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    scales = [n.input[1] for n in model.graph.node if n.op_type.endswith("QuantizeLinear")]
    assert scales
    for name in scales:
        assert inits[name].shape == () and position_of_scale(float(inits[name])) is not None
    verdict = check(model)
    assert verdict.ready, verdict.summary()
    onnxsim = pytest.importorskip("onnxsim")
    assert onnxsim.check_vitisai_support(model) == []


@pytest.mark.real_model
def test_seed_example_on_digits(tmp_path):
    model = shared_path("models", "digits_cnn.onnx")
    calib = np.load(shared_path("models", "digits_calib.npz"))
    test = np.load(shared_path("models", "digits_test.npz"))
    out = tmp_path / "digits.xint8.onnx"
    quantizer = ModelQuantizer(seed_config())
    quantizer.quantize_model(str(model), str(out), ArrayDataReader({"image": calib["x"]}))
    quantized = onnx.load(out)
    assert_npu_form(quantized)
    assert top1(quantized, test["x"], test["y"]) >= 0.985  # float: 0.9917
    report = quantizer.report
    assert report.unfixable == [] and report.check["ready"]
    assert report.calibration["samples"] == 184  # 16 of the 200 held out for the verdict
    if report.peak_rss_mb:  # every stage records the high-water mark, which never goes down
        assert list(report.peak_rss_mb) == list(report.timings)
        peaks = list(report.peak_rss_mb.values())
        assert peaks == sorted(peaks) and peaks[0] > 0
    # deterministic: the same inputs give the same bytes, also from an .npz path
    again = tmp_path / "again.onnx"
    ModelQuantizer(seed_config()).quantize_model(
        str(model), str(again), calibration_data_path=shared_path("models", "digits_calib.npz")
    )
    assert again.read_bytes() == out.read_bytes()


@pytest.mark.real_model
@pytest.mark.slow
def test_squeezenet_accuracy_and_readiness(tmp_path):
    from quark_onnx import ImageFolderDataReader, PreprocessSpec

    model = shared_path("models", "squeezenet1.1.onnx")
    val_dir = shared_path("data", "imagenet", "val")
    spec = PreprocessSpec.parse("resize=256,crop=224,mean=104;117;123,order=BGR")
    labels = {}
    for line in (val_dir / "labels.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, index = line.split("\t")[:2]
            labels[name] = int(index)
    val = ImageFolderDataReader(val_dir, str(model), spec)
    x = np.concatenate([feed["data_0"] for feed in val])
    y = np.array([labels[f.name] for f in val.files])
    out = tmp_path / "squeezenet.xint8.onnx"
    calib = ImageFolderDataReader(shared_path("data", "imagenet", "calib"), str(model), spec)
    ModelQuantizer(Config(global_quant_config=get_default_config("XINT8"))).quantize_model(
        str(model), str(out), calib
    )
    assert_npu_form(onnx.load(out))
    drop = top1(str(model), x, y) - top1(str(out), x, y)
    assert drop <= 0.025, f"top-1 drop {100 * drop:.1f} points"  # AMD Quark XINT8: 3.8


def test_model_without_quantizable_op_is_an_error_and_writes_nothing(tmp_path):
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])
    proto = make_model([onnx.helper.make_node("Sigmoid", ["x"], ["y"], name="s")], [x], [y])
    src = tmp_path / "m.onnx"
    src.write_bytes(proto.SerializeToString())
    qc = get_default_config("XINT8")
    qc.extra_options["ConvertSigmoidToHardSigmoid"] = False
    with pytest.raises(QuantizationError, match="no node can be quantized"):
        ModelQuantizer(Config(global_quant_config=qc)).quantize_model(
            str(src), str(tmp_path / "out.onnx"), ArrayDataReader({"x": np.ones((2, 4), "f")})
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


@pytest.mark.real_model
@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet50", "shufflenet", "squeezenet", "inception_v1"])
def test_zoo_light_models_quantize_ready(name, tmp_path):
    from test_pipeline import _zoo_with_random_weights

    src = tmp_path / f"{name}.onnx"
    proto = _zoo_with_random_weights(name)
    del proto.graph.output[1:]  # the helper exposes the Softmax input for its own comparison
    src.write_bytes(proto.SerializeToString())
    qc = get_default_config("XINT8")
    qc.extra_options.update(UseRandomData=True, RandomDataSamples=4)
    out = tmp_path / f"{name}.xint8.onnx"
    ModelQuantizer(Config(global_quant_config=qc)).quantize_model(str(src), str(out))
    verdict = check(str(out))
    # ready: every finding left is an op that runs on the CPU, named with its node
    assert verdict.ready, verdict.summary()
    for finding in verdict.warnings:
        assert finding.rule == "unsupported_op" and finding.node


def test_the_ir_does_not_import_sympy_and_quantization_never_imports_torch(tmp_path):
    # onnx-ir from 0.2 on imports sympy at import time (34 MB resident): the pin keeps it out.
    # (onnxsim imports sympy when it happens to be installed; no dependency of ours installs it.)
    import subprocess
    import sys

    code = f"""
import sys
import numpy as np
import onnx_ir
import quark_onnx.pipeline.quantizer
print("sympy" in sys.modules)
from onnx import TensorProto, helper, numpy_helper, save
from quark_onnx import ArrayDataReader, Config, ModelQuantizer, get_default_config
w = numpy_helper.from_array(np.ones((4, 3, 3, 3), np.float32) / 9, "w")
conv = helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])
graph = helper.make_graph(
    [conv], "g",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], [w])
opset = [helper.make_opsetid("", 17)]
save(helper.make_model(graph, opset_imports=opset, ir_version=8), r"{tmp_path}/m.onnx")
data = ArrayDataReader({{"x": np.random.default_rng(0).random((4, 3, 8, 8), np.float32)}})
q = ModelQuantizer(Config(global_quant_config=get_default_config("XINT8")))
q.quantize_model(r"{tmp_path}/m.onnx", r"{tmp_path}/q.onnx", data)
print("torch" in sys.modules, len(q.report.timings) > 0)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "True"]


def test_outputs_clipped_by_npu_rules_are_reported(tmp_path):
    rng = np.random.default_rng(4)
    x = rng.normal(0, 1.0, (16, 1, 4, 4, 4)).astype(np.float32)
    # one position for the Concat and the NPU's HardSigmoid output floor (position >= 7, range
    # +-0.99) force the box offsets far below their range
    model = box_and_score_model("HardSigmoid", alpha=1 / 6)
    quantizer = ModelQuantizer(Config(global_quant_config=get_default_config("XINT8")))
    quantizer.quantize_model(model, None, ArrayDataReader([{"x": s} for s in x]))
    clipped = {c["tensor"]: c for c in quantizer.report.range_clips}
    assert "y" in clipped and clipped["y"]["position"] >= 7
    assert clipped["y"]["max_abs"] > 2 * clipped["y"]["range_kept"]
    assert "range clipped" in quantizer.report.summary()


def test_graph_output_range_is_kept_when_no_rule_forces_a_clip():
    """Without the HardSigmoid floor the output's group starts no higher than its NonOverflow
    position + 1, however the error curves weigh the members."""
    model = box_and_score_model("HardSigmoid", alpha=1 / 6)
    model.graph.node[2].op_type = "Sigmoid"
    del model.graph.node[2].attribute[:]
    rng = np.random.default_rng(4)
    x = rng.normal(0, 1.0, (16, 1, 4, 4, 4)).astype(np.float32)
    config = get_default_config("XINT8")
    config.extra_options["ConvertSigmoidToHardSigmoid"] = False
    quantizer = ModelQuantizer(Config(global_quant_config=config))
    quantizer.quantize_model(model, None, ArrayDataReader([{"x": s} for s in x]))
    assert quantizer.report.range_clips == []
    peak = max(
        float(np.abs(run).max())
        for run in (
            ort.InferenceSession(model.SerializeToString()).run(None, {"x": s})[0] for s in x
        )
    )
    assert 127 * 2.0 ** -quantizer.report.positions["y"] >= peak / 2


def test_random_calibration_keeps_samples_for_bias_correction(tmp_path):
    # the random reader is built once and its samples kept: bias correction runs on them
    qc = get_default_config("XINT8")
    qc.extra_options.update(UseRandomData=True, RandomDataSamples=8)
    quantizer = ModelQuantizer(Config(global_quant_config=qc))
    quantizer.quantize_model(shared_path("models", "digits_cnn.onnx"), tmp_path / "q.onnx")
    corrected = quantizer.report.bias_correction
    assert corrected["samples"] == 8
    assert corrected["layers"] > 0 and corrected["changed_channels"] > 0


def test_random_calibration_reads_every_sample_asked_for(tmp_path, monkeypatch):
    # a reader of known length is not capped at the default for readers of unknown length
    from quark_onnx.calibration import readers

    monkeypatch.setattr(readers, "DEFAULT_MAX_FEEDS", 5)
    w = np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32)
    model = make_model(
        [onnx.helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])],
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3, 8, 8])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4, 8, 8])],
        {"w": w},
    )
    qc = get_default_config("XINT8")
    qc.extra_options.update(UseRandomData=True, RandomDataSamples=12)
    quantizer = ModelQuantizer(Config(global_quant_config=qc))
    quantizer.quantize_model(model, tmp_path / "q.onnx")
    assert quantizer.report.calibration["samples"] == 12


def test_no_working_graph_is_alive_when_the_check_reads_the_written_model(tmp_path, monkeypatch):
    """The working onnx_ir graph is the largest thing held per node (tens of KB per node):
    nothing the quantizer keeps may reach it once the written model exists, or the check and
    the save hold two forms of a long model at once."""
    import gc

    import onnx_ir as ir

    import quark_onnx.npu.readiness

    def graphs() -> int:
        gc.collect()
        return sum(isinstance(o, ir.Graph) for o in gc.get_objects())

    alive: list[int] = []
    real_check = quark_onnx.npu.readiness.check

    def counting_check(model, **options):
        alive.append(graphs())
        return real_check(model, **options)

    monkeypatch.setattr(quark_onnx.npu.readiness, "check", counting_check)
    before = graphs()  # other tests' graphs still alive in this process are not ours
    quantizer = ModelQuantizer(Config(global_quant_config=get_default_config("XINT8")))
    quantizer.quantize_model(
        shared_path("models", "digits_cnn.onnx"),
        tmp_path / "q.onnx",
        calibration_data_path=shared_path("models", "digits_calib.npz"),
        progress=False,
    )
    assert alive == [before]


def test_auto_pad_convs_of_a_dynamic_model_get_explicit_pads_once_shapes_are_fixed(tmp_path):
    """A dynamic-shape model's ``auto_pad`` Conv cannot get explicit pads before calibration
    (the shapes are unknown); with FixShapes the written model has them (the Vitis AI EP rejects
    a Conv relying on defaults) and computes what it computed before."""
    rng = np.random.default_rng(6)
    same = {"kernel_shape": [3, 3], "auto_pad": "SAME_UPPER"}
    model = make_model(
        [
            onnx.helper.make_node("Conv", ["x", "w1", "b1"], ["c"], **same),
            onnx.helper.make_node("Relu", ["c"], ["r"]),
            onnx.helper.make_node("Conv", ["r", "w2"], ["y"], strides=[2, 2], **same),
        ],
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["n", 3, "h", "w"])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["n", 2, "h2", "w2"])],
        {
            "w1": rng.normal(0, 0.3, (4, 3, 3, 3)).astype(np.float32),
            "b1": rng.normal(0, 0.1, 4).astype(np.float32),
            "w2": rng.normal(0, 0.3, (2, 4, 3, 3)).astype(np.float32),
        },
    )
    x = rng.normal(0, 1, (8, 3, 9, 9)).astype(np.float32)
    qc = get_default_config("XINT8")
    qc.extra_options["FixShapes"] = "x:[1,3,9,9]"
    out = tmp_path / "q.onnx"
    ModelQuantizer(Config(global_quant_config=qc)).quantize_model(
        model, str(out), ArrayDataReader({"x": x})
    )
    written = onnx.load(out)
    convs = [n for n in written.graph.node if n.op_type == "Conv"]
    assert len(convs) == 2
    for conv in convs:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in conv.attribute}
        assert attrs.get("auto_pad", b"NOTSET") in (b"NOTSET", "NOTSET")
        assert attrs["pads"] == [1, 1, 1, 1]  # SAME_UPPER, 3x3 on 9x9 (stride 1 and 2)
    assert not [f for f in check(str(out)).errors if f.rule == "conv_default_attributes"]
    # the explicit pads compute what auto_pad computed: the same quantized model, run both ways
    relaxed = onnx.load(out)
    for node in relaxed.graph.node:
        if node.op_type == "Conv":
            kept = [a for a in node.attribute if a.name != "pads"]
            del node.attribute[:]
            node.attribute.extend([*kept, onnx.helper.make_attribute("auto_pad", "SAME_UPPER")])
    feed = {"x": x[:1]}
    a = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, feed)[0]
    b = ort.InferenceSession(relaxed.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, feed
    )[0]
    np.testing.assert_array_equal(a, b)


def _gelu_model() -> onnx.ModelProto:
    """Conv -> GELU as torch and paddle export it, ``x * (Erf(x / sqrt 2) + 1) * 0.5`` -> Conv."""
    rng = np.random.default_rng(0)
    nodes = [
        onnx.helper.make_node("Conv", ["x", "w1", "b1"], ["x1"], pads=[1] * 4),
        onnx.helper.make_node("Div", ["x1", "sqrt2"], ["t"]),
        onnx.helper.make_node("Erf", ["t"], ["e"]),
        onnx.helper.make_node("Add", ["e", "one"], ["g"]),
        onnx.helper.make_node("Mul", ["x1", "g"], ["m"]),
        onnx.helper.make_node("Mul", ["m", "half"], ["a"]),
        onnx.helper.make_node("Conv", ["a", "w2"], ["y"]),
    ]
    consts = {"sqrt2": np.sqrt(2.0), "one": 1.0, "half": 0.5}
    return make_model(
        nodes,
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3, 8, 8])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4, 8, 8])],
        {
            "w1": rng.normal(0, 0.5, (8, 3, 3, 3)).astype(np.float32),
            "b1": rng.normal(0, 0.2, 8).astype(np.float32),
            "w2": rng.normal(0, 0.5, (4, 8, 1, 1)).astype(np.float32),
            **{k: np.array(v, np.float32) for k, v in consts.items()},
        },
    )


def test_xint8_gelu_quantizes_the_erf_and_is_vitis_ai_ready(tmp_path):
    # XINT8 leaves GELU's Div float; with the Erf after it unquantized nothing quantized the
    # Div's output, and check reported one-sided Q/DQ on the Div and the Erf
    x = np.random.default_rng(1).normal(0, 1, (8, 3, 8, 8)).astype(np.float32)
    out = tmp_path / "q.onnx"
    quantize_xint8_and_check(_gelu_model(), x, out)
    written = onnx.load(out)
    (erf,) = [n for n in written.graph.node if n.op_type == "Erf"]
    producers = {o: n.op_type for n in written.graph.node for o in n.output}
    assert producers[erf.input[0]] == "DequantizeLinear"
    readers = [n.op_type for n in written.graph.node if erf.output[0] in n.input]
    assert readers == ["QuantizeLinear"]
