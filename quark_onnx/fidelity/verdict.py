"""Fidelity: does the quantized model still compute what the float model computes?

"Ready" (the NPU compiler takes the model, :mod:`quark_onnx.check`) and "faithful" (its outputs
still follow the float model's) are separate verdicts. This module measures the second one, on
every graph output, with the metrics of :mod:`quark_onnx.fidelity.compare` (sums over all samples
and elements)::

    SQNR   = 10 log10( sum f^2 / sum (f - q)^2 )      [dB]
    cosine = sum f q / sqrt( sum f^2 * sum q^2 )
    top-1 agreement: share of rows (axis 0) whose argmax is the float model's; only for score
        vectors (:func:`quark_onnx.fidelity.compare.agreement_kind`: [N, C] or [N, C, 1, 1]): an
        argmax over a box list or a feature map is not a decision.

An output is **faithful** when, for a score vector, its top-1 agreement is at least
``min_agreement``, and, for any other output, its SQNR is at least ``min_sqnr_db``. A score vector
is judged by its decision: the logits of per-tensor int8 classifiers that keep their float top-1
within a point measure 10-15 dB, close to any SQNR bound that would catch a broken box or feature
output. The defaults catch an output that no longer carries the float model's signal, not an
ordinary quantization loss: 10 dB is a noise of a third of the signal's RMS, and a top-1
agreement under 0.75 is a classifier that changed its mind on every fourth input. Both are
options (``FidelityMinSQNR``, ``FidelityMinAgreement``).

:func:`compare_runs` compares two runs of the same feeds; it serves two measurements:

* what each numerics-changing graph pass cost (:func:`quark_onnx.pipeline.prepare.run_passes`);
* the fidelity guard of :class:`quark_onnx.ModelQuantizer`: the original float model against the
  quantized one, part by part, on the samples held out from calibration
  (:mod:`quark_onnx.pipeline.guard`, :class:`FidelityResult`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from quark_onnx.fidelity.compare import (
    ErrorAccumulator,
    TensorComparison,
    agreement_kind,
    json_float,
    ordered,
)

logger = logging.getLogger(__name__)

#: Default thresholds (options ``FidelityMinSQNR`` and ``FidelityMinAgreement``).
DEFAULT_MIN_SQNR_DB = 10.0
DEFAULT_MIN_AGREEMENT = 0.75


#: Default score threshold of a decision (option ``FidelityScoreThreshold``): detectors keep a
#: box from about 0.25 on.
DEFAULT_SCORE_THRESHOLD = 0.25


@dataclass(frozen=True)
class PartFidelity:
    """Fidelity of one part of a graph output
    (:class:`~quark_onnx.fidelity.anatomy.OutputPart`), judged by what it is:

    * ``"decisions"`` (a score part): the decisions its scores drive: at every position (the
      part's elements with its class axis taken out) the class whose score is highest, if it is
      at least the threshold. ``agreement`` is the F1 of the quantized model's decisions against
      the float model's (``2 kept / (float + quantized)``); ``kept`` the share of the float
      model's decisions the quantized model also takes. A class decided at more than half of the
      positions is a background class and not counted. The part is faithful when the F1 and
      its SQNR both pass (few samples hold few decisions; scores that no longer follow the
      float ones flip on the next inputs). A part with no float decision is judged by SQNR;
    * ``"top1"`` (a per-sample score vector): the share of samples with the same argmax;
    * ``"argmax"`` (a dense map): the share of positions with the same argmax over the classes,
      and the SQNR (an image or a depth map has the same shape and no decision in its argmax);
    * ``"sqnr"`` (coordinates and every other value): the SQNR.
    """

    label: str
    kind: str
    measure: str
    sqnr_db: float
    agreement: float | None
    decisions: int
    kept: float | None
    faithful: bool

    def describe(self) -> str:
        """``output0[:, 4:84] (scores, Sigmoid): 0 % of 236 float decisions kept ...``; a
        whole output is named ``output 'y'``."""
        name = self.label if "[" in self.label else f"output {self.label!r}"
        return f"{name} ({self.kind}): {self.measured()}"

    def measured(self) -> str:
        """What was measured, in words (without the part's name)."""
        if self.measure == "decisions":
            return (
                f"{_pct(self.kept)} of {self.decisions} float decisions kept "
                f"(F1 {self.agreement:.2f}), SQNR {_db(self.sqnr_db)}"
            )
        if self.measure in ("top1", "argmax"):
            what = "top-1" if self.measure == "top1" else "argmax"
            return f"{what} agreement {self.agreement:.3f}, SQNR {_db(self.sqnr_db)}"
        return f"SQNR {_db(self.sqnr_db)}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "part": self.label,
            "kind": self.kind,
            "measure": self.measure,
            "sqnr_db": json_float(self.sqnr_db),
            "agreement": self.agreement,
            "decisions": self.decisions,
            "kept": self.kept,
            "faithful": self.faithful,
        }


class _PartJudge:
    """Running counts of one output part over the samples (constant memory)."""

    def __init__(self, part: Any, batch: int | None, threshold: float) -> None:
        self.part, self.batch, self.threshold = part, batch, threshold
        self.error = ErrorAccumulator()
        self.measure = "sqnr"
        self.agree = self.rows = 0
        # decisions: per class, float positives, quantized positives, both; positions
        self.positive_f: dict[int, int] = {}
        self.positive_q: dict[int, int] = {}
        self.both: dict[int, int] = {}
        self.positions = 0

    def update(self, f: np.ndarray, q: np.ndarray) -> None:
        # no float64 copies: the accumulator writes its products into one buffer, and argmax
        # and maximum read values in an order-preserving dtype (compare.ordered)
        f, q = self.part.take(np.asarray(f)), self.part.take(np.asarray(q))
        self.error.update(f, q, top1=False)
        f, q = ordered(f), ordered(q)
        part, whole = self.part, self.part.axis is None
        axis = part.class_axis
        if part.kind == "score":
            if part.softmax and axis is not None and self._per_sample(f, axis):
                self._argmax(f, q, axis, "top1")
            else:
                self._decisions(f, q, axis)
        elif whole and agreement_kind(f.shape) == "top1" and self._per_sample(f, None):
            rows = f.shape[0] if f.ndim >= 2 else 1
            self._argmax(f.reshape(rows, -1), q.reshape(rows, -1), 1, "top1")
        elif whole and f.ndim >= 4:
            axis = 1 if axis is None else axis
            if f.shape[axis] >= 2:
                self._argmax(f, q, axis, "argmax")

    def _per_sample(self, f: np.ndarray, axis: int | None) -> bool:
        """One decision per sample: the rows (all axes but the class axis) are the batch."""
        if self.batch is None:
            return False
        sizes = [d for i, d in enumerate(f.shape) if i != axis and d != 1]
        return sizes == [] or sizes == [self.batch] or (axis is None and f.shape[0] == self.batch)

    def _argmax(self, f: np.ndarray, q: np.ndarray, axis: int, measure: str) -> None:
        self.measure = measure
        fa, qa = np.argmax(f, axis=axis), np.argmax(q, axis=axis)
        self.agree += int(np.sum(fa == qa))
        self.rows += int(fa.size)

    def _decisions(self, f: np.ndarray, q: np.ndarray, axis: int | None) -> None:
        self.measure = "decisions"
        if axis is None or f.ndim == 0:
            f2, q2 = f.reshape(-1, 1), q.reshape(-1, 1)
        else:
            f2 = np.moveaxis(f, axis, -1).reshape(-1, f.shape[axis])
            q2 = np.moveaxis(q, axis, -1).reshape(-1, q.shape[axis])
        fc, qc = np.argmax(f2, axis=1), np.argmax(q2, axis=1)
        # the maxima in float64 (exact), compared with the threshold as a float64
        fp = np.max(f2, axis=1).astype(np.float64) >= self.threshold
        qp = np.max(q2, axis=1).astype(np.float64) >= self.threshold
        both = fp & qp & (fc == qc)
        # per class: the float decisions, the quantized ones (by their own class), both agreeing
        for counts, decided in (
            (self.positive_f, fc[fp]),
            (self.positive_q, qc[qp]),
            (self.both, fc[both]),
        ):
            classes, numbers = np.unique(decided, return_counts=True)
            for c, n in zip(classes.tolist(), numbers.tolist(), strict=True):
                counts[c] = counts.get(c, 0) + n
        self.positions += int(f2.shape[0])

    def result(self, min_sqnr: float, min_agree: float, values_too: bool = False) -> PartFidelity:
        sqnr = self.error.result(self.part.label, self.part.label).sqnr_db
        sqnr_ok = not sqnr < min_sqnr
        label, kind = self.part.label, _part_kind(self.part)
        if self.measure == "decisions":
            background = {c for c, n in self.positive_f.items() if n > self.positions / 2}
            fpos = sum(n for c, n in self.positive_f.items() if c not in background)
            qpos = sum(n for c, n in self.positive_q.items() if c not in background)
            both = sum(n for c, n in self.both.items() if c not in background)
            if fpos:
                # the decisions, and the scores themselves: a few samples hold few decisions,
                # and scores that no longer follow the float ones flip on the next inputs
                f1 = 2.0 * both / (fpos + qpos)
                faithful = f1 >= min_agree and sqnr_ok
                return PartFidelity(label, kind, "decisions", sqnr, f1, fpos, both / fpos, faithful)
            return PartFidelity(label, kind, "sqnr", sqnr, None, 0, None, sqnr_ok)
        if self.measure in ("top1", "argmax") and self.rows:
            agreement = self.agree / self.rows
            # a per-sample score vector is judged by its decision (logits of int8 classifiers
            # that keep their top-1 measure 10-15 dB); a dense map by its argmax and its values
            # (the same shape holds segmentation logits and images or depth, whose argmax is
            # no decision)
            # ``values_too`` (a target that names an SQNR): the score vector's values as well
            faithful = agreement >= min_agree and (
                (self.measure == "top1" and not values_too) or sqnr_ok
            )
            return PartFidelity(label, kind, self.measure, sqnr, agreement, 0, None, faithful)
        return PartFidelity(label, kind, "sqnr", sqnr, None, 0, None, sqnr_ok)


def _part_kind(part: Any) -> str:
    """What a part is, in words: scores, or values (the producer's op type)."""
    if part.kind == "score":
        return f"scores, {part.op_type}" if part.op_type else "scores"
    return f"values, {part.op_type}" if part.op_type else "values"


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{100.0 * share:.0f} %"


@dataclass(frozen=True)
class OutputFidelity:
    """Fidelity of one graph output (see the module docstring)."""

    name: str
    sqnr_db: float
    cosine: float
    max_abs_error: float
    top1_agreement: float | None
    rows: int
    faithful: bool
    #: The output's parts judged one by one (:mod:`quark_onnx.fidelity.anatomy`); when given,
    #: the output is faithful when every part is.
    parts: tuple[PartFidelity, ...] = ()

    @classmethod
    def from_comparison(
        cls,
        comparison: TensorComparison,
        min_sqnr: float,
        min_agree: float,
        *,
        scores_by_decision: bool = True,
        parts: Sequence[PartFidelity] = (),
    ) -> OutputFidelity:
        # a top-1 agreement exists for score vectors only (compare.agreement_kind)
        agreement = comparison.top1_agreement
        sqnr_ok = not comparison.sqnr_db < min_sqnr  # NaN is not faithful
        if agreement is None:
            faithful = sqnr_ok
        elif scores_by_decision:
            faithful = agreement >= min_agree
        else:
            faithful = sqnr_ok and agreement >= min_agree
        if parts:
            faithful = all(p.faithful for p in parts)
        return cls(
            name=comparison.name,
            sqnr_db=comparison.sqnr_db,
            cosine=comparison.cosine,
            max_abs_error=comparison.max_abs_error,
            top1_agreement=agreement,
            rows=comparison.rows if agreement is not None else 0,
            faithful=faithful,
            parts=tuple(parts),
        )

    def describe(self) -> str:
        if self.parts:
            return "; ".join(p.describe() for p in self.parts)
        agree = (
            f", top-1 agreement {self.top1_agreement:.3f} ({self.rows} rows)"
            if self.top1_agreement is not None
            else ""
        )
        return f"SQNR {_db(self.sqnr_db)}, cosine {self.cosine:.4f}{agree}"

    @property
    def worst_part(self) -> PartFidelity | None:
        """The first part that is not faithful (None: all are, or no parts)."""
        return next((p for p in self.parts if not p.faithful), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "sqnr_db": json_float(self.sqnr_db),
            "cosine": self.cosine,
            "max_abs_error": self.max_abs_error,
            "top1_agreement": self.top1_agreement,
            "rows": self.rows,
            "faithful": self.faithful,
            "parts": [p.to_dict() for p in self.parts],
        }


@dataclass
class FidelityResult:
    """Per-output fidelity of a quantized model, with the thresholds it was judged by."""

    samples: int
    outputs: list[OutputFidelity]
    min_sqnr_db: float
    min_agreement: float
    #: Filled by the caller when some output is not faithful: the layers that lose the most.
    worst_layers: list[dict[str, Any]] = field(default_factory=list)
    #: Whether ``samples`` were held out from every stage that fits or chooses (the verdict's
    #: samples, option ``FidelityHoldout``), or are calibration samples.
    held_out: bool = False

    @property
    def faithful(self) -> bool:
        return all(o.faithful for o in self.outputs)

    @property
    def unfaithful(self) -> list[OutputFidelity]:
        return [o for o in self.outputs if not o.faithful]

    def to_dict(self) -> dict[str, Any]:
        return {
            "faithful": self.faithful,
            "samples": self.samples,
            "held_out": self.held_out,
            "min_sqnr_db": self.min_sqnr_db,
            "min_agreement": self.min_agreement,
            "outputs": [o.to_dict() for o in self.outputs],
            "worst_layers": list(self.worst_layers),
        }

    @property
    def sample_words(self) -> str:
        """``held-out sample(s)`` or ``calibration sample(s)``."""
        return "held-out sample(s)" if self.held_out else "calibration sample(s)"

    def describe(self) -> str:
        """Every output's fidelity on one line."""
        return "; ".join(f"{o.name}: {o.describe()}" for o in self.outputs)

    def message(self, model: str) -> str:
        """One warning text naming each unfaithful output, its fidelity and the worst layers."""
        bad = "; ".join(_unfaithful_text(o) for o in self.unfaithful)
        text = (
            f"{model}: the quantized model does not follow the float model on {self.samples} "
            f"{self.sample_words}: {bad} (thresholds: SQNR >= {self.min_sqnr_db:g} dB, decision "
            f"and top-1 agreement >= {self.min_agreement:g})"
        )
        if self.worst_layers:
            layers = ", ".join(
                f"{w['node'] or w['tensor']} ({w['op_type']}, {w['drop_db']:+.1f} dB)"
                for w in self.worst_layers
            )
            text += f"; the layers that lose the most: {layers}"
        return text + (
            ". Look at those layers' ranges (LayerErrorAnalysis=True lists every tensor), keep "
            "them float with nodes_to_exclude, or turn off the numerics-changing passes the "
            "report names"
        )


def compare_runs(
    before: Sequence[Mapping[str, np.ndarray]],
    after: Sequence[Mapping[str, np.ndarray]],
    *,
    min_sqnr_db: float = DEFAULT_MIN_SQNR_DB,
    min_agreement: float = DEFAULT_MIN_AGREEMENT,
    scores_by_decision: bool = True,
    parts: Mapping[str, Sequence[Any]] | None = None,
    batches: Sequence[int | None] | None = None,
    score_threshold: float = DEFAULT_SCORE_THRESHOLD,
) -> list[OutputFidelity]:
    """Per-output fidelity of ``after`` to ``before`` (outputs of the same feeds, run by run).

    ``scores_by_decision=False`` holds score vectors to the SQNR bound as well (a graph pass is
    judged by how much it moves the model, not only by whether decisions flip).

    With ``parts`` (:func:`quark_onnx.fidelity.anatomy.anatomy`; an output it does not name is
    one whole part) every output is judged part by part (:class:`PartFidelity`); ``batches`` are
    the feeds' batch sizes (a per-sample score vector has one row per sample)."""
    from quark_onnx.fidelity.anatomy import whole_output

    accumulators: dict[str, ErrorAccumulator] = {}
    judges: dict[str, list[_PartJudge]] = {}
    for i, (ref, got) in enumerate(zip(before, after, strict=True)):
        batch = batches[i] if batches is not None else None
        for name, f in ref.items():
            if name not in got or np.shape(got[name]) != np.shape(f):
                continue
            accumulators.setdefault(name, ErrorAccumulator()).update(f, got[name], top1=True)
            if parts is None:
                continue
            if name not in judges:
                found = parts.get(name) or [whole_output(name)]
                judges[name] = [_PartJudge(part, batch, score_threshold) for part in found]
            for judge in judges[name]:
                judge.batch = batch
                judge.update(f, got[name])
    return [
        OutputFidelity.from_comparison(
            acc.result(name, name),
            min_sqnr_db,
            min_agreement,
            scores_by_decision=scores_by_decision,
            parts=[
                j.result(min_sqnr_db, min_agreement, values_too=not scores_by_decision)
                for j in judges.get(name, [])
            ],
        )
        for name, acc in accumulators.items()
    ]


def _unfaithful_text(output: OutputFidelity) -> str:
    """An unfaithful output in words: its unfaithful parts when it has parts."""
    bad = [p for p in output.parts if not p.faithful]
    if bad:
        return "; ".join(p.describe() for p in bad)
    return f"output {output.name!r}: {output.describe()}"


def _db(value: float) -> str:
    return f"{value:.1f} dB" if math.isfinite(value) else f"{value} dB"
