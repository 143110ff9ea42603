"""Heterogeneous joins (a shared position int8 cannot hold) and the decode tail kept on the CPU.

The NPU puts all inputs and the output of a Concat at one power-of-two position (the shared-scale
rule). Where the joined parts' calibrated ranges differ widely, that position is the widest
part's, and the narrowest part keeps only a few bits: a detector's output ``Concat[boxes
(hundreds of pixels), scores in [0, 1]]`` rounds every score to 0 (YOLOv8-style: 0 % of the
detections kept).

**Criterion.** At the shared position ``p`` (the NonOverflow position of the widest input), an
input whose own NonOverflow position is ``p_i`` keeps ``B - (p_i - p)`` of the ``B`` bits of the
type (8 for int8: the sign and 7 magnitude bits). A join is *heterogeneous* when some input keeps
fewer than :data:`SIGNIFICANT_BITS` = 6 bits, i.e. it loses 3 or more bits (its range is 8 times
or more below the widest part's). Why 6: each bit lost costs a uniform signal 6.02 dB of SQNR; at
6 bits it keeps 37.9 dB (6.02 * 6 + 1.76), near what int8 keeps on a Gaussian activation at its
MinMSE position, and a score in [0, 1] keeps a step of 1/32 (0.03 around a 0.25 threshold); at
5 bits the step is 1/16, a quarter of the threshold.

**Treatment.** A heterogeneous join whose output reaches the graph outputs without passing a
layer (Conv, ConvTranspose, Gemm, MatMul) is in the model's *decode tail*. The tail is:

* the join and every node downstream of it (up to the graph outputs);
* upstream, every node whose outputs are read only by the tail, stopping at the layers: the
  score Sigmoid, box arithmetic with anchor/stride constants, the Reshape/Transpose/Split/Concat
  of the decode. The layers it stops at are the last NPU layers.

The tail stays float on the CPU: its nodes leave the plan (``float_nodes``, with the reason), the
tensors read or written only by tail nodes are not quantized, and each tensor where a part leaves
the NPU (a last layer's output) keeps its own Q/DQ at its own position. The readiness checker
accepts such a float region after the last Q/DQ as the CPU partition
(:func:`quark_onnx.npu.placement.cpu_tail_nodes`).

A heterogeneous join *inside* the network (a layer reads it) is reported as a warning and left
as planned: keeping it float would split the NPU graph there.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import onnx_ir as ir

from quark_onnx.npu.placement import LAYERS
from quark_onnx.params import pof2
from quark_onnx.plan.types import FloatNode

logger = logging.getLogger(__name__)

__all__ = [
    "SIGNIFICANT_BITS",
    "Join",
    "decode_tail",
    "heterogeneous_joins",
    "split_heterogeneous_joins",
]

#: the fewest bits (sign included) an input of a shared-position join may keep (module doc)
SIGNIFICANT_BITS = 6

_STANDARD = ("", "ai.onnx")
#: ops that read only their input's shape (not data)
_SHAPE_READERS = frozenset({"Shape", "Size"})


@dataclass(frozen=True)
class Join:
    """A shared-position equality whose narrowest input would keep fewer than ``bits`` bits."""

    node: str
    op_type: str
    widest: str
    widest_max: float
    narrowest: str
    narrowest_max: float
    bits_kept: int

    def describe(self) -> str:
        return (
            f"join of ranges 2^{_exponent(self.widest_max)} and "
            f"2^{_exponent(self.narrowest_max)} ({self.op_type} {self.node!r}: {self.narrowest!r} "
            f"would keep {self.bits_kept} bits at {self.widest!r}'s position)"
        )


def _exponent(peak: float) -> int:
    return math.ceil(math.log2(peak)) if peak > 0 else 0


def _type_bits(qtype: Any) -> int:
    low, high = pof2.code_range(qtype)
    return round(math.log2(high - low + 1))


def heterogeneous_joins(
    plan: Any, ranges: dict[str, tuple[float, int]], bits: int | None = None
) -> list[Join]:
    """The plan's shared-position equalities (Concat) whose inputs' calibrated ranges leave the
    narrowest input fewer than ``bits`` bits at the widest input's position (module doc)."""
    bits = SIGNIFICANT_BITS if bits is None else bits
    joins = []
    for eq in plan.active_equalities():
        members = [t for t in eq.tensors[:-1] if t in ranges]  # the inputs; the last is the output
        if len(members) < 2:
            continue
        widest = min(members, key=lambda t: ranges[t][1])
        narrowest = max(members, key=lambda t: ranges[t][1])
        lost = ranges[narrowest][1] - ranges[widest][1]
        kept = _type_bits(plan.tensors[narrowest].qtype) - lost
        if kept < bits:
            joins.append(
                Join(
                    eq.node,
                    eq.op_type,
                    widest,
                    ranges[widest][0],
                    narrowest,
                    ranges[narrowest][0],
                    kept,
                )
            )
    return joins


