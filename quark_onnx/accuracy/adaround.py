"""AdaRound: learn, layer by layer, whether each int8 weight rounds down or up.

Positions never change (int8, per tensor, power of two ``s = 2^-p``); only the rounding of each
code between ``floor(w / s)`` and ``floor(w / s) + 1`` is learned, so every NPU rule still holds.

The objective. For a layer with float weights ``W`` and (dequantized, fixed) bias ``b``, ``X`` the
im2col columns of the layer's input *in the quantized model* (the already-quantized prefix) and
``T`` the *float model's* output of that layer, the reconstruction error of weights ``V`` is::

    L(V) = sum || V X - (T - b) ||^2 = tr(V G V^T) - 2 tr(V C) + const,
    G = X X^T + mu I,   C = X (T - b)^T + mu W^T

per convolution group. ``G`` and ``C`` are accumulated once per layer over all samples and output
positions, so an iteration costs ``O(out_channels * K^2)`` whatever the amount of data. The damping
``mu = Damping * mean(diag(X X^T))`` keeps weights in directions the data does not excite near
their float values (otherwise a Gemm fed by 32 samples could round them arbitrarily).

AdaRound (Nagel et al., 2020): ``V = s * (floor(W / s) + h(A))`` with the rectified sigmoid
``h(A) = clip(sigmoid(A) (zeta - gamma) + gamma, 0, 1)``, ``zeta = 1.1``, ``gamma = -0.1``, ``A``
initialised so that ``h = frac(W / s)`` (round-to-nearest's starting point), minimising::

    L(V) / L(nearest) + lambda * mean(1 - |2 h - 1|^beta)

with Adam; the first 20 % of iterations have no regulariser, then ``beta`` anneals from 20 to 2,
pushing every ``h`` to 0 or 1. The result is ``floor(W / s) + [h >= 0.5]``, clipped to int8; codes
whose floor is already outside ``[-128, 127]`` stay saturated. The learned rounding is kept only
when its loss is below round-to-nearest's.

Held-out gate: the samples are split in two (:func:`~.layerwise.held_out_split`); ``G`` and ``C``
of the first half fit the rounding, and a layer keeps it only if its undamped reconstruction
error on the *second* half, ``L_check(V) = tr(V G_2 V^T) - 2 tr(V C_2) + ||T_2 - b||^2``, is
below round-to-nearest's; otherwise the layer stays rounded to nearest. So a layer is never
changed unless the change reduces its output error on data it was not fitted on.

Second-order rounding (``OptimAlgorithm = "gptq"``, :func:`gptq_rounding`): the same loss and the
same held-out gate, minimised in one pass per layer instead of by gradient descent: the best
float weights for the quantized inputs ``W* = C^T G^-1`` are quantized column by column, each
column's rounding error spread over the columns not yet quantized through the Cholesky factor
of ``G^-1`` (GPTQ, Frantar et al., 2022). One factorisation per group; its statistics use at
most :data:`GPTQ_COLUMNS` output positions per sample, in float32. It can also move a weight
away from its floor/ceiling pair (``W*`` is not ``W``), which AdaRound cannot.

With bias correction on (the XINT8 preset), second-order rounding runs inside bias correction's
layer walk instead of as a stage of its own
(:class:`~quark_onnx.accuracy.sequential_rounding.SequentialRounding`): the same replays
feed both, each layer is rounded on the inputs the corrected prefix produces and its bias then
corrected for the rounded weights. Its statistics use :data:`GPTQ_POSITIONS_PER_INPUT` output
positions per input of the layer (spread evenly over each sample), and a layer offering fewer
is left rounded to nearest. The held-out gate there asks more than the separate stage's: the
error must fall on each of :data:`GPTQ_HELD_OUT_GROUPS` disjoint groups of the held-out samples,
not only on their sum; a gain one group alone carries is not taken to generalise (with the sum
alone, SqueezeNet with rescaled channels and folded dead ones lost 0.5 dB of output SQNR on
the 500 test images, benchmarks/results/fidelity_gptq_sum_gate.txt; with both groups it keeps
its SQNR, benchmarks/results/fidelity_gptq.txt).
Positions: a least-squares fit of ``K`` inputs on ``n`` positions looks better on its own data
than on new data by about ``2K/n`` of the error, so at 100 positions per input the fit's
optimism (~2 %) stays small against what rounding gains on held-out samples (up to 68 % of a
layer's error on MobileNetV2). Layers with fewer positions overfit: rounded on all the positions
they had, every MobileNetV2 1x1 layer with 66 or fewer per input lost on its held-out half
(0.5-215 % more error; benchmarks/results/rounding_layers.txt). The statistics then cost
``O(K^3)`` per group whatever the image size (time: benchmarks/results/rounding.txt).

What the layer output is fitted to (``Target``, :mod:`~quark_onnx.accuracy.layer_statistics`):
``"float"`` (default), the float model's output as above, whose least-squares fit on a noisy
quantized input shrinks the layer's response toward its mean; ``"weights"``, the float weights
on the quantized input (``T - b = W X``: rounding only, no compensation of the prefix's error);
``"debiased"``, the float target's fit with each output channel's gain restored (slope 1 of
fitted on float output). The held-out gate measures the same target on the held-out samples.
None of them is in the XINT8 preset (measured: benchmarks/results/rounding_target.md).

Settings (``extra_options["FastFinetune"]``): ``OptimAlgorithm`` (``"adaround"``, default, or
``"gptq"``), ``Target`` (``"float"``, default, ``"weights"`` or ``"debiased"``),
``NumIterations`` (default 500), ``NumBatches`` (samples used, default all kept),
``LearningRate`` (default 0.05), ``TimeBudgetPerLayer`` (seconds of optimisation per layer,
default 5; the loop stops early and keeps the best so far); the last three are AdaRound's.
Supported layers: 2-D Conv (any group, stride, dilation, padding) and Gemm (alpha = beta = 1,
transA = 0); others are reported as skipped.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from quark_onnx.accuracy.layer_statistics import TARGETS, _statistics, _ungroup
from quark_onnx.accuracy.layers import Layer, find_layers, held_out_split, set_codes, tensor_names
from quark_onnx.accuracy.replay import Replay
from quark_onnx.config.options import ExtraOptions, did_you_mean
from quark_onnx.errors import ConfigError, QuantizationError
from quark_onnx.plan.types import QuantPlan
from quark_onnx.runtime.progress import Progress

logger = logging.getLogger(__name__)

ZETA = 1.1
GAMMA = -0.1
#: Fraction of iterations without the rounding regulariser.
WARMUP = 0.2
BETA_START = 20.0
BETA_END = 2.0
#: Weight of the rounding regulariser against the normalised reconstruction loss.
REG_WEIGHT = 10.0
#: Ridge damping relative to the mean diagonal of X X^T.
DAMPING = 0.01


#: ``OptimAlgorithm`` values: learned rounding, or second-order (GPTQ) rounding.
ALGORITHMS = ("adaround", "gptq")

#: Output positions per sample the second-order rounding's statistics use (module doc).
GPTQ_COLUMNS = 1024
#: Output positions per input (``K``) the statistics of second-order rounding inside bias
#: correction use, and the fewest a layer must offer to be rounded
#: (:class:`~quark_onnx.accuracy.sequential_rounding.SequentialRounding`).
GPTQ_POSITIONS_PER_INPUT = 100
#: Disjoint groups the held-out samples of second-order rounding inside bias correction are split
#: into: a layer keeps the rounding only where each group's error falls (module doc).
GPTQ_HELD_OUT_GROUPS = 2
#: Columns quantized between two updates of the columns after them (:func:`gptq_rounding`).
GPTQ_BLOCK = 128

#: The settings that take one of a few names.
_CHOICES = {"OptimAlgorithm": ALGORITHMS, "Target": TARGETS}

#: Upper bounds of the count settings: above them AdaRound would run for days.
_MAX_SETTING = {"NumIterations": 1_000_000, "NumBatches": 100_000}


@dataclass(frozen=True)
class AdaRoundSettings:
    """Typed ``FastFinetune`` settings (see the module docstring)."""

    NumIterations: int = 500
    NumBatches: int = 0
    LearningRate: float = 0.05
    TimeBudgetPerLayer: float = 5.0
    OptimAlgorithm: str = "adaround"
    Target: str = "float"

    @classmethod
    def from_options(cls, raw: dict[str, Any] | None) -> AdaRoundSettings:
        """Validate ``extra_options["FastFinetune"]``; unknown keys name the closest valid one."""
        names = [f.name for f in fields(cls)]
        values: dict[str, Any] = {}
        for key, value in (raw or {}).items():
            if key not in names:
                hint = did_you_mean(str(key), names)
                raise ConfigError(
                    f"unknown FastFinetune setting {key!r}{hint} (valid: {', '.join(names)})"
                )
            if key in _CHOICES:
                if value not in _CHOICES[key]:
                    raise ConfigError(
                        f"FastFinetune setting {key}={value!r} is not one of "
                        f"{', '.join(map(repr, _CHOICES[key]))}"
                    )
                values[key] = value
                continue
            want = float if key in ("LearningRate", "TimeBudgetPerLayer") else int
            ok = isinstance(value, (int, float)) if want is float else isinstance(value, int)
            if isinstance(value, bool) or not ok:
                raise ConfigError(
                    f"FastFinetune setting {key!r} expects {want.__name__}, got {value!r}"
                )
            if key in _MAX_SETTING and value > _MAX_SETTING[key]:
                raise ConfigError(
                    f"FastFinetune setting {key}={value!r} is out of range: at most "
                    f"{_MAX_SETTING[key]} (it sets how long AdaRound runs)"
                )
            if value < 0 or (key == "LearningRate" and value == 0):
                raise ConfigError(f"FastFinetune setting {key!r} must be positive, got {value!r}")
            values[key] = want(value)
        return cls(**values)


@dataclass
class RoundingResult:
    """Codes chosen for one weight tensor and the losses that decided it."""

    codes: np.ndarray
    loss_nearest: float
    loss_learned: float
    accepted: bool
    iterations: int
    seconds: float

    def record(
        self, node: str, changed: int, held_out: tuple[float, float] | None, **extra: Any
    ) -> dict[str, Any]:
        """The report's row for this layer (both rounding paths write the same keys)."""
        return {
            "node": node,
            "loss_nearest": self.loss_nearest,
            "loss_learned": self.loss_learned,
            "accepted": self.accepted,
            "changed_codes": changed if self.accepted else 0,
            "held_out_loss_nearest": None if held_out is None else held_out[0],
            "held_out_loss_learned": None if held_out is None else held_out[1],
            **extra,
        }


