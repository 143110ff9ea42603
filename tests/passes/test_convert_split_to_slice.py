"""ConvertSplitToSlice: every Split form becomes exact Slices; unknown sizes are left alone."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import make_model, run_ort
from onnx import TensorProto as T
from onnx import helper as h

from quark_onnx.passes import ConvertSplitToSlice

X = np.arange(2 * 7 * 3, dtype=np.float32).reshape(2, 7, 3)
IN = h.make_tensor_value_info("x", T.FLOAT, [2, 7, 3])


def _outs(shapes):
    return [h.make_tensor_value_info(f"y{i}", T.FLOAT, s) for i, s in enumerate(shapes)]


def _apply(model):
    ir_model = ir.serde.deserialize_model(model)
    result = ConvertSplitToSlice()(ir_model)
    proto = ir.serde.serialize_model(ir_model)
    onnx.checker.check_model(proto, full_check=True)
    return result, proto


def _same(model, proto):
    ref = run_ort(model, {"x": X})
    new = run_ort(proto, {"x": X})
    for a, b in zip(ref, new, strict=True):
        np.testing.assert_array_equal(a, b)


CASES = {
    "opset11-attribute": (
        11,
        dict(axis=1, split=[2, 4, 1]),
        None,
        [[2, 2, 3], [2, 4, 3], [2, 1, 3]],
    ),
    "opset13-input": (13, dict(axis=1), [3, 3, 1], [[2, 3, 3], [2, 3, 3], [2, 1, 3]]),
    "opset13-equal": (13, dict(axis=0), None, [[1, 7, 3], [1, 7, 3]]),
    "opset13-negative-axis": (13, dict(axis=-1), None, [[2, 7, 1], [2, 7, 1], [2, 7, 1]]),
    "opset18-num-outputs-uneven": (
        18,
        dict(axis=1, num_outputs=3),
        None,
        [[2, 3, 3], [2, 3, 3], [2, 1, 3]],
    ),
    "opset18-input": (18, dict(axis=-2), [5, 2], [[2, 5, 3], [2, 2, 3]]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_split_becomes_slices(case):
    opset, attrs, split, shapes = CASES[case]
    inputs, inits = ["x"], {}
    if split is not None:
        inits["split"] = np.array(split, dtype=np.int64)
        inputs.append("split")
    outs = _outs(shapes)
    node = h.make_node("Split", inputs, [o.name for o in outs], name="split", **attrs)
    model = make_model([node], [IN], outs, inits, opset=opset)
    result, proto = _apply(model)
    assert result.modified
    assert [n.op_type for n in proto.graph.node] == ["Slice"] * len(shapes)
    assert [o.name for o in proto.graph.output] == [o.name for o in outs]
    assert "split" not in {i.name for i in proto.graph.initializer}
    _same(model, proto)


def test_only_used_outputs_are_sliced():
    model = make_model(
        [
            h.make_node("Split", ["x"], ["a", "b", "c"], axis=1, split=[1, 2, 4]),
            h.make_node("Relu", ["c"], ["y0"]),
            h.make_node("Neg", ["a"], ["y1"]),
        ],
        [IN],
        _outs([[2, 4, 3], [2, 1, 3]]),
        opset=11,
    )
    result, proto = _apply(model)
    assert result.modified
    assert [n.op_type for n in proto.graph.node] == ["Slice", "Slice", "Relu", "Neg"]
    _same(model, proto)


def test_split_after_other_nodes_and_shape_inference():
    # the Split input's shape is only known after shape inference (Transpose output)
    model = make_model(
        [
            h.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1]),
            h.make_node("Split", ["t"], ["y0", "y1"], axis=-1, num_outputs=2),
        ],
        [IN],
        _outs([[2, 3, 4], [2, 3, 3]]),
        opset=18,
    )
    result, proto = _apply(model)
    assert result.modified
    _same(model, proto)


def test_unknown_axis_size_without_split_is_left_alone():
    x = h.make_tensor_value_info("x", T.FLOAT, ["N", 7, 3])
    model = make_model(
        [h.make_node("Split", ["x"], ["y0", "y1"], axis=0)],
        [x],
        [h.make_tensor_value_info(n, T.FLOAT, ["M", 7, 3]) for n in ("y0", "y1")],
        opset=13,
    )
    result, proto = _apply(model)
    assert not result.modified
    assert [n.op_type for n in proto.graph.node] == ["Split"]

    # ... but with the sizes given, the unknown dimension does not matter
    model = make_model(
        [h.make_node("Split", ["x", "split"], ["y0", "y1"], axis=1)],
        [x],
        [
            h.make_tensor_value_info("y0", T.FLOAT, ["N", 3, 3]),
            h.make_tensor_value_info("y1", T.FLOAT, ["N", 4, 3]),
        ],
        {"split": np.array([3, 4], dtype=np.int64)},
        opset=13,
    )
    result, proto = _apply(model)
    assert result.modified
    _same(model, proto)


def test_runtime_split_sizes_are_left_alone():
    model = make_model(
        [h.make_node("Split", ["x", "split"], ["y0", "y1"], axis=1)],
        [IN, h.make_tensor_value_info("split", T.INT64, [2])],
        _outs([[2, "a", 3], [2, "b", 3]]),
        opset=13,
    )
    result, _ = _apply(model)
    assert not result.modified
