"""Empirical bias correction: remove the mean output shift quantization leaves in each layer.

For every quantized Conv/ConvTranspose/Gemm with a bias, in graph order, on the kept calibration
samples:

* ``y_q``: the layer's output in the quantized model, computed from the quantized model's actual
  inputs (the already-corrected quantized prefix) with its int8 weights and bias;
* ``y_f``: the same tensor in the float model (float inputs, float weights);
* per output channel ``c``: ``delta_c = mean(y_f - y_q)`` over samples and spatial positions
  (where the layer feeds a Relu or a constant Clip, only over the positions where either output
  is inside the activation's range: an error both sides lose to the activation needs no fix);
* the bias becomes ``b'_c = b_c + delta_c`` and is requantized at its position ``p_b``:
  ``q'_c = clip(round_half_even(b'_c * 2^p_b), qmin, qmax)`` (int8, or int32 with
  ``Int32Bias``);
* the bias is quantized inside this loop: where ``b'`` saturates at ``p_b`` (an int8 bias's
  position is the float bias's NonOverflow position, often too fine for the shift), the position
  moves to the one with the least squared error on ``b'`` inside the shift_bias window
  ``[p_w + p_in - 15, p_w + p_in - lo(shift_cut)]`` (:func:`bias_window`,
  :func:`best_bias_position`; only with ``BiasCorrectionMovePositions``, off by default, for a
  bias read by this layer alone, with ``AdjustShiftBias`` and without ``Int32Bias``). Every NPU
  rule still holds; the moved positions are returned in ``moved_bias_positions`` and written into
  the caller's positions. Off because on SqueezeNet (500 val images) it raised the output SQNR
  by 0.5 dB but cost 1.2 points of top-1 (benchmarks/results/rounding.txt).

Because ``y_q`` is measured on the quantized model's inputs, the correction also absorbs the mean
error arriving from earlier layers ("empirical" rather than analytic bias correction). The
layer's output is then updated in the replay (``y_q + (q'_c - q_c) 2^-p_b``) so later layers see
the corrected prefix; the whole walk runs every node once (:class:`~.layerwise.Replay`).

With second-order rounding on (``include_fast_ft`` with ``FastFinetune.OptimAlgorithm =
"gptq"``; off in the XINT8 preset, see configs/xint8.toml), each layer's weights are rounded
first, in the same walk, on the same replays
(:class:`~.sequential_rounding.SequentialRounding`): the bias is then corrected for the rounded
weights, and no second replay of either model runs.

Held-out gate (per channel, :func:`gated_shift`): the shift is fitted on the first half of the
samples and kept only where it also shrinks the second half's mean error.

Memory and time: both replays run under a memory budget (:data:`REPLAY_BUDGET`, and
:data:`FLOAT_REPLAY_BUDGET` for the float one; see :class:`~.layerwise.Replay`): per layer, the
layer's output is computed one sample at a time in both models (the float model's next sample on
a helper thread meanwhile, :func:`~.ahead.ahead`), its channel sums accumulated
(:func:`channel_sums`, both halves in one pass) and the sample dropped, so ``y_q``/``y_f`` are
never held for all samples; between layers each replay keeps at most the budget (int8 codes
where the quantized model has them) and recomputes the rest
from its checkpoint. The float replay stays float32: storing it in float16 between segments cost
MobileNetV2 a point of top-1 (0.772 -> 0.762 on 500 val images). Peak resident memory of the
stage with 32 samples (whole XINT8 run, 2 cores, over the resident set before it): SqueezeNet 1.1
+45 MB (237 -> 282), MobileNetV2 +91 MB (277 -> 368), down from +50-80 and +150 MB when the
segments' sessions allocated straight from glibc, whose heap they fragmented
(:mod:`~.layerwise`), and from 210 and 410 MB when both replays kept every live tensor of every
sample. On MobileNetV2 the +91 MB are about: the float replay's checkpoint, up to 37 MB (past
the budget, where the rerun allowance moves it to a 96x56x56 float32 state), the quantized one's
up to 14 MB of int8 codes, one sample's tensors along both replays' segments (15-25 MB at
112x112), and the live sessions. The stage takes about
1.2-1.5x a single walk (reruns): 2.6-2.9 s on MobileNetV2 with or without the shared arena
(medians of alternate runs; before the float budget was doubled). A larger budget trades
memory back for time. Where
no boundary fits the budget (ResNet-50 at 224x224), the replay's rerun allowance bounds the
recomputation to about one extra pass: 8.7 s instead of 50 s for ResNet-50 with random weights.

Samples: the replays run the kept samples while a sample's layer outputs (float32, every layer
corrected, from the graph's shapes) times the samples fit :data:`ACTIVATION_BUDGET`; past it,
the first samples that fit, at least :data:`MIN_SAMPLES` (:func:`replayed_samples`). Time and the
replays' checkpoints grow with the samples replayed, so a 512x896 model no longer replays 32
samples of 180 MB of layer outputs each. The mean shift of a channel averages every position of
every sample; what fewer samples cost is its spread between samples: each layer's report entry
gives ``shift_standard_error`` (the standard error of the per-sample mean shift, averaged over
the channels), and the summary ``samples`` of ``samples_available``.

Saturation: a corrected bias that leaves the int8 range at every position of its window (or
whose position may not move) is clipped, and counted in the report. A layer without a bias is
skipped and reported: adding one would need a new position inside the shift_bias window, which
the constraint solver, not this stage, chooses.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from quark_onnx.accuracy.adaround import AdaRoundSettings
from quark_onnx.accuracy.ahead import ahead
from quark_onnx.accuracy.layers import Layer, find_layers, set_codes, tensor_names
from quark_onnx.accuracy.replay import Replay
from quark_onnx.accuracy.sequential_rounding import SequentialRounding
from quark_onnx.config.options import ExtraOptions
from quark_onnx.npu.rules import shift_bias_range
from quark_onnx.params.pof2 import POSITION_MAX, POSITION_MIN
from quark_onnx.plan.types import PlannedNode, QuantPlan
from quark_onnx.runtime.progress import Progress

logger = logging.getLogger(__name__)

#: Bytes the quantized replay may keep between layers for all samples (:class:`Replay`).
REPLAY_BUDGET = 16 * 2**20
#: The same for the float replay. Its live tensors are float32 (4x the quantized replay's int8
#: codes): under 16 MiB its checkpoint stayed behind MobileNetV2's 112x112 layers until the
#: rerun allowance moved it past the budget to a 37 MB state anyway, rerunning those layers for
#: every request meanwhile. 32 MiB lets it move earlier, for fewer reruns and no higher stage
#: peak (benchmarks/results/perf21_time.md).
FLOAT_REPLAY_BUDGET = 32 * 2**20
#: onnxruntime intra-op threads of each replay while the float and the quantized replay run side
#: by side (benchmarks/results/perf21_time.md).
SIDE_BY_SIDE_THREADS = 1
#: Bytes of layer outputs the replays run through, over the samples: a sample's layer outputs
#: (float32, every corrected layer, :func:`layer_output_bytes`) times the samples replayed.
#: Beyond it fewer samples are replayed (:func:`replayed_samples`): at 512x896 a sample's layer
#: outputs are about 180 MB, and the 32 kept samples cost 119 s and a 1.6 GB peak
#: (benchmarks/results/stage_cost.txt). A 224x224 classifier (MobileNetV2: 24 MB a sample)
#: keeps all 32.
ACTIVATION_BUDGET = 1 << 30
#: Samples replayed whatever their size: the held-out gate needs two in each half.
MIN_SAMPLES = 4


def layer_output_bytes(layers: Sequence[Layer]) -> int:
    """Bytes of one sample's outputs of ``layers`` as float32, from the graph's shapes (a
    dimension without a number, e.g. a dynamic batch, counts as 1; an unknown shape as 0)."""
    total = 0
    for layer in layers:
        shape = layer.node.outputs[0].shape
        if shape is None:
            continue
        total += 4 * math.prod(d if isinstance(d, int) else 1 for d in shape)
    return total


def replayed_samples(available: int, per_sample: int, budget: int = ACTIVATION_BUDGET) -> int:
    """How many of ``available`` samples the replays run: all while ``per_sample`` bytes of
    layer outputs times the samples fit ``budget``, else as many as fit, at least
    :data:`MIN_SAMPLES`."""
    if per_sample <= 0 or per_sample * available <= budget:
        return available
    return min(available, max(MIN_SAMPLES, budget // per_sample))


def requantize_bias(codes: np.ndarray, position: int, delta: np.ndarray) -> tuple[np.ndarray, int]:
    """Codes of ``codes * 2^-p + delta`` at position ``p`` (round half to even, saturating).

    Returns the new codes (same dtype) and how many of them saturated (the wanted value lay
    outside the integer range and was clipped). A non-finite ``delta`` leaves its code unchanged
    (a NaN cast to an integer is an arbitrary code).
    """
    info = np.iinfo(codes.dtype)
    delta = np.asarray(delta, dtype=np.float64)
    delta = np.where(np.isfinite(delta), delta, 0.0)
    wanted = np.rint(codes.astype(np.float64) + delta * math.ldexp(1.0, position))
    saturated = int(np.count_nonzero((wanted < info.min) | (wanted > info.max)))
    return np.clip(wanted, info.min, info.max).astype(codes.dtype), saturated


def _activation_bounds(layer: Layer) -> tuple[float, float] | None:
    """``(lo, hi)`` of the Relu (0, inf) or constant-bounded Clip that alone reads the layer's
    output (through one Q/DQ pair), else None."""
    uses = layer.node.outputs[0].uses()
    if len(uses) != 1:
        return None
    nxt = uses[0].node
    if nxt.op_type in ("QuantizeLinear",) and nxt.outputs:
        dq_uses = nxt.outputs[0].uses()
        if len(dq_uses) != 1 or not dq_uses[0].node.outputs:
            return None
        after = dq_uses[0].node.outputs[0].uses()
        if len(after) != 1:
            return None
        nxt = after[0].node
    if nxt.domain not in ("", "ai.onnx"):
        return None
    if nxt.op_type == "Relu":
        return 0.0, math.inf
    if nxt.op_type != "Clip":
        return None
    bounds = [-math.inf, math.inf]
    for slot in (1, 2):
        value = nxt.inputs[slot] if len(nxt.inputs) > slot else None
        if value is None:
            continue
        if value.const_value is None or value.const_value.numpy().size != 1:
            return None  # a bound computed at run time: no mask
        bounds[slot - 1] = float(value.const_value.numpy().reshape(-1)[0])
    return bounds[0], bounds[1]


def channel_sums(
    f: np.ndarray, q: np.ndarray, bounds: tuple[float, float] | None
) -> tuple[np.ndarray, np.ndarray]:
    """Per output channel (axis 1): ``sum(f - q)`` and the number of terms, over every other axis.

    With ``bounds`` (the layer feeds a Relu or a Clip to ``(lo, hi)``) only the positions where
    either output lies inside ``(lo, hi)`` count: the error the activation removes (both below
    ``lo``, or both above ``hi``) needs no correction.
    """
    axes = tuple(i for i in range(f.ndim) if i != 1)
    # NaN/Inf outputs (non-finite data) make their channel's sum non-finite; correct_bias leaves
    # such channels alone and says so, so numpy's own warnings would only repeat it
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.subtract(f, q, dtype=np.float32)
        if bounds is None:
            count = d.size // max(d.shape[1], 1)
            return np.sum(d, axis=axes, dtype=np.float64), np.full(d.shape[1], count, np.int64)
        lo, hi = bounds
        active = (f > lo) | (q > lo)
        if hi < math.inf:
            active &= (f < hi) | (q < hi)
        np.multiply(d, active, out=d)
        return np.sum(d, axis=axes, dtype=np.float64), np.count_nonzero(active, axis=axes)


def gated_shift(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """The per-channel mean shift over both halves, kept only for channels where it generalises.

    ``num``/``den`` (shape ``(2, C)``) hold the sums of :func:`channel_sums` over the first and
    the second half of the samples. The shift ``fit = num_0 / den_0`` is estimated on the first
    half and checked on the second, ``check = num_1 / den_1``: a channel is corrected (by the
    mean over all samples) only when subtracting ``fit`` brings the second half's mean error
    closer to zero, ``|check - fit| < |check|``. A mean shift that is noise (it differs between
    halves more than it is large) is left alone, so the correction cannot add error on data it
    has not seen.
    """
    delta = num.sum(axis=0) / np.maximum(den.sum(axis=0), 1)
    fit = num[0] / np.maximum(den[0], 1)
    check = num[1] / np.maximum(den[1], 1)
    return np.where(np.abs(check - fit) < np.abs(check), delta, 0.0)


def bias_window(node: PlannedNode, positions: dict[str, int]) -> tuple[int, int] | None:
    """Bias positions the shift_bias rule allows for ``node`` at the solved ``positions``:
    ``[p_w + p_in - 15, p_w + p_in - lo(shift_cut)]`` (None: a position is missing)."""
    weight, output = node.weight, node.output
    data = node.inputs[0] if node.inputs else None
    if weight not in positions or data not in positions or output not in positions:
        return None
    assert weight is not None and data is not None and output is not None
    acc = positions[weight] + positions[data]
    lo, hi = shift_bias_range(acc - positions[output], node.before_leaky_relu)
    return max(acc - hi, POSITION_MIN), min(acc - lo, POSITION_MAX)


def best_bias_position(
    target: np.ndarray, current: int, window: tuple[int, int], dtype: np.dtype
) -> int:
    """The position in ``window`` whose codes represent ``target`` with the least squared error
    (saturation included); ``current`` on a tie, then the finest."""
    info = np.iinfo(dtype)
    t = np.asarray(target, dtype=np.float64)

    def error(p: int) -> float:
        q = np.clip(np.rint(t * math.ldexp(1.0, p)), info.min, info.max) * math.ldexp(1.0, -p)
        return float(np.sum((t - q) ** 2))

    candidates = range(window[0], window[1] + 1)
    return min(candidates, key=lambda p: (error(p), p != current, -p), default=current)


def _bias_windows(
    layers: Sequence[Layer], plan: QuantPlan, positions: dict[str, int], options: ExtraOptions
) -> dict[str, tuple[tuple[int, int], str]]:
    """Layer name -> (shift_bias window, planned bias tensor) for the biases that may move."""
    if not options.BiasCorrectionMovePositions or options.Int32Bias or not options.AdjustShiftBias:
        return {}  # int32 bias sits at p_w + p_in; without AdjustShiftBias it is not ours
    nodes = {n.name: n for n in plan.nodes}
    readers: dict[str, int] = {}
    for n in plan.nodes:
        if n.bias:
            readers[n.bias] = readers.get(n.bias, 0) + 1
    out: dict[str, tuple[tuple[int, int], str]] = {}
    for layer in layers:
        node = nodes.get(layer.name)
        if node is None or not node.bias or readers[node.bias] != 1:
            continue
        if positions.get(node.bias) != layer.bias_position:
            continue  # the quantized graph does not hold the planned position
        assert layer.bias is not None
        scale = layer.bias.uses()[0].node.inputs[1]
        if scale is None or len(scale.uses()) != 1 or not scale.is_initializer():
            continue  # a scale another tensor reads too would move with it
        window = bias_window(node, positions)
        if window is not None and window[0] <= layer.bias_position <= window[1]:
            out[layer.name] = (window, node.bias)
    return out


def _set_bias_position(layer: Layer, position: int, quant: Replay) -> None:
    """Give the layer's bias DequantizeLinear the scale ``2^-position`` (graph and replay)."""
    assert layer.bias is not None
    dq = layer.bias.uses()[0].node
    scale = dq.inputs[1]
    assert scale is not None and scale.const_value is not None
    value = np.asarray(math.ldexp(1.0, -position), dtype=np.float32).reshape(
        scale.const_value.numpy().shape
    )
    scale.const_value = ir.tensor(value, name=scale.name)
    quant.set_initializer(scale.name or "", value)
    layer.bias_position = position


