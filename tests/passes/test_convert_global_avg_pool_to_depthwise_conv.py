"""ConvertGlobalAvgPoolToDepthwiseConv: a global average pool becomes an exact depthwise Conv."""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import make_model, run_ort
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

from quark_onnx import ArrayDataReader, Config, ModelQuantizer, get_default_config
from quark_onnx.npu.readiness import check
from quark_onnx.npu.rules import MAX_CONV_KERNEL_SIDE
from quark_onnx.params.pof2 import fake_quant, weight_position
from quark_onnx.passes import ConvertGlobalAvgPoolToDepthwiseConv
from quark_onnx.passes.convert_avg_pool_to_dpu_version import pool_reciprocal

RNG = np.random.default_rng(3)


def _relu_gap(shape, tail_flatten=True):
    """``y = Flatten(GlobalAveragePool(Relu(x)))`` (or the pool output itself)."""
    c = shape[1] if isinstance(shape[1], int) else 1
    nodes = [
        h.make_node("Relu", ["x"], ["r"], name="relu"),
        h.make_node("GlobalAveragePool", ["r"], ["g" if tail_flatten else "y"], name="gap"),
    ]
    out = [shape[0], c]
    if tail_flatten:
        nodes.append(h.make_node("Flatten", ["g"], ["y"], axis=1, name="flat"))
    else:
        out += [1] * (len(shape) - 2)
    return make_model(
        nodes,
        [h.make_tensor_value_info("x", T.FLOAT, list(shape))],
        [h.make_tensor_value_info("y", T.FLOAT, out)],
    )


def _apply(model, **options):
    ir_model = ir.serde.deserialize_model(model)
    result = ConvertGlobalAvgPoolToDepthwiseConv(**options)(ir_model)
    proto = ir.serde.serialize_model(ir_model)
    onnx.checker.check_model(proto, full_check=True)
    return result, proto


@pytest.mark.parametrize(
    "shape", [(2, 8, 13, 13), (1, 4, 7, 5), (1, 3, 16, 16), (3, 6, 1, 1), (1, 5, 16, 2)]
)
@pytest.mark.parametrize("tail_flatten", [True, False])
def test_float_outputs_are_preserved(shape, tail_flatten):
    model = _relu_gap(shape, tail_flatten)
    result, proto = _apply(model)
    assert result.modified
    ops = [n.op_type for n in proto.graph.node]
    assert "GlobalAveragePool" not in ops and ops.count("Conv") == 1
    conv = next(n for n in proto.graph.node if n.op_type == "Conv")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in conv.attribute}
    assert attrs == {
        "kernel_shape": list(shape[2:]),
        "strides": [1, 1],
        "pads": [0, 0, 0, 0],
        "dilations": [1, 1],
        "group": shape[1],
    }
    (weight,) = [i for i in proto.graph.initializer if i.name == conv.input[1]]
    assert numpy_helper.to_array(weight).shape == (shape[1], 1, *shape[2:])
    assert proto.graph.output[0].name == "y"  # the interface is unchanged
    x = RNG.normal(0, 50, shape).astype(np.float32)
    (ref,) = run_ort(model, {"x": x})
    (new,) = run_ort(proto, {"x": x})
    assert new.shape == ref.shape
    assert np.max(np.abs(new - ref)) <= 1e-5 * np.abs(ref).max()


def _gap_only(shape, dims=None):
    dims = dims or list(shape)
    return make_model(
        [h.make_node("GlobalAveragePool", ["x"], ["y"], name="gap")],
        [h.make_tensor_value_info("x", T.FLOAT, dims)],
        [h.make_tensor_value_info("y", T.FLOAT, [*dims[:2], *([1] * (len(dims) - 2))])],
    )


def _avg_pool(shape=(1, 4, 7, 7), out=(1, 4, 1, 1), **attrs):
    return make_model(
        [h.make_node("AveragePool", ["x"], ["y"], name="pool", **attrs)],
        [h.make_tensor_value_info("x", T.FLOAT, list(shape))],
        [h.make_tensor_value_info("y", T.FLOAT, list(out))],
    )


