"""Layer-by-layer replay of a float and a quantized model on calibration samples.

The accuracy stages (bias correction, AdaRound, error analysis) import from here; the pieces live
in :mod:`~quark_onnx.accuracy.layers` (layer discovery: :func:`find_layers`, codes helpers),
:mod:`~quark_onnx.accuracy.replay` (:class:`Replay`, the segment-by-segment engine) and
:mod:`~quark_onnx.accuracy.runtime` (onnxruntime session options and the shared arena).
"""

from __future__ import annotations

from quark_onnx.accuracy.layers import (
    LAYER_OPS,
    MIN_HELD_OUT,
    Layer,
    find_layers,
    float_name_of_input,
    float_name_of_output,
    held_out_split,
    position_of_scale,
    set_codes,
    tensor_names,
)
from quark_onnx.accuracy.replay import TRIM_SLACK_MB, Replay
from quark_onnx.accuracy.runtime import release_arena, session_options

__all__ = [
    "LAYER_OPS",
    "MIN_HELD_OUT",
    "TRIM_SLACK_MB",
    "Layer",
    "Replay",
    "find_layers",
    "float_name_of_input",
    "float_name_of_output",
    "held_out_split",
    "position_of_scale",
    "release_arena",
    "session_options",
    "set_codes",
    "tensor_names",
]
