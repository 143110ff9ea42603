"""DPU simulation passes: exact hardware numerics against numpy, and must-not-fire cases."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import make_model, run_ort
from onnx import TensorProto, helper

from quark_onnx.passes import (
    ConvertAvgPoolToDPUVersion,
    ConvertHardSigmoidToDPUVersion,
    ConvertLeakyReluToDPUVersion,
)
from quark_onnx.passes.convert_avg_pool_to_dpu_version import closest_reciprocal, pool_reciprocal

F = TensorProto.FLOAT


def vi(name, shape):
    return helper.make_tensor_value_info(name, F, shape)


def apply(pass_, proto):
    model = ir.serde.deserialize_model(proto)
    result = pass_(model)
    out = ir.serde.serialize_model(result.model)
    onnx.checker.check_model(out)
    return out, result.modified


def inits(proto):
    return {i.name: onnx.numpy_helper.to_array(i) for i in proto.graph.initializer}


# --- LeakyRelu ----------------------------------------------------------------------------------
def leaky(alpha=None):
    kw = {} if alpha is None else {"alpha": alpha}
    return make_model(
        [helper.make_node("LeakyRelu", ["x"], ["y"], name="lr", **kw)], [vi("x", [64])],
        [vi("y", [64])],
    )  # fmt: skip


def test_leaky_relu_alpha_becomes_26_over_256():
    assert ConvertLeakyReluToDPUVersion.changes_numerics
    out, modified = apply(ConvertLeakyReluToDPUVersion(), leaky(0.1))
    assert modified
    assert out.graph.node[0].attribute[0].f == np.float32(26 / 256)
    x = np.linspace(-8, 8, 64, dtype=np.float32)
    (y,) = run_ort(out, {"x": x})
    np.testing.assert_array_equal(y, np.where(x >= 0, x, x * np.float32(26 / 256)))


def test_leaky_relu_default_alpha_is_written():
    out, modified = apply(ConvertLeakyReluToDPUVersion(), leaky())
    assert modified and out.graph.node[0].attribute[0].f == np.float32(3 / 256)


def test_leaky_relu_on_the_grid_is_not_changed():
    proto = leaky(0.25)
    out, modified = apply(ConvertLeakyReluToDPUVersion(), proto)
    assert not modified
    assert out.graph.node[0].SerializeToString() == proto.graph.node[0].SerializeToString()


# --- HardSigmoid --------------------------------------------------------------------------------
def hard_sigmoid(alpha, beta=None):
    kw = {"alpha": alpha} | ({} if beta is None else {"beta": beta})
    return make_model(
        [helper.make_node("HardSigmoid", ["x"], ["y"], name="hs", **kw)], [vi("x", [97])],
        [vi("y", [97])],
    )  # fmt: skip


def test_hard_sigmoid_computes_the_npu_form():
    out, modified = apply(ConvertHardSigmoidToDPUVersion(), hard_sigmoid(1 / 6))
    assert modified and ConvertHardSigmoidToDPUVersion.changes_numerics
    assert [n.op_type for n in out.graph.node] == ["HardSigmoid", "Mul"]
    c = next(v for k, v in inits(out).items() if "dpu_scale" in k)
    assert c == np.float32(16386 / 16384)  # (2731/16384) / (1/6), exact
    assert [o.name for o in out.graph.output] == ["y"]
    x = (np.arange(97, dtype=np.float32) - 48) / 8  # -6 .. 6 in steps of 1/8
    (y,) = run_ort(out, {"x": x})
    hs = np.clip(x * np.float32(1 / 6) + np.float32(0.5), 0, 1).astype(np.float32)
    np.testing.assert_array_equal(y, hs * c)
    linear = np.abs(x) < 3
    # on the linear part this is the hardware's (x + 3) * 2731 / 2^14
    np.testing.assert_allclose(y[linear], (x[linear] + 3) * 2731 / 16384, rtol=0, atol=1e-7)


@pytest.mark.parametrize(("alpha", "beta"), [(0.2, None), (1 / 6, 0.25)])
def test_other_hard_sigmoids_are_not_changed(alpha, beta):
    out, modified = apply(ConvertHardSigmoidToDPUVersion(), hard_sigmoid(alpha, beta))
    assert not modified and [n.op_type for n in out.graph.node] == ["HardSigmoid"]


def test_hard_sigmoid_pass_is_idempotent():
    once, _ = apply(ConvertHardSigmoidToDPUVersion(), hard_sigmoid(1 / 6))
    twice, modified = apply(ConvertHardSigmoidToDPUVersion(), once)
    assert not modified and len(twice.graph.node) == 2


# --- average pools ------------------------------------------------------------------------------
def test_reciprocal_table_and_rule():
    assert pool_reciprocal(3, 3) == (7, 6)
    assert pool_reciprocal(5, 5) == (10, 8)
    assert pool_reciprocal(6, 6) == (7, 8)
    assert pool_reciprocal(7, 7) == (21, 10)
    assert pool_reciprocal(14, 14) == (21, 12)
    for area in (2, 4, 9, 10, 12, 25, 49, 100, 1000):
        k, n = closest_reciprocal(area)
        n_max = 7 + int(np.ceil(np.log2(area)))
        best = min(abs(round(2**m / area) / 2**m - 1 / area) for m in range(n_max))
        assert n < n_max and abs(k / 2**n - 1 / area) == best


def pool_model(op, x_shape, **attrs):
    return make_model(
        [helper.make_node(op, ["x"], ["y"], name="pool", **attrs)], [vi("x", x_shape)],
        [vi("y", ["n", "c", "h", "w"])],
    )  # fmt: skip


@pytest.mark.parametrize(
    ("op", "shape", "attrs", "area", "k", "n"),
    [
        ("AveragePool", [1, 2, 9, 9], {"kernel_shape": [3, 3], "strides": [3, 3]}, 9, 7, 6),
        ("GlobalAveragePool", [1, 2, 7, 7], {}, 49, 21, 10),
        ("GlobalAveragePool", [1, 2, 14, 14], {}, 196, 21, 12),
        ("GlobalAveragePool", [1, 2, 5, 5], {}, 25, 10, 8),
    ],
)
def test_average_pool_is_multiplied_by_the_hardware_factor(op, shape, attrs, area, k, n):
    proto = pool_model(op, shape, **attrs)
    out, modified = apply(ConvertAvgPoolToDPUVersion(), proto)
    assert modified and ConvertAvgPoolToDPUVersion.changes_numerics
    assert [nd.op_type for nd in out.graph.node] == [op, "Mul"]
    (factor,) = inits(out).values()
    assert factor == np.float32(area * k / 2**n)
    x = np.random.default_rng(0).integers(-50, 50, size=shape).astype(np.float32)
    (y,) = run_ort(out, {"x": x})
    (pooled,) = run_ort(proto, {"x": x})
    np.testing.assert_array_equal(y, pooled * factor)  # exactly the pool times A*k/2^n
    # and that is the hardware's sum * k / 2^n (integer inputs: sums exact)
    if op == "GlobalAveragePool":
        sums = x.sum(axis=(2, 3), keepdims=True)
    else:
        sums = x.reshape(1, 2, 3, 3, 3, 3).sum(axis=(3, 5))
    np.testing.assert_allclose(y, sums * k / 2**n, rtol=1e-6)


def test_reduce_mean_over_hw_uses_the_closest_reciprocal():
    proto = make_model(
        [helper.make_node("ReduceMean", ["x"], ["y"], name="rm", axes=[2, 3], keepdims=1)],
        [vi("x", [1, 2, 3, 3])], [vi("y", [1, 2, 1, 1])], opset=17,
    )  # fmt: skip
    out, modified = apply(ConvertAvgPoolToDPUVersion(), proto)
    assert modified
    (factor,) = inits(out).values()
    k, n = closest_reciprocal(9)
    assert (k, n) == (57, 9) and factor == np.float32(9 * 57 / 512)  # 57/512 ~ 1/9
    out, modified = apply(ConvertAvgPoolToDPUVersion(reduce_mean=False), proto)
    assert not modified


@pytest.mark.parametrize(
    ("op", "shape", "attrs"),
    [
        ("GlobalAveragePool", [1, 2, 4, 4], {}),  # 1/16 is exact: nothing to simulate
        ("AveragePool", [1, 2, 4, 4], {"kernel_shape": [2, 2]}),
        ("GlobalAveragePool", [1, 2, "h", "w"], {}),  # unknown area
        ("MaxPool", [1, 2, 3, 3], {"kernel_shape": [3, 3]}),
    ],
)
def test_pools_that_need_no_factor_are_not_changed(op, shape, attrs):
    proto = pool_model(op, shape, **attrs)
    out, modified = apply(ConvertAvgPoolToDPUVersion(), proto)
    assert not modified and len(out.graph.node) == 1


def test_avg_pool_pass_is_idempotent_and_keeps_output_names():
    proto = pool_model("GlobalAveragePool", [1, 2, 7, 7])
    once, _ = apply(ConvertAvgPoolToDPUVersion(), proto)
    assert [o.name for o in once.graph.output] == ["y"]
    assert once.graph.node[1].output[0] == "y"
    twice, modified = apply(ConvertAvgPoolToDPUVersion(), once)
    assert not modified and len(twice.graph.node) == 2
