"""ConvertLeakyReluToDPUVersion: LeakyRelu slope rounded to the NPU's multiples of 1/256.

The NPU multiplies negative inputs by an 8-bit fraction, so the slope it applies is
``round_half_even(256 * alpha) / 256`` (0.1 -> 26/256 = 0.1015625). The pass writes that value
into ``alpha`` (float32, exact) so that calibration and the quantized model see the hardware's
arithmetic. A LeakyRelu without ``alpha`` uses ONNX's default 0.01 (-> 3/256) and gets the
attribute written. Not changed: a slope already on the 1/256 grid (e.g. 0.25). Changes numerics
on purpose (``changes_numerics = True``).
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from quark_onnx.passes.base import QuarkPass

logger = logging.getLogger(__name__)

_DEFAULT_ALPHA = 0.01


def dpu_alpha(alpha: float) -> float:
    """``round_half_even(256 * alpha) / 256``."""
    return round(float(alpha) * 256.0) / 256.0


class ConvertLeakyReluToDPUVersion(QuarkPass):
    """Round every LeakyRelu's alpha to the NPU's 1/256 grid."""

    changes_numerics = True
    simulates_hardware = True

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        count = 0
        for node in ir.traversal.RecursiveGraphIterator(model.graph):
            if node.op_type != "LeakyRelu" or node.domain not in ("", "ai.onnx"):
                continue
            alpha = node.attributes.get_float("alpha", _DEFAULT_ALPHA)
            new = dpu_alpha(alpha)
            if "alpha" in node.attributes and np.float32(new) == np.float32(alpha):
                continue
            node.attributes["alpha"] = ir.AttrFloat32("alpha", new)
            logger.debug("LeakyRelu %s: alpha %r -> %r", node.name, alpha, new)
            count += 1
        if count:
            logger.info("ConvertLeakyReluToDPUVersion: %d LeakyRelu alpha(s) rounded", count)
        return ir.passes.PassResult(model, modified=bool(count))
