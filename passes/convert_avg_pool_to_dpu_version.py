"""ConvertAvgPoolToDPUVersion: multiply average pools by the NPU's reciprocal of the pool area.

The NPU does not divide: an average pool over an area ``A = kh * kw`` sums the window and multiplies
by ``k / 2^n``, an approximation of ``1 / A``. The float simulation therefore keeps the pool
(which divides by ``A`` exactly) and multiplies its output by ``A * k / 2^n`` (a float32 scalar
initializer, exact since ``A * k < 2^24``)::

    y = AveragePool(x) * (A * k / 2^n)  ==  sum_window(x) * k / 2^n

``k / 2^n`` comes from the hardware table for square windows (3x3 -> 7/64, 5x5 -> 10/256,
6x6 -> 7/256, 7x7 -> 21/1024, 14x14 -> 21/4096); otherwise it is the ``k / 2^n`` closest to
``1 / A`` over ``n = 0 .. 6 + ceil(log2 A)`` with ``k = round(2^n / A)`` (first ``n`` on ties),
as AMD Quark computes it. Windows with a side above 255 are not simulated (factor 1).

Handled: AveragePool with a 2-D ``kernel_shape``; GlobalAveragePool with a static 4-D input
(``A = H * W``); and, with ``reduce_mean=True``, ReduceMean over the spatial axes (2, 3) of a static
4-D input (factor from the closest-``k / 2^n`` rule only, as Quark does for ReduceMean).
Idempotent: a pool whose only consumer is already the ``Mul`` by its factor is left alone.
Changes numerics on purpose (``changes_numerics = True``); runs before calibration.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import onnx_ir as ir

from quark_onnx.graph.ir import NameGenerator, add_initializer, constant_array
from quark_onnx.passes.base import QuarkPass

logger = logging.getLogger(__name__)

#: Square window side -> (k, n): the hardware's k / 2^n for 1 / side^2.
SQUARE_RECIPROCALS: dict[int, tuple[int, int]] = {
    3: (7, 6),
    5: (10, 8),
    6: (7, 8),
    7: (21, 10),
    14: (21, 12),
}
MAX_SIDE = 255


def closest_reciprocal(area: int) -> tuple[int, int]:
    """``(k, n)`` with ``k / 2^n`` closest to ``1 / area`` for ``n < 7 + ceil(log2 area)``."""
    best: tuple[float, int, int] | None = None
    for n in range(7 + math.ceil(math.log2(area))):
        k = round(2**n / area)  # round half to even, as Python's round
        diff = abs(k / 2**n - 1 / area)
        if best is None or diff < best[0]:
            best = (diff, k, n)
    assert best is not None
    return best[1], best[2]


def pool_reciprocal(kh: int, kw: int) -> tuple[int, int]:
    """The NPU's ``(k, n)`` for a ``kh x kw`` window: the table for squares, else the closest."""
    if kh == kw and kh in SQUARE_RECIPROCALS:
        return SQUARE_RECIPROCALS[kh]
    return closest_reciprocal(kh * kw)


def dpu_factor(area: int, k: int, n: int) -> np.float32:
    """``A * k / 2^n`` as float32 (exact)."""
    return np.float32(area * k / 2**n)


def scaled_by(value: ir.Value, factor: np.float32) -> bool:
    """``value`` already feeds only a ``Mul`` by the scalar ``factor``."""
    uses = list(value.uses())
    if len(uses) != 1 or value.is_graph_output():
        return False
    node = uses[0].node
    if node.op_type != "Mul" or len(node.inputs) != 2:
        return False
    other = node.inputs[1] if node.inputs[0] is value else node.inputs[0]
    array = constant_array(other)
    return array is not None and array.size == 1 and np.float32(array.reshape(())) == factor


