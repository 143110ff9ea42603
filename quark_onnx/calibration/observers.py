"""Per-tensor observers: streaming statistics from which ranges and power-of-two positions follow.

Two observers, each updated batch by batch in memory that does not grow with the number of
samples, and each *mergeable*: two observers fed disjoint parts of the data merge into exactly the
observer fed all of it (``a.merge(b)``), which is also how a Concat output is derived from its
inputs.

:class:`MinMaxObserver`
    Running minimum and maximum (and, with ``CalibMovingAverage``, their exponential moving
    average over batches). Serves ``MinMax`` ranges and the ``NonOverflow`` position.

:class:`HistogramObserver`
    A histogram keyed by the top 16 bits of the float32 bit pattern (sign, 8 exponent bits, 7
    mantissa bits), holding per bucket the count ``n_b`` and the float64 sum ``S_b`` of the values,
    plus the exact minimum and maximum. A bucket of magnitude ``2^e`` spans ``[m, m + 2^(e-7))``:
    its width is at most ``2^-7`` of its values. It serves every method:

    * ``MinMSE`` exactly (see :func:`minmse_position_from_histogram` for why),
    * ``Percentile`` within one bucket (relative error below ``2^-7``),
    * ``Entropy`` and ``MSE`` on a linear histogram of ``NumBins`` bins resampled from it.

Numerics of power-of-two quantization (GUIDE §3). A position ``p`` gives the scale ``s = 2^-p``.
For a signed type the codes are ``q = clip(round_half_even(x / s), qmin, qmax)`` and the
dequantized value is ``q * s``. An unsigned type with the midpoint zero point (uint8 with zero
point 128) represents exactly the same values as the signed type of the same width (codes ``0..255``
minus ``128``), so its positions are computed with the signed limits ``-128..127``.

Non-finite values (NaN, +-Inf) are never folded into a range: each observer counts and skips them
(``nonfinite``); the collector warns with the tensor name and the count.
"""

from __future__ import annotations

import base64
import functools
import math
import sys
from typing import Any

import numpy as np

from quark_onnx.enums import QuantType
from quark_onnx.errors import CalibrationError, ConfigError

#: Number of histogram buckets: every value of the top 16 bits of a float32.
NUM_BUCKETS = 1 << 16
_HALF = 1 << 15
#: Position returned for a tensor whose values are all zero (any position represents it exactly):
#: scale 1, the convention onnxruntime uses for an all-zero range.
DEFAULT_POSITION = 0
#: Largest position the histogram search considers; above it the subnormal buckets are wider than
#: half a quantum (scales below 2^-132 never occur in practice).
MAX_HIST_POSITION = 132


# ------------------------------------------------------------------------------------------------
# Power-of-two numerics (numpy references)
# ------------------------------------------------------------------------------------------------


def signed_limits(qtype: QuantType) -> tuple[int, int]:
    """Code range ``(lo, hi)`` of ``qtype`` seen as a symmetric type.

    Signed types keep their limits (int8: -128..127). Unsigned types with the midpoint zero point
    represent the same values as the signed type of the same width, so uint8 gives -128..127 too.
    """
    qtype = QuantType.coerce(qtype)
    if not qtype.is_integer:
        raise ConfigError(f"power-of-two positions need an integer type, got {qtype}")
    if qtype.is_signed:
        return qtype.qmin, qtype.qmax
    half = 1 << (qtype.bits - 1)
    return qtype.qmin - half, qtype.qmax - half


def quantize_pof2(x: np.ndarray, position: int, qtype: QuantType = QuantType.QInt8) -> np.ndarray:
    """Dequantized values ``clip(round_half_even(x * 2^p), lo, hi) * 2^-p`` (numpy reference).

    Computed in float64 (``x * 2^p`` is exact there); returned in ``x``'s float dtype (exact: the
    results are small integers times a power of two) or float64 for non-float input.
    """
    lo, hi = signed_limits(qtype)
    x = np.asarray(x)
    q = np.clip(np.rint(np.ldexp(x.astype(np.float64), int(position))), lo, hi)
    out = np.ldexp(q, -int(position))
    return out.astype(x.dtype) if np.issubdtype(x.dtype, np.floating) else out


