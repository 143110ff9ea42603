"""``ModelQuantizer``: the Quark-shaped entry point that runs the whole pipeline.

The stages (GUIDE §1), each a module of its own, in the order :mod:`quark_onnx.pipeline.sequencer`
runs them (the order a recipe's rebuild shares)::

    load -> prepare passes -> plan -> calibrate -> positions -> NPU constraints -> insert QDQ
         -> accuracy stages -> error analysis, fidelity guard -> finalize -> check -> save

One pipeline serves every strategy and data type; the config selects what each stage does:

* power-of-two scales (``enable_npu_cnn`` / a ``PowerOfTwoMethod``, the XINT8 flow): calibrate,
  choose positions, solve the NPU constraints, ``InsertQDQ(plan, positions)``, then the accuracy
  stages (AdaRound, bias correction);
* float scales (static, weight-only, dynamic; int4 to int16, float8, float16/bfloat16): calibrate
  only when some activation is static with a scale
  (:func:`quark_onnx.params.strategy.needs_calibration`; weight-only, dynamic and Cast-only configs
  need no data and no reader), compute every tensor's
  :class:`~quark_onnx.params.qparams.QuantParams`
  (:func:`quark_onnx.params.strategy.compute_params`), then ``InsertQDQ(params)``.

This module gives each stage its work (``QuantizationRun``, the
:class:`~quark_onnx.pipeline.sequencer.Stages` of one call), times it and collects what it reports;
it holds no quantization logic of its own.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from quark_onnx.config.options import ExtraOptions
from quark_onnx.config.quantization import Config, QuantizationConfig
from quark_onnx.errors import ConfigError, QuantizationError
from quark_onnx.fidelity.target import parse_target, with_target
from quark_onnx.model_files.external import external_data_dir
from quark_onnx.model_files.load import load_ir, signature_proto, to_ir, to_proto, validate_proto
from quark_onnx.model_files.paths import check_output_path
from quark_onnx.model_files.save import save_model
from quark_onnx.npu.placement import write_promotions
from quark_onnx.pipeline import guard, mixed_precision, preflight, sequencer
from quark_onnx.pipeline import prepare as pipeline
from quark_onnx.pipeline import repair as fidelity_repair
from quark_onnx.pipeline.report import QuantizationReport

logger = logging.getLogger(__name__)


class ModelQuantizer:
    """Quantize ONNX models with a :class:`~quark_onnx.config.quantization.Config`.

    The config is validated here: unknown or mistyped ``extra_options`` raise
    :class:`~quark_onnx.errors.ConfigError` before any model is read.

    ``calibration_shards=K`` (> 1) calibrates K contiguous parts of the calibration data in
    parallel, in spawned processes or, with ``shard_backend="ray"``, Ray tasks, and merges their
    statistics (:func:`quark_onnx.calibration.shards.calibrate_sharded`); the quantized model is
    the same byte for byte. How the work is spread is not a quantization setting: it is not in the
    config and not in the report's settings.
    """

    def __init__(
        self, config: Config, *, calibration_shards: int = 1, shard_backend: str = "processes"
    ) -> None:
        if not isinstance(config, Config):
            raise ConfigError(
                f"ModelQuantizer expects a quark_onnx.Config, got {type(config).__name__}"
            )
        if (
            not isinstance(calibration_shards, int)
            or isinstance(calibration_shards, bool)
            or calibration_shards < 1
        ):
            raise ConfigError(
                f"calibration_shards={calibration_shards!r}: expected a positive whole number"
            )
        self.calibration_shards = calibration_shards
        self.shard_backend = shard_backend
        self.config = config
        self.options: ExtraOptions = config.global_quant_config.validate()
        #: The report of the last :meth:`quantize_model` call.
        self.report: QuantizationReport | None = None
        #: Tensor name -> QuantParams the model of the last :meth:`quantize_model` call holds, in
        #: the order written: scales, zero points and every constant's codes, after AdaRound
        #: and bias correction (what :func:`quark_onnx.formats.recipe.save_recipe` takes as
        # ``params``).
        self.params: dict[str, Any] | None = None
        #: Keep this many of the first calibration samples in :attr:`kept_samples` (the CLI's
        #: float-vs-quantized comparison reuses them instead of reading the data again).
        self.keep_samples = 0
        self.kept_samples: list[dict[str, np.ndarray]] = []
        #: whether :attr:`kept_samples` are the verdict's held-out samples
        self.kept_held_out = False

    @property
    def qconfig(self) -> QuantizationConfig:
        return self.config.global_quant_config

    @property
    def config_in_force(self) -> QuantizationConfig:
        """The configuration the last :meth:`quantize_model` applied: the given one with every
        pass that ``RevertCostlyPasses`` undid switched off (a copy; the given config is not
        changed). A recipe saved with it rebuilds the written model byte for byte."""
        qconfig = copy.deepcopy(self.qconfig)
        undone = [p["name"] for p in (self.report.passes if self.report else ()) if p["reverted"]]
        qconfig.extra_options.update(dict.fromkeys(undone, False))
        for repair in (r for r in (self.report.repairs if self.report else ()) if r["kept"]):
            fidelity_repair.apply_settings(qconfig, repair["settings"])
        if self.report is not None and self.report.mixed_precision:
            # the promotions found are rebuilt as a list, without the search (nor a repair
            # choosing again after it), judged by the thresholds it met
            qconfig.extra_options.update(
                mixed_precision.rebuild_settings(self.report, self.options)
            )
        return qconfig

    def quantize_model(
        self,
        model_input: str | os.PathLike | onnx.ModelProto,
        model_output: str | os.PathLike | None = None,
        calibration_data_reader: Any = None,
        calibration_data_path: str | os.PathLike | None = None,
        *,
        calibration_result: str | os.PathLike | None = None,
        save_calibration: str | os.PathLike | None = None,
        overwrite: bool = False,
        progress: Any = None,
        require_ready: bool = False,
    ) -> onnx.ModelProto:
        """Quantize ``model_input`` and write it to ``model_output`` (when given).

        Args:
            model_input: path of the float model, or a ModelProto.
            model_output: where to write the quantized model (atomically; never the input
                unless ``overwrite``).
            calibration_data_reader: an onnxruntime-style reader (``get_next()``), a dict of
                arrays, or None with ``UseRandomData``. Not needed (ignored) when no activation
                is calibrated: weight-only, dynamic and float16/bfloat16 configs.
            calibration_data_path: a ``.npz`` file of calibration inputs (instead of a reader).
            calibration_result: a calibration result saved earlier for this model and these
                preparation options: calibration is skipped.
            save_calibration: write the calibration result here (JSON) for later runs.
            overwrite: allow ``model_output`` to be the input model's path.
            progress: calibration progress: None (a live line on a terminal, log lines
                otherwise), True, False, or a callable ``(done, total, rate)``.
            require_ready: refuse, before any work, a model the NPU settings cannot make
                Vitis AI-ready (XINT8 on a model with no Conv) instead of warning.

        Returns:
            The quantized model. :attr:`report` holds what every stage did.
        """

        preflight.check_path_arguments(
            model_input=model_input,
            model_output=model_output,
            calibration_data_path=calibration_data_path,
            calibration_result=calibration_result,
            save_calibration=save_calibration,
        )
        # with a FidelityTarget the verdict's thresholds are the target's
        options = with_target(self.qconfig.validate())
        self.options = options
        self.params = None
        source = str(model_input) if not isinstance(model_input, onnx.ModelProto) else "<model>"
        report = QuantizationReport(model=source, settings=self.qconfig.effective_settings())
        self.report = report
        for sentence in self.qconfig.unsupported_settings():
            logger.warning("%s: %s", source, sentence)
            report.notes.append(sentence)
        input_path = None if isinstance(model_input, onnx.ModelProto) else Path(model_input)
        # every output is checked against every input before any work (a calibration file
        # written over the model, a model written over its own external data...)
        inputs = [calibration_data_path, calibration_result]
        if isinstance(calibration_data_reader, (str, os.PathLike)):
            inputs.append(calibration_data_reader)
        if model_output is not None:
            check_output_path(model_output, input_path, overwrite, inputs=inputs)
        if save_calibration is not None:
            check_output_path(
                save_calibration,
                input_path,
                inputs=[*inputs, model_output],
                external_data=False,
                what="calibration result",
            )

        run = QuantizationRun(
            self,
            report,
            source,
            model_input,
            reader=calibration_data_reader,
            npz_path=calibration_data_path,
            calibration_result=calibration_result,
            save_calibration=save_calibration,
            progress=progress,
            require_ready=require_ready,
        )
        run.output = (model_output, input_path, overwrite)
        outcome = sequencer.run(run)
        self.params = outcome.params
        logger.info("%s: quantized in %.2f s", source, report.total_seconds)
        if self.qconfig.print_summary:
            logger.info("%s: %s", source, report.summary())
        return outcome.model

    # -- stages -------------------------------------------------------------------------------

    def _samples_to_keep(self) -> int:
        """Calibration samples kept in memory for the stages that need data after calibration."""
        if not (
            self.qconfig.include_fast_ft
            or self.qconfig.include_bias_correction
            or self.options.LayerErrorAnalysis
        ):
            return 0
        return self.options.AccuracySamples

    def _fidelity_samples(self) -> int:
        """How many samples the pass measurement and the fidelity guard run (0: none)."""
        if not self.options.FidelityCheck:
            return 1  # numerics-changing passes are still measured on one sample
        return self.options.FidelitySamples  # >= 1 (options.OPTION_BOUNDS)

    def _calibrate(
        self,
        prepared: onnx.ModelProto,
        names: list[str],
        reader: Any,
        saved: str | os.PathLike | None,
        progress: Any = None,
        external_dir: Path | None = None,
    ) -> Any:
        from quark_onnx.calibration import CalibrationResult, calibrate

        if saved is not None:
            return CalibrationResult.load(saved, prepared)
        if self.calibration_shards > 1:
            from quark_onnx.calibration.shards import calibrate_sharded

            return calibrate_sharded(
                prepared,
                names,
                reader,
                method=self.qconfig.calibrate_method,
                options=self.options,
                shards=self.calibration_shards,
                backend=self.shard_backend,  # type: ignore[arg-type]
                external_data_dir=external_dir,
                providers=self.qconfig.execution_providers,
            )
        return calibrate(
            prepared,
            names,
            reader,
            method=self.qconfig.calibrate_method,
            options=self.options,
            providers=self.qconfig.execution_providers,
            progress=progress,
            external_data_dir=external_dir,
        )


#: Stages that allocate and free a lot (model copies, onnxruntime sessions, replays): their freed
#: heap pages go back to the OS when they end, so the next stage's peak does not stack on them.
_LARGE_STAGES = frozenset({"prepare", "calibrate", "adaround", "bias_correction", "error_analysis"})


@contextmanager
def _stage(report: QuantizationReport, name: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        from quark_onnx.runtime import memory

        if name in _LARGE_STAGES:
            memory.release_freed_memory()
        report.timings[name] = round(time.perf_counter() - start, 4)
        peak = memory.peak_rss_mb()
        if peak is not None:
            report.peak_rss_mb[name] = peak


class QuantizationRun(sequencer.Stages):
    """The stages of one :meth:`ModelQuantizer.quantize_model` call (run by
    :func:`quark_onnx.pipeline.sequencer.run`), with what they hand each other: the run state,
    public, which the fidelity repair reads and runs again
    (:class:`~quark_onnx.pipeline.repair.RepairableRun`)."""

    def __init__(
        self,
        quantizer: ModelQuantizer,
        report: QuantizationReport,
        source: str,
        model_input: Any,
        **arguments: Any,
    ) -> None:
        self.q = quantizer
        self.qconfig = quantizer.qconfig
        self.options = quantizer.options
        self.report = report
        self.source = source
        self.model_input = model_input
        self.arguments = arguments
        self.progress = arguments.get("progress")  # the stage lines follow the progress setting
        self.output: tuple[Any, Path | None, bool] = (None, None, False)
        self.reader: Any = None
        self.fidelity_samples: list[dict[str, np.ndarray]] = []
        self.reference: list[dict[str, np.ndarray]] | None = None
        #: held out from every stage that fits or chooses: the verdict's samples and reference
        self.verdict_samples: list[dict[str, np.ndarray]] = []
        self.verdict_reference: list[dict[str, np.ndarray]] = []
        #: fitted by no stage, not held out: what the mixed-precision search decides on
        self.search_samples: list[dict[str, np.ndarray]] = []
        self.search_reference: list[dict[str, np.ndarray]] = []
        self.anatomy: dict[str, list[Any]] = {}  # graph output -> its parts (output_anatomy)
        self.samples: list[dict[str, np.ndarray]] = []  # kept for the stages after calibration
        self.prepared: onnx.ModelProto | None = None  # the float copy calibration reads
        self.external_dir: Path | None = None
        self.calibration: Any = None  # the calibration result
        self.power_of_two = False  # set by the plan
        self.positions: dict[str, int] = {}  # XINT8: the solved positions
        self.quantized: dict[str, Any] = {}  # constant -> the initializer of its codes
        #: promoted tensor -> the nodes kept float around it (empty for a 16-bit tensor)
        self.promoted: dict[str, tuple[str, ...]] = {}

    def _attempts_again(self) -> bool:
        """Whether the guard's measurement may have the stages after calibration run again."""
        return self.options.FidelityRepair or self.options.FidelityRefine

    def _searches_precision(self) -> bool:
        """Whether a missed ``FidelityTarget`` may have the stages after calibration run again
        with promoted tensors (:mod:`quark_onnx.pipeline.mixed_precision`)."""
        return parse_target(self.options.FidelityTarget) is not None

    def load(self) -> Any:
        from quark_onnx.calibration.sources import calibration_source

        with _stage(self.report, "load"):
            if isinstance(self.model_input, onnx.ModelProto):
                proto = validate_proto(self.model_input)
                model = to_ir(proto)
            else:
                # external weights stay in their files, memory-mapped on use
                model = load_ir(self.model_input)
                # the readers read the graph's inputs only: no serialisation of the graph
                proto = signature_proto(model)
        args = self.arguments
        preflight.check_architecture(model, self.source, self.qconfig, args["require_ready"])
        reader, npz_path = args["reader"], args["npz_path"]
        if not self.qconfig.needs_calibration_data() and (reader, npz_path) != (None, None):
            # documented as ignored: not even the fidelity verdict reads it (a reader may be
            # costly, or one pass over a stream)
            logger.info(
                "%s: the calibration data is not read: these settings need none", self.source
            )
            reader = npz_path = None
        self.reader = calibration_source(
            reader,
            npz_path,
            self.options,
            model=proto,
            keep=max(self.q._samples_to_keep(), self.q.keep_samples),
        )
        # The verdict's samples are held out first: no stage fits or chooses on them. The next
        # ones serve the measurement of numerics-changing passes and the repair's choices; the
        # reader hands those to calibration as well.
        if self.reader is not None:
            if self.options.FidelityCheck:
                self.verdict_samples = self.reader.hold_out(self.options.FidelityHoldout)
            self.fidelity_samples = self.reader.peek(self.q._fidelity_samples())
            if self._searches_precision():
                # the mixed-precision search decides on samples no stage fits on: the ones
                # after those the accuracy stages fit (they fit on the selection samples too)
                fitted = max(self.q._samples_to_keep(), len(self.fidelity_samples))
                count = mixed_precision.search_sample_count(self.fidelity_samples)
                self.search_samples = self.reader.peek(fitted + count)[fitted:]
        preflight.check_tensors(model, self.source, self.verdict_samples + self.fidelity_samples)
        return model

    def prepare(self, model: Any) -> None:
        report = self.report
        with _stage(report, "prepare"):
            # the original model's outputs: the reference of the pass costs, of the guard's
            # choices and of the held-out verdict; the anatomy of its outputs (what each part is)
            samples = self.fidelity_samples + self.verdict_samples + self.search_samples
            reference = guard.reference_outputs(self.source, model, samples, self.options)
            if reference is not None:
                split, end = len(self.fidelity_samples), len(samples) - len(self.search_samples)
                self.reference = reference[:split]
                self.verdict_reference = reference[split:end]
                self.search_reference = reference[end:]
                self.anatomy = guard.output_anatomy(
                    model, (self.verdict_samples or self.fidelity_samples)[0]
                )
            report.passes = pipeline.prepare(
                model, self.qconfig, self.options, self.fidelity_samples, self.reference
            )
            extra = report.settings.get("extra_options", {})
            for record in report.passes:
                if record["reverted"] and record["name"] in extra:
                    # the setting in force is the one a recipe must rebuild with
                    extra[record["name"]] = False

    def plan(self, model: Any) -> Any:
        report = self.report
        with _stage(report, "plan"):
            from quark_onnx.plan.build import build_plan

            plan = build_plan(model, self.qconfig, self.options)
            report.plan = plan.summary()
            report.float_nodes = [
                {"node": f.name, "op_type": f.op_type, "reason": f.reason} for f in plan.float_nodes
            ]
        if not plan.nodes:
            raise QuantizationError(
                f"{self.source}: no node can be quantized (the model has "
                f"{len(report.float_nodes)} node(s), none with a quantization policy)"
            )
        self.power_of_two = any(spec.power_of_two for spec in plan.tensors.values())
        self.promoted = dict(plan.promoted)
        return plan

    def parameters(self, model: Any, plan: Any) -> Any:
        """Calibration, then the power-of-two positions (solved against the NPU rules) or the
        float-scale parameters."""
        from quark_onnx.params import strategy

        report, args = self.report, self.arguments
        # weights still in external files stay references: the float model is not copied
        self.prepared = to_proto(model, keep_external=True)
        self.external_dir = external_data_dir(model)
        result = None
        if strategy.needs_calibration(plan):
            names = (
                plan.activation_names() if self.power_of_two else strategy.calibrated_names(plan)
            )
            with _stage(report, "calibrate"):
                result = self.q._calibrate(
                    self.prepared,
                    names,
                    self.reader,
                    args["calibration_result"],
                    args["progress"],
                    self.external_dir,
                )
                if args["save_calibration"] is not None:
                    result.save(args["save_calibration"])
                report.calibration = {"samples": result.num_samples, "method": result.method}
        else:
            report.calibration = {"samples": 0, "method": None}
            logger.info(
                "%s: %s quantization needs no calibration data", self.source, plan.strategy.value
            )
        if self.options.FidelityCheck and (
            (self.power_of_two and self._attempts_again()) or self._searches_precision()
        ):
            self.calibration = result  # a repair or the precision search quantizes again from it
        kept = self.reader.kept if self.reader is not None else []
        self.samples = kept[self.options.AccuracySamplesSkip : self.q._samples_to_keep()]
        # what the CLI compares on: the verdict's held-out samples when there are any
        self.q.kept_samples = (self.verdict_samples or kept)[: self.q.keep_samples]
        self.q.kept_held_out = bool(self.verdict_samples)
        return self.scales(model, plan, result)

    def scales(self, model: Any, plan: Any, result: Any) -> Any:
        """The power-of-two positions (solved against the NPU rules) or the float-scale
        parameters of ``plan``'s tensors, from the calibration ``result``."""
        from quark_onnx.params import strategy

        if self.power_of_two:
            return self.xint8_positions(model, plan, result)
        report = self.report
        with _stage(report, "params"):
            params = strategy.compute_params(plan, result, model, self.qconfig, self.options)
            report.plan["params"] = len(params)
            report.plan["types"] = sorted({p.qtype.name for p in params.values()})
        return params

    def trial(
        self, qconfig: QuantizationConfig, options: ExtraOptions, samples: list | None = None
    ) -> QuantizationRun:
        """A run of the same model, calibration and samples (``samples``: others) with other
        settings, a fresh report and no positions yet: one fidelity repair attempt."""
        trial = copy.copy(self)
        trial.qconfig, trial.options = qconfig, options
        if samples is not None:
            trial.samples = samples
        trial.report = QuantizationReport(model=self.source)
        trial.positions, trial.quantized = {}, {}
        return trial

    def xint8_positions(self, model: Any, plan: Any, result: Any) -> dict[str, int]:
        """The XINT8 positions: calibrated, then moved where an NPU rule needs it."""
        from quark_onnx.params import pof2_params

        report, source = self.report, self.source
        with _stage(report, "positions"):
            method = self.qconfig.calibrate_method
            positions, errors = pof2_params.initial_positions(
                model, plan, result, method, self.options.WeightPositionMethod, self.options
            )
            # a decode tail kept float on the CPU (SplitHeterogeneousJoins) left the plan
            report.plan.update(plan.summary())
            report.float_nodes = [
                {"node": f.name, "op_type": f.op_type, "reason": f.reason} for f in plan.float_nodes
            ]
            ranges = pof2_params.calibrated_ranges(plan, result)
        with _stage(report, "constraints"):
            unclipped = pof2_params.order_decided(model, plan)
            solved = pof2_params.solve(plan, positions, errors, ranges, self.options, unclipped)
            report.adjustments = [a.__dict__ for a in solved.adjustments]
            report.unfixable = [v.message for v in solved.unfixable]
            for violation in solved.unfixable:
                logger.warning("%s: NPU rule cannot be met: %s", source, violation.message)
            report.positions = dict(solved.positions)
            report.range_clips = pof2_params.range_clips(plan, ranges, positions, solved.positions)
            for clip in report.range_clips:
                logger.warning("%s: %s", source, clip["message"])
            self._position_costs(plan, result, positions, errors, solved)
            # the weight error curves read the (memory-mapped) float weights: let them go
            del errors
        self.positions = solved.positions
        return solved.positions

    def _position_costs(
        self, plan: Any, result: Any, positions: dict, errors: dict, solved: Any
    ) -> None:
        """What each NPU-forced move costs the tensor it moves (its own SQNR from the calibration
        histogram); one warning line for the costly ones: the rules are the NPU's, the user can
        only read the cost."""
        from quark_onnx.npu import costs

        report = self.report
        report.position_costs = costs.forced_position_costs(
            positions,
            solved.positions,
            errors,
            costs.activation_mean_squares(plan, result),
            solved.adjustments,
        )
        costly = [e for e in report.position_costs if e["cost_db"] >= costs.COST_WARN_DB]
        if costly:
            logger.warning(
                "%s: NPU rules cost %d tensor(s) >= %.0f dB of their own SQNR "
                "(report.position_costs); worst: %s",
                self.source,
                len(costly),
                costs.COST_WARN_DB,
                costs.cost_message(costly[0]),
            )

    def insert(self, model: Any, plan: Any, parameters: Any) -> dict[str, Any]:
        from quark_onnx.passes.insert_qdq import InsertQDQ

        with _stage(self.report, "insert_qdq"):
            inserter = InsertQDQ(plan, parameters) if self.power_of_two else InsertQDQ(parameters)
            inserter(model)
        self.quantized = inserter.quantized
        return inserter.params

    def accuracy(self, model: Any, plan: Any, params: dict[str, Any]) -> dict[str, Any]:
        """AdaRound and bias correction (XINT8): they rewrite codes (and may move a bias
        position inside its shift_bias window)."""
        qconfig, report, samples = self.qconfig, self.report, self.samples
        if not self.power_of_two:
            return params
        if samples and (qconfig.include_fast_ft or qconfig.include_bias_correction):
            guard.materialize(self.prepared, self.external_dir, quantized=model)
        from quark_onnx.accuracy.adaround import adaround, rounding_in_bias_walk
        from quark_onnx.accuracy.bias_correction import correct_bias

        rounding = rounding_in_bias_walk(qconfig, self.options)  # then one walk does both
        if qconfig.include_fast_ft and rounding is None:
            with _stage(report, "adaround"):
                report.adaround = adaround(
                    self.prepared, model, samples, plan, self.positions, self.options
                )
        if qconfig.include_bias_correction:
            with _stage(report, "bias_correction"):
                # moves some bias positions in self.positions (inside their shift_bias windows)
                report.bias_correction = correct_bias(
                    self.prepared, model, samples, plan, self.positions, self.options, rounding
                )
                report.adaround = report.bias_correction.pop("rounding", report.adaround)
                report.positions.update(report.bias_correction.get("moved_bias_positions", {}))
        return self._written(params, plan)

    def _written(self, params: dict[str, Any], plan: Any) -> dict[str, Any]:
        """``params`` as the model now holds them: the codes of every constant (AdaRound and
        bias correction rewrite them in place) and the bias positions bias correction moved."""
        from quark_onnx.params import qparams

        moved = (self.report.bias_correction or {}).get("moved_bias_positions", {})
        written = {}
        for name, p in params.items():
            if name in moved:
                p = qparams.from_position(moved[name], plan.tensors[name].qtype)
            value = self.quantized.get(name)
            if value is not None and value.const_value is not None:
                p = dataclasses.replace(p, codes=value.const_value.numpy())
            written[name] = p
        return written

    def measure(self, model: Any, plan: Any, params: dict[str, Any]) -> tuple[Any, dict]:
        report = self.report
        if self.options.LayerErrorAnalysis and self.samples:
            guard.materialize(self.prepared, self.external_dir)
            with _stage(report, "error_analysis"):
                from quark_onnx.accuracy.error_analysis import layer_errors

                report.layer_errors = layer_errors(self.prepared, model, self.samples, plan)
        if not self.reference:
            return model, params
        # XINT8: an unfaithful output is quantized again with conservative choices, a faithful
        # one offered a refinement (quark_onnx.pipeline.repair)
        fix: Any = None
        if self.power_of_two and self._attempts_again():
            fix = fidelity_repair.Repairer(self, model, params, plan)
        if self._searches_precision():
            # a target still missed after the repair promotes tensors
            fix = mixed_precision.PrecisionSearch(self, model, params, plan, repairer=fix)
        # before finalize: fixing the batch dimension changes no value, and the samples'
        # own batch sizes still fit
        with _stage(report, "fidelity"):
            model = guard.guard_fidelity(
                report,
                self.source,
                model,
                guard.Evidence(
                    self.fidelity_samples,
                    self.reference,
                    self.verdict_samples,
                    self.verdict_reference,
                    self.anatomy,
                ),
                (self.prepared, plan, self.external_dir),
                self.options,
                repair=fix,
            )
        return model, (fix.params if fix is not None else params)

    def finalize(self, model: Any) -> onnx.ModelProto:
        from quark_onnx.pipeline.prepare import finalize_passes, run_passes

        with _stage(self.report, "finalize"):
            write_promotions(model, self.promoted)
            passes = finalize_passes(self.qconfig, self.options)
            self.report.passes += run_passes(model, passes).as_dict()["passes"]
            return to_proto(model)

    def release(self) -> None:
        self.prepared = self.calibration = None
        self.quantized = {}  # its initializers keep the whole working graph reachable
        gc.collect()

    def check(self, model: onnx.ModelProto) -> None:
        from quark_onnx.npu.readiness import check

        with _stage(self.report, "check"):
            # no advice to apply a pass this run measured and undid
            undone = self.report.reverted_passes
            self.report.check = check(model, reverted_passes=undone).to_dict()

    def save(self, model: onnx.ModelProto) -> None:

        output, input_path, overwrite = self.output
        if output is None:
            return
        with _stage(self.report, "save"):
            save_model(
                model,
                output,
                input_path=input_path,
                overwrite=overwrite,
                # None: external data only above the 2 GB protobuf limit
                external_data=True if self.qconfig.use_external_data_format else None,
            )
            self.report.output = str(output)
