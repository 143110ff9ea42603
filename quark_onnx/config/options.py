"""The ``extra_options`` of a quantization config: every key, its type, default and effect.

:class:`ExtraOptions` is the single source of truth. The Quark-shaped API keeps ``extra_options``
as a plain ``dict`` that users edit in place (as the seed example does); when a quantizer is
built, :func:`resolve_extra_options` turns it into an :class:`ExtraOptions`, rejecting unknown
keys (naming the closest valid key) and values of the wrong type (naming the expected type).
Library code reads the typed object, never the dict.

Keys that AMD Quark knows but quark_onnx does not act on are listed in
:data:`UNSUPPORTED_QUARK_OPTIONS`; they are accepted with a warning instead of silently ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import typing
from dataclasses import dataclass, field
from typing import Any

from quark_onnx.errors import ConfigError

logger = logging.getLogger(__name__)


def _opt(default: Any, doc: str) -> Any:
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class ExtraOptions:
    """Typed view of ``extra_options``. Field names are the option keys, as in AMD Quark."""

    # --- graph preparation (float passes, run before calibration) -------------------------------
    ConvertBNToConv: bool = _opt(
        True,
        "Fold BatchNormalization into the preceding Conv/ConvTranspose/Gemm; a BatchNormalization "
        "with no foldable producer becomes a depthwise 1x1 Conv. Also folds per-channel "
        "scale/shift constants after a Conv into it (FoldConvAffine). Float-preserving.",
    )
    FoldConstantChannels: bool = _opt(
        False,
        "Fold Conv output channels that are constant (weights zero, negligible by "
        "FoldConstantChannelsTolerance, or clamped to one value by the activation for every input "
        "up to 10x the first calibration batch's range) into the Conv/Gemm layers reading them, "
        "through "
        "Relu/Clip/LeakyRelu/PRelu/BatchNormalization/pools/depthwise Conv: the constant times "
        "the reader's weights goes into its bias and those weights are zeroed, only where exact "
        "(never a non-zero constant into a zero-padded Conv). Removes the outlier weights such "
        "channels leave in their readers. Float-preserving.",
    )
    FoldConstantChannelsTolerance: float = _opt(
        1e-4,
        "FoldConstantChannels: a channel with non-zero weights is negligible when its output "
        "variation bound ||W1[c]||_1 * (Lipschitz constants on the way) * max_o ||W2[o, c]||_1 "
        "is at most this times the largest channel's, at every reader (scale-free; 0: fold "
        "only channels whose weights are exactly zero).",
    )
    EqualizeGatedActivations: bool = _opt(
        False,
        "Equalize per-channel ranges between a Conv and the Convs reading its gated activation "
        "x * g(x) (SiLU, hardswish): the Conv's channels are divided by powers of two, the "
        "readers' multiplied, and the gate reads x through a new Mul restoring the scale, so it "
        "computes what it computed. Float-exact (bit-identical outputs). A native HardSwish op is "
        "first written as x * HardSigmoid(x) where it is equalized; constant Add/Sub shifts on "
        "either side (learnable affine blocks) get their constants scaled per channel.",
    )
    EqualizeResidualStreams: bool = _opt(
        False,
        "Equalize the per-channel ranges of each residual stream (the values the skip "
        "connections add: written by Convs, joined by Adds, read by Convs) against the Convs "
        "reading it, measured on the first calibration samples: the writers' channels are "
        "divided by powers of two, the readers' multiplied; kept only where the predicted "
        "quantization noise at the readers at least halves. Float-exact (bit-identical outputs).",
    )
    MigrateActivationOutliers: bool = _opt(
        False,
        "SmoothQuant-style migration of activation outliers: for each LayerNormalization read by "
        "MatMul/Gemm layers with constant weights, divide its wide channels (gain and bias) by "
        "powers of two s_j = 2^round(log2(max|x_j|^SmoothAlpha / max|W_j|^(1-SmoothAlpha))), "
        "measured on the first calibration samples, and multiply the readers' weight rows by "
        "s_j, so one per-tensor activation scale no longer serves a few 10-100x channels. "
        "Residual Adds reading the LayerNorm (post-LN encoders) get the value back through a "
        "float Mul by s, except on NPU configs (enable_npu_cnn), where such a LayerNorm is left "
        "alone. Float-exact (bit-identical outputs).",
    )
    SmoothAlpha: float = _opt(
        0.5,
        "MigrateActivationOutliers: the migration strength in [0, 1], the share of an "
        "activation channel's range moved into the weights (0.5: both end with the same range; "
        "AMD Quark's key and default).",
    )
    MigrateActivationOutliersScales: dict = _opt(
        {},
        "MigrateActivationOutliers: LayerNorm node name -> the log2 of its per-channel scales, "
        "applied instead of measured. A saved recipe records what the quantization chose here "
        "(its rebuild runs on no data); leave it empty otherwise.",
    )
    ReplaceClip6Relu: bool = _opt(
        False,
        "Replace a layer's Clip(0, 6) (ReLU6) by Relu and keep 6 as the output's range cap, so "
        "the quantized tensor saturates at the smallest power-of-two range holding 6. The Clip "
        "of hardswish/hardsigmoid is left alone. Changes float numerics above 6.",
    )
    ConvertClipToRelu: bool = _opt(
        False,
        "Replace Clip(0, hi) by Relu and keep hi as the output's range cap (value metadata "
        "quark_onnx.range_max, read by the plan), so the quantized tensor still saturates "
        "near hi. Changes float numerics above hi.",
    )
    ConvertSigmoidToHardSigmoid: bool = _opt(
        True,
        "Replace Sigmoid by HardSigmoid(alpha=1/6, beta=0.5), which the NPU computes. Changes "
        "numerics (max |difference| 0.069 on the Sigmoid output, at |x| = 1.32).",
    )
    ConvertReduceMeanToGlobalAvgPool: bool = _opt(
        True,
        "Replace ReduceMean over the spatial axes (H, W) of a 4-D tensor by GlobalAveragePool "
        "(plus a Reshape when keepdims=0). Float-preserving.",
    )
    SplitLargeKernelPool: bool = _opt(
        True,
        "Split a GlobalAveragePool/AveragePool whose kernel area exceeds the NPU limit into two "
        "average pools. Float-preserving.",
    )
    ConvertGlobalAvgPoolToDepthwiseConv: bool = _opt(
        False,
        "Replace a GlobalAveragePool (static 4-D input; also an AveragePool whose one unpadded "
        "window is the whole map) by a depthwise Conv with weights 1/(H W), a layer whose output "
        "position is its own instead of the input's (the pool's shared_scale rule, AlignPool); "
        "a side above the NPU's Conv kernel limit (16) is first reduced by an exact AveragePool "
        "over non-overlapping blocks. Float-preserving.",
    )
    ConvertSplitToSlice: bool = _opt(
        True, "Replace Split by one Slice per output (the NPU has no Split). Float-preserving."
    )

    FixShapes: str = _opt(
        "",
        "Static shapes for graph inputs in the written model, AMD Quark's format "
        "'input_1:[1,224,224,3];input_2:[1,96,96,3]'. All but a dynamic batch are fixed before "
        "the graph passes (pools need H and W); the batch after calibration.",
    )
    FixDynamicBatch: int = _opt(
        0,
        "Give every graph input whose first dimension is symbolic this batch size in the written "
        "model (0: keep it). The NPU compiles static shapes; XINT8 sets 1. Calibration still "
        "uses the dynamic batch, which is faster.",
    )

    # --- calibration ------------------------------------------------------------------------------
    UseRandomData: bool = _opt(
        False,
        "Calibrate on random data generated from the model's input shapes and dtypes when no "
        "calibration data is given (given data is used, with a warning).",
    )
    RandomDataReaderInputShape: dict = _opt(
        {},
        "Input name -> shape list for UseRandomData; needed for inputs with dynamic dimensions "
        "(otherwise a dynamic dimension is taken as 1).",
    )
    RandomDataReaderInputDataRange: dict = _opt(
        {}, "Input name -> [low, high] of the uniform random data (default [0, 1))."
    )
    RandomDataSeed: int = _opt(0, "Seed of the random calibration data (reproducible).")
    RandomDataSamples: int = _opt(100, "How many random samples UseRandomData generates.")
    CalibDataSize: int = _opt(
        0,
        "Read at most this many calibration samples, the fidelity verdict's held-out ones "
        "included (0: all of them).",
    )
    CalibMovingAverage: bool = _opt(
        False, "MinMax: use the exponential moving average of per-batch min/max."
    )
    CalibMovingAverageConstant: float = _opt(
        0.01, "MinMax with CalibMovingAverage: weight of each new batch."
    )
    Percentile: float = _opt(99.999, "Percentile method: the percentile of |x| kept in range.")
    NumBins: int = _opt(2048, "Entropy/MSE methods: linear bins the histogram is resampled to.")
    ActivationSymmetric: bool = _opt(True, "Symmetric activation quantization (zero point 0/128).")
    WeightSymmetric: bool = _opt(True, "Symmetric weight quantization (zero point 0).")

    # --- strategy and granularity (float-scale flows) ---------------------------------------------
    WeightsOnly: bool = _opt(
        False,
        "Weight-only quantization: only the weights of Conv/ConvTranspose/Gemm/MatMul are stored "
        "quantized (and dequantized in the graph); activations and biases stay float and no "
        "calibration data is needed. Not with enable_npu_cnn or use_dynamic_quant.",
    )
    WeightScaleBits: int = _opt(
        0,
        "Round every float weight scale up to this many significant bits (0: full float32). "
        "7 makes each scale, and its product with any 4-bit zero point, a float16 value, so "
        "GGUF Q4_1/Q8_0 export reads back exactly (UINT4_WEIGHT_ONLY_G32 sets it); a scale "
        "grows by less than 2^(1-bits).",
    )
    WeightBlockSize: int = _opt(
        0,
        "Per-group weight quantization: with per_channel=True, each run of this many weights "
        "along the layer's input-channel axis (MatMul B rows, Gemm/Conv input channels) gets "
        "its own scale and zero point (ONNX opset 21 block quantization). 0: per channel.",
    )

    # --- QDQ insertion ----------------------------------------------------------------------------
    QuantizeBias: bool = _opt(True, "Quantize Conv/Gemm bias (int8 with its own scale by default).")
    Int32Bias: bool = _opt(
        False, "Quantize bias to int32 with scale s_input * s_weight instead of int8."
    )
    RemoveQDQConvRelu: bool = _opt(
        False, "No Q/DQ between a single-consumer Conv/Gemm/Add/pool and a following Relu."
    )
    RemoveQDQConvClip: bool = _opt(
        False, "No Q/DQ between a single-consumer Conv/Gemm/Add/pool and a following Clip."
    )
    RemoveQDQConvLeakyRelu: bool = _opt(
        False, "No Q/DQ between a single-consumer Conv/Gemm/Add/pool and a following LeakyRelu."
    )
    RemoveQDQConvPRelu: bool = _opt(
        False, "No Q/DQ between a single-consumer Conv/Gemm/Add/pool and a following PRelu."
    )

    # --- NPU constraints (enable_npu_cnn) ---------------------------------------------------------
    AlignConcat: bool = _opt(True, "Concat inputs and output share one position.")
    AlignPool: bool = _opt(
        True, "MaxPool/AveragePool/GlobalAveragePool input and output share one position."
    )
    AlignPad: bool = _opt(True, "Pad input and output share one position.")
    AlignSlice: bool = _opt(True, "Slice input and output share one position.")
    AdjustShiftCut: bool = _opt(True, "Keep shift_cut = p_w + p_in - p_out in 0..16 (Conv/Gemm).")
    AdjustShiftBias: bool = _opt(
        True, "Keep shift_bias = p_w + p_in - p_bias in range (Conv/Gemm)."
    )
    AdjustShiftRead: bool = _opt(True, "Keep max p_in - min p_in <= 7 (Add/Sub).")
    AdjustShiftWrite: bool = _opt(True, "Keep min p_in - p_out in -7..25 (Add).")
    AdjustHardSigmoid: bool = _opt(True, "Keep HardSigmoid positions in the NPU's range.")
    AdjustShiftMul: bool = _opt(True, "Keep sum(p_in) - p_out in 0..32 (Mul).")

    # --- DPU simulation (model the hardware arithmetic in float) ---------------------------------
    SimulateDPU: bool = _opt(True, "Master switch of the DPU simulation passes below.")
    ConvertLeakyReluToDPUVersion: bool = _opt(True, "LeakyRelu alpha -> round(256*alpha)/256.")
    ConvertHardSigmoidToDPUVersion: bool = _opt(True, "HardSigmoid uses 2731/16384 for 1/6.")
    ConvertAvgPoolToDPUVersion: bool = _opt(
        True, "Average pools multiply by A*k/2^n, the hardware's reciprocal of the area A."
    )
    ConvertReduceMeanToDPUVersion: bool = _opt(
        True, "ReduceMean multiplies by the hardware's reciprocal of the reduced size."
    )

    # --- accuracy recovery ------------------------------------------------------------------------
    CLESteps: int = _opt(1, "Cross-layer equalization: iterations (-1: until converged).")
    CLETotalLayerDiffThreshold: float = _opt(
        2e-7, "Cross-layer equalization: stop when the total range change is below this."
    )
    CLEScaleAppendBias: bool = _opt(True, "Cross-layer equalization: include biases in ranges.")
    AccuracySamples: int = _opt(
        32,
        "Calibration samples kept in memory for bias correction, AdaRound and the per-layer "
        "error analysis (the first ones the reader yields).",
    )
    AccuracySamplesSkip: int = _opt(
        0,
        "The first N kept calibration samples are not fitted on by bias correction and AdaRound. "
        "The fidelity refinement sets it to FidelitySamples (the samples judging it are not the "
        "ones it is fitted on); a recipe records it, so the rebuild fits on the same samples.",
    )
    BiasCorrectionMovePositions: bool = _opt(
        False,
        "Bias correction: where a corrected int8 bias saturates, move its position inside the "
        "shift_bias window when that lowers the held-out samples' mean error (needs "
        "AdjustShiftBias; not with Int32Bias).",
    )
    LayerErrorAnalysis: bool = _opt(
        False,
        "Measure the SQNR of every quantized tensor against the float model on the kept "
        "samples and put it in the report, worst first.",
    )
    FastFinetune: dict = _opt(
        {},
        "Rounding settings: OptimAlgorithm (adaround or gptq), NumIterations, NumBatches, "
        "LearningRate, TimeBudgetPerLayer, Target (gptq in bias correction's walk: what each "
        "layer is fitted to: float (the float output), weights (the float weights on the "
        "quantized inputs) or debiased).",
    )

    # --- fidelity guard (quark_onnx.fidelity.verdict)
    # ---------------------------------------------------
    FidelityCheck: bool = _opt(
        True,
        "After quantizing, judge every graph output of the quantized model against the original "
        "float model, part by part (scores by the decisions they drive, coordinates and other "
        "values by SQNR, dense maps by argmax over their class axis), on FidelityHoldout "
        "calibration samples held out from every stage that fits or chooses; an output below "
        "the thresholds is a warning naming the part and the layers that lose the most. Also "
        "measures what each numerics-changing pass cost.",
    )
    RevertCostlyPasses: bool = _opt(
        False,
        "Undo an optional numerics-changing pass (ReplaceClip6Relu, ConvertSigmoidToHardSigmoid, "
        "...) that takes the float outputs below 30 dB SQNR or 0.9 top-1 agreement on the "
        "fidelity samples (quark_onnx.pipeline.prepare.PASS_MIN_SQNR_DB, PASS_MIN_AGREEMENT), "
        "keeping the original operations and recording the option as False in the report's "
        "settings (a recipe exported with --report rebuilds it); a warning names the pass either "
        "way. DPU simulations are never undone.",
    )
    FidelitySamples: int = _opt(
        16,
        "Calibration samples (the first ones after the held-out ones are taken) on which the "
        "numerics-changing passes' costs and the fidelity repair's choices are measured.",
    )
    FidelityHoldout: int = _opt(
        16,
        "Calibration samples held out for the fidelity verdict: calibration, the accuracy "
        "stages and every choice never see them (every second sample of the first 2n; at most "
        "a quarter of a source of known length). 0: the verdict is measured on the first "
        "FidelitySamples calibration samples, and says so.",
    )
    SplitHeterogeneousJoins: bool = _opt(
        True,
        "XINT8: a Concat whose inputs' calibrated ranges leave the narrowest input fewer than 6 "
        "of int8's 8 bits at the shared position (a detector's Concat[boxes, scores]) is not "
        "quantized as one tensor: its decode tail up to the graph outputs (and the Sigmoid/box "
        "arithmetic only it reads) stays float on the CPU, each part leaving the NPU at its own "
        "position (report float_nodes: 'decode tail on the CPU: ...'). A join inside the network "
        "is only reported.",
    )
    FidelityScoreThreshold: float = _opt(
        0.25,
        "Fidelity verdict: the score from which a score part (a Sigmoid/Softmax output, e.g. a "
        "detector's class scores) counts as a decision.",
    )
    FidelityMinSQNR: float = _opt(
        10.0,
        "Fidelity guard: an output that is not a score vector is not faithful below this SQNR "
        "(dB) against float.",
    )
    FidelityMinAgreement: float = _opt(
        0.75,
        "Fidelity guard: a score part whose decision agreement (F1) with float, a score vector "
        "whose top-1 agreement, or a dense map whose argmax agreement is below this is not "
        "faithful.",
    )
    RequireFidelity: bool = _opt(
        False,
        "Raise FidelityError (and write no model) when an output is not faithful, instead of a "
        "warning (CLI: --require-fidelity).",
    )
    FidelityRepair: bool = _opt(
        True,
        "XINT8: when the fidelity guard finds an output not faithful, quantize again from the "
        "same calibration with the conservative choices in turn (weights never clipped: "
        "WeightPositionMethod NonOverflow; no bias correction; both), stop at the first faithful "
        "one and keep whichever measures best on the guard's samples; the report lists every "
        "attempt (quark_onnx.pipeline.repair).",
    )
    FidelityRefine: bool = _opt(
        False,
        "XINT8: when the fidelity guard finds every output faithful, quantize once more from "
        "the same calibration with debiased second-order rounding (FastFinetune gptq, Target "
        "debiased) fitted on the kept samples after the guard's, and keep it only if it measures "
        "at least as well on every output and measure on the guard's samples and better on one "
        "(quark_onnx.pipeline.repair.dominates). Not when include_fast_ft is set. Off: the "
        "guard's 16 samples did not predict the test images on unseen models "
        "(benchmarks/results/refinement.md).",
    )
    FidelityTarget: str = _opt(
        "",
        "Mixed precision to a target, e.g. 'sqnr=20,agreement=0.95': the thresholds every output "
        "part must meet (SQNR in dB; decision, top-1 or argmax agreement; a term left out "
        "keeps FidelityMinSQNR / FidelityMinAgreement). When the quantized model misses it after "
        "the repair, the activation tensors whose quantization costs the output most are promoted "
        "one step at a time (XINT8: kept float on the CPU with the nodes around them; float "
        "scales: 16-bit), the NPU rules solved again each time, until the target is met or "
        "MixedPrecisionBudget is spent; the report lists every promotion "
        "(quark_onnx.pipeline.mixed_precision). '' (default): no search.",
    )
    MixedPrecisionBudget: float = _opt(
        0.1,
        "The share of the plan's activation tensors the FidelityTarget search may promote.",
    )
    MixedPrecisionTensors: list = _opt(
        [],
        "Activation tensors promoted by hand (names in the prepared model; an unknown name is an "
        "error naming the closest ones): XINT8 keeps each float on the CPU together with its "
        "producer and readers; float-scale presets quantize it to 16 bits (A16W8 tensors in an "
        "A8W8 model).",
    )
    WeightPositionMethod: str = _opt(
        "",
        "XINT8 weight positions: 'MinMSE' (the least squared error over the weight's values; may "
        "clip its largest values), 'NonOverflow' (never clips a weight), or '' to follow "
        "calibrate_method.",
    )


#: Keys AMD Quark accepts that quark_onnx does not act on: accepted with a warning, never silently.
UNSUPPORTED_QUARK_OPTIONS: frozenset[str] = frozenset(
    {
        "FuseInstanceNorm",
        "FuseL2Norm",
        "FuseLayerNorm",
        "FuseGelu",
        "FoldRelu",
        "ConvertSoftmaxToDPUVersion",
        "ConvertInstanceNormToDPUVersion",
        "IPULimitationCheck",
        "AdjustShiftSwish",
        "RemoveQDQInstanceNorm",
        "Int16Bias",
        "MatMulConstBOnly",
        "CopySharedInit",
        "CalibTensorRangeSymmetric",
        "OpTypesToExcludeOutput",
        "AddQDQPairToWeight",
        "DedicatedQDQPair",
        "QDQOpTypePerChannelSupportToAxis",
        "UseQDQVitisCustomOps",
        "ConvertOpsetVersion",
        "BF16QDQToCast",
        "ConvertFP16ToFP32",
    }
)


def option_fields() -> tuple[dataclasses.Field, ...]:
    return dataclasses.fields(ExtraOptions)


def option_names() -> list[str]:
    return [f.name for f in option_fields()]


def option_doc(name: str) -> str:
    return {f.name: f.metadata["doc"] for f in option_fields()}[name]


def closest_name(name: str, candidates: typing.Iterable[str]) -> str | None:
    """The candidate nearest to ``name`` (case-insensitive), or None when nothing is close."""
    candidates = list(candidates)
    lowered = {c.lower(): c for c in candidates}
    if name.lower() in lowered:
        return lowered[name.lower()]
    close = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.6)
    return lowered[close[0]] if close else None


def did_you_mean(name: str, candidates: typing.Iterable[str]) -> str:
    """``"; did you mean 'X'?"`` for the :func:`closest_name` of ``name``, or ``""``: the tail of
    an error message naming a value that is not among ``candidates``."""
    close = closest_name(name, candidates)
    return f"; did you mean {close!r}?" if close else ""


_TYPES = typing.get_type_hints(ExtraOptions)


def check_value_type(key: str, value: Any, expected: type) -> Any:
    """Return ``value`` if it has the expected type (ints accepted where floats are expected)."""
    ok = (
        (expected is bool and isinstance(value, bool))
        or (expected is int and isinstance(value, int) and not isinstance(value, bool))
        or (expected is float and isinstance(value, (int, float)) and not isinstance(value, bool))
        or (expected is str and isinstance(value, str))
        or (expected is dict and isinstance(value, dict))
        or (expected is list and isinstance(value, (list, tuple)))
    )
    if not ok:
        raise ConfigError(
            f"extra option {key!r} expects {expected.__name__}, got {type(value).__name__} "
            f"({value!r})"
        )
    return float(value) if expected is float else value


#: Sane bounds (inclusive) of the numeric options: a value outside is a typo or a unit mistake
#: that would otherwise allocate without bound (a block of 10^9 weights) or run for days.
OPTION_BOUNDS: dict[str, tuple[float, float, str]] = {
    "FixDynamicBatch": (0, 1 << 16, "a batch size"),
    "RandomDataSeed": (0, 2**64 - 1, "a non-negative seed"),
    "RandomDataSamples": (1, 100_000, "a number of random samples (each runs the model)"),
    "CalibDataSize": (0, 10_000_000, "a number of samples (0: all)"),
    "CalibMovingAverageConstant": (0.0, 1.0, "a weight in [0, 1]"),
    "Percentile": (0.0, 100.0, "a percentile"),
    "NumBins": (1, 1 << 20, "a number of histogram bins"),
    "WeightScaleBits": (0, 23, "significant bits of a float32 scale"),
    "WeightBlockSize": (0, 1 << 16, "0 (per channel) or a group size >= 1 (weights per scale)"),
    "CLESteps": (-1, 10_000, "a number of iterations (-1: until converged)"),
    "AccuracySamples": (0, 100_000, "a number of samples kept in memory"),
    "AccuracySamplesSkip": (0, 100_000, "a number of samples"),
    "FidelitySamples": (1, 100_000, "a number of samples (FidelityCheck=False skips the guard)"),
    "FidelityHoldout": (0, 100_000, "a number of held-out samples (0: none)"),
    "FidelityScoreThreshold": (0.0, 1.0, "a score in [0, 1]"),
    "FidelityMinSQNR": (-200.0, 200.0, "an SQNR in dB"),
    "FidelityMinAgreement": (0.0, 1.0, "a share of rows in [0, 1]"),
    "FoldConstantChannelsTolerance": (0.0, 1.0, "a relative bound in [0, 1]"),
    "MixedPrecisionBudget": (0.0, 1.0, "a share of the activation tensors in [0, 1]"),
    "SmoothAlpha": (0.0, 1.0, "a migration strength in [0, 1]"),
}


#: The string options that take one of a few values ('' is the default of each).
OPTION_CHOICES: dict[str, tuple[str, ...]] = {
    "WeightPositionMethod": ("", "MinMSE", "NonOverflow"),
}


def check_bounds(key: str, value: Any) -> None:
    """Refuse a numeric option outside :data:`OPTION_BOUNDS` or a string option not in
    :data:`OPTION_CHOICES`, naming it and what it takes."""
    choices = OPTION_CHOICES.get(key)
    if choices is not None and value not in choices:
        hint = did_you_mean(str(value), [c for c in choices if c])
        raise ConfigError(
            f"extra option {key}={value!r} is not one of {', '.join(map(repr, choices))}{hint}"
        )
    bounds = OPTION_BOUNDS.get(key)
    if bounds is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    low, high, meaning = bounds
    if not low <= value <= high:  # NaN fails both
        raise ConfigError(
            f"extra option {key}={value!r} is out of range [{low}, {high}]: expected {meaning}"
        )


def check_structure(key: str, value: Any) -> None:
    """Refuse an option whose value has the right type but not the right form: a
    ``FidelityTarget`` that does not parse, a ``MixedPrecisionTensors`` entry that is not a
    tensor name."""
    if key == "FidelityTarget":
        from quark_onnx.fidelity.target import parse_target

        parse_target(value)
    elif key == "MixedPrecisionTensors":
        bad = [v for v in value if not isinstance(v, str) or not v]
        if bad:
            raise ConfigError(
                f"extra option MixedPrecisionTensors expects tensor names, got {bad[0]!r}"
            )


def resolve_extra_options(extra: dict[str, Any] | None) -> ExtraOptions:
    """Validate a user's ``extra_options`` dict and return the effective typed options."""
    values: dict[str, Any] = {}
    for key, value in (extra or {}).items():
        if not isinstance(key, str):
            raise ConfigError(f"extra option names must be strings, got {key!r}")
        if key in _TYPES:
            values[key] = check_value_type(key, value, _TYPES[key])
            check_bounds(key, values[key])
            check_structure(key, values[key])
            continue
        if key in UNSUPPORTED_QUARK_OPTIONS:
            logger.warning(
                "extra option %r is an AMD Quark option quark_onnx does not implement; "
                "it is ignored",
                key,
            )
            continue
        hint = did_you_mean(key, option_names())
        raise ConfigError(
            f"unknown extra option {key!r}{hint} (valid options are listed in "
            "quark_onnx.config.options.ExtraOptions)"
        )
    return ExtraOptions(**values)
