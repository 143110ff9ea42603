"""Checks made before any work: argument types, and NPU settings on a model they do not fit."""

from __future__ import annotations

import logging
import os
from typing import Any

import onnx
import onnx_ir as ir

from quark_onnx.config.quantization import QuantizationConfig
from quark_onnx.errors import ConfigError

# the quantizer's stages report through the quantizer's logger
logger = logging.getLogger("quark_onnx.pipeline.quantizer")

__all__ = ["check_architecture", "check_path_arguments", "check_tensors"]

#: Ops whose constant inputs are weights: an infinity there is corruption (elsewhere, a constant
#: of -inf is an attention mask, and legitimate).
_WEIGHT_OPS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul", "BatchNormalization"})
#: Elements checked at once (the boolean mask of a piece, not of a whole 100 MB weight).
_FINITE_CHUNK = 1 << 22


def _non_finite(array: Any) -> tuple[int, int, int]:
    """(NaN count, infinity count, flat index of the first) of a float array, read in pieces."""
    import numpy as np

    flat = np.asarray(array).reshape(-1)
    if flat.dtype.kind != "f":  # (bfloat16 and the float8 types of ml_dtypes are not checked)
        return 0, 0, -1
    nans = infs = 0
    first = -1
    for start in range(0, flat.size, _FINITE_CHUNK):
        piece = flat[start : start + _FINITE_CHUNK]
        bad = ~np.isfinite(piece)
        if not bad.any():
            continue
        n = int(np.isnan(piece).sum())
        nans += n
        infs += int(bad.sum()) - n
        if first < 0:
            first = start + int(np.argmax(bad))
    return nans, infs, first


def check_tensors(model: Any, source: str, samples: list[dict[str, Any]]) -> None:
    """Refuse, before any pass, NaN in a float initializer, an infinity in a weight, and NaN or
    infinity in the calibration samples the passes measure on, naming the tensor (or input and
    sample): otherwise a pass fails deep inside ("cannot convert float NaN to integer") naming
    nothing. So are a string initializer, a weight with no element and a graph input with a
    dimension of 0 (a pass or the calibration failed on those without naming them).
    Non-finite values in later calibration samples are ignored with a warning, as documented;
    these first samples decide the preparation, so they must be clean.

    Raises:
        QuantizationError: a weight holds NaN (or an infinity, for a weight of a Conv, Gemm,
            MatMul...); a string initializer; an empty weight; a zero input dimension.
        ModelLoadError: an initializer's bytes do not fill its declared type and shape.
        CalibrationError: a sample the passes measure on holds NaN or an infinity.
    """
    import numpy as np

    from quark_onnx.errors import CalibrationError, ModelLoadError, QuantizationError

    weights = {
        value.name
        for node in model.graph
        if node.op_type in _WEIGHT_OPS
        for value in node.inputs[1:]
        if value is not None
    }
    for name, value in model.graph.initializers.items():
        tensor = value.const_value
        if tensor is None:
            continue
        if tensor.dtype == ir.DataType.STRING:
            raise QuantizationError(
                f"{source}: initializer {name!r} holds strings; quark_onnx quantizes numeric "
                "graphs: remove the string constant (and the ops that read it) before quantizing"
            )
        if name in weights and tensor.size == 0:
            raise QuantizationError(
                f"{source}: weight {name!r} has shape {list(tensor.shape)}, with no element; a "
                "layer without weights cannot be quantized: fix or re-export the model"
            )
        if not tensor.dtype.is_floating_point():
            continue
        try:
            array = tensor.numpy()
        except (ValueError, TypeError) as exc:  # bytes that do not fill the declared shape
            raise ModelLoadError(
                f"{source}: initializer {name!r} ({tensor.dtype.name}, shape "
                f"{list(tensor.shape)}): its data does not match its type and shape ({exc}); "
                "the file is corrupt: re-export or re-download it"
            ) from exc
        nans, infs, first = _non_finite(array)
        if nans or (infs and name in weights):
            raise QuantizationError(
                f"{source}: initializer {name!r} holds {nans} NaN and {infs} infinite value(s) "
                f"(the first at flat index {first}); the model's weights are corrupt: fix or "
                "re-export the model"
            )
    for value in model.graph.inputs:
        if value.shape is not None and any(d == 0 for d in value.shape):
            raise QuantizationError(
                f"{source}: graph input {value.name!r} has shape {list(value.shape)}, with a "
                "dimension of 0; no sample can feed it: fix or re-export the model"
            )
    for index, feed in enumerate(samples):
        for name, array in feed.items():
            array = np.asarray(array)
            if array.dtype.kind != "f":
                continue
            nans, infs, first = _non_finite(array)
            if nans or infs:
                raise CalibrationError(
                    f"{source}: calibration input {name!r}, sample {index}: {nans} NaN and {infs} "
                    f"infinite value(s) (the first at flat index {first}); the first samples "
                    "decide the preparation passes and must be finite: clean the data (e.g. "
                    "numpy.nan_to_num) or drop that sample"
                )


def check_architecture(
    model: Any, source: str, qconfig: QuantizationConfig, require_ready: bool
) -> None:
    """Warn (or, with ``require_ready``, refuse) before any work when NPU (XINT8) settings meet
    a model without Conv: the Vitis AI CNN flow is built around Conv layers (the check wants at
    least two) and leaves transformer ops float; float-scale presets fit such models."""
    if not qconfig.enable_npu_cnn:
        return
    if any(node.op_type == "Conv" for node in model.graph):
        return
    message = (
        f"{source}: the NPU (XINT8) settings are for CNNs and this model has no Conv node; "
        "the result will not be Vitis AI-ready and its LayerNormalization/Gelu/Softmax-style "
        "ops stay float. For transformers use A16W8 (accurate static), A8W8 or INT8_DYNAMIC"
    )
    if require_ready:
        raise ConfigError(message + " (refused because readiness is required)")
    logger.warning(message)


def check_path_arguments(**arguments: Any) -> None:
    """Refuse path arguments of the wrong type (a number, bytes, a list) with the argument named,
    instead of a ``TypeError`` from deep inside."""
    for name, value in arguments.items():
        allowed: tuple[type, ...] = (str, os.PathLike)
        if name == "model_input":
            allowed = (str, os.PathLike, onnx.ModelProto)
        elif value is None:
            continue
        if not isinstance(value, allowed):
            expected = "a path or an onnx.ModelProto" if name == "model_input" else "a path"
            raise ConfigError(f"{name} must be {expected}, got {type(value).__name__}")
