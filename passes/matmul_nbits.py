"""MatMulNBits: weight-only 4-bit MatMul layers in onnxruntime's ``com.microsoft`` format.

Weight-only int4/uint4 quantization writes the opset-21 standard form::

    W_quantized [K, N] (int4/uint4) -> DequantizeLinear(W_scale, W_zero_point,
                                                         axis=0, block_size=B) -> MatMul(A, .)

onnxruntime (and its generate() API for LLM weights) runs the same numbers fastest as one
``com.microsoft.MatMulNBits(A, B_packed, scales, zero_points; K, N, bits=4, block_size=B)``
node. This pass rewrites each such pair; the values are the same, only their layout changes:

* ``B_packed`` uint8 ``[N, ceil(K/B), B/2]``: column ``n`` of ``W`` cut into blocks of ``B``
  codes along ``K`` (the last block padded with code 0), two codes per byte, the even-``k`` code
  in the low nibble;
* ``scales`` float ``[N * ceil(K/B)]``: ``W_scale`` transposed (row ``n``, then block);
* ``zero_points`` uint8 ``[N * ceil(ceil(K/B) / 2)]``: ``W_zero_point`` transposed, packed two
  per byte the same way, each row padded to whole bytes.

MatMulNBits codes are unsigned with ``w = (code - zero_point) * scale``: a signed int4 code
``q`` is stored as ``q + 8`` with zero point ``z + 8``, which gives the same ``w`` exactly.
The layer then differs from the DequantizeLinear form only by float rounding of the products
and sums (onnxruntime's kernel orders them differently).

Handled: a default-domain ``MatMul`` whose input B is the output of a ``DequantizeLinear`` of a
2-D int4/uint4 constant blocked along axis 0 (``block_size`` a power of two >= 16) read only by
MatMul layers. Anything else is left as it is. The ``com.microsoft`` opset (version 1) is added
when a layer is rewritten. Unused DequantizeLinear nodes and initializers are removed.
"""

from __future__ import annotations

import logging

import ml_dtypes
import numpy as np
import onnx_ir as ir

from quark_onnx.graph.ir import (
    NameGenerator,
    add_initializer,
    constant_array,
    is_standard,
    remove_unread_dequantize,
)
from quark_onnx.passes.base import QuarkPass

logger = logging.getLogger(__name__)

MS_DOMAIN = "com.microsoft"
_FOUR_BIT = (ir.DataType.INT4, ir.DataType.UINT4)


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """Pack unsigned 4-bit codes (last axis, even length) two per byte, the even one low."""
    codes = codes.astype(np.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def nbits_layout(
    codes: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None, block_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(B_packed, scales, zero_points) of MatMulNBits for a ``[K, N]`` 4-bit weight blocked
    along K (``scale``/``zero_point`` of shape ``[ceil(K/B), N]``); see the module docstring."""
    k, n = codes.shape
    blocks = -(-k // block_size)
    signed = codes.dtype == np.dtype(ml_dtypes.int4)
    offset = 8 if signed else 0
    q = codes.astype(np.int16) + offset  # unsigned codes 0..15
    z = (
        np.zeros((blocks, n), np.int16)
        if zero_point is None
        else zero_point.astype(np.int16).reshape(blocks, n)
    ) + offset
    padded = np.zeros((blocks * block_size, n), np.int16)
    padded[:k] = q
    columns = padded.T.reshape(n, blocks, block_size)
    b_packed = pack_nibbles(columns)
    scales = np.ascontiguousarray(scale.reshape(blocks, n).T.astype(np.float32)).reshape(-1)
    zt = z.T  # [N, blocks]
    if blocks % 2:
        zt = np.concatenate([zt, np.zeros((n, 1), np.int16)], axis=1)
    zero_points = pack_nibbles(zt).reshape(-1)
    return b_packed, scales, zero_points


def _blocked_weight(value: ir.Value | None) -> tuple[ir.Node, int] | None:
    """(DequantizeLinear, block size) for a 2-D 4-bit constant blocked along axis 0."""
    dq = value.producer() if value is not None else None
    if not is_standard(dq, "DequantizeLinear") or len(dq.inputs) < 2 or dq.inputs[0] is None:
        return None
    if dq.inputs[0].dtype not in _FOUR_BIT:
        return None
    block = dq.attributes.get_int("block_size", 0)
    if dq.attributes.get_int("axis", 1) != 0 or block < 16 or block & (block - 1):
        return None
    codes = constant_array(dq.inputs[0])
    if codes is None or codes.ndim != 2 or constant_array(dq.inputs[1]) is None:
        return None
    if any(not is_standard(use.node, "MatMul") or use.idx != 1 for use in dq.outputs[0].uses()):
        return None
    return dq, block


class ToMatMulNBits(QuarkPass):
    """Rewrite 4-bit weight-only MatMul layers into MatMulNBits (see the module docstring)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        names = NameGenerator(graph)
        packed: dict[int, tuple[ir.Value, ir.Value, ir.Value, int, int, int]] = {}
        rewritten = 0
        for node in list(graph):
            if not is_standard(node, "MatMul") or len(node.inputs) != 2:
                continue
            found = _blocked_weight(node.inputs[1])
            if found is None:
                continue
            dq, block = found
            if id(dq) not in packed:
                codes = constant_array(dq.inputs[0])
                scale = constant_array(dq.inputs[1])
                zero = constant_array(dq.inputs[2]) if len(dq.inputs) > 2 else None
                b, s, z = nbits_layout(codes, scale, zero, block)
                base = dq.inputs[0].name or "weight"
                packed[id(dq)] = (
                    add_initializer(graph, names(f"{base}_nbits"), b),
                    add_initializer(graph, names(f"{base}_nbits_scales"), s),
                    add_initializer(graph, names(f"{base}_nbits_zero_points"), z),
                    codes.shape[0],
                    codes.shape[1],
                    block,
                )
            b, s, z, k, n, block = packed[id(dq)]
            old = node.outputs[0]
            out = ir.Value(name=names(f"{old.name}_nbits"), type=old.type, shape=old.shape)
            fused = ir.Node(
                MS_DOMAIN,
                "MatMulNBits",
                [node.inputs[0], b, s, z],
                attributes=[
                    ir.AttrInt64("K", k),
                    ir.AttrInt64("N", n),
                    ir.AttrInt64("bits", 4),
                    ir.AttrInt64("block_size", block),
                ],
                outputs=[out],
                name=names(f"{node.name or 'MatMul'}_MatMulNBits"),
            )
            graph.insert_after(node, fused)
            name = old.name
            old.replace_all_uses_with(out, replace_graph_outputs=True)
            graph.remove(node, safe=True)
            out.name = name
            rewritten += 1
        if rewritten:
            model.opset_imports.setdefault(MS_DOMAIN, 1)
            remove_unread_dequantize(graph)
            logger.info("ToMatMulNBits: %d MatMul layer(s) now MatMulNBits", rewritten)
        return ir.passes.PassResult(model, rewritten > 0)
