"""Power-of-two (XINT8) fixed-point arithmetic: quantize, dequantize, and choosing positions.

A *position* ``p`` is the number of fractional bits of a fixed-point code; the scale is
``s = 2^-p`` (exactly representable in float32 for ``-126 <= p <= 149``). For an integer type with
codes ``[qmin, qmax]`` and zero point ``z`` (0 for signed types; ``2^(bits-1)`` for the unsigned
types used symmetrically, e.g. uint8 with zero point 128)::

    quantize(x, p)   = clip(round_half_even(x / s) + z, qmin, qmax)
    dequantize(q, p) = (q - z) * s
    fake_quant(x, p) = dequantize(quantize(x, p), p)

which is exactly what onnxruntime's QuantizeLinear/DequantizeLinear compute with a power-of-two
scale: dividing by ``2^-p`` is exact in binary floating point, so the only rounding is the
round-half-to-even of ``x / s``.

Choosing positions:

* **NonOverflow**: the largest ``p`` (finest scale) at which no value saturates, i.e.
  ``round_half_even(max(x) * 2^p) <= qmax - z`` and ``round_half_even(min(x) * 2^p) >= qmin - z``.
* **MinMSE**: the ``p`` minimising ``mean((fake_quant(x, p) - x)^2)`` over the whole array, found by
  exhaustive search. Only ``p >= p_nonoverflow`` can win: at ``p_nonoverflow`` nothing clips and its
  grid contains every coarser grid's points inside the representable range, so every element's
  error there is no larger than at any ``p < p_nonoverflow``. Once ``128 * 2^-p`` drops below the
  smallest non-zero ``|x|``, every non-zero element saturates and the error only grows with ``p``,
  so the search window ``[p_nonoverflow, p_saturated]`` is exact (capped at :data:`MAX_SEARCH`
  positions).
* **Bias**: int8 bias gets its own position (NonOverflow over the bias values, or as the NPU
  constraint solver moves it); int32 bias uses ``p_bias = p_in + p_w`` so that the bias is added at
  the accumulator's scale ``s_in * s_w``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import numpy as np

from quark_onnx.enums import PowerOfTwoMethod, QuantType

#: Positions are searched within this range (scales 2^-40 .. 2^40); anything outside is not a
#: meaningful fixed-point format for 8/16/32-bit codes.
POSITION_MIN = -40
POSITION_MAX = 40
#: Most positions MinMSE tries above the NonOverflow position.
MAX_SEARCH = 32


def zero_point(qtype: QuantType) -> int:
    """Zero point of symmetric quantization: 0 for signed types, ``2^(bits-1)`` for unsigned."""
    return 0 if qtype.is_signed else 2 ** (qtype.bits - 1)


def numpy_dtype(qtype: QuantType) -> np.dtype:
    """The numpy dtype of the integer codes of ``qtype``."""
    table = {
        QuantType.QInt8: np.int8,
        QuantType.QUInt8: np.uint8,
        QuantType.QInt16: np.int16,
        QuantType.QUInt16: np.uint16,
        QuantType.QInt32: np.int32,
    }
    if qtype not in table:
        raise ValueError(f"{qtype} is not a power-of-two integer type (int8/uint8/int16/int32)")
    return np.dtype(table[qtype])


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
    """``dequantize(quantize(x, p), p)``: the value the quantized model computes with."""
    return dequantize(quantize(x, p, qtype), p, qtype)


def mse(x: np.ndarray, p: int, qtype: QuantType = QuantType.QInt8) -> float:
    """Mean squared quantization error of ``x`` at position ``p``."""
    x64 = np.asarray(x, dtype=np.float64)
    if x64.size == 0:
        return 0.0
    step = math.ldexp(1.0, -int(p))
    z = zero_point(qtype)
    q = np.clip(np.rint(x64 / step), qtype.qmin - z, qtype.qmax - z)
    return float(np.mean((q * step - x64) ** 2))


def nonoverflow_position(lo: float, hi: float, qtype: QuantType = QuantType.QInt8) -> int:
    """Largest ``p`` at which the range ``[lo, hi]`` quantizes without saturating.

    ``p`` satisfies ``round_half_even(hi * 2^p) <= qmax - z`` and
    ``round_half_even(lo * 2^p) >= qmin - z``. An all-zero range gets :data:`POSITION_MAX`.
    """
    z = zero_point(qtype)
    top, bottom = qtype.qmax - z, qtype.qmin - z
    hi = max(float(hi), 0.0)
    lo = min(float(lo), 0.0)
    if hi == 0.0 and lo == 0.0:
        return POSITION_MAX
    if not (math.isfinite(hi) and math.isfinite(lo)):
        raise ValueError(f"range [{lo}, {hi}] is not finite; no position covers it")
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


def minmse_position(x: np.ndarray, qtype: QuantType = QuantType.QInt8) -> int:
    """Position minimising :func:`mse` over ``x`` (exhaustive; ties go to the lower position)."""
    x64 = np.asarray(x, dtype=np.float64).ravel()
    if x64.size == 0 or not np.any(x64):
        return POSITION_MAX
    start = nonoverflow_position(float(x64.min()), float(x64.max()), qtype)
    smallest = float(np.min(np.abs(x64[x64 != 0])))
    limit = 2 ** (qtype.bits - 1)
    # beyond p_saturated every non-zero element saturates and the error grows monotonically
    p_saturated = math.ceil(math.log2(limit / smallest))
    stop = min(max(start, p_saturated), start + MAX_SEARCH, POSITION_MAX)
    best_p, best_err = start, mse(x64, start, qtype)
    for p in range(start + 1, stop + 1):
        err = mse(x64, p, qtype)
        if err < best_err:
            best_p, best_err = p, err
    return best_p


def weight_position(
    w: np.ndarray,
    method: PowerOfTwoMethod = PowerOfTwoMethod.MinMSE,
    qtype: QuantType = QuantType.QInt8,
) -> int:
    """Position of a weight tensor (per tensor) by NonOverflow or MinMSE over all its values."""
    method = PowerOfTwoMethod.coerce(method)
    arr = np.asarray(w)
    if method is PowerOfTwoMethod.NonOverflow:
        if arr.size == 0:
            return POSITION_MAX
        return nonoverflow_position(float(arr.min()), float(arr.max()), qtype)
    return minmse_position(arr, qtype)


def bias_position(
    b: np.ndarray,
    p_in: int | None = None,
    p_w: int | None = None,
    int32: bool = False,
) -> int:
    """Bias position: ``p_in + p_w`` for int32 bias, else the int8 NonOverflow position of ``b``."""
    if int32:
        if p_in is None or p_w is None:
            raise ValueError("int32 bias needs the input and weight positions (p_in + p_w)")
        return int(p_in) + int(p_w)
    arr = np.asarray(b)
    if arr.size == 0:
        return POSITION_MAX
    return nonoverflow_position(float(arr.min()), float(arr.max()), QuantType.QInt8)


def error_function(x: np.ndarray, qtype: QuantType = QuantType.QInt8) -> Callable[[int], float]:
    """``p -> mse(x, p)`` memoised: the per-tensor cost the NPU constraint solver minimises."""
    data = np.asarray(x, dtype=np.float64).ravel().copy()

    @functools.cache
    def cost(p: int) -> float:
        return mse(data, int(p), qtype)

    return cost