def _quadratic_loss(w: np.ndarray, gram: np.ndarray, cross: np.ndarray, const: float) -> float:
    """``sum_g tr(W_g G_g W_g^T) - 2 tr(W_g C_g) + const`` for ``w`` of shape (g, O, K)."""
    wg = np.matmul(w, gram)
    return float(np.sum(wg * w) - 2.0 * np.sum(w * np.swapaxes(cross, 1, 2)) + const)


def learn_rounding(
    w: np.ndarray,
    position: int,
    gram: np.ndarray,
    cross: np.ndarray,
    const: float = 0.0,
    *,
    iterations: int = 500,
    learning_rate: float = 0.05,
    time_budget: float = float("inf"),
    qmin: int = -128,
    qmax: int = 127,
) -> RoundingResult:
    """AdaRound on one weight tensor (module doc) against the quadratic loss ``(gram, cross)``.

    Args:
        w: float weights grouped as (groups, out_per_group, K).
        position: the weight's power-of-two position (unchanged).
        gram: (groups, K, K); cross: (groups, K, out_per_group); const: ``sum ||T - b||^2``.

    Returns:
        The codes (int8, shape of ``w``) and the losses of nearest and learned rounding.
    """
    start = time.perf_counter()
    step = math.ldexp(1.0, -position)
    x = w.astype(np.float64) / step
    base = np.floor(x)
    free = (base >= qmin) & (base < qmax)
    base = np.clip(base, qmin, qmax)
    frac = np.where(free, x - np.floor(x), 0.0)
    nearest = np.clip(np.rint(x), qmin, qmax)
    gram = gram.astype(np.float64)
    cross = cross.astype(np.float64)
    loss_nearest = _quadratic_loss(nearest * step, gram, cross, const)
    scale = max(loss_nearest, 1e-30)
    n_free = max(int(np.count_nonzero(free)), 1)
    ratio = np.clip((frac - GAMMA) / (ZETA - GAMMA), 1e-4, 1 - 1e-4)
    a = np.log(ratio / (1.0 - ratio))
    m = np.zeros_like(a)
    v = np.zeros_like(a)
    b1, b2, eps = 0.9, 0.999, 1e-8
    cross_t = np.swapaxes(cross, 1, 2)
    done = 0
    warm = int(WARMUP * iterations)
    for it in range(iterations):
        if time.perf_counter() - start > time_budget:
            break
        sig = 1.0 / (1.0 + np.exp(-a))
        h_raw = sig * (ZETA - GAMMA) + GAMMA
        h = np.clip(h_raw, 0.0, 1.0)
        soft = (base + h * free) * step
        grad_w = 2.0 * (np.matmul(soft, gram) - cross_t) / scale
        grad_h = grad_w * step
        if it >= warm:
            t = (it - warm) / max(iterations - warm, 1)
            beta = BETA_START + (BETA_END - BETA_START) * t
            d = 2.0 * h - 1.0
            grad_h = grad_h + REG_WEIGHT / n_free * (
                -beta * np.abs(d) ** (beta - 1.0) * np.sign(d) * 2.0
            )
        grad_a = grad_h * free * ((h_raw > 0) & (h_raw < 1)) * sig * (1.0 - sig) * (ZETA - GAMMA)
        m = b1 * m + (1 - b1) * grad_a
        v = b2 * v + (1 - b2) * grad_a * grad_a
        mh = m / (1 - b1 ** (it + 1))
        vh = v / (1 - b2 ** (it + 1))
        a = a - learning_rate * mh / (np.sqrt(vh) + eps)
        done = it + 1
    sig = 1.0 / (1.0 + np.exp(-a))
    h = np.clip(sig * (ZETA - GAMMA) + GAMMA, 0.0, 1.0)
    learned = np.clip(base + (h >= 0.5) * free, qmin, qmax)
    loss_learned = _quadratic_loss(learned * step, gram, cross, const)
    accepted = loss_learned < loss_nearest
    codes = (learned if accepted else nearest).astype(np.int8)
    return RoundingResult(
        codes, loss_nearest, loss_learned, accepted, done, time.perf_counter() - start
    )


