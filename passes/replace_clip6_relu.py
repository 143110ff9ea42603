"""ReplaceClip6Relu: a layer's ``Clip(x, 0, 6)`` (ReLU6) becomes ``Relu(x)`` with a range cap of 6.

Maths. ``Clip(x, 0, 6) = min(max(x, 0), 6)`` and ``Relu(x) = max(x, 0)``: the two agree for
``x <= 6`` and the Relu passes ``x > 6`` through, so the float difference is ``max(x - 6, 0)``.
The bound is kept as the output's range cap (metadata ``quark_onnx.range_max``, as
:class:`~quark_onnx.passes.ConvertClipToRelu` writes it): the quantized tensor then saturates at
the smallest power-of-two int8 range that holds 6 (``127 * 2^-4 = 7.94``), which is what the NPU
computes for a fused ReLU6. Without the cap a calibrated range follows pre-activations that reach
tens on real models, and every value above 6 that the original model cut off passes through.
A capped value blocks cross-layer equalization (the cap holds for the unscaled channels only).

Fires only on a layer's activation (:func:`~quark_onnx.passes.convert_clip_to_relu.
is_layer_activation`: the Clip of hardswish/hardsigmoid, ``Clip(x + 3, 0, 6)``, is left alone)
and only when both bounds are constants equal to exactly 0.0 and 6.0, given as attributes
(opset < 11), initializers, or ``Constant`` node outputs (opset >= 11). ``Clip(0, 4)``, a Clip
with a run-time bound, or a Clip with a missing bound is left alone.

``changes_numerics = True``: the float outputs change wherever the ReLU6 saturated; the quantized
model differs from the original only where a value lies between 6 and the cap's int8 range.
"""

from __future__ import annotations

import logging

import onnx_ir as ir

from quark_onnx.passes.base import QuarkPass
from quark_onnx.passes.convert_clip_to_relu import (
    float_clips,
    is_layer_activation,
    record_range_cap,
    replace_by_relu,
)

logger = logging.getLogger(__name__)


class ReplaceClip6Relu(QuarkPass):
    """Replace a layer's ``Clip(x, 0, 6)`` by ``Relu(x)``, the bound kept as a range cap."""

    changes_numerics = True

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        count = 0
        for node, lo, hi in float_clips(model):
            if lo != 0.0 or hi != 6.0:  # also rejects None and the NOT_CONSTANT sentinel
                continue
            if not is_layer_activation(node):
                continue
            replace_by_relu(node)
            record_range_cap(node.outputs[0], 6.0)
            logger.debug("Clip %s (0, 6) -> Relu", node.name)
            count += 1
        if count:
            logger.info("ReplaceClip6Relu: %d Clip(0, 6) -> Relu (range cap 6)", count)
        return ir.passes.PassResult(model, modified=bool(count))
