"""Fidelity repair: when the guard measures an XINT8 output as not faithful, quantize again with
the conservative choices and keep what measures best.

Two choices of the XINT8 flow trade a rare catastrophe for a common gain, and both were seen to
break models no test here had seen:

* **MinMSE weight positions** may clip a weight tensor's largest values. The squared error over
  the weight's values counts a clipped weight like a rounded one, but a clipped weight's error is
  not noise: it shrinks the strongest pattern of its output channel exactly when that pattern is
  present (a text recognizer whose 18,385-class head lost its most frequent class's weights this
  way fell to 1 dB output SQNR; never clipping them: 13.6 dB). ``NonOverflow`` never clips.
* **Bias correction** moves each layer's bias by the mean error measured on the calibration
  samples. Where those samples do not exercise a layer as the model's inputs will (a text
  detector calibrated on images without text), the correction itself becomes the error.

The guard's verdict is a measurement on the user's own samples, so it can decide: each
:class:`Repair` in :func:`candidates` order re-runs positions, Q/DQ insertion and the accuracy
stages on a fresh copy of the prepared float model with the same calibration result, and is
measured like the first attempt. They are tried in order up to the first faithful one.

Then one more attempt adds **second-order rounding** (:func:`with_rounding`: GPTQ-style
rounding of every Conv/Gemm weight, fitted to the float layer output from the quantized inputs;
inside bias correction's walk where that runs) to the best settings so far, also when one was
faithful: the first faithful repair is the most conservative one, not the best (a recognizer
whose never-clipped weights measured 10.02 dB, just past the threshold, measured 11.87 with the
rounding as well). It costs about one more quantization and is off in the preset because it
shrinks a detector's positive scores (``benchmarks/results/rounding_target.md``); on models the
preset leaves unfaithful it raised every one measured (``benchmarks/results/unseen.md``). The
best-measuring attempt (:func:`score`: faithful outputs, then agreement, cosine, SQNR) is kept,
which may be the first.

A faithful result is offered one **refinement** instead (:func:`refinement`, option
``FidelityRefine``): second-order rounding fitted to the float output with each output channel's
gain restored to slope 1 (``FastFinetune`` Target ``"debiased"``: the plain fit attenuates strong
responses, which cost a detector its positive scores). Whether it helps depends on the model
(``benchmarks/results/refinement.md``: person detector 163 -> 182 of 199 float detections, the
PaddleOCR classifier 16.8 -> 15.8 dB), so it is kept only when it measures at least as well on
every output and every measure (SQNR, cosine, top-1 agreement) and better on one
(:func:`dominates`): a faithful model is never traded for one that is worse anywhere the guard
looks. The refinement's rounding and bias correction fit on the kept samples after the guard's,
so that measurement is on samples it was not fitted on (fitted on all of them, the PP-OCRv6 tiny
detector quantized with the snippet's options measured better on the guard's samples and 2 dB
lower on its test images).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from quark_onnx.config.enums import PowerOfTwoMethod
from quark_onnx.errors import QuantizationError
from quark_onnx.model_files.load import to_ir

logger = logging.getLogger("quark_onnx.pipeline.quantizer")


class RepairableRun(Protocol):
    """What a repair reads of a quantizer run and calls on it (the run state of
    :class:`~quark_onnx.pipeline.quantizer.QuantizationRun`, public): the settings, the samples,
    the prepared float model and its calibration, and the stages an attempt runs again."""

    source: str
    report: Any  # QuantizationReport
    qconfig: Any  # QuantizationConfig
    options: Any  # ExtraOptions
    samples: list[dict[str, Any]]
    fidelity_samples: list[dict[str, Any]]
    reference: list[dict[str, Any]] | None
    anatomy: dict[str, list[Any]]  # graph output -> its parts (fidelity.anatomy)
    prepared: Any  # onnx.ModelProto: the float copy calibration read
    external_dir: Any
    calibration: Any
    positions: dict[str, int]
    quantized: dict[str, Any]

    def trial(
        self, qconfig: Any, options: Any, samples: list[dict[str, Any]] | None = None
    ) -> RepairableRun:
        """A run of the same model and calibration with other settings (fresh report)."""
        ...

    def xint8_positions(self, model: Any, plan: Any, result: Any) -> dict[str, int]: ...

    def insert(self, model: Any, plan: Any, parameters: Any) -> dict[str, Any]: ...

    def accuracy(self, model: Any, plan: Any, params: dict[str, Any]) -> dict[str, Any]: ...


__all__ = [
    "Repair",
    "Repairer",
    "apply_settings",
    "candidates",
    "dominates",
    "refinement",
    "repair",
    "score",
    "with_rounding",
]

#: The report fields the stages from positions to the accuracy stages write (a kept attempt's
#: replace the first attempt's).
STAGE_FIELDS = (
    "positions",
    "adjustments",
    "unfixable",
    "range_clips",
    "position_costs",
    "bias_correction",
    "adaround",
)


@dataclass(frozen=True)
class Repair:
    """One conservative variant of the settings: extra options and config fields it changes."""

    label: str
    extra_options: tuple[tuple[str, Any], ...] = ()
    config: tuple[tuple[str, Any], ...] = ()

    def settings(self) -> dict[str, Any]:
        """The changed settings, as the report records them."""
        return {**dict(self.config), **dict(self.extra_options)}


def apply_settings(qconfig: Any, settings: dict[str, Any]) -> None:
    """Write a repair's settings into ``qconfig`` (config fields, else extra options)."""
    for key, value in settings.items():
        if any(f.name == key for f in dataclasses.fields(qconfig)):
            setattr(qconfig, key, value)
        else:
            qconfig.extra_options[key] = value


