"""CrossLayerEqualization: data-free equalization of the weight ranges of consecutive convolutions.

Why. The NPU quantizes each weight tensor with one power-of-two scale. After BatchNorm folding the
output channels of a convolution (depthwise ones above all) can have weight ranges tens of times
apart, so a per-tensor scale set by the widest channel rounds the narrow ones to a few levels or
to zero. Cross-layer equalization (Nagel et al., "Data-Free Quantization Through Weight
Equalization and Bias Correction", ICCV 2019) moves range between two layers without changing the
float function.

Maths. Let ``y = f(W1 * x + b1)`` feed ``z = W2 * y + b2`` where ``f`` is positively homogeneous
and acts per channel: ``f(s x) = s f(x)`` for every ``s > 0`` (Relu, LeakyRelu, PRelu, no
activation at all, max/average pooling, zero padding). For any positive vector ``s``::

    W1[i, ...] <- W1[i, ...] / s_i      b1[i] <- b1[i] / s_i        (output channel i of conv 1)
    W2[:, i, ...] <- W2[:, i, ...] * s_i                             (input channel i of conv 2)

leaves ``z`` unchanged, because channel ``i`` of ``y`` is divided by ``s_i`` and every weight that
reads it is multiplied by ``s_i``. With ``r1_i = max |W1[i, ...]|`` (and, with
``scale_append_bias``, ``max(r1_i, |b1_i|)``) and ``r2_i`` = the largest ``|w|`` of conv 2 that
reads input channel ``i``, the choice::

    s_i = sqrt(r1_i * r2_i) / r2_i = sqrt(r1_i / r2_i)

makes both new ranges equal to ``sqrt(r1_i * r2_i)``, which maximises the product of the two
layers' relative channel precisions (Nagel et al., section 4.1). A channel that carries ~0 keeps
``s_i = 1``: one whose weight product ``max |W1[i, ...]| * r2_i`` is at most
:data:`NEGLIGIBLE_RANGE` times the pair's largest (a dead or constant channel; equalizing with it
would carry its ~0 range over to the partner, and its bias, divided by a tiny ``s_i``, into the
activation). The product, not either range alone, because it is what the channel contributes to
the readers and it does not change when the channel is rescaled (``W1[i] * a``, ``W2[:, i] / a``):
a channel that one layer has made 100 times narrower and the other 100 times wider is not dead,
it is exactly what CLE must undo. The ungated sweeps (``gate = False`` or ``'component'``) do
not leave such a channel where the model put it, though, since that is whatever factor the
model happened to carry on it (a rescaled network keeps a near-dead channel 100x wider than the
rest, and it sets the whole layer's per-tensor range): they place it where its ranges,
normalised by the live channels' medians, are equal (:func:`_place_negligible`), which is
inside both layers' typical ranges whenever its normalised product is at most 1 (a constant
channel read by wide weights is not, and keeps ``s_i = 1``).

Grouped second convolutions are handled through their channel layout: input channel ``i`` of a conv
with ``group = g`` and ``C_in / g`` channels per group is column ``i mod (C_in / g)`` of the output
channels of group ``i div (C_in / g)``; a depthwise conv (``group = C_in``, weight ``C_out x 1 x k
x k``) thus scales its per-channel filters by ``s_i``.

Chains (``conv -> dw conv -> conv`` in MobileNet blocks) share layers between pairs: a depthwise
conv is the second layer of one pair and the first of the next. One *step* equalizes every pair
once, in graph order, recomputing ranges from the current weights (Gauss-Seidel sweeps). Steps
repeat until ``steps`` is reached or, with ``steps = -1``, until the total relative change of the
step, ``sum over pairs of mean_i |s_i - 1|`` (the relative change of both layers' channel ranges),
falls below ``threshold`` (``ExtraOptions.CLETotalLayerDiffThreshold``; AMD Quark measures the
absolute mean weight change instead, which depends on the weights' magnitudes). A step limit of
:data:`MAX_ADAPTIVE_STEPS` bounds the adaptive mode. In that mode the ungated sweeps over-relax
each group of pairs that share layers (step ``s^omega``, :func:`over_relaxation` of the group's
longest chain), since only the end point matters there: a chain's balance is a 1-D Laplacian in log
scale, whose plain sweeps need ``O(length^2)`` steps; over-relaxed still ``O(length)``, so
after :data:`SWEEPS_BEFORE_SOLVE` steps the balanced point is solved for directly (policy
iteration over which channels set the ranges, one block-tridiagonal solve per policy:
:mod:`._cle_balance`) and a sweep confirms it. Scales are accumulated in float64 and each
weight is rounded back to its dtype once, so the float model changes only by that rounding (about
1e-7 relative for float32).

Gate (on by default). Equalizing ranges is not the same as lowering the error of one
power-of-two scale per tensor: the rescaled tensor's range may move to a worse point of the
power-of-two grid, and a second conv's channels that were fine become coarse. Each proposed
scaling of a pair is therefore applied only if it lowers the layers' rounding noise as the
readers' outputs see it (:func:`propagated_noise`: int8 rounding error at each weight's MinMSE
position, each channel weighted by the signal it carries to the readers, so a channel the grid
rounds away counts however small its weights), summed over the pair's layers (``gate = 'sum'``,
the default) or, with ``gate = 'per_layer'``, also without raising any one layer's. If the full
step fails, the damped steps ``s^(1/2)`` and ``s^(1/4)`` are tried (the grid makes the noise
jagged in ``s``); if all fail the pair is left as it is for that step. Both terms are noise at
the same readers' outputs, so their sum is what the pair's precision is; the per-layer rule
refuses real trade-offs (equalizing usually coarsens one side a little to save the other a
lot) and, measured, leaves a randomly rescaled SqueezeNet unrepaired. This needs no data, so it
runs in the float prepare stage.

Component gate (``gate = 'component'``, what ``include_cle`` runs). A step-by-step gate makes the
result depend on where the sweeps start: the same network with its channels rescaled ends at
another point (a rescaled SqueezeNet lost 5 points where the original lost 1). Converged
equalization without a gate does not: the balanced point ``r1_i = r2_i`` absorbs any per-channel
factor, and on chains it is unique, once the ~0 channels are placed rather than left at ``s = 1``
(left there, they kept the rescaling's factors, and a rescaled SqueezeNet ended at 1.4x the
predicted noise of the equalized original; placed, it ends on the same weights). So the pairs are
equalized ungated, and then each group of pairs that share layers (:func:`_components`) keeps the
equalized weights only if they predict less noise than the weights the pass found by
:data:`COMPONENT_MIN_GAIN`. The prediction (:func:`_component_noise`) adds,
over the group, every pair's :func:`propagated_noise` and, given ``sample_feeds``, the
:func:`activation_noise` of every tensor the readers read (measured once, before equalizing, and
followed through the scaling: a channel made wider sets a coarser per-tensor step for all the
others). The equalized point and its predicted noise are the same for a model and any rescaling of
it, so a rescaled model gets the equalized weights of the original, while an original whose ranges
are already fine keeps its own weights exactly.

``max_scale`` bounds the *cumulative* factor applied to each channel boundary to
``[1 / max_scale, max_scale]``, so near-dead channels do not blow up the neighbouring weights.

Pairs handled: ``Conv -> [ops] -> Conv(s)`` where

* ``[ops]`` is zero or more of Relu, LeakyRelu, PRelu, Identity, Clip whose bounds are each absent,
  0 or infinite (``Clip(0, inf)`` is a Relu), MaxPool (no Indices output used), AveragePool,
  GlobalAveragePool, GlobalMaxPool, Pad in reflect/edge/wrap mode or constant mode with value 0,
  and Concat on the channel axis (channel ``i`` becomes channel ``offset + i``; the inputs'
  channel counts must be known);
* every reader of the first conv's output and of every value on the way is one of those ops
  (through input 0, any input of a Concat) or a Conv reading it as input 0: the first conv is
  equalized against all those convs at once, ``r2_i`` the largest read of channel ``i`` over
  them (SqueezeNet's squeeze conv against both expand convs; each expand conv against the conv
  after the Concat). A graph output, or any other reader (a residual Add), blocks it;
* all convs have constant float weights (initializers that are not graph inputs, or Constant
  nodes) and a constant bias or none; each reader's ``C_in`` equals the channels it reads.

Not equalized (logged at debug level and listed in :attr:`CrossLayerEqualization.report`):

* ``Clip(0, 6)`` (ReLU6) and any Clip with a finite non-zero bound: not positively homogeneous
  (``min(s x, 6) != s min(x, 6)``). :class:`~quark_onnx.passes.ReplaceClip6Relu` keeps the
  bound as the Relu's range cap, which blocks the pair as well: a per-tensor cap does not
  survive per-channel scaling.
* Gemm/MatMul pairs (not implemented) and anything else between the two convs (Add, Mul,
  Sigmoid, HardSigmoid, Concat, Reshape, ...).

High-bias absorption (section 4.2 of the paper) is not done: the data-free bound it needs
(``beta - 3 gamma`` from BatchNorm statistics) is gone once ``ConvertBNToConv`` has folded the
BatchNorms, and a bound without it would need calibration data. Biases are scaled, never moved.

Only the main graph is searched (not If/Loop bodies). A value carrying the range cap that
:class:`~quark_onnx.passes.ConvertClipToRelu` records (metadata ``quark_onnx.range_max``) blocks
a pair: the cap holds for the unscaled channels only, so CLE must run before that pass.

Weight initializers shared with another node, and weights produced by Constant nodes, are copied
into fresh initializers before being rewritten; nothing else in the graph sees the new values.

Code. This module is the pass: pair selection, the sweep loop, the component decision and the
write-back. The ops through which per-channel scaling is float-exact and the search for the convs
reading a conv's channels are in :mod:`._cle_pairs`; the layers' working copies, the per-pair
step with its gate and over-relaxation in :mod:`._cle_solver`; the noise predictions in
:mod:`._cle_noise`; the channel ranges and statistics shared with other passes in
:mod:`._channels`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable, Sequence

import numpy as np
import onnx_ir as ir

from quark_onnx.errors import ConfigError
from quark_onnx.graph.channels import ChannelStats, channel_range_spread, channel_statistics
from quark_onnx.graph.ir import NameGenerator, store_constant_input
from quark_onnx.passes._cle_balance import balance
from quark_onnx.passes._cle_pairs import _follow, _label
from quark_onnx.passes._cle_solver import (
    _chain_length,
    _component_noise,
    _components,
    _equalize,
    _Layer,
    _Pair,
    over_relaxation,
)
from quark_onnx.passes.base import QuarkPass

logger = logging.getLogger(__name__)


#: Upper bound on the number of steps when ``steps = -1`` (until converged).
MAX_ADAPTIVE_STEPS = 2000

#: Ungated steps to convergence after which the balanced point is solved for instead
#: (:func:`~quark_onnx.passes._cle_balance.balance`). A sweep costs one pass over the pairs and
#: wide, short graphs converge in a few dozen (the shared models: at most 70), where one solve
#: costs more than all their sweeps (dense blocks of hundreds of channels); a chain needs sweeps in
#: proportion to its length (over-relaxed), which the solve does not. A fixed budget keeps the
#: pass linear in the number of pairs either way.
SWEEPS_BEFORE_SOLVE = 100

#: ``gate = 'component'`` keeps a group's equalized weights only when they predict at most
#: 1 / this of the noise of the weights it found. The prediction is first order (white inputs
#: to the weights, the smallest covering power-of-two activation step, no bias rounding): on the
#: shared models it is off by up to ~10 % either way where equalizing changes little (SqueezeNet
#: 1.1: predicted -5 %, measured +8 % output noise), while a real range problem predicts orders
#: of magnitude (a rescaled pair: 100x to 1e6x). A factor 2 (3 dB) acts only on the latter.
COMPONENT_MIN_GAIN = 2.0

#: Gate modes (see the module docstring).
GATES = ("sum", "per_layer", "component")


@dataclasses.dataclass(frozen=True)
class EqualizedPair:
    """Two convolutions equalized together, and the op types between them."""

    first: str
    second: str
    through: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class SkippedPair:
    """A convolution whose output could not be equalized with a following one, and why."""

    first: str
    reason: str


@dataclasses.dataclass(frozen=True)
class RangeSpread:
    """``max_c r_c / min_c r_c`` over the output channels ``c`` of a weight, before and after.

    ``r_c = max |W[c, ...]|``; channels with ``r_c = 0`` are left out (they stay zero).
    """

    node: str
    weight: str
    before: float
    after: float


@dataclasses.dataclass(frozen=True)
class ComponentChoice:
    """The ``gate = 'component'`` decision on one group of pairs that share layers."""

    pairs: tuple[str, ...]
    noise_before: float
    noise_after: float
    kept: bool


@dataclasses.dataclass
class CLEReport:
    """What the last run of :class:`CrossLayerEqualization` did."""

    pairs: list[EqualizedPair] = dataclasses.field(default_factory=list)
    skipped: list[SkippedPair] = dataclasses.field(default_factory=list)
    iterations: int = 0
    converged: bool = False
    #: ``sum over pairs of mean_i |s_i - 1|`` in the last step.
    last_change: float = math.inf
    spreads: list[RangeSpread] = dataclasses.field(default_factory=list)
    #: Pairs whose scaling the gate refused (in their last step): ``"first -> second"``.
    rejected: list[str] = dataclasses.field(default_factory=list)
    #: ``gate = 'component'``: per group of pairs that share layers, its pairs, the predicted
    #: noise before and after equalization, and whether the equalized weights were kept.
    components: list[ComponentChoice] = dataclasses.field(default_factory=list)


class CrossLayerEqualization(QuarkPass):
    """Equalize per-channel weight ranges of ``Conv -> (homogeneous ops) -> Conv`` pairs.

    Args:
        steps: equalization sweeps over all pairs (``ExtraOptions.CLESteps``); ``-1`` repeats
            until a step's total relative change is below ``threshold`` (at most
            :data:`MAX_ADAPTIVE_STEPS` steps); ``0`` does nothing.
        threshold: stop when ``sum over pairs of mean_i |s_i - 1|`` of a step is below this
            (``ExtraOptions.CLETotalLayerDiffThreshold``); also ends a run with ``steps > 0`` early.
        scale_append_bias: the first conv's channel range is ``max(max |W1[i]|, |b1_i|)``
            (``ExtraOptions.CLEScaleAppendBias``), so a large bias is not inflated by ``1/s_i``.
        max_scale: the cumulative factor at each channel boundary stays in
            ``[1/max_scale, max_scale]``; ``None`` for no bound.
        pairs: ``(first conv name, second conv name)`` pairs to equalize (node names; unnamed
            nodes cannot be selected); ``None`` for all eligible pairs. Named pairs that are not
            eligible are logged and listed as skipped.
        gate: apply a pair's scaling only when it lowers the power-of-two weight quantization
            noise the readers see (:func:`propagated_noise`, the NPU's per-tensor int8 grid),
            summed over the layers (``True`` or ``'sum'``) or also for each layer
            (``'per_layer'``); ``'component'``: equalize without a gate, then keep the result
            of each group of pairs that share layers only if it lowers the group's predicted
            noise (:func:`_component_noise`: weights, and with ``sample_feeds`` the activations
            between them) by at least :data:`COMPONENT_MIN_GAIN`; ``False``: no gate. Refused
            pairs are listed in :attr:`CLEReport.rejected`, the component decisions in
            :attr:`CLEReport.components`.
        sample_feeds: model inputs (e.g. a calibration batch) on which ``gate = 'component'``
            measures the activations the pairs rescale; without them only the weights count.

    After a run, :attr:`report` (:class:`CLEReport`) lists the pairs, the steps taken and the
    per-weight channel range spread before and after.
    """

    def __init__(
        self,
        steps: int = 1,
        threshold: float = 2e-7,
        scale_append_bias: bool = True,
        max_scale: float | None = 1e4,
        pairs: Sequence[tuple[str, str]] | None = None,
        gate: bool | str = True,
        sample_feeds: dict[str, np.ndarray] | None = None,
    ) -> None:
        super().__init__()
        if gate not in GATES and gate not in (True, False):
            raise ConfigError(
                f"CrossLayerEqualization gate={gate!r}: use True (= 'sum'), 'per_layer', "
                "'component' or False"
            )
        self.gate: str | None = None if gate is False else ("sum" if gate is True else str(gate))
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < -1:
            raise ConfigError(
                f"CrossLayerEqualization steps={steps!r}: use a positive integer, 0 (no-op) "
                "or -1 (until converged)"
            )
        if not threshold >= 0:
            raise ConfigError(f"CrossLayerEqualization threshold={threshold!r}: use a number >= 0")
        if max_scale is not None and not max_scale > 1:
            raise ConfigError(
                f"CrossLayerEqualization max_scale={max_scale!r}: use a number > 1 or None"
            )
        self.steps = steps
        self.threshold = float(threshold)
        self.scale_append_bias = bool(scale_append_bias)
        self.max_scale = None if max_scale is None else float(max_scale)
        self.pairs = None if pairs is None else {(str(a), str(b)) for a, b in pairs}
        self.sample_feeds = sample_feeds
        self.report = CLEReport()

    # ------------------------------------------------------------------------------ discovery

    def _find_pairs(self, graph: ir.Graph, report: CLEReport) -> list[_Pair]:
        layers: dict[int, _Layer] = {}

        def layer(node: ir.Node, arrays: tuple[np.ndarray, np.ndarray | None]) -> _Layer:
            key = id(node)
            if key not in layers:
                weight, bias = arrays
                group = node.attributes.get_int("group", 1)
                layers[key] = _Layer(
                    node=node,
                    weight=weight.astype(np.float64),
                    bias=None if bias is None else bias.astype(np.float64),
                    group=group,
                    original=weight,
                    original_bias=bias,
                )
            return layers[key]

        found: list[_Pair] = []
        for node in graph:
            if node.op_type != "Conv" or node.domain not in ("", "ai.onnx"):
                continue
            result = _follow(node)
            if isinstance(result, str):
                report.skipped.append(SkippedPair(_label(node), result))
                logger.debug("CLE: no pair from %s: %s", _label(node), result)
                continue
            readers, through, first_arrays = result
            names = [reader.name for reader, _, _ in readers]
            if self.pairs is not None and not any((node.name, n) in self.pairs for n in names):
                report.skipped.append(
                    SkippedPair(_label(node), f"pair with {', '.join(names)!r} not selected")
                )
                continue
            first_layer = layer(node, first_arrays)
            found.append(
                _Pair(
                    first_layer,
                    [(layer(reader, arrays), idx) for reader, idx, arrays in readers],
                    through,
                    np.ones(first_layer.weight.shape[0]),
                )
            )
        if self.pairs is not None:
            chosen = {(p.first.node.name, r.node.name) for p in found for r in p.reader_layers}
            for a, b in sorted(self.pairs - chosen):
                logger.warning("CLE: requested pair (%r, %r) is not an eligible pair", a, b)
                report.skipped.append(SkippedPair(a, f"requested pair with {b!r} not eligible"))
        return found

    # ------------------------------------------------------------------------------ prediction

    def _measure(self, model: ir.Model, pairs: Sequence[_Pair]) -> dict[str, ChannelStats]:
        """Statistics of every tensor the pairs' readers read, on ``sample_feeds`` (empty when
        onnxruntime cannot run the model: then only the weights are judged)."""
        names = sorted({layer.node.inputs[0].name for p in pairs for layer in p.reader_layers})
        try:
            return channel_statistics(model, self.sample_feeds or {}, names)
        except Exception as exc:  # onnxruntime raises its own exception types
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            logger.warning(
                "CLE: cannot run the model on the samples (%s); only weights are judged", first
            )
            return {}

    # ------------------------------------------------------------------------------ write back

    def _write_back(self, graph: ir.Graph, layers: Iterable[_Layer], report: CLEReport) -> None:
        names: NameGenerator | None = None
        for layer in layers:
            if not layer.changed:
                continue
            if names is None:
                names = NameGenerator(graph)
            dtype = layer.original.dtype
            weight = layer.weight.astype(dtype)
            before = channel_range_spread(layer.original)
            w_name = store_constant_input(graph, layer.node, 1, weight, names, "cle")
            if layer.bias is not None:
                store_constant_input(graph, layer.node, 2, layer.bias.astype(dtype), names, "cle")
            report.spreads.append(
                RangeSpread(_label(layer.node), w_name, before, channel_range_spread(weight))
            )

    # ------------------------------------------------------------------------------ pass entry

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        report = CLEReport()
        self.report = report
        pairs = self._find_pairs(model.graph, report)
        report.pairs = [EqualizedPair(_label(p.first.node), p.second, p.through) for p in pairs]
        if not pairs or self.steps == 0:
            report.converged = not pairs
            report.last_change = 0.0 if not pairs else math.inf
            return ir.passes.PassResult(model, modified=False)

        if self.steps == -1 and self.gate not in ("sum", "per_layer"):
            # only the end point matters: over-relax the chains (fixed steps keep plain steps)
            for chain in _components(pairs):
                relax = over_relaxation(_chain_length(chain))
                for pair in chain:
                    pair.relax = relax
        components = _components(pairs) if self.gate == "component" else []
        stats = self._measure(model, pairs) if components and self.sample_feeds else {}
        before = [_component_noise(comp, stats) for comp in components]

        limit = MAX_ADAPTIVE_STEPS if self.steps == -1 else self.steps
        solve = self.steps == -1 and self.gate not in ("sum", "per_layer")
        while report.iterations < limit:
            if solve and report.iterations >= SWEEPS_BEFORE_SOLVE:
                # the balanced point directly, once (its solves are bounded): the sweeps
                # settle what it leaves out
                balance(pairs, self.scale_append_bias, self.max_scale)
                solve = False
            change = sum(
                _equalize(pair, self.gate, self.scale_append_bias, self.max_scale) for pair in pairs
            )
            report.iterations += 1
            report.last_change = change
            if change < self.threshold:
                report.converged = True
                break
        if self.steps == -1 and not report.converged:
            logger.warning(
                "CLE: not converged after %d steps (change %.3g >= threshold %.3g)",
                report.iterations,
                report.last_change,
                self.threshold,
            )

        for pair in pairs:
            pair.first.materialize()
            for layer in pair.reader_layers:
                layer.materialize()
        for comp, noise_before in zip(components, before, strict=True):
            noise_after = _component_noise(comp, stats)
            keep = noise_after * COMPONENT_MIN_GAIN < noise_before
            labels = tuple(f"{_label(p.first.node)} -> {p.second}" for p in comp)
            report.components.append(ComponentChoice(labels, noise_before, noise_after, keep))
            logger.debug(
                "CLE: %s: predicted noise %.4g -> %.4g, %s",
                "; ".join(labels),
                noise_before,
                noise_after,
                "equalized" if keep else "left as it was",
            )
            if not keep:
                for pair in comp:
                    pair.cumulative = np.ones_like(pair.cumulative)
                    pair.first.restore()
                    for layer in pair.reader_layers:
                        layer.restore()
        report.rejected = [f"{_label(p.first.node)} -> {p.second}" for p in pairs if p.rejected]
        report.rejected += [
            label for choice in report.components if not choice.kept for label in choice.pairs
        ]
        layers: dict[int, _Layer] = {}
        for pair in pairs:
            layers.setdefault(id(pair.first), pair.first)
            for layer in pair.reader_layers:
                layers.setdefault(id(layer), layer)
        self._write_back(model.graph, layers.values(), report)
        modified = bool(report.spreads)
        logger.info(
            "CLE: %d pairs, %d steps, converged=%s, last change %.3g",
            len(pairs),
            report.iterations,
            report.converged,
            report.last_change,
        )
        for spread in report.spreads:
            logger.debug(
                "CLE: %s channel range spread %.3g -> %.3g",
                spread.node,
                spread.before,
                spread.after,
            )
        return ir.passes.PassResult(model, modified=modified)
