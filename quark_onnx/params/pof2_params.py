"""Power-of-two (XINT8) parameters from calibration: each tensor's position, then the NPU rules.

* :func:`split_joins` (called by :func:`initial_positions`): the decode tail of a join whose
  parts int8 cannot hold at one position stays float (:mod:`quark_onnx.npu.decode_tail`);
* :func:`initial_positions`: activations from the calibration result (NonOverflow or MinMSE,
  never wider than a folded clip bound), weights and biases from their values; the error curves
  the solver minimises where a rule moves a position;
* :func:`solve`: the positions after :func:`quark_onnx.params.solver.solve_positions`, graph
  outputs capped at their NonOverflow position + :data:`CLIP_CEILING`, the inputs of the ops in
  :data:`ORDER_DECIDING_OPS` at their NonOverflow position (:func:`order_decided`);
* :func:`range_clips`: activations the rules moved to a position that clips their range.
"""

from __future__ import annotations

import math
from typing import Any

import onnx_ir as ir

from quark_onnx.config.enums import PowerOfTwoMethod
from quark_onnx.config.options import ExtraOptions
from quark_onnx.errors import QuantizationError
from quark_onnx.params import pof2

__all__ = [
    "CLIP_CEILING",
    "ORDER_DECIDING_OPS",
    "calibrated_ranges",
    "initial_positions",
    "order_decided",
    "range_clips",
    "solve",
    "split_joins",
]


def initial_positions(
    model: ir.Model,
    plan: Any,
    result: Any,
    method: Any,
    weight_method: Any = None,
    options: ExtraOptions | None = None,
) -> tuple[dict[str, int], dict[str, Any]]:
    """Calibrated activation positions and weight/bias positions, before the NPU rules; and the
    error curves (position -> error) the solver minimises where it must move a position.

    Weights use ``weight_method`` (option ``WeightPositionMethod``; None or '': ``method``)."""
    from quark_onnx.params.strategy import constant_data, constant_values
    from quark_onnx.plan.types import ACTIVATION_EQUALITY_OPS, TensorKind

    if not isinstance(method, PowerOfTwoMethod):
        raise QuantizationError(
            f"calibrate_method {method} does not give power-of-two "
            "scales; XINT8 needs PowerOfTwoMethod.MinMSE or NonOverflow"
        )
    weight_method = PowerOfTwoMethod.coerce(weight_method or method)
    # a join whose parts int8 cannot hold at one position: its decode tail leaves the plan
    # (quark_onnx.npu.decode_tail; option SplitHeterogeneousJoins)
    split_joins(model, plan, result, options)
    positions: dict[str, int] = {}
    errors: dict[str, Any] = {}
    constants = constant_values(model)  # one scan; arrays are read one weight at a time
    for name, spec in plan.tensors.items():
        if spec.kind is TensorKind.ACTIVATION:
            p = result.position(name, method=method, qtype=spec.qtype)
            if spec.range_max is not None:
                # A clip bound folded into Relu (ConvertClipToRelu): never use a range wider
                # than the bound, so the quantized tensor saturates there.
                p = max(p, pof2.position_for_abs_max(spec.range_max, spec.qtype))
            positions[name] = p
            curve = result.error_function(name, spec.qtype)
            if curve is not None:  # histogram methods: the solver then minimises error
                errors[name] = curve
        elif spec.kind is TensorKind.WEIGHT:
            w = constant_data(constants, name)
            positions[name] = pof2.weight_position(w, weight_method, spec.qtype)
            errors[name] = pof2.error_function(w, spec.qtype)
        else:
            positions[name] = pof2.bias_position(constant_data(constants, name))
    for eq in plan.equalities:
        if eq.op_type in ACTIVATION_EQUALITY_OPS and eq.option is None:
            # the activation's output decides (its range cap included): the input's own
            # statistics count values the activation discards
            pre, post = eq.tensors
            positions[pre] = positions[post]
            errors.pop(pre, None)
    return positions, errors


def split_joins(model: ir.Model, plan: Any, result: Any, options: Any = None) -> list[Any]:
    """Keep the decode tail of every heterogeneous join float on the CPU: ``plan`` is amended in
    place (:func:`quark_onnx.npu.decode_tail.split_heterogeneous_joins`); the nodes made float.
    ``options`` default to the plan's."""
    from quark_onnx.npu.decode_tail import split_heterogeneous_joins

    if result is None:
        return []
    options = options if options is not None else plan.options
    return split_heterogeneous_joins(model, plan, calibrated_ranges(plan, result), options)


#: A graph output (and the shared-scale group it is in) starts no higher than its NonOverflow
#: position + 1: at most the top half of its calibrated range is clipped. Outputs are what the
#: user reads (box offsets, scores); MinMSE alone may trade their extremes for resolution.
CLIP_CEILING = 1


#: Ops whose result is decided by which of their input values are the largest: a class picked
#: by ArgMax/TopK, the probabilities of a Softmax (exp makes the largest logits dominate). A
#: position that clips an input's calibrated range makes its top values equal at the clip and
#: changes the decision, while MinMSE, which weighs every element alike, happily trades those
#: few values for resolution on the many small ones (a 1000-class classifier lost 8 points of
#: top-1 so). Their inputs are therefore never clipped: a ceiling at the NonOverflow position.
ORDER_DECIDING_OPS = frozenset({"Softmax", "LogSoftmax", "ArgMax", "ArgMin", "TopK"})