def candidates(qconfig: Any, options: Any) -> list[Repair]:
    """The repairs that change something for these settings, in the order they are tried."""
    weight_method = PowerOfTwoMethod.coerce(
        options.WeightPositionMethod or qconfig.calibrate_method
    )
    no_clip = (
        (("WeightPositionMethod", "NonOverflow"),)
        if weight_method is PowerOfTwoMethod.MinMSE
        else ()
    )
    no_bias_correction = (("include_bias_correction", False),)
    found = []
    if no_clip:
        found.append(Repair("weights never clipped", extra_options=no_clip))
    if qconfig.include_bias_correction:
        found.append(Repair("no bias correction", config=no_bias_correction))
        if no_clip:
            found.append(
                Repair(
                    "weights never clipped, no bias correction",
                    extra_options=no_clip,
                    config=no_bias_correction,
                )
            )
    return found


def with_rounding(qconfig: Any, options: Any, base: Repair | None) -> Repair | None:
    """``base`` (None: the settings as given) plus second-order rounding; None when the settings
    already round (``include_fast_ft``: the user's choice stands)."""
    if qconfig.include_fast_ft:
        return None
    rounding = {**(options.FastFinetune or {}), "OptimAlgorithm": "gptq"}
    return Repair(
        f"{base.label}, second-order rounding" if base else "second-order rounding",
        extra_options=(*(base.extra_options if base else ()), ("FastFinetune", rounding)),
        config=(*(base.config if base else ()), ("include_fast_ft", True)),
    )


def refinement(qconfig: Any, options: Any) -> Repair | None:
    """The attempt offered to a faithful result: debiased second-order rounding; None when the
    settings already round or ``FidelityRefine`` is off."""
    if qconfig.include_fast_ft or not options.FidelityRefine:
        return None
    rounding = {**(options.FastFinetune or {}), "OptimAlgorithm": "gptq", "Target": "debiased"}
    return Repair(
        "debiased second-order rounding",
        extra_options=(("FastFinetune", rounding),),
        config=(("include_fast_ft", True),),
    )


def dominates(result: Any, first: Any) -> bool:
    """``result`` measures at least as well as ``first`` on every output and measure (SQNR,
    cosine, top-1 agreement where the output has one) and better on at least one; NaN is never
    as good."""
    pairs = list(zip(result.outputs, first.outputs, strict=True))
    measures = [
        (new, old)
        for o, f in pairs
        for new, old in ((o.sqnr_db, f.sqnr_db), (o.cosine, f.cosine))
        + (((o.top1_agreement, f.top1_agreement),) if f.top1_agreement is not None else ())
        + _part_agreements(o, f)
    ]
    if any(new is None or not new >= old for new, old in measures):  # NaN fails >=
        return False
    return any(new > old for new, old in measures)


