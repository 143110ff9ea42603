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
calibration samples no stage fitted on (after those the accuracy stages fit). ``k`` doubles (1,
2, 4, ...) up to ``MixedPrecisionBudget`` of the plan's activation tensors, then a bisection
between the last miss and the first hit finds the smallest ``k`` that meets the target: about
``2 log2(budget)`` quantizations. If none meets it, the attempt that measures best is kept when
it is better than no promotion, and the verdict says the target is missed.

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
from quark_onnx.pipeline.repair import STAGE_FIELDS
from quark_onnx.plan.types import UnionFind

logger = logging.getLogger("quark_onnx.pipeline.quantizer")

__all__ = [
    "PrecisionSearch",
    "rebuild_settings",
    "search",
    "search_sample_count",
]

#: Samples the ranking runs (each costs one model run per quantized activation).
RANKING_SAMPLES = 8

#: The search's decisions compare attempts a fraction of a dB apart: on the PaddleOCR classifier
#: the attempt that measured best on 16 samples measured 0.6 dB worse than no promotion on 500
#: held-out images. It decides on up to SEARCH_SAMPLES samples within SEARCH_BYTES of inputs.
SEARCH_SAMPLES = 64
SEARCH_BYTES = 256 << 20


def search_sample_count(selection: list[dict[str, Any]]) -> int:
    """How many samples the search decides on: up to :data:`SEARCH_SAMPLES` within
    :data:`SEARCH_BYTES` of inputs, at least as many as the selection samples."""
    if not selection:
        return 0
    size = sum(int(getattr(v, "nbytes", 0)) for v in selection[0].values()) or 1
    return max(len(selection), min(SEARCH_SAMPLES, SEARCH_BYTES // size))


#: The report fields the stages from the plan to the accuracy stages write (a kept attempt's
#: replace the first attempt's): the repair's, and the plan's, which a promotion changes.
_STAGE_FIELDS = ("plan", "float_nodes", *STAGE_FIELDS)


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
        # judged again on samples no stage fitted on: the repair's rounding, fitted on the
        # selection samples, measured 20.9 dB there on the PaddleOCR classifier and 13.8 dB held
        # out, and a search that trusted it never started
        judged = _measure(self.run, self.model)
        result = judged if judged is not None else result
        if not result.faithful:
            self.model, self.params, result = search(
                self.run, self.model, self.params, self.plan, result
            )
        return self.model, result


def _judging(run: Any) -> tuple[list[Any], list[Any]]:
    """The samples (and float reference) the search decides on: the run's search samples,
    else (too few calibration samples) the selection samples."""
    if run.search_samples:
        return run.search_samples, run.search_reference
    return run.fidelity_samples, run.reference


def _measure(run: Any, model: Any, report: Any = None) -> Any:
    """``model`` measured on the search's samples (None when it does not run)."""
    from quark_onnx.pipeline import guard

    samples, reference = _judging(run)
    return guard.measure(
        report if report is not None else run.report,
        run.source,
        model,
        samples,
        reference,
        run.options,
        run.anatomy or None,
    )


def search(run: Any, model: Any, params: Any, plan: Any, first: Any) -> tuple[Any, Any, Any]:
    """Promote the fewest ranked tensors that make ``model`` meet the target (see the module
    docstring); return the model, parameters and fidelity result kept. The report gets
    ``mixed_precision``."""
    found = _Search(run, model, plan)
    met = found.smallest_meeting()
    kept = met if met is not None else found.best_better_than(first)
    return found.keep(kept, met is not None, (model, params, first))


class _Search:
    """The state of one :func:`search`: the ranked candidates, the attempts and the record."""

    def __init__(self, run: Any, model: Any, plan: Any) -> None:
        from quark_onnx.accuracy.contribution import activation_contributions

        self.run, self.start = run, time.perf_counter()
        options = run.options
        self.manual = tuple(options.MixedPrecisionTensors)
        self.plan, self.activations = plan, plan.activation_names()
        self.limit = int(options.MixedPrecisionBudget * len(self.activations))
        judging, reference = _judging(run)
        samples = judging[:RANKING_SAMPLES]
        error, self.shares = activation_contributions(
            model, samples, reference[: len(samples)], run.anatomy or None
        )
        planned = set(self.activations)
        self.ranked = [
            t
            for t, share in sorted(self.shares.items(), key=lambda kv: (-kv[1], kv[0]))
            if share > 0 and t in planned and t not in self.manual
        ][: self.limit]
        self.tried: dict[int, _Attempt] = {}
        self.record: dict[str, Any] = {
            "target": parse_target(options.FidelityTarget).describe(),
            "budget": options.MixedPrecisionBudget,
            "activation_tensors": len(self.activations),
            "ranking": {"samples": len(samples), "error": error, "candidates": len(self.shares)},
            "attempts": [],
        }
        run.report.mixed_precision = self.record

    def attempt(self, count: int) -> _Attempt | None:
        """The model quantized with the first ``count`` ranked tensors promoted, measured."""
        if count in self.tried:
            return self.tried[count]
        begin = time.perf_counter()
        tensors = self.manual + tuple(self.ranked[:count])
        try:
            found = _quantize_with(self.run, tensors)
        except QuarkOnnxError as exc:  # e.g. a tensor the calibration never saw
            logger.warning("%s: promoting %d tensor(s) not tried: %s", self.run.source, count, exc)
            return None
        if found is None:
            return None
        seconds = time.perf_counter() - begin
        self.tried[count] = _Attempt(count, tensors, *found, seconds)
        result = found[-1]
        self.record["attempts"].append(
            {
                "promoted": len(tensors),
                "faithful": result.faithful,
                "measured": result.describe(),
                "seconds": round(seconds, 4),
            }
        )
        return self.tried[count]

    def _meets(self, count: int) -> _Attempt | None:
        current = self.attempt(count)
        return current if current is not None and current.result.faithful else None

    def smallest_meeting(self) -> _Attempt | None:
        """Double the count (1, 2, 4, ... up to the budget) to the first attempt that meets the
        target, then bisect between the last miss and it; None when none meets it."""
        met, miss, count = None, 0, 1
        while self.ranked and met is None:
            count = min(count, len(self.ranked))
            met = self._meets(count)
            if met is None:
                if count >= len(self.ranked):
                    break
                miss, count = count, count * 2
        if met is None:
            return None
        low, high = miss, met.count
        while high - low > 1:
            middle = (low + high) // 2
            found = self._meets(middle)
            low, high, met = (low, middle, found) if found is not None else (middle, high, met)
        return met

    def best_better_than(self, first: Any) -> _Attempt | None:
        """The best-measuring attempt when it measures better than no promotion."""
        from quark_onnx.pipeline import repair

        if not self.tried:
            return None
        best = max(self.tried.values(), key=lambda a: repair.score(a.result))
        return best if repair.score(best.result) > repair.score(first) else None

    def keep(self, kept: _Attempt | None, met: bool, unchanged: tuple[Any, Any, Any]) -> Any:
        """Make ``kept`` the run's model (its stage records, positions and promotions) and
        complete the record; ``unchanged`` (model, parameters, result) when None."""
        run, report, record = self.run, self.run.report, self.record
        first = unchanged[2]
        record["met"] = met
        record["seconds"] = round(time.perf_counter() - self.start, 4)
        if not self.ranked:
            record["note"] = (
                "no tensor to promote: the budget allows none"
                if self.limit < 1
                else "no quantized activation measurably adds to the output error"
            )
        if kept is None:
            record.update(_cost(run, self.plan, self.manual, self.shares, self.activations))
            logger.warning(
                "%s: mixed precision: the target (%s) is not met within MixedPrecisionBudget %g "
                "(%d of %d activation tensors); no promotion measured better (%s)",
                run.source,
                record["target"],
                run.options.MixedPrecisionBudget,
                self.limit,
                len(self.activations),
                first.describe(),
            )
            return unchanged
        for name in _STAGE_FIELDS:
            setattr(report, name, getattr(kept.run.report, name))
        run.positions, run.quantized = kept.run.positions, kept.run.quantized
        run.promoted = dict(kept.plan.promoted)
        report.settings.setdefault("extra_options", {}).update(
            MixedPrecisionTensors=list(kept.tensors)
        )
        record.update(_cost(run, kept.plan, kept.tensors, self.shares, self.activations))
        logger.log(
            logging.INFO if met else logging.WARNING,
            "%s: mixed precision: %d of %d activation tensor(s) promoted to %s %s the target "
            "(%s): %s instead of %s",
            run.source,
            len(kept.tensors),
            len(self.activations),
            record["precision"],
            "meet" if met else "do not meet",
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
    # fitted on the samples the first attempt was fitted on: attempts measured alike compare
    # fairly (fitted apart, each measured lower on the selection than the first attempt, which
    # was fitted on it, and the person detector kept its unrepaired model: 63 % of the float
    # detections held out instead of 75 %)
    extra.update(MixedPrecisionTensors=list(tensors))
    qconfig.extra_options.update(extra)
    options = dataclasses.replace(run.options, **extra)
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
        result = _measure(run, model, trial.report)
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
    groups = UnionFind()
    for i in inside:
        groups.add(labels[i])
    crossing: set[tuple[str, str]] = set()
    for i in inside:
        me = labels[i]
        for name in nodes[i].input:
            if not name or name in constants:
                continue
            src = producer.get(name)
            if src is not None and labels[src] in members:
                groups.union(labels[src], me)
            elif src is None or nodes[src].op_type != "Constant":
                crossing.add(("in", name))
        for name in nodes[i].output:
            if any(labels[r] not in members for r in readers.get(name, [])):
                crossing.add(("out", name))
    return len({groups.find(x) for x in groups.items()}), len(crossing)


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
