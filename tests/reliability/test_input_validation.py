"""Input validation through ``ModelQuantizer.quantize_model``: one error hierarchy, named faults.

Each bad input ends in a :class:`~quark_onnx.errors.QuarkOnnxError` whose message names the file
(and node or tensor where there is one) and says what to do, and nothing is written. Inputs that
can be handled (old opsets, custom-domain and control-flow nodes, dynamic shapes) are quantized
with the unsupported parts left in float and reported.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from fuzz_models import conv_chain, quantizer
from onnx import TensorProto
from onnx import helper as h

from quark_onnx import Config, ModelQuantizer, get_default_config
from quark_onnx.errors import (
    ModelLoadError,
    QuantizationError,
    QuarkOnnxError,
)


def _save(model: onnx.ModelProto, path) -> str:
    path.write_bytes(model.SerializeToString())
    return str(path)


def _quantize_fails(tmp_path, src, error=QuarkOnnxError, **kwargs) -> QuarkOnnxError:
    out = tmp_path / "out.onnx"
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(error) as info:
        quantizer(**kwargs).quantize_model(src, out)
    assert not out.exists()
    assert sorted(os.listdir(tmp_path)) == before  # nothing written, nothing left behind
    return info.value


def _with_tail(node: onnx.NodeProto, opsets=()) -> onnx.ModelProto:
    """conv_chain with ``node`` appended, reading ``y`` and producing ``z``."""
    model = conv_chain()
    model.graph.node.append(node)
    model.graph.output[0].name = "z"
    model.opset_import.extend(opsets)
    return model


def test_missing_file(tmp_path):
    err = _quantize_fails(tmp_path, tmp_path / "absent.onnx", ModelLoadError)
    assert "absent.onnx" in str(err) and "no such file" in str(err)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file(tmp_path):
    src = tmp_path / "locked.onnx"
    _save(conv_chain(), src)
    src.chmod(0)
    try:
        err = _quantize_fails(tmp_path, src, ModelLoadError)
    finally:
        src.chmod(0o644)
    assert "locked.onnx" in str(err) and "permission" in str(err).lower()


def test_folder_instead_of_file(tmp_path):
    (tmp_path / "dir.onnx").mkdir()
    err = _quantize_fails(tmp_path, tmp_path / "dir.onnx", ModelLoadError)
    assert "is a folder, not a regular file" in str(err)


def test_not_a_protobuf(tmp_path):
    src = tmp_path / "picture.onnx"
    src.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    err = _quantize_fails(tmp_path, src, ModelLoadError)
    assert "picture.onnx" in str(err) and "not a valid ONNX model" in str(err)


@pytest.mark.parametrize("keep", [0.3, 0.9, 0.999])
def test_truncated(tmp_path, keep):
    data = conv_chain().SerializeToString()
    src = tmp_path / "cut.onnx"
    src.write_bytes(data[: int(len(data) * keep)])
    err = _quantize_fails(tmp_path, src, ModelLoadError)
    assert "cut.onnx" in str(err) and "truncated" in str(err)


def test_checker_failure_names_node(tmp_path):
    model = conv_chain()
    model.graph.node[1].input[0] = "no_such_value"
    err = _quantize_fails(tmp_path, _save(model, tmp_path / "bad.onnx"), ModelLoadError)
    text = str(err)
    assert "bad.onnx" in text and "ONNX checker" in text
    assert "relu0" in text and "no_such_value" in text  # the node and the tensor at fault
    assert "\n" not in text  # one line for a CLI


def test_old_opset_is_upgraded_and_quantized(tmp_path):
    model = conv_chain()
    model.opset_import[0].version = 11
    out = tmp_path / "q.onnx"
    quantizer().quantize_model(_save(model, tmp_path / "old.onnx"), out)
    q = onnx.load(str(out))
    assert q.opset_import[0].version >= 13
    assert sum(n.op_type == "QuantizeLinear" for n in q.graph.node) >= 2


def test_opset_that_cannot_be_upgraded(tmp_path):
    # Cast-1 takes a string type name; onnx's converter has no adapter for it
    x = h.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = h.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    graph = h.make_graph([h.make_node("Cast", ["x"], ["y"], to="FLOAT")], "g", [x], [y])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 1)])
    model.ir_version = 3
    err = _quantize_fails(tmp_path, _save(model, tmp_path / "ancient.onnx"), ModelLoadError)
    text = str(err)
    assert "ancient.onnx" in text and "opset 1" in text and "opset >= 13" in text


def test_known_custom_domain_node_stays_float_and_is_reported(tmp_path):
    gelu = h.make_node("Gelu", ["y"], ["z"], domain="com.microsoft", name="gelu")
    model = _with_tail(gelu, [h.make_opsetid("com.microsoft", 1)])
    q = quantizer()
    out = tmp_path / "q.onnx"
    quantized = q.quantize_model(_save(model, tmp_path / "ms.onnx"), out)
    assert {"node": "gelu", "op_type": "Gelu", "reason": "custom domain 'com.microsoft'"} in (
        q.report.float_nodes
    )
    gelu_out = next(n for n in quantized.graph.node if n.op_type == "Gelu")
    assert gelu_out.domain == "com.microsoft"
    consumers = [n.op_type for n in quantized.graph.node if set(n.input) & set(gelu_out.output)]
    assert "QuantizeLinear" not in consumers  # left in float


def test_unknown_custom_op_after_the_quantized_part(tmp_path):
    node = h.make_node("MyOp", ["y"], ["z"], domain="com.example", name="mystery")
    model = _with_tail(node, [h.make_opsetid("com.example", 1)])
    q = quantizer()
    q.quantize_model(_save(model, tmp_path / "custom.onnx"), tmp_path / "q.onnx")
    assert any(f["node"] == "mystery" for f in q.report.float_nodes)


def test_unknown_custom_op_feeding_a_quantized_node_is_named(tmp_path):
    model = conv_chain()
    model.graph.node[1].CopyFrom(
        h.make_node("MyAct", ["c0"], ["r0"], domain="com.example", name="mystery")
    )
    model.opset_import.append(h.make_opsetid("com.example", 1))
    err = _quantize_fails(tmp_path, _save(model, tmp_path / "custom.onnx"))
    assert "MyAct" in str(err)


def _if_model(cond_as_input: bool) -> onnx.ModelProto:
    shape = [1, 4, 8, 8]
    then_g = h.make_graph(
        [h.make_node("Relu", ["y"], ["t"], name="then_relu")],
        "then",
        [],
        [h.make_tensor_value_info("t", TensorProto.FLOAT, shape)],
    )
    else_g = h.make_graph(
        [h.make_node("Neg", ["y"], ["e"], name="else_neg")],
        "else",
        [],
        [h.make_tensor_value_info("e", TensorProto.FLOAT, shape)],
    )
    node = h.make_node("If", ["cond"], ["z"], then_branch=then_g, else_branch=else_g, name="if")
    model = _with_tail(node)
    if cond_as_input:
        model.graph.input.append(h.make_tensor_value_info("cond", TensorProto.BOOL, []))
    else:
        model.graph.initializer.append(onnx.numpy_helper.from_array(np.array(True), "cond"))
    return model


def test_if_subgraph_stays_float_and_is_reported(tmp_path):
    q = quantizer(samples=2)
    out = tmp_path / "q.onnx"
    quantized = q.quantize_model(_save(_if_model(True), tmp_path / "if.onnx"), out)
    reasons = {f["node"]: f["reason"] for f in q.report.float_nodes}
    assert reasons["then_relu"] == "inside a subgraph"
    assert reasons["else_neg"] == "inside a subgraph"
    assert "if" in reasons
    if_node = next(n for n in quantized.graph.node if n.op_type == "If")
    for branch in if_node.attribute:
        assert all(n.op_type not in ("QuantizeLinear", "DequantizeLinear") for n in branch.g.node)
    findings = q.report.check["findings"]
    assert any(f["rule"] == "control_flow" and f["node"] == "if" for f in findings)
    # the main graph around it is quantized
    assert sum(n.op_type == "QuantizeLinear" for n in quantized.graph.node) >= 2


def test_a_value_only_a_branch_reads_stays_alive_for_the_layer_walk(tmp_path):
    """The If's branches read the last layer's output ``y`` by name, not as a node input: the
    layer walk of bias correction with second-order rounding reads ``y`` twice (the rounding,
    then the bias) and must still have it, and the If's segment must get it as an input."""
    config = get_default_config("XINT8")
    config.optimize_model = False
    config.include_fast_ft = True
    config.extra_options.update(
        UseRandomData=True, RandomDataSamples=2, FastFinetune={"OptimAlgorithm": "gptq"}
    )
    q = ModelQuantizer(Config(global_quant_config=config))
    model = _if_model(True)
    quantized = q.quantize_model(_save(model, tmp_path / "if.onnx"), tmp_path / "q.onnx")
    assert q.report.bias_correction  # the walk ran over the layers
    assert any(n.op_type == "If" for n in quantized.graph.node)


