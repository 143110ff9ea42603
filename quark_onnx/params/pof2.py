"""Power-of-two (XINT8) fixed-point arithmetic: quantize, dequantize, and choosing positions.

This module is the one definition of the power-of-two numerics, used alike for weights, biases and
activations (the calibration observers compute activation positions through these functions; only
the histogram evaluation of the error lives with the histogram, in
:mod:`quark_onnx.calibration.observers`).

A *position* ``p`` is the number of fractional bits of a fixed-point code; the scale is
``s = 2^-p`` (exactly representable in float32 for ``-126 <= p <= 149``). For an integer type with
codes ``[qmin, qmax]`` and zero point ``z`` (0 for signed types; ``2^(bits-1)`` for the unsigned
types used symmetrically, e.g. uint8 with zero point 128)::

    quantize(x, p)   = clip(round_half_even(x / s) + z, qmin, qmax)
    dequantize(q, p) = (q - z) * s
    fake_quant(x, p) = dequantize(quantize(x, p), p)

which is exactly what onnxruntime's QuantizeLinear/DequantizeLinear compute with a power-of-two
scale: dividing by ``2^-p`` is exact in binary floating point, so the only rounding is the
round-half-to-even of ``x / s``. The *centred code range* ``[qmin - z, qmax - z]``
(:func:`code_range`) is ``[-128, 127]`` for both int8 and uint8 with zero point 128: the two
represent the same values.

Choosing positions:

* **NonOverflow** (:func:`nonoverflow_position`): the largest ``p`` (finest scale) at which no value
  of the range ``[lo, hi]`` saturates *after rounding*: ``round_half_even(hi * 2^p) <= qmax - z``
  and ``round_half_even(lo * 2^p) >= qmin - z``. The range may be asymmetric (an activation's
  observed ``[min, max]``, a weight's values): the negative side may use code ``qmin - z = -128``.
* **MinMSE** (:func:`minmse_position`): the ``p`` minimising the sum of squared errors
  ``sum((fake_quant(x, p) - x)^2)`` over all the data, found by exhaustive search over
  :func:`minmse_window` ``= [p_no, p_sat]``, ties to the lower position (:func:`best_position`).
  Only ``p >= p_no`` can win: at ``p_no`` nothing clips, and every coarser grid is a subset of
  ``p_no``'s grid, so no element's error is smaller there. From ``p_sat``
  (:func:`saturation_position`) on, every non-zero value rounds to an extreme code and each error
  grows strictly with ``p``. Arrays (weights) are searched here; histograms (activations) are
  searched by the observers with the same window and tie rule, and give the same position.
* **Bias**: int8 bias gets its own position (NonOverflow over the bias values, or as the NPU
  constraint solver moves it); int32 bias uses ``p_bias = p_in + p_w`` so that the bias is added at
  the accumulator's scale ``s_in * s_w``.

All-zero tensors. Every position represents an all-zero tensor exactly, so the choice is a
convention; it is :data:`ZERO_POSITION` ``=`` :data:`POSITION_MAX` (the finest scale), for
weights, biases and activations alike (also for a tensor with no finite value). The reason is the
NPU constraint solver (:mod:`quark_onnx.params.solver`): it only ever *lowers* shared (activation)
positions, starts a shared-scale group at its members' lowest position, and reports a bias whose
position ends above its preferred (NonOverflow) position as saturating. With the top position a
zero tensor never binds: it does not drag a Concat group down, never forces a neighbour of an Add
down (``shift_read``), never raises a spurious ``bias_range`` overflow for a zero bias, and the
solver can lower it to whatever its neighbours need at zero cost (its error curve is identically
0, see :func:`error_function`). A low convention (e.g. scale 1, ``p = 0``) would do each of those
things to the *other*, non-zero tensors.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

from quark_onnx.config.enums import PowerOfTwoMethod, QuantType

#: Positions are chosen within this range (scales 2^-40 .. 2^40); anything outside is not a
#: meaningful fixed-point format for 8/16/32-bit codes.
POSITION_MIN = -40
POSITION_MAX = 40
#: Position of a tensor whose values are all zero (or that has no finite value). Any position
#: represents it exactly; the finest one never constrains the NPU rules (see the module doc).
ZERO_POSITION = POSITION_MAX


def zero_point(qtype: QuantType) -> int:
    """Zero point of symmetric quantization: 0 for signed types, ``2^(bits-1)`` for unsigned."""
    return qtype.symmetric_zero_point


def code_range(qtype: QuantType) -> tuple[int, int]:
    """Centred code range ``(qmin - z, qmax - z)``: ``(-128, 127)`` for int8 and uint8 alike."""
    qtype = QuantType.coerce(qtype)
    if not qtype.is_integer:
        raise ValueError(f"power-of-two positions need an integer type, got {qtype}")
    z = zero_point(qtype)
    return qtype.qmin - z, qtype.qmax - z


def numpy_dtype(qtype: QuantType) -> np.dtype:
    """The numpy dtype of the integer codes of ``qtype`` (8-, 16- and 32-bit integer types: the
    ones power-of-two positions are defined for). Derived from the type's width and sign, so this
    module does not import :mod:`quark_onnx.params.qparams` (which builds on it); it agrees with
    :func:`quark_onnx.params.qparams.numpy_dtype` (a test checks)."""
    if not qtype.is_integer or qtype.bits < 8:
        raise ValueError(f"{qtype} is not a power-of-two integer type (int8/uint8/int16/int32)")
    return np.dtype(f"{'' if qtype.is_signed else 'u'}int{qtype.bits}")


def scale_of(p: int) -> np.float32:
    """The scale ``2^-p`` as an exact float32."""
    return np.float32(math.ldexp(1.0, -int(p)))


def quantize(x: np.ndarray, p: int, qtype: QuantType = QuantType.QInt8) -> np.ndarray:
    """Integer codes ``clip(round_half_even(x * 2^p) + z, qmin, qmax)`` in ``qtype``'s dtype."""
    scaled = np.asarray(x, dtype=np.float64) * math.ldexp(1.0, int(p))
    q = np.rint(scaled) + zero_point(qtype)
    return np.clip(q, qtype.qmin, qtype.qmax).astype(numpy_dtype(qtype))


