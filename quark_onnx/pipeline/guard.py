"""The fidelity guard: the quantized model's outputs against the float model's.

The reference is the model the user gave, before any pass (:func:`reference_outputs`), so the
cost of the numerics-changing passes counts. Two sets of samples serve it (:class:`Evidence`):

* the **selection** samples, the first calibration samples: the repair and the refinement choose
  between attempts on them (:mod:`quark_onnx.pipeline.repair`);
* the **verdict** samples, held out from the calibration data before anything reads it
  (:meth:`quark_onnx.calibration.sources.CalibrationSource.hold_out`): no stage fits ranges,
  biases or rounding on them and no choice is made on them, so the verdict measures what the
  user's unseen inputs will meet. Without them (``FidelityHoldout=0``, or too few samples) the
  verdict is the selection samples' and says so.

Every output is judged part by part (:mod:`quark_onnx.fidelity.anatomy`,
:mod:`quark_onnx.fidelity`). :func:`guard_fidelity` warns (or, with ``RequireFidelity``, raises)
when a part is not faithful, naming it and the tensors whose SQNR drops the most
(:func:`worst_layers`, the per-layer error analysis).

Memory: the guard holds one sample's outputs at a time. The quantized model runs sample by
sample into the comparison's running sums (:func:`quark_onnx.fidelity.verdict.compare_runs`);
the reference outputs, needed again by every measurement, are a :class:`RunStore`, written to
files once they pass :data:`REFERENCE_MEMORY_BYTES` (the verdict of a 1x16x1000x1000 output on
16 samples: 3.0 GB peak before, 0.9 GB after; ``bench_stage_cost.py``, case ``wide1000``).
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

import numpy as np
import onnx

from quark_onnx.config.enums import QuantType
from quark_onnx.config.options import ExtraOptions
from quark_onnx.errors import ConfigError, FidelityError
from quark_onnx.model_files import external
from quark_onnx.model_files.files import private_temp_folder

if TYPE_CHECKING:
    import onnx_ir as ir

    from quark_onnx.fidelity.verdict import FidelityResult
    from quark_onnx.pipeline.report import QuantizationReport

# the quantizer's stages report through the quantizer's logger
logger = logging.getLogger("quark_onnx.pipeline.quantizer")

__all__ = [
    "Evidence",
    "RunStore",
    "guard_fidelity",
    "materialize",
    "measure",
    "output_anatomy",
    "reference_outputs",
    "worst_layers",
]

#: Fewer held-out samples than this make a coarse verdict: a warning says so.
MIN_VERDICT_SAMPLES = 8


@dataclass(frozen=True)
class Evidence:
    """The samples the guard measures on, with the original model's outputs on them."""

    selection: list[dict[str, np.ndarray]]
    selection_reference: Sequence[dict[str, np.ndarray]]
    verdict: list[dict[str, np.ndarray]] = field(default_factory=list)
    verdict_reference: Sequence[dict[str, np.ndarray]] = field(default_factory=list)
    #: graph output -> its parts (:func:`output_anatomy`); empty: whole outputs
    anatomy: dict[str, list[Any]] = field(default_factory=dict)


def output_anatomy(model: ir.Model, sample: dict[str, np.ndarray]) -> dict[str, list[Any]]:
    """The parts of ``model``'s outputs (:mod:`quark_onnx.fidelity.anatomy`), their shapes read
    from one float run on ``sample``; empty when the model cannot be traced or run."""
    from quark_onnx.fidelity.anatomy import anatomy
    from quark_onnx.runtime import sessions

    def run(names: list[str]) -> dict[str, np.ndarray]:
        return sessions.run_outputs(model, [sample], outputs=names, purpose="anatomy")[0]

    return anatomy(model, run)


def reference_outputs(
    source: str, model: ir.Model, samples: list[dict[str, np.ndarray]], options: ExtraOptions
) -> Sequence[dict[str, np.ndarray]] | None:
    """The loaded model's outputs on ``samples`` (None: no samples, guard off, or onnxruntime
    cannot run them; calibration then reports a bad feed by name), kept as a :class:`RunStore`:
    in memory while small, in files beyond :data:`REFERENCE_MEMORY_BYTES`."""
    if not samples or not options.FidelityCheck:
        return None
    store = RunStore()
    try:
        for outputs in _runs(model, samples):
            store.append(outputs)
    except _RunFailed as exc:
        logger.warning("%s: fidelity not measured: the model does not run: %s", source, exc)
        return None
    return store


