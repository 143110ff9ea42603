"""Mask-like tensors: recognised from the graph, never quantized, and a bound that fails loudly."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from encoder_fixtures import SMALL, build_encoder, embedding_cosines, encoder_inputs
from onnx import TensorProto, helper, numpy_helper

from quark_onnx import ArrayDataReader, Config, ModelQuantizer, get_default_config
from quark_onnx.errors import QuantizationError
from quark_onnx.model_files.load import to_ir
from quark_onnx.plan.build import build_plan
from quark_onnx.plan.masks import FILL_MAGNITUDE, MAX_ACTIVATION_ABS, find_saturating

STATIC = ["A8W8", "A16W8", "U8S8", "FP8_E4M3", "BF16", "FP16"]


@pytest.fixture(scope="module", params=["mul", "where"])
def encoder(request):
    model = build_encoder(SMALL, seed=3, mask_style=request.param)
    return model, encoder_inputs(16, 1, SMALL), encoder_inputs(24, 2, SMALL)


def test_the_mask_and_the_masked_scores_are_recognised(encoder):
    model, _, _ = encoder
    found = find_saturating(to_ir(model).graph)
    maker = "mask/Mul" if "mask/Mul" in found else "mask/Where"
    adds = {f"encoder/layer.{i}/attention/Add" for i in range(SMALL.layers)}
    assert set(found) == {maker, "mask/min", *adds}
    # the scores before the mask and the Softmax output are ordinary activations
    assert "encoder/layer.0/attention/Div" not in found
    assert "encoder/layer.0/attention/Softmax" not in found


def test_large_divisors_and_ordinary_models_are_not_masks():
    f = TensorProto.FLOAT
    nodes = [
        helper.make_node("Div", ["x", "big"], ["d"], name="div"),
        helper.make_node("Mul", ["d", "small"], ["y"], name="mul"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", f, [2, 4])],
        [helper.make_tensor_value_info("y", f, [2, 4])],
        [
            numpy_helper.from_array(np.array(FILL_MAGNITUDE * 10, np.float32), "big"),
            numpy_helper.from_array(np.array(3.0, np.float32), "small"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert find_saturating(to_ir(model).graph) == {}


@pytest.mark.parametrize("preset", STATIC)
def test_no_mask_like_tensor_gets_a_scale(encoder, preset):
    model, calib, test = encoder
    qc = get_default_config(preset)
    quantizer = ModelQuantizer(Config(global_quant_config=qc))
    quantized = quantizer.quantize_model(model, None, ArrayDataReader(calib, batch_size=4))
    masks = set(find_saturating(to_ir(model).graph))
    inits = {i.name: numpy_helper.to_array(i) for i in quantized.graph.initializer}
    checked = 0
    for node in quantized.graph.node:
        if node.op_type in ("QuantizeLinear", "Cast") and node.input[0] in masks:
            pytest.fail(f"{preset}: mask-like {node.input[0]} is quantized by {node.name}")
        if node.op_type == "QuantizeLinear" and node.input[1] in inits:
            scale = inits[node.input[1]].astype(np.float64)
            zero = inits[node.input[2]]
            info = np.iinfo(zero.dtype) if zero.dtype.kind in "iu" else None
            qmax = 448.0 if info is None else float(info.max - info.min) / 2
            assert np.all(scale * qmax <= MAX_ACTIVATION_ABS), (preset, node.input[0])
            checked += 1
    assert checked or preset in ("BF16", "FP16")
    assert quantizer.report.plan["mask_like"] == len(masks)
    # and attention still works: padded keys keep weight 0
    assert embedding_cosines(model, quantized, test).min() > 0.97, preset


def test_an_unrecognised_fill_is_refused_not_quantized():
    """A mask fed as a float graph input (no fill constant in the graph): the calibrated range
    reaches finfo.min and quantizing it is an error naming the tensor."""
    f = TensorProto.FLOAT
    nodes = [
        helper.make_node("Add", ["scores", "mask"], ["masked"], name="add"),
        helper.make_node("Softmax", ["masked"], ["probs"], name="softmax", axis=-1),
        helper.make_node("Mul", ["probs", "v"], ["y"], name="mul"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("scores", f, ["n", 8]),
            helper.make_tensor_value_info("mask", f, ["n", 8]),
            helper.make_tensor_value_info("v", f, ["n", 8]),
        ],
        [helper.make_tensor_value_info("y", f, ["n", 8])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    rng = np.random.default_rng(0)
    mask = np.zeros((16, 8), np.float32)
    mask[:, 5:] = np.finfo(np.float32).min
    feeds = {"scores": rng.standard_normal((16, 8)).astype(np.float32), "mask": mask}
    feeds["v"] = rng.standard_normal((16, 8)).astype(np.float32)
    assert find_saturating(to_ir(model).graph) == {}
    quantizer = ModelQuantizer(Config(global_quant_config=get_default_config("A16W8")))
    with pytest.raises(QuantizationError, match="'mask'.*nodes_to_exclude"):
        quantizer.quantize_model(model, None, ArrayDataReader(feeds))
    # excluding the nodes that make and read it, as the message says, gives a model
    qc = get_default_config("A16W8")
    qc.nodes_to_exclude = ["add", "softmax"]
    out = ModelQuantizer(Config(global_quant_config=qc)).quantize_model(
        model, None, ArrayDataReader(feeds)
    )
    assert any(n.op_type == "QuantizeLinear" and n.input[0] == "probs" for n in out.graph.node)


def test_plan_lists_the_mask_nodes_as_float_with_the_reason(encoder):
    model, _, _ = encoder
    plan = build_plan(to_ir(model), get_default_config("A16W8"))
    reasons = {f.name: f.reason for f in plan.float_nodes}
    assert "mask-like" in reasons["encoder/layer.0/attention/Add"]
    assert not any(name in plan.tensors for name in plan.saturating)


def test_fill_constant_detection_needs_a_large_value():
    def const(value):
        tensor = numpy_helper.from_array(np.asarray(value, np.float32), "c")
        return onnx.helper.make_model(
            helper.make_graph(
                [helper.make_node("Mul", ["x", "c"], ["y"], name="m")],
                "g",
                [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
                [tensor],
            ),
            opset_imports=[helper.make_opsetid("", 17)],
        )

    assert find_saturating(to_ir(const(-1e4)).graph) != {}
    assert find_saturating(to_ir(const(-np.inf)).graph) != {}
    assert find_saturating(to_ir(const(-9999.0)).graph) == {}


def test_constant_of_shape_and_expanded_fills_are_masks():
    f = TensorProto.FLOAT
    fill = helper.make_tensor("v", f, [1], [float(np.finfo(np.float32).min)])
    nodes = [
        helper.make_node("ConstantOfShape", ["shape"], ["filled"], name="cos", value=fill),
        helper.make_node("Where", ["keep", "x", "filled"], ["a"], name="where"),
        helper.make_node("Expand", ["neg_inf", "shape"], ["causal"], name="expand"),
        helper.make_node("Add", ["a", "causal"], ["y"], name="add"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", f, [2, 4]),
            helper.make_tensor_value_info("keep", TensorProto.BOOL, [2, 4]),
        ],
        [helper.make_tensor_value_info("y", f, [2, 4])],
        [
            numpy_helper.from_array(np.array([2, 4], np.int64), "shape"),
            numpy_helper.from_array(np.array(-np.inf, np.float32), "neg_inf"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    found = find_saturating(to_ir(model).graph)
    assert {"filled", "a", "causal", "y"} <= set(found)
