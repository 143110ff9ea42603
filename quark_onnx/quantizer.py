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

import logging
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from quark_onnx.config import Config, QuantizationConfig
from quark_onnx.enums import PowerOfTwoMethod
from quark_onnx.errors import ConfigError, QuantizationError
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

    @property
    def qconfig(self) -> QuantizationConfig:
        return self.config.global_quant_config

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

        Returns:
            The quantized model. :attr:`report` holds what every stage did.
        """
        from quark_onnx import model_io

        options = self.qconfig.validate()
        self.options = options
        self.params = None
        source = str(model_input) if not isinstance(model_input, onnx.ModelProto) else "<model>"
        report = QuantizationReport(model=source, settings=self.qconfig.effective_settings())
        self.report = report
        input_path = None if isinstance(model_input, onnx.ModelProto) else Path(model_input)
        if model_output is not None:
            model_io.check_output_path(model_output, input_path, overwrite)

        with _stage(report, "load"):
            if isinstance(model_input, onnx.ModelProto):
                proto = model_io.validate_proto(model_input)
                model = model_io.to_ir(proto)
            else:
                # external weights stay in their files, memory-mapped on use
                model = model_io.load_ir(model_input)
                proto = model_io.to_proto(model, keep_external=True)

        reader = _make_reader(
            calibration_data_reader,
            calibration_data_path,
            options,
            model=proto,
            keep=self._samples_to_keep(),
        )
        del proto  # only the reader's checks read it: its weight bytes need not stay resident
        sample = reader.peek() if reader is not None else None
        with _stage(report, "prepare"):
            report.passes = self._prepare(model, sample)

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

        samples = reader.kept if reader is not None else []
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
        with _stage(report, "finalize"):
            from quark_onnx.pipeline import finalize_passes, run_passes

            report.passes += run_passes(model, finalize_passes(self.qconfig, options)).as_dict()[
                "passes"
            ]
            quantized = model_io.to_proto(model)

        with _stage(report, "check"):
            from quark_onnx.check import check

            verdict = check(quantized)
            report.check = verdict.to_dict()

        if model_output is not None:
            with _stage(report, "save"):
                model_io.save_model(
                    quantized, model_output, input_path=input_path, overwrite=overwrite
                )
                report.output = str(model_output)
        logger.info("%s: quantized in %.2f s", source, report.total_seconds)
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
        with _stage(report, "constraints"):
            from quark_onnx.constraints import solve_positions

            solved = solve_positions(plan, positions, options, errors)
            report.adjustments = [a.__dict__ for a in solved.adjustments]
            report.unfixable = [v.message for v in solved.unfixable]
            for violation in solved.unfixable:
                logger.warning("%s: NPU rule cannot be met: %s", source, violation.message)
            report.positions = dict(solved.positions)
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

    def _samples_to_keep(self) -> int:
        """Calibration samples kept in memory for the stages that need data after calibration."""
        if not (
            self.qconfig.include_fast_ft
            or self.qconfig.include_bias_correction
            or self.options.LayerErrorAnalysis
        ):
            return 0
        return self.options.AccuracySamples

    def _prepare(self, model: Any, sample: dict[str, np.ndarray] | None) -> list[dict]:
        from quark_onnx.pipeline import quantize_passes, run_passes

        passes = quantize_passes(self.qconfig, self.options)
        pipeline = run_passes(model, passes, sample_feeds=sample)
        return pipeline.as_dict()["passes"]

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
            )
        return calibrate(
            prepared,
            names,
            reader,
            method=self.qconfig.calibrate_method,
            options=self.options,
            progress=progress,
            external_data_dir=external_dir,
        )

    def _initial_positions(
        self, model: Any, plan: Any, result: Any
    ) -> tuple[dict[str, int], dict[str, Any]]:
        """Calibrated activation positions and weight/bias positions, before the NPU rules."""
        from quark_onnx import pof2
        from quark_onnx.plan import TensorKind
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
        return positions, errors


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

    def __init__(self, reader: Any, keep: int = 0) -> None:
        self._reader = reader
        self._first: dict[str, np.ndarray] | None = None
        self._peeked = False
        self._keep = keep
        self.kept: list[dict[str, np.ndarray]] = []

    def _remember(self, feed: dict[str, np.ndarray] | None) -> dict[str, np.ndarray] | None:
        if feed is not None and len(self.kept) < self._keep:
            self.kept.append({k: np.array(v, copy=True) for k, v in feed.items()})
        return feed

    def peek(self) -> dict[str, np.ndarray] | None:
        if not self._peeked:
            self._first = self._reader.get_next()
            self._peeked = True
        return self._first

    def get_next(self) -> dict[str, np.ndarray] | None:
        if self._peeked:
            self._peeked = False
            first, self._first = self._first, None
            return self._remember(first)
        return self._remember(self._reader.get_next())


def _make_reader(
    reader: Any,
    npz_path: str | os.PathLike | None,
    options: ExtraOptions,
    *,
    model: onnx.ModelProto,
    keep: int = 0,
) -> _PeekableReader | None:
    from quark_onnx.calibration import ArrayDataReader, NpzDataReader

    if reader is not None and npz_path is not None:
        raise ConfigError("give either calibration_data_reader or calibration_data_path, not both")
    if npz_path is not None:
        reader = NpzDataReader(npz_path)
    elif isinstance(reader, dict):
        reader = ArrayDataReader(reader)
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
    return _PeekableReader(reader, keep=keep)


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
