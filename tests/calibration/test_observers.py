"""Observers against exact numpy oracles on the concatenated data.

One oracle (numpy, independent of quark_onnx) checks both paths of the power-of-two numerics: the
array functions of :mod:`quark_onnx.params.pof2` (weights) and the histogram observers
(activations).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from quark_onnx.calibration import CalibrationResult, quantize_pof2
from quark_onnx.calibration.buckets import bucket_edges
from quark_onnx.calibration.histogram_search import (
    entropy_threshold_from_histogram,
    mse_threshold_from_histogram,
    resample_linear,
)
from quark_onnx.calibration.observers import HistogramObserver, MinMaxObserver
from quark_onnx.config.enums import QuantType
from quark_onnx.errors import CalibrationError
from quark_onnx.params import pof2


def _data(kind: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "normal":
        x = rng.standard_normal(n) * 10 ** rng.uniform(-3, 3)
    elif kind == "student2":  # heavy tails
        x = rng.standard_t(2, n) * 10 ** rng.uniform(-2, 2)
    elif kind == "cauchy_relu":
        x = np.maximum(rng.standard_cauchy(n), 0)
    elif kind == "integers":  # many exact ties x = (k + 1/2) s
        x = np.round(rng.standard_normal(n) * 60)
    else:
        raise ValueError(kind)
    return x.astype(np.float32)


KINDS = ["normal", "student2", "cauchy_relu", "integers"]

# --- the numpy oracle ----------------------------------------------------------------------------

#: centred code range (qmin - z, qmax - z); uint8 with zero point 128 is int8's
CODES = {
    QuantType.QInt8: (-128, 127),
    QuantType.QUInt8: (-128, 127),
    QuantType.QInt16: (-32768, 32767),
}


def oracle_fake_quant(x: np.ndarray, p: int, qtype: QuantType = QuantType.QInt8) -> np.ndarray:
    """clip(round_half_even(x * 2^p), lo, hi) * 2^-p in float64."""
    lo, hi = CODES[qtype]
    return np.clip(np.round(x.astype(np.float64) * 2.0**p), lo, hi) * 2.0**-p


def oracle_sse(x: np.ndarray, p: int, qtype: QuantType = QuantType.QInt8) -> float:
    x64 = x.astype(np.float64)
    return float(np.sum((x64 - oracle_fake_quant(x64, p, qtype)) ** 2))


def oracle_nonoverflow(x: np.ndarray, qtype: QuantType = QuantType.QInt8) -> int:
    """Largest p in [-40, 40] at which no rounded code leaves the code range."""
    lo, hi = CODES[qtype]
    x64 = x.astype(np.float64)
    fits = []
    for p in range(-40, 41):
        codes = np.round(x64 * 2.0**p)
        if codes.min() >= lo and codes.max() <= hi:
            fits.append(p)
    return max(fits)


def oracle_minmse(x: np.ndarray, qtype: QuantType = QuantType.QInt8) -> int:
    """argmin over p in [p_nonoverflow, 40] of the SSE on all data; ties -> smaller p."""
    p0 = oracle_nonoverflow(x, qtype)
    sses = [oracle_sse(x, p, qtype) for p in range(p0, 41)]
    return p0 + int(np.argmin(sses))


def _stream(obs, x: np.ndarray, parts: int, seed: int):
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, x.size), size=parts - 1, replace=False))
    for chunk in np.split(x, cuts):
        obs.update(chunk.reshape(-1, 1) if chunk.size % 2 else chunk.reshape(2, -1))
    return obs


# --- one definition, two paths -------------------------------------------------------------------


def test_quantize_pof2_is_pof2_fake_quant_and_matches_the_oracle():
    assert quantize_pof2 is pof2.fake_quant
    x = np.array([0.0, 0.3, 0.5, 1.5, 2.5, -2.5, 100.0, -100.0], np.float32)
    # p = 0: round half to even, clip to [-128, 127]
    np.testing.assert_array_equal(pof2.fake_quant(x, 0), [0, 0, 0, 2, 2, -2, 100, -100])
    # p = 1: scale 1/2, codes clip at 127 -> 63.5, -128 -> -64
    np.testing.assert_array_equal(pof2.fake_quant(x, 1), [0, 0.5, 0.5, 1.5, 2.5, -2.5, 63.5, -64])
    # uint8 with zero point 128 represents the same values as int8
    np.testing.assert_array_equal(pof2.fake_quant(x, 1, QuantType.QUInt8), pof2.fake_quant(x, 1))
    assert pof2.fake_quant(np.array([300.0]), 0, QuantType.QInt16)[0] == 300.0
    for p in (-2, 0, 3, 9):
        for q in CODES:
            np.testing.assert_array_equal(pof2.fake_quant(x, p, q), oracle_fake_quant(x, p, q))


@pytest.mark.parametrize("absmax", [1e-6, 0.1, 0.99, 1.0, 3.0, 127.0, 127.5, 128.0, 1e5])
@pytest.mark.parametrize("qtype", [QuantType.QInt8, QuantType.QUInt8, QuantType.QInt16])
def test_nonoverflow_is_the_oracle_on_both_paths(absmax, qtype):
    for x in (np.array([-absmax, absmax], np.float32), np.array([0.0, absmax], np.float32)):
        expected = oracle_nonoverflow(x, qtype)
        assert pof2.nonoverflow_position(x.min(), x.max(), qtype) == expected
        for obs in (MinMaxObserver(), HistogramObserver()):
            obs.update(x)
            assert obs.nonoverflow_position(qtype) == expected
    # never clips: the max quantizes to within half a step, not to the clip value
    p = pof2.position_for_abs_max(absmax, qtype)
    got = pof2.fake_quant(np.array([absmax]), p, qtype)[0]
    assert abs(got - np.float32(absmax)) <= 2.0 ** -(p + 1)


def test_nonoverflow_negative_side_uses_code_minus_128():
    # -1.0 * 2^7 = -128 fits; +1.0 * 2^7 = 128 does not: an asymmetric range is finer
    x = np.array([-1.0, 0.5], np.float32)
    assert oracle_nonoverflow(x) == 7
    for obs in (MinMaxObserver(), HistogramObserver()):
        obs.update(x)
        assert obs.nonoverflow_position() == 7
    assert pof2.position_for_abs_max(1.0) == 6


def test_all_zero_is_pof2_zero_position_everywhere():
    zeros = np.zeros(10, np.float32)
    assert pof2.ZERO_POSITION == pof2.POSITION_MAX
    assert pof2.nonoverflow_position(0.0, 0.0) == pof2.ZERO_POSITION
    assert pof2.minmse_position(zeros) == pof2.ZERO_POSITION
    assert pof2.weight_position(zeros, "NonOverflow") == pof2.ZERO_POSITION
    assert pof2.bias_position(zeros) == pof2.ZERO_POSITION
    for obs in (MinMaxObserver(), HistogramObserver()):
        assert obs.nonoverflow_position() == pof2.ZERO_POSITION  # nothing observed
        obs.update(zeros)
        assert obs.nonoverflow_position() == pof2.ZERO_POSITION
    assert obs.minmse_position() == pof2.ZERO_POSITION
    with pytest.raises(ValueError, match="not finite"):
        pof2.nonoverflow_position(float("nan"), 1.0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streamed_minmax_and_nonoverflow_equal_numpy(kind, seed):
    x = _data(kind, 20_000, seed)
    mm = _stream(MinMaxObserver(), x, 7, seed)
    hist = _stream(HistogramObserver(), x, 7, seed)
    expected = oracle_nonoverflow(x)
    for obs in (mm, hist):
        assert obs.min == float(x.min()) and obs.max == float(x.max())
        assert obs.count == x.size
        assert obs.nonoverflow_position() == expected
    assert pof2.weight_position(x, "NonOverflow") == expected


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_streamed_minmse_equals_exhaustive_argmin_and_pof2(kind, seed):
    x = _data(kind, 20_000, seed)
    obs = _stream(HistogramObserver(), x, 5, seed)
    for qtype in (QuantType.QInt8, QuantType.QUInt8):
        expected = oracle_minmse(x, qtype)
        assert obs.minmse_position(qtype) == expected
        assert pof2.minmse_position(x, qtype) == expected


@pytest.mark.parametrize("kind", KINDS)
def test_histogram_sse_equals_oracle_at_every_position(kind):
    x = _data(kind, 20_000, 12)
    obs = _stream(HistogramObserver(), x, 4, 12)
    p0 = oracle_nonoverflow(x)
    positions = list(range(p0 - 6, min(p0 + 20, 41)))
    expected = np.array([oracle_sse(x, p) for p in positions])
    np.testing.assert_allclose(obs.sse(positions), expected, rtol=1e-9, atol=0)
    np.testing.assert_allclose([pof2.sse(x, p) for p in positions], expected, rtol=1e-12, atol=0)
    # the activation error curve is the MSE, the same currency as pof2.error_function's
    result = CalibrationResult("h", "MinMSE", 1, {"t": obs})
    curve, weight_curve = result.error_function("t"), pof2.error_function(x)
    for p, sse in zip(positions, expected, strict=True):
        assert curve(p) == pytest.approx(sse / x.size, rel=1e-9)
        assert weight_curve(p) == pytest.approx(sse / x.size, rel=1e-12)


def test_error_function_needs_a_histogram_except_for_zeros():
    mm = MinMaxObserver()
    mm.update(np.array([0.5, -1.0], np.float32))
    zero = MinMaxObserver()
    zero.update(np.zeros(3, np.float32))
    result = CalibrationResult("h", "NonOverflow", 1, {"a": mm, "z": zero})
    assert result.error_function("a") is None
    z = result.error_function("z")
    assert [z(p) for p in (-40, 0, 40)] == [0.0, 0.0, 0.0]
    with pytest.raises(CalibrationError, match="did you mean 'a'"):
        result.error_function("aa")


def test_minmse_can_clip_and_differs_from_nonoverflow():
    # one huge outlier: clipping it is cheaper than coarsening everything else
    x = np.concatenate([np.random.default_rng(0).standard_normal(10_000), [40.0]])
    x = x.astype(np.float32)
    p = pof2.minmse_position(x)
    assert p == oracle_minmse(x) == _stream(HistogramObserver(), x, 3, 0).minmse_position()
    assert p > oracle_nonoverflow(x)


def test_minmse_ties_go_to_the_larger_scale():
    # 63.75: p = 0 rounds it to 64, p = 1 clips it to 63.5 -- both errors are 0.25
    x = np.array([63.75, 1.0], np.float32)
    assert oracle_nonoverflow(x) == 0
    assert oracle_sse(x, 0) == oracle_sse(x, 1) == 0.0625
    h = HistogramObserver()
    h.update(x)
    assert list(h.sse([0, 1])) == [0.0625, 0.0625]
    assert pof2.minmse_position(x) == h.minmse_position() == 0 == oracle_minmse(x)
    assert pof2.best_position([3, 1, 2], [1.0, 1.0, 0.5]) == 2
    assert pof2.best_position([3, 1, 2], [0.5, 0.5, 0.5]) == 1


def test_minmse_int16_exact_on_one_array():
    x = _data("student2", 5_000, 4)
    assert pof2.minmse_position(x, QuantType.QInt16) == oracle_minmse(x, QuantType.QInt16)


@pytest.mark.parametrize("kind", KINDS)
def test_merge_of_shards_equals_one_observer(kind):
    x = _data(kind, 30_000, 5)
    whole_h = HistogramObserver()
    whole_h.update(x)
    whole_m = MinMaxObserver()
    whole_m.update(x)
    shards = np.array_split(x, 4)
    hs, ms = [], []
    for shard in shards:
        h, m = HistogramObserver(), MinMaxObserver()
        h.update(shard)
        m.update(shard)
        hs.append(h)
        ms.append(m)
    h = hs[0].merge(hs[1]).merge(hs[2].merge(hs[3]))
    m = ms[0].merge(ms[1]).merge(ms[2]).merge(ms[3])
    # integer statistics: shards merge exactly, in any order
    np.testing.assert_array_equal(h.counts, whole_h.counts)
    np.testing.assert_array_equal(h.offset_sums, whole_h.offset_sums)
    np.testing.assert_allclose(h.square_sums, whole_h.square_sums, rtol=1e-12, atol=0)
    np.testing.assert_allclose(h.sums, whole_h.sums, rtol=1e-12, atol=0)
    assert (h.min, h.max, m.min, m.max) == (whole_h.min, whole_h.max, whole_m.min, whole_m.max)
    assert m.count == whole_m.count == x.size
    assert h.minmse_position() == whole_h.minmse_position()
    assert h.percentile_range(99.9, True) == whole_h.percentile_range(99.9, True)


def _bucket_width(value: float) -> float:
    lower, upper = bucket_edges()
    key = int(np.array([abs(value)], np.float32).view(np.uint32)[0] >> 16)
    return float(upper[key] - lower[key])


def _in_bucket_ending_at(edge: float, value: float, upper: bool) -> bool:
    """``value`` lies in the bucket whose upper (or lower) edge is ``edge``."""
    width = _bucket_width(value)
    if upper:
        return edge - width * 1.000001 <= value <= edge
    return edge <= value <= edge + width * 1.000001


@pytest.mark.parametrize("kind", ["normal", "student2", "cauchy_relu"])
@pytest.mark.parametrize("pct", [99.0, 99.9, 99.999])
def test_percentile_within_one_bucket(kind, pct):
    x = _data(kind, 50_000, 7)
    obs = _stream(HistogramObserver(), x, 6, 7)
    n = x.size
    # symmetric: the order statistic numpy's percentile interpolates towards is in the last bucket
    lo, hi = obs.percentile_range(pct, symmetric=True)
    a = np.sort(np.abs(x))
    assert lo == -hi
    assert hi >= float(np.percentile(a, pct))
    assert _in_bucket_ending_at(hi, float(a[math.ceil((n - 1) * pct / 100)]), upper=True)
    # asymmetric: the same on each tail of x
    lo, hi = obs.percentile_range(pct, symmetric=False)
    tail = (100 - pct) / 200
    v = np.sort(x)
    ref_lo, ref_hi = np.percentile(x, [100 * tail, 100 - 100 * tail])
    assert lo <= ref_lo and hi >= ref_hi
    assert _in_bucket_ending_at(lo, float(v[math.floor((n - 1) * tail)]), upper=False)
    assert _in_bucket_ending_at(hi, float(v[math.ceil((n - 1) * (1 - tail))]), upper=True)


@pytest.mark.parametrize("kind", ["student2", "cauchy_relu"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_entropy_within_one_bucket_of_reference(kind, seed):
    x = _data(kind, 100_000, seed)
    obs = _stream(HistogramObserver(), x, 5, seed)
    t = obs.entropy_threshold(2048)
    a = np.abs(x.astype(np.float64))
    hist, edges = np.histogram(a, bins=2048, range=(0.0, a.max()))
    ref = entropy_threshold_from_histogram(hist, edges)
    assert abs(t - ref) <= max(_bucket_width(ref), edges[1]) * 1.0001


def _bucket_reference(x: np.ndarray, num_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Linear bins of ``|x|`` built in one go from numpy's own bucket statistics of all the data:
    counts and float64 sums of ``|x|`` per top-16-bit key of the float32 pattern, resampled by the
    same rule the observer uses. Only the streamed statistics differ from the observer's path."""
    a = np.abs(x.astype(np.float32))
    keys = a.view(np.uint32) >> 16
    counts = np.bincount(keys, minlength=1 << 15)
    sums = np.bincount(keys, weights=a.astype(np.float64), minlength=1 << 15)
    return resample_linear(counts, sums, float(a.max()), num_bins)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_entropy_and_mse_within_one_bin_of_the_reference_on_all_data(kind, seed):
    x = _data(kind, 100_000, seed)
    obs = _stream(HistogramObserver(), x, 5, seed)
    hist, edges = _bucket_reference(x, 2048)
    one_bin = edges[1] * 1.0001
    assert abs(obs.entropy_threshold(2048) - entropy_threshold_from_histogram(hist, edges)) <= (
        one_bin
    )
    assert abs(obs.mse_threshold(2048) - mse_threshold_from_histogram(hist, edges)) <= one_bin


