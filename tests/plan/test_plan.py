"""build_plan on tiny graphs: specs, groups, fusion, float reasons, range caps."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import make_model
from onnx import TensorProto, helper

from quark_onnx.config.enums import QuantType
from quark_onnx.config.quantization import QuantizationConfig
from quark_onnx.graph.ir import RANGE_MAX_KEY
from quark_onnx.plan.build import build_plan
from quark_onnx.plan.types import TensorKind

F = TensorProto.FLOAT
RNG = np.random.default_rng(0)


def vi(name, shape):
    return helper.make_tensor_value_info(name, F, shape)


def xint8(**extra) -> QuantizationConfig:
    qc = QuantizationConfig()
    qc.calibrate_method = "NonOverflow"
    qc.enable_npu_cnn = True
    qc.extra_options.update(extra)
    return qc


def conv_relu_model(act="Relu") -> ir.Model:
    w = RNG.normal(size=(4, 3, 3, 3)).astype(np.float32)
    b = RNG.normal(size=(4,)).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "W", "B"], ["c"], name="conv", kernel_shape=[3, 3]),
        helper.make_node(act, ["c"], ["r"], name="act"),
        helper.make_node("MaxPool", ["r"], ["m"], name="pool", kernel_shape=[2, 2]),
        helper.make_node("Sigmoid", ["m"], ["y"], name="sig"),
    ]
    proto = make_model(nodes, [vi("x", [1, 3, 8, 8])], [vi("y", [1, 4, 3, 3])], {"W": w, "B": b})
    return ir.serde.deserialize_model(proto)


def test_specs_kinds_and_order():
    plan = build_plan(conv_relu_model(), xint8())
    assert list(plan.tensors) == ["x", "W", "B", "c", "r", "m"]
    kinds = {n: s.kind for n, s in plan.tensors.items()}
    assert kinds["W"] is TensorKind.WEIGHT and kinds["B"] is TensorKind.BIAS
    assert plan.activation_names() == ["x", "c", "r", "m"]
    spec = plan.tensors["x"]
    assert spec.qtype is QuantType.QInt8 and spec.symmetric and spec.power_of_two
    assert spec.is_graph_input and not spec.per_channel
    assert plan.tensors["B"].qtype is QuantType.QInt8
    assert [(f.name, f.reason) for f in plan.float_nodes] == [
        ("sig", "no quantization policy for op type Sigmoid")
    ]
    # MaxPool in = out; the Q/DQ kept before the Relu takes the Relu output's position
    assert plan.groups() == [("c", "r", "m")]
    assert plan.fused == []


def test_fused_relu_has_no_tensor_and_output_read_after_activation():
    plan = build_plan(conv_relu_model(), xint8(RemoveQDQConvRelu=True))
    assert "c" not in plan.tensors
    conv = plan.nodes[0]
    assert (conv.output, conv.fused_tensor, conv.fused_op) == ("r", "c", "Relu")
    assert [(f.producer, f.activation, f.tensor) for f in plan.fused] == [("conv", "act", "c")]


def test_kept_qdq_before_relu_or_clip_shares_the_activation_position():
    for act in ("Relu", "Clip"):
        plan = build_plan(conv_relu_model(act), xint8())
        (eq,) = [e for e in plan.equalities if e.op_type == act]
        assert eq.tensors == ("c", "r") and eq.option is None


def test_no_shared_position_where_it_would_not_be_exact():
    # LeakyRelu scales negatives: its input's range is not its output's
    plan = build_plan(conv_relu_model("LeakyRelu"), xint8())
    assert not [e for e in plan.equalities if e.op_type == "LeakyRelu"]
    # the pre-activation has a second reader, whose values the Relu does not discard
    proto = ir.serde.serialize_model(conv_relu_model())
    proto.graph.output.append(vi("c", [1, 4, 6, 6]))
    plan = build_plan(ir.serde.deserialize_model(proto), xint8())
    assert not [e for e in plan.equalities if e.op_type == "Relu"]
    # float-scale plans have no positions to share
    qc = QuantizationConfig()
    qc.calibrate_method = "MinMax"
    plan = build_plan(conv_relu_model(), qc)
    assert not [e for e in plan.equalities if e.op_type == "Relu"]


def test_fusion_only_for_the_option_of_that_activation():
    plan = build_plan(conv_relu_model("LeakyRelu"), xint8(RemoveQDQConvRelu=True))
    assert "c" in plan.tensors and not plan.fused
    plan = build_plan(conv_relu_model("LeakyRelu"), xint8(RemoveQDQConvLeakyRelu=True))
    assert "c" not in plan.tensors and plan.nodes[0].before_leaky_relu


def test_int32_bias_and_uint8_activations():
    qc = xint8(Int32Bias=True)
    qc.activation_type = QuantType.QUInt8
    plan = build_plan(conv_relu_model(), qc)
    assert plan.tensors["B"].qtype is QuantType.QInt32
    assert plan.tensors["x"].qtype is QuantType.QUInt8
    assert plan.tensors["W"].qtype is QuantType.QInt8


def test_bias_left_float_without_quantize_bias():
    plan = build_plan(conv_relu_model(), xint8(QuantizeBias=False))
    assert "B" not in plan.tensors and plan.nodes[0].bias is None


def test_excluded_and_selected_nodes():
    qc = xint8()
    qc.nodes_to_exclude = ["pool"]
    plan = build_plan(conv_relu_model(), qc)
    reasons = {f.name: f.reason for f in plan.float_nodes}
    assert reasons["pool"] == "excluded by nodes_to_exclude"
    assert "m" not in plan.tensors  # only produced by a float node and read by a float node
    qc = xint8()
    qc.op_types_to_quantize = ["Conv"]
    plan = build_plan(conv_relu_model(), qc)
    assert [n.name for n in plan.nodes] == ["conv"]
    reasons = {f.name: f.reason for f in plan.float_nodes}
    assert reasons["act"] == "op type not in op_types_to_quantize"


def concat_model() -> ir.Model:
    nodes = [
        helper.make_node("Relu", ["a"], ["ra"], name="r1"),
        helper.make_node("Relu", ["b"], ["rb"], name="r2"),
        helper.make_node("Concat", ["ra", "rb"], ["cat"], name="cat", axis=1),
        helper.make_node("Reshape", ["cat", "shape"], ["flat"], name="reshape"),
        helper.make_node("Custom", ["flat"], ["y"], name="custom", domain="com.example"),
    ]
    shape = onnx.numpy_helper.from_array(np.array([4], dtype=np.int64), "shape")
    graph = helper.make_graph(
        nodes, "g", [vi("a", [1, 2]), vi("b", [1, 2])], [vi("y", [4])], [shape]
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.example", 1)]
    return ir.serde.deserialize_model(helper.make_model(graph, opset_imports=opsets))


def test_concat_and_reshape_share_one_group_and_custom_domain_stays_float():
    plan = build_plan(concat_model(), xint8())
    # each Relu's input is read by the Relu only: it takes the Relu output's position
    assert plan.groups() == [("a", "ra", "b", "rb", "cat", "flat")]
    assert "shape" not in plan.tensors
    assert {f.name: f.reason for f in plan.float_nodes}["custom"] == "custom domain 'com.example'"
    # AlignConcat off: the Concat equality is dropped, Reshape's stays
    from quark_onnx.config.options import resolve_extra_options

    assert plan.groups(resolve_extra_options({"AlignConcat": False})) == [
        ("a", "ra"),
        ("b", "rb"),
        ("cat", "flat"),
    ]


def test_range_cap_from_value_metadata():
    model = conv_relu_model()
    relu_out = next(n for n in model.graph if n.name == "act").outputs[0]
    relu_out.metadata_props[RANGE_MAX_KEY] = "6.0"
    plan = build_plan(model, xint8())
    assert plan.range_caps == {"r": 6.0}
    assert plan.tensors["r"].range_max == 6.0


def test_subgraph_nodes_are_reported():
    then = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["t"], name="inner_relu")], "then", [], [vi("t", [1])]
    )
    other = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["e"], name="inner_neg")], "else", [], [vi("e", [1])]
    )
    nodes = [
        helper.make_node("If", ["cond"], ["y"], name="if", then_branch=then, else_branch=other)
    ]
    proto = make_model(
        nodes, [helper.make_tensor_value_info("cond", TensorProto.BOOL, []), vi("x", [1])],
        [vi("y", [1])],
    )  # fmt: skip
    plan = build_plan(ir.serde.deserialize_model(proto), xint8())
    reasons = {f.name: f.reason for f in plan.float_nodes}
    assert reasons["inner_relu"] == "inside a subgraph"
    assert reasons["if"].startswith("no quantization policy")


def test_dpu_scale_mul_is_fused_into_the_pool():
    nodes = [
        helper.make_node("GlobalAveragePool", ["x"], ["g"], name="gap"),
        helper.make_node("Mul", ["g", "c"], ["y"], name="gap_dpu_scale"),
    ]
    proto = make_model(
        nodes, [vi("x", [1, 2, 7, 7])], [vi("y", [1, 2, 1, 1])],
        {"c": np.array(1.0048828125, dtype=np.float32)},
    )  # fmt: skip
    plan = build_plan(ir.serde.deserialize_model(proto), xint8())
    assert list(plan.tensors) == ["x", "c", "y"]  # no pair on g; the factor is an int8 weight
    assert plan.tensors["c"].kind is TensorKind.WEIGHT
    assert plan.groups() == [("x", "y")]  # AlignPool: pool input = output (read after the Mul)
    assert plan.nodes[0].fused_op == "Mul"


@pytest.mark.parametrize("const_first", [False, True])
def test_constant_operand_of_add_is_a_weight(const_first):
    ins = ["k", "x"] if const_first else ["x", "k"]
    proto = make_model(
        [helper.make_node("Add", ins, ["y"], name="add")],
        [vi("x", [1, 3])], [vi("y", [1, 3])], {"k": np.ones((1, 3), np.float32)},
    )  # fmt: skip
    plan = build_plan(ir.serde.deserialize_model(proto), xint8())
    assert plan.tensors["k"].kind is TensorKind.WEIGHT
    assert set(plan.nodes[0].activation_inputs) == {"x", "k"}
    assert plan.tensors["y"].is_graph_output
