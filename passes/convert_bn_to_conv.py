"""ConvertBNToConv: fold inference-mode BatchNormalization into Conv / ConvTranspose / Gemm.

Maths. In inference mode ``BatchNormalization`` is a per-channel affine map on axis 1::

    y[:, c, ...] = gamma[c] * (x[:, c, ...] - mean[c]) / sqrt(var[c] + eps) + beta[c]
                 = m[c] * x[:, c, ...] + b[c]
    with  m = gamma / sqrt(var + eps),   b = beta - mean * m.

(``m`` and ``b`` are computed in float64 and cast back to the weight's dtype once.)

Folding into the producer ``x = P(input)`` of the BN input, when that value has the BN as its only
reader (and is not a graph output) and P's weights and bias are constants:

* ``Conv``, weight ``W[Cout, Cin/group, k...]``, bias ``B[Cout]`` (0 when absent)::

      W'[o, ...] = m[o] * W[o, ...]          B'[o] = m[o] * B[o] + b[o]

* ``ConvTranspose``, weight ``W[Cin, Cout/group, k...]``: output channel ``o = g * (Cout/group)
  + j`` is produced by ``W[g * (Cin/group) : (g+1) * (Cin/group), j, ...]``, so the weight is viewed
  as ``[group, Cin/group, Cout/group, k...]`` and column ``j`` of group ``g`` is scaled by
  ``m[g * (Cout/group) + j]``; the bias as for Conv.

* ``Gemm``, ``Y = alpha * A' B' + beta * C`` with ``B' = B`` (``transB=0``, ``B[K, N]``) or
  ``B' = B^T`` (``transB=1``, ``B[N, K]``): column ``n`` of ``B'`` is scaled by ``m[n]``
  (``B[:, n]`` or ``B[n, :]``) and the new bias is ``C' = m * (beta * C) + b`` (broadcast, so a
  ``[M, 1]`` or ``[M, N]`` C stays valid) with ``beta`` set to 1.

The BN node is removed and the producer's output takes the BN output's name (and its place among
the graph outputs), so readers and graph outputs keep their names.

A BN with no foldable producer (the producer is another op type, its output has a second reader,
or its weights are not constants) on a 4-D input becomes a depthwise 1x1 Conv: weight
``m.reshape(C, 1, 1, 1)``, bias ``b``, ``group = C``, with ``kernel_shape``, ``strides``, ``pads``
and ``dilations`` written explicitly (the Vitis AI EP rejects Conv nodes relying on defaults). The
producer is never modified in that case.

Not rewritten: a BN in training mode (``training_mode=1`` or a used running-mean/var output),
``spatial=0`` (opset < 9), non-constant parameters, non-float tensors, and standalone BNs whose
input is not 4-D (or of unknown rank after shape inference). An initializer that is also a graph
input can be overridden at run time and is not taken as a constant, except in IR version < 4
models (which had to list every initializer as an input).

Float-preserving: the float32 result differs from the unfused graph by rounding only (about
1e-6 relative).
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from quark_onnx.graph.ir import (
    NameGenerator,
    add_initializer,
    constant_array,
    infer_shapes,
    single_consumer,
)
from quark_onnx.passes._affine_fold import (
    Constants,
    bn_affine,
    bypass,
    folded_conv,
    folded_gemm,
    is_inference_bn,
    set_weight_and_bias,
)
from quark_onnx.passes.base import QuarkPass
from quark_onnx.passes.convert_clip_to_relu import remove_if_unused

logger = logging.getLogger(__name__)

_FOLD_TARGETS = frozenset({"Conv", "ConvTranspose", "Gemm"})


class ConvertBNToConv(QuarkPass):
    """Fold BatchNormalization into its Conv/ConvTranspose/Gemm producer, else make it a Conv.

    Args:
        fold: fold a BN into its producer when that is exact and safe.
        standalone_to_conv: turn the remaining 4-D BNs into depthwise 1x1 Convs.
    """

    def __init__(self, fold: bool = True, standalone_to_conv: bool = True) -> None:
        super().__init__()
        self.fold = fold
        self.standalone_to_conv = standalone_to_conv

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        bns = [
            node
            for node in ir.traversal.RecursiveGraphIterator(model.graph)
            if node.op_type == "BatchNormalization" and node.domain == "" and is_inference_bn(node)
        ]
        if not bns:
            return ir.passes.PassResult(model, modified=False)
        self._names = NameGenerator(model.graph)
        self._const = Constants(model)
        folded = 0
        rest: list[tuple[ir.Node, np.ndarray, np.ndarray]] = []
        for node in bns:
            affine = bn_affine(node, self._const)
            if affine is None:
                logger.debug("BatchNormalization %s: parameters are not constants", node.name)
                continue
            m, b = affine
            if self.fold and self._fold(node, m, b):
                folded += 1
            else:
                rest.append((node, m, b))
        converted = 0
        if self.standalone_to_conv and rest:
            if any(node.inputs[0].shape is None for node, _, _ in rest):
                infer_shapes(model, type(self).__name__)
            for node, m, b in rest:
                if self._to_depthwise_conv(node, m, b):
                    converted += 1
        if folded or converted:
            logger.info(
                "ConvertBNToConv: %d BatchNormalization folded into their producer, %d turned "
                "into depthwise 1x1 Conv",
                folded,
                converted,
            )
        return ir.passes.PassResult(model, modified=bool(folded or converted))

    # -- folding -----------------------------------------------------------------------------

    def _fold(self, bn: ir.Node, m: np.ndarray, b: np.ndarray) -> bool:
        x = bn.inputs[0]
        producer = x.producer()
        graph = bn.graph
        if (
            producer is None
            or producer.op_type not in _FOLD_TARGETS
            or producer.domain != ""
            or producer.graph is not graph
            or single_consumer(x) is not bn
            or x.index() != 0
        ):
            return False
        if producer.op_type == "Gemm":
            new = folded_gemm(producer, self._const, m, b)
        else:
            new = folded_conv(producer, self._const, m, b)
        if new is None:
            return False
        bn_params = list(bn.inputs[1:])
        set_weight_and_bias(producer, *new, self._names, "bn")
        bypass(bn, x)
        for value in bn_params:
            if value is not None:
                remove_if_unused(graph, value)
        logger.debug("BatchNormalization %s folded into %s %s", bn.name, producer.op_type, x.name)
        return True

    # -- standalone --------------------------------------------------------------------------

    def _to_depthwise_conv(self, bn: ir.Node, m: np.ndarray, b: np.ndarray) -> bool:
        x = bn.inputs[0]
        if x.shape is None or x.shape.rank() != 4:
            logger.debug("BatchNormalization %s: input is not 4-D, left alone", bn.name)
            return False
        channels = m.size
        if isinstance(x.shape[1], int) and x.shape[1] != channels:
            return False
        dtype = _weight_dtype(x, bn)
        if dtype is None:
            return False
        graph = bn.graph
        base = bn.name or "BatchNormalization"
        old_params = list(bn.inputs[1:])
        weight = add_initializer(
            graph, self._names(f"{base}.dw_weight"), m.reshape(channels, 1, 1, 1).astype(dtype)
        )
        bias = add_initializer(graph, self._names(f"{base}.dw_bias"), b.astype(dtype))
        bn.op_type = "Conv"
        bn.resize_inputs(3)
        bn.replace_input_with(1, weight)
        bn.replace_input_with(2, bias)
        bn.resize_outputs(1)
        bn.attributes.clear()
        bn.attributes.add(ir.AttrInt64s("kernel_shape", [1, 1]))
        bn.attributes.add(ir.AttrInt64s("strides", [1, 1]))
        bn.attributes.add(ir.AttrInt64s("pads", [0, 0, 0, 0]))
        bn.attributes.add(ir.AttrInt64s("dilations", [1, 1]))
        bn.attributes.add(ir.AttrInt64("group", channels))
        for value in old_params:
            if value is not None:
                remove_if_unused(graph, value)
        logger.debug("BatchNormalization %s -> depthwise 1x1 Conv (group=%d)", bn.name, channels)
        return True


def _weight_dtype(x: ir.Value, bn: ir.Node) -> np.dtype | None:
    if x.dtype is not None:
        try:
            dtype = np.dtype(x.dtype.numpy())
        except (TypeError, ValueError):
            return None
    else:
        gamma = constant_array(bn.inputs[1])
        dtype = gamma.dtype if gamma is not None else np.dtype(np.float32)
    return dtype if np.issubdtype(dtype, np.floating) else None