@pytest.mark.parametrize(
    "attrs",
    [
        {"kernel_shape": [7, 7]},
        {"kernel_shape": [7, 7], "strides": [2, 2], "pads": [0, 0, 0, 0], "ceil_mode": 1},
        {"kernel_shape": [7, 7], "auto_pad": "VALID", "count_include_pad": 1},
    ],
)
def test_an_average_pool_over_the_whole_map_is_a_global_mean(attrs):
    """Older exports write ResNet's last pool as AveragePool(7x7) on a 7x7 map."""
    model = _avg_pool((2, 6, 7, 7), (2, 6, 1, 1), **attrs)
    result, proto = _apply(model)
    assert result.modified
    assert [n.op_type for n in proto.graph.node] == ["Conv"]
    x = RNG.normal(0, 50, (2, 6, 7, 7)).astype(np.float32)
    (ref,) = run_ort(model, {"x": x})
    (new,) = run_ort(proto, {"x": x})
    assert new.shape == ref.shape == (2, 6, 1, 1)
    assert np.max(np.abs(new - ref)) <= 1e-5 * np.abs(ref).max()


@pytest.mark.parametrize(
    "model, options",
    [
        # a side above the NPU's Conv kernel limit and no block stage allowed: stays a pool
        (_gap_only((1, 4, MAX_CONV_KERNEL_SIDE + 1, 4)), {"max_pool_kernel_area": 0}),
        (_gap_only((1, 4, 13, 13)), {"max_kernel_side": 12, "max_pool_kernel_area": 1}),
        # blocks bringing 17 x 31 within the Conv limit are the whole 527-element window: above
        # the pool's area limit 512
        (_gap_only((1, 4, 17, 31)), {}),
        # unknown spatial size: no kernel to write
        (_gap_only(None, ["N", 4, "H", "W"]), {}),
        # unknown channel count: no group to write
        (_gap_only(None, [1, "C", 7, 7]), {}),
        # not 2-D
        (_gap_only((1, 4, 9)), {}),
        (_gap_only((1, 4, 3, 3, 3)), {}),
        # a sliding/padded average pool and a global max pool are other ops
        (
            make_model(
                [h.make_node("AveragePool", ["x"], ["y"], kernel_shape=[7, 7], pads=[1, 1, 1, 1])],
                [h.make_tensor_value_info("x", T.FLOAT, [1, 4, 7, 7])],
                [h.make_tensor_value_info("y", T.FLOAT, [1, 4, 3, 3])],
            ),
            {},
        ),
        # an AveragePool whose window slides, or pads, is not a global mean
        (_avg_pool(out=(1, 4, 3, 3), kernel_shape=[3, 3], strides=[2, 2]), {}),
        (_avg_pool(out=(1, 4, 7, 7), kernel_shape=[7, 7], auto_pad="SAME_UPPER"), {}),
        (
            make_model(
                [h.make_node("GlobalMaxPool", ["x"], ["y"])],
                [h.make_tensor_value_info("x", T.FLOAT, [1, 4, 7, 7])],
                [h.make_tensor_value_info("y", T.FLOAT, [1, 4, 1, 1])],
            ),
            {},
        ),
    ],
)
def test_pools_it_must_not_convert(model, options):
    before = [n.op_type for n in model.graph.node]
    result, proto = _apply(model, **options)
    assert not result.modified
    assert [n.op_type for n in proto.graph.node] == before


def test_limit_must_be_positive():
    with pytest.raises(ValueError, match="max_kernel_side"):
        ConvertGlobalAvgPoolToDepthwiseConv(max_kernel_side=0)
    with pytest.raises(ValueError, match="max_pool_kernel_area"):
        ConvertGlobalAvgPoolToDepthwiseConv(max_pool_kernel_area=-1)