def _agreement(output: Any) -> float:
    """An output's decisions: its top-1 agreement, or the sum of its parts' agreements (scores
    by their decisions, dense maps by argmax)."""
    parts = [p.agreement for p in getattr(output, "parts", ()) if p.agreement is not None]
    return float(sum(parts)) if parts else (output.top1_agreement or 0.0)


def _part_agreements(new: Any, old: Any) -> tuple[tuple[float, float], ...]:
    """The pairs of part agreements two results of one output both have."""
    pairs = zip(getattr(new, "parts", ()), getattr(old, "parts", ()), strict=False)
    return tuple(
        (n.agreement, o.agreement)
        for n, o in pairs
        if n.agreement is not None and o.agreement is not None
    )


def score(result: Any) -> tuple[int, float, float, float]:
    """Order of fidelity results: more faithful outputs; then the higher sum of agreements
    (score vectors: top-1; score parts: their decisions, :func:`_agreement`); then the higher
    sum of cosines (does each output still follow the float pattern: an output that collapsed
    to zeros measures about 0 dB SQNR, better than a noisy one that still carries the pattern,
    but cosine 0); then the higher sum of SQNR (each within +-100 dB). NaN counts as the worst
    value."""

    def finite(value: float, low: float) -> float:
        return low if value != value else max(low, min(-low, value))

    return (
        sum(o.faithful for o in result.outputs),
        sum(_agreement(o) for o in result.outputs),
        sum(finite(o.cosine, -1.0) for o in result.outputs),
        sum(finite(o.sqnr_db, -100.0) for o in result.outputs),
    )


def repair(
    run: RepairableRun, model: Any, params: Any, plan: Any, first: Any
) -> tuple[Any, Any, Any]:
    """Try :func:`candidates` on ``run`` when its guard found ``first`` not faithful (option
    ``FidelityRepair``), else the :func:`refinement`; return the model, parameters and fidelity
    result kept. The report gets one ``repairs`` entry per attempt, and the kept attempt's stage
    records and settings."""
    report = run.report
    kept = (score(first), model, params, first, None)

    def attempt(
        cand: Repair, better: Callable[[Any], bool] | None = None, held_out: bool = False
    ) -> bool:
        """Try ``cand`` (fitted held out: :func:`_attempt`), keep it if it measures best so far
        (or, with ``better``, if ``better(result)``); whether it is faithful."""
        nonlocal kept
        start = time.perf_counter()
        if held_out:  # recorded with its settings: a recipe rebuilds it on the same samples
            skip = ("AccuracySamplesSkip", len(run.fidelity_samples))
            cand = dataclasses.replace(cand, extra_options=(*cand.extra_options, skip))
        try:
            trial = _attempt(run, plan, cand, held_out=held_out)
        except QuantizationError as exc:  # an attempt that cannot run leaves what was measured
            logger.warning("%s: %s not tried: %s", run.source, cand.label, exc)
            return False
        if trial is None:
            return False
        trial_run, trial_model, trial_params, result = trial
        report.repairs.append(
            {
                "repair": cand.label,
                "settings": cand.settings(),
                "refinement": bool(first.faithful),
                **_fidelity_row(result),
                "seconds": round(time.perf_counter() - start, 4),
            }
        )
        keep = better(result) if better is not None else score(result) > kept[0]
        if keep:
            kept = (score(result), trial_model, trial_params, result, (cand, trial_run))
        return bool(result.faithful)

    if first.faithful:
        refine = refinement(run.qconfig, run.options)
        if refine is not None:
            attempt(refine, better=lambda result: dominates(result, first), held_out=True)
    elif run.options.FidelityRepair:
        any(attempt(cand) for cand in candidates(run.qconfig, run.options))  # to 1st faithful
        best = kept[4][0] if kept[4] is not None else None
        rounding = with_rounding(run.qconfig, run.options, best)
        if rounding is not None:
            attempt(rounding)
    _, model, params, result, chosen = kept
    for entry in report.repairs:
        entry["kept"] = chosen is not None and entry["repair"] == chosen[0].label
    if chosen is None:
        return model, params, result
    cand, trial_run = chosen
    for name in STAGE_FIELDS:
        setattr(report, name, getattr(trial_run.report, name))
    run.positions, run.quantized = trial_run.positions, trial_run.quantized
    report.settings.get("extra_options", {}).update(dict(cand.extra_options))
    report.settings.update(dict(cand.config))
    logger.log(
        logging.INFO if first.faithful else logging.WARNING,
        "%s: fidelity %s: with %s (%s) the outputs measure %s instead of %s; kept",
        run.source,
        "refinement" if first.faithful else "repair",
        cand.label,
        ", ".join(f"{k}={v}" for k, v in cand.settings().items()),
        result.describe(),
        first.describe(),
    )
    return model, params, result


