"""Mixed precision to a fidelity target: the fewest promoted tensors that make the model faithful.

When the verdict, judged by the ``FidelityTarget`` thresholds, still finds the quantized model
below the target after the repair (:mod:`quark_onnx.pipeline.repair`), the search promotes
activation tensors off 8 bits:

* in a power-of-two (XINT8) plan a promoted tensor is kept float, with its producer and readers,
  on the CPU (Vitis AI's XINT8 compiler takes int8 only): an island whose NPU/CPU transitions
  the report counts;
* in a float-scale plan it takes the 16-bit type of its sign: A16W8 tensors in an A8W8 model,
  the per-tensor mix AMD Quark's ONNX mixed-precision tutorial writes by hand for Ryzen AI.

What to promote is measured. :func:`quark_onnx.accuracy.contribution.activation_contributions`
ranks every quantized activation by the share of the output error that disappears when its
Q/DQ pair alone is left out (one gated session). The ranking only orders the candidates: the
errors of a model do not add up (bias correction fitted around a tensor, errors that cancel), so
each step quantizes the model again with the first ``k`` ranked tensors promoted (plan, NPU
rules, positions, insertion and the accuracy stages from the same calibration) and measures it on
the selection samples. ``k`` doubles (1, 2, 4, ...) up to ``MixedPrecisionBudget`` of the plan's
activation tensors, then a bisection between the last miss and the first hit finds the smallest
``k`` that meets the target: about ``2 log2(budget)`` quantizations. If none meets it, the
attempt that measures best is kept when it is better than no promotion, and the verdict says the
target is missed.

The promotions are the option ``MixedPrecisionTensors`` (what a user may also list by hand): the
recipe of the run (:attr:`~quark_onnx.pipeline.quantizer.ModelQuantizer.config_in_force`)
rebuilds the same model from the list, without searching. The written model records each
promoted tensor and its float nodes in its metadata (:mod:`quark_onnx.npu.placement`): the
readiness check takes those nodes as intended, not as findings.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

from quark_onnx.errors import QuarkOnnxError
from quark_onnx.fidelity.target import parse_target
from quark_onnx.model_files.load import to_ir

logger = logging.getLogger("quark_onnx.pipeline.quantizer")

__all__ = [
    "PrecisionSearch",
    "rebuild_settings",
    "search",
]

#: Selection samples the ranking runs (each costs one model run per quantized activation).
RANKING_SAMPLES = 8

#: The report fields the stages from the plan to the accuracy stages write (a kept attempt's
#: replace the first attempt's).
_STAGE_FIELDS = (
    "plan",
    "float_nodes",
    "positions",
    "adjustments",
    "unfixable",
    "range_clips",
    "position_costs",
    "bias_correction",
    "adaround",
)


@dataclass
class _Attempt:
    """One quantization with the first ``count`` ranked tensors promoted."""

    count: int
    tensors: tuple[str, ...]
    run: Any
    model: Any
    params: Any
    plan: Any
    result: Any
    seconds: float


class PrecisionSearch:
    """The guard's hook when a ``FidelityTarget`` is set: the repair first (when given), then
    :func:`search` if the target is still missed. :attr:`model` and :attr:`params` are the ones
    kept."""

    def __init__(self, run: Any, model: Any, params: Any, plan: Any, repairer: Any = None) -> None:
        self.run, self.model, self.params, self.plan = run, model, params, plan
        self.repairer = repairer

    def __call__(self, first: Any) -> tuple[Any, Any]:
        result = first
        if self.repairer is not None:
            self.model, result = self.repairer(first)
            self.params = self.repairer.params
        if not result.faithful:
            self.model, self.params, result = search(
                self.run, self.model, self.params, self.plan, result
            )
        return self.model, result


def search(run: Any, model: Any, params: Any, plan: Any, first: Any) -> tuple[Any, Any, Any]:
    """Promote the fewest ranked tensors that make ``model`` meet the target (see the module
    docstring); return the model, parameters and fidelity result kept. The report gets
    ``mixed_precision``."""
    from quark_onnx.accuracy.contribution import activation_contributions
    from quark_onnx.pipeline import repair

    start = time.perf_counter()
    options, report = run.options, run.report
    manual = tuple(options.MixedPrecisionTensors)
    activations = plan.activation_names()
    limit = int(options.MixedPrecisionBudget * len(activations))
    samples = run.fidelity_samples[:RANKING_SAMPLES]
    error, shares = activation_contributions(
        model, samples, run.reference[: len(samples)], run.anatomy or None
    )
    planned = set(activations)
    ranked = [
        t
        for t, share in sorted(shares.items(), key=lambda kv: (-kv[1], kv[0]))
        if share > 0 and t in planned and t not in manual
    ][:limit]
    record: dict[str, Any] = {
        "target": parse_target(options.FidelityTarget).describe(),
        "budget": options.MixedPrecisionBudget,
        "activation_tensors": len(activations),
        "ranking": {"samples": len(samples), "error": error, "candidates": len(shares)},
        "attempts": [],
    }
    report.mixed_precision = record
    tried: dict[int, _Attempt] = {}

    def attempt(count: int) -> _Attempt | None:
        if count in tried:
            return tried[count]
        begin = time.perf_counter()
        tensors = manual + tuple(ranked[:count])
        try:
            found = _quantize_with(run, tensors)
        except QuarkOnnxError as exc:  # e.g. a tensor the calibration never saw
            logger.warning("%s: promoting %d tensor(s) not tried: %s", run.source, count, exc)
            return None
        if found is None:
            return None
        trial, trial_model, trial_params, trial_plan, result = found
        tried[count] = _Attempt(
            count,
            tensors,
            trial,
            trial_model,
            trial_params,
            trial_plan,
            result,
            time.perf_counter() - begin,
        )
        record["attempts"].append(
            {
                "promoted": len(tensors),
                "faithful": result.faithful,
                "measured": result.describe(),
                "seconds": round(time.perf_counter() - begin, 4),
            }
        )
        return tried[count]

    met: _Attempt | None = None
    miss = 0
    count = 1
    while ranked:
        current = attempt(min(count, len(ranked)))
        if current is not None and current.result.faithful:
            met = current
            break
        miss = min(count, len(ranked))
        if count >= len(ranked):
            break
        count *= 2
    if met is not None:
        low, high = miss, met.count
        while high - low > 1:  # the smallest count that meets the target
            middle = (low + high) // 2
            current = attempt(middle)
            if current is not None and current.result.faithful:
                high, met = middle, current
            else:
                low = middle
    kept = met
    if kept is None and tried:
        best = max(tried.values(), key=lambda a: repair.score(a.result))
        kept = best if repair.score(best.result) > repair.score(first) else None
    record["met"] = met is not None
    record["seconds"] = round(time.perf_counter() - start, 4)
    if not ranked:
        record["note"] = (
            "no tensor to promote: the budget allows none"
            if limit < 1
            else "no quantized activation measurably adds to the output error"
        )
    if kept is None:
        record.update(_cost(run, plan, manual, shares, activations))
        logger.warning(
            "%s: mixed precision: the target (%s) is not met within MixedPrecisionBudget %g "
            "(%d of %d activation tensors); no promotion measured better (%s)",
            run.source,
            record["target"],
            options.MixedPrecisionBudget,
            limit,
            len(activations),
            first.describe(),
        )
        return model, params, first
    for name in _STAGE_FIELDS:
        setattr(report, name, getattr(kept.run.report, name))
    run.positions, run.quantized = kept.run.positions, kept.run.quantized
    run.promoted = dict(kept.plan.promoted)
    report.settings.setdefault("extra_options", {})["MixedPrecisionTensors"] = list(kept.tensors)
    record.update(_cost(run, kept.plan, kept.tensors, shares, activations))
    logger.log(
        logging.INFO if met is not None else logging.WARNING,
        "%s: mixed precision: %d of %d activation tensor(s) promoted to %s %s the target (%s): "
        "%s instead of %s",
        run.source,
        len(kept.tensors),
        len(activations),
        record["precision"],
        "meet" if met is not None else "do not meet",
        record["target"],
        kept.result.describe(),
        first.describe(),
    )
    return kept.model, kept.params, kept.result


def _quantize_with(run: Any, tensors: tuple[str, ...]) -> tuple[Any, ...] | None:
    """The stages from the plan on, again, on a fresh copy of the prepared float model, with
    ``tensors`` promoted and the settings the repair kept; None when the model does not run."""
    from quark_onnx.pipeline import guard, repair
    from quark_onnx.plan.build import build_plan

    qconfig = copy.deepcopy(run.qconfig)
    extra: dict[str, Any] = {}
    for entry in run.report.repairs:
        if entry.get("kept"):
            repair.apply_settings(qconfig, entry["settings"])
            extra.update({k: v for k, v in entry["settings"].items() if hasattr(run.options, k)})
    qconfig.extra_options["MixedPrecisionTensors"] = list(tensors)
    options = dataclasses.replace(run.options, **extra, MixedPrecisionTensors=list(tensors))
    trial = run.trial(qconfig, options)
    guard.materialize(run.prepared, run.external_dir)
    model = to_ir(run.prepared)
    with repair._quiet():  # the first attempt's warnings were given
        plan = build_plan(model, qconfig, options)
        params = trial.scales(model, plan, run.calibration)
        params = trial.insert(model, plan, params)
        params = trial.accuracy(model, plan, params)
        trial.report.plan = {**plan.summary(), **trial.report.plan}
        trial.report.float_nodes = [
            {"node": f.name, "op_type": f.op_type, "reason": f.reason} for f in plan.float_nodes
        ]
        result = guard.measure(
            trial.report,
            run.source,
            model,
            run.fidelity_samples,
            run.reference,
            options,
            run.anatomy or None,
        )
    if result is None:
        return None
    return trial, model, params, plan, result


def _cost(
    run: Any,
    plan: Any,
    tensors: tuple[str, ...],
    shares: dict[str, float],
    activations: list[str],
) -> dict[str, Any]:
    """What the promotions cost: each tensor with its measured share of the output error and its
    float nodes, the share of the activation tensors promoted, the CPU islands and transitions."""
    promoted = dict(plan.promoted) if tensors else {}
    precision = "float (CPU)" if run.power_of_two else "16-bit"
    entry = {
        "precision": precision,
        "promoted": [
            {
                "tensor": t,
                "error_share": round(shares[t], 4) if t in shares else None,
                "nodes": list(promoted.get(t, ())),
            }
            for t in tensors
        ],
        "fraction": round(len(tensors) / len(activations), 4) if activations else 0.0,
    }
    if run.power_of_two:
        islands, transitions = _islands(run.prepared, promoted)
        entry.update(islands=islands, transitions=transitions)
    return entry


def _islands(prepared: Any, promoted: dict[str, tuple[str, ...]]) -> tuple[int, int]:
    """Connected groups of the nodes kept float, and the tensors crossing between them and the
    NPU (each a DequantizeLinear into an island or a QuantizeLinear out of one)."""
    members = {n for nodes in promoted.values() for n in nodes}
    if not members:
        return 0, 0
    nodes = list(prepared.graph.node)
    labels = [node_label_proto(n) for n in nodes]
    producer = {o: i for i, n in enumerate(nodes) for o in n.output}
    readers: dict[str, list[int]] = {}
    for i, n in enumerate(nodes):
        for name in n.input:
            readers.setdefault(name, []).append(i)
    constants = {t.name for t in prepared.graph.initializer}
    inside = [i for i, label in enumerate(labels) if label in members]
    parent = {labels[i]: labels[i] for i in inside}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    crossing: set[tuple[str, str]] = set()
    for i in inside:
        me = labels[i]
        for name in nodes[i].input:
            if not name or name in constants:
                continue
            src = producer.get(name)
            if src is not None and labels[src] in members:
                parent[find(labels[src])] = find(me)
            elif src is None or nodes[src].op_type != "Constant":
                crossing.add(("in", name))
        for name in nodes[i].output:
            if any(labels[r] not in members for r in readers.get(name, [])):
                crossing.add(("out", name))
    return len({find(x) for x in parent}), len(crossing)


def node_label_proto(node: Any) -> str:
    """A NodeProto's label as the readiness checker names it (its name, else its first
    output's)."""
    return node.name or (node.output[0] if node.output else f"<unnamed {node.op_type}>")


def rebuild_settings(report: Any, options: Any) -> dict[str, Any]:
    """The extra options that rebuild a searched model: the promoted tensors as a list, no
    search, no repair choosing again, and the thresholds the verdict used."""
    record = report.mixed_precision
    tensors = [e["tensor"] for e in record.get("promoted", [])] if record.get("target") else None
    if tensors is None:
        return {}
    return {
        "MixedPrecisionTensors": tensors,
        "FidelityTarget": "",
        "FidelityRepair": False,
        "FidelityMinSQNR": options.FidelityMinSQNR,
        "FidelityMinAgreement": options.FidelityMinAgreement,
    }