def dequantize(q: np.ndarray, p: int, qtype: QuantType = QuantType.QInt8) -> np.ndarray:
    """Float32 values ``(q - z) * 2^-p``."""
    centred = np.asarray(q, dtype=np.float64) - zero_point(qtype)
    return (centred * math.ldexp(1.0, -int(p))).astype(np.float32)


def fake_quant(x: np.ndarray, p: int, qtype: QuantType = QuantType.QInt8) -> np.ndarray:
    """``dequantize(quantize(x, p), p)``: the value the quantized model computes with.

    Float32, exact for 8- and 16-bit codes (a code times a power of two).
    """
    return dequantize(quantize(x, p, qtype), p, qtype)


#: Arrays of more values than this are processed in pieces of this size, so the float64
#: temporaries stay bounded: a few 2 MiB arrays instead of several the size of the weight in
#: float64 (benchmarks/results/measurements.md).
CHUNK = 1 << 18


def _finite64(x: np.ndarray) -> np.ndarray:
    x64 = np.asarray(x, dtype=np.float64).reshape(-1)
    if x64.size and not np.isfinite(x64).all():
        x64 = x64[np.isfinite(x64)]
    return x64


def _finite_chunks(x: np.ndarray) -> Iterator[np.ndarray]:
    """The finite values of ``x`` as float64, in pieces of at most :data:`CHUNK` values."""
    flat = np.asarray(x).reshape(-1)
    for start in range(0, flat.size, CHUNK):
        yield _finite64(flat[start : start + CHUNK])