@pytest.mark.parametrize(
    "shape, blocks",
    [
        ((1, 6, 3, 96), (1, 6)),  # PaddleOCR's squeeze-excite pools: 3 x 96 -> 3 x 16
        ((2, 4, 24, 24), (2, 2)),  # -> 12 x 12
        ((1, 3, 48, 17), (3, 17)),  # 17 is prime: its block is the whole side
        ((1, 2, 20, 7), (2, 1)),
    ],
)
def test_large_pools_average_blocks_first(shape, blocks):
    model = _relu_gap(shape)
    result, proto = _apply(model)
    assert result.modified
    ops = [n for n in proto.graph.node if n.op_type in ("AveragePool", "Conv", "GlobalAveragePool")]
    assert [n.op_type for n in ops] == ["AveragePool", "Conv"]
    pool_attrs = {a.name: list(a.ints) for a in ops[0].attribute}
    assert pool_attrs == {"kernel_shape": list(blocks), "strides": list(blocks), "pads": [0] * 4}
    conv_kernel = next(list(a.ints) for a in ops[1].attribute if a.name == "kernel_shape")
    assert conv_kernel == [k // d for k, d in zip(shape[2:], blocks, strict=True)]
    assert max(conv_kernel) <= MAX_CONV_KERNEL_SIDE
    x = RNG.normal(0, 50, shape).astype(np.float32)
    (ref,) = run_ort(model, {"x": x})
    (new,) = run_ort(proto, {"x": x})
    assert np.max(np.abs(new - ref)) <= 1e-5 * np.abs(ref).max()


@pytest.mark.parametrize("side_h", range(1, MAX_CONV_KERNEL_SIDE + 1))
def test_quantized_weight_is_never_worse_than_the_pool_reciprocal(side_h):
    """1/(H W) as a per-tensor power-of-two int8 weight (the position the quantizer chooses for
    it, MinMSE and NonOverflow) is at least as close to 1/(H W) as the hardware pool's k/2^n."""
    for side_w in range(1, MAX_CONV_KERNEL_SIDE + 1):
        area = side_h * side_w
        weight = np.full((4, 1, side_h, side_w), 1.0 / area, dtype=np.float32)
        k, n = pool_reciprocal(side_h, side_w)
        pool_error = abs(area * k / 2**n - 1)
        for method in ("MinMSE", "NonOverflow"):
            p = weight_position(weight, method)
            q = float(fake_quant(weight, p).ravel()[0])
            assert abs(area * q - 1) <= pool_error + 1e-12, (side_h, side_w, method)
            assert abs(area * q - 1) <= 2.0 ** -math.floor(math.log2(127))  # 7 significant bits


def _big_relu_mean_model():
    """x -> Conv 3x3 (4 -> 8) -> Relu -> GlobalAveragePool -> Conv 1x1 -> y: the pool reads a
    wide Relu range (~hundreds) and outputs its mean (~tens)."""
    w1 = (RNG.normal(0, 1, (8, 4, 3, 3)) * 20).astype(np.float32)
    w2 = (RNG.normal(0, 1, (3, 8, 1, 1)) * 0.1).astype(np.float32)
    return make_model(
        [
            h.make_node("Conv", ["x", "w1"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
            h.make_node("Relu", ["c"], ["r"]),
            h.make_node("GlobalAveragePool", ["r"], ["g"]),
            h.make_node("Conv", ["g", "w2"], ["y"], kernel_shape=[1, 1]),
        ],
        [h.make_tensor_value_info("x", T.FLOAT, [1, 4, 12, 12])],
        [h.make_tensor_value_info("y", T.FLOAT, [1, 3, 1, 1])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )


def _xint8(model, samples, convert):
    config = get_default_config("XINT8")
    config.extra_options["ConvertGlobalAvgPoolToDepthwiseConv"] = convert
    quantizer = ModelQuantizer(Config(global_quant_config=config))
    quantized = quantizer.quantize_model(model, None, ArrayDataReader(samples))
    return quantizer, quantized


def test_xint8_gives_the_mean_its_own_position_and_stays_ready():
    model = _big_relu_mean_model()
    samples = [{"x": RNG.normal(0, 1, (1, 4, 12, 12)).astype(np.float32)} for _ in range(16)]
    pooled, pooled_model = _xint8(model, samples, convert=False)
    conv, conv_model = _xint8(model, samples, convert=True)
    # the pool: input and output share one position; the Conv: the mean has a finer one
    assert pooled.report.positions["r"] == pooled.report.positions["g"]
    assert conv.report.positions["g"] > conv.report.positions["r"]
    assert check(conv_model).ready, check(conv_model).summary()
    # and the quantized model computes the float one more closely (oracle: float outputs)
    tests = [RNG.normal(0, 1, (1, 4, 12, 12)).astype(np.float32) for _ in range(16)]

    def error(quantized):
        return sum(
            float(np.sum((run_ort(quantized, {"x": x})[0] - run_ort(model, {"x": x})[0]) ** 2))
            for x in tests
        )

    assert error(conv_model) < error(pooled_model)
