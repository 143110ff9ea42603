"""Power-of-two arithmetic against an exact numpy oracle and onnxruntime's Q/DQ."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import onnx
import pytest
from conftest import make_model, run_ort
from onnx import TensorProto, helper

from quark_onnx.config.enums import PowerOfTwoMethod, QuantType
from quark_onnx.params import pof2


def oracle(x: np.ndarray, p: int) -> np.ndarray:
    """clip(round_half_even(x / s), -128, 127) * s in float64."""
    s = 2.0**-p
    return np.clip(np.round(x.astype(np.float64) / s), -128, 127) * s


def qdq_model(p: int, qtype: QuantType) -> onnx.ModelProto:
    dtype = pof2.numpy_dtype(qtype)
    inits = {
        "s": np.array(pof2.scale_of(p)),
        "z": np.array(pof2.zero_point(qtype), dtype=dtype),
    }
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
        helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"]),
    ]
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    return make_model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [None]),
        ],
        inits,
    ), elem


def sample(p: int, rng: np.random.Generator) -> np.ndarray:
    s = 2.0**-p
    halves = (np.arange(-140, 140) + 0.5) * s  # ties at every code, both signs, saturating ends
    noise = rng.normal(scale=80 * s, size=2000)
    return np.concatenate([halves, noise, [0.0, -0.0, 127 * s, -128 * s, 1e6, -1e6]]).astype(
        np.float32
    )


@pytest.mark.parametrize("p", [-3, 0, 4, 7, 12])
@pytest.mark.parametrize("qtype", [QuantType.QInt8, QuantType.QUInt8])
def test_fake_quant_matches_numpy_oracle_and_onnxruntime_exactly(p, qtype):
    x = sample(p, np.random.default_rng(p + 100))
    model, _ = qdq_model(p, qtype)
    (ort_y,) = run_ort(model, {"x": x})
    ours = pof2.fake_quant(x, p, qtype)
    np.testing.assert_array_equal(ours, oracle(x, p).astype(np.float32))
    np.testing.assert_array_equal(ours, ort_y)


def test_quantize_codes_and_zero_point():
    x = np.array([0.5, 1.5, 2.5, -0.5, -2.5, 1000.0, -1000.0], dtype=np.float32)
    np.testing.assert_array_equal(pof2.quantize(x, 0), [0, 2, 2, 0, -2, 127, -128])
    np.testing.assert_array_equal(
        pof2.quantize(x, 0, QuantType.QUInt8), [128, 130, 130, 128, 126, 255, 0]
    )
    assert pof2.quantize(x, 0).dtype == np.int8
    assert pof2.quantize(x, 0, QuantType.QUInt8).dtype == np.uint8
    np.testing.assert_array_equal(pof2.dequantize(np.array([-128, 127]), 3), [-16.0, 15.875])


def test_scale_of_is_exact_power_of_two():
    for p in range(-20, 40):
        s = pof2.scale_of(p)
        assert s.dtype == np.float32
        assert math.frexp(float(s)) == (0.5, 1 - p)


@pytest.mark.parametrize("qtype", [QuantType.QInt8, QuantType.QUInt8])
def test_nonoverflow_is_the_finest_position_without_saturation(qtype):
    rng = np.random.default_rng(1)
    for _ in range(300):
        x = rng.normal(scale=10 ** rng.uniform(-4, 4), size=50)
        p = pof2.nonoverflow_position(x.min(), x.max(), qtype)
        z = pof2.zero_point(qtype)
        codes = np.round(x * 2.0**p) + z
        assert codes.max() <= qtype.qmax and codes.min() >= qtype.qmin
        finer = np.round(x * 2.0 ** (p + 1)) + z
        assert finer.max() > qtype.qmax or finer.min() < qtype.qmin


def test_nonoverflow_boundaries():
    assert pof2.position_for_abs_max(127.0) == 0
    assert pof2.position_for_abs_max(127.5) == -1  # 127.5 rounds to 128: saturates at p=0
    assert pof2.position_for_abs_max(1.0) == 6  # 1.0 * 2^7 = 128 > 127
    assert pof2.nonoverflow_position(-1.0, 0.5) == 7  # -128/128 fits
    assert pof2.position_for_abs_max(0.0) == pof2.POSITION_MAX


def test_minmse_is_the_exhaustive_minimum():
    rng = np.random.default_rng(2)
    for trial in range(40):
        w = rng.standard_t(df=2 + trial % 5, size=400) * 10 ** rng.uniform(-3, 1)
        p = pof2.weight_position(w, PowerOfTwoMethod.MinMSE)
        errors = {q: pof2.mse(w, q) for q in range(-30, 41)}
        best = min(errors.values())
        assert errors[p] == best
        assert p == min(q for q, e in errors.items() if e == best)


def test_minmse_can_clip_outliers_and_nonoverflow_never_does():
    w = np.concatenate([np.full(10000, 0.03), [5.0]])
    p_mse = pof2.weight_position(w, "MinMSE")
    p_no = pof2.weight_position(w, PowerOfTwoMethod.NonOverflow)
    assert p_no == 4  # 5 * 16 = 80 fits, 5 * 32 = 160 does not
    assert p_mse > p_no


def test_bias_positions():
    b = np.array([0.3, -1.7], dtype=np.float32)
    assert pof2.bias_position(b) == pof2.nonoverflow_position(-1.7, 0.3)
    assert pof2.bias_position(b, p_in=5, p_w=7, int32=True) == 12
    with pytest.raises(ValueError):
        pof2.bias_position(b, int32=True)


def test_error_function_is_mse():
    x = np.linspace(-3, 3, 101)
    f = pof2.error_function(x)
    assert f(5) == pof2.mse(x, 5)
    assert f(0) > f(5)


def test_sse_and_mse_match_the_oracle():
    x = sample(3, np.random.default_rng(7))
    x64 = x.astype(np.float64)
    for p in (-2, 0, 3, 8):
        expected = float(np.sum((oracle(x, p) - x64) ** 2))
        assert pof2.sse(x, p) == pytest.approx(expected, rel=1e-12)
        assert pof2.mse(x, p) == pytest.approx(expected / x.size, rel=1e-12)


def test_saturation_position_and_window():
    # 0.25 * 2^9 = 128 >= 127.5: from p = 9 on every |x| >= 0.25 rounds to an extreme code
    assert pof2.saturation_position(0.25) == 9
    assert pof2.saturation_position(127.5) == 0
    assert pof2.saturation_position(127.4) == 1
    assert pof2.minmse_window(-1.0, 3.0, 0.25) == range(pof2.position_for_abs_max(3.0), 10)
    # the window never passes POSITION_MAX
    assert pof2.minmse_window(-1.0, 1.0, 1e-30)[-1] == pof2.POSITION_MAX
    with pytest.raises(ValueError):
        pof2.saturation_position(0.0)


def test_minmse_window_contains_the_global_optimum_above_nonoverflow():
    rng = np.random.default_rng(3)
    for _ in range(30):
        x = rng.standard_t(2, size=300) * 10 ** rng.uniform(-3, 2)
        p_no = pof2.weight_position(x, "NonOverflow")
        errors = {q: pof2.sse(x, q) for q in range(p_no, pof2.POSITION_MAX + 1)}
        best = min(errors.values())
        assert pof2.minmse_position(x) == min(q for q, e in errors.items() if e == best)


@pytest.mark.parametrize("qtype", [QuantType.QInt8, QuantType.QUInt8, QuantType.QInt16])
def test_minmse_search_stops_early_yet_equals_the_exhaustive_argmin(qtype, monkeypatch):
    rng = np.random.default_rng(11)
    kinds = [
        lambda n: rng.standard_normal(n),
        lambda n: np.maximum(rng.standard_normal(n), 0.0),
        lambda n: rng.standard_t(1.5, size=n),
        lambda n: rng.integers(-40, 40, size=n) / 16.0,  # on a power-of-two grid: exact ties
        lambda n: np.concatenate([rng.uniform(-1e-3, 1e-3, n - 1), [50.0]]),  # one outlier
        lambda n: np.full(n, 0.3),
    ]
    evaluated = []
    original = pof2._sse_and_clip64

    def counting(x64, p, q):
        evaluated.append(p)
        return original(x64, p, q)

    monkeypatch.setattr(pof2, "_sse_and_clip64", counting)
    windows = 0
    for kind in kinds:
        for n in (1, 7, 500):
            x = kind(n) * 10 ** rng.uniform(-2, 2)
            if qtype is QuantType.QUInt8:
                x = np.abs(x)
            lo, hi = float(x.min()), float(x.max())
            nz = np.abs(x[x != 0])
            if nz.size == 0:
                assert pof2.minmse_position(x, qtype) == pof2.ZERO_POSITION
                continue
            window = pof2.minmse_window(lo, hi, float(nz.min()), qtype)
            errors = {q: pof2.sse(x, q, qtype) for q in window}
            best = min(errors.values())
            assert pof2.minmse_position(x, qtype) == min(q for q, e in errors.items() if e == best)
            windows += len(window)
    # the clipping bound must have cut the search short somewhere (and it cannot add work)
    assert len(evaluated) < windows


def test_minmse_search_does_not_stop_while_a_later_position_can_win():
    # a large bulk and one far outlier: at p = 3 the clipping error is already half the best
    # error, yet p = 4 wins (errors 20797, 5543, 2466, 2095, 2200 for p = 1..5); a search that
    # stopped on a loose bound would return 3
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.uniform(-1.0, 1.0, 1_000_000), [50.0]])
    errors = {p: pof2.sse(x, p) for p in range(1, 9)}
    assert min(errors, key=errors.get) == 4
    assert pof2.minmse_position(x) == 4


def test_best_position_ties_go_to_the_lower_position():
    assert pof2.best_position([5, 3, 4], [1.0, 2.0, 1.0]) == 4
    assert pof2.best_position(range(3), [0.0, 0.0, 0.0]) == 0
    with pytest.raises(ValueError):
        pof2.best_position([], [])


def test_zero_tensors_take_the_finest_position():
    # any position represents zeros; the finest never constrains the NPU rules
    assert pof2.ZERO_POSITION == pof2.POSITION_MAX
    assert pof2.bias_position(np.zeros(8, np.float32)) == pof2.ZERO_POSITION
    assert pof2.weight_position(np.zeros(8), "MinMSE") == pof2.ZERO_POSITION
    assert pof2.error_function(np.zeros(8))(3) == 0.0


def test_pof2_does_not_import_the_calibration_package():
    import subprocess
    import sys

    code = "import sys, quark_onnx.params.pof2; print('quark_onnx.calibration' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_minmse_in_pieces_equals_the_whole_array_argmin(monkeypatch):
    monkeypatch.setattr(pof2, "CHUNK", 97)  # many pieces, the last one short
    rng = np.random.default_rng(5)
    for trial in range(20):
        x = rng.standard_t(1.5 + trial % 4, size=1000) * 10 ** rng.uniform(-2, 2)
        x[rng.integers(0, x.size, 3)] = [np.nan, np.inf, 0.0]  # ignored / zero
        finite = x[np.isfinite(x)]
        p_no = pof2.weight_position(finite, "NonOverflow")
        errors = {
            q: float(np.sum((oracle(finite, q) - finite) ** 2))
            for q in range(p_no, pof2.POSITION_MAX + 1)
        }
        best = min(errors.values())
        expected = [q for q, e in errors.items() if e <= best * (1 + 1e-12)]
        assert pof2.minmse_position(x) in expected


def test_minmse_never_copies_a_large_weight_whole():
    x = np.random.default_rng(6).standard_normal(2_000_000).astype(np.float32)
    tracemalloc.start()
    try:
        pof2.minmse_position(x)
        pof2.error_function(x)(pof2.minmse_position(x))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # one float64 copy of the whole array is 16 MB; a few float64 pieces are alive at a time
    assert peak < 6 * pof2.CHUNK * 8 < x.size * 8


def test_numpy_dtype_agrees_with_the_qparams_table():
    """pof2 derives the codes' dtype from width and sign (it does not import qparams)."""
    from quark_onnx.params.qparams import numpy_dtype as table

    power_of_two_types = [q for q in QuantType if q.is_integer and q.bits >= 8]
    assert len(power_of_two_types) == 5
    for qtype in power_of_two_types:
        assert pof2.numpy_dtype(qtype) == table(qtype)
