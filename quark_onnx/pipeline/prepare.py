"""The prepare pipeline: float graph rewrites chosen from the config, run in order, measured.

:func:`prepare_passes` returns the pipeline as data (a list of pass instances), so what will run
can be printed, tested and edited before anything runs::

    passes = prepare_passes(qconfig, qconfig.resolved_options())
    report = run_passes(model, passes, sample_feeds={"image": x})

Order and switches (each pass only when its switch is on; ``*``: changes numerics on purpose):

====  ====================================  ====================================================
 1    SimplifyWithOnnxsim                   ``qconfig.optimize_model``
 1b   RemoveInferenceDropout                always (inference Dropout is an identity)
 1c   RemoveIdentity                        always (Identity nodes block the patterns)
 2    ConvertSplitToSlice                   ``ExtraOptions.ConvertSplitToSlice``
 3    FoldConvAffine, ConvertBNToConv       ``ExtraOptions.ConvertBNToConv``
 3b   FoldConstantChannels                  ``ExtraOptions.FoldConstantChannels``
 4    ReplaceClip6Relu *                    ``ExtraOptions.ReplaceClip6Relu``
 4b   CrossLayerEqualization                ``qconfig.include_cle``
 4c   EqualizeGatedActivations              ``ExtraOptions.EqualizeGatedActivations``
 4d   EqualizeResidualStreams               ``ExtraOptions.EqualizeResidualStreams``
 4e   MigrateActivationOutliers             ``ExtraOptions.MigrateActivationOutliers``
 5    ConvertClipToRelu *                   ``ExtraOptions.ConvertClipToRelu``
 6    ConvertReduceMeanToGlobalAvgPool      ``ExtraOptions.ConvertReduceMeanToGlobalAvgPool``
 7    SplitLargeKernelPool                  ``ExtraOptions.SplitLargeKernelPool``
 7b   ConvertGlobalAvgPoolToDepthwiseConv   ``ExtraOptions.ConvertGlobalAvgPoolToDepthwiseConv``
 8    ConvertSigmoidToHardSigmoid *         ``ExtraOptions.ConvertSigmoidToHardSigmoid``
 9    GraphCleanup                          always: drop unused nodes/initializers, sort
====  ====================================  ====================================================

Simplification comes first so the rewrites see folded constants; constant channels are folded
once BatchNorms are in the Convs' weights and before CLE, which must not pair a ~0 channel;
ReplaceClip6Relu precedes ConvertClipToRelu (both keep the bound as the Relu's range cap);
ReduceMean becomes GlobalAveragePool before large pools are split, then global pools Convs.

:func:`run_passes` times each pass and, for passes with ``changes_numerics = True`` when sample
inputs are given, runs the model before and after that pass in onnxruntime (CPU, graph
optimizations off) on every sample and records per model output ``max |after - before|`` and the
fidelity of the new outputs to the old ones (:func:`quark_onnx.fidelity.verdict.compare_runs`: SQNR,
cosine, top-1 agreement for score vectors). The outputs before a pass are those of the last run
while no pass changed the graph since, or only passes whose outputs are the same bits
(``preserves_outputs``: GraphCleanup). An optional pass whose outputs fall below
:data:`PASS_MIN_SQNR_DB` or :data:`PASS_MIN_AGREEMENT` is a warning that names the pass, what it
cost and the option that turns it off (a pass that simulates the NPU's arithmetic is reported
only). The runs see the model as the quantizer will compute it:
a range cap (``quark_onnx.range_max``, left by ReplaceClip6Relu and ConvertClipToRelu) saturates
its Relu at the value ``saturation(cap)`` gives (the power-of-two int8 range that holds the cap,
for XINT8), so a ReLU6 made Relu is charged for what passes 6, not for the unbounded Relu. Each
run needs a full in-memory copy of the model: above :data:`MEASURE_MAX_BYTES` of tensors (1 GiB)
the differences are not measured (one log line says so) and the records carry no measurement.
When the outputs before a measured pass are not known yet, the runs before and after it share
one session (:mod:`quark_onnx.fidelity.paired_run`): the part of the graph the pass left is computed
once.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass, TopologicalSortPass

from quark_onnx.config.enums import PowerOfTwoMethod
from quark_onnx.config.options import ExtraOptions
from quark_onnx.config.quantization import QuantizationConfig
from quark_onnx.errors import PassError
from quark_onnx.passes import (
    ConvertAvgPoolToDPUVersion,
    ConvertBNToConv,
    ConvertClipToRelu,
    ConvertGlobalAvgPoolToDepthwiseConv,
    ConvertHardSigmoidToDPUVersion,
    ConvertLeakyReluToDPUVersion,
    ConvertReduceMeanToGlobalAvgPool,
    ConvertSigmoidToHardSigmoid,
    ConvertSplitToSlice,
    CrossLayerEqualization,
    EqualizeGatedActivations,
    EqualizeResidualStreams,
    FixInputShapes,
    FoldConstantChannels,
    FoldConvAffine,
    MakeConvAttributesExplicit,
    MigrateActivationOutliers,
    RemoveIdentity,
    RemoveInferenceDropout,
    ReplaceClip6Relu,
    SimplifyWithOnnxsim,
    SplitLargeKernelPool,
)
from quark_onnx.passes.base import QuarkPass
from quark_onnx.passes.fix_input_shapes import parse_fix_shapes

if TYPE_CHECKING:
    from quark_onnx.fidelity.verdict import OutputFidelity

logger = logging.getLogger(__name__)

#: Output differences of numerics-changing passes are measured only up to this model size.
MEASURE_MAX_BYTES = 1 << 30

#: An optional numerics-changing pass (ReplaceClip6Relu, ConvertSigmoidToHardSigmoid, ...) is an
#: approximation made for the NPU; its noise should stay an order of magnitude below what int8
#: quantization itself leaves at the outputs of a good model (15-25 dB): 30 dB on every output,
#: score vectors included, and 0.9 top-1 agreement. Below that the user is told which pass and
#: option (and RevertCostlyPasses undoes it). Passes that simulate the NPU's arithmetic are
#: measured and reported only.
PASS_MIN_SQNR_DB = 30.0
PASS_MIN_AGREEMENT = 0.9


class GraphCleanup(QuarkPass):
    """Remove nodes and initializers nothing reads, then sort the nodes topologically.

    Wraps onnx_ir's ``RemoveUnusedNodesPass`` and ``TopologicalSortPass``; the model's inputs and
    outputs are never removed. The outputs stay the same bits (every node that remains computes
    what it did, from the same inputs): :func:`run_passes` keeps the outputs it measured before.
    """

    #: The model's outputs are bit-identical after the pass (no rerun to measure the next pass).
    preserves_outputs = True

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
    range_samples: Sequence[dict[str, np.ndarray]] | None = None,
) -> list[QuarkPass]:
    """The prepare-stage passes for ``qconfig`` and its resolved ``options``, in run order.

    ``sample_feeds`` (model inputs, e.g. the first calibration batch) lets FoldConstantChannels
    also fold channels the samples show clamped to one value with a wide margin, and lets
    CrossLayerEqualization's component gate weigh the activations it rescales.
    ``range_samples`` (the first calibration samples; default ``[sample_feeds]``) give
    EqualizeGatedActivations, EqualizeResidualStreams and MigrateActivationOutliers the
    activations' channel ranges.

    Cross-layer equalization (``include_cle``) runs after ReplaceClip6Relu and before
    ConvertClipToRelu: a ReLU6, or the range cap either pass leaves, blocks a pair (the cap holds
    for the unscaled channels only), a plain Relu does not.
    """
    cle = CrossLayerEqualization(
        steps=options.CLESteps,
        threshold=options.CLETotalLayerDiffThreshold,
        scale_append_bias=options.CLEScaleAppendBias,
        gate="component",
        sample_feeds=sample_feeds,
    )
    ranges = [sample_feeds] if range_samples is None and sample_feeds else range_samples
    chosen: list[tuple[bool, QuarkPass | type[QuarkPass]]] = [
        (qconfig.optimize_model, SimplifyWithOnnxsim),
        (True, RemoveInferenceDropout),
        (True, RemoveIdentity),
        (options.ConvertSplitToSlice, ConvertSplitToSlice),
        (options.ConvertBNToConv, FoldConvAffine),  # a BN after a bias Add too; then the rest
        (options.ConvertBNToConv, ConvertBNToConv),
        (
            options.FoldConstantChannels,
            FoldConstantChannels(
                tolerance=options.FoldConstantChannelsTolerance, sample_feeds=sample_feeds
            ),
        ),
        (options.ReplaceClip6Relu, ReplaceClip6Relu),
        (qconfig.include_cle, cle),
        (options.EqualizeGatedActivations, EqualizeGatedActivations(ranges)),
        (options.EqualizeResidualStreams, EqualizeResidualStreams(ranges)),
        (
            options.MigrateActivationOutliers,
            # an NPU runs no float Mul: there a residual Add blocks the rescaling
            MigrateActivationOutliers(
                ranges,
                alpha=options.SmoothAlpha,
                restore=not qconfig.enable_npu_cnn,
                scales=options.MigrateActivationOutliersScales,
            ),
        ),
        (options.ConvertClipToRelu, ConvertClipToRelu),
        (options.ConvertReduceMeanToGlobalAvgPool, ConvertReduceMeanToGlobalAvgPool),
        (options.SplitLargeKernelPool, SplitLargeKernelPool),
        (options.ConvertGlobalAvgPoolToDepthwiseConv, ConvertGlobalAvgPoolToDepthwiseConv),
        (options.ConvertSigmoidToHardSigmoid, ConvertSigmoidToHardSigmoid),
    ]
    passes: list[QuarkPass] = [
        p if isinstance(p, QuarkPass) else p() for enabled, p in chosen if enabled
    ]
    passes.append(GraphCleanup())
    return passes


def finalize_passes(qconfig: QuantizationConfig, options: ExtraOptions) -> list[QuarkPass]:
    """Passes run on the quantized model before it is written: static input shapes (``FixShapes``,
    ``FixDynamicBatch``; not before calibration, which may batch samples on a dynamic batch) and,
    for NPU configs, explicit Conv attributes again (an ``auto_pad`` Conv's pads need the shapes).
    """
    shapes = parse_fix_shapes(options.FixShapes)
    if not (shapes or options.FixDynamicBatch):
        return []
    fix = FixInputShapes(shapes, batch=options.FixDynamicBatch)
    return [fix, MakeConvAttributesExplicit()] if qconfig.enable_npu_cnn else [fix]


def quantize_passes(
    qconfig: QuantizationConfig,
    options: ExtraOptions,
    sample_feeds: dict[str, np.ndarray] | None = None,
    range_samples: Sequence[dict[str, np.ndarray]] | None = None,
) -> list[QuarkPass]:
    """Every float pass that runs before calibration, in run order (``sample_feeds``: as for
    :func:`prepare_passes`).

    With ``FixShapes``, FixInputShapes first (all but a dynamic batch); the prepare passes; for
    NPU configs (``enable_npu_cnn``) the DPU simulation passes (``SimulateDPU``, the individual
    ``Convert*ToDPUVersion`` switches) — before calibration, so that the ranges are those of the
    hardware's arithmetic — and the explicit Conv attributes the Vitis AI EP requires.
    """
    passes = prepare_passes(qconfig, options, sample_feeds, range_samples)
    if shapes := parse_fix_shapes(options.FixShapes):  # pools need H and W; the batch waits
        passes.insert(0, FixInputShapes(shapes, keep_batch=True))
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
        fidelity: per output, the fidelity of the outputs after the pass to those before
            (:meth:`quark_onnx.fidelity.verdict.OutputFidelity.to_dict`; same condition).
        warning: the warning logged when the pass cost more than the thresholds, else None.
        reverted: the pass cost more than the thresholds and was undone
            (``RevertCostlyPasses``): the model is as it was before the pass.
    """

    name: str
    modified: bool
    seconds: float
    changes_numerics: bool = False
    max_abs_diff: dict[str, float] = field(default_factory=dict)
    fidelity: list[dict] = field(default_factory=list)
    warning: str | None = None
    reverted: bool = False


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


Feeds = dict[str, np.ndarray]


def run_model(
    model: ir.Model,
    feeds: Feeds | Sequence[Feeds],
    *,
    saturation: Callable[[float], float] | None = None,
) -> Any:
    """All outputs of ``model`` on ``feeds`` (onnxruntime, CPU, graph optimizations off).

    One feed gives one ``{output: array}`` dict; a sequence of feeds gives a list of them. With
    ``saturation``, every Relu whose output carries a range cap is run as
    ``Clip(x, 0, saturation(cap))`` (the model itself is not changed).
    """
    from quark_onnx.runtime import sessions

    if saturation is None:
        # in pieces of at most runtime.SEGMENT_NODES nodes: the memory of a long graph's
        # session is bounded by the piece (the same values as one session)
        batch = [feeds] if isinstance(feeds, dict) else feeds
        runs = sessions.run_outputs(model, batch, purpose="run_model")
        return runs[0] if isinstance(feeds, dict) else runs
    session = sessions.create_session(model, purpose="run_model", edit=_saturator(saturation))
    names = [o.name for o in session.get_outputs()]
    if isinstance(feeds, dict):
        return dict(zip(names, session.run(names, feeds), strict=True))
    return [dict(zip(names, session.run(names, feed), strict=True)) for feed in feeds]


def _saturator(
    saturation: Callable[[float], float] | None,
) -> Callable[[onnx.ModelProto], None] | None:
    if saturation is None:
        return None
    return lambda proto: _saturate_capped_relus(proto, saturation)


def _saturate_capped_relus(proto: onnx.ModelProto, saturation: Callable[[float], float]) -> None:
    """Run each Relu of ``proto`` whose output has a range cap as ``Clip(0, saturation(cap))``."""
    from quark_onnx.graph.ir import RANGE_MAX_KEY

    graph = proto.graph
    caps = {
        info.name: float(prop.value)
        for info in (*graph.value_info, *graph.output)
        for prop in info.metadata_props
        if prop.key == RANGE_MAX_KEY
    }
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 13)
    for node in proto.graph.node:
        if node.op_type != "Relu" or node.domain not in ("", "ai.onnx"):
            continue
        cap = caps.get(node.output[0])
        if cap is None:
            continue
        high = float(saturation(cap))
        node.op_type = "Clip"
        if opset < 11:
            node.attribute.extend(
                [onnx.helper.make_attribute("min", 0.0), onnx.helper.make_attribute("max", high)]
            )
            continue
        names = [f"{node.output[0]}__saturation_{bound}" for bound in ("low", "high")]
        for name, value in zip(names, (0.0, high), strict=True):
            proto.graph.initializer.append(
                onnx.numpy_helper.from_array(np.array(value, dtype=np.float32), name)
            )
        node.input.extend(names)


