"""Export a weight-only 4-bit model in onnxruntime's ``MatMulNBits`` format.

``UINT4_WEIGHT_ONLY_G32`` (or any weight-only int4/uint4 config with ``WeightBlockSize``) writes
the standard opset-21 blocked DequantizeLinear form; :func:`export_matmul_nbits` turns every
4-bit MatMul layer of such a model into ``com.microsoft.MatMulNBits``
(:class:`~quark_onnx.passes.matmul_nbits.ToMatMulNBits` has the layout), the form onnxruntime
and its generate() API run for LLM weights. Same weights, same scales; the outputs differ from the
DequantizeLinear form by float rounding only.
"""

from __future__ import annotations

import logging
import os

import onnx

from quark_onnx.errors import QuantizationError
from quark_onnx.model_files.load import load_ir, to_ir, to_proto
from quark_onnx.model_files.paths import check_output_path
from quark_onnx.model_files.save import save_model

logger = logging.getLogger(__name__)


def export_matmul_nbits(
    model: str | os.PathLike | onnx.ModelProto,
    output: str | os.PathLike | None = None,
    *,
    overwrite: bool = False,
) -> onnx.ModelProto:
    """The MatMulNBits form of a weight-only 4-bit ``model`` (written to ``output`` if given).

    Raises:
        QuantizationError: the model has no MatMul with a 4-bit weight blocked along its input
            channels (quantize it with ``UINT4_WEIGHT_ONLY_G32`` first).
        ModelSaveError: ``output`` is the input model (without ``overwrite``) or not writable.
    """
    from quark_onnx.passes.matmul_nbits import ToMatMulNBits

    source = "<model>" if isinstance(model, onnx.ModelProto) else str(model)
    input_path = None if isinstance(model, onnx.ModelProto) else model
    if output is not None:
        check_output_path(output, input_path, overwrite)
    ir_model = (
        to_ir(model) if isinstance(model, onnx.ModelProto) else load_ir(model, upgrade_opset=False)
    )
    if not ToMatMulNBits()(ir_model).modified:
        raise QuantizationError(
            f"{source}: no MatMul reads a 4-bit weight blocked along its input channels "
            "(DequantizeLinear with axis=0 and block_size >= 16); quantize the model with "
            "UINT4_WEIGHT_ONLY_G32 first"
        )
    proto = to_proto(ir_model)
    if output is not None:
        save_model(proto, output, input_path=input_path, overwrite=overwrite)
        logger.info("%s: MatMulNBits model written to %s", source, output)
    return proto