def nonoverflow_position(absmax: float, qtype: QuantType = QuantType.QInt8) -> int:
    """The largest ``p`` with ``absmax <= qmax * 2^-p``: the finest scale that never clips.

    ``qmax`` is the positive code limit (127 for int8 and uint8 with zero point 128), which also
    covers the negative side (``-absmax >= -128 * 2^-p``). ``absmax == 0`` (an all-zero tensor,
    represented exactly by any scale) gives :data:`DEFAULT_POSITION`.
    """
    _, hi = signed_limits(qtype)
    a = float(absmax)
    if not math.isfinite(a) or a < 0:
        raise CalibrationError(f"nonoverflow_position: absmax must be finite and >= 0, got {a}")
    if a == 0.0:
        return DEFAULT_POSITION
    p = math.floor(math.log2(hi / a))
    # math.log2 may be off by one ulp near powers of two: settle it with exact comparisons.
    while math.ldexp(hi, -p) < a:
        p -= 1
    while math.ldexp(hi, -(p + 1)) >= a:
        p += 1
    return p


def minmse_position(x: np.ndarray, qtype: QuantType = QuantType.QInt8) -> int:
    """The position minimising ``sum((x - quantize_pof2(x, p))^2)`` over one array, exactly.

    Non-finite values are ignored. Candidates are ``p_no .. p_sat`` (see
    :func:`minmse_position_from_histogram`); ties go to the smaller ``p`` (the larger scale).
    8-bit types use the exact histogram search; wider types evaluate every candidate on the array.
    """
    x = np.asarray(x)
    lo, hi = signed_limits(qtype)
    if max(hi, -lo) <= 128:
        obs = HistogramObserver()
        obs.update(x)
        return obs.minmse_position(qtype)
    values = np.asarray(x, dtype=np.float64).reshape(-1)
    values = values[np.isfinite(values)]
    nz = np.abs(values[values != 0])
    if nz.size == 0:
        return DEFAULT_POSITION
    p_no = nonoverflow_position(float(nz.max()), qtype)
    p_sat = _saturation_position(float(nz.min()), hi)
    best, best_sse = p_no, math.inf
    for p in range(p_no, max(p_no, p_sat) + 1):
        sse = float(np.sum((values - quantize_pof2(values, p, qtype)) ** 2))
        if sse < best_sse:
            best, best_sse = p, sse
    return best


def _saturation_position(min_nonzero: float, hi: int) -> int:
    """Smallest ``p`` at which every value of magnitude >= ``min_nonzero`` saturates.

    For ``p`` at or above it, all nonzero values lie beyond ``(hi + 0.5) * 2^-p`` and the error
    ``|x| - hi * 2^-p`` of each of them grows with ``p``, so no larger position can be better.
    """
    p = math.ceil(math.log2((hi + 0.5) / min_nonzero))
    while math.ldexp(hi + 0.5, -p) > min_nonzero:
        p += 1
    while math.ldexp(hi + 0.5, -(p - 1)) <= min_nonzero:
        p -= 1
    return p


# ------------------------------------------------------------------------------------------------
# Buckets
# ------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def bucket_edges() -> tuple[np.ndarray, np.ndarray]:
    """Magnitude edges ``(lower, upper)`` (float64, exact) of the 32768 magnitude keys.

    Key ``k = (bits >> 16) & 0x7FFF`` has exponent ``E = k >> 7`` and mantissa ``M = k & 127``:
    ``E = 0`` (zero and subnormals) spans ``[M, M + 1) * 2^-133``; ``1 <= E <= 254`` spans
    ``[128 + M, 129 + M) * 2^(E - 134)``; ``E = 255`` (Inf/NaN) is never filled.
    """
    k = np.arange(_HALF, dtype=np.int64)
    e = k >> 7
    m = k & 127
    normal = e > 0
    base = np.where(normal, 128 + m, m).astype(np.float64)
    exp = np.where(normal, e - 134, -133)
    lower = np.ldexp(base, exp)
    upper = np.ldexp(base + 1, exp)
    lower[e == 255] = np.inf
    upper[e == 255] = np.inf
    lower.setflags(write=False)
    upper.setflags(write=False)
    return lower, upper