def _try_run(
    model: ir.Model, feeds: Sequence[Feeds], when: str, saturation: Callable[[float], float] | None
) -> list[dict[str, np.ndarray]] | None:
    """:func:`run_model`, or None (with a warning) when onnxruntime cannot run the model."""
    try:
        return run_model(model, feeds, saturation=saturation)
    except Exception as exc:  # onnxruntime raises its own exception types
        logger.warning(
            "cannot measure the output difference %s on model %s: onnxruntime failed (%s)",
            when,
            _model_label(model),
            str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
        )
        return None


def _try_run_pair(
    before: ir.Model,
    after: ir.Model,
    feeds: Sequence[Feeds],
    name: str,
    saturation: Callable[[float], float] | None,
) -> tuple[list[dict[str, np.ndarray]] | None, list[dict[str, np.ndarray]] | None]:
    """The outputs of the models ``before`` and ``after`` pass ``name`` (None: does not run),
    in one session when they pair (:func:`quark_onnx.fidelity.paired_run.run_before_after`)."""
    from quark_onnx.fidelity.paired_run import run_before_after

    try:
        pair = run_before_after(before, after, feeds, _saturator(saturation))
    except Exception:  # onnxruntime's own types; the separate runs below warn what failed
        pair = None
    if pair is not None:
        return pair
    outputs = _try_run(before, feeds, f"before {name}", saturation)
    if outputs is None:
        return None, None
    return outputs, _try_run(after, feeds, f"after {name}", saturation)


