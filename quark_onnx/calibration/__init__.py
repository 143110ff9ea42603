"""Calibration: run the float model on data and keep per-tensor statistics in constant memory.

``calibrate(model, tensor_names, reader, method=..., options=...)`` returns a
:class:`CalibrationResult` that answers ``position()`` (power-of-two, NonOverflow/MinMSE),
``range()`` (MinMax/Percentile/Entropy/MSE) and ``absmax()``, and that can be saved and loaded.
"""

from __future__ import annotations

from .collector import calibrate, session_options
from .observers import (
    HistogramObserver,
    MinMaxObserver,
    minmse_position,
    nonoverflow_position,
    quantize_pof2,
)
from .readers import (
    ArrayDataReader,
    CalibrationDataReader,
    NpzDataReader,
    RandomDataReader,
    reader_for,
)
from .result import CalibrationResult, model_hash

__all__ = [
    "ArrayDataReader",
    "CalibrationDataReader",
    "CalibrationResult",
    "HistogramObserver",
    "MinMaxObserver",
    "NpzDataReader",
    "RandomDataReader",
    "calibrate",
    "minmse_position",
    "model_hash",
    "nonoverflow_position",
    "quantize_pof2",
    "reader_for",
    "session_options",
]
