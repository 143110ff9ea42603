"""One exception hierarchy for everything quark_onnx raises on purpose.

Every message names the thing at fault (file, node, tensor, option) and says what to do, so that a
CLI can print ``str(error)`` as its one line and a pipeline log stays readable.
"""

from __future__ import annotations


class QuarkOnnxError(Exception):
    """Base class: catch this to handle every quark_onnx failure."""


class ConfigError(QuarkOnnxError, ValueError):
    """A configuration, preset or option is invalid (unknown name, wrong type, bad value)."""


class ModelLoadError(QuarkOnnxError):
    """A model file is missing, unreadable, not ONNX, truncated or fails the ONNX checker."""


class ModelSaveError(QuarkOnnxError):
    """A model or report could not be written (bad path, refusing to overwrite the input, ...)."""


class OutputAppearedError(ModelSaveError):
    """An output that did not exist when the run started exists when it is to be placed: another
    run wrote it meanwhile; it is left as it is (without ``overwrite``)."""


class UnsafePathError(QuarkOnnxError):
    """A path (for example an external-data location) escapes the folder it must stay in."""


class CalibrationError(QuarkOnnxError):
    """Calibration data is missing, does not match the model's inputs, or cannot be run."""


class QuantizationError(QuarkOnnxError):
    """The quantizer could not produce a valid model (constraint that cannot be met, ...)."""


class FidelityError(QuantizationError):
    """The quantized model's outputs do not follow the float model's (``RequireFidelity``)."""


class PassError(QuarkOnnxError):
    """A graph pass failed on a model it was asked to rewrite."""