def _standard_error(means: list[Any], count: int) -> float | None:
    """The standard error of the mean shift over ``count`` samples, averaged over the channels,
    from the sums of each sample's per-channel mean error and of its square (None: fewer than
    two samples, or non-finite errors)."""
    if count < 2:
        return None
    with np.errstate(invalid="ignore", over="ignore"):
        mean = np.asarray(means[0], np.float64) / count
        variance = np.maximum(np.asarray(means[1], np.float64) / count - mean * mean, 0.0)
        error = float(np.mean(np.sqrt(variance / (count - 1))))
    return error if math.isfinite(error) else None


def _bias_step(layer: Layer) -> np.ndarray:
    assert layer.bias_position is not None
    return np.float64(math.ldexp(1.0, -layer.bias_position))


def correct_bias(
    prepared: onnx.ModelProto,
    model: ir.Model,
    samples: Sequence[dict[str, np.ndarray]],
    plan: QuantPlan,
    positions: dict[str, int],
    options: ExtraOptions,
    rounding: AdaRoundSettings | None = None,
) -> dict[str, Any]:
    """Correct the quantized biases of ``model`` in place (module doc); returns a JSON summary.

    Args:
        prepared: the float model after the float passes (same tensor names).
        model: the quantized model (QDQ inserted); its ``<bias>_quantized`` codes are rewritten.
        samples: calibration feeds (up to ``options.AccuracySamples``).
        plan, positions: the quantization plan and solved positions (positions are not changed).
        options: the extra options.
        rounding: with ``OptimAlgorithm = "gptq"``, each layer's weights are first rounded by
            second-order rounding in the same walk
            (:class:`~.sequential_rounding.SequentialRounding`); its summary is
            ``summary["rounding"]``.
    """
    start = time.perf_counter()
    summary: dict[str, Any] = {"layers": 0, "changed_channels": 0, "saturated": 0}
    if not samples:
        logger.warning("bias correction skipped: no calibration samples were kept")
        summary["skipped_reason"] = "no calibration samples kept (AccuracySamples = 0?)"
        return summary
    layers, skipped = find_layers(model, tensor_names(prepared))
    available = len(samples)
    # a fixed budget of activation bytes: large inputs replay fewer samples (the mean shift's
    # standard error, per layer in the report, says what that costs)
    per_sample = layer_output_bytes(layers)
    samples = samples[: replayed_samples(available, per_sample, ACTIVATION_BUDGET)]
    summary.update(samples_available=available, layer_output_bytes_per_sample=per_sample)
    if len(samples) < available:
        logger.info(
            "bias correction: %d of %d samples replayed (%.0f MB of layer outputs a sample, "
            "budget %.0f MB)",
            len(samples),
            available,
            per_sample / 1e6,
            ACTIVATION_BUDGET / 1e6,
        )
    windows = _bias_windows(layers, plan, positions, options)
    moved: dict[str, int] = {}
    if not layers:  # no replay: each would copy or run the whole model for nothing
        summary.update(moved_bias_positions=moved, per_layer=[], skipped=skipped)
        summary.update(samples=len(samples), segment_runs=0)
        if rounding is not None:
            summary["rounding"] = SequentialRounding(prepared, samples, rounding).summary()
        summary["seconds"] = round(time.perf_counter() - start, 3)
        return summary
    # the two replays run side by side (module ahead), one core each: onnxruntime's own threads
    # would split every small one-sample segment run and wake each other for it, which cost more
    # CPU than it saved. The rounder's walk runs them one after the other: its own threads then.
    threads = SIDE_BY_SIDE_THREADS if rounding is None else None
    # closing the replays hands their arena regions and heap pages back before the next stage
    with (
        # the quantized replay reads the working model itself (segments serialized as built)
        Replay(
            model,
            samples,
            "bias correction (quantized model)",
            memory_budget=REPLAY_BUDGET,
            threads=threads,
        ) as quant,
        Replay(
            prepared,
            samples,
            "bias correction (float model)",
            memory_budget=FLOAT_REPLAY_BUDGET,
            threads=threads,
        ) as flt,
        # the float replay's next sample runs here while the quantized one runs (module ahead)
        concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool,
    ):
        rounder = None if rounding is None else SequentialRounding(prepared, samples, rounding)
        per_layer = _correct_layers(
            layers, skipped, quant, (flt, pool), len(samples) // 2, summary, windows, moved, rounder
        )
    if rounder is not None:
        summary["rounding"] = rounder.summary()
    # the bias positions moved inside their shift_bias windows (the caller's solved positions)
    positions.update(moved)
    summary["moved_bias_positions"] = moved
    summary["per_layer"] = per_layer
    summary["skipped"] = skipped
    summary["samples"] = len(samples)
    summary["segment_runs"] = quant.runs + flt.runs
    summary["seconds"] = round(time.perf_counter() - start, 3)
    logger.info(
        "bias correction: %d layer(s), %d channel(s) changed, %d saturated, %d skipped",
        summary["layers"],
        summary["changed_channels"],
        summary["saturated"],
        len(skipped),
    )
    return summary