#: Bytes of reference outputs kept in memory; the store writes every run to a file beyond
#: (a 1x16x1000x1000 output is 64 MB a sample: the 32 samples of the guard held 2 GB).
REFERENCE_MEMORY_BYTES = 64 * 2**20


class RunStore(Sequence[dict[str, np.ndarray]]):
    """Runs (``{output: array}``, one per sample) in memory up to
    :data:`REFERENCE_MEMORY_BYTES`, then all of them in ``.npy`` files of a private temporary
    folder, read back one run at a time when indexed (the values are the same bits). A slice is
    a store over the same files. The folder goes with the last store that uses it."""

    def __init__(self, memory_bytes: int | None = None) -> None:
        #: per run, its arrays, or ``(output, file or array)`` pairs once spilled
        self._runs: list[Any] = []
        self._memory_bytes = REFERENCE_MEMORY_BYTES if memory_bytes is None else memory_bytes
        self._held = 0
        self._folder: tempfile.TemporaryDirectory[str] | None = None

    def append(self, run: dict[str, np.ndarray]) -> None:
        self._held += sum(np.asarray(v).nbytes for v in run.values())
        if self._folder is None and self._held > self._memory_bytes:
            try:
                self._folder = private_temp_folder("reference")
            except OSError as exc:  # no room for a folder: kept in memory, as before the store
                logger.info("reference outputs kept in memory: %s", exc)
                self._memory_bytes = 1 << 62
            else:
                self._runs = [self._spill(r, i) for i, r in enumerate(self._runs)]
        self._runs.append(self._spill(run, len(self._runs)) if self._folder is not None else run)

    def _spill(self, run: dict[str, np.ndarray], index: int) -> Any:
        """The run's files (a value numpy cannot write without pickling stays an array); the
        run itself when the files cannot be written (a full disk)."""
        assert self._folder is not None
        spilled: list[tuple[str, Any]] = []
        try:
            for name, value in run.items():
                value = np.asarray(value)
                if value.dtype.hasobject:
                    spilled.append((name, value))
                    continue
                path = os.path.join(self._folder.name, f"{index}_{len(spilled)}.npy")
                np.save(path, value, allow_pickle=False)
                spilled.append((name, path))
        except OSError as exc:
            logger.info("a reference run kept in memory: %s", exc)
            return run
        return spilled

    def __len__(self) -> int:
        return len(self._runs)

    @overload
    def __getitem__(self, index: int) -> dict[str, np.ndarray]: ...

    @overload
    def __getitem__(self, index: slice) -> RunStore: ...

    def __getitem__(self, index: int | slice) -> dict[str, np.ndarray] | RunStore:
        if isinstance(index, slice):
            part = RunStore(self._memory_bytes)
            part._runs, part._folder, part._held = self._runs[index], self._folder, self._held
            return part
        run = self._runs[index]
        if isinstance(run, dict):
            return run
        return {
            name: np.load(where, allow_pickle=False) if isinstance(where, str) else where
            for name, where in run
        }


class _RunFailed(Exception):
    """onnxruntime could not run the model (its first line)."""


