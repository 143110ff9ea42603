"""Per-tensor observers: streaming statistics from which ranges and power-of-two positions follow.

Two observers, each updated batch by batch in memory that does not grow with the number of
samples, and each *mergeable*: two observers fed disjoint parts of the data merge into exactly the
observer fed all of it (``a.merge(b)``), which is also how a Concat output is derived from its
inputs.

:class:`MinMaxObserver` (:mod:`~quark_onnx.calibration.minmax`, imported here)
    Running minimum and maximum (and, with ``CalibMovingAverage``, their exponential moving
    average over batches). Serves ``MinMax`` ranges and the ``NonOverflow`` position.

:class:`HistogramObserver`
    A histogram of float32 magnitude buckets (:mod:`~quark_onnx.calibration.buckets`: the top 16
    bits of the bit pattern as the key, at most ``2^-7`` of its values wide; the low 16 bits the
    exact offset of a value inside its bucket). Per bucket it keeps two integers -- the count
    ``n_b`` and the sum ``T_b`` of the centred offsets, from which the bucket's sum follows
    exactly (see :class:`HistogramObserver`) -- plus the sums of squares of the positive and of
    the negative values and the exact minimum and maximum. It serves every method (the searches
    are :mod:`~quark_onnx.calibration.histogram_search`'s):

    * ``MinMSE`` exactly, and the exact quantization error at any position
      (:func:`histogram_sse`, :func:`minmse_position_from_histogram`),
    * ``Percentile`` within one bucket (relative error below ``2^-7``),
    * ``Entropy`` and ``MSE`` on a linear histogram of ``NumBins`` bins resampled from it.

The power-of-two numerics (positions, NonOverflow, the MinMSE window and tie rule, the all-zero
convention) are :mod:`quark_onnx.params.pof2`'s; only their evaluation on a histogram lives here. An
unsigned type with the midpoint zero point (uint8 with zero point 128) represents exactly the same
values as the signed type of the same width (:func:`quark_onnx.params.pof2.code_range`).

Non-finite values (NaN, +-Inf) are never folded into a range: each observer counts and skips them
(``nonfinite``); the collector warns with the tensor name and the count.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np

from quark_onnx.calibration.buckets import (
    _HALF,
    NUM_BUCKETS,
    _decode,
    _encode,
    _finite_float32,
    _float32,
    _key_length,
    _pattern,
    bucket_edges,
    bucket_units,
)
from quark_onnx.calibration.histogram_search import (
    entropy_threshold_from_histogram,
    histogram_sse,
    minmse_position_from_histogram,
    mse_threshold_from_histogram,
    resample_linear,
)
from quark_onnx.calibration.minmax import MinMaxObserver
from quark_onnx.config.enums import QuantType
from quark_onnx.errors import CalibrationError, ConfigError
from quark_onnx.params import pof2

#: Values binned per step: the step's keys and offsets stay in the CPU cache.
_CHUNK = 1 << 15
#: Added to every staged bit pattern: a staged bucket ``b`` holds ``n_b (2^40 + 2^16 b) +
#: sum(low16)``, from which both parts follow exactly while ``n_b <= 2^22``.
_PACK = 1 << 40
#: Values staged before the staged sums are unpacked (every bucket then has ``n_b <= 2^22``).
_STAGE_LIMIT = (1 << 22) - _CHUNK


_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY.setflags(write=False)

_SCRATCH = threading.local()

try:  # what np.einsum calls (without ``optimize``), minus its Python wrapper: one call per step
    from numpy._core.multiarray import c_einsum as _einsum
except ImportError:  # pragma: no cover - another numpy layout
    _einsum = np.einsum


def _scratch() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """This thread's working arrays of :meth:`HistogramObserver._bin` (:data:`_CHUNK` each: the
    packed patterns and the keys as int64, the values and their negative parts as float64).

    Reused for every step: fresh temporaries of 256 KiB each are above glibc's mmap threshold or
    at the top of its heap, so each step's would be mapped (or grown) and page-faulted anew --
    more time than the arithmetic they hold. Per thread, since observers may be folded on two.
    """
    arrays = getattr(_SCRATCH, "arrays", None)
    if arrays is None:
        arrays = (
            np.empty(_CHUNK, np.int64),
            np.empty(_CHUNK, np.int64),
            np.empty(_CHUNK, np.float64),
            np.empty(_CHUNK, np.float64),
        )
        _SCRATCH.arrays = arrays
    return arrays


def _frozen(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


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
        """Add ``(n, t)`` of the non-empty buckets ``keys`` (ascending) to the statistics.

        Once a tensor's range has been seen, later data rarely opens a new bucket: then the sums
        are added in place of the known buckets, without building the union of the keys.
        """
        if self._keys.size and keys.size:
            at = np.searchsorted(self._keys, keys)
            if at[-1] < self._keys.size and np.array_equal(self._keys[at], keys):
                n_all, t_all = self._n.copy(), self._t.copy()
                n_all[at] += n
                t_all[at] += t
                self._n, self._t = _frozen(n_all), _frozen(t_all)
                return
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
        add_at, einsum, copyto = np.add.at, _einsum, np.copyto
        least, most = np.minimum.reduce, np.maximum.reduce
        packed_buf, keys_buf, x64_buf, neg_buf = _scratch()
        pos_sq, neg_sq = 0.0, 0.0
        for start in range(0, values.size, _CHUNK):
            chunk = values[start : start + _CHUNK]
            lo, hi = float(least(chunk)), float(most(chunk))  # NaN propagates
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
            m = chunk.size
            packed, keys, x64 = packed_buf[:m], keys_buf[:m], x64_buf[:m]
            # the key is the numeric top half of the pattern: no byte-order question
            copyto(packed, chunk.view(np.uint32))
            np.right_shift(packed, 16, out=keys)
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
            np.add(packed, _PACK, out=packed)
            add_at(stage, keys, packed)
            self._staged += m
            copyto(x64, chunk)
            if lo < 0.0:
                neg = neg_buf[:m]
                np.minimum(x64, 0.0, out=neg)
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
        """:func:`quark_onnx.params.pof2.nonoverflow_position` of the observed ``[min, max]``."""
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


Observer = MinMaxObserver | HistogramObserver


def observer_from_dict(d: dict[str, Any]) -> Observer:
    kinds = {MinMaxObserver.kind: MinMaxObserver, HistogramObserver.kind: HistogramObserver}
    if d.get("kind") not in kinds:
        raise CalibrationError(f"unknown observer kind {d.get('kind')!r} in calibration data")
    return kinds[d["kind"]].from_dict(d)