def test_entropy_reference_sees_wrong_streaming():
    # the same comparison fails when a fifth of the data is fed twice (or a fifth is missing)
    x = _data("normal", 100_000, 0)
    hist, edges = _bucket_reference(x, 2048)
    ref = entropy_threshold_from_histogram(hist, edges)
    twice, missing = HistogramObserver(), HistogramObserver()
    twice.update(x)
    twice.update(x[:20_000])
    missing.update(x[:80_000])
    assert abs(twice.entropy_threshold(2048) - ref) > edges[1]
    assert abs(missing.entropy_threshold(2048) - ref) > edges[1]


def test_nonfinite_values_are_counted_and_ignored():
    x = np.array([1.0, np.nan, -3.0, np.inf, -np.inf, 2.0], np.float32)
    for obs in (MinMaxObserver(), HistogramObserver()):
        obs.update(x)
        assert obs.nonfinite == 3 and obs.count == 3
        assert (obs.min, obs.max) == (-3.0, 2.0)


def test_relu_derivation_is_exact():
    x = _data("normal", 10_000, 9)
    h, m = HistogramObserver(), MinMaxObserver()
    h.update(x)
    m.update(x)
    direct_h, direct_m = HistogramObserver(), MinMaxObserver()
    direct_h.update(np.maximum(x, 0))
    direct_m.update(np.maximum(x, 0))
    np.testing.assert_array_equal(h.relu().magnitude_counts(), direct_h.magnitude_counts())
    np.testing.assert_array_equal(h.relu().offset_sums, direct_h.offset_sums)
    np.testing.assert_allclose(h.relu().square_sums, direct_h.square_sums, rtol=1e-12, atol=0)
    np.testing.assert_allclose(
        h.relu().sse(range(-3, 20)), direct_h.sse(range(-3, 20)), rtol=1e-12, atol=0
    )
    assert h.relu().minmse_position() == direct_h.minmse_position()
    assert (m.relu().min, m.relu().max) == (direct_m.min, direct_m.max)