def _runs(model: Any, samples: Sequence[dict[str, np.ndarray]]) -> Iterator[dict[str, np.ndarray]]:
    """``model``'s graph outputs on each sample, one sample at a time (the values of
    :func:`quark_onnx.pipeline.prepare.run_model`: the same session options but the arena,
    which would keep the buffers of the largest run, e.g. a dequantized 100 MB weight, for the
    session's life). A model too long for one session runs in pieces over all samples
    (:func:`quark_onnx.runtime.sessions.run_segments`): its runs come at the end. onnxruntime's
    failures are raised as :class:`_RunFailed`."""
    from quark_onnx.runtime import sessions

    if isinstance(model, onnx.ModelProto):
        names = [o.name for o in model.graph.output]
    else:
        names = [v.name for v in model.graph.outputs]
    names = list(dict.fromkeys(names))
    pending: dict[int, dict[str, np.ndarray]] = {}
    ready = 0
    options = sessions.session_options(arena=False)
    try:
        pieces = sessions.run_segments(model, samples, names, options=options, purpose="run_model")
        for first, got in pieces:
            for name, values in got.items():
                for j, value in enumerate(values):
                    pending.setdefault(first + j, {})[name] = value
            while len(pending.get(ready, ())) == len(names) and ready < len(samples):
                run = pending.pop(ready)
                ready += 1
                yield {n: run[n] for n in names}
    except Exception as exc:  # onnxruntime raises its own exception types
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise _RunFailed(first_line) from exc


def guard_fidelity(
    report: QuantizationReport,
    source: str,
    model: Any,
    evidence: Evidence,
    stages: tuple[onnx.ModelProto, Any, Path | None],
    options: ExtraOptions,
    repair: Callable[[FidelityResult], tuple[Any, FidelityResult]] | None = None,
) -> Any:
    """Judge every output against the original float model; warn (or raise) if unfaithful.

    The reference is the model the user gave, before any pass: the cost of the
    numerics-changing passes counts. ``repair`` (when given) may replace the model after a
    measurement on the selection samples (:mod:`quark_onnx.pipeline.repair`); the verdict is
    then measured on the held-out samples. When a part is not faithful, the per-layer error
    analysis of the model kept (the tensors whose SQNR drops the most) names where it is lost.
    Returns the model kept.
    """
    parts = evidence.anatomy or None
    selection = None
    if repair is not None or not evidence.verdict:
        # measured on the selection samples only where something chooses on them (the repair,
        # the refinement) or nothing was held out
        selection = measure(
            report, source, model, evidence.selection, evidence.selection_reference, options, parts
        )
        if selection is None:
            return model
        if repair is not None:  # a repair when not faithful, else a refinement (fidelity_repair)
            model, selection = repair(selection)
    result = selection
    if evidence.verdict:
        result = measure(
            report,
            source,
            model,
            evidence.verdict,
            evidence.verdict_reference,
            options,
            parts,
            held_out=True,
        )
        if result is None:
            return model
        if len(evidence.verdict) < MIN_VERDICT_SAMPLES:
            logger.warning(
                "%s: the fidelity verdict rests on %d held-out sample(s) only: give more "
                "calibration data (FidelityHoldout takes up to a quarter of it)",
                source,
                len(evidence.verdict),
            )
    elif options.FidelityHoldout > 0:
        logger.warning(
            "%s: too few calibration samples to hold any out: the fidelity verdict is measured "
            "on %d sample(s) the quantizer fitted on, and may be optimistic",
            source,
            result.samples,
        )
    if not result.faithful:
        result.worst_layers = worst_layers(report, evidence.selection, model, *stages)
    report.fidelity = result.to_dict()
    if selection is not None and selection is not result:
        # what the repair and the refinement chose on (the first calibration samples)
        report.fidelity["selection"] = {
            k: v for k, v in selection.to_dict().items() if k not in ("worst_layers", "held_out")
        }
    if result.faithful:
        logger.info(
            "%s: faithful on %d %s: %s",
            source,
            result.samples,
            result.sample_words,
            result.describe(),
        )
        return model
    message = result.message(source)
    if _activation_bits(report) == 8:
        # measured: a seal text detector (activations with max/RMS near 40 in ~60 blocks, each
        # losing a little) 0.3 dB in XINT8, 9.1 dB with A16W8 (benchmarks/results/unseen.md)
        message += (
            "; where many layers each lose a little, 8-bit activations are the limit: a "
            "FidelityTarget (--fidelity-target) promotes only the tensors that cost the most, "
            "16-bit activations for the whole model (preset A16W8) keep more"
            if not options.FidelityTarget
            else "; 16-bit activations for the whole model (preset A16W8) keep more"
        )
    if options.RequireFidelity:
        raise FidelityError(message + " (RequireFidelity is set: no model was written)")
    logger.warning(message)
    return model


