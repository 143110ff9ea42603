"""ConvertBNToConv: exact folds into Conv / ConvTranspose / Gemm, depthwise Conv otherwise."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import make_model, run_ort
from onnx import TensorProto as T
from onnx import helper as h

from quark_onnx.passes import ConvertBNToConv

RNG = np.random.default_rng(0)


def _bn_params(prefix: str, c: int) -> dict[str, np.ndarray]:
    return {
        f"{prefix}_scale": RNG.uniform(0.5, 2.0, c).astype(np.float32),
        f"{prefix}_bias": RNG.normal(0, 1, c).astype(np.float32),
        f"{prefix}_mean": RNG.normal(0, 1, c).astype(np.float32),
        f"{prefix}_var": RNG.uniform(0.1, 3.0, c).astype(np.float32),
    }


def _bn(x: str, y: str, prefix: str = "bn", **attrs) -> onnx.NodeProto:
    names = [f"{prefix}_{k}" for k in ("scale", "bias", "mean", "var")]
    return h.make_node("BatchNormalization", [x, *names], [y], name=prefix, epsilon=1e-3, **attrs)


def _apply(model: onnx.ModelProto, feeds: dict[str, np.ndarray], **options):
    """Run the pass; return (result, new ModelProto, reference outputs, new outputs)."""
    ref = run_ort(model, feeds)
    ir_model = ir.serde.deserialize_model(model)
    result = ConvertBNToConv(**options)(ir_model)
    proto = ir.serde.serialize_model(ir_model)
    onnx.checker.check_model(proto)
    return result, proto, ref, run_ort(proto, feeds)


def _assert_close(ref: list[np.ndarray], new: list[np.ndarray]) -> None:
    for a, b in zip(ref, new, strict=True):
        assert a.shape == b.shape
        tol = 1e-5 * float(np.ptp(a))
        assert np.max(np.abs(a - b)) <= tol, (np.max(np.abs(a - b)), tol)


def _ops(proto: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in proto.graph.node]


@pytest.mark.parametrize("group,with_bias", [(1, True), (1, False), (2, True)])
def test_fold_into_conv(group, with_bias):
    c_in, c_out = 4, 6
    w = RNG.normal(0, 1, (c_out, c_in // group, 3, 3)).astype(np.float32)
    inits = {"w": w, **_bn_params("bn", c_out)}
    conv_inputs = ["x", "w"]
    if with_bias:
        inits["b"] = RNG.normal(0, 1, c_out).astype(np.float32)
        conv_inputs.append("b")
    model = make_model(
        [
            h.make_node("Conv", conv_inputs, ["c"], name="conv", group=group, pads=[1, 1, 1, 1]),
            _bn("c", "y"),
            h.make_node("Relu", ["y"], ["z"]),
        ],
        [h.make_tensor_value_info("x", T.FLOAT, [2, c_in, 5, 5])],
        [h.make_tensor_value_info("z", T.FLOAT, [2, c_out, 5, 5])],
        inits,
    )
    x = RNG.normal(0, 1, (2, c_in, 5, 5)).astype(np.float32)
    result, proto, ref, new = _apply(model, {"x": x})
    assert result.modified
    assert _ops(proto) == ["Conv", "Relu"]
    assert proto.graph.node[0].output[0] == "y"  # the BN output's name is kept
    assert {i.name for i in proto.graph.initializer}.isdisjoint(
        {"w", "bn_scale", "bn_var", "bn_mean", "bn_bias"}
    )
    _assert_close(ref, new)


def test_fold_when_bn_output_is_graph_output():
    w = RNG.normal(0, 1, (3, 2, 1, 1)).astype(np.float32)
    model = make_model(
        [h.make_node("Conv", ["x", "w"], ["c"]), _bn("c", "y")],
        [h.make_tensor_value_info("x", T.FLOAT, [1, 2, 4, 4])],
        [h.make_tensor_value_info("y", T.FLOAT, [1, 3, 4, 4])],
        {"w": w, **_bn_params("bn", 3)},
    )
    x = RNG.normal(0, 1, (1, 2, 4, 4)).astype(np.float32)
    result, proto, ref, new = _apply(model, {"x": x})
    assert result.modified and _ops(proto) == ["Conv"]
    assert [o.name for o in proto.graph.output] == ["y"]
    _assert_close(ref, new)


@pytest.mark.parametrize("group", [1, 2])
def test_fold_into_conv_transpose(group):
    c_in, c_out = 4, 6  # weight layout [C_in, C_out / group, kH, kW]
    w = RNG.normal(0, 1, (c_in, c_out // group, 3, 3)).astype(np.float32)
    b = RNG.normal(0, 1, c_out).astype(np.float32)
    model = make_model(
        [
            h.make_node("ConvTranspose", ["x", "w", "b"], ["c"], group=group, strides=[2, 2]),
            _bn("c", "y"),
        ],
        [h.make_tensor_value_info("x", T.FLOAT, [1, c_in, 4, 4])],
        [h.make_tensor_value_info("y", T.FLOAT, [1, c_out, 9, 9])],
        {"w": w, "b": b, **_bn_params("bn", c_out)},
    )
    x = RNG.normal(0, 1, (1, c_in, 4, 4)).astype(np.float32)
    result, proto, ref, new = _apply(model, {"x": x})
    assert result.modified and _ops(proto) == ["ConvTranspose"]
    _assert_close(ref, new)


@pytest.mark.parametrize(
    "trans_b,c_shape,beta",
    [(0, (5,), 1.0), (1, (5,), 0.5), (1, (1, 5), 2.0), (0, (3, 1), 1.0), (1, None, 1.0)],
)
def test_fold_into_gemm(trans_b, c_shape, beta):
    k, n, m = 4, 5, 3
    bw = RNG.normal(0, 1, (n, k) if trans_b else (k, n)).astype(np.float32)
    inits = {"B": bw, **_bn_params("bn", n)}
    gemm_inputs = ["a", "B"]
    if c_shape is not None:
        inits["C"] = RNG.normal(0, 1, c_shape).astype(np.float32)
        gemm_inputs.append("C")
    model = make_model(
        [
            h.make_node("Gemm", gemm_inputs, ["g"], transB=trans_b, beta=beta, alpha=0.7),
            _bn("g", "y"),
        ],
        [h.make_tensor_value_info("a", T.FLOAT, [m, k])],
        [h.make_tensor_value_info("y", T.FLOAT, [m, n])],
        inits,
    )
    a = RNG.normal(0, 1, (m, k)).astype(np.float32)
    result, proto, ref, new = _apply(model, {"a": a})
    assert result.modified and _ops(proto) == ["Gemm"]
    _assert_close(ref, new)


def _depthwise_checks(proto: onnx.ModelProto, channels: int) -> None:
    conv = next(n for n in proto.graph.node if n.op_type == "Conv" and n.name == "bn")
    attrs = {a.name: h.get_attribute_value(a) for a in conv.attribute}
    assert attrs == {
        "kernel_shape": [1, 1],
        "strides": [1, 1],
        "pads": [0, 0, 0, 0],
        "dilations": [1, 1],
        "group": channels,
    }
    weight = next(i for i in proto.graph.initializer if i.name == conv.input[1])
    assert list(weight.dims) == [channels, 1, 1, 1]


def test_standalone_bn_becomes_depthwise_conv():
    model = make_model(
        [h.make_node("Relu", ["x"], ["r"]), _bn("r", "y")],
        [h.make_tensor_value_info("x", T.FLOAT, [2, 3, 4, 4])],
        [h.make_tensor_value_info("y", T.FLOAT, [2, 3, 4, 4])],
        _bn_params("bn", 3),
    )
    x = RNG.normal(0, 1, (2, 3, 4, 4)).astype(np.float32)
    result, proto, ref, new = _apply(model, {"x": x})
    assert result.modified and _ops(proto) == ["Relu", "Conv"]
    _depthwise_checks(proto, 3)
    _assert_close(ref, new)


def test_conv_with_second_reader_is_not_modified():
    """The Conv output also feeds an Add: the Conv keeps its weights, the BN becomes a Conv."""
    w = RNG.normal(0, 1, (3, 2, 1, 1)).astype(np.float32)
    model = make_model(
        [
            h.make_node("Conv", ["x", "w"], ["c"], name="conv"),
            _bn("c", "y"),
            h.make_node("Add", ["c", "y"], ["z"]),
        ],
        [h.make_tensor_value_info("x", T.FLOAT, [1, 2, 4, 4])],
        [h.make_tensor_value_info("z", T.FLOAT, [1, 3, 4, 4])],
        {"w": w, **_bn_params("bn", 3)},
    )
    x = RNG.normal(0, 1, (1, 2, 4, 4)).astype(np.float32)
    result, proto, ref, new = _apply(model, {"x": x})
    assert result.modified
    conv = next(n for n in proto.graph.node if n.name == "conv")
    assert list(conv.input) == ["x", "w"]
    w_after = next(i for i in proto.graph.initializer if i.name == "w")
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(w_after), w)
    _depthwise_checks(proto, 3)
    _assert_close(ref, new)

    # with the standalone conversion off, nothing at all changes
    ir_model = ir.serde.deserialize_model(model)
    assert not ConvertBNToConv(standalone_to_conv=False)(ir_model).modified


def test_training_mode_bn_is_left_alone():
    c = 3
    node = h.make_node(
        "BatchNormalization",
        ["x", "bn_scale", "bn_bias", "bn_mean", "bn_var"],
        ["y", "running_mean", "running_var"],
        training_mode=1,
    )
    model = make_model(
        [node],
        [h.make_tensor_value_info("x", T.FLOAT, [2, c, 4, 4])],
        [
            h.make_tensor_value_info("y", T.FLOAT, [2, c, 4, 4]),
            h.make_tensor_value_info("running_mean", T.FLOAT, [c]),
            h.make_tensor_value_info("running_var", T.FLOAT, [c]),
        ],
        _bn_params("bn", c),
        opset=15,
    )
    ir_model = ir.serde.deserialize_model(model)
    assert not ConvertBNToConv()(ir_model).modified
    assert [n.op_type for n in ir_model.graph] == ["BatchNormalization"]


def test_runtime_parameters_and_non_4d_are_left_alone():
    # scale is a graph input: not a constant
    params = _bn_params("bn", 3)
    scale = params.pop("bn_scale")
    model = make_model(
        [_bn("x", "y")],
        [
            h.make_tensor_value_info("x", T.FLOAT, [1, 3, 4, 4]),
            h.make_tensor_value_info("bn_scale", T.FLOAT, list(scale.shape)),
        ],
        [h.make_tensor_value_info("y", T.FLOAT, [1, 3, 4, 4])],
        params,
    )
    assert not ConvertBNToConv()(ir.serde.deserialize_model(model)).modified

    # a 3-D standalone BN is not turned into a Conv
    model = make_model(
        [_bn("x", "y")],
        [h.make_tensor_value_info("x", T.FLOAT, [1, 3, 8])],
        [h.make_tensor_value_info("y", T.FLOAT, [1, 3, 8])],
        _bn_params("bn", 3),
    )
    assert not ConvertBNToConv()(ir.serde.deserialize_model(model)).modified


def test_shared_conv_weight_is_not_modified_for_the_other_reader():
    w = RNG.normal(0, 1, (3, 3, 1, 1)).astype(np.float32)
    model = make_model(
        [
            h.make_node("Conv", ["x", "w"], ["c"], name="conv"),
            _bn("c", "y"),
            h.make_node("Conv", ["y", "w"], ["z"], name="conv2"),
        ],
        [h.make_tensor_value_info("x", T.FLOAT, [1, 3, 4, 4])],
        [h.make_tensor_value_info("z", T.FLOAT, [1, 3, 4, 4])],
        {"w": w, **_bn_params("bn", 3)},
    )
    x = RNG.normal(0, 1, (1, 3, 4, 4)).astype(np.float32)
    result, proto, ref, new = _apply(model, {"x": x})
    assert result.modified and _ops(proto) == ["Conv", "Conv"]
    assert proto.graph.node[1].input[1] == "w"
    assert proto.graph.node[0].input[1] != "w"
    _assert_close(ref, new)


@pytest.mark.parametrize("ir_version,folds", [(3, True), (8, False)])
def test_initializers_listed_as_inputs(ir_version, folds):
    """Overridable initializers are constants only in IR < 4 models (which must list them)."""
    w = RNG.normal(0, 1, (3, 2, 1, 1)).astype(np.float32)
    inits = {"w": w, **_bn_params("bn", 3)}
    graph = h.make_graph(
        [h.make_node("Conv", ["x", "w"], ["c"]), _bn("c", "y")],
        "legacy",
        [h.make_tensor_value_info("x", T.FLOAT, [1, 2, 4, 4])]
        + [h.make_tensor_value_info(k, T.FLOAT, list(v.shape)) for k, v in inits.items()],
        [h.make_tensor_value_info("y", T.FLOAT, [1, 3, 4, 4])],
        [onnx.numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 13)])
    model.ir_version = ir_version
    ir_model = ir.serde.deserialize_model(model)
    assert ConvertBNToConv()(ir_model).modified == folds
