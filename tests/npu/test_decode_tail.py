"""Heterogeneous joins (quark_onnx.npu.decode_tail): a Concat of box offsets and scores whose
ranges int8 cannot hold at one position keeps its decode tail float on the CPU; a join int8 can
hold, and a join inside the network, are left as planned; the checker accepts the tail."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from conftest import make_model
from onnx import TensorProto, helper

from quark_onnx import ArrayDataReader, Config, ModelQuantizer, get_default_config
from quark_onnx.config.quantization import QuantizationConfig
from quark_onnx.npu.decode_tail import (
    SIGNIFICANT_BITS,
    decode_tail,
    heterogeneous_joins,
    split_heterogeneous_joins,
)
from quark_onnx.npu.placement import cpu_tail_nodes
from quark_onnx.npu.readiness import check
from quark_onnx.params.pof2 import position_for_abs_max
from quark_onnx.plan.build import build_plan

F = TensorProto.FLOAT
CONV = {"kernel_shape": [1, 1], "pads": [0, 0, 0, 0], "strides": [1, 1], "dilations": [1, 1]}


def _model(box_scale: float, internal: bool = False) -> onnx.ModelProto:
    """conv0 -> Relu -> {box conv (times ``box_scale``), score conv -> Sigmoid} -> Concat ``y``
    (then, with ``internal``, a 1x1 Conv reads the Concat: a join inside the network)."""
    rng = np.random.default_rng(3)
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["h"], name="conv0", group=1, **CONV),
        helper.make_node("Relu", ["h"], ["hr"], name="relu0"),
        helper.make_node("Conv", ["hr", "wb"], ["box"], name="box", group=1, **CONV),
        helper.make_node("Conv", ["hr", "ws"], ["logit"], name="score", group=1, **CONV),
        helper.make_node("Sigmoid", ["logit"], ["prob"], name="gate"),
        helper.make_node("Concat", ["box", "prob"], ["cat"], name="cat", axis=1),
    ]
    init = {
        "w0": rng.normal(0, 1.0, (4, 4, 1, 1)).astype(np.float32),
        "wb": (rng.normal(0, 1.0, (2, 4, 1, 1)) * box_scale).astype(np.float32),
        "ws": rng.normal(0, 1.0, (1, 4, 1, 1)).astype(np.float32),
    }
    channels = 3
    if internal:
        init["w1"] = rng.normal(0, 1.0, (3, 3, 1, 1)).astype(np.float32)
        nodes.append(helper.make_node("Conv", ["cat", "w1"], ["y"], name="conv1", group=1, **CONV))
    else:
        nodes.append(helper.make_node("Identity", ["cat"], ["y"], name="out"))
    return make_model(
        nodes,
        [helper.make_tensor_value_info("x", F, [1, 4, 4, 4])],
        [helper.make_tensor_value_info("y", F, [1, channels, 4, 4])],
        init,
    )


def _samples() -> np.ndarray:
    return np.random.default_rng(4).normal(0, 1.0, (16, 4, 4, 4)).astype(np.float32)


def _xint8() -> QuantizationConfig:
    qc = QuantizationConfig()
    qc.calibrate_method = "NonOverflow"
    qc.enable_npu_cnn = True
    return qc


def _ranges(box_max: float, prob_max: float = 0.99) -> dict[str, tuple[float, int]]:
    peaks = {"x": 3.0, "h": 4.0, "hr": 4.0, "box": box_max, "logit": 6.0, "prob": prob_max}
    peaks["cat"] = max(box_max, prob_max)
    return {name: (peak, position_for_abs_max(peak)) for name, peak in peaks.items()}


@pytest.mark.parametrize(
    "box_max,fires",
    [
        (300.0, True),  # position -2 against 7: the scores keep no bit
        (4.5, True),  # position 4 against 7: 3 bits lost, 5 kept
        (3.9, False),  # position 5 against 7: 6 bits kept
        (1.9, False),  # position 6 against 7: 7 bits kept
    ],
)
def test_criterion_bits_kept(box_max, fires):
    plan = build_plan(ir.serde.deserialize_model(_model(1.0)), _xint8())
    ranges = _ranges(box_max)
    joins = heterogeneous_joins(plan, ranges)
    lost = ranges["prob"][1] - ranges["box"][1]
    assert (8 - lost < SIGNIFICANT_BITS) == fires
    assert bool(joins) == fires
    if fires:
        (join,) = joins
        assert (join.node, join.widest, join.narrowest) == ("cat", "box", "prob")
        assert join.bits_kept == 8 - lost


def test_split_amends_the_plan_and_names_the_join():
    model = ir.serde.deserialize_model(_model(100.0))
    plan = build_plan(model, _xint8())
    made = split_heterogeneous_joins(model, plan, _ranges(300.0), plan.options)
    assert {f.name for f in made} == {"cat"}  # Sigmoid and Identity have no policy: float already
    reasons = {f.name: f.reason for f in plan.float_nodes}
    for name in ("cat", "gate", "out"):
        assert reasons[name].startswith("decode tail on the CPU: join of ranges 2^9 and 2^0")
    assert "Concat 'cat'" in reasons["cat"]
    # each part leaves the NPU at its own position; nothing of the tail is planned
    assert {"box", "logit"} <= set(plan.activation_names())
    assert "cat" not in plan.tensors and "prob" not in plan.tensors
    assert not [e for e in plan.equalities if e.node == "cat"]
    assert "cat" not in {n.name for n in plan.nodes}


def test_split_is_off_with_the_option():
    model = ir.serde.deserialize_model(_model(100.0))
    plan = build_plan(model, _xint8())

    class Off:
        SplitHeterogeneousJoins = False

    assert split_heterogeneous_joins(model, plan, _ranges(300.0), Off()) == []
    assert "cat" in plan.tensors


def test_a_join_inside_the_network_is_left_as_planned():
    model = ir.serde.deserialize_model(_model(100.0, internal=True))
    (cat,) = [n for n in model.graph if n.name == "cat"]
    assert decode_tail(model.graph, cat) is None
    plan = build_plan(model, _xint8())
    assert split_heterogeneous_joins(model, plan, _ranges(300.0), plan.options) == []
    assert "cat" in plan.tensors


def _quantize(model: onnx.ModelProto, path) -> onnx.ModelProto:
    qc = get_default_config("XINT8")
    qc.extra_options["ConvertSigmoidToHardSigmoid"] = False
    ModelQuantizer(Config(global_quant_config=qc)).quantize_model(
        model, str(path), ArrayDataReader({"x": _samples()})
    )
    return onnx.load(str(path))


def _dq_outputs(model: onnx.ModelProto) -> dict[str, str]:
    """Tensor name -> the output of the DequantizeLinear that reads its QuantizeLinear."""
    q_of = {n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "QuantizeLinear"}
    return {
        q_of[n.input[0]]: n.output[0]
        for n in model.graph.node
        if n.op_type == "DequantizeLinear" and n.input[0] in q_of
    }


def test_quantized_tail_is_float_and_each_part_keeps_its_own_position(tmp_path):
    float_model = _model(100.0)
    model = _quantize(float_model, tmp_path / "q.onnx")
    dq = _dq_outputs(model)
    assert "box" in dq and "logit" in dq  # the parts leave the NPU with their own Q/DQ
    assert "cat" not in dq and "prob" not in dq  # the tail is float
    (last,) = [n for n in model.graph.node if "y" in n.output]
    assert last.op_type == "Concat"
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    scales = {
        n.input[0]: float(inits[n.input[1]])
        for n in model.graph.node
        if n.op_type == "QuantizeLinear"
    }
    assert scales["box"] > 2 * scales["logit"]  # not one position
    # exact oracle: y = Concat(DQ(box), sigmoid(DQ(logit))) computed in float
    extra = onnx.ModelProto.FromString(model.SerializeToString())
    extra.graph.output.extend(helper.make_empty_tensor_value_info(dq[n]) for n in ("box", "logit"))
    session = ort.InferenceSession(extra.SerializeToString(), providers=["CPUExecutionProvider"])
    for x in _samples()[:4]:
        y, box, logit = session.run(None, {"x": x[None]})
        np.testing.assert_array_equal(y[:, :2], box)
        np.testing.assert_allclose(y[:, 2:], 1 / (1 + np.exp(-logit)), rtol=1e-6, atol=1e-7)
    # the readiness checker takes the float tail as the CPU partition, not a finding
    verdict = check(model)
    assert verdict.ready, [f.message for f in verdict.errors]
    assert not [f for f in verdict.findings if f.node in ("cat", "gate", "out")]


def test_a_join_int8_can_hold_stays_quantized(tmp_path):
    """Must not fire: box offsets within 2x of the scores share one position as before."""
    model = _quantize(_model(0.15), tmp_path / "q.onnx")
    (last,) = [n for n in model.graph.node if "y" in n.output]
    assert last.op_type == "DequantizeLinear"  # the join's output is quantized


def test_checker_still_flags_a_layer_without_its_output_qdq():
    """The CPU partition is float nodes after the last Q/DQ, never a layer: a Conv whose output
    has no Q/DQ cannot run on the NPU."""
    rng = np.random.default_rng(0)
    s = helper.make_tensor("s", F, [], [1 / 16])
    z = helper.make_tensor("z", TensorProto.INT8, [], [0])
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q"),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dq"),
        helper.make_node("Conv", ["xd", "w"], ["c"], name="conv", group=1, **CONV),
        helper.make_node("Sigmoid", ["c"], ["y"], name="sig"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", F, [1, 4, 4, 4])],
        [helper.make_tensor_value_info("y", F, [1, 2, 4, 4])],
        [s, z, onnx.numpy_helper.from_array(rng.normal(size=(2, 4, 1, 1)).astype(np.float32), "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    ir_model = ir.serde.deserialize_model(model)
    tail = cpu_tail_nodes(ir_model.graph)
    names = {n.name for n in ir_model.graph if id(n) in tail}
    assert names == {"sig"}
    verdict = check(model)
    assert any(f.node == "conv" for f in verdict.errors)
    assert not [f for f in verdict.findings if f.node == "sig"]