def gptq_rounding(
    w: np.ndarray,
    position: int,
    gram: np.ndarray,
    cross: np.ndarray,
    const: float = 0.0,
    *,
    qmin: int = -128,
    qmax: int = 127,
) -> RoundingResult:
    """Second-order (GPTQ/OBQ) rounding of one weight tensor against ``(gram, cross)``.

    The quadratic loss of :func:`learn_rounding` is ``(V - W*) G (V - W*)^T + const'`` with
    ``W* = C^T G^-1`` the best float weights for the quantized inputs. Columns (inputs) are
    quantized one at a time at the fixed step ``s = 2^-p``; the error of each column is spread
    over the columns not yet quantized through the inverse Hessian's Cholesky factor
    ``G^-1 = U^T U``: ``w[:, j+1:] -= (w_j - q_j) / U_jj * U[j, j+1:]`` (Frantar et al., 2022).
    One Cholesky factorisation per group; batched over groups (depthwise layers). The result is
    kept only when its loss is below round-to-nearest's (of the float weights ``w``).
    """
    start = time.perf_counter()
    step = math.ldexp(1.0, -position)
    gram = gram.astype(np.float64)
    cross = cross.astype(np.float64)
    nearest = np.clip(np.rint(w.astype(np.float64) / step), qmin, qmax)
    loss_nearest = _quadratic_loss(nearest * step, gram, cross, const)
    k = gram.shape[1]
    try:
        target = np.swapaxes(np.linalg.solve(gram, cross), 1, 2)  # (g, O, K) = C^T G^-1
        upper = np.swapaxes(np.linalg.cholesky(np.linalg.inv(gram)), 1, 2)
    except np.linalg.LinAlgError:
        return RoundingResult(
            nearest.astype(np.int8), loss_nearest, loss_nearest, False, 0,
            time.perf_counter() - start,
        )  # fmt: skip
    work = target.copy()
    codes = np.empty_like(work)
    # lazy batch updates (GPTQ's blocks): inside a block column by column, then the columns
    # after it in one matrix product, instead of one rank-1 update of every later column each
    for b0 in range(0, k, GPTQ_BLOCK):
        b1 = min(b0 + GPTQ_BLOCK, k)
        errors = np.empty((*work.shape[:2], b1 - b0))
        for j in range(b0, b1):
            col = np.clip(np.rint(work[:, :, j] / step), qmin, qmax)
            codes[:, :, j] = col
            err = (work[:, :, j] - col * step) / upper[:, j, j][:, None]
            work[:, :, j + 1 : b1] -= err[:, :, None] * upper[:, None, j, j + 1 : b1]
            errors[:, :, j - b0] = err
        if b1 < k:
            work[:, :, b1:] -= np.matmul(errors, upper[:, b0:b1, b1:])
    loss = _quadratic_loss(codes * step, gram, cross, const)
    accepted = loss < loss_nearest
    return RoundingResult(
        (codes if accepted else nearest).astype(np.int8), loss_nearest, loss, accepted, k,
        time.perf_counter() - start,
    )  # fmt: skip


