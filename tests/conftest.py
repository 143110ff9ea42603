"""Shared fixtures: the ../shared folder, tiny-graph builders, an onnxruntime runner."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


def shared_path(*parts: str) -> Path:
    """A path in ../shared; the test is skipped when that folder is not beside the repo."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} not available")
    return path


@pytest.fixture
def shared() -> Path:
    if not SHARED.exists():
        pytest.skip("../shared not available")
    return SHARED


def make_model(nodes, inputs, outputs, initializers=(), opset: int = 17) -> onnx.ModelProto:
    """A checked ModelProto from onnx.helper pieces (initializers may be name -> ndarray)."""
    if isinstance(initializers, dict):
        initializers = [
            onnx.numpy_helper.from_array(np.asarray(v), k) for k, v in initializers.items()
        ]
    graph = onnx.helper.make_graph(
        list(nodes), "test", list(inputs), list(outputs), list(initializers)
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


#: the tensor with one channel 200x the others: per-tensor int8 leaves the others ~1 level
OUTLIER = "t1"


def outlier_channel_model(outlier: float = 200.0) -> onnx.ModelProto:
    """x -> Conv 3x3 -> Relu -> Conv 1x1 -> t1 (channel 0 x200) -> Conv 1x1 (reads channel 0
    at 1/200) -> Relu -> Conv 1x1 -> y. The output depends on t1's small channels, which an int8
    grid spanning channel 0 cannot hold."""
    rng = np.random.default_rng(7)
    w1 = rng.normal(0, 0.5, (4, 4, 1, 1)).astype(np.float32)
    w1[0] *= outlier
    w2 = rng.normal(0, 0.5, (4, 4, 1, 1)).astype(np.float32)
    w2[:, 0] /= outlier
    nodes = [
        onnx.helper.make_node("Conv", ["x", "w0", "b0"], ["c0"], name="conv0", kernel_shape=[3, 3],
                    pads=[1, 1, 1, 1]),
        onnx.helper.make_node("Relu", ["c0"], ["r0"], name="relu0"),
        onnx.helper.make_node("Conv", ["r0", "w1"], [OUTLIER], name="conv1", kernel_shape=[1, 1]),
        onnx.helper.make_node("Conv", [OUTLIER, "w2"], ["c2"], name="conv2", kernel_shape=[1, 1]),
        onnx.helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        onnx.helper.make_node("Conv", ["r2", "w3"], ["y"], name="conv3", kernel_shape=[1, 1]),
    ]  # fmt: skip
    return make_model(
        nodes,
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 1, 8, 8])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 2, 8, 8])],
        {
            "w0": rng.normal(0, 0.5, (4, 1, 3, 3)).astype(np.float32),
            "b0": rng.normal(0, 0.1, 4).astype(np.float32),
            "w1": w1,
            "w2": w2,
            "w3": rng.normal(0, 0.5, (2, 4, 1, 1)).astype(np.float32),
        },
    )


def conv_relu_conv_model() -> onnx.ModelProto:
    """Conv -> Relu -> Conv on a 1x3x8x8 input ``x`` (output ``y``), seeded weights."""
    rng = np.random.default_rng(0)
    conv = dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    return make_model(
        [
            onnx.helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", **conv),
            onnx.helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
            onnx.helper.make_node("Conv", ["r1", "w2", "b2"], ["y"], name="conv2", **conv),
        ],
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 3, 8, 8])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4, 8, 8])],
        {
            "w1": rng.standard_normal((6, 3, 3, 3)).astype(np.float32),
            "b1": rng.standard_normal(6).astype(np.float32),
            "w2": rng.standard_normal((4, 6, 3, 3)).astype(np.float32),
            "b2": rng.standard_normal(4).astype(np.float32),
        },
    )


def run_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """All outputs of ``model`` on ``feeds`` with graph optimizations off (exact reference)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return session.run(None, feeds)


def quantize_xint8_and_check(model: onnx.ModelProto, x: np.ndarray, out: Path, **fields):
    """Quantize ``model`` (input ``x``, samples on axis 0) with the XINT8 preset, its fields set
    from ``fields``, to ``out``; the readiness verdict of the written model, asserted ready."""
    from quark_onnx import ArrayDataReader, Config, ModelQuantizer, get_default_config
    from quark_onnx.npu.readiness import check

    config = get_default_config("XINT8")
    for name, value in fields.items():
        setattr(config, name, value)
    ModelQuantizer(Config(global_quant_config=config)).quantize_model(
        model, str(out), ArrayDataReader({model.graph.input[0].name: x})
    )
    verdict = check(str(out))
    assert verdict.ready, [f.message for f in verdict.errors]
    return verdict


def box_and_score_model(gate: str, **gate_attrs) -> onnx.ModelProto:
    """Concat(box offsets in about +-4, ``gate(logit)`` scores in [0, 1]) -> the graph output:
    two differently ranged tensors that the NPU's Concat rule puts at one position."""
    rng = np.random.default_rng(3)
    conv = {"kernel_shape": [1, 1], "pads": [0, 0, 0, 0], "strides": [1, 1], "dilations": [1, 1]}
    nodes = [
        onnx.helper.make_node("Conv", ["x", "wb"], ["box"], name="box", group=1, **conv),
        onnx.helper.make_node("Conv", ["x", "ws"], ["logit"], name="score", group=1, **conv),
        onnx.helper.make_node(gate, ["logit"], ["prob"], name="gate", **gate_attrs),
        onnx.helper.make_node("Concat", ["box", "prob"], ["y"], name="cat", axis=1),
    ]
    return make_model(
        nodes,
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4, 4, 4])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 3, 4, 4])],
        {
            "wb": rng.normal(0, 1.0, (2, 4, 1, 1)).astype(np.float32),
            "ws": rng.normal(0, 1.0, (1, 4, 1, 1)).astype(np.float32),
        },
    )


#: The extra options of the Vitis AI documentation's XINT8 example (``UseRandomData`` aside, which
#: each test sets as it needs).
SNIPPET_OPTIONS = {
    "ConvertBNToConv": True,
    "ConvertSigmoidToHardSigmoid": False,
    "ConvertClipToRelu": True,
    "SplitLargeKernelPool": False,
    "ReplaceClip6Relu": True,
    "ConvertReduceMeanToGlobalAvgPool": False,
    "RemoveQDQConvClip": False,
    "RemoveQDQConvPRelu": False,
    "RemoveQDQConvRelu": False,
    "RemoveQDQConvLeakyRelu": False,
}