def test_moving_average_matches_definition_and_refuses_merge():
    obs = MinMaxObserver(moving_average=0.5)
    for lo, hi in [(-1.0, 1.0), (-3.0, 5.0), (0.0, 2.0)]:
        obs.update(np.array([lo, hi], np.float32))
    # ema: start at the first batch, then ema += c * (batch - ema)
    # min: -1 -> -1 + 0.5 * (-3 + 1) = -2 -> -2 + 0.5 * (0 + 2) = -1
    # max:  1 ->  1 + 0.5 * (5 - 1) =  3 ->  3 + 0.5 * (2 - 3) = 2.5
    assert obs.range(moving_average=True) == (-1.0, 2.5)
    assert obs.range() == (-3.0, 5.0)
    with pytest.raises(CalibrationError, match="cannot be merged"):
        obs.merge(MinMaxObserver())


def test_roundtrip_dict():
    x = _data("student2", 5_000, 11)
    h = HistogramObserver()
    h.update(x)
    h2 = HistogramObserver.from_dict(h.to_dict())
    np.testing.assert_array_equal(h.counts, h2.counts)
    np.testing.assert_array_equal(h.sums, h2.sums)
    np.testing.assert_array_equal(h.offset_sums, h2.offset_sums)
    assert h.square_sums == h2.square_sums
    assert (h2.min, h2.max) == (h.min, h.max)
    assert math.isclose(h2.absmax, float(np.abs(x).max()))


