"""The prepare pipeline: float graph rewrites chosen from the config, run in order, measured.

:func:`prepare_passes` returns the pipeline as data (a list of pass instances), so what will run
can be printed, tested and edited before anything runs::

    passes = prepare_passes(qconfig, qconfig.resolved_options())
    report = run_passes(model, passes, sample_feeds={"image": x})

Order and switches (each pass only when its switch is on; ``*``: changes numerics on purpose):

====  ==================================  ===============================================
 1    SimplifyWithOnnxsim                 ``qconfig.optimize_model``
 1b   RemoveInferenceDropout              always (inference Dropout is an identity)
 2    ConvertSplitToSlice                 ``ExtraOptions.ConvertSplitToSlice``
 3    ConvertBNToConv                     ``ExtraOptions.ConvertBNToConv``
 3b   FoldConstantChannels                ``ExtraOptions.FoldConstantChannels``
 4    ReplaceClip6Relu *                  ``ExtraOptions.ReplaceClip6Relu``
 4b   CrossLayerEqualization              ``qconfig.include_cle``
 5    ConvertClipToRelu *                 ``ExtraOptions.ConvertClipToRelu``
 6    ConvertReduceMeanToGlobalAvgPool    ``ExtraOptions.ConvertReduceMeanToGlobalAvgPool``
 7    SplitLargeKernelPool                ``ExtraOptions.SplitLargeKernelPool``
 8    ConvertSigmoidToHardSigmoid *       ``ExtraOptions.ConvertSigmoidToHardSigmoid``
 9    GraphCleanup                        always: drop unused nodes/initializers, sort
====  ==================================  ===============================================

Simplification comes first so the rewrites see folded constants; constant channels are folded
once BatchNorms are in the Convs' weights and before CLE, which must not pair a ~0 channel;
ReplaceClip6Relu precedes
ConvertClipToRelu so a ReLU6 becomes a plain Relu (no range cap) when both are on; ReduceMean is
turned into GlobalAveragePool before large pools are split.

:func:`run_passes` times each pass and, for passes with ``changes_numerics = True`` when sample
inputs are given, runs the model before and after that pass in onnxruntime (CPU, graph
optimizations off) and records ``max |after - before|`` per model output. Each run needs a full
in-memory copy of the model: above :data:`MEASURE_MAX_BYTES` of tensors (1 GiB) the differences
are not measured (one log line says so) and the records carry no ``max_abs_diff``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass, TopologicalSortPass

from quark_onnx.config import QuantizationConfig
from quark_onnx.errors import PassError
from quark_onnx.options import ExtraOptions
from quark_onnx.passes import (
    ConvertAvgPoolToDPUVersion,
    ConvertBNToConv,
    ConvertClipToRelu,
    ConvertHardSigmoidToDPUVersion,
    ConvertLeakyReluToDPUVersion,
    ConvertReduceMeanToGlobalAvgPool,
    ConvertSigmoidToHardSigmoid,
    ConvertSplitToSlice,
    CrossLayerEqualization,
    FixInputShapes,
    FoldConstantChannels,
    MakeConvAttributesExplicit,
    RemoveInferenceDropout,
    ReplaceClip6Relu,
    SimplifyWithOnnxsim,
    SplitLargeKernelPool,
)
from quark_onnx.passes.base import QuarkPass

logger = logging.getLogger(__name__)

#: Output differences of numerics-changing passes are measured only up to this model size.
MEASURE_MAX_BYTES = 1 << 30


class GraphCleanup(QuarkPass):
    """Remove nodes and initializers nothing reads, then sort the nodes topologically.

    Wraps onnx_ir's ``RemoveUnusedNodesPass`` and ``TopologicalSortPass``; the model's inputs and
    outputs are never removed.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        removed = RemoveUnusedNodesPass()(model).modified
        order = [id(node) for node in model.graph]
        TopologicalSortPass()(model)
        resorted = order != [id(node) for node in model.graph]
        return ir.passes.PassResult(model, modified=removed or resorted)