def append_scale_mul(
    graph: ir.Graph, node: ir.Node, factor: np.float32, names: NameGenerator
) -> ir.Node:
    """Insert ``Mul(out, factor)`` after ``node``; the Mul takes over the output's name and uses.

    The node's output is renamed ``<out>_pre_dpu_scale``; consumers and graph outputs read the
    Mul's output, which carries the original name, so the graph's interface is unchanged.
    """
    out = node.outputs[0]
    original = out.name or names("dpu_scaled")
    constant = add_initializer(
        graph, names(f"{original}_dpu_scale"), np.array(factor, dtype=np.float32)
    )
    result = ir.Value(name=None, shape=out.shape, type=out.type)
    out.replace_all_uses_with(result, replace_graph_outputs=True)
    out.name = names(f"{original}_pre_dpu_scale")
    result.name = original
    mul = ir.Node(
        "",
        "Mul",
        [out, constant],
        outputs=[result],
        name=names(f"{node.name or original}_dpu_scale"),
    )
    graph.insert_after(node, mul)
    return mul


def _static_spatial(value: ir.Value | None) -> tuple[int, int] | None:
    if value is None or value.shape is None or value.shape.rank() != 4:
        return None
    dims = value.shape[2:]
    if not all(isinstance(d, int) for d in dims):
        return None
    return int(dims[0]), int(dims[1])


def _spatial_reduce_mean(node: ir.Node) -> bool:
    if "axes" in node.attributes:
        axes = list(node.attributes.get_ints("axes"))
    elif len(node.inputs) > 1 and node.inputs[1] is not None:
        array = constant_array(node.inputs[1])
        if array is None:
            return False
        axes = [int(a) for a in np.asarray(array).reshape(-1)]
    else:
        return False
    return len(axes) == 2 and {a % 4 for a in axes} == {2, 3}


class ConvertAvgPoolToDPUVersion(QuarkPass):
    """Append ``Mul(A * k / 2^n)`` to average pools (and spatial ReduceMean) — see module doc.

    Args:
        reduce_mean: also simulate ReduceMean over (H, W) (option ConvertReduceMeanToDPUVersion).
    """

    changes_numerics = True
    simulates_hardware = True

    def __init__(self, reduce_mean: bool = True) -> None:
        super().__init__()
        self.reduce_mean = reduce_mean

    def _factor(self, node: ir.Node) -> tuple[int, np.float32] | None:
        if node.op_type == "AveragePool":
            kernel = node.attributes.get_ints("kernel_shape", None)
            if kernel is None or len(kernel) != 2:
                return None
            kh, kw = int(kernel[0]), int(kernel[1])
            if max(kh, kw) > MAX_SIDE:
                return None
            k, n = pool_reciprocal(kh, kw)
            return kh * kw, dpu_factor(kh * kw, k, n)
        hw = _static_spatial(node.inputs[0] if node.inputs else None)
        if hw is None:
            logger.warning(
                "%s %s: input H, W unknown; DPU average not simulated", node.op_type, node.name
            )
            return None
        if node.op_type == "GlobalAveragePool":
            if max(hw) > MAX_SIDE:
                return None
            k, n = pool_reciprocal(*hw)
        else:
            k, n = closest_reciprocal(hw[0] * hw[1])
        return hw[0] * hw[1], dpu_factor(hw[0] * hw[1], k, n)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        ops = {"AveragePool", "GlobalAveragePool"} | ({"ReduceMean"} if self.reduce_mean else set())
        graph = model.graph
        candidates = [
            n
            for n in graph
            if n.op_type in ops and n.domain in ("", "ai.onnx") and n.outputs and n.inputs
        ]
        names = NameGenerator(graph)
        count = 0
        for node in candidates:
            if node.op_type == "ReduceMean" and not _spatial_reduce_mean(node):
                continue
            found = self._factor(node)
            if found is None:
                continue
            area, factor = found
            if factor == np.float32(1.0) or scaled_by(node.outputs[0], factor):
                continue
            append_scale_mul(graph, node, factor, names)
            logger.debug("%s %s: area %d, output x %r", node.op_type, node.name, area, factor)
            count += 1
        if count:
            logger.info("ConvertAvgPoolToDPUVersion: %d average(s) rescaled", count)
        return ir.passes.PassResult(model, modified=bool(count))
