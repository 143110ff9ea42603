"""Where a node runs and how it is checked, beyond its op's row: two cases decided here, in one
place for the planner and the readiness checker.

* **Constant arithmetic read only by CPU ops** (``Mul``, ``Add``, ``Sub``, ``Div`` of one computed
  tensor and a constant, every reader placed on the CPU) runs on the CPU with its readers: the
  planner leaves it float, the checker does not count it as an NPU node missing a Q/DQ. The
  graph is split before those readers anyway; on the NPU the result would only be requantized to
  int8 on the way. The case that matters: the gate input ``x * s`` EqualizeGatedActivations
  writes before a SiLU's ``Sigmoid`` (a CPU op in XINT8) rescales each channel by its own power
  of two, which one per-tensor int8 position cannot hold for every channel; read in float from
  ``x``'s int8 codes it is exact.
* **The decode tail after the last NPU layer** (:func:`cpu_tail_nodes`): float nodes fed by a
  ``DequantizeLinear`` from which no ``QuantizeLinear`` is reachable, other than the layers
  (Conv, ConvTranspose, Gemm, MatMul),
  are the model's CPU partition: the graph leaves the NPU once, at the Q/DQ pairs before them,
  and never comes back. The planner keeps such a tail float where a heterogeneous join needs it
  (:mod:`quark_onnx.npu.decode_tail`); the checker does not count its nodes as NPU nodes missing
  a Q/DQ. A layer in it still is one (a Conv without its output Q/DQ cannot run on the NPU).
* **Shape arithmetic** (:mod:`quark_onnx.graph.shape_arithmetic`): integer tensors and the float
  tensors that only compute shapes are never quantized; their nodes are not NPU nodes either.
* **Mixed-precision islands**: the nodes kept float around a promoted tensor
  (:mod:`quark_onnx.pipeline.mixed_precision`) run on the CPU on purpose. The model records them
  in its metadata (:data:`PROMOTIONS_KEY`, :func:`write_promotions`); the checker takes the nodes
  of that record as intended instead of as findings, and only those: a float node the record does
  not name is reported as ever.
* **A LayerNorm written op by op** (:func:`~quark_onnx.graph.patterns.decomposed_layer_norm`:
  ``(x - mean) / sqrt(var + eps)``) is the ``LayerNormalization`` op and is treated as its row
  says for XINT8: float inside, quantized at its input and output (by its neighbours), checked
  as one node. Node by node, XINT8 had no rule for its ``Div`` and left its ``Pow`` and ``Sqrt``
  results unquantized between NPU ops (a model ``check`` rejects); quantizing those as well made
  the PP-OCRv6 small recognizer's squared deviations int8 and took it from 8.2 to 1.2 dB output
  SQNR (``benchmarks/results/unseen.md``).
"""

from __future__ import annotations

import json

import onnx_ir as ir

from quark_onnx.graph.patterns import decomposed_layer_norm, is_constant
from quark_onnx.npu import ops as npu_ops

_STANDARD = ("", "ai.onnx")
#: the layers: a decode tail stops at them (they are the last NPU layers)
LAYERS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})
_CONSTANT_ARITHMETIC = frozenset({"Mul", "Add", "Sub", "Div"})


def _runs_on_cpu(node: ir.Node) -> bool:
    row = npu_ops.spec(node.op_type) if node.domain in _STANDARD else None
    return row is not None and row.placement is npu_ops.Placement.CPU


def cpu_side_arithmetic(node: ir.Node) -> bool:
    """``node`` is constant arithmetic read only by CPU ops, so it runs on the CPU with them."""
    if node.op_type not in _CONSTANT_ARITHMETIC or node.domain not in _STANDARD:
        return False
    if len(node.inputs) != 2 or any(v is None for v in node.inputs):
        return False
    if sum(1 for v in node.inputs if not is_constant(v)) != 1 or len(node.outputs) != 1:
        return False
    out = node.outputs[0]
    uses = list(out.uses())
    if out.is_graph_output() or not uses:
        return False
    return all(_runs_on_cpu(use.node) for use in uses)


def layer_norm_members(graph: ir.Graph) -> set[int]:
    """``id(node)`` of every top-level node of ``graph`` inside a LayerNorm written op by op."""
    members: set[int] = set()
    for node in graph:
        if node.op_type == "Pow":
            members.update(id(n) for n in decomposed_layer_norm(node) or ())
    return members


def cpu_tail_nodes(graph: ir.Graph) -> set[int]:
    """``id(node)`` of the top-level nodes of ``graph`` after its last NPU layer: fed (through
    any path) by a ``DequantizeLinear``, no ``QuantizeLinear`` reachable from them, and not Q/DQ
    nodes or layers (module doc). Empty for a graph without Q/DQ nodes."""
    nodes = list(graph)
    qdq = ("QuantizeLinear", "DequantizeLinear")
    reaches_q: set[int] = set()
    for node in reversed(nodes):  # consumers first
        readers = [use.node for out in node.outputs for use in out.uses()]
        if any(r.op_type == "QuantizeLinear" or id(r) in reaches_q for r in readers):
            reaches_q.add(id(node))
    fed: set[int] = set()
    for node in nodes:  # producers first
        producers = [v.producer() for v in node.inputs if v is not None]
        if any(
            p is not None and (p.op_type == "DequantizeLinear" or id(p) in fed) for p in producers
        ):
            fed.add(id(node))
    return {
        id(n)
        for n in nodes
        if id(n) in fed
        and id(n) not in reaches_q
        and n.op_type not in qdq
        and n.op_type not in LAYERS
    }


#: Model metadata key of the mixed-precision promotions: JSON ``{"precision": "float" | "int16",
#: "tensors": {tensor: [node, ...]}}``, the nodes kept float around each promoted tensor (none for
#: a 16-bit tensor), named as the readiness checker names nodes.
PROMOTIONS_KEY = "quark_onnx.mixed_precision"


def write_promotions(model: ir.Model, promoted: dict[str, tuple[str, ...]]) -> None:
    """Record ``promoted`` (tensor -> its float nodes) in ``model``'s metadata; nothing without
    a promotion, so such a model is the same bytes as without this record."""
    if not promoted:
        return
    precision = "float" if any(promoted.values()) else "int16"
    model.metadata_props[PROMOTIONS_KEY] = json.dumps(
        {"precision": precision, "tensors": {t: list(n) for t, n in sorted(promoted.items())}},
        sort_keys=True,
    )


def read_promotions(metadata: dict[str, str]) -> dict[str, tuple[str, ...]]:
    """The promotions a model records (:func:`write_promotions`): tensor -> float nodes; empty
    when there is none or the record does not parse."""
    text = metadata.get(PROMOTIONS_KEY)
    if not text:
        return {}
    try:
        tensors = json.loads(text).get("tensors", {})
        return {str(t): tuple(str(n) for n in nodes) for t, nodes in tensors.items()}
    except (ValueError, AttributeError, TypeError):
        return {}
