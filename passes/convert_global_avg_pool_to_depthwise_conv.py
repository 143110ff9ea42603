"""ConvertGlobalAvgPoolToDepthwiseConv: a global average pool becomes a depthwise Conv.

Why. On the NPU an average pool is a pool op: its input and output share one power-of-two
position (the ``shared_scale`` rule, option ``AlignPool``). A global average pool's output is a
mean, usually a much smaller range than its input (SqueezeNet's last pool reads a Relu reaching
~290 and outputs the logits), so the shared position either clips the input or leaves the mean
with a step of several units. A depthwise Conv computes the same mean as a layer: its output
position is its own, held only to the Conv shift rules (``shift_cut = p_w + p_in - p_out`` in
0 .. 16; no bias), while its input keeps the position it has on its own. The pool's positions
are one choice among the Conv's (``p_out = p_in``, shift_cut = ``p_w``), so no threshold decides
where to convert: calibration picks the mean's position.

Maths. For ``x`` of shape ``(N, C, H, W)``::

    GlobalAveragePool(x)[n, c, 0, 0] = (1 / (H W)) sum_{h, w} x[n, c, h, w]
                                     = Conv(x, W, group=C)[n, c, 0, 0],  W[c, 0, :, :] = 1 / (H W)

with ``kernel_shape = (H, W)``, ``strides = 1``, ``pads = 0``, ``dilations = 1``, no bias.
Float-preserving up to the summation order and the rounding of ``1 / (H W)`` to the float type
(about 1e-7 relative in float32).

Hardware arithmetic. The pool sums the window and multiplies by the hardware's ``k / 2^n``
(``pool_reciprocal`` in :mod:`quark_onnx.passes.convert_avg_pool_to_dpu_version`, simulated by
ConvertAvgPoolToDPUVersion, which runs after this pass and so no longer sees a converted pool).
The Conv multiplies by its quantized weight instead: ``1 / (H W)`` as a per-tensor power-of-two
int8 weight is ``q / 2^p``, ``p = floor(log2(127 H W))``, ``q = round(2^p / (H W))`` in 64 .. 127.
For every kernel within the Conv limit its relative error is at most the pool's (equal from 7x7
up, e.g. 13x13: 97/2^14 both; 3x3: 114/2^10, 0.2 %, against the pool's 7/2^6, 1.6 %), and the
quantized model computes it exactly (the weight's Q/DQ).

When. A ``GlobalAveragePool`` of the default domain whose input is 4-D with static ``C``, ``H``,
``W`` (shape inference runs when unknown) of a float type:

* ``H, W <= max_kernel_side`` (the NPU's Conv kernel limit, default
  :data:`quark_onnx.npu.rules.MAX_CONV_KERNEL_SIDE`, which the readiness check enforces): the
  pool becomes the depthwise Conv.
* a larger side: the mean is taken in two exact stages (as SplitLargeKernelPool does, whose
  module gives the maths): first ``AveragePool(kernel = d, strides = d, pads = 0)`` over
  non-overlapping blocks, ``d_i`` the smallest divisor of ``k_i`` leaving ``k_i / d_i <=
  max_kernel_side``, then the depthwise Conv over the ``(H / d_1, W / d_2)`` block means. The
  block pool keeps the input's position (its outputs' range is within the input's, so nothing
  clips), and the Conv averages ``e = H W / (d_1 d_2)`` of them, which divides the block pool's
  rounding noise power by about ``e`` while the mean gets its own position. Not done when the
  block area exceeds the pool's own limit (``max_pool_kernel_area``, SplitLargeKernelPool's
  512): the pool is kept.

An ``AveragePool`` whose one window is the whole input is the same global mean (older exports
write ResNet's and Inception's last pool as ``AveragePool(kernel 7x7)`` on a 7x7 map): kernel equal
to the static ``(H, W)``, no padding (``pads`` 0, ``auto_pad`` NOTSET or VALID) and dilations 1
(strides and ``ceil_mode`` then give one output whatever they are). It is converted the same way.
Other AveragePools (windows that slide or pad) and GlobalMaxPool are left alone. The pass runs
after SplitLargeKernelPool, so the last stage of a pool it split is converted like any other.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from quark_onnx.graph.ir import NameGenerator, add_initializer, infer_shapes
from quark_onnx.npu.rules import MAX_CONV_KERNEL_SIDE
from quark_onnx.passes.base import QuarkPass
from quark_onnx.passes.split_large_kernel_pool import NPU_MAX_POOL_KERNEL_AREA

logger = logging.getLogger(__name__)

_FLOAT_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE})


def block_kernel(kernel: tuple[int, ...], max_side: int, max_area: int) -> tuple[int, ...] | None:
    """Stage-1 block sides ``d`` (``d_i`` the smallest divisor of ``kernel[i]`` with
    ``kernel[i] / d_i <= max_side``), or None when a side has none or ``prod(d) > max_area``.
    All ones when the kernel already fits (no block stage)."""
    blocks = []
    for k in kernel:
        d = next((d for d in range(1, k + 1) if k % d == 0 and k // d <= max_side), None)
        if d is None:
            return None
        blocks.append(d)
    return tuple(blocks) if np.prod(blocks) <= max_area else None


def _is_global(node: ir.Node, hw: tuple[int, int]) -> bool:
    """A GlobalAveragePool, or an AveragePool whose single window is the whole unpadded map."""
    if node.op_type == "GlobalAveragePool":
        return True
    if node.attributes.get_string("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        return False
    if any(node.attributes.get_ints("pads", [0, 0, 0, 0])):
        return False
    if any(d != 1 for d in node.attributes.get_ints("dilations", [1, 1])):
        return False
    return tuple(node.attributes.get_ints("kernel_shape", ())) == hw


def _static_chw(value: ir.Value) -> tuple[int, int, int] | None:
    """``(C, H, W)`` of a 4-D value when all three are known positive integers."""
    if value.shape is None or value.shape.rank() != 4:
        return None
    dims = tuple(value.shape[1:])
    if not all(isinstance(d, int) and d > 0 for d in dims):
        return None
    return int(dims[0]), int(dims[1]), int(dims[2])


class ConvertGlobalAvgPoolToDepthwiseConv(QuarkPass):
    """Replace global average pools (static 4-D input) by depthwise Convs (see module doc).

    Args:
        max_kernel_side: largest Conv kernel height/width (the NPU's Conv kernel limit).
        max_pool_kernel_area: largest block area of the average pool stage in front of the
            Conv for a pool with a side above ``max_kernel_side`` (0 or 1: no block stage, such
            pools are kept).
    """

    def __init__(
        self,
        max_kernel_side: int = MAX_CONV_KERNEL_SIDE,
        max_pool_kernel_area: int = NPU_MAX_POOL_KERNEL_AREA,
    ) -> None:
        super().__init__()
        if max_kernel_side < 1:
            raise ValueError(f"max_kernel_side must be >= 1, got {max_kernel_side}")
        if max_pool_kernel_area < 0:
            raise ValueError(f"max_pool_kernel_area must be >= 0, got {max_pool_kernel_area}")
        self.max_kernel_side = int(max_kernel_side)
        self.max_pool_kernel_area = int(max_pool_kernel_area)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        pools = [
            node
            for node in graph
            if node.op_type in ("GlobalAveragePool", "AveragePool")
            and node.domain in ("", "ai.onnx")
            and node.inputs
            and node.inputs[0] is not None
        ]
        if not pools:
            return ir.passes.PassResult(model, modified=False)
        if any(_static_chw(node.inputs[0]) is None for node in pools):
            infer_shapes(model, type(self).__name__)
        names = NameGenerator(graph)
        count = 0
        for node in pools:
            x = node.inputs[0]
            chw = _static_chw(x)
            if chw is None or x.dtype not in _FLOAT_TYPES:
                logger.debug("%s %s: input not static 4-D float, kept", node.op_type, node.name)
                continue
            channels, height, width = chw
            if not _is_global(node, (height, width)):
                continue
            blocks = block_kernel(
                (height, width), self.max_kernel_side, max(self.max_pool_kernel_area, 1)
            )
            if blocks is None:
                logger.debug(
                    "%s %s: kernel %dx%d cannot be brought within the Conv limit %d, kept",
                    node.op_type,
                    node.name,
                    height,
                    width,
                    self.max_kernel_side,
                )
                continue
            base = node.name or "GlobalAveragePool"
            if blocks != (1, 1):
                x = self._block_pool(graph, node, x, blocks, names)
                height, width = height // blocks[0], width // blocks[1]
            weight = np.full(
                (channels, 1, height, width), 1.0 / (height * width), dtype=x.dtype.numpy()
            )
            w = add_initializer(graph, names(f"{base}/mean_weight"), weight)
            conv = ir.Node(
                "",
                "Conv",
                [x, w],
                attributes=[
                    ir.AttrInt64s("kernel_shape", [height, width]),
                    ir.AttrInt64s("strides", [1, 1]),
                    ir.AttrInt64s("pads", [0, 0, 0, 0]),
                    ir.AttrInt64s("dilations", [1, 1]),
                    ir.AttrInt64("group", channels),
                ],
                outputs=[ir.Value(name=None, shape=node.outputs[0].shape, type=x.type)],
                name=names(f"{base}/depthwise_mean"),
            )
            out = node.outputs[0]
            out.replace_all_uses_with(conv.outputs[0], replace_graph_outputs=True)
            conv.outputs[0].name, out.name = out.name, None
            graph.insert_before(node, conv)
            graph.remove(node, safe=True)
            logger.debug(
                "%s %s (%d channels) -> %sdepthwise Conv %dx%d",
                node.op_type,
                node.name,
                channels,
                "" if blocks == (1, 1) else f"AveragePool {blocks[0]}x{blocks[1]} blocks, ",
                height,
                width,
            )
            count += 1
        if count:
            logger.info(
                "ConvertGlobalAvgPoolToDepthwiseConv: %d global average pool(s) -> depthwise Conv",
                count,
            )
        return ir.passes.PassResult(model, modified=bool(count))

    @staticmethod
    def _block_pool(
        graph: ir.Graph,
        node: ir.Node,
        x: ir.Value,
        blocks: tuple[int, ...],
        names: NameGenerator,
    ) -> ir.Value:
        """Insert ``AveragePool(kernel = strides = blocks)`` on ``x`` before ``node``."""
        base = node.name or "GlobalAveragePool"
        pool = ir.Node(
            "",
            "AveragePool",
            [x],
            attributes=[
                ir.AttrInt64s("kernel_shape", list(blocks)),
                ir.AttrInt64s("strides", list(blocks)),
                ir.AttrInt64s("pads", [0] * (2 * len(blocks))),
            ],
            name=names(f"{base}/block_mean"),
        )
        out = pool.outputs[0]
        out.name = names(f"{base}/block_mean_output")
        out.type = x.type
        out.shape = ir.Shape(
            [x.shape[0], x.shape[1], *(h // d for h, d in zip(x.shape[2:], blocks, strict=True))]
        )
        graph.insert_before(node, pool)
        return out
