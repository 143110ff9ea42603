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
    mantissa bits). The low 16 bits are the exact offset of a value inside its bucket, so per
    bucket the observer keeps two integers -- the count ``n_b`` and the sum ``T_b`` of the centred
    offsets, from which the bucket's sum follows exactly (see :class:`HistogramObserver`) -- plus
    the sums of squares of the positive and of the negative values and the exact minimum and
    maximum. A bucket
    of magnitude ``2^e`` spans ``[m, m + 2^(e-7))``: its width is at most ``2^-7`` of its values.
    It serves every method:

    * ``MinMSE`` exactly, and the exact quantization error at any position
      (:func:`histogram_sse`, :func:`minmse_position_from_histogram`),
    * ``Percentile`` within one bucket (relative error below ``2^-7``),
    * ``Entropy`` and ``MSE`` on a linear histogram of ``NumBins`` bins resampled from it.

The power-of-two numerics (positions, NonOverflow, the MinMSE window and tie rule, the all-zero
convention) are :mod:`quark_onnx.pof2`'s; only their evaluation on a histogram lives here. An
unsigned type with the midpoint zero point (uint8 with zero point 128) represents exactly the same
values as the signed type of the same width (:func:`quark_onnx.pof2.code_range`).

Non-finite values (NaN, +-Inf) are never folded into a range: each observer counts and skips them
(``nonfinite``); the collector warns with the tensor name and the count.
"""

from __future__ import annotations

import base64
import functools
import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from quark_onnx import pof2
from quark_onnx.enums import QuantType
from quark_onnx.errors import CalibrationError, ConfigError

#: Number of histogram buckets: every value of the top 16 bits of a float32.
NUM_BUCKETS = 1 << 16
_HALF = 1 << 15
#: Largest position at which the histogram error is exact for 8-bit types: above it the subnormal
#: buckets are wider than half a quantum (far beyond :data:`quark_onnx.pof2.POSITION_MAX`).
MAX_HIST_POSITION = 132
#: Values binned per step: the step's keys and offsets stay in the CPU cache.
_CHUNK = 1 << 15
#: Added to every staged bit pattern: a staged bucket ``b`` holds ``n_b (2^40 + 2^16 b) +
#: sum(low16)``, from which both parts follow exactly while ``n_b <= 2^22``.
_PACK = 1 << 40
#: Values staged before the staged sums are unpacked (every bucket then has ``n_b <= 2^22``).
_STAGE_LIMIT = (1 << 22) - _CHUNK


_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY.setflags(write=False)


def _frozen(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


def _pattern(v: float) -> int:
    """The float32 bit pattern of ``v`` (a float32 value)."""
    return int(np.float32(v).view(np.uint32))


def _key_length(length: int) -> int:
    """``length`` keys rounded up to whole exponents (128 keys), at most 65536."""
    return min(NUM_BUCKETS, -(-length // 128) * 128)


def signed_limits(qtype: QuantType) -> tuple[int, int]:
    """Centred code range ``(lo, hi)`` of ``qtype`` (:func:`quark_onnx.pof2.code_range`).

    Raises :class:`~quark_onnx.errors.ConfigError` for a type without integer codes.
    """
    qtype = QuantType.coerce(qtype)
    if not qtype.is_integer:
        raise ConfigError(f"power-of-two positions need an integer type, got {qtype}")
    return pof2.code_range(qtype)


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


@functools.lru_cache(maxsize=1)
def bucket_units() -> tuple[np.ndarray, np.ndarray]:
    """Per magnitude key: the midpoint ``c`` and the weight ``u`` of the lowest mantissa bit.

    A float32 of magnitude key ``k`` whose low 16 bits are ``low`` has magnitude exactly
    ``c + t * u`` with ``t = low - 2^15`` (``-2^15 <= t < 2^15``) and ``u = 2^(max(E, 1) - 150)``.
    """
    lower, upper = bucket_edges()
    mid = 0.5 * (lower + upper)
    e = np.arange(_HALF, dtype=np.int64) >> 7
    unit = np.ldexp(1.0, np.maximum(e, 1) - 150)
    mid.setflags(write=False)
    unit.setflags(write=False)
    return mid, unit


def _float32(x: np.ndarray) -> np.ndarray:
    """``x`` as a contiguous one-dimensional float32 array (a view when it already is one)."""
    x = np.asarray(x)
    if x.dtype != np.float32:
        if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
            raise CalibrationError(f"cannot observe a tensor of dtype {x.dtype}")
        x = x.astype(np.float32)
    return np.ascontiguousarray(x).reshape(-1)


def _finite_float32(x: np.ndarray) -> tuple[np.ndarray, int, float, float]:
    """``x`` as a contiguous float32 array of its finite values, how many were dropped, and the
    minimum and maximum of the kept values (``inf, -inf`` when none)."""
    x = _float32(x)
    if x.size == 0:
        return x, 0, math.inf, -math.inf
    lo, hi = x.min(), x.max()  # numpy min/max propagate NaN
    if np.isfinite(lo) and np.isfinite(hi):
        return x, 0, float(lo), float(hi)
    kept = x[np.isfinite(x)]
    if kept.size == 0:
        return kept, int(x.size), math.inf, -math.inf
    return kept, int(x.size - kept.size), float(kept.min()), float(kept.max())


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

    def nonoverflow_position(self, qtype: QuantType = QuantType.QInt8) -> int:
        """:func:`quark_onnx.pof2.nonoverflow_position` of the observed ``[min, max]``."""
        if self.count == 0:
            return pof2.ZERO_POSITION
        return pof2.nonoverflow_position(self.min, self.max, QuantType.coerce(qtype))

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
    """Exact per-bucket statistics keyed by the top 16 bits of the float32 pattern.

    A finite float32 ``x`` of bucket ``b`` (its top 16 bits) has magnitude exactly
    ``|x| = c_b + t * u_b``: ``c_b`` is the bucket midpoint, ``u_b`` the weight of the lowest
    mantissa bit (:func:`bucket_units`) and ``t = low16 - 2^15`` the low 16 bits of the pattern,
    centred. The observer keeps

    * per bucket ``n_b`` (int64), the count, and ``T_b = sum t`` (int64, exact), so that
      ``sum |x| = n_b c_b + u_b T_b``;
    * ``square_sums = (sum x^2 over x > 0, sum x^2 over x < 0)`` (float64; each ``x^2`` of a float32
      is exact in float64, only the additions round): the part of the quantization error that no
      position changes (:func:`histogram_sse`);
    * the exact minimum and maximum.

    Memory: ``n_b`` and ``T_b`` are stored for the non-empty buckets only (a few thousand for a
    typical activation), plus, while data comes in, one int64 staging array over the keys up to
    the largest one seen (whole exponents): ``128 (127 + k)`` keys for a tensor that is never
    negative and stays below ``2^k`` (~16.6 k keys, 130 KiB, for a ReLU6 output), at most 65536
    (512 KiB) for a signed one. Any query bins what is buffered and releases the staging array
    (:meth:`flush`). Merging adds the statistics, so shards merge exactly (the square sums up to
    float64 rounding).

    Binning, per step of :data:`_CHUNK` values (cache-sized): one ``np.add.at`` of the value's bit
    pattern plus ``2^40`` into the staging array, and one or two float64 sums of squares. A staged
    bucket ``b`` then holds ``n_b (2^40 + 2^16 b) + sum(low16)``, which gives both the count and
    the exact offset sum (:meth:`_unstage`, every :data:`_STAGE_LIMIT` values, while
    ``n_b <= 2^22``). That is one scatter per value instead of the two ``np.bincount`` calls (a
    count and a float64 weighted sum over 65536 buckets) that a float-sum histogram needs, and the
    integer offsets make the bucket sums exact.
    """

    kind = "histogram"

    #: Batches smaller than this are buffered and binned together (fewer numpy calls per value).
    buffer_size = _CHUNK

    def __init__(self) -> None:
        # non-empty buckets (keys ascending) and their statistics, up to the last unstaging
        self._keys = _EMPTY
        self._n = _EMPTY
        self._t = _EMPTY
        # while data comes in: keys 0 .. L-1, L one past the largest key seen
        self._stage: np.ndarray | None = None
        self._staged = 0
        self._pending: list[np.ndarray] = []
        self._pending_size = 0
        self.square_sums = (0.0, 0.0)
        self.min = math.inf
        self.max = -math.inf
        self.nonfinite = 0
        self.batches = 0

    # --- statistics ---------------------------------------------------------------------------

    def flush(self) -> None:
        """Bin the buffered values and release the staging array (queries call this; the
        observer keeps accepting updates afterwards)."""
        self._flush_pending()
        if self._stage is not None:
            self._unstage()
            self._stage = None

    def _flush_pending(self) -> None:
        if self._pending:
            values = np.concatenate(self._pending)
            self._pending, self._pending_size = [], 0
            self._bin(values, checked=True)

    def _unstage(self) -> None:
        """Move the staged sums into the per-bucket statistics.

        Staged bucket ``b`` holds ``S = n_b M_b + L_b`` with ``M_b = 2^40 + 2^16 b`` and
        ``L_b = sum(low16) < n_b 2^16 < M_b``: ``n_b = S // M_b`` and ``T_b = L_b - n_b 2^15``
        (``S < 2^22 (2^40 + 2^32 + 2^16) < 2^63``).
        """
        stage = self._stage
        if stage is None or self._staged == 0:
            return
        keys = np.flatnonzero(stage)
        staged = stage[keys]
        scale = (keys << 16) + _PACK
        n = staged // scale
        t = staged - n * scale - n * _HALF
        stage[keys] = 0
        self._staged = 0
        self._add_buckets(keys, n, t)

    def _add_buckets(self, keys: np.ndarray, n: np.ndarray, t: np.ndarray) -> None:
        """Add ``(n, t)`` of the non-empty buckets ``keys`` (ascending) to the statistics."""
        if self._keys.size:
            union = np.union1d(self._keys, keys)
            n_all = np.zeros(union.size, np.int64)
            t_all = np.zeros(union.size, np.int64)
            old = np.searchsorted(union, self._keys)
            new = np.searchsorted(union, keys)
            n_all[old] = self._n
            t_all[old] = self._t
            n_all[new] += n
            t_all[new] += t
            keys, n, t = union, n_all, t_all
        self._keys, self._n, self._t = _frozen(keys), _frozen(n), _frozen(t)

    def _set(self, n: np.ndarray, t: np.ndarray) -> None:
        """Store full-length (65536) statistics."""
        keys = np.flatnonzero(n)
        self._keys = _frozen(keys.astype(np.int64))
        self._n = _frozen(np.asarray(n, np.int64)[keys])
        self._t = _frozen(np.asarray(t, np.int64)[keys])

    def nonzero_buckets(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(keys, n_b, T_b)`` of the non-empty buckets, keys ascending (int64, read-only)."""
        self.flush()
        return self._keys, self._n, self._t

    def _full(self, a: np.ndarray) -> np.ndarray:
        out = np.zeros(NUM_BUCKETS, dtype=np.int64)
        out[self._keys] = a
        return out

    @property
    def counts(self) -> np.ndarray:
        """Values per bucket ``n_b`` (int64, 65536; a copy)."""
        self.flush()
        return self._full(self._n)

    @property
    def offset_sums(self) -> np.ndarray:
        """``T_b``: sum of the centred low-16-bit offsets per bucket (int64, 65536; a copy)."""
        self.flush()
        return self._full(self._t)

    @property
    def sums(self) -> np.ndarray:
        """Sum of the values per bucket, ``+-(n_b c_b + u_b T_b)`` (float64, 65536)."""
        mid, unit = bucket_units()
        keys, n, t = self.nonzero_buckets()
        out = np.zeros(NUM_BUCKETS, dtype=np.float64)
        mag = keys & (_HALF - 1)
        sign = np.where(keys >= _HALF, -1.0, 1.0)
        out[keys] = sign * (n * mid[mag] + unit[mag] * t)
        return out

    @property
    def count(self) -> int:
        self.flush()
        return int(self._n.sum())

    @property
    def absmax(self) -> float:
        if self.min > self.max:
            return 0.0
        return max(abs(self.min), abs(self.max))

    # --- updates ------------------------------------------------------------------------------

    def update(self, x: np.ndarray) -> None:
        """Fold one batch (any shape, any real dtype; converted to float32) into the histogram."""
        x = _float32(x)
        self.batches += 1
        if x.size >= self.buffer_size:
            self._bin(x, checked=False)
            return
        values, dropped, lo, hi = _finite_float32(x)
        self.nonfinite += dropped
        if values.size == 0:
            return
        self.min = min(self.min, lo)
        self.max = max(self.max, hi)
        self._pending.append(values.copy() if values.base is not None else values)
        self._pending_size += values.size
        if self._pending_size >= self.buffer_size:
            self._flush_pending()

    def _bin(self, values: np.ndarray, checked: bool) -> None:
        """Fold contiguous float32 ``values``, :data:`_CHUNK` values per step.

        Each step reads its values once from memory and then works in the CPU cache: minimum and
        maximum (non-finite values dropped and counted, unless ``checked`` says they were, and
        that the range is already folded in), the scatter into the staging array and the sums
        of squares. The largest key of a step follows from its minimum and maximum: the pattern
        of the minimum when it is negative (negative keys grow with the magnitude), else that of
        the maximum -- unless the minimum is zero, when a ``-0.0`` (key ``2^15``) may hide among
        the zeros and the largest key itself decides.
        """
        add_at, einsum = np.add.at, np.einsum
        pos_sq, neg_sq = 0.0, 0.0
        for start in range(0, values.size, _CHUNK):
            chunk = values[start : start + _CHUNK]
            lo, hi = float(chunk.min()), float(chunk.max())  # NaN propagates
            if not checked:
                if not (math.isfinite(lo) and math.isfinite(hi)):
                    kept = chunk[np.isfinite(chunk)]
                    self.nonfinite += chunk.size - kept.size
                    if kept.size == 0:
                        continue
                    chunk = kept
                    lo, hi = float(kept.min()), float(kept.max())
                self.min = min(self.min, lo)
                self.max = max(self.max, hi)
            word = chunk.view(np.uint32)  # the key is the numeric top half: no byte-order question
            packed = word.astype(np.int64)
            keys = packed >> 16
            if lo < 0.0:
                top = _pattern(lo) >> 16
            elif lo > 0.0:
                top = _pattern(hi) >> 16
            else:
                top = int(keys.max())
            stage = self._stage
            if stage is None or top >= stage.size:
                stage = self._stage_for(top)
            if self._staged > _STAGE_LIMIT:
                self._unstage()
            packed += _PACK
            add_at(stage, keys, packed)
            self._staged += chunk.size
            x64 = chunk.astype(np.float64)
            if lo < 0.0:
                neg = np.minimum(x64, 0.0)
                neg_sq += float(einsum("i,i->", neg, neg))
                np.maximum(x64, 0.0, out=x64)
            pos_sq += float(einsum("i,i->", x64, x64))  # numpy's own loop, not a BLAS thread
        self.square_sums = (self.square_sums[0] + pos_sq, self.square_sums[1] + neg_sq)

    def _stage_for(self, top: int) -> np.ndarray:
        """The staging array, created or extended to hold key ``top`` (whole exponents)."""
        length = _key_length(top + 1)
        if self._stage is None:
            self._stage = np.zeros(length, dtype=np.int64)
        else:
            grow = np.zeros(length - self._stage.size, np.int64)
            self._stage = np.concatenate([self._stage, grow])
        return self._stage

    def merge(self, other: HistogramObserver) -> HistogramObserver:
        out = HistogramObserver()
        out._set(self.counts + other.counts, self.offset_sums + other.offset_sums)
        out.square_sums = (
            self.square_sums[0] + other.square_sums[0],
            self.square_sums[1] + other.square_sums[1],
        )
        out.min = min(self.min, other.min)
        out.max = max(self.max, other.max)
        out.nonfinite = self.nonfinite + other.nonfinite
        out.batches = self.batches + other.batches
        return out

    def relu(self) -> HistogramObserver:
        """The histogram of ``max(x, 0)``: positive buckets kept, the rest counted as zeros.

        A zero has key 0 and offset ``t = -2^15``.
        """
        out = HistogramObserver()
        n, t = self.counts, self.offset_sums
        zeros = int(n[_HALF:].sum())
        n[_HALF:], t[_HALF:] = 0, 0
        n[0] += zeros
        t[0] -= zeros * _HALF
        out._set(n, t)
        out.square_sums = (self.square_sums[0], 0.0)
        out.nonfinite, out.batches = self.nonfinite, self.batches
        if self.min <= self.max:
            out.min, out.max = max(self.min, 0.0), max(self.max, 0.0)
        return out

    # --- queries ---------------------------------------------------------------------------------

    def magnitude_counts(self) -> np.ndarray:
        """Counts per magnitude key (both signs together), shape (32768,)."""
        return self.counts[:_HALF] + self.counts[_HALF:]

    def nonoverflow_position(self, qtype: QuantType = QuantType.QInt8) -> int:
        """:func:`quark_onnx.pof2.nonoverflow_position` of the observed ``[min, max]``."""
        if self.min > self.max:
            return pof2.ZERO_POSITION
        return pof2.nonoverflow_position(self.min, self.max, QuantType.coerce(qtype))

    def sse(self, positions: Iterable[int], qtype: QuantType = QuantType.QInt8) -> np.ndarray:
        """Quantization SSE of all observed values at each position (:func:`histogram_sse`)."""
        return histogram_sse(self, positions, qtype)

    def minmse_position(self, qtype: QuantType = QuantType.QInt8) -> int:
        return minmse_position_from_histogram(self, QuantType.coerce(qtype))

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

    def magnitude_sums(self) -> np.ndarray:
        """Sum of ``|x|`` per magnitude key (both signs together), shape (32768,), float64."""
        sums = self.sums
        return sums[:_HALF] - sums[_HALF:]

    def linear_histogram(self, num_bins: int) -> tuple[np.ndarray, np.ndarray]:
        """``|x|`` resampled to ``num_bins`` linear bins over ``[0, max |x|]``: (counts, edges).

        :func:`resample_linear` of this observer's magnitude counts and sums.
        """
        return resample_linear(
            self.magnitude_counts(), self.magnitude_sums(), self.absmax, num_bins
        )

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
        keys, n, t = self.nonzero_buckets()
        return {
            "kind": self.kind,
            "min": self.min if self.min <= self.max else None,
            "max": self.max if self.min <= self.max else None,
            "count": self.count,
            "nonfinite": self.nonfinite,
            "batches": self.batches,
            "keys": _encode(keys.astype(np.int32)),
            "counts": _encode(n),
            "offset_sums": _encode(t),
            "square_sums": list(self.square_sums),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HistogramObserver:
        out = cls()
        keys = _decode(d["keys"]).astype(np.intp)
        n = np.zeros(NUM_BUCKETS, dtype=np.int64)
        t = np.zeros(NUM_BUCKETS, dtype=np.int64)
        n[keys] = _decode(d["counts"])
        t[keys] = _decode(d["offset_sums"])
        out._set(n, t)
        pos, neg = d["square_sums"]
        out.square_sums = (float(pos), float(neg))
        if d["min"] is not None:
            out.min, out.max = float(d["min"]), float(d["max"])
        out.nonfinite, out.batches = int(d["nonfinite"]), int(d["batches"])
        return out


def resample_linear(
    counts: np.ndarray, sums: np.ndarray, amax: float, num_bins: int
) -> tuple[np.ndarray, np.ndarray]:
    """Magnitude bucket statistics resampled to ``num_bins`` linear bins over ``[0, amax]``.

    ``counts[k]`` and ``sums[k]`` are the number and the sum of the ``|x|`` of magnitude key ``k``
    (``(bits >> 16) & 0x7FFF``, :func:`bucket_edges`); ``amax = max |x|``. Returns
    ``(counts, edges)`` of the linear bins.

    Within each bucket the values are given a linear density ``1 + a (t - 1/2)`` over the
    bucket's relative position ``t``, whose slope ``a = 12 (mean_t - 1/2)`` (clipped to
    ``[-2, 2]``) reproduces the bucket's mean (from its sum); the bucket holding ``amax`` is cut
    there. Buckets are at most ``2^-7`` of their value wide, so no value is moved further than
    that relative distance; a linear bin narrower than a bucket gets a share of the bucket, not
    the exact count of its values (Entropy and MSE search thresholds on these bins).
    """
    edges = np.linspace(0.0, amax, num_bins + 1)
    counts = np.asarray(counts, dtype=np.float64)
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
    mag_sums = np.asarray(sums, dtype=np.float64)[: last + 1]
    mean_t = np.divide(mag_sums / np.maximum(n, 1) - lo, width, out=np.full(n.size, 0.5))
    slope = np.clip(12.0 * (np.where(n > 0, mean_t, 0.5) - 0.5), -2.0, 2.0)
    before = np.concatenate([[0.0], np.cumsum(n)])
    b = np.clip(np.searchsorted(hi, edges, side="left"), 0, last)
    t = np.clip((edges - lo[b]) / width[b], 0.0, 1.0)
    cdf = before[b] + n[b] * (t + 0.5 * slope[b] * (t * t - t))
    cdf[-1] = before[-1]
    return np.diff(cdf), edges


Observer = MinMaxObserver | HistogramObserver


def observer_from_dict(d: dict[str, Any]) -> Observer:
    kinds = {MinMaxObserver.kind: MinMaxObserver, HistogramObserver.kind: HistogramObserver}
    if d.get("kind") not in kinds:
        raise CalibrationError(f"unknown observer kind {d.get('kind')!r} in calibration data")
    return kinds[d["kind"]].from_dict(d)


# ------------------------------------------------------------------------------------------------
# Searches on histograms
# ------------------------------------------------------------------------------------------------

#: Positions evaluated together (a positions x buckets block).
_POSITION_BLOCK = 16


def histogram_sse(
    hist: HistogramObserver, positions: Iterable[int], qtype: QuantType = QuantType.QInt8
) -> np.ndarray:
    """``sum_x (x - fake_quant(x, p))^2`` over every value ``hist`` observed, for each ``p``.

    Why this is exact for 8-bit types. Take a scale ``s = 2^-p`` and a bucket of width
    ``w = 2^k`` (its edges are multiples of ``w``). In units of ``s`` the bucket width is
    ``v = w / s``, a power of two. If ``v <= 1/2`` the rounding boundaries ``(j + 1/2) s`` are
    multiples of ``w``, so none lies strictly inside the bucket: every value of the bucket rounds
    to the same code ``k_b`` except possibly a value exactly at the lower edge when that edge is a
    boundary -- a tie, whose squared error ``(s/2)^2`` is the same whichever way it rounds. If
    ``v >= 1`` the bucket's magnitudes are ``>= 128 v s >= 128 s``: every value rounds to the
    extreme code (``127`` or ``-128``) or beyond, and saturates there. Hence with the midpoint
    ``c_b``, ``k_b = clip(rint(c_b / s))`` (the sign's code limit) and ``e_b = c_b - k_b s``, and
    ``|x| = c_b + t u_b`` (see :class:`HistogramObserver`)::

        SSE(p) = sum_b sum_{x in b} (e_b + t u_b)^2
               = sum_b [ n_b e_b^2 + 2 e_b u_b T_b ]  +  C,
        C      = sum_b sum_{x in b} (t u_b)^2 = sum x^2 - sum_b [ n_b c_b^2 + 2 c_b u_b T_b ].

    The first sum (all that depends on ``p``) comes from exact integer statistics and is written
    about the bucket midpoints, so it is as accurate as the quantization error itself: the argmin
    is exact. ``C``, the spread of the values about their bucket midpoints, is the same at every
    position; it comes from the float64 sum of squares (relative rounding about ``1e-16`` of
    ``sum x^2``). The argument needs ``p <= MAX_HIST_POSITION`` (the subnormal buckets are
    ``2^-133`` wide).

    16-bit types: buckets ``2^-7`` wide can span several quanta without saturating; for those the
    values are modelled as uniform within the bucket (``s^2/12`` per value inside the range, the
    exact integral for the clipped part), so the result is an approximation there.
    """
    lo_code, hi_code = signed_limits(qtype)
    positions = np.asarray(list(positions), dtype=np.int64).reshape(-1)
    out = np.zeros(positions.size, dtype=np.float64)
    keys, n, offsets = hist.nonzero_buckets()
    if keys.size == 0 or positions.size == 0:
        return out
    mid, unit = bucket_units()
    lower, upper = bucket_edges()
    mag = keys & (_HALF - 1)
    negative = keys >= _HALF
    n = n.astype(np.float64)
    c, u = mid[mag], unit[mag]
    dev_sum = offsets.astype(np.float64) * u  # sum (|x| - c_b)
    spread = max(0.0, sum(hist.square_sums) - float(np.sum(n * c * c + 2.0 * c * dev_sum)))
    qside = np.where(negative, -lo_code, hi_code).astype(np.float64)
    wide = max(hi_code, -lo_code) > 128
    for first in range(0, positions.size, _POSITION_BLOCK):
        block = positions[first : first + _POSITION_BLOCK]
        s = np.ldexp(1.0, -block)[:, None]
        k = np.minimum(np.rint(c / s), qside)
        e = c - k * s
        sse_b = n * e * e + 2.0 * e * dev_sum
        if wide:
            lo_e, hi_e = lower[mag], upper[mag]
            sse_b = np.where(
                _spanning(lo_e, hi_e, s, qside), _uniform_sse(n, lo_e, hi_e, s, qside), sse_b
            )
        out[first : first + block.size] = np.maximum(sse_b.sum(axis=1) + spread, 0.0)
    return out


def minmse_position_from_histogram(
    hist: HistogramObserver, qtype: QuantType = QuantType.QInt8
) -> int:
    """``argmin_p`` of :func:`histogram_sse` over :func:`quark_onnx.pof2.minmse_window`.

    The window starts at the rounding-aware NonOverflow position of the observed ``[min, max]``
    and ends at the saturation position of the smallest non-zero bucket's lower edge (a lower
    bound of the smallest non-zero ``|x|``); ties go to the lower position
    (:func:`quark_onnx.pof2.best_position`). For 8-bit types this is exactly
    :func:`quark_onnx.pof2.minmse_position` of the observed values. An all-zero tensor gives
    :data:`quark_onnx.pof2.ZERO_POSITION`.
    """
    if hist.min > hist.max or (hist.min == 0.0 and hist.max == 0.0):
        return pof2.ZERO_POSITION
    keys = hist.nonzero_buckets()[0]
    lower = bucket_edges()[0][keys & (_HALF - 1)]
    nonzero = lower > 0
    # bucket 0 holds zeros and subnormals: bound those below by the smallest subnormal
    min_nonzero = float(lower[nonzero].min()) if nonzero.any() else math.ldexp(1.0, -149)
    window = pof2.minmse_window(hist.min, hist.max, min_nonzero, qtype)
    return pof2.best_position(window, histogram_sse(hist, window, qtype))


def _spanning(lo_e, hi_e, s, qside) -> np.ndarray:
    """Buckets at least one quantum wide that do not saturate entirely (16-bit types only)."""
    return ((hi_e - lo_e) >= s) & (lo_e < (qside + 0.5) * s)


def _uniform_sse(n, lo_e, hi_e, s, qside) -> np.ndarray:
    """SSE of a bucket whose values are spread uniformly over it, minus their spread about the
    midpoint (``n w^2 / 12``, which :func:`histogram_sse` adds back as part of ``C``)."""
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