def test_histogram_statistics_equal_numpy_of_the_bit_pattern():
    # the staged, packed integer accumulation against a direct numpy reference, across several
    # unpackings of the staging array (more values than one staging period)
    x = _data("normal", 3 * (1 << 20), 13)
    x[::7] = 0.0
    obs = HistogramObserver()
    for part in np.array_split(x, 5):
        obs.update(part)
    bits = x.view(np.uint32)
    keys = (bits >> 16).astype(np.intp)
    t = (bits & 0xFFFF).astype(np.int64) - (1 << 15)
    np.testing.assert_array_equal(obs.counts, np.bincount(keys, minlength=1 << 16))
    sum_t = np.zeros(1 << 16, np.int64)
    np.add.at(sum_t, keys, t)
    np.testing.assert_array_equal(obs.offset_sums, sum_t)
    x64 = x.astype(np.float64)
    expected = (float(np.sum(x64[x64 > 0] ** 2)), float(np.sum(x64[x64 < 0] ** 2)))
    np.testing.assert_allclose(obs.square_sums, expected, rtol=1e-12, atol=0)
    ref = np.bincount(keys, weights=x.astype(np.float64), minlength=1 << 16)
    np.testing.assert_allclose(obs.sums, ref, rtol=1e-12, atol=0)