def _standard(node: ir.Node) -> bool:
    return node.domain in _STANDARD


def _readers(node: ir.Node) -> list[ir.Node]:
    return [use.node for out in node.outputs for use in out.uses()]


def decode_tail(
    graph: ir.Graph, join: ir.Node, fused: frozenset[int] = frozenset()
) -> set[int] | None:
    """``id`` of the nodes of the decode tail of ``join`` (module doc), or None when a layer
    reads the join's output (a join inside the network). ``fused``: ``id`` of activations fused
    into their producer (they stay with it on the NPU)."""
    tail: set[int] = set()
    stack = [join]
    while stack:  # downstream: everything reading the join, up to the graph outputs
        node = stack.pop()
        if id(node) in tail:
            continue
        if node.op_type in LAYERS or not _standard(node):
            return None
        tail.add(id(node))
        stack.extend(_readers(node))
    changed = True
    nodes = list(graph)
    while changed:  # upstream: nodes read only by the tail, up to the layers
        changed = False
        for node in reversed(nodes):
            if id(node) in tail or id(node) in fused:
                continue
            if node.op_type in LAYERS or not _standard(node):
                continue
            if node.op_type == "Constant" or not node.outputs:
                continue
            readers = _readers(node)
            if not readers or any(o.is_graph_output() for o in node.outputs):
                continue
            if all(id(r) in tail or r.op_type in _SHAPE_READERS for r in readers) and any(
                id(r) in tail for r in readers
            ):
                tail.add(id(node))
                changed = True
    return tail


def split_heterogeneous_joins(
    model: ir.Model, plan: Any, ranges: dict[str, tuple[float, int]], options: Any
) -> list[FloatNode]:
    """Amend ``plan`` in place: the decode tail of every heterogeneous join stays float (module
    doc). Returns the nodes made float (appended to ``plan.float_nodes`` too).

    Off with the extra option ``SplitHeterogeneousJoins=False``."""
    from quark_onnx.plan.build import node_label

    if not options.SplitHeterogeneousJoins:
        return []
    joins = heterogeneous_joins(plan, ranges)
    if not joins:
        return []
    nodes = list(model.graph)
    by_label = {node_label(n, i): n for i, n in enumerate(nodes)}
    labels = {id(n): label for label, n in by_label.items()}
    fused = frozenset(id(by_label[f.activation]) for f in plan.fused if f.activation in by_label)
    reasons: dict[int, str] = {}
    for join in joins:
        node = by_label.get(join.node)
        if node is None:
            continue
        tail = decode_tail(model.graph, node, fused)
        if tail is None:
            logger.warning(
                "%s inside the network: one position loses the narrow part; left as planned "
                "(keeping it float would split the NPU graph there)",
                join.describe(),
            )
            continue
        reasons[id(node)] = f"decode tail on the CPU: {join.describe()}"  # its own join
        for member in tail:
            reasons.setdefault(member, f"decode tail on the CPU: {join.describe()}")
    if not reasons:
        return []
    tail_labels = {labels[i]: reason for i, reason in reasons.items() if i in labels}
    return _amend(plan, tail_labels)


def _amend(plan: Any, tail: dict[str, str]) -> list[FloatNode]:
    """Drop the tail nodes from ``plan``; unplan the tensors only tail nodes read or write."""
    kept_nodes, made_float = [], []
    for planned in plan.nodes:
        if planned.name in tail:
            made_float.append(FloatNode(planned.name, planned.op_type, tail[planned.name]))
        else:
            kept_nodes.append(planned)
    # tail nodes that were float already (no policy: Sigmoid in XINT8) now say why they are
    plan.float_nodes[:] = [
        FloatNode(f.name, f.op_type, tail[f.name]) if f.name in tail else f
        for f in plan.float_nodes
    ]
    used: set[str] = set()
    for planned in kept_nodes:
        used.update(t for t in planned.inputs if t)
        used.update(
            t for t in (planned.output, planned.weight, planned.bias, planned.fused_tensor) if t
        )
    dropped = {
        name
        for planned in plan.nodes
        if planned.name in tail
        for name in (*planned.inputs, planned.output, planned.weight, planned.bias)
        if name and name not in used
    }
    plan.nodes[:] = kept_nodes
    for name in dropped:
        plan.tensors.pop(name, None)
        plan.range_caps.pop(name, None)
        plan.bias_sources.pop(name, None)
    equalities = []
    for eq in plan.equalities:
        if eq.node in tail:
            continue
        members = tuple(t for t in eq.tensors if t not in dropped)
        if len(members) >= 2:
            equalities.append(type(eq)(eq.node, eq.op_type, members, eq.option))
    plan.equalities[:] = equalities
    plan.fused[:] = [f for f in plan.fused if f.producer not in tail]
    plan.float_nodes.extend(made_float)
    for fnode in made_float:
        logger.info("node %s (%s) stays float: %s", fnode.name, fnode.op_type, fnode.reason)
    return made_float
