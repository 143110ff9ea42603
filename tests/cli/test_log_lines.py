"""Warnings are one line each; tracebacks only with ``--debug``: onnx_ir's shape-inference failure
on a bfloat16 model is one warning naming the pass and the node, and any library warning logged
with its exception is one line in the CLI."""

from __future__ import annotations

import logging
import sys

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import pytest
from cli_helpers import run_cli
from onnx import TensorProto
from onnx import helper as h

from quark_onnx.cli.common import LogFormatter
from quark_onnx.graph.ir import infer_shapes


def bfloat16_model() -> onnx.ModelProto:
    """x (bfloat16) -> Conv -> Relu -> ReduceMean over H, W: onnx's shape inference refuses the
    bfloat16 Conv, onnxruntime has no bfloat16 Conv on the CPU."""
    weight = np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(ml_dtypes.bfloat16)
    nodes = [
        h.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1], kernel_shape=[3, 3]),
        h.make_node("Relu", ["c"], ["r"], name="relu"),
        h.make_node("ReduceMean", ["r"], ["y"], name="mean", axes=[2, 3], keepdims=1),
    ]
    graph = h.make_graph(
        nodes,
        "bf16",
        [h.make_tensor_value_info("x", TensorProto.BFLOAT16, [1, 3, 8, 8])],
        [h.make_tensor_value_info("y", TensorProto.BFLOAT16, [1, 4, 1, 1])],
        [onnx.numpy_helper.from_array(weight, "w")],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_a_failed_shape_inference_is_one_warning_naming_the_pass_and_node(caplog):
    model = ir.serde.deserialize_model(bfloat16_model())
    with caplog.at_level(logging.DEBUG):
        assert infer_shapes(model, "SomePass") is False
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.name for r in warnings] == ["quark_onnx.graph.ir"]  # not onnx_ir's own record
    message = warnings[0].getMessage()
    assert message.startswith("SomePass: shape inference failed") and "node name: conv" in message
    assert "\n" not in message and warnings[0].exc_info is None
    # the traceback is kept for the DEBUG level
    assert any(r.levelno == logging.DEBUG and r.exc_info for r in caplog.records)


def test_a_successful_shape_inference_warns_nothing(caplog):
    """The must-not-fire case."""
    model = bfloat16_model()
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.FLOAT
    model.graph.output[0].type.tensor_type.elem_type = TensorProto.FLOAT
    model.graph.initializer[0].CopyFrom(
        onnx.numpy_helper.from_array(np.ones((4, 3, 3, 3), np.float32), "w")
    )
    graph = ir.serde.deserialize_model(model)
    with caplog.at_level(logging.DEBUG):
        assert infer_shapes(graph, "SomePass") is True
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    conv = next(node for node in graph.graph if node.name == "conv")
    assert list(conv.outputs[0].shape) == [1, 4, 8, 8]  # inferred


@pytest.mark.parametrize("debug", [False, True])
def test_a_library_warning_with_its_exception_is_one_line_without_debug(debug):
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        record = logging.LogRecord(
            "somelib", logging.WARNING, __file__, 1, "it failed", None, sys.exc_info()
        )
    text = LogFormatter("%(levelname)s: %(name)s: %(message)s", debug).format(record)
    if debug:
        assert "Traceback" in text
    else:
        assert text == "WARNING: somelib: it failed (ValueError: bad thing)"


def test_a_bfloat16_model_fails_named_with_no_traceback(tmp_path):
    onnx.save(bfloat16_model(), tmp_path / "bf.onnx")
    args = ["quantize", "bf.onnx", "-o", "out", "--preset", "A8W8", "--random-calib", "2"]
    done = run_cli(*args, cwd=tmp_path, timeout=300)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert "ConvertReduceMeanToGlobalAvgPool: shape inference failed" in done.stderr
    assert "error: " in done.stderr and "node (conv)" in done.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == []  # nothing left
    with_debug = run_cli(*args, "--debug", cwd=tmp_path, timeout=300)
    assert "Traceback" in with_debug.stderr
