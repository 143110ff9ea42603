"""MakeConvAttributesExplicit: explicit Conv attributes, float-preserving, auto_pad resolved."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import make_model, run_ort
from onnx import TensorProto, helper

from quark_onnx.passes import MakeConvAttributesExplicit
from quark_onnx.passes.make_conv_attributes_explicit import same_pads

F = TensorProto.FLOAT
EXPLICIT = ("kernel_shape", "strides", "pads", "dilations", "group")


def vi(name, shape):
    return helper.make_tensor_value_info(name, F, shape)


def run_pass(proto):
    model = ir.serde.deserialize_model(proto)
    result = MakeConvAttributesExplicit()(model)
    out = ir.serde.serialize_model(result.model)
    onnx.checker.check_model(out)
    return out, result.modified


def attrs(node):
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def conv_proto(x_shape, w_shape, op="Conv", **attributes):
    rng = np.random.default_rng(0)
    w = rng.normal(size=w_shape).astype(np.float32)
    node = helper.make_node(op, ["x", "W"], ["y"], name="conv", **attributes)
    return make_model([node], [vi("x", x_shape)], [vi("y", ["n", "c", "h", "w"])], {"W": w})


def check_same_outputs(before, after, x_shape):
    x = np.random.default_rng(1).normal(size=x_shape).astype(np.float32)
    np.testing.assert_array_equal(run_ort(before, {"x": x})[0], run_ort(after, {"x": x})[0])


def test_defaults_are_written_and_numerics_unchanged():
    proto = conv_proto([1, 3, 7, 7], (4, 3, 3, 3))
    out, modified = run_pass(proto)
    assert modified
    a = attrs(out.graph.node[0])
    assert a == {
        "kernel_shape": [3, 3],
        "strides": [1, 1],
        "pads": [0, 0, 0, 0],
        "dilations": [1, 1],
        "group": 1,
    }
    check_same_outputs(proto, out, [1, 3, 7, 7])


@pytest.mark.parametrize("mode", ["SAME_UPPER", "SAME_LOWER", "VALID"])
@pytest.mark.parametrize(("size", "kernel", "stride"), [(7, 3, 2), (8, 4, 3), (6, 2, 1)])
def test_auto_pad_resolved_into_pads(mode, size, kernel, stride):
    shape = [1, 2, size, size + 1]
    proto = conv_proto(shape, (3, 2, kernel, kernel), auto_pad=mode, strides=[stride, stride])
    out, modified = run_pass(proto)
    assert modified
    a = attrs(out.graph.node[0])
    assert "auto_pad" not in a and set(EXPLICIT) <= set(a)
    check_same_outputs(proto, out, shape)


def test_same_pads_formula():
    # size 7, kernel 3, stride 2: out 4, total = 3*2 + 3 - 7 = 2 -> (1, 1)
    assert same_pads([7], [3], [2], [1], upper=True) == [1, 1]
    # size 8, kernel 4, stride 3: out 3, total = 6 + 4 - 8 = 2; size 6 k 2 s 1: total 1
    assert same_pads([8, 6], [4, 2], [3, 1], [1, 1], upper=True) == [1, 0, 1, 1]
    assert same_pads([8, 6], [4, 2], [3, 1], [1, 1], upper=False) == [1, 1, 1, 0]


def test_dynamic_shape_with_same_padding_is_left_alone():
    proto = conv_proto([1, 2, "h", "w"], (3, 2, 3, 3), auto_pad="SAME_UPPER")
    out, modified = run_pass(proto)
    assert not modified
    assert attrs(out.graph.node[0])["auto_pad"] == b"SAME_UPPER"


def test_dynamic_batch_with_static_spatial_dims_is_resolved():
    # pads depend on H and W only: a symbolic batch must not keep auto_pad
    proto = conv_proto(["n", 2, 7, 8], (3, 2, 3, 3), auto_pad="SAME_UPPER", strides=[2, 2])
    out, modified = run_pass(proto)
    assert modified
    a = attrs(out.graph.node[0])
    assert "auto_pad" not in a and a["pads"] == [1, 0, 1, 1]
    check_same_outputs(proto, out, [2, 2, 7, 8])


def test_conv_transpose_gets_explicit_attributes():
    proto = conv_proto([1, 2, 4, 4], (2, 3, 3, 3), op="ConvTranspose", strides=[2, 2])
    out, modified = run_pass(proto)
    assert modified and set(EXPLICIT) <= set(attrs(out.graph.node[0]))
    check_same_outputs(proto, out, [1, 2, 4, 4])


def test_already_explicit_conv_is_not_modified():
    proto = conv_proto(
        [1, 3, 7, 7], (4, 3, 3, 3), kernel_shape=[3, 3], strides=[1, 1], pads=[1, 1, 1, 1],
        dilations=[1, 1], group=1,
    )  # fmt: skip
    out, modified = run_pass(proto)
    assert not modified
    assert out.graph.node[0].SerializeToString() == proto.graph.node[0].SerializeToString()
