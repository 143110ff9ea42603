"""Quantization parameters of one tensor, and the numpy reference of their arithmetic.

:class:`QuantParams` is the one record every strategy and format speaks: the static XINT8 flow
(a power-of-two scale is just a scale ``2^-p``), float-scale static quantization, weight-only and
dynamic quantization, the recipe files (save/load), importing foreign QDQ models and GGUF export.
It is plain data: a quant type, a scale and zero point (arrays, shaped by the granularity) and,
for a constant tensor, optionally its integer codes.

Granularity follows ONNX ``QuantizeLinear`` (opset 21 for blocks):

* per tensor: ``scale.shape == ()``, ``axis is None``;
* per channel: ``scale.shape == (x.shape[axis],)``;
* per group (block): ``scale.shape == x.shape`` with ``x.shape[axis]`` replaced by
  ``ceil(x.shape[axis] / block_size)``; element ``i`` along ``axis`` uses scale ``i // block_size``.

The arithmetic (ONNX semantics, which onnxruntime implements)::

    integer:  q = saturate(round_half_even(x / scale) + zero_point)
    float8:   q = float8_e4m3fn(clip(x / scale, -448, 448))      (saturate=1; zero point 0)
    x' = (q - zero_point) * scale

``float16``/``bfloat16`` have no scale: the tensor goes through a Cast pair (``x -> Cast(to=bf16)
-> Cast(to=float)``), so ``scale`` and ``zero_point`` are None and :func:`fake_quant` is the
round trip through that type.

Dynamic activations (``dynamic=True``) carry no scale: it is computed at run time from the tensor
itself (:func:`dynamic_params` is the numpy reference of what the graph computes).

Low-bit and float8 codes use the ``ml_dtypes`` numpy types (``int4``, ``uint4``,
``float8_e4m3fn``, ``bfloat16``), which ``onnx`` and ``onnx_ir`` already depend on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from quark_onnx.config.enums import QuantType
from quark_onnx.errors import QuantizationError
from quark_onnx.params.pof2 import scale_of

#: Largest finite float8 e4m3fn value; QuantizeLinear saturates to it.
FLOAT8_E4M3FN_MAX = 448.0

_NUMPY_DTYPES: dict[QuantType, np.dtype] = {
    QuantType.QInt8: np.dtype(np.int8),
    QuantType.QUInt8: np.dtype(np.uint8),
    QuantType.QInt16: np.dtype(np.int16),
    QuantType.QUInt16: np.dtype(np.uint16),
    QuantType.QInt32: np.dtype(np.int32),
    QuantType.QInt4: np.dtype(ml_dtypes.int4),
    QuantType.QUInt4: np.dtype(ml_dtypes.uint4),
    QuantType.QFLOAT8E4M3FN: np.dtype(ml_dtypes.float8_e4m3fn),
    QuantType.QFloat16: np.dtype(np.float16),
    QuantType.QBFloat16: np.dtype(ml_dtypes.bfloat16),
}

#: Types written as a Cast pair instead of QuantizeLinear/DequantizeLinear.
CAST_TYPES = frozenset({QuantType.QFloat16, QuantType.QBFloat16})


def numpy_dtype(qtype: QuantType) -> np.dtype:
    """The numpy dtype of ``qtype``'s codes (ml_dtypes for int4/uint4/float8/bfloat16)."""
    return _NUMPY_DTYPES[QuantType.coerce(qtype)]