#: Ops through which an order-deciding op still reads its input's extremes: ops that only move
#: values, and ops that are non-decreasing in every input element without mixing channels (a
#: pooled class map: clipping the map's peaks lowers exactly the top logits). A depthwise Conv
#: with non-negative weights (a pool rewritten for the NPU) is one too;
#: any other Conv or a Gemm mixes channels with signed weights: the walk stops there.
_EXTREME_PRESERVING_OPS = frozenset(
    {
        "Flatten", "Reshape", "Squeeze", "Unsqueeze", "Transpose", "Identity",
        "Relu", "LeakyRelu", "Clip", "MaxPool", "AveragePool", "GlobalAveragePool",
        "GlobalMaxPool", "ReduceMean", "ReduceMax",
    }
)  # fmt: skip


def order_decided(model: ir.Model, plan: Any) -> set[str]:
    """The planned activations an op of :data:`ORDER_DECIDING_OPS` reads, directly or through
    :data:`_EXTREME_PRESERVING_OPS` (a classifier's ``Relu -> GlobalAveragePool -> Flatten``
    between its last ``Conv`` and its ``Softmax``)."""
    from quark_onnx.plan.types import TensorKind

    found: set[str] = set()
    for node in model.graph.all_nodes():
        if node.op_type not in ORDER_DECIDING_OPS or not node.inputs:
            continue
        value = node.inputs[0]
        while value is not None:
            spec = plan.tensors.get(value.name)
            if spec is not None and spec.kind is TensorKind.ACTIVATION:
                found.add(value.name)
            producer = value.producer()
            if producer is None or not _preserves_extremes(producer):
                break
            value = producer.inputs[0] if producer.inputs else None
    return found


def _preserves_extremes(node: ir.Node) -> bool:
    if node.op_type in _EXTREME_PRESERVING_OPS:
        return True
    if node.op_type != "Conv" or len(node.inputs) < 2 or node.inputs[1] is None:
        return False
    weight = node.inputs[1].const_value
    if weight is None:
        return False
    w = weight.numpy()
    group = node.attributes.get_int("group", 1)
    # depthwise: one input channel per group and one output per group
    return w.ndim >= 2 and w.shape[1] == 1 and group == w.shape[0] and bool((w >= 0).all())


def calibrated_ranges(plan: Any, result: Any) -> dict[str, tuple[float, int]]:
    """Activation -> (calibrated max |x|, its int8 NonOverflow position)."""
    ranges: dict[str, tuple[float, int]] = {}
    if result is None:
        return ranges
    for name in plan.activation_names():
        spec, observer = plan.tensors[name], result.observer(name)
        peak = max(abs(observer.min), abs(observer.max))
        if spec.range_max is not None:  # a ReLU6 made Relu saturates at its cap on purpose
            peak = min(peak, spec.range_max)
        if math.isfinite(peak) and peak > 0:
            ranges[name] = (peak, pof2.position_for_abs_max(peak, spec.qtype))
    return ranges


def range_clips(
    plan: Any,
    ranges: dict[str, tuple[float, int]],
    chosen: dict[str, int],
    solved: dict[str, int],
) -> list[dict[str, Any]]:
    """Activations the NPU rules moved to a position that clips more than half their range.

    That happens where a rule forces one position on tensors whose ranges differ by more than
    int8 holds (a Concat of box offsets and sigmoid scores, a HardSigmoid output floor). A
    position the tensor's own statistics chose (MinMSE clips long tails on purpose) or a range
    cap is not reported. Each entry names the tensor, the range kept and the range seen."""
    clips = []
    for name, (peak, nonoverflow) in ranges.items():
        p = solved.get(name)
        if p is None or p <= max(chosen.get(name, p), nonoverflow + CLIP_CEILING):
            continue
        kept = pof2.code_range(plan.tensors[name].qtype)[1] * 2.0**-p
        clips.append(
            {
                "tensor": name,
                "position": p,
                "nonoverflow_position": nonoverflow,
                "range_kept": kept,
                "max_abs": peak,
                "message": (
                    f"tensor {name!r} is quantized at position {p} (range +-{kept:.4g}) but its "
                    f"calibrated values reach {peak:.4g} (position {nonoverflow}): the NPU rules "
                    "that tie it to other tensors clip it"
                ),
            }
        )
    return clips


def solve(
    plan: Any,
    positions: dict[str, int],
    errors: dict[str, Any],
    ranges: dict[str, tuple[float, int]],
    options: ExtraOptions,
    unclipped: set[str] | frozenset[str] = frozenset(),
) -> Any:
    """The positions after the NPU rules (:class:`quark_onnx.params.solver.Solution`), each graph
    output (and the shared-scale group it is in) starting no higher than :data:`CLIP_CEILING`
    above its NonOverflow position, each tensor of ``unclipped`` (:func:`order_decided`) no
    higher than its NonOverflow position."""
    from quark_onnx.params.solver import solve_positions

    ceilings = {
        name: p + CLIP_CEILING
        for name, (_, p) in ranges.items()
        if plan.tensors[name].is_graph_output
    }
    for name in unclipped:
        if name in ranges:
            ceilings[name] = min(ceilings.get(name, ranges[name][1]), ranges[name][1])
    return solve_positions(plan, positions, options, errors, ceilings)
