"""SplitLargeKernelPool: an average pool over a large window becomes two smaller average pools.

The NPU's average pool accepts kernels of area at most 512 (AMD Quark, ``Optimizer.
split_large_kernel_pool`` in ``quark/onnx/optimize.py``, uses that limit and splits
GlobalAveragePool once). The limit is the constructor option ``max_kernel_area``.

Maths. Let a window have size ``k_i`` along spatial dimension ``i`` and ``k_i = d_i * e_i``. The
window is the disjoint union of ``e = prod e_i`` blocks of ``d = prod d_i`` elements each, so::

    mean(window) = (1 / (d e)) sum_blocks sum_block x = (1 / e) sum_blocks ((1 / d) sum_block x)
                 = mean over the e blocks of (mean of each block)

Stage 1 is ``AveragePool(kernel=d, strides=d, pads=0)`` (non-overlapping blocks starting at 0),
stage 2 averages ``e`` stage-1 outputs. Both are exact means of equal-size groups, so the
composition equals the original pool up to float rounding (about 1e-7 relative).

* ``GlobalAveragePool`` over ``(H, W)`` (or ``(L)``): ``k = (H, W)``; stage 2 is the original
  GlobalAveragePool, now reading the ``(H/d_1, W/d_2)`` stage-1 output.
* ``AveragePool`` with no padding (pads 0, ``auto_pad`` NOTSET or VALID), ``ceil_mode=0`` and
  dilations 1: stage 2 is the original node with ``kernel = k / d`` and ``strides = s / d``. This
  needs ``d_i | s_i`` (the blocks of every window must line up with the stage-1 grid: a window
  starts at ``j s_i``, a multiple of ``d_i``), or a window covering the whole dimension
  (``H_i = k_i``, one output, stride 1 in stage 2). With ``d_i | s_i`` the output lengths agree:
  ``floor((floor(H/d) - k/d) / (s/d)) = floor((H - k) / s)``.

Choice of ``d`` (as in AMD Quark): ``d_i`` is the largest divisor of ``k_i`` not above
``sqrt(k_i)``. If that leaves a stage above the limit (or is not allowed by the strides), every
allowed divisor combination is tried and the one with the smallest larger stage is taken. When no
combination brings both stages within the limit (for example a prime-sized 23x23 window), the
pool is left alone with a warning: only one split is made.

Needs static spatial sizes of the pool input; shape inference runs when they are unknown. Pools
with kernel area ``<= max_kernel_area`` are never touched.
"""

from __future__ import annotations

import itertools
import logging
import math

import onnx_ir as ir

from quark_onnx.graph.ir import NameGenerator, infer_shapes
from quark_onnx.passes.base import QuarkPass

logger = logging.getLogger(__name__)

#: Kernel area limit of the NPU's average pool (AMD Quark's value).
NPU_MAX_POOL_KERNEL_AREA = 512


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _quark_factor(n: int) -> int:
    """The largest divisor of ``n`` not above ``sqrt(n)`` (1 for primes)."""
    d = math.isqrt(n)
    while d > 1 and n % d:
        d -= 1
    return max(d, 1)


def choose_split(
    kernel: tuple[int, ...], allowed: list[list[int]], limit: int
) -> tuple[int, ...] | None:
    """Stage-1 kernel ``d`` (``d_i`` in ``allowed[i]``, dividing ``kernel[i]``) or None.

    Both ``prod(d)`` and ``prod(kernel / d)`` must be ``<= limit``; AMD Quark's square-root choice
    is preferred when it qualifies, else the combination with the smallest larger stage.
    """

    def stages(d: tuple[int, ...]) -> tuple[int, int]:
        first = math.prod(d)
        return first, math.prod(kernel) // first

    preferred = tuple(_quark_factor(k) for k in kernel)
    if (
        math.prod(preferred) > 1
        and all(p in a for p, a in zip(preferred, allowed, strict=True))
        and max(stages(preferred)) <= limit
    ):
        return preferred
    best: tuple[int, ...] | None = None
    best_key: tuple[int, int] | None = None
    for d in itertools.product(*allowed):
        first, second = stages(d)
        if first == 1 or max(first, second) > limit:
            continue
        key = (max(first, second), -min(first, second))
        if best_key is None or key < best_key:
            best, best_key = d, key
    return best


def _static_spatial(value: ir.Value) -> tuple[int, ...] | None:
    if value.shape is None or value.shape.rank() < 3:
        return None
    dims = tuple(value.shape[2:])
    if not all(isinstance(d, int) and d > 0 for d in dims):
        return None
    return dims