@dataclasses.dataclass
class _LayerError:
    """A layer's output error (quantized minus float) over the replayed samples, per channel:
    ``num``/``den`` the sums and counts of the fitting half (row 0) and the checking half (row
    1), ``means`` the sums of each sample's mean error and of its square (the standard error of
    the shift over the samples), ``ndim`` the output's rank."""

    num: np.ndarray
    den: np.ndarray
    means: list[Any]
    count: int
    ndim: int

    @classmethod
    def measure(
        cls, layer: Layer, flt: Replay, pool: concurrent.futures.Executor, quant: Replay, half: int
    ) -> _LayerError:
        """One sample of each model at a time: the layer's outputs are never all held."""
        bounds = _activation_bounds(layer)
        num = den = None
        means: list[Any] = [0.0, 0.0]
        count = ndim = 0
        floats = ahead(flt.stream([layer.float_output]), pool)
        pairs = zip(floats, quant.stream([layer.output]), strict=True)
        for (i, (f,)), (_, (q,)) in pairs:
            n, d = channel_sums(f, q, bounds)
            if num is None or den is None:
                num, den = np.zeros((2, n.size)), np.zeros((2, n.size), np.int64)
            num[0 if i < half else 1] += n
            den[0 if i < half else 1] += d
            with np.errstate(invalid="ignore", over="ignore"):
                mean = n / np.maximum(d, 1)
                means = [means[0] + mean, means[1] + mean * mean]
            count += 1
            ndim = q.ndim
            del f, q
        assert num is not None and den is not None
        return cls(num, den, means, count, ndim)