def _errors64(x64: np.ndarray, p: int, qtype: QuantType) -> tuple[np.ndarray, np.ndarray]:
    """``(fake_quant(x, p) - x, x * 2^p)`` in float64."""
    lo, hi = code_range(qtype)
    scaled = x64 * math.ldexp(1.0, int(p))
    return np.clip(np.rint(scaled), lo, hi) * math.ldexp(1.0, -int(p)) - x64, scaled


def _sse64(x64: np.ndarray, p: int, qtype: QuantType) -> float:
    err, _ = _errors64(x64, p, qtype)
    return float(np.sum(err * err))


def sse(x: np.ndarray, p: int, qtype: QuantType = QuantType.QInt8) -> float:
    """Sum of squared quantization errors ``sum((fake_quant(x, p) - x)^2)``, in float64.

    Arrays above :data:`CHUNK` values are summed piece by piece (the same value up to the float64
    rounding of the summation order).
    """
    x = np.asarray(x)
    if x.size <= CHUNK:
        return _sse64(np.asarray(x, dtype=np.float64), p, qtype)
    flat = x.reshape(-1)
    return sum(
        _sse64(np.asarray(flat[i : i + CHUNK], dtype=np.float64), p, qtype)
        for i in range(0, flat.size, CHUNK)
    )


def mse(x: np.ndarray, p: int, qtype: QuantType = QuantType.QInt8) -> float:
    """Mean squared quantization error of ``x`` at position ``p`` (0.0 for an empty array)."""
    n = np.asarray(x).size
    return sse(x, p, qtype) / n if n else 0.0


def nonoverflow_position(lo: float, hi: float, qtype: QuantType = QuantType.QInt8) -> int:
    """Largest ``p`` at which the range ``[lo, hi]`` quantizes without saturating.

    ``p`` satisfies ``round_half_even(hi * 2^p) <= qmax - z`` and
    ``round_half_even(lo * 2^p) >= qmin - z`` (``[lo, hi]`` is widened to contain 0). An all-zero
    range gets :data:`ZERO_POSITION`; the result is clamped to
    ``[POSITION_MIN, POSITION_MAX]``.

    Raises:
        ValueError: ``lo`` or ``hi`` is not finite.
    """
    lo, hi = float(lo), float(hi)
    if not (math.isfinite(hi) and math.isfinite(lo)):
        raise ValueError(f"range [{lo}, {hi}] is not finite; no position covers it")
    bottom, top = code_range(qtype)
    hi = max(hi, 0.0)
    lo = min(lo, 0.0)
    if hi == 0.0 and lo == 0.0:
        return ZERO_POSITION
    # start from the analytic estimate, then settle the rounding at the boundary exactly
    bound = max(hi / top if top > 0 else 0.0, lo / bottom if bottom < 0 else 0.0)
    p = math.floor(-math.log2(bound)) + 1
    p = min(max(p, POSITION_MIN), POSITION_MAX)

    def fits(pos: int) -> bool:
        f = math.ldexp(1.0, pos)
        return round(hi * f) <= top and round(lo * f) >= bottom  # round() is half-to-even

    while p > POSITION_MIN and not fits(p):
        p -= 1
    while p < POSITION_MAX and fits(p + 1):
        p += 1
    return p


def position_for_abs_max(max_abs: float, qtype: QuantType = QuantType.QInt8) -> int:
    """NonOverflow position of a symmetric range ``[-max_abs, max_abs]``."""
    return nonoverflow_position(-abs(max_abs), abs(max_abs), qtype)