def _round(
    layer: Layer,
    stats: tuple[np.ndarray, np.ndarray, np.ndarray, float, Any],
    held: tuple[np.ndarray, np.ndarray, np.ndarray, float, Any] | None,
    settings: AdaRoundSettings,
) -> tuple[RoundingResult, tuple[float, float] | None]:
    """Round one layer against its damped fitted statistics, then the held-out gate (module
    doc); returns the result (round-to-nearest codes where not accepted) and the held-out
    losses (nearest, learned) when they were measured."""
    wg, gram, cross, const, _ = stats
    diag = np.mean(np.diagonal(gram, axis1=1, axis2=2), axis=1)
    mu = DAMPING * np.maximum(diag, 1e-12)
    gram = gram + mu[:, None, None] * np.eye(gram.shape[1])[None]
    cross = cross + mu[:, None, None] * np.swapaxes(wg, 1, 2)
    const = const + float(np.sum(mu[:, None, None] * wg * wg))
    if settings.OptimAlgorithm == "gptq":
        result = gptq_rounding(wg, layer.weight_position, gram, cross, const)
    else:
        result = learn_rounding(
            wg,
            layer.weight_position,
            gram,
            cross,
            const,
            iterations=settings.NumIterations,
            learning_rate=settings.LearningRate,
            time_budget=settings.TimeBudgetPerLayer,
        )
    held_out = None
    if held is not None and result.accepted:
        # judged on samples the rounding was not fitted on (undamped reconstruction error)
        _, h_gram, h_cross, h_const, _ = held
        step = math.ldexp(1.0, -layer.weight_position)
        nearest = np.clip(np.rint(wg / step), -128, 127) * step
        held_out = (
            _quadratic_loss(nearest, h_gram, h_cross, h_const),
            _quadratic_loss(result.codes * step, h_gram, h_cross, h_const),
        )
        result.accepted = held_out[1] < held_out[0]
        if not result.accepted:
            result.codes = np.clip(np.rint(wg / step), -128, 127).astype(np.int8)
    return result, held_out


