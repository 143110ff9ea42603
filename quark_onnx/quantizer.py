"""``ModelQuantizer``: the Quark-shaped entry point that runs the whole pipeline.

The stages (GUIDE §1), each a module of its own::

    load -> prepare passes -> plan -> calibrate -> positions -> NPU constraints -> insert QDQ
         -> check -> save (+ report)

One pipeline serves every strategy and data type; the config selects what each stage does:

* power-of-two scales (``enable_npu_cnn`` / a ``PowerOfTwoMethod``, the XINT8 flow): calibrate,
  choose positions, solve the NPU constraints, ``InsertQDQ(plan, positions)``, then the accuracy
  stages (AdaRound, bias correction);
* float scales (static, weight-only, dynamic; int4 to int16, float8, float16/bfloat16): calibrate
  only when some activation is static with a scale (:func:`quark_onnx.strategy.needs_calibration`;
  weight-only, dynamic and Cast-only configs need no data and no reader), compute every tensor's
  :class:`~quark_onnx.qparams.QuantParams` (:func:`quark_onnx.strategy.compute_params`), then
  ``InsertQDQ(params)``.

This module only sequences them, times them and collects what each reports; it holds no
quantization logic of its own.
"""

from __future__ import annotations

import copy
import gc
import logging
import math
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from quark_onnx.config import Config, QuantizationConfig
from quark_onnx.enums import PowerOfTwoMethod
from quark_onnx.errors import CalibrationError, ConfigError, FidelityError, QuantizationError
from quark_onnx.options import ExtraOptions
from quark_onnx.report import QuantizationReport

logger = logging.getLogger(__name__)


