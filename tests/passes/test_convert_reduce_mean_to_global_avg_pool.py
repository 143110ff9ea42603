"""ConvertReduceMeanToGlobalAvgPool: spatial means become GlobalAveragePool (+ Flatten)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import make_model, run_ort
from onnx import TensorProto as T
from onnx import helper as h

from quark_onnx.passes import ConvertReduceMeanToGlobalAvgPool

RNG = np.random.default_rng(1)
X = RNG.normal(0, 3, (2, 3, 5, 7)).astype(np.float32)


def _model(axes, keepdims=1, opset=17, in_shape=(2, 3, 5, 7), out_shape=None):
    attrs = {"keepdims": keepdims}
    inputs, inits = ["x"], {}
    if axes is not None and opset >= 18:
        inits["axes"] = np.array(axes, dtype=np.int64)
        inputs.append("axes")
    elif axes is not None:
        attrs["axes"] = list(axes)
    if out_shape is None:
        out_shape = (
            [
                d if (i not in {a % len(in_shape) for a in axes}) else 1
                for i, d in enumerate(in_shape)
            ]
            if keepdims
            else [d for i, d in enumerate(in_shape) if i not in {a % len(in_shape) for a in axes}]
        )
    return make_model(
        [h.make_node("ReduceMean", inputs, ["y"], name="mean", **attrs)],
        [h.make_tensor_value_info("x", T.FLOAT, list(in_shape) if in_shape else None)],
        [h.make_tensor_value_info("y", T.FLOAT, out_shape)],
        inits,
        opset=opset,
    )


def _apply(model):
    ir_model = ir.serde.deserialize_model(model)
    result = ConvertReduceMeanToGlobalAvgPool()(ir_model)
    proto = ir.serde.serialize_model(ir_model)
    onnx.checker.check_model(proto, full_check=True)
    return result, proto


@pytest.mark.parametrize("opset", [13, 17, 18])
@pytest.mark.parametrize("axes", [(2, 3), (3, 2), (-2, -1), (2, -1)])
@pytest.mark.parametrize("keepdims", [1, 0])
def test_spatial_mean_becomes_global_average_pool(opset, axes, keepdims):
    model = _model(axes, keepdims, opset)
    (ref,) = run_ort(model, {"x": X})
    result, proto = _apply(model)
    assert result.modified
    ops = [n.op_type for n in proto.graph.node]
    assert ops == (["GlobalAveragePool"] if keepdims else ["GlobalAveragePool", "Flatten"])
    assert not proto.graph.initializer  # the opset-18 axes constant is dropped
    (y,) = run_ort(proto, {"x": X})
    assert y.shape == ref.shape
    assert np.max(np.abs(y - ref)) <= 1e-5 * np.ptp(ref)
    np.testing.assert_allclose(y.reshape(2, 3), X.mean(axis=(2, 3)), rtol=0, atol=1e-5)


def test_unknown_input_shape_is_inferred():
    model = make_model(
        [
            h.make_node("Relu", ["x"], ["r"]),
            h.make_node("ReduceMean", ["r"], ["y"], axes=[2, 3], keepdims=0),
        ],
        [h.make_tensor_value_info("x", T.FLOAT, [2, 3, 5, 7])],
        [h.make_tensor_value_info("y", T.FLOAT, [2, 3])],
    )
    result, proto = _apply(model)
    assert result.modified
    np.testing.assert_allclose(
        run_ort(proto, {"x": X})[0], np.maximum(X, 0).mean(axis=(2, 3)), rtol=0, atol=1e-5
    )


@pytest.mark.parametrize(
    "axes,in_shape,opset",
    [
        ((1,), (2, 3, 5, 7), 17),
        ((1, 2, 3), (2, 3, 5, 7), 17),
        ((1, 2, 3), (2, 3, 5, 7), 18),
        ((2,), (2, 3, 5, 7), 17),
        ((2, 3), (2, 3, 5, 7, 4), 17),  # rank 5
        ((1, 2), (2, 3, 5), 17),  # rank 3
        (None, (2, 3, 5, 7), 17),  # no axes: everything
    ],
)
def test_other_reductions_are_left_alone(axes, in_shape, opset):
    out_shape = [1] * len(in_shape) if axes is None else None
    result, proto = _apply(_model(axes, 1, opset, in_shape, out_shape))
    assert not result.modified
    assert [n.op_type for n in proto.graph.node] == ["ReduceMean"]


def test_unknown_rank_is_left_alone():
    x = h.make_tensor_value_info("x", T.FLOAT, None)
    x.type.tensor_type.ClearField("shape")
    model = h.make_model(
        h.make_graph(
            [h.make_node("ReduceMean", ["x"], ["y"], axes=[2, 3])],
            "g",
            [x],
            [h.make_tensor_value_info("y", T.FLOAT, None)],
        ),
        opset_imports=[h.make_opsetid("", 17)],
    )
    ir_model = ir.serde.deserialize_model(model)
    assert not ConvertReduceMeanToGlobalAvgPool()(ir_model).modified


def test_runtime_axes_are_left_alone():
    model = make_model(
        [h.make_node("ReduceMean", ["x", "axes"], ["y"], keepdims=1)],
        [
            h.make_tensor_value_info("x", T.FLOAT, [2, 3, 5, 7]),
            h.make_tensor_value_info("axes", T.INT64, [2]),
        ],
        [h.make_tensor_value_info("y", T.FLOAT, [2, 3, 1, 1])],
        opset=18,
    )
    result, _ = _apply(model)
    assert not result.modified
