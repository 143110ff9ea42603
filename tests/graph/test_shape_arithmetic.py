"""Shape arithmetic is never calibrated or quantized (quark_onnx.graph.shape_arithmetic), in every
flow, with or without simplification; a real float activation still is."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from conftest import SNIPPET_OPTIONS, make_model
from onnx import TensorProto, helper

from quark_onnx import ArrayDataReader, Config, ModelQuantizer, get_default_config
from quark_onnx.config.quantization import QuantizationConfig
from quark_onnx.graph.shape_arithmetic import is_float_value, is_shape_parameter, shape_values
from quark_onnx.npu.readiness import check
from quark_onnx.plan.build import build_plan

F = TensorProto.FLOAT
CONV = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [1, 1], "dilations": [1, 1]}
SNIPPET = {"UseRandomData": True, **SNIPPET_OPTIONS}
#: the tensors of each chain that compute the Reshape's shape
INT_CHAIN = ("s", "g", "u", "shp")
FLOAT_CHAIN = ("s", "g", "gf", "half", "hi", "u", "shp")


def _model(float_chain: bool) -> onnx.ModelProto:
    """conv1 -> relu -> conv2 -> Reshape(conv2, shape) with the shape computed from
    Shape(conv2): ``Gather(0) -> Unsqueeze -> Concat(.., [-1])`` (int64) or, with
    ``float_chain``, ``Gather(1) -> Cast(float) -> Div(0.5) -> Cast(int64) -> Unsqueeze ->
    Concat([1], ..)`` (a float tensor that only computes a shape). Shape inference is not
    stored, as in an unsimplified export read without it."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", group=1, **CONV),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", group=1, **CONV),
        helper.make_node("Shape", ["c2"], ["s"], name="shape"),
    ]
    init = {
        "w1": rng.standard_normal((6, 3, 3, 3)).astype(np.float32) * 0.5,
        "b1": rng.standard_normal(6).astype(np.float32) * 0.1,
        "w2": rng.standard_normal((4, 6, 3, 3)).astype(np.float32) * 0.3,
        "b2": rng.standard_normal(4).astype(np.float32) * 0.1,
        "ax0": np.array([0], np.int64),
        "m1": np.array([-1], np.int64),
        "one": np.array([1], np.int64),
    }
    if float_chain:
        init["i"] = np.array(1, np.int64)
        init["two"] = np.array(0.5, np.float32)
        nodes += [
            helper.make_node("Gather", ["s", "i"], ["g"], name="gather", axis=0),
            helper.make_node("Cast", ["g"], ["gf"], name="tofloat", to=F),
            helper.make_node("Div", ["gf", "two"], ["half"], name="div"),
            helper.make_node("Cast", ["half"], ["hi"], name="toint", to=TensorProto.INT64),
            helper.make_node("Unsqueeze", ["hi", "ax0"], ["u"], name="unsq"),
            helper.make_node("Concat", ["one", "u", "m1"], ["shp"], name="cat", axis=0),
        ]
        out_shape = [1, 8, 32]
    else:
        init["i"] = np.array(0, np.int64)
        nodes += [
            helper.make_node("Gather", ["s", "i"], ["g"], name="gather", axis=0),
            helper.make_node("Unsqueeze", ["g", "ax0"], ["u"], name="unsq"),
            helper.make_node("Concat", ["u", "m1"], ["shp"], name="cat", axis=0),
        ]
        out_shape = [1, 256]
    nodes.append(helper.make_node("Reshape", ["c2", "shp"], ["y"], name="reshape"))
    return make_model(
        nodes,
        [helper.make_tensor_value_info("x", F, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", F, out_shape)],
        init,
    )


def _samples(n: int = 8) -> np.ndarray:
    return np.random.default_rng(1).standard_normal((n, 3, 8, 8)).astype(np.float32)


def _run(model: onnx.ModelProto | str, x: np.ndarray, outputs=None) -> list[np.ndarray]:
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else model
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    return session.run(outputs, {"x": x})


def _with_outputs(model: onnx.ModelProto, names) -> onnx.ModelProto:
    """``model`` with ``names`` added as graph outputs (types left to onnxruntime)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    model.graph.output.extend(helper.make_empty_tensor_value_info(n) for n in names)
    return model


def _xint8() -> QuantizationConfig:
    qc = QuantizationConfig()
    qc.calibrate_method = "NonOverflow"
    qc.enable_npu_cnn = True
    return qc


@pytest.mark.parametrize("float_chain", [False, True])
def test_plan_leaves_the_shape_chain_alone_and_quantizes_the_activations(float_chain):
    model = ir.serde.deserialize_model(_model(float_chain))
    chain = FLOAT_CHAIN if float_chain else INT_CHAIN
    plan = build_plan(model, _xint8())
    assert not set(chain) & set(plan.tensors)
    # must not fire: the real activations are quantized
    assert {"x", "r1", "c2", "y"} <= set(plan.activation_names())
    reasons = {f.name: f.reason for f in plan.float_nodes}
    for name in ("shape", "gather", "unsq", "cat") + (
        ("tofloat", "div", "toint") if float_chain else ()
    ):
        assert reasons[name].startswith("shape arithmetic"), (name, reasons.get(name))
    assert "reshape" in {n.name for n in plan.nodes}


def test_schema_types_and_shape_parameters():
    model = ir.serde.deserialize_model(_model(True))
    values = {v.name: v for n in model.graph for v in n.outputs}
    for name in ("s", "g", "hi", "u", "shp"):
        assert values[name].dtype is None and not is_float_value(values[name]), name
    for name in ("gf", "half", "c2"):
        assert is_float_value(values[name]), name
    nodes = {n.name: n for n in model.graph}
    assert is_shape_parameter(nodes["reshape"], 1) and not is_shape_parameter(nodes["reshape"], 0)
    assert not is_shape_parameter(nodes["div"], 0)
    marked = shape_values(model.graph)
    assert {id(values[n]) for n in FLOAT_CHAIN} <= marked
    assert not {id(values[n]) for n in ("c1", "r1", "c2", "y")} & marked


def test_a_float_chain_feeding_only_a_shape_slot_is_shape_arithmetic():
    """Backward rule: a float computed from an activation that only reaches Resize's scales."""
    nodes = [
        helper.make_node("ReduceMax", ["x"], ["m"], name="rmax", keepdims=0),
        helper.make_node("Concat", ["ones", "m", "m"], ["scales"], name="cat", axis=0),
        helper.make_node("Resize", ["x", "", "scales"], ["y"], name="resize"),
    ]
    proto = make_model(
        nodes,
        [helper.make_tensor_value_info("x", F, [1, 1, 2, 2])],
        [helper.make_tensor_value_info("y", F, [1, 1, 2, 2])],
        {"ones": np.ones(2, np.float32)},
    )
    model = ir.serde.deserialize_model(proto)
    values = {v.name: v for n in model.graph for v in n.outputs}
    marked = shape_values(model.graph)
    assert id(values["scales"]) in marked and id(values["m"]) in marked
    assert id(values["y"]) not in marked and id(model.graph.inputs[0]) not in marked


def test_argmax_of_an_activation_does_not_make_it_shape_arithmetic():
    """Must not fire: an integer result (ArgMax) read by the graph output is not a shape."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("ArgMax", ["r"], ["y"], name="argmax", axis=1),
    ]
    proto = make_model(
        nodes,
        [helper.make_tensor_value_info("x", F, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, [1, 1])],
    )
    model = ir.serde.deserialize_model(proto)
    marked = shape_values(model.graph)
    (relu,) = [n for n in model.graph if n.name == "relu"]
    assert id(relu.outputs[0]) not in marked


def _config(preset: str, snippet: bool) -> Config:
    qc = get_default_config(preset)
    if snippet:
        qc.optimize_model = False
        qc.extra_options.update(SNIPPET)
    qc.extra_options["UseRandomData"] = False
    return Config(global_quant_config=qc)


@pytest.mark.parametrize("float_chain", [False, True])
@pytest.mark.parametrize(
    "preset,snippet",
    [("XINT8", False), ("XINT8", True), ("A8W8", False), ("A16W8", False)],
)
def test_quantize_unsimplified_shape_chain(tmp_path, float_chain, preset, snippet):
    proto = _model(float_chain)
    x = _samples()
    out = tmp_path / "q.onnx"
    ModelQuantizer(_config(preset, snippet)).quantize_model(
        proto, str(out), ArrayDataReader({"x": x})
    )
    quantized = onnx.load(str(out))
    q_inputs = {n.input[0] for n in quantized.graph.node if n.op_type == "QuantizeLinear"}
    chain = FLOAT_CHAIN if float_chain else INT_CHAIN
    assert not set(chain) & q_inputs
    assert "c2" in q_inputs or any(n.startswith("c2") for n in q_inputs)  # must not fire
    # the shape chain (what simplification left of it) computes what the float model computes
    produced = {out for node in quantized.graph.node for out in node.output}
    kept = [name for name in chain if name in produced]
    if snippet:  # optimize_model=False: nothing folded
        assert kept == list(chain)
    want = _run(_with_outputs(proto, kept), x[:1])[1:]
    got = _run(_with_outputs(quantized, kept), x[:1])[1:]
    for name, a, b in zip(kept, want, got, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)
    (y_float,), (y_q,) = _run(proto, x[:1]), _run(quantized, x[:1])
    assert y_q.shape == y_float.shape
    # the data path is quantized, not lost: int8 error well inside the signal
    assert np.abs(y_q - y_float).max() < 0.1 * np.abs(y_float).max()
    if preset == "XINT8":  # the shape chain is no NPU node missing a Q/DQ
        verdict = check(str(out))
        assert verdict.ready, [f.message for f in verdict.errors]


def test_quantized_codes_are_data_not_shape_parameters():
    """A DequantizeLinear's int8 input admits no float type, yet it is the data itself: the
    float tensors quantized before it are not shape arithmetic (once they were, and the readiness
    checker skipped every node of a quantized model as shape arithmetic)."""
    scale, zero = np.float32(0.5), np.int8(0)
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q"),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dq"),
        helper.make_node("Relu", ["xd"], ["r"], name="relu"),
        helper.make_node("QuantizeLinear", ["r", "s", "z"], ["rq"], name="q2"),
        helper.make_node("DequantizeLinear", ["rq", "s", "z"], ["y"], name="dq2"),
    ]
    proto = make_model(
        nodes,
        [helper.make_tensor_value_info("x", F, [1, 4])],
        [helper.make_tensor_value_info("y", F, [1, 4])],
        {"s": scale, "z": zero},
        opset=13,
    )
    model = ir.serde.deserialize_model(proto)
    by_name = {n.name: n for n in model.graph}
    assert not is_shape_parameter(by_name["dq"], 0)
    values = {v.name: v for n in model.graph for v in n.outputs}
    marked = shape_values(model.graph)
    assert not {id(values[n]) for n in ("xd", "r")} & marked
