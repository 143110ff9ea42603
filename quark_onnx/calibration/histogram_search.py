"""Searches on a histogram of magnitude buckets (:mod:`~quark_onnx.calibration.buckets`): the
exact power-of-two quantization error at any position and the MinMSE position
(:func:`histogram_sse`, :func:`minmse_position_from_histogram`), and the Entropy and MSE
thresholds on a linear histogram resampled from the buckets (:func:`resample_linear`).

They read a :class:`~quark_onnx.calibration.observers.HistogramObserver` through the few
statistics :class:`BucketStatistics` names, so this module does not import the observers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Protocol

import numpy as np

from quark_onnx.calibration.buckets import _HALF, bucket_edges, bucket_units, signed_limits
from quark_onnx.config.enums import QuantType
from quark_onnx.params import pof2


class BucketStatistics(Protocol):
    """What the searches read of a histogram observer."""

    min: float
    max: float
    square_sums: tuple[float, float]

    def nonzero_buckets(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...


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


#: Positions evaluated together (a positions x buckets block).
_POSITION_BLOCK = 16


def histogram_sse(
    hist: BucketStatistics, positions: Iterable[int], qtype: QuantType = QuantType.QInt8
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
    hist: BucketStatistics, qtype: QuantType = QuantType.QInt8
) -> int:
    """``argmin_p`` of :func:`histogram_sse` over :func:`quark_onnx.params.pof2.minmse_window`.

    The window starts at the rounding-aware NonOverflow position of the observed ``[min, max]``
    and ends at the saturation position of the smallest non-zero bucket's lower edge (a lower
    bound of the smallest non-zero ``|x|``); ties go to the lower position
    (:func:`quark_onnx.params.pof2.best_position`). For 8-bit types this is exactly
    :func:`quark_onnx.params.pof2.minmse_position` of the observed values. An all-zero tensor gives
    :data:`quark_onnx.params.pof2.ZERO_POSITION`.
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