def adaround(
    prepared: onnx.ModelProto,
    model: ir.Model,
    samples: Sequence[dict[str, np.ndarray]],
    plan: QuantPlan,
    positions: dict[str, int],
    options: ExtraOptions,
) -> dict[str, Any]:
    """Learn the rounding of every supported layer's int8 weights in place; JSON summary.

    Layers are visited in graph order; each one's input is taken from the quantized model with the
    earlier layers already re-rounded, its target from the float model (:class:`~.layerwise.Replay`,
    one pass over each model in total).
    """
    settings = AdaRoundSettings.from_options(options.FastFinetune)
    start = time.perf_counter()
    summary: dict[str, Any] = {"layers": 0, "accepted": 0, "settings": settings.__dict__.copy()}
    if not samples:
        logger.warning("AdaRound skipped: no calibration samples were kept")
        summary["skipped_reason"] = "no calibration samples kept (AccuracySamples = 0?)"
        return summary
    used = list(samples[: settings.NumBatches] if settings.NumBatches else samples)
    layers, skipped = find_layers(model, tensor_names(prepared))
    float_weights = {t.name: t for t in prepared.graph.initializer}
    per_layer: list[dict[str, Any]] = []
    # closing the replays hands their arena regions and heap pages back before the next stage
    with (
        Replay(model, used, "AdaRound (quantized model)") as quant,
        Replay(prepared, used, "AdaRound (float model)") as flt,
        Progress(len(layers), desc="AdaRound", unit="layers", logger=logger) as progress,
    ):
        for layer in layers:
            progress.update()
            w_name = _float_weight_name(layer)
            if layer.weight_codes.dtype != np.int8 or w_name not in float_weights:
                skipped.append({"node": layer.name, "reason": "no float int8-quantized weight"})
                continue
            w_float = onnx.numpy_helper.to_array(float_weights[w_name]).astype(np.float32)
            bias = _dequantized_bias(layer, w_float)
            (xs,) = quant.get([layer.input])
            (ts,) = flt.get([layer.float_output])
            t0 = time.perf_counter()
            fit_x, check_x = held_out_split(xs)
            fit_t, check_t = held_out_split(ts)
            columns = GPTQ_COLUMNS if settings.OptimAlgorithm == "gptq" else 0
            target = settings.Target
            stats = _statistics(layer, w_float, bias, fit_x, fit_t, columns, target)
            held = (
                _statistics(layer, w_float, bias, check_x, check_t, columns, target)
                if check_x
                else None
            )
            if stats is None:
                skipped.append({"node": layer.name, "reason": f"unsupported {layer.op_type} form"})
                continue
            result, held_out = _round(layer, stats, held, settings)
            stat_seconds = time.perf_counter() - t0 - result.seconds
            how = stats[4]
            codes = _ungroup(result.codes, how)
            changed = int(np.count_nonzero(codes != layer.weight_codes))
            if result.accepted and changed:
                set_codes(layer.weight, codes)
                quant.set_initializer(layer.weight.name or "", codes)
            summary["layers"] += 1
            summary["accepted"] += int(result.accepted)
            per_layer.append(
                result.record(
                    layer.name,
                    changed,
                    held_out,
                    iterations=result.iterations,
                    seconds=round(result.seconds + stat_seconds, 3),
                )
            )
            logger.debug("AdaRound %s: %s", layer.name, per_layer[-1])
    summary["per_layer"] = per_layer
    summary["skipped"] = skipped
    summary["samples"] = len(used)
    summary["seconds"] = round(time.perf_counter() - start, 3)
    logger.info(
        "AdaRound: %d layer(s), %d improved on round-to-nearest, %d skipped, %.1f s",
        summary["layers"],
        summary["accepted"],
        len(skipped),
        summary["seconds"],
    )
    return summary


