"""MakeConvAttributesExplicit: write every Conv/ConvTranspose attribute the ONNX spec defaults.

The Vitis AI execution provider aborts session creation on a Conv that relies on defaults
(measured on Ryzen AI 1.8; the same test as ``onnxsim``'s ``check_vitisai_support``), so each Conv
gets ``kernel_shape``, ``strides``, ``pads``, ``dilations`` and ``group`` written out. The values
are the ones ONNX uses when the attribute is absent, so the pass is float-preserving:

* ``kernel_shape`` = ``W.shape[2:]`` (the weight's spatial dims; needs a known weight shape);
* ``strides``, ``dilations`` = 1 per spatial axis; ``group`` = 1; ``pads`` = 0 (begins then ends);
* ``auto_pad``: ``VALID`` -> pads 0. ``SAME_UPPER``/``SAME_LOWER`` on a Conv whose input has
  static spatial dims (the batch and channels may be symbolic): per spatial axis of size ``i``,
  stride ``s``, kernel ``k`` and dilation ``d``::

      o = ceil(i / s);  total = max(0, (o - 1) s + (k - 1) d + 1 - i)
      SAME_UPPER: begin = total // 2,       end = total - begin   (extra padding at the end)
      SAME_LOWER: begin = total - total // 2, end = total // 2    (extra padding at the start)

  and ``auto_pad`` is removed (``NOTSET``). With a dynamic H or W, or ``SAME_*`` on a
  ConvTranspose (whose padding also depends on ``output_padding``/``output_shape``), the node is
  left as it is and logged.

Not changed: nodes whose weight shape is unknown (logged).
"""

from __future__ import annotations

import logging
import math

import onnx_ir as ir

from quark_onnx.passes.base import QuarkPass

logger = logging.getLogger(__name__)

_OPS = frozenset({"Conv", "ConvTranspose"})


def same_pads(
    sizes: list[int], kernel: list[int], strides: list[int], dilations: list[int], upper: bool
) -> list[int]:
    """ONNX pads (all begins, then all ends) equivalent to ``auto_pad=SAME_UPPER/SAME_LOWER``."""
    begins, ends = [], []
    for i, k, s, d in zip(sizes, kernel, strides, dilations, strict=True):
        out = math.ceil(i / s)
        total = max(0, (out - 1) * s + (k - 1) * d + 1 - i)
        small, large = total // 2, total - total // 2
        begins.append(small if upper else large)
        ends.append(large if upper else small)
    return begins + ends


def _ints(node: ir.Node, name: str) -> list[int] | None:
    attr = node.attributes.get(name)
    return None if attr is None else list(attr.as_ints())


class MakeConvAttributesExplicit(QuarkPass):
    """Write kernel_shape, strides, pads, dilations and group on every Conv/ConvTranspose."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        count = 0
        for node in ir.traversal.RecursiveGraphIterator(model.graph):
            if node.op_type in _OPS and node.domain in ("", "ai.onnx") and self._explicit(node):
                count += 1
        if count:
            logger.info("MakeConvAttributesExplicit: %d node(s) given explicit attributes", count)
        return ir.passes.PassResult(model, modified=bool(count))

    @staticmethod
    def _explicit(node: ir.Node) -> bool:
        label = node.name or node.op_type
        weight = node.inputs[1] if len(node.inputs) > 1 else None
        if weight is None or weight.shape is None or not weight.shape.is_static():
            logger.warning(
                "%s %s: weight shape unknown; attributes left implicit", node.op_type, label
            )
            return False
        kernel = _ints(node, "kernel_shape") or [int(d) for d in weight.shape[2:]]
        rank = len(kernel)
        strides = _ints(node, "strides") or [1] * rank
        dilations = _ints(node, "dilations") or [1] * rank
        auto_pad = node.attributes.get_string("auto_pad", "NOTSET")
        pads = _ints(node, "pads")
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            x = node.inputs[0]
            shape = x.shape if x is not None else None
            spatial = list(shape[2:]) if shape is not None else []
            static = bool(spatial) and all(isinstance(d, int) for d in spatial)
            if node.op_type != "Conv" or not static:
                logger.warning(
                    "%s %s: auto_pad=%s needs static spatial input dims on a Conv; left as it is",
                    node.op_type,
                    label,
                    auto_pad,
                )
                return False
            sizes = [int(d) for d in shape[2:]]
            pads = same_pads(sizes, kernel, strides, dilations, auto_pad == "SAME_UPPER")
        elif auto_pad == "VALID" or pads is None:
            pads = [0] * (2 * rank)
        before = {
            k: node.attributes.get(k)
            for k in ("kernel_shape", "strides", "pads", "dilations", "group", "auto_pad")
        }
        node.attributes.pop("auto_pad", None)
        node.attributes["kernel_shape"] = ir.AttrInt64s("kernel_shape", kernel)
        node.attributes["strides"] = ir.AttrInt64s("strides", strides)
        node.attributes["pads"] = ir.AttrInt64s("pads", pads)
        node.attributes["dilations"] = ir.AttrInt64s("dilations", dilations)
        node.attributes["group"] = ir.AttrInt64("group", node.attributes.get_int("group", 1))
        after = {k: node.attributes.get(k) for k in before}
        changed = any(
            (before[k] is None) != (after[k] is None)
            or (before[k] is not None and before[k].value != after[k].value)
            for k in before
        )
        return changed
