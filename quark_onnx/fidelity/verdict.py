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
  quantized one on the first calibration samples (:class:`FidelityResult`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from quark_onnx.fidelity.compare import ErrorAccumulator, TensorComparison, json_float

logger = logging.getLogger(__name__)

#: Default thresholds (options ``FidelityMinSQNR`` and ``FidelityMinAgreement``).
DEFAULT_MIN_SQNR_DB = 10.0
DEFAULT_MIN_AGREEMENT = 0.75


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

    @classmethod
    def from_comparison(
        cls,
        comparison: TensorComparison,
        min_sqnr: float,
        min_agree: float,
        *,
        scores_by_decision: bool = True,
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
        return cls(
            name=comparison.name,
            sqnr_db=comparison.sqnr_db,
            cosine=comparison.cosine,
            max_abs_error=comparison.max_abs_error,
            top1_agreement=agreement,
            rows=comparison.rows if agreement is not None else 0,
            faithful=faithful,
        )

    def describe(self) -> str:
        agree = (
            f", top-1 agreement {self.top1_agreement:.3f} ({self.rows} rows)"
            if self.top1_agreement is not None
            else ""
        )
        return f"SQNR {_db(self.sqnr_db)}, cosine {self.cosine:.4f}{agree}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "sqnr_db": json_float(self.sqnr_db),
            "cosine": self.cosine,
            "max_abs_error": self.max_abs_error,
            "top1_agreement": self.top1_agreement,
            "rows": self.rows,
            "faithful": self.faithful,
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
            "min_sqnr_db": self.min_sqnr_db,
            "min_agreement": self.min_agreement,
            "outputs": [o.to_dict() for o in self.outputs],
            "worst_layers": list(self.worst_layers),
        }

    def describe(self) -> str:
        """Every output's fidelity on one line."""
        return "; ".join(f"{o.name}: {o.describe()}" for o in self.outputs)

    def message(self, model: str) -> str:
        """One warning text naming each unfaithful output, its fidelity and the worst layers."""
        bad = "; ".join(f"output {o.name!r}: {o.describe()}" for o in self.unfaithful)
        text = (
            f"{model}: the quantized model does not follow the float model on {self.samples} "
            f"calibration sample(s): {bad} (thresholds: SQNR >= {self.min_sqnr_db:g} dB, score "
            f"vectors top-1 agreement >= {self.min_agreement:g})"
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
) -> list[OutputFidelity]:
    """Per-output fidelity of ``after`` to ``before`` (outputs of the same feeds, run by run).

    ``scores_by_decision=False`` holds score vectors to the SQNR bound as well (a graph pass is
    judged by how much it moves the model, not only by whether decisions flip)."""
    accumulators: dict[str, ErrorAccumulator] = {}
    for ref, got in zip(before, after, strict=True):
        for name, f in ref.items():
            if name not in got or np.shape(got[name]) != np.shape(f):
                continue
            accumulators.setdefault(name, ErrorAccumulator()).update(f, got[name], top1=True)
    return [
        OutputFidelity.from_comparison(
            acc.result(name, name),
            min_sqnr_db,
            min_agreement,
            scores_by_decision=scores_by_decision,
        )
        for name, acc in accumulators.items()
    ]


def _db(value: float) -> str:
    return f"{value:.1f} dB" if math.isfinite(value) else f"{value} dB"