def _bucket_keys(x32: np.ndarray) -> np.ndarray:
    """Top 16 bits of each float32 as intp (the histogram key)."""
    flat = x32.reshape(-1)
    if sys.byteorder == "little":
        return flat.view(np.uint16)[1::2].astype(np.intp)
    return (flat.view(np.uint32) >> 16).astype(np.intp)


def _finite_float32(x: np.ndarray) -> tuple[np.ndarray, int]:
    """``x`` as a contiguous float32 array of its finite values, and how many were dropped."""
    x = np.asarray(x)
    if x.dtype != np.float32:
        if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
            raise CalibrationError(f"cannot observe a tensor of dtype {x.dtype}")
        x = x.astype(np.float32)
    x = np.ascontiguousarray(x).reshape(-1)
    if x.size == 0:
        return x, 0
    lo, hi = x.min(), x.max()  # numpy min/max propagate NaN
    if np.isfinite(lo) and np.isfinite(hi):
        return x, 0
    mask = np.isfinite(x)
    kept = x[mask]
    return kept, int(x.size - kept.size)


def _encode(a: np.ndarray) -> dict[str, Any]:
    a = np.ascontiguousarray(a)
    return {
        "dtype": a.dtype.str,
        "data": base64.b64encode(a.tobytes()).decode("ascii"),
    }


def _decode(d: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(base64.b64decode(d["data"]), dtype=np.dtype(d["dtype"])).copy()


# ------------------------------------------------------------------------------------------------
# MinMax
# ------------------------------------------------------------------------------------------------


class MinMaxObserver:
    """Running min/max of the finite values (and their moving average over batches).

    With ``moving_average=c`` each :meth:`update` is one batch and ``ema = ema + c * (batch -
    ema)`` (starting from the first batch), as onnxruntime's MinMax calibrator does; that average
    depends on batch order, so such observers cannot be merged.
    """

    kind = "minmax"

    def __init__(self, moving_average: float | None = None) -> None:
        self.min = math.inf
        self.max = -math.inf
        self.count = 0
        self.nonfinite = 0
        self.batches = 0
        self.moving_average = moving_average
        self.ema_min = math.nan
        self.ema_max = math.nan

    @property
    def absmax(self) -> float:
        """``max |x|`` over the finite values seen (0.0 when none)."""
        if self.count == 0:
            return 0.0
        return max(abs(self.min), abs(self.max))

    def update(self, x: np.ndarray) -> None:
        """Fold one batch (any shape, any real dtype) into the statistics."""
        x = np.asarray(x)
        if x.size == 0:
            return
        lo, hi = x.min(), x.max()  # numpy min/max propagate NaN
        dropped = 0
        if not (np.isfinite(lo) and np.isfinite(hi)):
            finite = x[np.isfinite(x)]
            dropped = int(x.size - finite.size)
            if finite.size == 0:
                self.nonfinite += dropped
                return
            lo, hi = finite.min(), finite.max()
        self.update_stats(float(lo), float(hi), int(x.size - dropped), dropped)

    def update_stats(self, lo: float, hi: float, count: int, nonfinite: int = 0) -> None:
        """Fold a batch given by its finite min, max and count (in-graph reductions)."""
        self.nonfinite += nonfinite
        if count == 0:
            return
        self.min = min(self.min, lo)
        self.max = max(self.max, hi)
        self.count += count
        if self.moving_average is not None:
            c = self.moving_average
            if self.batches == 0:
                self.ema_min, self.ema_max = lo, hi
            else:
                self.ema_min += c * (lo - self.ema_min)
                self.ema_max += c * (hi - self.ema_max)
        self.batches += 1

    def range(self, moving_average: bool = False) -> tuple[float, float]:
        if self.count == 0:
            return 0.0, 0.0
        if moving_average:
            if self.moving_average is None:
                raise CalibrationError(
                    "the moving average of min/max was not collected: calibrate again with "
                    "CalibMovingAverage=True"
                )
            return self.ema_min, self.ema_max
        return self.min, self.max

    def merge(self, other: MinMaxObserver) -> MinMaxObserver:
        """The observer of the union of both data sets."""
        if self.moving_average is not None or other.moving_average is not None:
            raise CalibrationError(
                "moving-average min/max depends on batch order and cannot be merged"
            )
        out = MinMaxObserver()
        out.min = min(self.min, other.min)
        out.max = max(self.max, other.max)
        out.count = self.count + other.count
        out.nonfinite = self.nonfinite + other.nonfinite
        out.batches = self.batches + other.batches
        return out

    def relu(self) -> MinMaxObserver:
        """The observer of ``max(x, 0)`` for the data of this one."""
        out = MinMaxObserver()
        out.count, out.nonfinite, out.batches = self.count, self.nonfinite, self.batches
        if self.count:
            out.min, out.max = max(self.min, 0.0), max(self.max, 0.0)
        return out

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "kind": self.kind,
            "min": self.min if self.count else None,
            "max": self.max if self.count else None,
            "count": self.count,
            "nonfinite": self.nonfinite,
            "batches": self.batches,
        }
        if self.moving_average is not None:
            d.update(moving_average=self.moving_average, ema_min=self.ema_min, ema_max=self.ema_max)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MinMaxObserver:
        out = cls(d.get("moving_average"))
        out.count, out.nonfinite, out.batches = int(d["count"]), int(d["nonfinite"]), d["batches"]
        if out.count:
            out.min, out.max = float(d["min"]), float(d["max"])
        if out.moving_average is not None:
            out.ema_min, out.ema_max = float(d["ema_min"]), float(d["ema_max"])
        return out