class Repairer:
    """The fidelity guard's repair hook for one quantizer run: after the guard calls it,
    :attr:`model` and :attr:`params` are the ones kept (until then, the run's own)."""

    def __init__(self, run: RepairableRun, model: Any, params: Any, plan: Any) -> None:
        self.run, self.model, self.params, self.plan = run, model, params, plan

    def __call__(self, first: Any) -> tuple[Any, Any]:
        self.model, self.params, result = repair(
            self.run, self.model, self.params, self.plan, first
        )
        return self.model, result


def _attempt(
    run: RepairableRun, plan: Any, cand: Repair, held_out: bool = False
) -> tuple[RepairableRun, Any, Any, Any] | None:
    """Positions, insertion and accuracy stages again with ``cand``'s settings, on a fresh copy
    of the prepared float model; the trial run, its model, parameters and fidelity result.

    ``held_out``: the accuracy stages fit on the kept samples after the guard's (the guard's are
    the first ones), so the guard's measurement of the attempt is on samples it was not fitted
    on; None when no sample is left for the fit."""
    from quark_onnx.pipeline import guard

    samples = None
    if held_out:
        samples = run.samples[len(run.fidelity_samples) :]
        if not samples:
            logger.info(
                "%s: %s not tried: the %d kept calibration samples are all the fidelity guard's "
                "(AccuracySamples > FidelitySamples leaves some to fit on)",
                run.source,
                cand.label,
                len(run.samples),
            )
            return None
    trial = run.trial(
        dataclasses.replace(run.qconfig, **dict(cand.config)),
        dataclasses.replace(run.options, **dict(cand.extra_options)),
        samples,
    )
    guard.materialize(run.prepared, run.external_dir)
    model = to_ir(run.prepared)
    with _quiet():  # the first attempt's warnings were given; the kept one is summarised
        positions = trial.xint8_positions(model, plan, run.calibration)
        params = trial.insert(model, plan, positions)
        params = trial.accuracy(model, plan, params)
        result = guard.measure(
            trial.report,
            run.source,
            model,
            run.fidelity_samples,
            run.reference,
            run.options,
            run.anatomy or None,
        )
    if result is None:
        return None
    return trial, model, params, result


def _fidelity_row(result: Any) -> dict[str, Any]:
    keys = ("name", "sqnr_db", "cosine", "top1_agreement", "faithful", "parts")
    outputs = [o.to_dict() for o in result.outputs]
    return {"faithful": result.faithful, "outputs": [{k: o[k] for k in keys} for o in outputs]}


class _DropWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.WARNING


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Warnings of the stages are not repeated for each attempt. A logger's filter sees only
    what is logged on that logger itself, so every ``quark_onnx`` logger gets one."""
    drop = _DropWarnings()
    loggers = [
        log
        for name, log in logging.Logger.manager.loggerDict.items()
        if isinstance(log, logging.Logger) and name.split(".")[0] == "quark_onnx"
    ]
    for log in loggers:
        log.addFilter(drop)
    try:
        yield
    finally:
        for log in loggers:
            log.removeFilter(drop)