@dataclass(frozen=True, eq=False)
class QuantParams:
    """How one tensor is quantized (see the module docstring for shapes and arithmetic).

    Attributes:
        qtype: the data type of the codes.
        scale: float32 array (shape ``()``, ``(C,)`` or the block shape); None for Cast-pair types
            and dynamic activations.
        zero_point: array of ``qtype``'s numpy dtype, same shape as ``scale``; None where
            ``scale`` is None.
        axis: the channel/block axis (None: per tensor).
        block_size: group size along ``axis`` (None: per channel or per tensor).
        dynamic: the scale is computed at run time from the tensor (dynamic quantization).
        symmetric: how a dynamic scale is computed (symmetric: ``max|x| / qmax``).
        codes: for a constant tensor, its quantized values (AdaRound, bias correction and imported
            models decide codes that re-quantizing the float values would not reproduce).
    """

    qtype: QuantType
    scale: np.ndarray | None = None
    zero_point: np.ndarray | None = None
    axis: int | None = None
    block_size: int | None = None
    dynamic: bool = False
    symmetric: bool = True
    codes: np.ndarray | None = None

    @property
    def is_cast(self) -> bool:
        """Written as a Cast pair (float16/bfloat16), not as QuantizeLinear/DequantizeLinear."""
        return self.qtype in CAST_TYPES

    @property
    def granularity(self) -> str:
        """``"cast"``, ``"dynamic"``, ``"tensor"``, ``"channel"`` or ``"group"``."""
        if self.is_cast:
            return "cast"
        if self.dynamic:
            return "dynamic"
        if self.axis is None:
            return "tensor"
        return "group" if self.block_size else "channel"

    def validate(self, shape: tuple[int, ...] | None = None, name: str = "tensor") -> None:
        """Raise :class:`QuantizationError` naming ``name`` if these parameters are inconsistent
        (with each other, or with a tensor of ``shape`` when given)."""
        where = f"{name}: {self.qtype.name}"
        if self.is_cast or self.dynamic:
            if self.scale is not None or self.zero_point is not None:
                raise QuantizationError(f"{where}: a {self.granularity} tensor carries no scale")
            return
        if self.scale is None or self.zero_point is None:
            raise QuantizationError(f"{where}: scale and zero point are required")
        if self.scale.shape != self.zero_point.shape:
            raise QuantizationError(
                f"{where}: scale shape {self.scale.shape} != zero point shape "
                f"{self.zero_point.shape}"
            )
        if self.zero_point.dtype != numpy_dtype(self.qtype):
            raise QuantizationError(
                f"{where}: zero point dtype {self.zero_point.dtype} is not "
                f"{numpy_dtype(self.qtype)}"
            )
        if not np.all(np.isfinite(self.scale)) or np.any(self.scale <= 0):
            raise QuantizationError(f"{where}: scales must be finite and positive")
        if self.block_size is not None and (self.axis is None or self.block_size < 1):
            raise QuantizationError(f"{where}: block_size needs an axis and must be >= 1")
        if shape is None:
            return
        expected = expected_scale_shape(shape, self.axis, self.block_size)
        if self.scale.shape != expected:
            raise QuantizationError(
                f"{where}: scale shape {self.scale.shape} does not fit a tensor of shape "
                f"{tuple(shape)} ({self.granularity}; expected {expected})"
            )
        if self.codes is not None and tuple(self.codes.shape) != tuple(shape):
            raise QuantizationError(
                f"{where}: codes shape {self.codes.shape} != tensor shape {tuple(shape)}"
            )


def expected_scale_shape(
    shape: tuple[int, ...], axis: int | None, block_size: int | None
) -> tuple[int, ...]:
    """The scale shape for a tensor of ``shape`` at this granularity."""
    if axis is None:
        return ()
    axis = _normal_axis(axis, len(shape))
    if block_size is None:
        return (int(shape[axis]),)
    out = list(int(d) for d in shape)
    out[axis] = math.ceil(out[axis] / block_size)
    return tuple(out)


def _normal_axis(axis: int, rank: int) -> int:
    if not -rank <= axis < rank:
        raise QuantizationError(f"axis {axis} is out of range for a rank-{rank} tensor")
    return axis % rank


def broadcast_parameter(
    values: np.ndarray, shape: tuple[int, ...], axis: int | None, block_size: int | None
) -> np.ndarray:
    """Expand a scale or zero point to ``shape`` (per tensor, per channel or per block)."""
    values = np.asarray(values)
    if axis is None:
        return values
    axis = _normal_axis(axis, len(shape))
    if block_size is None:
        view = [1] * len(shape)
        view[axis] = values.shape[0]
        return values.reshape(view)
    expanded = np.repeat(values, block_size, axis=axis)
    return np.take(expanded, np.arange(shape[axis]), axis=axis)


