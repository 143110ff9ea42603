"""ReplaceClip6Relu: ``Clip(x, 0, 6)`` (ReLU6) becomes ``Relu(x)``.

Maths. ``Clip(x, 0, 6) = min(max(x, 0), 6)`` and ``Relu(x) = max(x, 0)``: the two agree for
``x <= 6`` and the Relu passes ``x > 6`` through unchanged, so the difference is
``max(x - 6, 0)``. Unlike :class:`~quark_onnx.passes.ConvertClipToRelu`, the bound 6 is dropped
(no range cap is recorded): this is the form cross-layer equalization needs, because a Relu is
positively homogeneous (``relu(s x) = s relu(x)`` for ``s > 0``) and a ReLU6 is not.

Fires only when both bounds are constants equal to exactly 0.0 and 6.0, given as attributes
(opset < 11), initializers, or ``Constant`` node outputs (opset >= 11). ``Clip(0, 4)``, a Clip
with a run-time bound, or a Clip with a missing bound is left alone.

``changes_numerics = True``: outputs change wherever the ReLU6 saturated.
"""

from __future__ import annotations

import logging

import onnx_ir as ir

from quark_onnx.passes.base import QuarkPass
from quark_onnx.passes.convert_clip_to_relu import float_clips, replace_by_relu

logger = logging.getLogger(__name__)


class ReplaceClip6Relu(QuarkPass):
    """Replace ``Clip(x, 0, 6)`` by ``Relu(x)`` (the upper bound is dropped on purpose)."""

    changes_numerics = True

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        count = 0
        for node, lo, hi in float_clips(model):
            if lo != 0.0 or hi != 6.0:  # also rejects None and the NOT_CONSTANT sentinel
                continue
            replace_by_relu(node)
            logger.debug("Clip %s (0, 6) -> Relu", node.name)
            count += 1
        if count:
            logger.info("ReplaceClip6Relu: %d Clip(0, 6) -> Relu", count)
        return ir.passes.PassResult(model, modified=bool(count))
