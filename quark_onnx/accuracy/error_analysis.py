"""Per-layer error analysis: SQNR of every quantized activation, and which layers to keep float.

For each activation ``T`` the plan quantizes, on the kept calibration samples, with ``f`` the float
model's ``T`` and ``q`` the quantized model's dequantized ``T`` (the output of its Q/DQ pair)::

    SQNR(T) = 10 log10( sum f^2 / sum (q - f)^2 )   [dB]

summed over all samples and elements (:data:`SQNR_CAP` when the error is zero). This is the
*accumulated* error: the noise of every earlier layer reaches ``T``. The error a node *adds* is
``drop(T) = min SQNR(inputs) - SQNR(T)`` over the node's quantized activation inputs (a graph
input's SQNR is its own quantization noise): :func:`worst_layers` ranks by that drop, so a single
damaged layer is found even though everything after it inherits its noise.

Keeping a node in float (``nodes_to_exclude``) has a cost on the NPU: the node runs on the CPU and
the graph is split there, with a transfer on each edge between an NPU node and a CPU node.
:func:`fallback_cost` counts the NPU partitions and boundary edges before and after.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from quark_onnx.plan.types import QuantPlan

logger = logging.getLogger(__name__)

#: SQNR reported for a tensor quantized without error (dB).
SQNR_CAP = 200.0

#: Most tensors :func:`layer_errors` measures in one call. onnxruntime's session build grows
#: faster than linearly with the number of graph outputs (an XINT8 chain of 12,000 Adds: 12.5 s for
#: two sessions with every tensor an output; 50,000 Adds: about 40 minutes), so a larger graph
#: is measured on an evenly spaced subset of its tensors, each with the inputs of its producer
#: (its ``drop`` stays exact).
MAX_ANALYSED_TENSORS = 2048


def sqnr_db(signal_power: float, noise_power: float) -> float:
    """``10 log10(signal / noise)``, capped at :data:`SQNR_CAP` (and at ``-SQNR_CAP``)."""
    if noise_power <= 0.0:
        return SQNR_CAP
    if signal_power <= 0.0:
        return -SQNR_CAP
    return float(np.clip(10.0 * math.log10(signal_power / noise_power), -SQNR_CAP, SQNR_CAP))


def quantized_views(model: ir.Model) -> dict[str, str]:
    """Float tensor name -> name of its dequantized value in the quantized graph (Q/DQ pairs)."""
    views: dict[str, str] = {}
    for node in model.graph:
        if node.op_type != "QuantizeLinear" or not node.outputs or node.inputs[0] is None:
            continue
        for use in node.outputs[0].uses():
            dq = use.node
            if dq.op_type != "DequantizeLinear" or not dq.outputs:
                continue
            out = dq.outputs[0]
            original = out.name if out.is_graph_output() else node.inputs[0].name
            if original and out.name:
                views.setdefault(original, out.name)
    return views


def layer_errors(
    prepared: onnx.ModelProto,
    model: ir.Model,
    samples: Sequence[dict[str, np.ndarray]],
    plan: QuantPlan,
    max_tensors: int = MAX_ANALYSED_TENSORS,
) -> list[dict[str, Any]]:
    """SQNR of every quantized activation of ``model`` against ``prepared``, worst first
    (of an evenly spaced subset when there are more than ``max_tensors``, logged).

    Each entry: ``tensor``, ``node`` (the plan's node whose output position it is, None for a
    graph input), ``op_type``, ``sqnr_db``, ``drop_db`` (SQNR lost at that node), ``rel_rmse``
    (``sqrt(noise / signal)``). Memory: one sample's tensors at a time, or, for a graph longer
    than one session, one piece's tensors of a group of samples (:func:`_paired_values`).
    """
    if not samples:
        return []
    views = quantized_views(model)
    float_names = {o for n in prepared.graph.node for o in n.output} | {
        i.name for i in prepared.graph.input
    }
    tensors = [t for t in plan.activation_names() if t in views and t in float_names]
    if not tensors:
        return []
    producers: dict[str, tuple[str, str, tuple[str, ...]]] = {}
    for node in plan.nodes:
        if node.output is not None:
            producers.setdefault(node.output, (node.name, node.op_type, node.activation_inputs))
    if len(tensors) > max_tensors:
        tensors = _evenly_spaced(tensors, producers, max_tensors)
    signal = np.zeros(len(tensors))
    noise = np.zeros(len(tensors))
    for i, f_values, q_values in _paired_values(prepared, model, samples, tensors, views):
        for f, q in zip(f_values, q_values, strict=True):
            f64 = np.asarray(f, dtype=np.float64)
            signal[i] += float(np.sum(f64 * f64))
            noise[i] += float(np.sum((np.asarray(q, dtype=np.float64) - f64) ** 2))
    sqnr = {t: sqnr_db(signal[i], noise[i]) for i, t in enumerate(tensors)}
    entries: list[dict[str, Any]] = []
    for i, t in enumerate(tensors):
        node_name, op_type, inputs = producers.get(t, (None, None, ()))
        in_sqnr = [sqnr[x] for x in inputs if x in sqnr]
        drop = (min(in_sqnr) if in_sqnr else SQNR_CAP) - sqnr[t]
        if any(x not in sqnr for x in inputs):
            # an input not measured (left out of a long graph's subset, or not quantized at all:
            # a float island's output) leaves the node's drop unknown
            node_name = None
        entries.append(
            {
                "tensor": t,
                "node": node_name,
                "op_type": op_type,
                "sqnr_db": round(sqnr[t], 3),
                "drop_db": round(drop, 3) if node_name is not None else 0.0,
                "rel_rmse": float(math.sqrt(noise[i] / signal[i])) if signal[i] > 0 else None,
            }
        )
    entries.sort(key=lambda e: e["sqnr_db"])
    return entries


#: Samples run together through the pieces of a graph too long for one session: the values of
#: a piece are held for every sample of the group
# (:func:`quark_onnx.runtime.sessions.run_segments`).
SEGMENT_SAMPLES = 4


def _paired_values(
    prepared: onnx.ModelProto,
    model: ir.Model,
    samples: Sequence[dict[str, np.ndarray]],
    tensors: list[str],
    views: dict[str, str],
) -> Iterator[tuple[int, list[np.ndarray], list[np.ndarray]]]:
    """``(index in tensors, float values, quantized values)`` of each tensor on some samples.

    Both models run through :func:`quark_onnx.runtime.sessions.run_segments` in the same way: one
    session each, sample by sample, or, when either graph is too long for one session, piece by
    piece on groups of :data:`SEGMENT_SAMPLES` samples, the quantized model advanced as far as
    the float one has gone. A value waits only until its counterpart is computed: what is held
    is one sample's tensors, or about a piece's tensors per model for a group.
    """
    from quark_onnx.runtime import sessions

    whole = max(sessions.node_count(prepared), sessions.node_count(model)) <= sessions.SEGMENT_NODES
    groups = (
        [samples]
        if whole
        else [samples[i : i + SEGMENT_SAMPLES] for i in range(0, len(samples), SEGMENT_SAMPLES)]
    )
    index = {t: i for i, t in enumerate(tensors)}
    of_view = {views[t]: t for t in tensors}
    for group in groups:
        float_runs = sessions.run_segments(
            prepared, group, tensors, whole=whole, purpose="error_analysis"
        )
        quant_runs = sessions.run_segments(
            model, group, list(of_view), whole=whole, purpose="error_analysis"
        )
        waiting_f: dict[tuple[str, int], list[np.ndarray]] = {}
        waiting_q: dict[tuple[str, int], list[np.ndarray]] = {}
        for first, got in float_runs:
            waiting_f.update(((t, first), values) for t, values in got.items())
            while any(key not in waiting_q for key in waiting_f):
                more = next(quant_runs, None)
                if more is None:
                    break
                waiting_q.update(((of_view[v], more[0]), values) for v, values in more[1].items())
            for key in [key for key in waiting_f if key in waiting_q]:
                yield index[key[0]], waiting_f.pop(key), waiting_q.pop(key)
        for _ in quant_runs:  # let the last session go
            pass


def _evenly_spaced(
    tensors: list[str],
    producers: dict[str, tuple[str, str, tuple[str, ...]]],
    limit: int,
) -> list[str]:
    """At most ``limit`` of ``tensors`` (plan order), evenly spaced, each with the activation
    inputs of its producer that are among ``tensors``."""
    known = set(tensors)
    stride = -(-2 * len(tensors) // max(limit, 2))  # a picked tensor and its inputs: ~2 each
    chosen: dict[str, None] = {}
    for t in tensors[::stride]:
        if len(chosen) >= limit:
            break
        for x in producers.get(t, (None, None, ()))[2]:
            if x in known:
                chosen[x] = None
        chosen[t] = None
    logger.info(
        "per-layer error analysis: %d of %d quantized tensors measured (every %d-th with its "
        "inputs; onnxruntime sessions with more outputs take too long to build)",
        len(chosen),
        len(tensors),
        stride,
    )
    order = {t: i for i, t in enumerate(tensors)}
    return sorted(chosen, key=order.__getitem__)


def worst_layers(errors: Sequence[dict[str, Any]], k: int) -> list[str]:
    """Names of the ``k`` nodes adding the most error (largest ``drop_db``), for
    ``nodes_to_exclude``. Entries without a node (graph inputs) are not candidates."""
    if k <= 0:
        return []
    ranked = sorted(
        (e for e in errors if e.get("node")),
        key=lambda e: (-float(e.get("drop_db", 0.0)), float(e.get("sqnr_db", 0.0))),
    )
    names: list[str] = []
    for e in ranked:
        if e["node"] not in names:
            names.append(e["node"])
        if len(names) == k:
            break
    return names


def fallback_cost(
    plan: QuantPlan, prepared: onnx.ModelProto, excluded: Iterable[str]
) -> dict[str, int]:
    """What keeping ``excluded`` nodes in float costs on the NPU.

    Quantized nodes of ``plan`` run on the NPU, every other node on the CPU. Counts connected
    NPU partitions (nodes joined by a tensor) and NPU<->CPU boundary edges, for the plan as it is
    and with ``excluded`` moved to the CPU. ``prepared`` is the float model the plan was built on
    (node names as in the plan, ``node_label``).
    """
    from quark_onnx.plan.build import node_label

    nodes = list(ir.serde.deserialize_model(prepared).graph)
    labels = {id(n): node_label(n, i) for i, n in enumerate(nodes)}
    quantized = {n.name for n in plan.nodes}
    skip = {"QuantizeLinear", "DequantizeLinear", "Constant"}
    compute = [n for n in nodes if n.op_type not in skip]

    def count(on_npu: set[str]) -> tuple[int, int]:
        parent = {labels[id(n)]: labels[id(n)] for n in compute if labels[id(n)] in on_npu}

        def find(x: str) -> str:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        edges = 0
        for n in compute:
            a = labels[id(n)]
            for out in n.outputs:
                for b_node in _compute_consumers(out, skip):
                    b = labels.get(id(b_node))
                    if b is None:
                        continue
                    if (a in on_npu) != (b in on_npu):
                        edges += 1
                    elif a in on_npu:
                        parent[find(a)] = find(b)
        return len({find(x) for x in parent}), edges

    before = {labels[id(n)] for n in compute if labels[id(n)] in quantized}
    after = before - set(excluded)
    p0, e0 = count(before)
    p1, e1 = count(after)
    return {
        "npu_nodes_before": len(before),
        "npu_nodes_after": len(after),
        "partitions_before": p0,
        "partitions_after": p1,
        "boundary_edges_before": e0,
        "boundary_edges_after": e1,
    }


def _compute_consumers(value: ir.Value, skip: set[str]) -> list[ir.Node]:
    """Consumers of ``value``, looking through Q/DQ nodes."""
    out: list[ir.Node] = []
    stack = [value]
    seen: set[int] = set()
    while stack:
        v = stack.pop()
        for use in v.uses():
            n = use.node
            if id(n) in seen:
                continue
            seen.add(id(n))
            if n.op_type in skip:
                stack.extend(n.outputs)
            else:
                out.append(n)
    return out
