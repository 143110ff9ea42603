"""Checks made before any work: argument types, and NPU settings on a model they do not fit."""

from __future__ import annotations

import logging
import os
from typing import Any

import onnx

from quark_onnx.config.quantization import QuantizationConfig
from quark_onnx.errors import ConfigError

# the quantizer's stages report through the quantizer's logger
logger = logging.getLogger("quark_onnx.pipeline.quantizer")

__all__ = ["check_architecture", "check_path_arguments"]


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