def test_loop_subgraph_stays_float(tmp_path):
    body = h.make_graph(
        [
            h.make_node("Identity", ["c_in"], ["c_out"]),
            h.make_node("Relu", ["v_in"], ["v_out"], name="body_relu"),
        ],
        "body",
        [
            h.make_tensor_value_info("i", TensorProto.INT64, []),
            h.make_tensor_value_info("c_in", TensorProto.BOOL, []),
            h.make_tensor_value_info("v_in", TensorProto.FLOAT, [1, 4, 8, 8]),
        ],
        [
            h.make_tensor_value_info("c_out", TensorProto.BOOL, []),
            h.make_tensor_value_info("v_out", TensorProto.FLOAT, [1, 4, 8, 8]),
        ],
    )
    loop = h.make_node("Loop", ["trip", "", "y"], ["z"], body=body, name="loop")
    model = _with_tail(loop)
    model.graph.input.append(h.make_tensor_value_info("trip", TensorProto.INT64, []))
    q = quantizer()
    quantized = q.quantize_model(_save(model, tmp_path / "loop.onnx"), tmp_path / "q.onnx")
    assert {"node": "body_relu", "op_type": "Relu", "reason": "inside a subgraph"} in (
        q.report.float_nodes
    )
    body_out = next(n for n in quantized.graph.node if n.op_type == "Loop").attribute[0].g
    assert all(n.op_type != "QuantizeLinear" for n in body_out.node)