def prepare_passes(
    qconfig: QuantizationConfig,
    options: ExtraOptions,
    sample_feeds: dict[str, np.ndarray] | None = None,
) -> list[QuarkPass]:
    """The prepare-stage passes for ``qconfig`` and its resolved ``options``, in run order.

    ``sample_feeds`` (model inputs, e.g. the first calibration batch) lets FoldConstantChannels
    also fold channels the samples show clamped to one value with a wide margin.

    Cross-layer equalization (``include_cle``) runs right after ReplaceClip6Relu — ReLU6 blocks it,
    plain Relu does not — and before ConvertClipToRelu, whose range cap it must not rescale.
    """
    cle = CrossLayerEqualization(
        steps=options.CLESteps,
        threshold=options.CLETotalLayerDiffThreshold,
        scale_append_bias=options.CLEScaleAppendBias,
    )
    chosen: list[tuple[bool, QuarkPass | type[QuarkPass]]] = [
        (qconfig.optimize_model, SimplifyWithOnnxsim),
        (True, RemoveInferenceDropout),
        (options.ConvertSplitToSlice, ConvertSplitToSlice),
        (options.ConvertBNToConv, ConvertBNToConv),
        (
            options.FoldConstantChannels,
            FoldConstantChannels(
                tolerance=options.FoldConstantChannelsTolerance, sample_feeds=sample_feeds
            ),
        ),
        (options.ReplaceClip6Relu, ReplaceClip6Relu),
        (qconfig.include_cle, cle),
        (options.ConvertClipToRelu, ConvertClipToRelu),
        (options.ConvertReduceMeanToGlobalAvgPool, ConvertReduceMeanToGlobalAvgPool),
        (options.SplitLargeKernelPool, SplitLargeKernelPool),
        (options.ConvertSigmoidToHardSigmoid, ConvertSigmoidToHardSigmoid),
    ]
    passes: list[QuarkPass] = [
        p if isinstance(p, QuarkPass) else p() for enabled, p in chosen if enabled
    ]
    passes.append(GraphCleanup())
    return passes


def finalize_passes(qconfig: QuantizationConfig, options: ExtraOptions) -> list[QuarkPass]:
    """Passes run on the quantized model before it is written.

    Static input shapes (``FixShapes``, ``FixDynamicBatch``) are applied here rather than before
    calibration, so that calibration can run several samples per batch on a dynamic-batch model.
    """
    from quark_onnx.passes.fix_input_shapes import parse_fix_shapes

    shapes = parse_fix_shapes(options.FixShapes)
    if shapes or options.FixDynamicBatch:
        return [FixInputShapes(shapes, batch=options.FixDynamicBatch)]
    return []


def quantize_passes(
    qconfig: QuantizationConfig,
    options: ExtraOptions,
    sample_feeds: dict[str, np.ndarray] | None = None,
) -> list[QuarkPass]:
    """Every float pass that runs before calibration, in run order (``sample_feeds``: as for
    :func:`prepare_passes`).

    The prepare passes (cross-layer equalization among them), then for NPU configs
    (``enable_npu_cnn``) the DPU simulation passes (``SimulateDPU`` and the individual
    ``Convert*ToDPUVersion`` switches) — before calibration, so that the ranges are those of the
    hardware's arithmetic — and the explicit Conv attributes the Vitis AI EP requires.
    """
    passes = prepare_passes(qconfig, options, sample_feeds)
    if qconfig.enable_npu_cnn:
        if options.SimulateDPU:
            if options.ConvertLeakyReluToDPUVersion:
                passes.append(ConvertLeakyReluToDPUVersion())
            if options.ConvertHardSigmoidToDPUVersion:
                passes.append(ConvertHardSigmoidToDPUVersion())
            if options.ConvertAvgPoolToDPUVersion:
                passes.append(
                    ConvertAvgPoolToDPUVersion(reduce_mean=options.ConvertReduceMeanToDPUVersion)
                )
        passes.append(MakeConvAttributesExplicit())
    passes.append(GraphCleanup())
    return passes


@dataclass(frozen=True)
class PassRecord:
    """What one pass did.

    Attributes:
        name: the pass's class name.
        modified: whether it changed the model.
        seconds: wall time of the pass.
        changes_numerics: the pass changes the float model's outputs on purpose.
        max_abs_diff: output name -> ``max |after - before|`` on the sample inputs; only for
            numerics-changing passes that modified the model when sample inputs were given
            (``{}`` otherwise).
    """

    name: str
    modified: bool
    seconds: float
    changes_numerics: bool = False
    max_abs_diff: dict[str, float] = field(default_factory=dict)