def _max_abs_diff(
    before: Sequence[dict[str, np.ndarray]], after: Sequence[dict[str, np.ndarray]]
) -> dict[str, float]:
    diffs: dict[str, float] = {}
    for ref_run, new_run in zip(before, after, strict=True):
        for name, ref in ref_run.items():
            if name not in new_run:
                continue
            a = np.asarray(new_run[name], dtype=np.float64)
            b = np.asarray(ref, dtype=np.float64)
            diff = float(np.max(np.abs(a - b))) if a.size else 0.0
            diffs[name] = max(diffs.get(name, 0.0), diff)
    return diffs


def _cost_warning(
    name: str, model: ir.Model, fidelity: Sequence[OutputFidelity], reverted: bool
) -> str | None:
    """The warning for a pass whose outputs fell below the pass thresholds, else None."""
    bad = [f for f in fidelity if not f.faithful]
    if not bad:
        return None
    what = "; ".join(f"output {f.name!r}: {f.describe()}" for f in bad)
    text = (
        f"{name} changed the float outputs of model {_model_label(model)} by more than a graph "
        f"pass should ({what}; thresholds SQNR >= {PASS_MIN_SQNR_DB:g} dB, top-1 agreement >= "
        f"{PASS_MIN_AGREEMENT:g})"
    )
    if reverted:
        return text + (
            f": undone, the original operations are kept (RevertCostlyPasses; set it to False "
            f"to apply {name} anyway)"
        )
    return text + f"; set the extra option {name}=False to keep the original operations"


