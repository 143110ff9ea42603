"""The inputs of order-deciding ops (Softmax, ArgMax, TopK) are never clipped by their position."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from quark_onnx import ArrayDataReader, Config, ModelQuantizer, get_default_config
from quark_onnx.params import pof2
from quark_onnx.params.pof2_params import order_decided
from quark_onnx.plan.types import TensorKind

CLASSES = 64


def classifier(head: str, pool_weights: np.ndarray | None = None) -> onnx.ModelProto:
    """x[1,8,4,4] -> 1x1 Conv (signed) -> Relu -> pool -> Flatten -> ``head`` -> y.

    ``pool_weights``: a depthwise Conv as the pool (the NPU's rewrite of GlobalAveragePool)
    instead of GlobalAveragePool."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((CLASSES, 8, 1, 1)).astype(np.float32)
    inits = [onnx.numpy_helper.from_array(w, "w")]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
    ]
    if pool_weights is None:
        nodes.append(helper.make_node("GlobalAveragePool", ["r"], ["p"], name="pool"))
    else:
        inits.append(onnx.numpy_helper.from_array(pool_weights, "pw"))
        nodes.append(helper.make_node("Conv", ["r", "pw"], ["p"], name="pool", group=CLASSES))
    nodes.append(helper.make_node("Flatten", ["p"], ["f"], name="flatten"))
    nodes.append(helper.make_node(head, ["f"], ["y"], name="head"))
    graph = helper.make_graph(
        nodes,
        "classifier",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, CLASSES])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def planned(model: ir.Model) -> SimpleNamespace:
    """A plan stand-in: every float value of the graph is a planned activation."""
    names = [v.name for n in model.graph for v in n.outputs] + ["x"]
    return SimpleNamespace(tensors={n: SimpleNamespace(kind=TensorKind.ACTIVATION) for n in names})


def test_the_walk_goes_back_through_pool_and_layout_to_the_first_signed_conv():
    model = ir.from_proto(classifier("Softmax"))
    assert order_decided(model, planned(model)) == {"f", "p", "r", "c"}


def test_a_depthwise_conv_with_non_negative_weights_is_a_pool():
    mean = np.full((CLASSES, 1, 4, 4), 1 / 16, np.float32)
    model = ir.from_proto(classifier("Softmax", mean))
    assert order_decided(model, planned(model)) == {"f", "p", "r", "c"}
    signed = mean.copy()
    signed[3, 0, 0, 0] = -0.5  # no longer non-decreasing in its input: the walk stops there
    model = ir.from_proto(classifier("Softmax", signed))
    assert order_decided(model, planned(model)) == {"f", "p"}


@pytest.mark.parametrize("head", ["Sigmoid", "Relu", "Identity"])
def test_must_not_fire_without_an_order_deciding_op(head):
    model = ir.from_proto(classifier(head))
    assert order_decided(model, planned(model)) == set()


def peaked_samples(n: int = 48) -> np.ndarray:
    """Inputs of which every 16th is half again as large (a confident image): MinMSE over every
    logit trades those few top values for resolution on the many others."""
    rng = np.random.default_rng(1)
    x = np.abs(rng.standard_normal((n, 8, 4, 4)).astype(np.float32)) * 4.0
    x[::16] *= 1.5
    return x


def logits_position(head: str) -> tuple[int, int]:
    """(position the quantizer chose for the Softmax input ``f``, its NonOverflow position)."""
    proto = classifier(head)
    x = peaked_samples()
    probe = onnx.ModelProto()
    probe.CopyFrom(proto)
    probe.graph.output.append(helper.make_tensor_value_info("f", TensorProto.FLOAT, None))
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    peak = max(float(np.abs(session.run(["f"], {"x": s[None]})[0]).max()) for s in x)
    qc = get_default_config("XINT8")
    qc.include_bias_correction = False
    quantizer = ModelQuantizer(Config(global_quant_config=qc))
    quantizer.quantize_model(proto, None, ArrayDataReader({"x": x}, batch_size=1))
    return quantizer.report.positions["f"], pof2.position_for_abs_max(peak)


def test_softmax_logits_keep_their_calibrated_peak():
    chosen, nonoverflow = logits_position("Softmax")
    assert chosen <= nonoverflow


def test_without_the_softmax_the_same_logits_are_clipped():
    """The rule is what keeps the peak: the same tensor feeding a Sigmoid is clipped by MinMSE."""
    chosen, nonoverflow = logits_position("Sigmoid")
    assert chosen > nonoverflow
