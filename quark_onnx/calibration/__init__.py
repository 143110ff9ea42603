"""Calibration: run the float model on data and keep per-tensor statistics in constant memory.

``calibrate(model, tensor_names, reader, method=..., options=...)`` returns a
:class:`CalibrationResult` that answers ``position()`` (power-of-two, NonOverflow/MinMSE),
``range()`` (MinMax/Percentile/Entropy/MSE), ``absmax()`` and ``error_function()`` (activation
error curves for the NPU constraint solver), and that can be saved and loaded.

``nonoverflow_position``, ``minmse_position`` and ``quantize_pof2`` (an alias of
:func:`quark_onnx.params.pof2.fake_quant`) are re-exported from :mod:`quark_onnx.params.pof2`, the
one definition of the power-of-two numerics.
"""

from __future__ import annotations

from quark_onnx.calibration.collector import calibrate
from quark_onnx.calibration.observers import HistogramObserver, MinMaxObserver
from quark_onnx.calibration.readers import (
    ArrayDataReader,
    CalibrationDataReader,
    NpzDataReader,
    RandomDataReader,
    reader_for,
)
from quark_onnx.calibration.result import CalibrationResult, model_hash
from quark_onnx.calibration.session import session_options
from quark_onnx.params.pof2 import fake_quant as quantize_pof2
from quark_onnx.params.pof2 import minmse_position, nonoverflow_position

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