def run_passes(
    model: ir.Model,
    passes: Sequence[QuarkPass],
    *,
    sample_feeds: Feeds | Sequence[Feeds] | None = None,
    saturation: Callable[[float], float] | None = None,
    revert_costly: bool = False,
    reference_outputs: Sequence[dict[str, np.ndarray]] | None = None,
) -> PipelineReport:
    """Run ``passes`` on ``model`` in place, in order; report what each did.

    ``sample_feeds``: one feed or several, on which numerics-changing passes are measured;
    ``saturation``: see :func:`run_model` (how a range cap saturates in the quantized model);
    ``revert_costly``: undo a measured pass whose outputs fall below the pass thresholds
    (the graph before the pass is kept: a clone sharing the weights' tensors, so cheap);
    ``reference_outputs``: the model's outputs on ``sample_feeds`` as it is now, when the caller
    has them (saves a run).

    Raises:
        PassError: a pass raised; the message names the pass and the model.
    """
    from quark_onnx.fidelity.verdict import compare_runs

    report = PipelineReport()
    # outputs of the current model on the samples, when known
    outputs: list[dict[str, np.ndarray]] | None = (
        list(reference_outputs) if reference_outputs else None
    )
    if isinstance(sample_feeds, dict):
        sample_feeds = [sample_feeds]
    if not sample_feeds:
        sample_feeds = None
    if sample_feeds is not None and any(getattr(p, "changes_numerics", False) for p in passes):
        from quark_onnx.model_files.external import model_bytes

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
    unchanged: ir.Model | None = None  # the model before the passes that did not change it
    for pass_ in passes:
        name = type(pass_).__name__
        measure = bool(getattr(pass_, "changes_numerics", False)) and sample_feeds is not None
        # outputs before the pass not known: run them after it, with the outputs after it, in one
        # session that computes the graph the pass left unchanged once
        # (quark_onnx.fidelity.paired_run)
        deferred = measure and outputs is None
        revertible = measure and revert_costly and not getattr(pass_, "simulates_hardware", False)
        snapshot = model.clone() if revertible else None
        if deferred and unchanged is None:  # kept while passes leave the model as it is
            unchanged = snapshot or model.clone()
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
        fidelity: list[OutputFidelity] = []
        warning = None
        reverted = False
        if result.modified:
            if measure and deferred:
                outputs, after = _try_run_pair(unchanged, model, sample_feeds, name, saturation)
                if outputs is None:
                    sample_feeds = None  # the samples do not run: one warning, not one per pass
            elif measure:
                after = _try_run(model, sample_feeds, f"after {name}", saturation)
            unchanged = None
            if measure:
                if after is not None:
                    diffs = _max_abs_diff(outputs, after)
                    fidelity = compare_runs(
                        outputs,
                        after,
                        min_sqnr_db=PASS_MIN_SQNR_DB,
                        min_agreement=PASS_MIN_AGREEMENT,
                        scores_by_decision=False,
                    )
                    if not getattr(pass_, "simulates_hardware", False):
                        costly = any(not f.faithful for f in fidelity)
                        reverted = snapshot is not None and costly
                        warning = _cost_warning(name, model, fidelity, reverted)
                if reverted:
                    model.graph = snapshot.graph  # outputs stay those before the pass
                else:
                    outputs = after
            elif not getattr(pass_, "preserves_outputs", False):
                outputs = None
            logger.info(
                "%s changed the graph in %.3f s%s",
                name,
                seconds,
                "; " + ", ".join(f"{f.name}: {f.describe()}" for f in fidelity) if fidelity else "",
            )
            if warning:
                logger.warning(warning)
        report.passes.append(
            PassRecord(
                name=name,
                modified=result.modified,
                seconds=seconds,
                changes_numerics=bool(getattr(pass_, "changes_numerics", False)),
                max_abs_diff=diffs,
                fidelity=[f.to_dict() for f in fidelity],
                warning=warning,
                reverted=reverted,
            )
        )
    return report


