"""SimplifyWithOnnxsim: folds constants when onnxsim succeeds; never fails the pipeline."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnx_ir as ir
import onnxsim
from conftest import make_model, run_ort
from onnx import TensorProto as T
from onnx import helper as h

from quark_onnx.passes import SimplifyWithOnnxsim


def _model() -> onnx.ModelProto:
    """``y = Reshape(x * (2 + 3), Shape(x))``: the Add and the Shape are foldable."""
    model = make_model(
        [
            h.make_node("Add", ["two", "three"], ["five"]),
            h.make_node("Mul", ["x", "five"], ["m"]),
            h.make_node("Shape", ["x"], ["s"]),
            h.make_node("Reshape", ["m", "s"], ["y"]),
        ],
        [h.make_tensor_value_info("x", T.FLOAT, [2, 3])],
        [h.make_tensor_value_info("y", T.FLOAT, [2, 3])],
        {"two": np.array(2.0, dtype=np.float32), "three": np.array(3.0, dtype=np.float32)},
    )
    model.graph.name = "foldable"
    return model


def test_simplifies_and_keeps_outputs():
    model = _model()
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    ir_model = ir.serde.deserialize_model(model)
    result = SimplifyWithOnnxsim()(ir_model)
    assert result.modified and result.model is ir_model
    proto = ir.serde.serialize_model(ir_model)
    onnx.checker.check_model(proto)
    assert "Add" not in [n.op_type for n in proto.graph.node]
    assert "Shape" not in [n.op_type for n in proto.graph.node]
    np.testing.assert_array_equal(run_ort(proto, {"x": x})[0], run_ort(model, {"x": x})[0])


def test_nothing_to_simplify_is_not_modified():
    model = make_model(
        [h.make_node("Relu", ["x"], ["y"])],
        [h.make_tensor_value_info("x", T.FLOAT, [2, 3])],
        [h.make_tensor_value_info("y", T.FLOAT, [2, 3])],
    )
    ir_model = ir.serde.deserialize_model(model)
    assert not SimplifyWithOnnxsim()(ir_model).modified


def test_onnxsim_failure_is_a_warning(monkeypatch, caplog):
    def boom(*args, **kwargs):
        raise RuntimeError("[ONNXRuntimeError] : 1 : FAIL : unsupported op\nmore details")

    monkeypatch.setattr(onnxsim, "simplify", boom)
    ir_model = ir.serde.deserialize_model(_model())
    nodes = [n.op_type for n in ir_model.graph]
    with caplog.at_level(logging.WARNING):
        result = SimplifyWithOnnxsim()(ir_model)
    assert not result.modified
    assert [n.op_type for n in ir_model.graph] == nodes
    assert "'foldable'" in caplog.text and "unsupported op" in caplog.text


def test_failed_check_is_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(onnxsim, "simplify", lambda model, **kwargs: (model, False))
    ir_model = ir.serde.deserialize_model(_model())
    with caplog.at_level(logging.WARNING):
        result = SimplifyWithOnnxsim()(ir_model)
    assert not result.modified
    assert "'foldable'" in caplog.text and "check failed" in caplog.text


def _domains(proto: onnx.ModelProto) -> set[str]:
    return {n.domain for n in proto.graph.node}


def test_fusions_into_runtime_specific_ops_are_not_kept(caplog):
    """onnxsim fuses the encoder block's attention into com.microsoft::Attention, which no
    quantizer policy covers: the pass falls back to folding and shape inference only, keeping
    standard ops and the float outputs."""
    from tests.strategies.transformer_block import block_inputs, build_block

    proto = build_block()
    fused, _ = onnxsim.simplify(proto)
    assert "com.microsoft" in _domains(fused)  # the premise: onnxsim's fusion fires here
    x = block_inputs(2, seed=3)
    name = proto.graph.input[0].name
    (expected,) = run_ort(proto, {name: x})
    model = ir.serde.deserialize_model(proto)
    with caplog.at_level(logging.INFO):
        SimplifyWithOnnxsim()(model)
    out = ir.serde.serialize_model(model)
    assert _domains(out) <= {"", "ai.onnx"}
    assert "without fusions" in caplog.text
    (got,) = run_ort(out, {name: x})
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_standard_fusions_are_kept():
    """Must not fire: a Conv + BatchNormalization fused by onnxsim stays in the standard domain,
    so the optimized result is kept (the BatchNormalization is gone)."""
    rng = np.random.default_rng(0)
    c = 4
    inits = [
        onnx.numpy_helper.from_array(rng.standard_normal((c, 3, 3, 3)).astype(np.float32), "w"),
        onnx.numpy_helper.from_array(rng.uniform(0.5, 2, c).astype(np.float32), "g"),
        onnx.numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "b"),
        onnx.numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "m"),
        onnx.numpy_helper.from_array(rng.uniform(0.5, 2, c).astype(np.float32), "v"),
    ]
    nodes = [
        h.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1]),
        h.make_node("BatchNormalization", ["y", "g", "b", "m", "v"], ["z"]),
    ]
    graph = h.make_graph(
        nodes,
        "conv_bn",
        [h.make_tensor_value_info("x", T.FLOAT, [1, 3, 8, 8])],
        [h.make_tensor_value_info("z", T.FLOAT, [1, c, 8, 8])],
        inits,
    )
    proto = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model = ir.serde.deserialize_model(proto)
    SimplifyWithOnnxsim()(model)
    ops = [n.op_type for n in ir.serde.serialize_model(model).graph.node]
    assert "BatchNormalization" not in ops and "Conv" in ops


def test_large_weights_applied_to_the_input_are_kept_out_of_onnxsims_copy(monkeypatch):
    """A weight no constant-foldable node reads is handed to onnxsim as an input and comes back
    as the same initializer (its values unchanged); a constant chain beside it
    is still folded. Must not fire: the weight that feeds the foldable Transpose stays in."""
    import passes.simplify_with_onnxsim as sim

    monkeypatch.setattr(sim, "HOLD_BYTES", 64)
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 8)).astype(np.float32)
    v = rng.standard_normal((8, 8)).astype(np.float32)
    model = make_model(
        [
            h.make_node("MatMul", ["x", "W"], ["a"], name="mm"),
            h.make_node("Transpose", ["V"], ["vt"], name="t", perm=[1, 0]),
            h.make_node("MatMul", ["a", "vt"], ["y"], name="mm2"),
        ],
        [h.make_tensor_value_info("x", T.FLOAT, [1, 8])],
        [h.make_tensor_value_info("y", T.FLOAT, [1, 8])],
        {"W": w, "V": v},
    )
    x = rng.standard_normal((1, 8)).astype(np.float32)
    expected = run_ort(model, {"x": x})
    ir_model = ir.serde.deserialize_model(model)
    assert [value.name for value in sim._held_initializers(ir_model.graph)] == ["W"]
    result = SimplifyWithOnnxsim()(ir_model)
    assert result.modified  # the Transpose of the constant V was folded
    graph = result.model.graph
    assert [v.name for v in graph.inputs] == ["x"]
    np.testing.assert_array_equal(graph.initializers["W"].const_value.numpy(), w)
    assert "t" not in [n.name for n in graph]
    out = ir.serde.serialize_model(result.model)
    onnx.checker.check_model(out)
    np.testing.assert_allclose(run_ort(out, {"x": x})[0], expected[0], rtol=1e-5, atol=1e-5)