# ------------------------------------------------------------------------------------------------
# Histogram
# ------------------------------------------------------------------------------------------------


class HistogramObserver:
    """Per-bucket counts and sums keyed by the top 16 bits of the float32 pattern.

    Memory is fixed: 65536 int64 counts and 65536 float64 sums (1 MiB) per tensor. Merging adds the
    arrays, so shards merge exactly (sums up to float64 rounding of the additions).
    """

    kind = "histogram"

    #: Batches smaller than this are buffered and binned together (a bincount over 65536 buckets
    #: costs as much as binning tens of thousands of values); the buffer is bounded by it.
    buffer_size = 1 << 16

    def __init__(self) -> None:
        self._counts = np.zeros(NUM_BUCKETS, dtype=np.int64)
        self._sums = np.zeros(NUM_BUCKETS, dtype=np.float64)
        self._pending: list[np.ndarray] = []
        self._pending_size = 0
        self.min = math.inf
        self.max = -math.inf
        self.nonfinite = 0
        self.batches = 0

    @property
    def counts(self) -> np.ndarray:
        """Values per bucket (int64, 65536)."""
        self._flush()
        return self._counts

    @counts.setter
    def counts(self, value: np.ndarray) -> None:
        self._flush()
        self._counts = value

    @property
    def sums(self) -> np.ndarray:
        """Float64 sum of the values per bucket (65536)."""
        self._flush()
        return self._sums

    @sums.setter
    def sums(self, value: np.ndarray) -> None:
        self._flush()
        self._sums = value

    @property
    def count(self) -> int:
        return int(self.counts.sum())

    @property
    def absmax(self) -> float:
        if self.min > self.max:
            return 0.0
        return max(abs(self.min), abs(self.max))

    def update(self, x: np.ndarray) -> None:
        """Fold one batch (any shape, any real dtype; converted to float32) into the histogram."""
        values, dropped = _finite_float32(x)
        self.nonfinite += dropped
        self.batches += 1
        if values.size == 0:
            return
        self.min = min(self.min, float(values.min()))
        self.max = max(self.max, float(values.max()))
        if values.size >= self.buffer_size:
            self._bin(values)
            return
        self._pending.append(values.copy() if values.base is not None else values)
        self._pending_size += values.size
        if self._pending_size >= self.buffer_size:
            self._flush()

    def _flush(self) -> None:
        if self._pending:
            values = np.concatenate(self._pending)
            self._pending, self._pending_size = [], 0
            self._bin(values)

    def _bin(self, values: np.ndarray) -> None:
        keys = _bucket_keys(values)
        self._counts += np.bincount(keys, minlength=NUM_BUCKETS)
        self._sums += np.bincount(keys, weights=values, minlength=NUM_BUCKETS)

    def merge(self, other: HistogramObserver) -> HistogramObserver:
        out = HistogramObserver()
        out.counts = self.counts + other.counts
        out.sums = self.sums + other.sums
        out.min = min(self.min, other.min)
        out.max = max(self.max, other.max)
        out.nonfinite = self.nonfinite + other.nonfinite
        out.batches = self.batches + other.batches
        return out

    def relu(self) -> HistogramObserver:
        """The histogram of ``max(x, 0)``: positive buckets kept, the rest counted as zeros."""
        out = HistogramObserver()
        out.counts[:_HALF] = self.counts[:_HALF]
        out.sums[:_HALF] = self.sums[:_HALF]
        out.counts[0] = self.counts[0] + int(self.counts[_HALF:].sum())
        out.nonfinite, out.batches = self.nonfinite, self.batches
        if self.min <= self.max:
            out.min, out.max = max(self.min, 0.0), max(self.max, 0.0)
        return out

    # --- queries ---------------------------------------------------------------------------------

    def magnitude_counts(self) -> np.ndarray:
        """Counts per magnitude key (both signs together), shape (32768,)."""
        return self.counts[:_HALF] + self.counts[_HALF:]

    def minmse_position(self, qtype: QuantType = QuantType.QInt8) -> int:
        return minmse_position_from_histogram(
            self.counts, self.sums, self.absmax, QuantType.coerce(qtype)
        )

    def percentile_range(self, percentile: float, symmetric: bool) -> tuple[float, float]:
        """Range keeping ``percentile`` % of the values, within one bucket (see module doc).

        Symmetric: ``(-T, T)`` with ``T`` the upper edge of the bucket holding the order statistic
        of ``|x|`` at rank ``ceil((N - 1) * P / 100)`` (0-based; numpy's "linear" percentile lies
        between that one and the previous), clamped to ``max |x|``. Asymmetric: the lower value
        edge of the bucket of the ``(100 - P) / 2`` % order statistic of ``x`` and the upper value
        edge of the bucket of the ``100 - (100 - P) / 2`` % one, clamped to ``[min, max]``.
        """
        if not 0.0 < percentile <= 100.0:
            raise ConfigError(f"Percentile must be in (0, 100], got {percentile}")
        n = self.count
        if n == 0:
            return 0.0, 0.0
        lower, upper = bucket_edges()
        if symmetric:
            cum = np.cumsum(self.magnitude_counts())
            rank = math.ceil((n - 1) * percentile / 100.0)  # 0-based
            b = int(np.searchsorted(cum, rank + 1))
            t = min(float(upper[b]), self.absmax)
            return -t, t
        # value order: negative keys from the largest magnitude down, then positive keys up
        neg = self.counts[_HALF:][::-1]
        cum = np.cumsum(np.concatenate([neg, self.counts[:_HALF]]))
        low_edges = np.concatenate([-upper[::-1], lower])
        high_edges = np.concatenate([-lower[::-1], upper])
        tail = (100.0 - percentile) / 200.0
        r_lo = math.floor((n - 1) * tail)
        r_hi = math.ceil((n - 1) * (1.0 - tail))
        lo = float(low_edges[int(np.searchsorted(cum, r_lo + 1))])
        hi = float(high_edges[int(np.searchsorted(cum, r_hi + 1))])
        return max(lo, self.min), min(hi, self.max)

    def linear_histogram(self, num_bins: int) -> tuple[np.ndarray, np.ndarray]:
        """``|x|`` resampled to ``num_bins`` linear bins over ``[0, max |x|]``: (counts, edges).

        Within each bucket the values are given a linear density ``1 + a (t - 1/2)`` over the
        bucket's relative position ``t``, whose slope ``a = 12 (mean_t - 1/2)`` (clipped to
        ``[-2, 2]``) reproduces the bucket's exact mean (from its sum); the bucket holding
        ``max |x|`` is cut there. Buckets are at most ``2^-7`` of their value wide, so no value is
        moved further than that relative distance.
        """
        amax = self.absmax
        edges = np.linspace(0.0, amax, num_bins + 1)
        counts = self.magnitude_counts().astype(np.float64)
        if amax == 0.0:
            hist = np.zeros(num_bins)
            hist[0] = counts.sum()
            return hist, edges
        lower, upper = bucket_edges()
        last = int(np.nonzero(counts)[0].max())
        n = counts[: last + 1]
        lo = lower[: last + 1]
        hi = np.minimum(upper[: last + 1], amax)
        hi[-1] = amax
        width = np.maximum(hi - lo, np.finfo(np.float64).tiny)
        mag_sums = self.sums[: last + 1] - self.sums[_HALF : _HALF + last + 1]
        mean_t = np.divide(mag_sums / np.maximum(n, 1) - lo, width, out=np.full(n.size, 0.5))
        slope = np.clip(12.0 * (np.where(n > 0, mean_t, 0.5) - 0.5), -2.0, 2.0)
        before = np.concatenate([[0.0], np.cumsum(n)])
        b = np.clip(np.searchsorted(hi, edges, side="left"), 0, last)
        t = np.clip((edges - lo[b]) / width[b], 0.0, 1.0)
        cdf = before[b] + n[b] * (t + 0.5 * slope[b] * (t * t - t))
        cdf[-1] = before[-1]
        return np.diff(cdf), edges

    def entropy_threshold(self, num_bins: int, num_quantized_bins: int = 128) -> float:
        """KL-divergence threshold on the resampled linear histogram of ``|x|``."""
        hist, edges = self.linear_histogram(num_bins)
        return entropy_threshold_from_histogram(hist, edges, num_quantized_bins)

    def mse_threshold(self, num_bins: int, qmax: int = 127) -> float:
        """Threshold minimising the expected float-scale quantization MSE (see
        :func:`mse_threshold_from_histogram`)."""
        hist, edges = self.linear_histogram(num_bins)
        return mse_threshold_from_histogram(hist, edges, qmax)

    # --- persistence ----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        keys = np.nonzero(self.counts)[0].astype(np.int32)
        return {
            "kind": self.kind,
            "min": self.min if self.min <= self.max else None,
            "max": self.max if self.min <= self.max else None,
            "count": self.count,
            "nonfinite": self.nonfinite,
            "batches": self.batches,
            "keys": _encode(keys),
            "counts": _encode(self.counts[keys]),
            "sums": _encode(self.sums[keys]),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HistogramObserver:
        out = cls()
        keys = _decode(d["keys"]).astype(np.intp)
        out.counts[keys] = _decode(d["counts"])
        out.sums[keys] = _decode(d["sums"])
        if d["min"] is not None:
            out.min, out.max = float(d["min"]), float(d["max"])
        out.nonfinite, out.batches = int(d["nonfinite"]), int(d["batches"])
        return out


Observer = MinMaxObserver | HistogramObserver


def observer_from_dict(d: dict[str, Any]) -> Observer:
    kinds = {MinMaxObserver.kind: MinMaxObserver, HistogramObserver.kind: HistogramObserver}
    if d.get("kind") not in kinds:
        raise CalibrationError(f"unknown observer kind {d.get('kind')!r} in calibration data")
    return kinds[d["kind"]].from_dict(d)


# ------------------------------------------------------------------------------------------------
# Searches on histograms
# ------------------------------------------------------------------------------------------------


def minmse_position_from_histogram(
    counts: np.ndarray, sums: np.ndarray, absmax: float, qtype: QuantType = QuantType.QInt8
) -> int:
    """``argmin_p sum (x - dq_p(x))^2`` from the bucket counts and sums.

    Why this is exact for 8-bit types. Take a candidate scale ``s = 2^-p`` and a bucket of width
    ``w = 2^k`` (its edges are multiples of ``w``). In units of ``s`` the bucket width is
    ``u = w / s``, a power of two. If ``u <= 1/2`` the rounding boundaries ``(j + 1/2)`` are
    multiples of ``u``, so none lies strictly inside the bucket: every value of the bucket rounds to
    the same code ``k_b`` except possibly a value exactly at the lower edge when that edge is a
    boundary -- a tie, whose squared error ``(s/2)^2`` is the same whichever way it rounds, so the
    sum is unchanged. If ``u >= 1`` the bucket's magnitudes are ``>= 128 u >= 128``, beyond
    ``qmax + 1/2``: every value saturates to the same code. Hence, with ``c_b`` the bucket midpoint,
    ``k_b = clip(rint(|c_b| / s))`` and ``D_b = sum_{x in b} (|x| - |c_b|)``::

        SSE(p) = sum_b [ 2 (|c_b| - k_b s) D_b + n_b (|c_b| - k_b s)^2 ] + sum_b sum (|x| - |c_b|)^2

    and the last term does not depend on ``p``. Writing the error about the bucket midpoint keeps
    the float64 evaluation accurate to the size of the quantization error itself.

    Candidates: positions below ``p_no`` (:func:`nonoverflow_position`) are never better -- their
    grids are subsets of ``p_no``'s and nothing clips at ``p_no`` -- and from ``p_sat``
    (:func:`_saturation_position`) on every nonzero value saturates and the error only grows, so
    every ``p`` in ``p_no .. p_sat`` is evaluated (capped at :data:`MAX_HIST_POSITION`). Ties go to
    the smaller ``p`` (the larger scale). An all-zero tensor gives :data:`DEFAULT_POSITION`.

    16-bit types: buckets ``2^-7`` wide can span several quanta without saturating; for those the
    error is modelled as uniform within the bucket (``s^2/12`` per value inside the range, the exact
    integral for the clipped part), so the result is an approximation there.
    """
    lo_code, hi_code = signed_limits(qtype)
    if absmax == 0.0 or not counts.any():
        return DEFAULT_POSITION
    keys = np.nonzero(counts)[0]
    lower, upper = bucket_edges()
    mag_key = keys & (_HALF - 1)
    negative = keys >= _HALF
    n = counts[keys].astype(np.float64)
    lo_e, hi_e = lower[mag_key], upper[mag_key]
    c = 0.5 * (lo_e + hi_e)
    d = np.where(negative, -sums[keys], sums[keys]) - n * c  # sum of (|x| - c) per bucket
    qside = np.where(negative, -lo_code, hi_code).astype(np.float64)

    p_no = nonoverflow_position(absmax, qtype)
    nonzero = lo_e > 0
    min_nonzero = float(lo_e[nonzero].min()) if nonzero.any() else float(hi_e.min())
    p_sat = min(_saturation_position(min_nonzero, hi_code), MAX_HIST_POSITION)
    positions = np.arange(p_no, max(p_no, p_sat) + 1)

    best, best_sse = p_no, math.inf
    for chunk in np.array_split(positions, max(1, len(positions) // 16)):
        s = np.ldexp(1.0, -chunk.astype(np.int64))[:, None]
        k = np.minimum(np.rint(c / s), qside)
        err = c - k * s
        sse_b = 2.0 * err * d + n * err * err
        if max(hi_code, -lo_code) > 128:
            sse_b = np.where(
                _spanning(lo_e, hi_e, s, qside), _uniform_sse(n, lo_e, hi_e, s, qside), sse_b
            )
        sse = sse_b.sum(axis=1)
        i = int(np.argmin(sse))
        if sse[i] < best_sse:
            best, best_sse = int(chunk[i]), float(sse[i])
    return best


def _spanning(lo_e, hi_e, s, qside) -> np.ndarray:
    """Buckets at least one quantum wide that do not saturate entirely (16-bit types only)."""
    return ((hi_e - lo_e) >= s) & (lo_e < (qside + 0.5) * s)


def _uniform_sse(n, lo_e, hi_e, s, qside) -> np.ndarray:
    """SSE of a bucket whose values are spread uniformly (minus the p-independent term)."""
    w = hi_e - lo_e
    t = np.clip((qside + 0.5) * s, lo_e, hi_e)
    inside = (t - lo_e) / w
    top = qside * s
    a, b = t - top, hi_e - top
    clipped = np.where(hi_e > t, (b**3 - a**3) / (3.0 * np.maximum(hi_e - t, 1e-300)), 0.0)
    sse = n * (inside * s * s / 12.0 + (1.0 - inside) * clipped)
    return sse - n * w * w / 12.0


def entropy_threshold_from_histogram(
    hist: np.ndarray, edges: np.ndarray, num_quantized_bins: int = 128
) -> float:
    """Threshold minimising KL(P || Q) (the TensorRT/MXNet entropy calibration).

    For every ``i`` from ``num_quantized_bins`` to ``len(hist)``: ``P`` is the first ``i`` bins
    with the mass beyond them added to bin ``i - 1``; ``Q`` merges the first ``i`` bins into
    ``num_quantized_bins`` groups (``i // nq`` bins each, the last group taking the rest) and
    spreads each group's mass evenly over its nonzero bins. The returned threshold is ``edges[i]``
    of the smallest divergence (ties: the smaller ``i``).
    """
    hist = np.asarray(hist, dtype=np.float64)
    if len(hist) <= num_quantized_bins or hist.sum() == 0:
        return float(edges[-1])
    candidates, kls = entropy_divergences(hist, num_quantized_bins)
    return float(edges[candidates[int(np.argmin(kls))]])


def entropy_divergences(
    hist: np.ndarray, num_quantized_bins: int = 128
) -> tuple[np.ndarray, np.ndarray]:
    """``(i, KL_i)`` for every candidate bin count ``i`` (see
    :func:`entropy_threshold_from_histogram`)."""
    hist = np.asarray(hist, dtype=np.float64)
    nb = len(hist)
    nq = num_quantized_bins
    total_after = np.concatenate([np.cumsum(hist[::-1])[::-1], [0.0]])
    candidates = np.arange(nq, nb + 1)
    kls = np.empty(candidates.size)
    for j, i in enumerate(candidates):
        sliced = hist[:i]
        p = sliced.copy()
        p[-1] += total_after[i]
        nonzero = sliced != 0
        merged = i // nq
        starts = np.arange(nq) * merged
        group_sum = np.add.reduceat(sliced, starts)
        group_nz = np.add.reduceat(nonzero.astype(np.float64), starts)
        per_bin = np.divide(group_sum, group_nz, out=np.zeros(nq), where=group_nz > 0)
        group_of = np.minimum(np.arange(i) // merged, nq - 1)
        q = np.where(nonzero, per_bin[group_of], 0.0)
        kls[j] = _kl(p, q)
    return candidates, kls


def _kl(p: np.ndarray, q: np.ndarray) -> float:
    """KL(P || Q) of the normalised distributions (infinite where Q misses mass of P)."""
    ps, qs = p.sum(), q.sum()
    if ps == 0 or qs == 0:
        return math.inf
    p = p / ps
    q = q / qs
    mask = p > 0
    if np.any(q[mask] == 0):
        return math.inf
    return float(np.sum(p[mask] * np.log(p[mask] / q[mask])))


def mse_threshold_from_histogram(hist: np.ndarray, edges: np.ndarray, qmax: int = 127) -> float:
    """Threshold ``t`` (a bin edge) minimising the expected MSE of float-scale quantization.

    With ``s = t / qmax``: values below ``t`` cost the uniform rounding error ``s^2 / 12``,
    values beyond it the clipping error ``(c - t)^2`` at their bin centre ``c``. Ties go to the
    larger ``t`` (less clipping).
    """
    hist = np.asarray(hist, dtype=np.float64)
    centres = 0.5 * (edges[:-1] + edges[1:])
    t = edges[1:][:, None]
    s = t / qmax
    clipped = centres[None, :] > t
    err = np.where(clipped, (centres[None, :] - t) ** 2, s * s / 12.0)
    mse = (err * hist[None, :]).sum(axis=1)
    best = np.flatnonzero(mse == mse.min())[-1]
    return float(edges[1:][best])
