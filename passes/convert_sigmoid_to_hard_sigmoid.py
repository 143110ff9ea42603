"""ConvertSigmoidToHardSigmoid: ``Sigmoid(x)`` becomes ``HardSigmoid(x, alpha=1/6, beta=0.5)``.

Maths. ``HardSigmoid(x) = max(0, min(1, alpha * x + beta))``; with ``alpha = 1/6``,
``beta = 1/2`` it is the piecewise-linear form the NPU computes (0 below -3, 1 above 3, linear in
between), the same curve as ``relu6(x + 3) / 6``. Against ``sigmoid(x) = 1 / (1 + e^-x)`` the
largest difference is 0.0692, at ``|x| = 1.317`` (where the sigmoid's slope ``s (1 - s)`` equals
the hard curve's 1/6, i.e. ``s = 1/2 + sqrt(1/12)``); at ``|x| = 3`` it is 0.047, it is 0 at
``x = 0`` and tends to 0 as ``|x| -> inf``.

The attribute is a float32, so ``alpha`` is stored as ``float32(1/6) = 0.16666667``. A later DPU
simulation pass replaces it by ``2731/16384``, the hardware's constant.

Handled: every ``Sigmoid`` of the default domain on float16/float/double tensors (or of unknown
type). Left alone: bfloat16 tensors (HardSigmoid has no bfloat16 kernel).

``changes_numerics = True``.
"""

from __future__ import annotations

import logging

import onnx_ir as ir

from quark_onnx.passes.base import QuarkPass

logger = logging.getLogger(__name__)

_HARD_SIGMOID_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE})


class ConvertSigmoidToHardSigmoid(QuarkPass):
    """Replace Sigmoid by ``HardSigmoid(alpha, beta)`` (default the NPU's 1/6 and 1/2)."""

    changes_numerics = True

    def __init__(self, alpha: float = 1.0 / 6.0, beta: float = 0.5) -> None:
        super().__init__()
        self.alpha = float(alpha)
        self.beta = float(beta)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        count = 0
        for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
            if node.op_type != "Sigmoid" or node.domain != "":
                continue
            x = node.inputs[0] if node.inputs else None
            if x is None or (x.dtype is not None and x.dtype not in _HARD_SIGMOID_TYPES):
                continue
            node.op_type = "HardSigmoid"
            node.attributes.clear()
            node.attributes.add(ir.AttrFloat32("alpha", self.alpha))
            node.attributes.add(ir.AttrFloat32("beta", self.beta))
            logger.debug("Sigmoid %s -> HardSigmoid", node.name)
            count += 1
        if count:
            logger.info(
                "ConvertSigmoidToHardSigmoid: %d Sigmoid -> HardSigmoid(alpha=%g, beta=%g)",
                count,
                self.alpha,
                self.beta,
            )
        return ir.passes.PassResult(model, modified=bool(count))