def saturation_position(min_abs_nonzero: float, qtype: QuantType = QuantType.QInt8) -> int:
    """Smallest ``p`` at which every value with ``|x| >= min_abs_nonzero`` rounds to an extreme
    code: ``min_abs_nonzero * 2^p >= top + 1/2`` with ``top = qmax - z``.

    From there on each such value's error (``|x| - top * s`` on the positive side,
    ``|x| - (top + 1) * s`` or the distance to ``-(top + 1) * s`` on the negative side) grows
    strictly with ``p``, so no larger position can lower the error.
    """
    m = float(min_abs_nonzero)
    if not (math.isfinite(m) and m > 0.0):
        raise ValueError(f"min_abs_nonzero must be finite and > 0, got {m}")
    edge = code_range(qtype)[1] + 0.5
    p = math.ceil(math.log2(edge / m))
    # math.log2 may be off by one ulp near powers of two: settle it with exact comparisons
    while math.ldexp(edge, -p) > m:
        p += 1
    while math.ldexp(edge, -(p - 1)) <= m:
        p -= 1
    return p


def minmse_window(
    lo: float, hi: float, min_abs_nonzero: float, qtype: QuantType = QuantType.QInt8
) -> range:
    """The positions MinMSE evaluates: ``p_no .. min(max(p_no, p_sat), POSITION_MAX)``.

    ``p_no = nonoverflow_position(lo, hi)`` and ``p_sat = saturation_position(min_abs_nonzero)``
    (see the module doc for why no position outside can win). ``min_abs_nonzero`` may be any lower
    bound of the smallest non-zero ``|x|`` (a histogram bucket edge): positions beyond the true
    ``p_sat`` are strictly worse, so the extra candidates never change the result.
    """
    p_no = nonoverflow_position(lo, hi, qtype)
    p_sat = saturation_position(min_abs_nonzero, qtype)
    return range(p_no, min(max(p_no, p_sat), POSITION_MAX) + 1)


def best_position(positions: Sequence[int], errors: Iterable[float]) -> int:
    """The position of the smallest error; ties go to the lower position (the larger scale)."""
    best, best_err = None, math.inf
    for p, err in sorted(zip(positions, errors, strict=True)):
        if best is None or err < best_err:
            best, best_err = p, err
    if best is None:
        raise ValueError("best_position needs at least one candidate position")
    return int(best)


def minmse_position(x: np.ndarray, qtype: QuantType = QuantType.QInt8) -> int:
    """Position minimising :func:`sse` over ``x`` (exhaustive over :func:`minmse_window`).

    Non-finite values are ignored; an empty or all-zero array gets :data:`ZERO_POSITION`.
    ``x`` is read in pieces of :data:`CHUNK` values for every candidate (it may be memory-mapped;
    it is never copied whole, and the float64 temporaries stay a few MB).
    """
    _, lo, hi, small = _finite_stats(x)
    if not math.isfinite(small):
        return ZERO_POSITION
    best, best_err = 0, math.inf
    for p in minmse_window(lo, hi, small, qtype):  # ascending
        err = clipped = 0.0
        for chunk in _finite_chunks(x):
            e, c = _sse_and_clip64(chunk, p, qtype)
            err += e
            clipped += c
        if err < best_err:  # strictly: ties go to the lower position
            best, best_err = p, err
        if clipped > best_err * (1.0 + 1e-12):
            # every later position clips more: its error is at least ``clipped``
            break
    return int(best)


def _sse_and_clip64(x64: np.ndarray, p: int, qtype: QuantType) -> tuple[float, float]:
    """:func:`sse` at ``p`` and the part of it from values beyond the extreme codes.

    Why the search may stop on the second number. A value above ``hi * 2^-p`` is represented by
    ``hi`` (it rounds to ``hi`` or saturates there), so its error is exactly
    ``x - hi * 2^-p``; likewise below ``lo * 2^-p``. Raising ``p`` lowers both thresholds, so the
    set of such values only grows and each of their errors only grows: this *clipping error* is
    non-decreasing in ``p`` and a lower bound of the whole error at every later position. Once it
    exceeds the best error found, no later position can be better (the 1e-12 margin keeps float64
    summation rounding from deciding a near-tie differently from the exhaustive search).
    """
    lo, hi = code_range(qtype)
    err, scaled = _errors64(x64, p, qtype)
    err *= err
    beyond = (scaled > hi) | (scaled < lo)
    return float(np.sum(err)), float(np.sum(err, where=beyond))


