"""How much of the output error each activation's quantization causes, measured.

The mixed-precision search (:mod:`quark_onnx.pipeline.mixed_precision`) promotes the tensors
whose quantization costs the output most. That cost is measured, not estimated: one session runs
the quantized model with every activation's QuantizeLinear/DequantizeLinear pair behind a gate,
``y = x + g * (DQ(Q(x)) - x)``, ``g`` a graph input (1: quantized, as written; 0: float). With
all gates at 1 it computes the quantized model's outputs exactly (``x + (q - x)`` is ``q`` up to
float rounding); opening one gate at a time measures what that tensor's quantization alone adds
to the output error, every other tensor quantized as in the model. One session serves all the
tensors, so the cost is ``tensors x samples`` runs of the model and no session per tensor.

The error is counted part by part (:mod:`quark_onnx.fidelity.anatomy`): each output part's
noise over its signal, summed over the parts, so a score part small beside its output's box
coordinates weighs as much as they do (the verdict judges each part on its own).

What a gate measures is the tensor's error with the rest of the model as it is: bias correction
fitted around it stays. The search therefore uses the ranking only to choose what to try, and
measures each promotion on a model quantized again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import helper

__all__ = ["activation_contributions", "activation_pairs"]

_GATE_SUFFIX = "__mixed_precision_gate"


def activation_pairs(model: onnx.ModelProto) -> dict[str, tuple[int, int]]:
    """Quantized activation -> (index of its QuantizeLinear, of its DequantizeLinear) in
    ``model.graph.node``: the pairs whose QuantizeLinear reads a tensor that is not a constant."""
    constants = {i.name for i in model.graph.initializer}
    constants |= {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    producer = {o: i for i, n in enumerate(model.graph.node) for o in n.output}
    pairs: dict[str, tuple[int, int]] = {}
    for i, node in enumerate(model.graph.node):
        if node.op_type != "DequantizeLinear" or not node.input:
            continue
        q = producer.get(node.input[0])
        if q is None:
            continue
        q_node = model.graph.node[q]
        if q_node.op_type != "QuantizeLinear" or q_node.input[0] in constants:
            continue
        pairs.setdefault(q_node.input[0], (q, i))
    return pairs


def _gate(model: onnx.ModelProto, tensors: Sequence[str]) -> dict[str, str]:
    """Put each of ``tensors``' Q/DQ pairs behind a gate input (in place); tensor -> gate name."""
    pairs = activation_pairs(model)
    gates: dict[str, str] = {}
    added = []
    for k, tensor in enumerate(tensors):
        _, dq = pairs[tensor]
        dq_node = model.graph.node[dq]
        out = dq_node.output[0]
        quantized = f"{out}{_GATE_SUFFIX}_q"
        dq_node.output[0] = quantized
        gate = f"{_GATE_SUFFIX}_{k}"
        diff, scaled = f"{out}{_GATE_SUFFIX}_d", f"{out}{_GATE_SUFFIX}_s"
        added += [
            helper.make_node("Sub", [quantized, tensor], [diff]),
            helper.make_node("Mul", [diff, gate], [scaled]),
            helper.make_node("Add", [tensor, scaled], [out]),
        ]
        model.graph.input.append(helper.make_tensor_value_info(gate, onnx.TensorProto.FLOAT, []))
        gates[tensor] = gate
    model.graph.node.extend(added)
    _sort_topologically(model.graph)
    return gates


def _sort_topologically(graph: onnx.GraphProto) -> None:
    """Reorder ``graph.node`` so every node follows its inputs' producers (the gates' nodes were
    appended at the end)."""
    available = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    pending = list(graph.node)
    ordered: list[onnx.NodeProto] = []
    while pending:
        rest = []
        for node in pending:
            if all(name in available for name in node.input):
                ordered.append(node)
                available.update(node.output)
            else:
                rest.append(node)
        if len(rest) == len(pending):  # a node reading something never produced: keep order
            ordered += rest
            break
        pending = rest
    del graph.node[:]
    graph.node.extend(ordered)


def activation_contributions(
    model: Any,
    samples: Sequence[Mapping[str, np.ndarray]],
    reference: Sequence[Mapping[str, np.ndarray]],
    parts: Mapping[str, Sequence[Any]] | None = None,
    tensors: Sequence[str] | None = None,
) -> tuple[float, dict[str, float]]:
    """The quantized ``model``'s (an ``ir.Model``) error on ``samples`` against ``reference``
    (the float model's outputs), and per quantized activation the share of that error that
    disappears when it alone is left float (negative: its quantization happened to cancel other
    errors). ``tensors``: the activations to measure (default: every quantized one).

    Returns:
        (error, {tensor: share}): the error is the sum over output parts of noise / signal.
    """
    from quark_onnx.runtime import sessions

    chosen: list[str] = []
    gates: dict[str, str] = {}  # tensor -> its gate input, filled when the session is built

    def edit(proto: onnx.ModelProto) -> None:
        pairs = activation_pairs(proto)
        chosen.extend(t for t in (tensors if tensors is not None else pairs) if t in pairs)
        gates.update(_gate(proto, chosen))

    session = sessions.create_session(model, purpose="contributions", edit=edit)
    names = [o.name for o in session.get_outputs()]
    one, zero = np.ones((), np.float32), np.zeros((), np.float32)

    def error(open_gate: str | None) -> float:
        noise: dict[tuple[str, int], float] = {}
        signal: dict[tuple[str, int], float] = {}
        for feed, ref in zip(samples, reference, strict=True):
            run = {**feed, **{g: (zero if g == open_gate else one) for g in gates.values()}}
            outputs = dict(zip(names, session.run(names, run), strict=True))
            for name, f in ref.items():
                if name not in outputs or np.shape(outputs[name]) != np.shape(f):
                    continue
                q = np.asarray(outputs[name], np.float64)
                f64 = np.asarray(f, np.float64)
                found = (parts or {}).get(name) or [None]
                for k, part in enumerate(found):
                    fp = part.take(f64) if part is not None else f64
                    qp = part.take(q) if part is not None else q
                    noise[(name, k)] = noise.get((name, k), 0.0) + float(np.sum((qp - fp) ** 2))
                    signal[(name, k)] = signal.get((name, k), 0.0) + float(np.sum(fp**2))
        return float(sum(n / max(signal[key], 1e-30) for key, n in noise.items()))

    base = error(None)
    if base <= 0.0:
        return base, {t: 0.0 for t in chosen}
    return base, {t: (base - error(gates[t])) / base for t in chosen}