#: Calibration samples whose activation ranges the equalization passes read: each is one
#: onnxruntime run of the float model before calibration.
RANGE_SAMPLES = 8

#: Bytes of model outputs one copy of the pass-cost measurement holds: the outputs before a
#: pass and after it are each a list over the measured samples, so a model with large outputs
#: (a 1x16x1000x1000 map: 64 MB a sample) is measured on the first samples that fit, never fewer
#: than :data:`MEASURE_MIN_SAMPLES`. Its per-element statistics (SQNR, pixel agreement) still
#: rest on millions of values; a model with small outputs keeps every sample.
MEASURE_OUTPUT_BYTES = 256 << 20
MEASURE_MIN_SAMPLES = 2


def measured_samples(
    samples: Sequence[Feeds], reference: Sequence[dict[str, np.ndarray]] | None
) -> int:
    """How many of ``samples`` the pass costs are measured on (:data:`MEASURE_OUTPUT_BYTES`),
    from the size of the first reference run (all of them when it is not known)."""
    if not reference or len(samples) <= MEASURE_MIN_SAMPLES:
        return len(samples)
    per_sample = sum(np.asarray(v).nbytes for v in reference[0].values())
    fit = MEASURE_OUTPUT_BYTES // max(per_sample, 1)
    return int(min(len(samples), max(MEASURE_MIN_SAMPLES, fit)))