def rounding_in_bias_walk(qconfig: Any, options: ExtraOptions) -> AdaRoundSettings | None:
    """The settings when second-order rounding runs inside bias correction's walk (both on,
    ``OptimAlgorithm = "gptq"``: one replay of each model, each layer rounded and then its bias
    corrected on the same inputs); None when rounding is off or a stage of its own."""
    if not (qconfig.include_fast_ft and qconfig.include_bias_correction):
        return None
    settings = AdaRoundSettings.from_options(options.FastFinetune)
    return settings if settings.OptimAlgorithm == "gptq" else None


def _float_weight_name(layer: Layer) -> str:
    """The float weight's name: the DQ's output is ``W_DequantizeLinear_Output``; the codes are
    ``W_quantized`` (InsertQDQ)."""
    name = layer.weight.name or ""
    return name[: -len("_quantized")] if name.endswith("_quantized") else name


def _dequantized_bias(layer: Layer, w_float: np.ndarray) -> np.ndarray:
    cout = w_float.shape[0]
    if layer.op_type == "Gemm" and not layer.node.attributes.get_int("transB", 0):
        cout = w_float.shape[1]
    elif layer.op_type == "ConvTranspose":  # weight C_in x C_out/group x k...
        cout = w_float.shape[1] * layer.node.attributes.get_int("group", 1)
    codes = layer.bias_codes
    if codes is None or layer.bias_position is None:
        return np.zeros(cout)
    if codes.size != cout:
        raise QuantizationError(f"{layer.name}: bias has {codes.size} values for {cout} outputs")
    return codes.astype(np.float64) * math.ldexp(1.0, -layer.bias_position)
