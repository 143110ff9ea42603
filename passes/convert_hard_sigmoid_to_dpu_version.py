"""ConvertHardSigmoidToDPUVersion: HardSigmoid with the NPU's 2731/16384 in place of 1/6.

The NPU evaluates ``HardSigmoid(alpha=1/6, beta=1/2)`` as ``(x + 3) * 2731 / 2^14`` (then the
output shift and int8 saturation), i.e. with ``2731/16384 = 0.16668701...`` for ``1/6``. AMD
Quark simulates this, and this pass writes the same form: the HardSigmoid stays and is followed
by ``Mul(c)`` with ``c = (2731/16384) / (1/6) = 16386/16384 = 1.0001220703125`` (exact in
float32)::

    Mul(HardSigmoid(x), c) = clip(x/6 + 1/2, 0, 1) * c = (x + 3) * 2731/16384   on the linear part

The upper end becomes ``c`` instead of 1, which int8 output saturation (``p_out >= 7``, at most
127/128) removes, as on the hardware. Fires on HardSigmoid with ``|alpha - 1/6| < 1e-6`` and
``beta`` absent or ``|beta - 0.5| < 1e-6`` (Quark's test); not on other HardSigmoids (ONNX's
default alpha is 0.2). Idempotent: a HardSigmoid already followed only by ``Mul(c)`` is left alone.
The quantizer keeps no Q/DQ between the HardSigmoid and this Mul. Changes numerics on purpose.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from quark_onnx.graph.ir import NameGenerator
from quark_onnx.passes.base import QuarkPass
from quark_onnx.passes.convert_avg_pool_to_dpu_version import append_scale_mul, scaled_by

logger = logging.getLogger(__name__)

#: The factor making HardSigmoid(1/6, 1/2) compute the NPU's (x + 3) * 2731/16384.
HARD_SIGMOID_SCALE = np.float32((2731.0 / 16384.0) / (1.0 / 6.0))
_EPS = 1e-6


def is_npu_hard_sigmoid(node: ir.Node) -> bool:
    """A HardSigmoid with alpha = 1/6 and beta = 1/2 (the form the NPU computes)."""
    alpha = node.attributes.get_float("alpha", 0.2)
    beta = node.attributes.get_float("beta", 0.5)
    return abs(alpha - 1.0 / 6.0) < _EPS and abs(beta - 0.5) < _EPS


class ConvertHardSigmoidToDPUVersion(QuarkPass):
    """Follow each HardSigmoid(1/6, 1/2) by ``Mul(1.0001220703125)`` (see module doc)."""

    changes_numerics = True
    simulates_hardware = True

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        candidates = [
            n
            for n in graph
            if n.op_type == "HardSigmoid"
            and n.domain in ("", "ai.onnx")
            and n.outputs
            and is_npu_hard_sigmoid(n)
        ]
        names = NameGenerator(graph)
        count = 0
        for node in candidates:
            if scaled_by(node.outputs[0], HARD_SIGMOID_SCALE):
                continue
            append_scale_mul(graph, node, HARD_SIGMOID_SCALE, names)
            count += 1
        if count:
            logger.info("ConvertHardSigmoidToDPUVersion: %d HardSigmoid(s) rescaled", count)
        return ir.passes.PassResult(model, modified=bool(count))