class ModelQuantizer:
    """Quantize ONNX models with a :class:`~quark_onnx.config.Config`.

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
        if calibration_shards < 1:
            raise ConfigError(
                f"calibration_shards={calibration_shards}: expected a positive number"
            )
        self.calibration_shards = calibration_shards
        self.shard_backend = shard_backend
        self.config = config
        self.options: ExtraOptions = config.global_quant_config.validate()
        #: The report of the last :meth:`quantize_model` call.
        self.report: QuantizationReport | None = None
        #: Tensor name -> QuantParams written by the last :meth:`quantize_model` call, in the
        #: order written (float-scale flows: with the constants' codes; XINT8: the solved
        #: positions as scales ``2^-p``, before bias correction and AdaRound change codes).
        self.params: dict[str, Any] | None = None
        #: Keep this many of the first calibration samples in :attr:`kept_samples` (the CLI's
        #: float-vs-quantized comparison reuses them instead of reading the data again).
        self.keep_samples = 0
        self.kept_samples: list[dict[str, np.ndarray]] = []

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
        from quark_onnx import model_io

        _check_path_arguments(
            model_input=model_input,
            model_output=model_output,
            calibration_data_path=calibration_data_path,
            calibration_result=calibration_result,
            save_calibration=save_calibration,
        )
        options = self.qconfig.validate()
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
            model_io.check_output_path(model_output, input_path, overwrite, inputs=inputs)
        if save_calibration is not None:
            model_io.check_output_path(
                save_calibration,
                input_path,
                inputs=[*inputs, model_output],
                external_data=False,
                what="calibration result",
            )

        with _stage(report, "load"):
            if isinstance(model_input, onnx.ModelProto):
                proto = model_io.validate_proto(model_input)
                model = model_io.to_ir(proto)
            else:
                # external weights stay in their files, memory-mapped on use
                model = model_io.load_ir(model_input)
                # the readers read the graph's inputs only: no serialisation of the graph
                proto = model_io.signature_proto(model)

        _check_architecture(model, source, self.qconfig, require_ready)
        reader = _make_reader(
            calibration_data_reader,
            calibration_data_path,
            options,
            model=proto,
            keep=max(self._samples_to_keep(), self.keep_samples),
        )
        del proto  # only the reader's checks read it
        # The first samples serve the measurement of numerics-changing passes and the fidelity
        # guard; the reader hands them to calibration as well.
        fidelity_samples = reader.peek(self._fidelity_samples()) if reader is not None else []
        with _stage(report, "prepare"):
            # the original model's outputs: the reference of the pass costs and of the guard
            reference = self._reference_outputs(source, model, fidelity_samples)
            report.passes = self._prepare(model, fidelity_samples, reference)
            extra = report.settings.get("extra_options", {})
            for record in report.passes:
                if record["reverted"] and record["name"] in extra:
                    # the setting in force is the one a recipe must rebuild with
                    extra[record["name"]] = False

        with _stage(report, "plan"):
            from quark_onnx.plan import build_plan

            plan = build_plan(model, self.qconfig, options)
            report.plan = plan.summary()
            report.float_nodes = [
                {"node": f.name, "op_type": f.op_type, "reason": f.reason} for f in plan.float_nodes
            ]
        if not plan.nodes:
            raise QuantizationError(
                f"{source}: no node can be quantized (the model has "
                f"{len(report.float_nodes)} node(s), none with a quantization policy)"
            )

        from quark_onnx import strategy

        # weights still in external files stay references: the float model is not copied
        prepared = model_io.to_proto(model, keep_external=True)
        external_dir = model_io.external_data_dir(model)
        power_of_two = any(spec.power_of_two for spec in plan.tensors.values())
        result = None
        if strategy.needs_calibration(plan):
            names = plan.activation_names() if power_of_two else strategy.calibrated_names(plan)
            with _stage(report, "calibrate"):
                result = self._calibrate(
                    prepared, names, reader, calibration_result, progress, external_dir
                )
                if save_calibration is not None:
                    result.save(save_calibration)
                report.calibration = {"samples": result.num_samples, "method": result.method}
        else:
            report.calibration = {"samples": 0, "method": None}
            logger.info(
                "%s: %s quantization needs no calibration data", source, plan.strategy.value
            )

        samples = reader.kept[: self._samples_to_keep()] if reader is not None else []
        self.kept_samples = reader.kept[: self.keep_samples] if reader is not None else []
        if power_of_two:
            self._power_of_two(report, source, model, prepared, plan, result, samples, external_dir)
        else:
            with _stage(report, "params"):
                params = strategy.compute_params(plan, result, model, self.qconfig, options)
                report.plan["params"] = len(params)
                report.plan["types"] = sorted({p.qtype.name for p in params.values()})
            with _stage(report, "insert_qdq"):
                from quark_onnx.passes.insert_qdq import InsertQDQ

                InsertQDQ(params)(model)
            self.params = params
        if options.LayerErrorAnalysis and samples:
            _materialize(prepared, external_dir)
            with _stage(report, "error_analysis"):
                from quark_onnx.accuracy.error_analysis import layer_errors

                report.layer_errors = layer_errors(prepared, model, samples, plan)
        if reference:
            # before finalize: fixing the batch dimension changes no value, and the samples'
            # own batch sizes still fit
            with _stage(report, "fidelity"):
                self._guard_fidelity(
                    report,
                    source,
                    model,
                    fidelity_samples,
                    reference,
                    (prepared, plan, external_dir),
                )
        with _stage(report, "finalize"):
            from quark_onnx.pipeline import finalize_passes, run_passes

            report.passes += run_passes(model, finalize_passes(self.qconfig, options)).as_dict()[
                "passes"
            ]
            quantized = model_io.to_proto(model)
        # the graph objects of the working model and the float copy are the largest things held
        # per node: dropped before the check builds its own view of the quantized model
        del model, prepared
        gc.collect()

        with _stage(report, "check"):
            from quark_onnx.check import check

            verdict = check(quantized)
            report.check = verdict.to_dict()

        if model_output is not None:
            with _stage(report, "save"):
                model_io.save_model(
                    quantized,
                    model_output,
                    input_path=input_path,
                    overwrite=overwrite,
                    # None: external data only above the 2 GB protobuf limit
                    external_data=True if self.qconfig.use_external_data_format else None,
                )
                report.output = str(model_output)
        logger.info("%s: quantized in %.2f s", source, report.total_seconds)
        if self.qconfig.print_summary:
            logger.info("%s: %s", source, report.summary())
        return quantized

    # -- stages -------------------------------------------------------------------------------

    def _power_of_two(
        self,
        report: QuantizationReport,
        source: str,
        model: Any,
        prepared: onnx.ModelProto,
        plan: Any,
        result: Any,
        samples: list[dict[str, np.ndarray]],
        external_dir: Path | None = None,
    ) -> None:
        """The XINT8 flow: positions, NPU constraints, InsertQDQ(plan, positions), accuracy."""
        options = self.options
        with _stage(report, "positions"):
            positions, errors = self._initial_positions(model, plan, result)
            ranges = _calibrated_ranges(plan, result)
        with _stage(report, "constraints"):
            from quark_onnx.constraints import solve_positions

            ceilings = {
                name: p + CLIP_CEILING
                for name, (_, p) in ranges.items()
                if plan.tensors[name].is_graph_output
            }
            solved = solve_positions(plan, positions, options, errors, ceilings)
            report.adjustments = [a.__dict__ for a in solved.adjustments]
            report.unfixable = [v.message for v in solved.unfixable]
            for violation in solved.unfixable:
                logger.warning("%s: NPU rule cannot be met: %s", source, violation.message)
            report.positions = dict(solved.positions)
            report.range_clips = _range_clips(plan, ranges, positions, solved.positions)
            for clip in report.range_clips:
                logger.warning("%s: %s", source, clip["message"])
            from quark_onnx.npu import costs

            report.position_costs = costs.forced_position_costs(
                positions,
                solved.positions,
                errors,
                costs.activation_mean_squares(plan, result),
                solved.adjustments,
            )
            costly = [e for e in report.position_costs if e["cost_db"] >= costs.COST_WARN_DB]
            if costly:  # one line: the rules are the NPU's, the user can only read the cost
                logger.warning(
                    "%s: NPU rules cost %d tensor(s) >= %.0f dB of their own SQNR "
                    "(report.position_costs); worst: %s",
                    source,
                    len(costly),
                    costs.COST_WARN_DB,
                    costs.cost_message(costly[0]),
                )
            # the weight error curves read the (memory-mapped) float weights: let them go
            del errors

        with _stage(report, "insert_qdq"):
            from quark_onnx.passes.insert_qdq import InsertQDQ

            inserter = InsertQDQ(plan, solved.positions)
            inserter(model)
        self.params = inserter.params

        if samples and (self.qconfig.include_fast_ft or self.qconfig.include_bias_correction):
            _materialize(prepared, external_dir)
        if self.qconfig.include_fast_ft:
            with _stage(report, "adaround"):
                from quark_onnx.accuracy.adaround import adaround

                report.adaround = adaround(
                    prepared, model, samples, plan, solved.positions, options
                )
        if self.qconfig.include_bias_correction:
            with _stage(report, "bias_correction"):
                from quark_onnx.accuracy.bias_correction import correct_bias

                report.bias_correction = correct_bias(
                    prepared, model, samples, plan, solved.positions, options
                )
                # a corrected bias may move inside its shift_bias window
                report.positions.update(report.bias_correction.get("moved_bias_positions", {}))

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

    def _reference_outputs(
        self, source: str, model: Any, samples: list[dict[str, np.ndarray]]
    ) -> list[dict[str, np.ndarray]] | None:
        """The loaded model's outputs on ``samples`` (None: no samples, guard off, or onnxruntime
        cannot run them; calibration then reports a bad feed by name)."""
        if not samples or not self.options.FidelityCheck:
            return None
        from quark_onnx.pipeline import run_model

        try:
            return run_model(model, samples)
        except Exception as exc:  # onnxruntime raises its own exception types
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            logger.warning("%s: fidelity not measured: the model does not run: %s", source, first)
            return None

    def _prepare(
        self,
        model: Any,
        samples: list[dict[str, np.ndarray]],
        reference: list[dict[str, np.ndarray]] | None,
    ) -> list[dict]:
        from quark_onnx.pipeline import quantize_passes, run_passes

        saturation = None
        method = self.qconfig.calibrate_method
        if self.qconfig.enable_npu_cnn or isinstance(method, PowerOfTwoMethod):
            from quark_onnx import pof2

            qtype = self.qconfig.activation_type

            def saturation(cap: float) -> float:
                # the int8 range of the power-of-two position that holds the cap (6 -> 7.94)
                return pof2.code_range(qtype)[1] * 2.0 ** -pof2.position_for_abs_max(cap, qtype)

        # FoldConstantChannels reads the first sample's ranges
        first = samples[0] if samples else None
        # EqualizeGatedActivations reads the channel ranges of the first few samples
        passes = quantize_passes(self.qconfig, self.options, first, samples[:RANGE_SAMPLES])
        pipeline = run_passes(
            model,
            passes,
            sample_feeds=samples,
            saturation=saturation,
            revert_costly=self.options.RevertCostlyPasses,
            reference_outputs=reference,
        )
        return pipeline.as_dict()["passes"]

    def _guard_fidelity(
        self,
        report: QuantizationReport,
        source: str,
        model: Any,
        samples: list[dict[str, np.ndarray]],
        reference: list[dict[str, np.ndarray]],
        stages: tuple[onnx.ModelProto, Any, Path | None],
    ) -> None:
        """Measure every output against the original float model; warn (or raise) if unfaithful.

        The reference is the model the user gave, before any pass: the cost of the
        numerics-changing passes counts. When an output is not faithful, the per-layer error
        analysis (the tensors whose SQNR drops the most) names where it is lost.
        """
        from quark_onnx import fidelity
        from quark_onnx.pipeline import run_model

        options = self.options
        try:
            quantized = run_model(model, samples)
        except Exception as exc:  # onnxruntime raises its own exception types
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            logger.warning("%s: fidelity not measured: %s", source, first)
            report.fidelity = {"faithful": None, "error": first}
            return
        result = fidelity.FidelityResult(
            samples=len(samples),
            outputs=fidelity.compare_runs(
                reference,
                quantized,
                min_sqnr_db=options.FidelityMinSQNR,
                min_agreement=options.FidelityMinAgreement,
            ),
            min_sqnr_db=options.FidelityMinSQNR,
            min_agreement=options.FidelityMinAgreement,
        )
        if not result.faithful:
            result.worst_layers = self._worst_layers(report, samples, model, *stages)
        report.fidelity = result.to_dict()
        if result.faithful:
            logger.info(
                "%s: faithful on %d sample(s): %s",
                source,
                result.samples,
                "; ".join(f"{o.name}: {o.describe()}" for o in result.outputs),
            )
            return
        message = result.message(source)
        if options.RequireFidelity:
            raise FidelityError(message + " (RequireFidelity is set: no model was written)")
        logger.warning(message)

    def _worst_layers(
        self,
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

            _materialize(prepared, external_dir)
            try:
                errors = layer_errors(prepared, model, samples, plan)
            except QuarkOnnxError as exc:
                logger.info("per-layer error analysis failed: %s", exc)
                return []
        ranked = sorted(errors, key=lambda e: -e["drop_db"])[:count]
        return [
            {k: e[k] for k in ("tensor", "node", "op_type", "sqnr_db", "drop_db")} for e in ranked
        ]

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

    def _initial_positions(
        self, model: Any, plan: Any, result: Any
    ) -> tuple[dict[str, int], dict[str, Any]]:
        """Calibrated activation positions and weight/bias positions, before the NPU rules."""
        from quark_onnx import pof2
        from quark_onnx.plan import ACTIVATION_EQUALITY_OPS, TensorKind
        from quark_onnx.strategy import constant_data, constant_values

        method = self.qconfig.calibrate_method
        if not isinstance(method, PowerOfTwoMethod):
            raise QuantizationError(
                f"calibrate_method {method} does not give power-of-two "
                "scales; XINT8 needs PowerOfTwoMethod.MinMSE or NonOverflow"
            )
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
                positions[name] = pof2.weight_position(w, method, spec.qtype)
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


#: Calibration samples whose activation ranges the prepare passes read (EqualizeGatedActivations):
#: each is one onnxruntime run of the float model before calibration.
RANGE_SAMPLES = 8


#: A graph output (and the shared-scale group it is in) starts no higher than its NonOverflow
#: position + 1: at most the top half of its calibrated range is clipped. Outputs are what the
#: user reads (box offsets, scores); MinMSE alone may trade their extremes for resolution.
CLIP_CEILING = 1


def _calibrated_ranges(plan: Any, result: Any) -> dict[str, tuple[float, int]]:
    """Activation -> (calibrated max |x|, its int8 NonOverflow position)."""
    from quark_onnx import pof2
    from quark_onnx.plan import TensorKind

    ranges: dict[str, tuple[float, int]] = {}
    if result is None:
        return ranges
    for name, spec in plan.tensors.items():
        if spec.kind is not TensorKind.ACTIVATION:
            continue
        observer = result.observer(name)
        peak = max(abs(observer.min), abs(observer.max))
        if spec.range_max is not None:  # a ReLU6 made Relu saturates at its cap on purpose
            peak = min(peak, spec.range_max)
        if math.isfinite(peak) and peak > 0:
            ranges[name] = (peak, pof2.position_for_abs_max(peak, spec.qtype))
    return ranges


def _range_clips(
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
    from quark_onnx import pof2

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


def _check_architecture(
    model: Any, source: str, qconfig: QuantizationConfig, require_ready: bool
) -> None:
    """Warn (or, with ``require_ready``, refuse) before any work when NPU (XINT8) settings meet
    a model without Conv: the Vitis AI CNN flow is built around Conv layers (the check wants at
    least two) and leaves transformer ops float; float-scale presets fit such models."""
    if not qconfig.enable_npu_cnn:
        return
    if any(node.op_type == "Conv" for node in model.graph):
        return
    message = (
        f"{source}: the NPU (XINT8) settings are for CNNs and this model has no Conv node; "
        "the result will not be Vitis AI-ready and its LayerNormalization/Gelu/Softmax-style "
        "ops stay float. For transformers use A16W8 (accurate static), A8W8 or INT8_DYNAMIC"
    )
    if require_ready:
        raise ConfigError(message + " (refused because readiness is required)")
    logger.warning(message)


def _materialize(prepared: onnx.ModelProto, external_dir: Path | None) -> None:
    """Read external weights into ``prepared`` (no-op without external data): the layer replays
    of AdaRound, bias correction and error analysis run onnxruntime on model bytes. Called after
    the positions stage, whose weight error curves are gone by then, to keep the peak low."""
    if external_dir is not None:
        from quark_onnx import model_io

        model_io.materialize(prepared, external_dir)


class _PeekableReader:
    """Wraps a calibration reader: the first sample can be looked at without losing it, and the
    first ``keep`` samples are kept (bounded memory) for the stages that run after calibration
    (bias correction, AdaRound, error analysis)."""

    def __init__(self, reader: Any, keep: int = 0, specs: Sequence[Any] = ()) -> None:
        self._reader = reader
        self._specs = list(specs)  # the model's inputs: peeked feeds are checked against them
        self._ahead: list[dict[str, np.ndarray]] = []  # read by peek, not yet by get_next
        self._ended = False
        self._keep = keep
        self.kept: list[dict[str, np.ndarray]] = []
        # the wrapped reader's length, so that calibration's guard does not cap a reader of
        # known length (``--random-calib 100000`` reads 100,000 samples, not the default cap)
        self.num_samples: int | None = getattr(reader, "num_samples", None)

    def _remember(self, feed: dict[str, np.ndarray] | None) -> dict[str, np.ndarray] | None:
        if feed is not None and len(self.kept) < self._keep:
            self.kept.append({k: np.array(v, copy=True) for k, v in feed.items()})
        return feed

    def peek(self, count: int = 1) -> list[dict[str, np.ndarray]]:
        """Copies of the first ``count`` samples (fewer if the reader has fewer); get_next still
        returns them, in order.

        Raises:
            CalibrationError: a peeked feed is not a dict of the model's inputs (the message
                calibration would give for it).
        """
        from quark_onnx.calibration.readers import validate_feed

        while len(self._ahead) < count and not self._ended:
            feed = self._reader.get_next()
            if feed is None:
                self._ended = True
            else:
                if self._specs:
                    try:
                        validate_feed(feed, self._specs, len(self._ahead), len(self._ahead))
                    except CalibrationError as exc:
                        name = getattr(self._reader, "reader_name", type(self._reader).__name__)
                        raise CalibrationError(f"calibration data reader {name}: {exc}") from exc
                self._ahead.append(feed)
        return [{k: np.array(v, copy=True) for k, v in f.items()} for f in self._ahead[:count]]

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self._ahead:
            return self._remember(self._ahead.pop(0))
        if self._ended:
            return None
        return self._remember(self._reader.get_next())


def _check_path_arguments(**arguments: Any) -> None:
    """Refuse path arguments of the wrong type (a number, bytes, a list) with the argument named,
    instead of a ``TypeError`` from deep inside."""
    for name, value in arguments.items():
        allowed: tuple[type, ...] = (str, os.PathLike)
        if name == "model_input":
            allowed = (str, os.PathLike, onnx.ModelProto)
        elif value is None:
            continue
        if not isinstance(value, allowed):
            expected = "a path or an onnx.ModelProto" if name == "model_input" else "a path"
            raise ConfigError(f"{name} must be {expected}, got {type(value).__name__}")


def _make_reader(
    reader: Any,
    npz_path: str | os.PathLike | None,
    options: ExtraOptions,
    *,
    model: onnx.ModelProto,
    keep: int = 0,
) -> _PeekableReader | None:
    from quark_onnx.calibration import ArrayDataReader

    if reader is not None and npz_path is not None:
        raise ConfigError("give either calibration_data_reader or calibration_data_path, not both")
    if npz_path is not None:
        reader = _npz_reader(npz_path, model)
    elif isinstance(reader, dict):
        reader = ArrayDataReader(reader)
    if reader is not None and options.UseRandomData:
        # The Vitis AI documentation's XINT8 snippet sets UseRandomData and users pass their data
        # anyway: ranges taken from random inputs say nothing about the real ones, and the kept
        # samples that bias correction replays would be noise too, so the real data is used.
        logger.warning(
            "UseRandomData is set but calibration data was given: calibrating on the given data "
            "(unset UseRandomData to silence this)"
        )
    if reader is None and options.UseRandomData:
        from quark_onnx.calibration import reader_for

        reader = reader_for(model, None, options)  # kept samples then serve bias correction too
    if reader is None:
        return None  # a saved calibration result
    if not callable(getattr(reader, "get_next", None)):
        raise ConfigError(
            f"calibration_data_reader must have get_next() (onnxruntime's "
            f"CalibrationDataReader protocol); got {type(reader).__name__}"
        )
    if callable(getattr(reader, "bind", None)):
        reader.bind(model)  # readers that take their input name from the model (.npz files)
    from quark_onnx.calibration.readers import GuardedReader, input_specs

    return _PeekableReader(GuardedReader(reader, options), keep=keep, specs=input_specs(model))


def _npz_reader(path: str | os.PathLike, model: onnx.ModelProto) -> Any:
    """A reader of a ``.npz``/``.npy`` file as the CLI's ``--calib`` reads it: a single-input
    model takes the only array (or the one named like the input, or ``x``); a multi-input model
    takes one array per input, named like the inputs (stacked over samples on axis 0)."""
    from quark_onnx.calibration import ArrayDataReader, NpzDataReader
    from quark_onnx.calibration.readers import input_specs
    from quark_onnx.errors import CalibrationError

    names = [spec.name for spec in input_specs(model)]
    if len(names) <= 1:
        return NpzDataReader(path, input_name=names[0] if names else None)
    try:
        with np.load(path, allow_pickle=False) as archive:
            keys = list(archive.files)
            missing = [n for n in names if n not in keys]
            if missing:
                raise CalibrationError(
                    f"{path}: the model has inputs {names}; the archive has arrays {keys} "
                    f"(missing {missing}): save one array per input, named like the input"
                )
            arrays = {n: archive[n] for n in names}
    except (OSError, ValueError, AttributeError) as exc:
        raise CalibrationError(f"{path}: not a readable .npz file ({exc})") from exc
    return ArrayDataReader(arrays)


#: Stages that allocate and free a lot (model copies, onnxruntime sessions, replays): their freed
#: heap pages go back to the OS when they end, so the next stage's peak does not stack on them.
_LARGE_STAGES = frozenset({"prepare", "calibrate", "adaround", "bias_correction", "error_analysis"})


@contextmanager
def _stage(report: QuantizationReport, name: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        from quark_onnx import memory

        if name in _LARGE_STAGES:
            memory.release_freed_memory()
        report.timings[name] = round(time.perf_counter() - start, 4)
        peak = memory.peak_rss_mb()
        if peak is not None:
            report.peak_rss_mb[name] = peak
