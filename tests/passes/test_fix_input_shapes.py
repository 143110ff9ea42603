"""FixInputShapes: static input shapes, outputs unchanged; no change on static models."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import make_model, run_ort

from quark_onnx.errors import ConfigError, PassError
from quark_onnx.model_files.load import to_ir, to_proto
from quark_onnx.passes import FixInputShapes
from quark_onnx.passes.fix_input_shapes import parse_fix_shapes


def _dynamic_model(batch="N") -> onnx.ModelProto:
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [batch, 2, 4, 4])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [batch, 2])
    w = np.random.default_rng(0).normal(size=(2, 2, 1, 1)).astype(np.float32)
    nodes = [
        onnx.helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[1, 1]),
        onnx.helper.make_node("Relu", ["c"], ["r"]),
        onnx.helper.make_node("GlobalAveragePool", ["r"], ["g"]),
        onnx.helper.make_node("Flatten", ["g"], ["y"]),
    ]
    return make_model(nodes, [x], [y], {"w": w})


def test_batch_becomes_static_and_outputs_are_unchanged():
    proto = _dynamic_model()
    x = np.random.default_rng(1).normal(size=(1, 2, 4, 4)).astype(np.float32)
    model = to_ir(proto)
    assert FixInputShapes(batch=1)(model).modified
    fixed = to_proto(model)
    dims = [d.dim_value for d in fixed.graph.input[0].type.tensor_type.shape.dim]
    assert dims == [1, 2, 4, 4]
    out_dims = [d.dim_value for d in fixed.graph.output[0].type.tensor_type.shape.dim]
    assert out_dims == [1, 2]
    np.testing.assert_array_equal(run_ort(fixed, {"x": x})[0], run_ort(proto, {"x": x})[0])


def test_explicit_shapes_from_quark_string():
    shapes = parse_fix_shapes("x:[1,2,4,4]")
    model = to_ir(_dynamic_model())
    assert FixInputShapes(shapes)(model).modified
    assert list(model.graph.inputs[0].shape) == [1, 2, 4, 4]


def _spatially_dynamic_model() -> onnx.ModelProto:
    """x: N x 2 x H x W -> Conv 1x1 -> Relu -> GlobalAveragePool -> Flatten -> y."""
    proto = _dynamic_model()
    dims = proto.graph.input[0].type.tensor_type.shape.dim
    dims[2].dim_param, dims[3].dim_param = "H", "W"
    return proto


def test_keep_batch_fixes_the_other_dimensions_only():
    model = to_ir(_spatially_dynamic_model())
    assert FixInputShapes(parse_fix_shapes("x:[1,2,4,4]"), keep_batch=True)(model).modified
    batch, *rest = model.graph.inputs[0].shape
    assert not isinstance(batch, int) and batch.value == "N" and rest == [2, 4, 4]
    # the spatial sizes reach the pool's input; the batch stays free for calibration
    (pool,) = [n for n in model.graph if n.op_type == "GlobalAveragePool"]
    assert list(pool.inputs[0].shape)[1:] == [2, 4, 4]
    x = np.random.default_rng(2).normal(size=(3, 2, 4, 4)).astype(np.float32)
    out = to_proto(model)
    np.testing.assert_array_equal(
        run_ort(out, {"x": x})[0], run_ort(_spatially_dynamic_model(), {"x": x})[0]
    )


def test_the_quantizer_fixes_h_and_w_before_the_pool_passes(tmp_path):
    """With FixShapes the global pool of a model with dynamic H and W is legalized as in a static
    one (it becomes a depthwise Conv, which needs its kernel size) and the batch is fixed last."""
    from quark_onnx import ArrayDataReader, Config, ModelQuantizer, get_default_config

    qc = get_default_config("XINT8")
    qc.extra_options["FixShapes"] = "x:[1,2,4,4]"
    out = tmp_path / "q.onnx"
    x = np.random.default_rng(3).normal(size=(8, 2, 4, 4)).astype(np.float32)
    ModelQuantizer(Config(global_quant_config=qc)).quantize_model(
        _spatially_dynamic_model(), str(out), ArrayDataReader({"x": x})
    )
    written = onnx.load(out)
    assert "GlobalAveragePool" not in {n.op_type for n in written.graph.node}
    dims = [d.dim_value for d in written.graph.input[0].type.tensor_type.shape.dim]
    assert dims == [1, 2, 4, 4]


def test_static_model_is_not_touched():
    model = to_ir(_dynamic_model(batch=1))
    assert not FixInputShapes(batch=1)(model).modified


@pytest.mark.parametrize(
    ("text", "error"),
    [("x[1,2]", ConfigError), ("x:[0,2]", ConfigError), ("x:[]", ConfigError)],
)
def test_bad_fix_shapes_strings(text, error):
    with pytest.raises(error):
        parse_fix_shapes(text)


def test_shape_that_contradicts_fixed_dims_is_refused():
    model = to_ir(_dynamic_model())
    with pytest.raises(PassError, match="fixed size 2 at axis 1"):
        FixInputShapes({"x": [1, 3, 4, 4]})(model)
    with pytest.raises(PassError, match="not graph inputs"):
        FixInputShapes({"image": [1, 2, 4, 4]})(to_ir(_dynamic_model()))


def _annotated_model() -> onnx.ModelProto:
    """Every value typed and carrying the batch symbol; a small initializer (bias, 64 bytes)
    after a large one (weight, 1 KB), which onnx_ir's shape inference regroups."""
    rng = np.random.default_rng(2)
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 16, 4, 4])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 16, 4, 4])
    nodes = [
        onnx.helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[1, 1]),
        onnx.helper.make_node("Relu", ["c"], ["y"]),
    ]
    model = make_model(
        nodes,
        [x],
        [y],
        {
            "w": rng.normal(size=(16, 16, 1, 1)).astype(np.float32),
            "b": rng.normal(size=16).astype(np.float32),
        },
    )
    model.graph.value_info.append(
        onnx.helper.make_tensor_value_info("c", onnx.TensorProto.FLOAT, ["N", 16, 4, 4])
    )
    return model


def test_no_shape_inference_when_the_batch_makes_every_value_static(monkeypatch):
    """The written bytes are those of the path that runs onnx_ir's shape inference (same
    shapes, same initializer order), without its serialization of the graph."""
    import quark_onnx.passes.fix_input_shapes as fis

    inferred = to_ir(_annotated_model())
    monkeypatch.setattr(fis, "_inference_has_work", lambda model: True)
    assert FixInputShapes(batch=1)(inferred).modified
    monkeypatch.undo()
    assert [v.name for v in inferred.graph.initializers.values()] == ["b", "w"]
    assert [list(v.shape) for v in inferred.graph.outputs] == [[1, 16, 4, 4]]

    def refuse(*args, **kwargs):
        raise AssertionError("shape inference ran on an all-static model")

    monkeypatch.setattr(fis, "infer_shapes", refuse)
    skipped = to_ir(_annotated_model())
    assert FixInputShapes(batch=1)(skipped).modified
    assert to_proto(skipped).SerializeToString() == to_proto(inferred).SerializeToString()


def test_shape_inference_still_fills_a_value_the_batch_leaves_unknown():
    model = to_ir(_dynamic_model())  # c, r, g carry no shape
    assert FixInputShapes(batch=1)(model).modified
    shapes = {v.name: v.shape for node in model.graph for v in node.outputs}
    assert [list(shapes[n]) for n in ("c", "r", "g")] == [[1, 2, 4, 4]] * 2 + [[1, 2, 1, 1]]