def _activation_bits(report: QuantizationReport) -> int | None:
    """Bits of the activation type in the report's settings (``"QuantType.QInt8"``), or None."""
    name = str(report.settings.get("activation_type", "")).rpartition(".")[2]
    try:
        return QuantType.coerce(name).bits
    except ConfigError:
        return None


def measure(
    report: QuantizationReport,
    source: str,
    model: Any,
    samples: list[dict[str, np.ndarray]],
    reference: Sequence[dict[str, np.ndarray]],
    options: ExtraOptions,
    parts: dict[str, list[Any]] | None = None,
    *,
    held_out: bool = False,
) -> FidelityResult | None:
    """Every output of ``model`` against ``reference`` on ``samples``, part by part when
    ``parts`` are given (None, recorded in the report, when the model does not run)."""
    from quark_onnx.fidelity import verdict

    try:
        # one sample's outputs at a time: the comparison accumulates its sums sample by sample
        outputs = verdict.compare_runs(
            reference,
            _runs(model, samples),
            min_sqnr_db=options.FidelityMinSQNR,
            min_agreement=options.FidelityMinAgreement,
            parts=parts,
            # a target that names an SQNR holds score vectors to it as well
            scores_by_decision=not _target_names_sqnr(options),
            batches=[_batch(feed) for feed in samples],
            score_threshold=options.FidelityScoreThreshold,
        )
    except _RunFailed as exc:
        logger.warning("%s: fidelity not measured: %s", source, exc)
        report.fidelity = {"faithful": None, "error": str(exc)}
        return None
    return verdict.FidelityResult(
        samples=len(samples),
        outputs=outputs,
        min_sqnr_db=options.FidelityMinSQNR,
        min_agreement=options.FidelityMinAgreement,
        held_out=held_out,
    )


def _target_names_sqnr(options: ExtraOptions) -> bool:
    from quark_onnx.fidelity.target import parse_target

    target = parse_target(options.FidelityTarget)
    return target is not None and target.sqnr_db is not None


def _batch(feed: dict[str, np.ndarray]) -> int | None:
    """A feed's batch size: the first axis of its inputs (None for scalars)."""
    for value in feed.values():
        if np.ndim(value) >= 1:
            return int(np.shape(value)[0])
    return None


def worst_layers(
    report: QuantizationReport,
    samples: list[dict[str, np.ndarray]],
    model: Any,
    prepared: onnx.ModelProto,
    plan: Any,
    external_dir: Path | None,
    count: int = 3,
) -> list[dict[str, Any]]:
    """The ``count`` quantized tensors whose SQNR drops the most (layer error analysis)."""
    from quark_onnx.errors import QuarkOnnxError

    errors = report.layer_errors
    if not errors:
        from quark_onnx.accuracy.error_analysis import layer_errors

        materialize(prepared, external_dir)
        try:
            errors = layer_errors(prepared, model, samples, plan)
        except QuarkOnnxError as exc:
            logger.info("per-layer error analysis failed: %s", exc)
            return []
    ranked = sorted(errors, key=lambda e: -e["drop_db"])[:count]
    return [{k: e[k] for k in ("tensor", "node", "op_type", "sqnr_db", "drop_db")} for e in ranked]


def materialize(
    prepared: onnx.ModelProto, external_dir: Path | None, quantized: ir.Model | None = None
) -> None:
    """Read external weights into ``prepared`` (no-op without external data): the layer replays
    of AdaRound, bias correction and error analysis run onnxruntime on model bytes. Called after
    the positions stage, whose weight error curves are gone by then, to keep the peak low.

    With ``quantized`` (the accuracy stages' call) only when it holds a layer those stages
    replay (:func:`quark_onnx.accuracy.layers.find_layers`): the weights read stay in the proto
    until the run ends (a cleared protobuf field keeps its memory), and a model without one (a
    MatMul network) has nothing to replay (a 100 MB weight: 100 MB more at the verdict)."""
    if external_dir is None:
        return
    if quantized is not None:
        from quark_onnx.accuracy.layers import find_layers

        if not find_layers(quantized)[0]:
            return
    external.materialize(prepared, external_dir)