def prepare(
    model: ir.Model,
    qconfig: QuantizationConfig,
    options: ExtraOptions,
    samples: Sequence[Feeds],
    reference: Sequence[dict[str, np.ndarray]] | None,
) -> list[dict]:
    """Run the prepare passes of ``qconfig`` on ``model`` as ``quantize_model`` does: the
    numerics-changing ones measured on ``samples`` (against ``reference``, the model's outputs
    on them, when known), with a Relu's range cap saturating where a power-of-two position
    puts it; the report of each pass."""

    saturation = None
    method = qconfig.calibrate_method
    if qconfig.enable_npu_cnn or isinstance(method, PowerOfTwoMethod):
        from quark_onnx.params import pof2

        qtype = qconfig.activation_type

        def saturation(cap: float) -> float:
            # the int8 range of the power-of-two position that holds the cap (6 -> 7.94)
            return pof2.code_range(qtype)[1] * 2.0 ** -pof2.position_for_abs_max(cap, qtype)

    # FoldConstantChannels reads the first sample's ranges
    first = samples[0] if samples else None
    # the equalization passes read the channel ranges of the first few samples
    passes = quantize_passes(qconfig, options, first, samples[:RANGE_SAMPLES])
    count = measured_samples(samples, reference)
    if count < len(samples):
        logger.info(
            "the output differences of the passes are measured on %d of %d samples (their "
            "outputs fill %d MiB)",
            count,
            len(samples),
            MEASURE_OUTPUT_BYTES >> 20,
        )
        samples, reference = samples[:count], reference[:count]
    pipeline = run_passes(
        model,
        passes,
        sample_feeds=samples,
        saturation=saturation,
        revert_costly=options.RevertCostlyPasses,
        reference_outputs=reference,
    )
    return pipeline.as_dict()["passes"]