class SplitLargeKernelPool(QuarkPass):
    """Split average pools whose kernel area exceeds ``max_kernel_area`` into two pools.

    Args:
        max_kernel_area: largest kernel area (product of the kernel sizes) the target accepts.
        include_average_pool: also split ``AveragePool`` nodes (not only GlobalAveragePool).
    """

    def __init__(
        self,
        max_kernel_area: int = NPU_MAX_POOL_KERNEL_AREA,
        include_average_pool: bool = True,
    ) -> None:
        super().__init__()
        if max_kernel_area < 1:
            raise ValueError(f"max_kernel_area must be >= 1, got {max_kernel_area}")
        self.max_kernel_area = int(max_kernel_area)
        self.include_average_pool = include_average_pool

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        op_types = {"GlobalAveragePool"}
        if self.include_average_pool:
            op_types.add("AveragePool")
        pools = [
            node
            for node in ir.traversal.RecursiveGraphIterator(model.graph)
            if node.op_type in op_types
            and node.domain == ""
            and node.inputs
            and node.inputs[0] is not None
        ]
        if not pools:
            return ir.passes.PassResult(model, modified=False)
        if any(_static_spatial(node.inputs[0]) is None for node in pools):
            infer_shapes(model, type(self).__name__)
        names = NameGenerator(model.graph)
        count = 0
        for node in pools:
            plan = self._plan(node)
            if plan is None:
                continue
            first, second_kernel, second_strides = plan
            x = node.inputs[0]
            base = node.name or node.op_type
            zeros = [0] * (2 * len(first))
            stage1 = ir.Node(
                "",
                "AveragePool",
                [x],
                attributes=[
                    ir.AttrInt64s("kernel_shape", list(first)),
                    ir.AttrInt64s("strides", list(first)),
                    ir.AttrInt64s("pads", zeros),
                ],
                name=names(f"{base}/split_stage1"),
            )
            mid = stage1.outputs[0]
            mid.name = names(f"{base}/split_stage1_output")
            mid.type = x.type
            spatial = _static_spatial(x)
            if x.type is not None and spatial is not None:
                mid.shape = ir.Shape(
                    [x.shape[0], x.shape[1], *(h // d for h, d in zip(spatial, first, strict=True))]
                )
            node.graph.insert_before(node, stage1)
            node.replace_input_with(0, mid)
            if node.op_type == "AveragePool":
                node.attributes.add(ir.AttrInt64s("kernel_shape", list(second_kernel)))
                node.attributes.add(ir.AttrInt64s("strides", list(second_strides)))
            logger.debug(
                "%s %s: kernel %s split into %s then %s",
                node.op_type,
                base,
                tuple(k * d for k, d in zip(second_kernel, first, strict=True)),
                first,
                second_kernel,
            )
            count += 1
        if count:
            logger.info(
                "SplitLargeKernelPool: %d average pool(s) with kernel area > %d split in two",
                count,
                self.max_kernel_area,
            )
        return ir.passes.PassResult(model, modified=bool(count))

    def _plan(
        self, node: ir.Node
    ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
        """``(stage-1 kernel, stage-2 kernel, stage-2 strides)`` or None when not split."""
        spatial = _static_spatial(node.inputs[0])
        if node.op_type == "GlobalAveragePool":
            if spatial is None:
                logger.debug("GlobalAveragePool %s: spatial size unknown, not split", node.name)
                return None
            kernel = spatial
            strides = spatial
            whole = [True] * len(kernel)
        else:
            kernel = tuple(node.attributes.get_ints("kernel_shape", ()))
            if not kernel or not self._is_plain_average_pool(node, len(kernel)):
                return None
            strides = tuple(node.attributes.get_ints("strides", [1] * len(kernel)))
            if spatial is None or len(spatial) != len(kernel):
                whole = [False] * len(kernel)
            else:
                whole = [h == k for h, k in zip(spatial, kernel, strict=True)]
        if math.prod(kernel) <= self.max_kernel_area:
            return None
        allowed = [
            [d for d in _divisors(k) if w or s % d == 0]
            for k, s, w in zip(kernel, strides, whole, strict=True)
        ]
        first = choose_split(kernel, allowed, self.max_kernel_area)
        if first is None:
            logger.warning(
                "%s %s: kernel %s (area %d) exceeds the limit %d and cannot be split into two "
                "pools within it; left as is (the NPU compiler may reject it)",
                node.op_type,
                node.name,
                kernel,
                math.prod(kernel),
                self.max_kernel_area,
            )
            return None
        second = tuple(k // d for k, d in zip(kernel, first, strict=True))
        second_strides = tuple(
            s // d if s % d == 0 else 1 for s, d in zip(strides, first, strict=True)
        )
        return first, second, second_strides

    @staticmethod
    def _is_plain_average_pool(node: ir.Node, rank: int) -> bool:
        auto_pad = node.attributes.get_string("auto_pad", "NOTSET")
        if auto_pad not in ("NOTSET", "VALID"):
            return False
        if any(node.attributes.get_ints("pads", [0] * (2 * rank))):
            return False
        if node.attributes.get_int("ceil_mode", 0) != 0:
            return False
        return all(d == 1 for d in node.attributes.get_ints("dilations", [1] * rank))
