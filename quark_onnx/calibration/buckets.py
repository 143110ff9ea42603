"""The histogram's buckets: the top 16 bits of a float32 bit pattern (sign, 8 exponent bits, 7
mantissa bits) as the key; the low 16 bits are the exact offset of a value inside its bucket. A
bucket of magnitude ``2^e`` spans ``[m, m + 2^(e-7))``: its width is at most ``2^-7`` of its
values. Also the centred code range of a quantized type, which every search on buckets uses,
and the float32 helpers of the observers (bit patterns, finite values, array encoding).
"""

from __future__ import annotations

import base64
import functools
import math
from typing import Any

import numpy as np

from quark_onnx.config.enums import QuantType
from quark_onnx.errors import CalibrationError, ConfigError
from quark_onnx.params import pof2

#: Number of histogram buckets: every value of the top 16 bits of a float32.
NUM_BUCKETS = 1 << 16
_HALF = 1 << 15
#: Largest position at which the histogram error is exact for 8-bit types: above it the subnormal
#: buckets are wider than half a quantum (far beyond :data:`quark_onnx.params.pof2.POSITION_MAX`).
MAX_HIST_POSITION = 132


def signed_limits(qtype: QuantType) -> tuple[int, int]:
    """Centred code range ``(lo, hi)`` of ``qtype`` (:func:`quark_onnx.params.pof2.code_range`).

    Raises :class:`~quark_onnx.errors.ConfigError` for a type without integer codes.
    """
    qtype = QuantType.coerce(qtype)
    if not qtype.is_integer:
        raise ConfigError(f"power-of-two positions need an integer type, got {qtype}")
    return pof2.code_range(qtype)


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


def _pattern(v: float) -> int:
    """The float32 bit pattern of ``v`` (a float32 value)."""
    return int(np.float32(v).view(np.uint32))


def _key_length(length: int) -> int:
    """``length`` keys rounded up to whole exponents (128 keys), at most 65536."""
    return min(NUM_BUCKETS, -(-length // 128) * 128)


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