def test_key_range_grows_with_the_data_and_stays_exact():
    # small positive values first, then larger ones, then negatives: the arrays grow (never the
    # full 65536 keys for non-negative data) and the statistics equal numpy's of all the data
    rng = np.random.default_rng(21)
    parts = [
        rng.uniform(0, 0.5, 40_000).astype(np.float32),
        rng.uniform(0, 6.0, 40_000).astype(np.float32),
        np.zeros(1000, np.float32),
    ]
    obs = HistogramObserver()
    for part in parts:
        obs.update(part)
    assert obs._stage.size <= 128 * 130  # below 2^3: keys of exponents up to 129 only
    assert obs.nonzero_buckets()[0].max() < 1 << 15
    assert obs._stage is None  # a query releases the staging array
    parts.append(-rng.uniform(0, 3.0, 40_000).astype(np.float32))
    obs.update(parts[-1])
    x = np.concatenate(parts)
    keys = (x.view(np.uint32) >> 16).astype(np.intp)
    t = (x.view(np.uint32) & 0xFFFF).astype(np.int64) - (1 << 15)
    np.testing.assert_array_equal(obs.counts, np.bincount(keys, minlength=1 << 16))
    sum_t = np.zeros(1 << 16, np.int64)
    np.add.at(sum_t, keys, t)
    np.testing.assert_array_equal(obs.offset_sums, sum_t)
    assert obs.minmse_position() == oracle_minmse(x)


