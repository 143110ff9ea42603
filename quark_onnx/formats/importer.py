"""Reading a QDQ model back into a float model and its ordered quantization parameters.

A QDQ model (written by this project, by onnxruntime's ``quantize_static`` or by AMD Quark's
standard-domain QDQ export) is a float model plus, per quantized tensor, a pattern of standard ops.
:func:`read_qdq` recognises each pattern, records one
:class:`~quark_onnx.params.qparams.QuantParams` per tensor and removes the pattern, leaving the
float model the parameters apply to:

* ``X -> QuantizeLinear(s, z) -> DequantizeLinear(s, z)``: activation ``X`` with scale ``s``,
  zero point ``z`` and the ``axis``/``block_size`` attributes; the float model reads ``X``;
* ``DequantizeLinear(C, s, z)`` with ``C`` an initializer or Constant (weights, int32 bias):
  constant ``W`` with the same parameters and ``codes = C``; the float model holds
  ``W = (C - z) * s`` (the values the quantized model computes with);
* ``X -> Cast(to=float16|bfloat16) -> Cast(to=float)``: ``X`` as ``QFloat16``/``QBFloat16``;
* a float16/bfloat16 constant ``C -> Cast(to=float)``: constant ``W`` with codes ``C``, folded to
  float32 in the float model;
* ``X -> DynamicQuantizeLinear -> DequantizeLinear``: ``X`` dynamic, uint8, asymmetric;
* ``X -> QuantizeLinear(s(X), z) -> DequantizeLinear``, the scale computed in the graph: ``X``
  dynamic and symmetric (zero point 0, or the middle code for unsigned types); the run-time
  scale subgraph is dropped from the float model.

Names: an activation's parameters are keyed by the QuantizeLinear input ``X``; when the
DequantizeLinear writes a graph output (the producer then writes ``X_QuantizeLinear_Input``), the
key and the float tensor take the graph output's name, so the float model keeps its output names.
A constant is keyed by the DequantizeLinear output name without its ``_DequantizeLinear_Output``
suffix (``W`` for ``W_DequantizeLinear_Output``); a DequantizeLinear that writes a name without
that suffix (onnxruntime's int32 bias writes the bias's own name) gives that name itself.

The parameters are ordered as the quantizer wrote them: by the position of the first initializer
the pattern owns (scale, zero point or codes; :class:`~quark_onnx.passes.insert_qdq.InsertQDQ`
adds them in its mapping's order), then by node position for patterns without initializers. So
``InsertQDQ(params)`` on the float model rebuilds this project's models byte for byte (see
:mod:`quark_onnx.formats.recipe`) and foreign models up to node order (same outputs).

This project's own integer forms are read as the QDQ form they were written from: the
``MatMulInteger`` layers of dynamic quantization
(:func:`~quark_onnx.passes.dynamic_matmul_integer.restore_qdq`) and embedding tables whose rows
are gathered before dequantization (:func:`~quark_onnx.passes.insert_qdq.
restore_gathered_tables`).

Refused, with an error naming the node: QOperator-format and integer ops (``QLinearConv``,
``MatMulInteger``, ...), quantize/dequantize ops of custom domains (Quark's ``VitisQuantizeLinear``,
...), a QuantizeLinear read by anything but DequantizeLinear, a DequantizeLinear of a graph input,
requantization (a DequantizeLinear whose parameters differ from its QuantizeLinear's), and a tensor
quantized twice with different parameters. Subgraphs (If/Loop bodies) are not read.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import onnx

from quark_onnx.formats.qdq_reader import QDQImportError, QDQReader, refuse_unsupported
from quark_onnx.model_files.load import load_model, to_ir, to_proto
from quark_onnx.params.qparams import QuantParams

logger = logging.getLogger(__name__)

__all__ = ["ImportedModel", "QDQImportError", "extract_params", "read_qdq"]


@dataclass
class ImportedModel:
    """What :func:`read_qdq` found.

    Attributes:
        float_model: the model with every quantization pattern removed and dequantized constants
            folded to float (``None`` when only the parameters were asked for).
        params: tensor name (in ``float_model``) -> parameters, in the order the quantizer wrote
            them.
        shapes: tensor name -> its static shape when known (constants always).
        source: the model's label in messages.
    """

    float_model: onnx.ModelProto | None
    params: dict[str, QuantParams]
    shapes: dict[str, tuple[int, ...] | None] = field(default_factory=dict)
    source: str = "<model>"


def read_qdq(
    model: onnx.ModelProto | str | os.PathLike,
    *,
    float_model: bool = True,
    source: str | None = None,
) -> ImportedModel:
    """Read the quantization parameters of a QDQ model and (optionally) its float model.

    Args:
        model: the QDQ model (a path is read with
            :func:`quark_onnx.model_files.load.load_model`, without opset upgrade).
        float_model: also build the float model (the patterns removed); False only reads.
        source: the model's name in messages (default: the path, or ``<model>``).

    Raises:
        QDQImportError: an unsupported construct (see the module docstring), naming the node.
        ModelLoadError: the file cannot be read as an ONNX model.
    """

    if isinstance(model, onnx.ModelProto):
        label = source or "<model>"
        proto = model
    else:
        label = source or str(model)
        proto = load_model(model, upgrade_opset=False)
    work = to_ir(proto) if not float_model else to_ir(_copy(proto))
    graph = work.graph
    from quark_onnx.passes.dynamic_matmul_integer import restore_qdq
    from quark_onnx.passes.insert_qdq import restore_gathered_tables

    # this project's integer MatMul layers (INT8_DYNAMIC) and gathered embedding rows read as QDQ
    restore_qdq(graph)
    restore_gathered_tables(graph)
    refuse_unsupported(graph, label)
    reader = QDQReader(graph, label)
    found = reader.scan()
    found.sort(key=lambda f: f.order)
    params: dict[str, QuantParams] = {}
    shapes: dict[str, tuple[int, ...] | None] = {}
    for f in found:
        params[f.key] = f.params
        shapes[f.key] = f.shape
    result_model = None
    if float_model:
        reader.remove_patterns()
        result_model = to_proto(work)
    logger.info("%s: %d quantized tensor(s) read", label, len(params))
    return ImportedModel(float_model=result_model, params=params, shapes=shapes, source=label)


def extract_params(model: onnx.ModelProto | str | os.PathLike) -> dict[str, QuantParams]:
    """The ordered quantization parameters of a QDQ model (:func:`read_qdq` without the float
    model)."""
    return read_qdq(model, float_model=False).params


def _copy(proto: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    return out