@dataclass
class PipelineReport:
    """Per-pass records of one :func:`run_passes` call, in run order."""

    passes: list[PassRecord] = field(default_factory=list)

    @property
    def modified(self) -> bool:
        return any(record.modified for record in self.passes)

    @property
    def seconds(self) -> float:
        return sum(record.seconds for record in self.passes)

    def record(self, name: str) -> PassRecord:
        """The record of the (first) pass called ``name``."""
        for rec in self.passes:
            if rec.name == name:
                return rec
        raise KeyError(f"no pass named {name!r} in this report")

    def as_dict(self) -> dict:
        return {"passes": [dataclasses.asdict(r) for r in self.passes]}


def _model_label(model: ir.Model) -> str:
    return repr(model.graph.name or "<unnamed graph>")


def run_model(model: ir.Model, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """All outputs of ``model`` on ``feeds`` (onnxruntime, CPU, graph optimizations off)."""
    import onnxruntime as ort

    from quark_onnx.model_io import to_proto

    proto = to_proto(model)  # weights memory-mapped from external data are read in
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    session = ort.InferenceSession(
        proto.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds), strict=True))


def _try_run(
    model: ir.Model, feeds: dict[str, np.ndarray], when: str
) -> dict[str, np.ndarray] | None:
    """:func:`run_model`, or None (with a warning) when onnxruntime cannot run the model."""
    try:
        return run_model(model, feeds)
    except Exception as exc:  # onnxruntime raises its own exception types
        logger.warning(
            "cannot measure the output difference %s on model %s: onnxruntime failed (%s)",
            when,
            _model_label(model),
            str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
        )
        return None


def _max_abs_diff(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> dict[str, float]:
    diffs: dict[str, float] = {}
    for name, ref in before.items():
        if name not in after:
            continue
        a = np.asarray(after[name], dtype=np.float64)
        b = np.asarray(ref, dtype=np.float64)
        diffs[name] = float(np.max(np.abs(a - b))) if a.size else 0.0
    return diffs


def run_passes(
    model: ir.Model,
    passes: Sequence[QuarkPass],
    *,
    sample_feeds: dict[str, np.ndarray] | None = None,
) -> PipelineReport:
    """Run ``passes`` on ``model`` in place, in order; report what each did.

    Raises:
        PassError: a pass raised; the message names the pass and the model.
    """
    report = PipelineReport()
    outputs: dict[str, np.ndarray] | None = None  # outputs of the current model, when known
    if sample_feeds is not None and any(getattr(p, "changes_numerics", False) for p in passes):
        from quark_onnx.model_io import model_bytes

        size = model_bytes(model)
        if size > MEASURE_MAX_BYTES:
            logger.info(
                "model %s holds %.2f GiB of tensors (above %.2f GiB): the output differences of "
                "numerics-changing passes are not measured (each measurement copies the model)",
                _model_label(model),
                size / (1 << 30),
                MEASURE_MAX_BYTES / (1 << 30),
            )
            sample_feeds = None
    for pass_ in passes:
        name = type(pass_).__name__
        measure = bool(getattr(pass_, "changes_numerics", False)) and sample_feeds is not None
        if measure and outputs is None:
            outputs = _try_run(model, sample_feeds, f"before {name}")
            measure = outputs is not None
        start = time.perf_counter()
        try:
            result = pass_(model)
        except PassError:
            raise
        except Exception as exc:
            raise PassError(
                f"pass {name} failed on model {_model_label(model)}: {type(exc).__name__}: {exc}"
            ) from exc
        seconds = time.perf_counter() - start
        diffs: dict[str, float] = {}
        if result.modified:
            if measure:
                after = _try_run(model, sample_feeds, f"after {name}")
                diffs = {} if after is None else _max_abs_diff(outputs, after)
                outputs = after
            else:
                outputs = None
            logger.info(
                "%s changed the graph in %.3f s%s",
                name,
                seconds,
                f"; max |output difference| {diffs}" if diffs else "",
            )
        report.passes.append(
            PassRecord(
                name=name,
                modified=result.modified,
                seconds=seconds,
                changes_numerics=bool(getattr(pass_, "changes_numerics", False)),
                max_abs_diff=diffs,
            )
        )
    return report