def _correct_layers(
    layers: list[Layer],
    skipped: list[dict[str, Any]],
    quant: Replay,
    float_side: tuple[Replay, concurrent.futures.Executor],
    half: int,
    summary: dict[str, Any],
    windows: dict[str, tuple[tuple[int, int], str]],
    moved: dict[str, int],
    rounder: SequentialRounding | None = None,
) -> list[dict[str, Any]]:
    """The per-layer walk of :func:`correct_bias`; returns the per-layer report.

    ``float_side``: the float replay and the one-worker pool its samples are computed ahead in.
    """
    flt, pool = float_side
    per_layer: list[dict[str, Any]] = []
    with Progress(len(layers), desc="bias correction", unit="layers", logger=logger) as progress:
        for layer in layers:
            progress.update()
            if rounder is not None:  # the weights first: the bias then corrects what they leave
                rounder(layer, quant, flt)
            if layer.bias is None or layer.bias_position is None:
                skipped.append(
                    {
                        "node": layer.name,
                        "reason": "no bias (adding one needs a shift_bias position)",
                    }
                )
                continue
            errors = _LayerError.measure(layer, flt, pool, quant, half)
            num, den, ndim = errors.num, errors.den, errors.ndim
            if half >= 2:
                delta = gated_shift(num, den)
            else:
                delta = num.sum(axis=0) / np.maximum(den.sum(axis=0), 1)
            codes = layer.bias_codes
            assert codes is not None
            if delta.shape != codes.shape:
                skipped.append({"node": layer.name, "reason": "bias and output channels differ"})
                continue
            nonfinite = int(delta.size - np.count_nonzero(np.isfinite(delta)))
            if nonfinite:
                # NaN/Inf activations (non-finite calibration data, overflowing layers) give no
                # usable mean: those channels keep their bias instead of a garbage code
                logger.warning(
                    "bias correction: layer %s: %d channel(s) have a non-finite mean error "
                    "(NaN/Inf in the layer outputs); their bias is left as quantized",
                    layer.name,
                    nonfinite,
                )
                delta = np.where(np.isfinite(delta), delta, 0.0)
            new_codes, saturated = requantize_bias(codes, layer.bias_position, delta)
            old_position = layer.bias_position
            window, bias_tensor = windows.get(layer.name, (None, ""))
            if saturated and window is not None:
                step = _bias_step(layer)
                target = codes.astype(np.float64) * step + delta
                position = best_bias_position(target, old_position, window, codes.dtype)
                moved_codes, moved_saturated = requantize_bias(
                    np.zeros_like(codes), position, target
                )
                # kept only where it leaves the held-out half a smaller mean error than the
                # saturated codes at the old position do
                check = num[1] / np.maximum(den[1], 1) if half >= 2 else delta
                stay = new_codes.astype(np.float64) * step - codes * step
                move = moved_codes.astype(np.float64) * math.ldexp(1.0, -position) - codes * step
                if position != old_position and np.sum((check - move) ** 2) < np.sum(
                    (check - stay) ** 2
                ):
                    new_codes, saturated = moved_codes, moved_saturated
                    _set_bias_position(layer, position, quant)
                    moved[bias_tensor] = position
            applied = new_codes.astype(np.float64) * _bias_step(layer) - codes * math.ldexp(
                1.0, -old_position
            )
            changed = int(np.count_nonzero(applied))
            per_layer.append(
                {
                    "node": layer.name,
                    "shift_standard_error": _standard_error(errors.means, errors.count),
                    "mean_shift_before": float(np.mean(np.abs(delta))),
                    "mean_shift_after": float(np.mean(np.abs(delta - applied))),
                    "changed_channels": changed,
                    "saturated": saturated,
                }
            )
            summary["layers"] += 1
            summary["changed_channels"] += changed
            summary["saturated"] += saturated
            if saturated:
                logger.info(
                    "bias correction: %s: %d bias value(s) saturate at position %d",
                    layer.name,
                    saturated,
                    layer.bias_position,
                )
            if not changed:
                continue
            set_codes(layer.bias, new_codes)
            quant.set_initializer(layer.bias.name or "", new_codes)
            shape = [1] * ndim
            shape[1] = -1
            # added to the layer's float32 output (kept or recomputed): later layers see the
            # corrected prefix
            quant.add_to(layer.output, applied.reshape(shape).astype(np.float32))
    return per_layer
