"""The enumerations of the Quark-shaped configuration API.

Each enum accepts, through :meth:`coerce`, its own members, their names as strings (any case), and
members of the same-named onnxruntime enums (``onnxruntime.quantization.QuantType.QInt8`` ...), so a
script written for AMD Quark or onnxruntime's quantizer keeps working with only its imports changed.
"""

from __future__ import annotations

import difflib
import enum
from typing import Any

from quark_onnx.errors import ConfigError


class _CoercibleEnum(enum.Enum):
    @classmethod
    def coerce(cls, value: Any, what: str | None = None) -> _CoercibleEnum:
        """Return the member named by ``value`` (a member, a foreign enum member or a string)."""
        if isinstance(value, cls):
            return value
        name = value.name if isinstance(value, enum.Enum) else value
        if isinstance(name, str):
            for member in cls:
                if member.name.lower() == name.lower():
                    return member
        names = [m.name for m in cls]
        close = difflib.get_close_matches(str(name), names, n=1, cutoff=0.5)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        label = what or cls.__name__
        raise ConfigError(f"{label}: {value!r} is not one of {', '.join(names)}{hint}")

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class QuantType(_CoercibleEnum):
    """Data type a tensor is quantized to (the names of onnxruntime's and Quark's QuantType)."""

    QInt8 = "int8"
    QUInt8 = "uint8"
    QInt16 = "int16"
    QUInt16 = "uint16"
    QInt32 = "int32"
    QInt4 = "int4"
    QUInt4 = "uint4"
    QFLOAT8E4M3FN = "float8e4m3fn"
    QFloat16 = "float16"
    QBFloat16 = "bfloat16"

    @property
    def bits(self) -> int:
        return {
            "int8": 8,
            "uint8": 8,
            "int16": 16,
            "uint16": 16,
            "int32": 32,
            "int4": 4,
            "uint4": 4,
            "float8e4m3fn": 8,
            "float16": 16,
            "bfloat16": 16,
        }[self.value]

    @property
    def is_integer(self) -> bool:
        return self.value.startswith(("int", "uint"))

    @property
    def is_signed(self) -> bool:
        return not self.value.startswith("uint")

    @property
    def qmin(self) -> int:
        """Smallest integer code (integer types only)."""
        return -(2 ** (self.bits - 1)) if self.is_signed else 0

    @property
    def symmetric_zero_point(self) -> int:
        """Zero point of symmetric quantization: 0 for signed types, ``2^(bits-1)`` (the middle
        code) for unsigned ones (integer types only)."""
        return 0 if self.is_signed else 2 ** (self.bits - 1)

    @property
    def qmax(self) -> int:
        """Largest integer code (integer types only)."""
        return 2 ** (self.bits - 1) - 1 if self.is_signed else 2**self.bits - 1


class QuantFormat(_CoercibleEnum):
    """How quantization is written into the graph. Only QDQ is produced (the NPU flow takes QDQ)."""

    QDQ = "qdq"
    QOperator = "qoperator"


class CalibrationMethod(_CoercibleEnum):
    """Float-scale range estimators (non-NPU presets)."""

    MinMax = "minmax"
    Percentile = "percentile"
    Entropy = "entropy"
    MSE = "mse"
    Distribution = "distribution"


class PowerOfTwoMethod(_CoercibleEnum):
    """Power-of-two position estimators used by XINT8.

    * ``NonOverflow``: the smallest power-of-two scale whose int8 range covers max|x| (never clips).
    * ``MinMSE``: the position that minimises the quantization mean squared error over all the
      calibration data, searched over every position.
    """

    NonOverflow = "nonoverflow"
    MinMSE = "minmse"


def coerce_calibrate_method(value: Any) -> CalibrationMethod | PowerOfTwoMethod:
    """``calibrate_method`` takes a member of either enum (or its name)."""
    if isinstance(value, (CalibrationMethod, PowerOfTwoMethod)):
        return value
    name = value.name if isinstance(value, enum.Enum) else str(value)
    for cls in (PowerOfTwoMethod, CalibrationMethod):
        for member in cls:
            if member.name.lower() == name.lower():
                return member
    names = [m.name for m in PowerOfTwoMethod] + [m.name for m in CalibrationMethod]
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ConfigError(f"calibrate_method: {value!r} is not one of {', '.join(names)}{hint}")
