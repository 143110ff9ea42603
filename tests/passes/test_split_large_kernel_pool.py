"""SplitLargeKernelPool: a pool over more than 512 elements becomes two exact average pools."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from conftest import make_model, run_ort
from onnx import TensorProto as T
from onnx import helper as h

from quark_onnx.passes import SplitLargeKernelPool
from quark_onnx.passes.split_large_kernel_pool import choose_split

RNG = np.random.default_rng(2)


def _gap(shape):
    out = [*shape[:2], *([1] * (len(shape) - 2))]
    return make_model(
        [h.make_node("GlobalAveragePool", ["x"], ["y"], name="gap")],
        [h.make_tensor_value_info("x", T.FLOAT, list(shape))],
        [h.make_tensor_value_info("y", T.FLOAT, out)],
    )


def _avg(shape, kernel, strides, out, **attrs):
    return make_model(
        [h.make_node("AveragePool", ["x"], ["y"], kernel_shape=kernel, strides=strides, **attrs)],
        [h.make_tensor_value_info("x", T.FLOAT, list(shape))],
        [h.make_tensor_value_info("y", T.FLOAT, list(out))],
    )


def _apply(model, **options):
    ir_model = ir.serde.deserialize_model(model)
    result = SplitLargeKernelPool(**options)(ir_model)
    proto = ir.serde.serialize_model(ir_model)
    onnx.checker.check_model(proto, full_check=True)
    return result, proto


def _check_same(model, proto, shape):
    x = RNG.normal(0, 2, shape).astype(np.float32)
    (ref,) = run_ort(model, {"x": x})
    (new,) = run_ort(proto, {"x": x})
    assert new.shape == ref.shape
    assert np.max(np.abs(new - ref)) <= 1e-5 * max(np.ptp(ref), np.abs(ref).max())


def _kernels(proto):
    return [
        (n.op_type, {a.name: list(a.ints) for a in n.attribute if a.name != "pads"})
        for n in proto.graph.node
    ]


@pytest.mark.parametrize(
    "shape,first,second",
    [
        ((1, 4, 32, 32), [4, 4], (8, 8)),  # Quark: largest divisor <= sqrt
        ((2, 3, 24, 40), [4, 5], (6, 8)),
        ((1, 3, 1024), [32], (32,)),  # 1-D
    ],
)
def test_global_average_pool_split(shape, first, second):
    model = _gap(shape)
    result, proto = _apply(model)
    assert result.modified
    kernels = _kernels(proto)
    assert kernels[0] == ("AveragePool", {"kernel_shape": first, "strides": first})
    assert kernels[1][0] == "GlobalAveragePool"
    mid = next(v for v in proto.graph.value_info if v.name == proto.graph.node[1].input[0])
    assert [d.dim_value for d in mid.type.tensor_type.shape.dim][2:] == list(second)
    assert all(np.prod(k) <= 512 for k in (first, second))
    _check_same(model, proto, shape)


def test_small_kernels_are_left_alone():
    for shape in [(1, 4, 16, 32), (1, 4, 7, 7), (1, 4, 512)]:
        result, proto = _apply(_gap(shape))
        assert not result.modified
        assert [n.op_type for n in proto.graph.node] == ["GlobalAveragePool"]
    result, _ = _apply(_avg((1, 2, 16, 16), [16, 16], [1, 1], (1, 2, 1, 1)))
    assert not result.modified


def test_unsplittable_kernel_warns(caplog):
    with caplog.at_level(logging.WARNING):
        result, _ = _apply(_gap((1, 2, 1, 521)))  # 521 is prime: no two factors within 512
    assert not result.modified
    assert "cannot be split" in caplog.text


def test_fallback_when_quarks_choice_exceeds_the_limit():
    # Quark's square-root choice for 23 x 46 is (1, 2) then (23, 23) = 529 > 512: another split
    # (both stages <= 46 elements) is searched for instead of giving up.
    model = _gap((1, 2, 23, 46))
    result, proto = _apply(model)
    assert result.modified
    first = _kernels(proto)[0][1]["kernel_shape"]
    assert np.prod(first) <= 512 and 23 * 46 // np.prod(first) <= 512
    assert max(np.prod(first), 23 * 46 // np.prod(first)) == 46
    _check_same(model, proto, (1, 2, 23, 46))

    # 29 x 31 (both prime): a (1, 31) pool then a (29, 1) one
    model = _gap((1, 2, 29, 31))
    result, proto = _apply(model)
    assert result.modified
    _check_same(model, proto, (1, 2, 29, 31))


def test_limit_is_an_option():
    model = _gap((1, 2, 8, 8))
    assert not _apply(model)[0].modified
    result, proto = _apply(model, max_kernel_area=16)
    assert result.modified
    assert _kernels(proto)[0][1]["kernel_shape"] == [2, 2]  # 8 -> 2 x 4 (largest divisor <= 2.8)
    _check_same(model, proto, (1, 2, 8, 8))
    with pytest.raises(ValueError, match="max_kernel_area"):
        SplitLargeKernelPool(max_kernel_area=0)


def test_average_pool_covering_the_input():
    model = _avg((1, 3, 32, 32), [32, 32], [1, 1], (1, 3, 1, 1))
    result, proto = _apply(model)
    assert result.modified
    assert _kernels(proto) == [
        ("AveragePool", {"kernel_shape": [4, 4], "strides": [4, 4]}),
        ("AveragePool", {"kernel_shape": [8, 8], "strides": [1, 1]}),
    ]
    _check_same(model, proto, (1, 3, 32, 32))


def test_strided_average_pool():
    # 24x24 windows every 8: the first stage's kernel must divide the stride (4 | 8)
    model = _avg((1, 2, 48, 56), [24, 24], [8, 8], (1, 2, 4, 5))
    result, proto = _apply(model)
    assert result.modified
    assert _kernels(proto) == [
        ("AveragePool", {"kernel_shape": [4, 4], "strides": [4, 4]}),
        ("AveragePool", {"kernel_shape": [6, 6], "strides": [2, 2]}),
    ]
    _check_same(model, proto, (1, 2, 48, 56))

    # stride 3 and kernel 24: only divisors of 3 are allowed (3 x 3, then 8 x 8)
    model = _avg((1, 2, 30, 30), [24, 24], [3, 3], (1, 2, 3, 3))
    result, proto = _apply(model)
    assert result.modified
    assert _kernels(proto)[0][1]["kernel_shape"] == [3, 3]
    _check_same(model, proto, (1, 2, 30, 30))


def test_padded_or_ceil_average_pool_is_left_alone():
    model = _avg((1, 2, 32, 32), [32, 32], [1, 1], (1, 2, 3, 3), pads=[1, 1, 1, 1])
    assert not _apply(model)[0].modified
    model = _avg((1, 2, 40, 40), [24, 24], [16, 16], (1, 2, 2, 2), ceil_mode=1)
    assert not _apply(model)[0].modified


def test_choose_split():
    assert choose_split((32, 32), [[1, 2, 4, 8, 16, 32]] * 2, 512) == (4, 4)
    assert choose_split((29, 31), [[1, 29], [1, 31]], 512) in {(1, 31), (29, 1)}
    assert choose_split((521,), [[1, 521]], 512) is None
    assert choose_split((24, 24), [[1, 3], [1, 3]], 512) == (3, 3)