def test_dynamic_shapes_calibrate_with_the_data_and_are_reported(tmp_path):
    model = conv_chain()
    for vi in (model.graph.input[0], model.graph.output[0]):
        vi.type.tensor_type.shape.dim[2].dim_param = "H"
        vi.type.tensor_type.shape.dim[3].dim_param = "W"
    src = _save(model, tmp_path / "dyn.onnx")
    data = np.random.default_rng(0).random([3, 3, 12, 10], dtype=np.float32)
    q = quantizer(UseRandomData=False)
    out = tmp_path / "q.onnx"
    q.quantize_model(src, out, {"x": data})
    assert q.report.calibration["samples"] == 3
    findings = q.report.check["findings"]
    assert any(f["rule"] == "dynamic_shape" and f["node"] == "x" for f in findings)
    # not fired on the static model
    static = _save(conv_chain(), tmp_path / "static.onnx")
    q.quantize_model(static, tmp_path / "q2.onnx", {"x": data[:, :, :8, :8]})
    assert not any(f["rule"] == "dynamic_shape" for f in q.report.check["findings"])


def test_no_quantizable_op_writes_nothing(tmp_path):
    x = h.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = h.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    graph = h.make_graph([h.make_node("Neg", ["x"], ["y"], name="neg")], "g", [x], [y])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    err = _quantize_fails(tmp_path, _save(model, tmp_path / "neg.onnx"), QuantizationError)
    assert "neg.onnx" in str(err) and "no node can be quantized" in str(err)


def test_every_error_is_one_hierarchy():
    import quark_onnx.errors as errors

    classes = [v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, Exception)]
    assert all(issubclass(c, errors.QuarkOnnxError) for c in classes)


def test_zero_stride_is_refused_before_it_crashes_onnxsim(tmp_path):
    # fuzz finding: a Conv stride of 0 passes the ONNX checker and onnxsim.simplify then dies
    # with SIGFPE, killing the process. Run in a subprocess so a regression cannot take pytest
    # down with it.
    import subprocess
    import sys
    from pathlib import Path

    model = conv_chain()
    strides = next(a for a in model.graph.node[0].attribute if a.name == "strides")
    strides.ints[0] = 0
    src = _save(model, tmp_path / "stride0.onnx")
    code = (
        "import sys; sys.path.insert(0, sys.argv[2])\n"
        "from fuzz_models import quantizer\n"
        "from quark_onnx.errors import ModelLoadError\n"
        "try:\n"
        "    quantizer(optimize=True).quantize_model(sys.argv[1])\n"
        "except ModelLoadError as exc:\n"
        "    print(exc)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, src, str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    assert "stride0.onnx" in proc.stdout and "conv0" in proc.stdout
    assert "strides must only contain positive values" in proc.stdout