def test_small_batches_are_buffered_and_give_the_same_statistics():
    x = _data("student2", 50_000, 14)
    one, many = HistogramObserver(), HistogramObserver()
    one.update(x)
    for part in np.array_split(x, 997):  # ~50 values per batch: buffered
        many.update(part)
    assert many.batches == 997
    np.testing.assert_array_equal(one.counts, many.counts)
    np.testing.assert_array_equal(one.offset_sums, many.offset_sums)
    np.testing.assert_allclose(one.square_sums, many.square_sums, rtol=1e-12, atol=0)
    np.testing.assert_allclose(one.sse(range(0, 30)), many.sse(range(0, 30)), rtol=1e-12)


def _bit_statistics(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-key counts and centred offset sums of float32 ``x``, straight from the bit pattern."""
    bits = x.view(np.uint32)
    keys = (bits >> 16).astype(np.intp)
    t = (bits & 0xFFFF).astype(np.int64) - (1 << 15)
    sum_t = np.zeros(1 << 16, np.int64)
    np.add.at(sum_t, keys, t)
    return np.bincount(keys, minlength=1 << 16), sum_t


@pytest.mark.parametrize("negative_zeros", [False, True])
def test_negative_zeros_among_zeros_are_binned_under_their_own_key(negative_zeros):
    # the largest key of a chunk comes from its min/max; with min == 0 a -0.0 (key 2^15) may hide
    # among the zeros, and must still be counted there
    rng = np.random.default_rng(22)
    x = rng.uniform(0, 6.0, 100_000).astype(np.float32)
    x[::3] = 0.0
    if negative_zeros:
        x[1::5] = -0.0
    obs = HistogramObserver()
    obs.update(x)
    counts, sum_t = _bit_statistics(x)
    np.testing.assert_array_equal(obs.counts, counts)
    np.testing.assert_array_equal(obs.offset_sums, sum_t)
    assert (obs.counts[1 << 15] > 0) == negative_zeros
    assert obs.minmse_position() == oracle_minmse(x)


def test_staged_sums_unpack_exactly_for_the_largest_keys():
    # one bucket near the top of the key range receives more values than a staging period
    # (2^22): the count and the offset sum must come apart exactly from n (2^40 + 2^16 b) + L
    rng = np.random.default_rng(23)
    big = np.float32(-3.0e38)
    x = np.full(5_000_000, big, np.float32)
    x[::2] = np.nextafter(big, np.float32(0))  # same bucket, another offset
    x[::1001] = rng.standard_normal(x[::1001].size).astype(np.float32)
    obs = HistogramObserver()
    for part in np.array_split(x, 3):
        obs.update(part)
    counts, sum_t = _bit_statistics(x)
    np.testing.assert_array_equal(obs.counts, counts)
    np.testing.assert_array_equal(obs.offset_sums, sum_t)
    assert (obs.min, obs.max) == (float(x.min()), float(x.max()))


def test_nonfinite_values_in_large_batches_are_dropped_per_chunk():
    rng = np.random.default_rng(24)
    x = rng.standard_normal(200_000).astype(np.float32)
    x[5] = np.nan
    x[70_000:70_010] = np.inf
    x[140_000 : 140_000 + (1 << 15)] = -np.inf  # a whole chunk of -inf and part of the next
    x[-1] = np.nan
    obs = HistogramObserver()
    obs.update(x)
    finite = x[np.isfinite(x)]
    counts, sum_t = _bit_statistics(finite)
    assert obs.nonfinite == x.size - finite.size
    assert (obs.min, obs.max) == (float(finite.min()), float(finite.max()))
    np.testing.assert_array_equal(obs.counts, counts)
    np.testing.assert_array_equal(obs.offset_sums, sum_t)
    x64 = finite.astype(np.float64)
    expected = (float(np.sum(x64[x64 > 0] ** 2)), float(np.sum(x64[x64 < 0] ** 2)))
    np.testing.assert_allclose(obs.square_sums, expected, rtol=1e-12, atol=0)


def test_queries_release_the_staging_array_and_updates_continue_exactly():
    x = _data("normal", 200_000, 25)
    obs = HistogramObserver()
    seen = []
    for part in np.array_split(x, 4):
        obs.update(part)
        seen.append(part)
        assert obs._stage is not None  # large batches are binned at once, into the stage
        counts, sum_t = _bit_statistics(np.concatenate(seen))
        np.testing.assert_array_equal(obs.counts, counts)  # a query: flush
        np.testing.assert_array_equal(obs.offset_sums, sum_t)
        assert obs._stage is None
    keys, n, _ = obs.nonzero_buckets()
    assert keys.size == np.count_nonzero(counts) and not n.flags.writeable
    assert obs.minmse_position() == oracle_minmse(x)


def _chunked_square_sums(x: np.ndarray, chunk: int = 1 << 15) -> tuple[float, float]:
    """The sums of squares of the positive and of the negative finite values of one large batch,
    added exactly as the observer defines them: per step of ``chunk`` values (non-finite values
    dropped within their step), one float64 ``einsum`` per sign, the steps added in order."""
    pos, neg = 0.0, 0.0
    for start in range(0, x.size, chunk):
        part = x[start : start + chunk]
        part = part[np.isfinite(part)].astype(np.float64)
        if part.size == 0:
            continue
        if part.min() < 0.0:
            below = np.minimum(part, 0.0)
            neg += float(np.einsum("i,i->", below, below))
        above = np.maximum(part, 0.0)
        pos += float(np.einsum("i,i->", above, above))
    return pos, neg


def _edge_values(n: int, seed: int) -> np.ndarray:
    """Signed data with the patterns the binning must handle: zeros of both signs, subnormals,
    the largest finite magnitudes, NaN and infinities, and a chunk that is all non-finite."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 10 ** rng.uniform(-4, 4, n)).astype(np.float32)
    x[::11] = 0.0
    x[3::13] = -0.0
    x[5::17] = np.float32(1e-42) * rng.choice([-1, 1], x[5::17].size)  # subnormals
    x[7::19] = np.finfo(np.float32).max * rng.choice([-1, 1], x[7::19].size)
    x[9::23] = np.nan
    x[10::29] = np.inf
    x[12::31] = -np.inf
    x[(1 << 15) : 2 * (1 << 15)] = np.nan
    return x


@pytest.mark.parametrize("split", [1, 3, 2000])
def test_binning_is_exact_on_edge_values_and_sums_squares_per_step(split):
    # every statistic equals its numpy definition on data with signed zeros, subnormals, the
    # largest magnitudes and non-finite values; the sums of squares bit for bit (per step of the
    # batch, as defined), whether batches are binned at once or buffered (split=2000)
    x = _edge_values(5 * (1 << 15) + 123, 30)
    obs = HistogramObserver()
    parts = np.array_split(x, split)
    for part in parts:
        obs.update(part)
    finite = x[np.isfinite(x)]
    counts, sum_t = _bit_statistics(finite)
    np.testing.assert_array_equal(obs.counts, counts)
    np.testing.assert_array_equal(obs.offset_sums, sum_t)
    assert obs.nonfinite == x.size - finite.size
    assert (obs.min, obs.max) == (float(finite.min()), float(finite.max()))
    if split < 2000:  # each part is one large batch, binned in its own steps
        pos, neg = 0.0, 0.0
        for part in parts:
            p, n = _chunked_square_sums(part)
            pos, neg = pos + p, neg + n
        assert obs.square_sums == (pos, neg)
    else:  # buffered: the finite values of the parts, binned in steps of the concatenation
        assert obs.square_sums == _chunked_square_sums(finite)


def test_observers_binned_on_two_threads_equal_one_thread():
    # the binning's working arrays are per thread: two threads folding different observers at
    # once give exactly what one thread gives
    import concurrent.futures

    data = [_edge_values(3 * (1 << 15) + 7, 40 + i) for i in range(4)]

    def fold(x: np.ndarray) -> HistogramObserver:
        obs = HistogramObserver()
        for part in np.array_split(x, 3):
            obs.update(part)
        obs.flush()
        return obs

    alone = [fold(x) for x in data]
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        together = list(pool.map(fold, data))
    for a, b in zip(alone, together, strict=True):
        np.testing.assert_array_equal(a.counts, b.counts)
        np.testing.assert_array_equal(a.offset_sums, b.offset_sums)
        assert a.square_sums == b.square_sums and (a.min, a.max) == (b.min, b.max)


def test_unstaging_into_known_and_new_buckets_is_exact():
    # after a query, data that only falls into known buckets is added in place; data with a new
    # bucket goes through the union of the keys: both equal numpy's statistics of all the data
    rng = np.random.default_rng(41)
    first = rng.uniform(1.0, 2.0, 50_000).astype(np.float32)  # one binade: all its 128 buckets
    known = rng.uniform(1.0, 2.0, 40_000).astype(np.float32)
    new = np.concatenate([known[:1000], np.float32([-3.5, 1e-3])])
    obs = HistogramObserver()
    seen = []
    for part, fast in ((first, False), (known, True), (new, False)):
        before = obs.nonzero_buckets()[0].copy()
        obs.update(part)
        seen.append(part)
        keys = obs.nonzero_buckets()[0]
        if before.size:  # the path taken: no new bucket (in place) or some (union)
            assert np.array_equal(keys, before) == fast
        counts, sum_t = _bit_statistics(np.concatenate(seen))
        np.testing.assert_array_equal(obs.counts, counts)
        np.testing.assert_array_equal(obs.offset_sums, sum_t)