def _finite_stats(x: np.ndarray) -> tuple[int, float, float, float]:
    """Count, min, max and smallest non-zero ``|x|`` of the finite values, piece by piece
    (``min_abs_nonzero`` is ``inf`` when every value is 0)."""
    count, lo, hi, small = 0, math.inf, -math.inf, math.inf
    for chunk in _finite_chunks(x):
        if not chunk.size:
            continue
        count += chunk.size
        lo, hi = min(lo, float(chunk.min())), max(hi, float(chunk.max()))
        nz = np.abs(chunk[chunk != 0])
        if nz.size:
            small = min(small, float(nz.min()))
    return count, lo, hi, small


def weight_position(
    w: np.ndarray,
    method: PowerOfTwoMethod = PowerOfTwoMethod.MinMSE,
    qtype: QuantType = QuantType.QInt8,
) -> int:
    """Position of a weight tensor (per tensor) by NonOverflow or MinMSE over all its values."""
    method = PowerOfTwoMethod.coerce(method)
    if method is PowerOfTwoMethod.NonOverflow:
        count, lo, hi, _ = _finite_stats(w)
        if count == 0:
            return ZERO_POSITION
        return nonoverflow_position(lo, hi, qtype)
    return minmse_position(w, qtype)


def bias_position(
    b: np.ndarray,
    p_in: int | None = None,
    p_w: int | None = None,
    int32: bool = False,
) -> int:
    """Bias position: ``p_in + p_w`` for int32 bias, else the int8 NonOverflow position of ``b``.

    A zero bias gets :data:`ZERO_POSITION`: the solver then places it anywhere in its shift_bias
    window without reporting a saturation.
    """
    if int32:
        if p_in is None or p_w is None:
            raise ValueError("int32 bias needs the input and weight positions (p_in + p_w)")
        return int(p_in) + int(p_w)
    return weight_position(b, PowerOfTwoMethod.NonOverflow, QuantType.QInt8)


def error_function(x: np.ndarray, qtype: QuantType = QuantType.QInt8) -> Callable[[int], float]:
    """``p -> mse(x, p)`` (memoised): the per-tensor cost the NPU constraint solver minimises.

    The currency is the *mean* squared error per element, not the sum. The solver compares moves
    of different tensors (lower a weight's position, or an activation's, or raise an output's) and
    picks the one whose error increase is smallest. What a tensor's quantization noise does to the
    network is its noise *per element*: in ``y = sum_k w_k x_k`` the output noise variance is about
    ``K * (mse_w * E[x^2] + mse_x * E[w^2])`` whatever the number of elements of ``w`` and ``x``;
    a weight with a few thousand elements is reused at every output pixel. A sum over elements
    would make an 800k-element activation look hundreds of times dearer than a 2k-element weight
    for the same per-element damage, so the solver would wreck weights to spare activations.
    Activation curves (:meth:`quark_onnx.calibration.CalibrationResult.error_function`) use the
    same currency: the exact SSE over all calibration values divided by their count.
    (Tensors of very different magnitudes are still compared in absolute units; dividing by
    ``mean(x^2)`` would compare noise-to-signal ratios instead.)
    """
    # No float64 copy is kept: the solver holds a curve for every weight until it is done, and
    # float64 copies of all of them were twice the model's weights (measurements.md in
    # benchmarks/results). ``x`` itself (a view; memory-mapped for external weights) is converted
    # again, piece by piece, for each position asked: the solver asks a few per tensor.
    source = np.asarray(x)
    count = _finite_stats(source)[0]

    @functools.cache
    def cost(p: int) -> float:
        if not count:
            return 0.0
        return sum(_sse64(chunk, int(p), qtype) for chunk in _finite_chunks(source)) / count

    return cost