def _block_views(
    x: np.ndarray, params: QuantParams
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``x`` as blocks (axis split into ``(blocks, block_size)``) with the scale and zero point
    shaped to broadcast over them: views, where :func:`broadcast_parameter` would expand both to
    the size of ``x`` (for a 100 MB weight, 300 MB more). None when the axis is not a multiple
    of the block size."""
    axis = _normal_axis(params.axis, x.ndim)
    size = params.block_size
    if size is None or x.shape[axis] % size or params.scale.shape[axis] * size != x.shape[axis]:
        return None
    blocks = (*x.shape[:axis], x.shape[axis] // size, size, *x.shape[axis + 1 :])
    per_block = (*params.scale.shape[:axis], params.scale.shape[axis], 1)
    per_block += params.scale.shape[axis + 1 :]
    scale = params.scale.astype(np.float32).reshape(per_block)
    zero = np.asarray(params.zero_point).reshape(per_block)
    return x.reshape(blocks), scale, zero


def quantize(x: np.ndarray, params: QuantParams) -> np.ndarray:
    """The codes ONNX ``QuantizeLinear`` computes for ``x`` (Cast-pair types: ``x`` cast).

    Memory: one float32 array of ``x``'s size besides the codes (the scale and zero point
    broadcast as views; rounding, offset and clipping in place), so a large weight is not copied
    several times over.
    """
    x = np.asarray(x, dtype=np.float32)
    dtype = numpy_dtype(params.qtype)
    if params.is_cast:
        return x.astype(dtype)
    if params.scale is None or params.zero_point is None:
        raise QuantizationError(f"quantize: {params.granularity} parameters carry no scale")
    shape = x.shape
    views = _block_views(x, params) if params.block_size is not None else None
    if views is not None:
        x, scale, zero = views
    else:
        scale = broadcast_parameter(
            params.scale.astype(np.float32), shape, params.axis, params.block_size
        )
        zero = broadcast_parameter(params.zero_point, shape, params.axis, params.block_size)
    scaled = np.asarray(x / scale)  # (a 0-d division gives a scalar, not an array)
    if params.qtype is QuantType.QFLOAT8E4M3FN:
        np.clip(scaled, -FLOAT8_E4M3FN_MAX, FLOAT8_E4M3FN_MAX, out=scaled)
        return scaled.astype(dtype).reshape(shape)
    # the division is float32 (as onnxruntime computes it); so are rounding, offset and
    # clipping for codes of at most 24 bits, exactly (a sum past 2^24 is clipped either way);
    # int32 codes near 2^31 take float64 so that they do not overflow in the cast
    np.rint(scaled, out=scaled)
    if max(abs(params.qtype.qmin), abs(params.qtype.qmax)) <= 1 << 24:
        q = scaled
        q += np.asarray(zero, dtype=np.float32)
    else:
        q = scaled.astype(np.float64)
        del scaled
        q += np.asarray(zero, dtype=np.float64)
    np.clip(q, params.qtype.qmin, params.qtype.qmax, out=q)
    return q.astype(dtype).reshape(shape)


def dequantize(q: np.ndarray, params: QuantParams) -> np.ndarray:
    """Float32 values ONNX ``DequantizeLinear`` computes from codes ``q``."""
    q = np.asarray(q)
    if params.is_cast:
        return q.astype(np.float32)
    if params.scale is None or params.zero_point is None:
        raise QuantizationError(f"dequantize: {params.granularity} parameters carry no scale")
    scale = broadcast_parameter(
        params.scale.astype(np.float32), q.shape, params.axis, params.block_size
    )
    zero = broadcast_parameter(
        params.zero_point.astype(np.float32), q.shape, params.axis, params.block_size
    )
    return ((q.astype(np.float32) - zero) * scale).astype(np.float32)


def fake_quant(x: np.ndarray, params: QuantParams) -> np.ndarray:
    """``dequantize(quantize(x))``: the value the quantized graph computes with."""
    if params.dynamic:
        return fake_quant(x, dynamic_params(x, params.qtype, params.symmetric))
    return dequantize(quantize(x, params), params)


def from_position(p: int, qtype: QuantType = QuantType.QInt8) -> QuantParams:
    """Power-of-two parameters: scale ``2^-p`` and the symmetric zero point (XINT8)."""
    return QuantParams(
        qtype=qtype,
        scale=np.array(scale_of(p), dtype=np.float32),
        zero_point=np.array(qtype.symmetric_zero_point, dtype=numpy_dtype(qtype)),
    )


def from_range(
    lo: np.ndarray | float,
    hi: np.ndarray | float,
    qtype: QuantType,
    *,
    symmetric: bool = True,
    axis: int | None = None,
    block_size: int | None = None,
    scale_bits: int = 0,
) -> QuantParams:
    """Float-scale parameters that cover ``[lo, hi]`` (elementwise for per-channel/per-group).

    * symmetric integer: ``scale = max(|lo|, |hi|) / qmax`` (signed: zero point 0; unsigned: the
      middle code ``2^(bits-1)``, so ``scale = max|x| / (2^(bits-1) - 1)``);
    * asymmetric integer: the range is widened to include 0 (so 0 is exact), ``scale = (hi - lo) /
      (qmax - qmin)`` and ``zero_point = round(qmin - lo / scale)``;
    * float8 e4m3fn: ``scale = max(|lo|, |hi|) / 448``, zero point 0.

    An all-zero range gets scale 1 (any scale represents it exactly). ``scale_bits > 0`` rounds
    every scale up to that many significant bits (:func:`round_scale_up`) before the zero point
    is chosen, so the range stays covered.
    """
    qtype = QuantType.coerce(qtype)
    if qtype in CAST_TYPES:
        return QuantParams(qtype=qtype)
    dtype = numpy_dtype(qtype)
    lo = np.minimum(np.asarray(lo, dtype=np.float64), 0.0)
    hi = np.maximum(np.asarray(hi, dtype=np.float64), 0.0)

    def rounded(scale: np.ndarray) -> np.ndarray:
        return round_scale_up(scale, scale_bits) if scale_bits > 0 else scale

    if qtype is QuantType.QFLOAT8E4M3FN:
        amax = np.maximum(-lo, hi)
        scale = rounded(np.where(amax > 0, amax / FLOAT8_E4M3FN_MAX, 1.0))
        zero = np.zeros(scale.shape, dtype=np.float64)
    elif symmetric:
        amax = np.maximum(-lo, hi)
        zero_code = qtype.symmetric_zero_point
        scale = rounded(np.where(amax > 0, amax / (qtype.qmax - zero_code), 1.0))
        zero = np.full(scale.shape, zero_code, dtype=np.float64)
    else:
        span = hi - lo
        scale = rounded(np.where(span > 0, span / (qtype.qmax - qtype.qmin), 1.0))
        zero = np.clip(np.rint(qtype.qmin - lo / scale), qtype.qmin, qtype.qmax)
    scale32 = np.asarray(scale, dtype=np.float32)
    # a scale that underflows float32 would divide by zero at run time
    scale32 = np.where(scale32 > 0, scale32, np.float32(np.finfo(np.float32).tiny))
    return QuantParams(
        qtype=qtype,
        scale=scale32.astype(np.float32),
        zero_point=np.asarray(zero).astype(dtype),
        axis=axis,
        block_size=block_size,
        symmetric=symmetric,
    )


def round_scale_up(scale: np.ndarray, bits: int) -> np.ndarray:
    """The smallest value ``>= scale`` with at most ``bits`` significant bits (elementwise).

    With ``bits = 7`` a scale is a float16 value (in float16's normal range) and so is its product
    with any 4-bit zero point (7 + 4 <= 11 significant bits): GGUF's Q4_1 ``d`` and ``m = -d * z``
    and Q8_0's ``d`` are then stored exactly. The scale grows by less than ``2^(1 - bits)``.
    """
    scale = np.asarray(scale, dtype=np.float64)
    positive = scale > 0
    safe = np.where(positive, scale, 1.0)
    step = np.exp2(np.floor(np.log2(safe)) - (bits - 1))
    return np.where(positive, np.ceil(safe / step) * step, scale)


def weight_range(
    w: np.ndarray, axis: int | None = None, block_size: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Min and max of ``w`` per tensor, per channel along ``axis`` or per block of ``block_size``
    along ``axis`` (the last block may be short), shaped like the scale."""
    w = np.asarray(w, dtype=np.float32)
    if axis is None:
        return np.asarray(w.min()), np.asarray(w.max())
    axis = _normal_axis(axis, w.ndim)
    if block_size is None:
        others = tuple(i for i in range(w.ndim) if i != axis)
        return w.min(axis=others), w.max(axis=others)
    n = w.shape[axis]
    blocks = math.ceil(n / block_size)
    pad = blocks * block_size - n
    moved = np.moveaxis(w, axis, -1)
    if pad:
        # pad with the last element: padding never widens the last block's range
        edge = np.repeat(moved[..., -1:], pad, axis=-1)
        moved = np.concatenate([moved, edge], axis=-1)
    grouped = moved.reshape(*moved.shape[:-1], blocks, block_size)
    lo = np.moveaxis(grouped.min(axis=-1), -1, axis)
    hi = np.moveaxis(grouped.max(axis=-1), -1, axis)
    return lo, hi


def weight_params(
    w: np.ndarray,
    qtype: QuantType,
    *,
    symmetric: bool = True,
    axis: int | None = None,
    block_size: int | None = None,
    scale_bits: int = 0,
) -> QuantParams:
    """MinMax parameters for a constant tensor at the given granularity (codes not included)."""
    lo, hi = weight_range(w, axis, block_size)
    return from_range(
        lo,
        hi,
        qtype,
        symmetric=symmetric,
        axis=axis,
        block_size=block_size,
        scale_bits=scale_bits,
    )


def dynamic_params(x: np.ndarray, qtype: QuantType, symmetric: bool) -> QuantParams:
    """Numpy reference of the scale a dynamic-quantization graph computes from ``x`` at run time.

    * uint8 asymmetric: ONNX ``DynamicQuantizeLinear`` — ``scale = (max(0, max x) - min(0, min x))
      / 255``, ``zero_point = saturate(round(-min(0, min x) / scale))``;
    * symmetric: ``scale = max|x| / (qmax - z)`` with the symmetric zero point ``z`` (0 for
      signed types, ``2^(bits-1)`` for unsigned ones, so uint8 divides by 127, not 255);
    * an all-zero input gets scale 1 (as onnxruntime's DynamicQuantizeLinear returns), zero
      point ``z``.
    """
    qtype = QuantType.coerce(qtype)
    x = np.asarray(x, dtype=np.float32)
    dtype = numpy_dtype(qtype)
    if symmetric:
        if not qtype.is_integer:
            raise QuantizationError(f"dynamic quantization takes integer types, not {qtype.name}")
        amax = np.float32(np.max(np.abs(x))) if x.size else np.float32(0)
        zero = qtype.symmetric_zero_point
        scale = amax / np.float32(qtype.qmax - zero) if amax > 0 else np.float32(1.0)
        return QuantParams(
            qtype=qtype,
            scale=np.array(scale, dtype=np.float32),
            zero_point=np.array(zero, dtype=dtype),
            symmetric=True,
        )
    if qtype is not QuantType.QUInt8:
        raise QuantizationError(
            f"asymmetric dynamic quantization is defined for uint8 (DynamicQuantizeLinear), "
            f"not {qtype.name}"
        )
    lo = np.float32(min(0.0, float(x.min()))) if x.size else np.float32(0)
    hi = np.float32(max(0.0, float(x.max()))) if x.size else np.float32(0)
    scale = (hi - lo) / np.float32(255.0)
    if scale == 0:  # an all-zero input: onnxruntime's DynamicQuantizeLinear gives scale 1
        scale = np.float32(1.0)
    zero = np.clip(np.rint(-lo / scale), 0, 255)
    return QuantParams(
        qtype=qtype,
        scale=np.array(scale, dtype=np.float32),
        zero_point=np.array(zero, dtype=np.uint8),
        symmetric=False,
    )
