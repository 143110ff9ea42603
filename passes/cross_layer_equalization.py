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
scale, whose plain sweeps need ``O(length^2)`` steps. Scales are accumulated in float64 and each
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
:data:`COMPONENT_MIN_GAIN`. The prediction (:meth:`CrossLayerEqualization._component_noise`) adds,
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
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import onnx_ir as ir

from quark_onnx.errors import ConfigError
from quark_onnx.passes._graph import NameGenerator, add_initializer, constant_array
from quark_onnx.passes.base import QuarkPass

# a range cap written by ConvertClipToRelu is valid only for the unscaled channels, so CLE does
# not equalize through such a value
from quark_onnx.passes.convert_clip_to_relu import RANGE_MAX_KEY

logger = logging.getLogger(__name__)


#: Upper bound on the number of steps when ``steps = -1`` (until converged).
MAX_ADAPTIVE_STEPS = 2000

_FLOAT_DTYPES = (np.float16, np.float32, np.float64)

#: A channel whose weight product ``r1_i * r2_i`` is at most this times the pair's largest is ~0
#: (dead or constant; :class:`~quark_onnx.passes.FoldConstantChannels` removes such channels
#: exactly) and is never equalized: it keeps ``s = 1``. Balanced, its range would be 1e-2 of the
#: widest channel's in both layers, about one int8 code.
NEGLIGIBLE_RANGE = 1e-4

#: Powers of a pair's proposed scaling the gate tries, in order (full step, then damped steps).
GATE_DAMPING = (1.0, 0.5, 0.25)

#: ``gate = 'component'`` keeps a group's equalized weights only when they predict at most
#: 1 / this of the noise of the weights it found. The prediction is first order (white inputs
#: to the weights, the smallest covering power-of-two activation step, no bias rounding): on the
#: shared models it is off by up to ~10 % either way where equalizing changes little (SqueezeNet
#: 1.1: predicted -5 %, measured +8 % output noise), while a real range problem predicts orders
#: of magnitude (a rescaled pair: 100x to 1e6x). A factor 2 (3 dB) acts only on the latter.
COMPONENT_MIN_GAIN = 2.0

#: Gate modes (see the module docstring).
GATES = ("sum", "per_layer", "component")

# Per-channel, positively homogeneous ops that may sit between the two convs (op -> data input 0).
_ALWAYS_HOMOGENEOUS = frozenset(
    {"Relu", "LeakyRelu", "PRelu", "Identity", "AveragePool", "GlobalAveragePool", "GlobalMaxPool"}
)


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


@dataclasses.dataclass(frozen=True)
class ChannelStats:
    """Per-channel (axis 1) statistics of one tensor over sample inputs."""

    max_abs: np.ndarray
    mean_square: np.ndarray
    #: share of the values that are not 0 (a Relu's zeros carry no rounding error)
    nonzero: np.ndarray


def channel_statistics(
    model: ir.Model,
    feeds: Mapping[str, np.ndarray] | Sequence[Mapping[str, np.ndarray]],
    names: Sequence[str],
) -> dict[str, ChannelStats]:
    """:class:`ChannelStats` of the named values of ``model`` over ``feeds`` (one feed or
    several, one onnxruntime session, CPU, graph optimisations off); values of rank < 2 or empty
    are left out."""
    from quark_onnx import runtime

    names = list(names)
    session = runtime.create_session(
        model, purpose="channel_statistics", edit=lambda p: runtime.add_outputs(p, names)
    )
    batches = [feeds] if isinstance(feeds, Mapping) else list(feeds)
    max_abs: dict[str, np.ndarray] = {}
    square: dict[str, np.ndarray] = {}
    nonzero: dict[str, np.ndarray] = {}
    count: dict[str, int] = {}
    for feed in batches:
        for name, array in zip(names, session.run(names, dict(feed)), strict=True):
            if array.ndim < 2 or not array.size:
                continue
            flat = np.moveaxis(array.astype(np.float64), 1, 0).reshape(array.shape[1], -1)
            peak = np.abs(flat).max(axis=1)
            if name in max_abs:
                max_abs[name] = np.maximum(max_abs[name], peak)
                square[name] += np.square(flat).sum(axis=1)
                nonzero[name] += (flat != 0).sum(axis=1)
                count[name] += flat.shape[1]
            else:
                max_abs[name] = peak
                square[name] = np.square(flat).sum(axis=1)
                nonzero[name] = (flat != 0).sum(axis=1).astype(np.float64)
                count[name] = flat.shape[1]
    return {
        name: ChannelStats(max_abs[name], square[name] / count[name], nonzero[name] / count[name])
        for name in max_abs
    }


def activation_noise(stats: ChannelStats, scale: np.ndarray, reads: np.ndarray) -> float:
    """Rounding noise of one per-tensor power-of-two int8 activation, relative, as its readers'
    outputs see it.

    ``stats`` were measured before equalization; ``scale[c]`` is the factor channel ``c`` has
    been divided by since (``y_c / s_c``); ``reads[c] = sum_k ||W_k[:, c]||^2`` over the readers
    at their current weights. With the step ``D = 2^ceil(log2(max_c A_c / s_c / 127))`` (the
    smallest power of two that holds the widest channel) and ``rho_c`` the share of non-zero
    values::

        N_act = D^2 / 12 * sum_c rho_c reads_c / sum_c E[y_c^2] / s_c^2 * reads_c

    The denominator does not change with the scaling (``reads_c`` grows by ``s_c^2``); the
    numerator is what CLE trades: a channel made wider sets a coarser step for all the others.
    """
    peak = float(np.max(stats.max_abs / scale, initial=0.0))
    signal = float(np.sum(stats.mean_square / np.square(scale) * reads))
    if peak <= 0.0 or signal <= 0.0:
        return 0.0
    step = 2.0 ** math.ceil(math.log2(peak / 127.0))
    return step * step / 12.0 * float(np.sum(stats.nonzero * reads)) / signal


def _negligible(r1: np.ndarray, r2: np.ndarray) -> np.ndarray:
    """Channels whose weight product ``r1_i * r2_i`` is at most :data:`NEGLIGIBLE_RANGE` times
    the largest (invariant under a per-channel rescaling of the pair)."""
    product = r1 * r2
    top = float(np.max(product)) if product.size else 0.0
    return product <= NEGLIGIBLE_RANGE * top


def output_channel_ranges(weight: np.ndarray) -> np.ndarray:
    """``r_c = max |W[c, ...]|`` for each output channel ``c`` (axis 0) of a conv weight."""
    return np.abs(weight.reshape(weight.shape[0], -1)).max(axis=1)


def input_channel_ranges(weight: np.ndarray, group: int) -> np.ndarray:
    """``r_i`` = largest ``|w|`` of a (grouped) conv weight ``C_out x C_in/g x k...`` reading input
    channel ``i``; length ``C_in = g * (C_in / g)``."""
    return np.abs(_grouped_view(weight, group)).max(axis=(1, 3)).reshape(-1)


def pof2_noise_ratio(weight: np.ndarray) -> float:
    """``||Q(W) - W||^2 / ||W||^2`` with ``Q`` the per-tensor power-of-two int8 quantizer at the
    MinMSE position (what the XINT8 weights get); 0.0 for an all-zero weight.

    Energy-weighted: a narrow channel the grid rounds to zero barely moves it, which is why the
    gate uses :func:`propagated_noise` instead.
    """
    from quark_onnx import pof2

    energy = float(np.sum(np.square(weight, dtype=np.float64)))
    if energy == 0.0:
        return 0.0
    return pof2.sse(weight, pof2.minmse_position(weight)) / energy


def _quant_error(weight: np.ndarray) -> np.ndarray:
    """``Q(W) - W`` in float64, ``Q`` the per-tensor power-of-two int8 quantizer at the MinMSE
    position."""
    from quark_onnx import pof2

    w64 = weight.astype(np.float64)
    if not np.any(w64):
        return np.zeros_like(w64)
    p = pof2.minmse_position(weight)
    return pof2.fake_quant(w64, p).astype(np.float64) - w64


def propagated_noise(
    first: np.ndarray, readers: Sequence[tuple[np.ndarray, int, np.ndarray]]
) -> list[float]:
    """Each layer's power-of-two rounding noise as the readers' outputs see it, relative.

    ``first``: the producer's weight (channel ``i`` = row ``i``); ``readers``: ``(weight, group,
    idx)`` per reader, reading channel ``i`` as its input channel ``idx[i]``. With ``E`` the
    rounding error of a whole tensor at its MinMSE position, ``a_i^2 = ||W1[i]||^2`` and
    ``g_i^2 = sum_k ||W_k[:, idx_k[i]]||^2``::

        N1   = sum_i ||E1[i]||^2 g_i^2 / sum_i ||W1[i]||^2 g_i^2
        N2_k = sum_i ||E_k[:, idx_k[i]]||^2 a_i^2 / sum_i ||W_k[:, idx_k[i]]||^2 a_i^2

    A channel's error counts as much as the signal it carries to the readers' outputs, so a
    channel the per-tensor grid rounds to nothing counts even if its weights are tiny (a plain
    ``||E||^2 / ||W||^2`` would ignore it). Rescaling a channel (``W1[i] / s``, ``W_k[:, i] *
    s``) leaves every weight ``||W1[i]||^2 g_i^2`` unchanged: only what the grid does to the
    rescaled weights moves these numbers. Returns ``[N1, N2_1, ...]`` (one per distinct reader
    weight, in order of first appearance).
    """

    def columns(weight: np.ndarray, group: int, idx: np.ndarray) -> np.ndarray:
        # squared norm of every input-channel column (grouped layout), picked at idx
        view = _grouped_view(np.square(weight), group)
        return view.sum(axis=(1, 3)).reshape(-1)[idx]

    e1 = _quant_error(first)
    row_w = np.square(first.astype(np.float64)).reshape(first.shape[0], -1).sum(axis=1)
    row_e = np.square(e1).reshape(first.shape[0], -1).sum(axis=1)
    reads = np.zeros(first.shape[0])
    per_reader: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for weight, group, idx in readers:
        w64 = weight.astype(np.float64)
        col_w = columns(w64, group, idx)
        reads += col_w
        if id(weight) not in per_reader:
            per_reader[id(weight)] = (np.zeros_like(row_w), np.zeros_like(row_w))
        total_w, total_e = per_reader[id(weight)]
        total_w += col_w
        total_e += columns(_quant_error(weight), group, idx)

    def ratio(err: np.ndarray, sig: np.ndarray, weights: np.ndarray) -> float:
        den = float(np.sum(sig * weights))
        return float(np.sum(err * weights)) / den if den > 0 else 0.0

    noise = [ratio(row_e, row_w, reads)]
    noise += [ratio(e, w, row_w) for w, e in per_reader.values()]
    return noise


def channel_range_spread(weight: np.ndarray) -> float:
    """``max_c r_c / min_c r_c`` over the non-zero output-channel ranges (1.0 if none)."""
    ranges = output_channel_ranges(weight)
    ranges = ranges[ranges > 0]
    if ranges.size == 0:
        return 1.0
    return float(ranges.max() / ranges.min())


def store_constant_input(
    graph: ir.Graph,
    node: ir.Node,
    index: int,
    array: np.ndarray,
    names: NameGenerator,
    suffix: str,
) -> str:
    """Put ``array`` on input ``index`` of ``node``; returns the name of the stored tensor.

    An initializer read only by this input is rewritten in place; one shared with other readers
    (or a graph input/output, or a Constant node's output) is left as it is for them and a fresh
    initializer ``<name>_<suffix>`` is made for ``node``; the old one is dropped once unread.
    """
    value = node.inputs[index]
    exclusive = (
        value.is_initializer()
        and not value.is_graph_input()
        and not value.is_graph_output()
        and len(value.uses()) == 1
    )
    if exclusive:
        value.const_value = ir.tensor(array, name=value.name)
        return value.name
    new = add_initializer(graph, names(f"{value.name or node.name}_{suffix}"), array)
    node.replace_input_with(index, new)
    if not value.uses() and not value.is_graph_output():
        producer = value.producer()
        if producer is not None and producer.op_type == "Constant":
            producer.graph.remove(producer, safe=True)
        elif value.is_initializer() and not value.is_graph_input():
            graph.initializers.pop(value.name)
    return new.name


def _rescaled(
    first: _Layer, readers: Sequence[tuple[_Layer, np.ndarray]], scale: np.ndarray
) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """``W1[i] / s_i`` and, for each reader reading channel ``i`` as its input channel
    ``idx[i]``, ``W2[:, idx[i]] * s_i`` (grouped layout); new arrays (readers by ``id``)."""
    shape = (-1,) + (1,) * (first.weight.ndim - 1)
    new_first = first.weight / scale.reshape(shape)
    new: dict[int, np.ndarray] = {}
    for layer, idx in readers:
        weight = new.get(id(layer), layer.weight)
        factors = np.ones(weight.shape[1] * layer.group)
        factors[idx] = scale
        view = _grouped_view(weight, layer.group)
        cpg = view.shape[2]
        new[id(layer)] = (view * factors.reshape(layer.group, 1, cpg, 1)).reshape(weight.shape)
    return new_first, new


def _components(pairs: Sequence[_Pair]) -> list[list[_Pair]]:
    """The pairs grouped by shared layers (a chain such as ``conv -> dw -> conv`` or SqueezeNet's
    fire modules is one group), each group in the pairs' order."""
    parent = list(range(len(pairs)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[int, int] = {}
    for i, pair in enumerate(pairs):
        for layer in (pair.first, *pair.reader_layers):
            j = owner.setdefault(id(layer), i)
            parent[root(i)] = root(j)
    groups: dict[int, list[_Pair]] = {}
    for i, pair in enumerate(pairs):
        groups.setdefault(root(i), []).append(pair)
    return list(groups.values())


def _place_negligible(
    scale: np.ndarray, r1: np.ndarray, r2: np.ndarray, negligible: np.ndarray, live: np.ndarray
) -> np.ndarray:
    """Set ``scale`` of the ~0 channels that can sit inside both layers' typical ranges; returns
    which were set.

    A ~0 channel is not balanced with its partner (:data:`NEGLIGIBLE_RANGE`), but leaving it at
    ``s = 1`` keeps whatever factor the model happens to carry on it: a network whose channels
    were rescaled (same function) keeps a near-dead channel 100x wider than the rest and sets
    the per-tensor range of a whole layer with it, so the equalized point depends on the input
    scaling. Instead, with ``m1, m2`` the median ranges of the live channels, the channel gets
    ``s = sqrt((r1 / m1) / (r2 / m2))``, which makes its normalised ranges equal:
    ``r1 / s / m1 = r2 * s / m2 = sqrt(r1 r2 / (m1 m2))``. Where that is at most 1 the channel
    is inside the typical range of both layers, and ``s`` follows any rescaling of the channel
    (``r1 -> a r1``, ``r2 -> r2 / a`` give ``s -> a s``), so the equalized weights no longer
    depend on it. A channel with ``r1 r2 > m1 m2`` (a constant channel: a large bias read by
    wide weights, FoldConstantChannels' case) keeps ``s = 1``.
    """
    m1, m2 = float(np.median(r1[live])), float(np.median(r2[live]))
    placed = negligible & (r1 * r2 <= m1 * m2)
    scale[placed] = np.sqrt((r1[placed] / m1) / (r2[placed] / m2))
    return placed


def over_relaxation(length: int) -> float:
    """The step exponent ``omega = 2 / (1 + sin(pi / (length + 1)))`` for a chain of ``length``
    pairs (1.0 for a pair alone).

    In log scale a balancing step sets a boundary's ``log s`` to the mean of what its two
    neighbouring layers ask for, so a chain's sweeps are Gauss-Seidel sweeps on a 1-D Laplacian;
    successive over-relaxation with this classical optimum (Young) needs ``O(length)`` sweeps
    instead of ``O(length^2)``. The max in the ranges makes the real map only piecewise linear,
    so this is the optimum of the linear model, not a guarantee.
    """
    return 2.0 / (1.0 + math.sin(math.pi / (max(length, 1) + 1)))


def _chain_length(component: Sequence[_Pair]) -> int:
    """The most pairs on one path through ``component`` (pairs in graph order; a pair follows
    another when its first conv is one of the other's readers)."""
    depth: dict[int, int] = {}
    for pair in component:
        depth[id(pair.first)] = max(depth.get(id(pair.first), 0), 1)
        for layer in pair.reader_layers:
            depth[id(layer)] = max(depth.get(id(layer), 0), depth[id(pair.first)] + 1)
    return max(depth.values(), default=1) - 1


def _grouped_view(weight: np.ndarray, group: int) -> np.ndarray:
    """``W`` viewed as ``(g, C_out/g, cpg, K)``, ``cpg = C_in/g``.

    Input channel ``i`` is the slice ``[i // cpg, :, i % cpg, :]``.
    """
    c_out, cpg = weight.shape[0], weight.shape[1]
    return weight.reshape(group, c_out // group, cpg, -1)


def _label(node: ir.Node) -> str:
    """The node's name, or ``<op>:<first output name>`` for an unnamed node."""
    return node.name or f"{node.op_type}:{node.outputs[0].name}"


def _is_float_array(array: np.ndarray | None) -> bool:
    return array is not None and array.dtype in _FLOAT_DTYPES


def _is_homogeneous_bound(node: ir.Node, index: int, attr: str) -> bool | None:
    """True if a Clip bound is absent, 0 or infinite; False if finite non-zero; None if unknown."""
    if attr in node.attributes:
        bound = node.attributes.get_float(attr)
        return bound == 0.0 or math.isinf(bound)
    if len(node.inputs) <= index or node.inputs[index] is None:
        return True
    array = constant_array(node.inputs[index])
    if array is None or array.size != 1:
        return None
    bound = float(array.reshape(()))
    return bound == 0.0 or math.isinf(bound)


def _homogeneity_problem(node: ir.Node) -> str | None:
    """None if ``node`` is per-channel and positively homogeneous in input 0, else the reason."""
    if node.domain not in ("", "ai.onnx"):
        return f"{node.op_type} {_label(node)!r} is not a known positively homogeneous op"
    op = node.op_type
    extra_outputs_used = any(out.uses() or out.is_graph_output() for out in node.outputs[1:])
    if op in _ALWAYS_HOMOGENEOUS or op == "MaxPool":
        if extra_outputs_used:
            return f"{op} {_label(node)!r} has a second output in use"
        return None
    if op == "Clip":
        lo = _is_homogeneous_bound(node, 1, "min")
        hi = _is_homogeneous_bound(node, 2, "max")
        if lo and hi:
            return None
        if lo is None or hi is None:
            return f"Clip {_label(node)!r} has a bound that is not a constant scalar"
        return (
            f"Clip {_label(node)!r} has a finite non-zero bound (ReLU6?) and is not positively "
            "homogeneous (ReplaceClip6Relu keeps the bound as a range cap, which blocks the pair "
            "too)"
        )
    if op == "Pad":
        mode = node.attributes.get_string("mode", "constant")
        if mode != "constant":
            return None
        if node.attributes.get_float("value", 0.0) != 0.0:  # opset < 11
            return f"Pad {_label(node)!r} pads with a non-zero value"
        if len(node.inputs) > 2 and node.inputs[2] is not None:
            value = constant_array(node.inputs[2])
            if value is None or np.any(value != 0):
                return f"Pad {_label(node)!r} pads with a non-zero or non-constant value"
        return None
    return f"{op} {_label(node)!r} is not a known positively homogeneous op"


def _concat_offset(node: ir.Node, index: int) -> tuple[int, int] | str:
    """``(first channel of input index, total channels)`` of a channel (axis 1) Concat."""
    rank = node.outputs[0].shape.rank() if node.outputs[0].shape is not None else None
    axis = node.attributes.get_int("axis", 0)
    if not (axis == 1 or (rank is not None and axis == 1 - rank)):
        return f"Concat {_label(node)!r} does not concatenate channels (axis 1)"
    counts = []
    for value in node.inputs:
        count = value_channels(value) if value is not None else None
        if count is None:
            return f"Concat {_label(node)!r}: the channel count of an input is unknown"
        counts.append(count)
    return sum(counts[:index]), sum(counts)


#: Ops whose output has the channels of their input 0 (what :func:`value_channels` walks back
#: through when a value carries no shape, e.g. a model not run through shape inference).
_SAME_CHANNELS = frozenset(
    {
        "Relu", "LeakyRelu", "PRelu", "Clip", "Identity", "Dropout", "MaxPool", "AveragePool",
        "GlobalAveragePool", "GlobalMaxPool", "Pad", "BatchNormalization", "Sigmoid",
        "HardSigmoid", "HardSwish",
    }
)  # fmt: skip


def value_channels(value: ir.Value, depth: int = 0) -> int | None:
    """Channels (axis 1) of ``value``: its recorded shape, else found from its producer (a Conv's
    constant weight, a channel Concat's inputs, or input 0 of a per-channel op); None if
    unknown."""
    shape = value.shape
    if shape is not None and len(shape) >= 2 and isinstance(shape[1], int):
        return shape[1]
    producer = value.producer()
    if producer is None or depth > 64 or producer.domain not in ("", "ai.onnx"):
        return None
    op = producer.op_type
    if op in ("Conv", "ConvTranspose") and len(producer.inputs) > 1 and producer.inputs[1]:
        weight = constant_array(producer.inputs[1])
        if weight is None or weight.ndim < 3:
            return None
        if op == "Conv":
            return int(weight.shape[0])
        return int(weight.shape[1]) * producer.attributes.get_int("group", 1)
    if op == "Concat" and producer.attributes.get_int("axis", 0) == 1:
        counts = [value_channels(v, depth + 1) if v is not None else None for v in producer.inputs]
        return None if any(c is None for c in counts) else sum(counts)  # type: ignore[misc]
    if op in _SAME_CHANNELS and producer.inputs and producer.inputs[0] is not None:
        return value_channels(producer.inputs[0], depth + 1)
    return None


def _conv_weights(node: ir.Node) -> tuple[np.ndarray, np.ndarray | None] | str:
    """The constant float weight and bias of a Conv, or the reason they cannot be rewritten."""
    if len(node.inputs) < 2 or node.inputs[1] is None:
        return f"Conv {_label(node)!r} has no weight input"
    w_value = node.inputs[1]
    if w_value.is_graph_input():
        return f"Conv {_label(node)!r} weight {w_value.name!r} is a graph input (not constant)"
    weight = constant_array(w_value)
    if not _is_float_array(weight) or weight.ndim < 3:
        return f"Conv {_label(node)!r} weight {w_value.name!r} is not a constant float tensor"
    bias = None
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        b_value = node.inputs[2]
        bias = None if b_value.is_graph_input() else constant_array(b_value)
        if not _is_float_array(bias) or bias.shape != (weight.shape[0],):
            return f"Conv {_label(node)!r} bias {b_value.name!r} is not a constant float vector"
    return weight, bias


@dataclasses.dataclass
class _Layer:
    """Float64 working copy of one conv's weight and bias, and whether it was rescaled."""

    node: ir.Node
    weight: np.ndarray
    bias: np.ndarray | None
    group: int
    original: np.ndarray
    changed: bool = False
    original_bias: np.ndarray | None = None

    #: Pending scaling of the ungated sweeps, applied by :meth:`materialize`: output channel
    #: ``o`` divided by ``out_scale[o]``, input channel ``c`` multiplied by ``in_scale[c]``.
    #: The sweeps need only channel ranges, and ``max |W[o, j, k] * in_j / out_o|`` over the
    #: kernel is ``peak[o, j] * in_j / out_o``: the kernel-free maxima (``peak``) are enough,
    #: and no weight is copied per step.
    out_scale: np.ndarray | None = None
    in_scale: np.ndarray | None = None
    peak: np.ndarray | None = None

    def restore(self) -> None:
        """Back to the weights the pass found."""
        self.weight = self.original.astype(np.float64)
        self.bias = None if self.original_bias is None else self.original_bias.astype(np.float64)
        self.changed = False
        self.out_scale = self.in_scale = self.peak = None

    def _current_peaks(self) -> np.ndarray:
        """``max_k |W[o, j, k]|`` at the pending scaling, viewed ``(g, C_out/g, cpg)``."""
        c_out, cpg = self.weight.shape[:2]
        if self.peak is None:
            self.peak = np.abs(self.weight.reshape(c_out, cpg, -1)).max(axis=2)
            self.out_scale = np.ones(c_out)
            self.in_scale = np.ones(cpg * self.group)
        assert self.out_scale is not None and self.in_scale is not None
        g = self.group
        return (
            self.peak.reshape(g, c_out // g, cpg)
            * self.in_scale.reshape(g, 1, cpg)
            / self.out_scale.reshape(g, c_out // g, 1)
        )

    def lazy_output_ranges(self) -> np.ndarray:
        """:func:`output_channel_ranges` of the weight at the pending scaling."""
        return self._current_peaks().max(axis=2).reshape(-1)

    def lazy_input_ranges(self) -> np.ndarray:
        """:func:`input_channel_ranges` of the weight at the pending scaling."""
        return self._current_peaks().max(axis=1).reshape(-1)

    def lazy_bias(self) -> np.ndarray | None:
        if self.bias is None or self.out_scale is None:
            return self.bias
        return self.bias / self.out_scale

    def materialize(self) -> None:
        """Apply the pending scaling to the weight and bias."""
        if self.out_scale is None or self.in_scale is None:
            return
        c_out, cpg = self.weight.shape[:2]
        g = self.group
        view = _grouped_view(self.weight, g)
        view = view / self.out_scale.reshape(g, c_out // g, 1, 1)
        view = view * self.in_scale.reshape(g, 1, cpg, 1)
        self.weight = view.reshape(self.weight.shape)
        if self.bias is not None:
            self.bias = self.bias / self.out_scale
        self.out_scale = self.in_scale = self.peak = None


@dataclasses.dataclass
class _Pair:
    """A conv and every conv reading its channels: ``readers`` holds each reader's layer and,
    per channel ``i`` of the first conv, the reader's input channel (``i`` plus a Concat
    offset)."""

    first: _Layer
    readers: list[tuple[_Layer, np.ndarray]]
    through: tuple[str, ...]
    cumulative: np.ndarray  # product of all s applied at this channel boundary
    rejected: bool = False  # the gate refused this pair's last proposed scaling
    #: exponent of the ungated sweeps' step ``s^relax`` (:func:`over_relaxation`)
    relax: float = 1.0

    @property
    def reader_layers(self) -> list[_Layer]:
        """The distinct reader layers, in discovery order."""
        seen: dict[int, _Layer] = {}
        for layer, _ in self.readers:
            seen.setdefault(id(layer), layer)
        return list(seen.values())

    @property
    def second(self) -> str:
        """The readers' labels, comma-separated."""
        return ", ".join(_label(layer.node) for layer in self.reader_layers)


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
            noise (:meth:`_component_noise`: weights, and with ``sample_feeds`` the activations
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
            result = self._follow(node)
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

    def _follow(self, first: ir.Node) -> tuple[list, tuple[str, ...], tuple] | str:
        """Every conv reading ``first``'s channels through homogeneous ops and channel Concats,
        with the input channel each reads, or why the channels cannot be rescaled."""
        first_arrays = _conv_weights(first)
        if isinstance(first_arrays, str):
            return first_arrays
        channels = first_arrays[0].shape[0]
        readers: list[tuple[ir.Node, np.ndarray, tuple]] = []
        through: list[str] = []
        # (value, channel index of first's channels in it, channel count of the value)
        stack = [(first.outputs[0], np.arange(channels), channels)]
        while stack:
            value, idx, width = stack.pop()
            if value.is_graph_output():
                return f"{value.name!r} is a graph output"
            if value is not first.outputs[0] and RANGE_MAX_KEY in value.metadata_props:
                return (
                    f"{value.name!r} carries a range cap ({RANGE_MAX_KEY}) that rescaling its "
                    "channels would invalidate; run CLE before ConvertClipToRelu"
                )
            uses = list(value.uses())
            if not uses:
                return f"{value.name!r} has no reader"
            for use in uses:
                consumer, index = use.node, use.idx
                standard = consumer.domain in ("", "ai.onnx")
                if standard and consumer.op_type == "Concat":
                    offset = _concat_offset(consumer, index)
                    if isinstance(offset, str):
                        return offset
                    start, total = offset
                    if "Concat" not in through:
                        through.append("Concat")
                    stack.append((consumer.outputs[0], idx + start, total))
                    continue
                if index != 0:
                    return (
                        f"{value.name!r} is input {index} of {consumer.op_type} "
                        f"{_label(consumer)!r}"
                    )
                if standard and consumer.op_type == "Conv":
                    arrays = _conv_weights(consumer)
                    if isinstance(arrays, str):
                        return arrays
                    group = consumer.attributes.get_int("group", 1)
                    w2 = arrays[0]
                    if group < 1 or w2.shape[1] * group != width or w2.shape[0] % group:
                        return (
                            f"Conv {_label(consumer)!r} (group {group}, weight {w2.shape}) does "
                            f"not read {width} channels"
                        )
                    readers.append((consumer, idx, arrays))
                    continue
                problem = _homogeneity_problem(consumer)
                if problem is not None:
                    return problem
                if consumer.op_type not in through:
                    through.append(consumer.op_type)
                stack.append((consumer.outputs[0], idx, width))
        return readers, tuple(through), first_arrays

    # ------------------------------------------------------------------------------ equalization

    def _equalize(self, pair: _Pair) -> float:
        """One equalization of ``pair`` in place; returns ``mean_i |s_i - 1|``."""
        first = pair.first
        gated = self.gate in ("sum", "per_layer")
        if gated:
            r1w = output_channel_ranges(first.weight)
            bias = first.bias
            r2 = np.max(
                [input_channel_ranges(lay.weight, lay.group)[idx] for lay, idx in pair.readers],
                axis=0,
            )
        else:  # ungated sweeps: ranges of the pending scaling, applied once at the end
            r1w = first.lazy_output_ranges()
            bias = first.lazy_bias()
            r2 = np.max([lay.lazy_input_ranges()[idx] for lay, idx in pair.readers], axis=0)
        r1 = r1w
        if self.scale_append_bias and bias is not None:
            r1 = np.maximum(r1, np.abs(bias))
        scale = np.ones_like(r1)
        ok = (r1 > 0) & (r2 > 0) & np.isfinite(r1) & np.isfinite(r2)
        # a channel carrying ~0 is dead or constant, not narrow: equalizing with it would only
        # carry its ~0 range over to the partner (the weight ranges alone decide, a large bias
        # does not make a constant channel a partner)
        negligible = _negligible(r1w, r2)
        live = ok & ~negligible
        scale[live] = np.sqrt(r1[live] / r2[live])
        if not gated and np.any(live):
            # the ungated sweeps place a ~0 channel instead of leaving it where the model put it
            live |= _place_negligible(scale, r1, r2, ok & negligible, live)
        ok = live
        if not gated and pair.relax != 1.0:
            scale[ok] = scale[ok] ** pair.relax
        if self.max_scale is not None:
            total = np.clip(pair.cumulative * scale, 1.0 / self.max_scale, self.max_scale)
            scale = total / pair.cumulative
        if np.all(scale == 1.0):
            return 0.0
        if not gated:
            assert first.out_scale is not None
            first.out_scale = first.out_scale * scale
            first.changed = True
            for layer, idx in pair.readers:
                assert layer.in_scale is not None
                layer.in_scale[idx] *= scale
                layer.changed = True
            pair.cumulative = pair.cumulative * scale
            return float(np.mean(np.abs(scale - 1.0)))
        proposal = self._gated(pair, scale, self.gate == "per_layer")
        pair.rejected = proposal is None
        if proposal is None:
            return 0.0
        scale, new_first, new_readers = proposal
        pair.cumulative = pair.cumulative * scale
        first.weight = new_first
        if first.bias is not None:
            first.bias = first.bias / scale
        first.changed = True
        for layer in pair.reader_layers:
            layer.weight = new_readers[id(layer)]
            layer.changed = True
        return float(np.mean(np.abs(scale - 1.0)))

    @staticmethod
    def _gated(
        pair: _Pair, scale: np.ndarray, per_layer: bool
    ) -> tuple[np.ndarray, np.ndarray, dict[int, np.ndarray]] | None:
        """The first of ``scale``, ``scale^(1/2)``, ``scale^(1/4)`` that lowers the pair's
        power-of-two weight noise at the readers (and, ``per_layer``, raises no layer's), with
        the rescaled weights; or None.

        The damped steps because the power-of-two grid makes the noise jagged in ``s``: a full
        step can put one layer just past a grid point where half a step does not.
        """
        before = propagated_noise(
            pair.first.weight, [(lay.weight, lay.group, idx) for lay, idx in pair.readers]
        )
        for power in GATE_DAMPING:
            trial = scale**power
            new_first, new_readers = _rescaled(pair.first, pair.readers, trial)
            after = propagated_noise(
                new_first, [(new_readers[id(lay)], lay.group, idx) for lay, idx in pair.readers]
            )
            no_layer_worse = all(a <= b for a, b in zip(after, before, strict=True))
            if sum(after) < sum(before) and (no_layer_worse or not per_layer):
                return trial, new_first, new_readers
        return None

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

    @staticmethod
    def _component_noise(component: Sequence[_Pair], stats: dict[str, ChannelStats]) -> float:
        """Predicted relative quantization noise of a group of pairs at their current weights:
        each pair's :func:`propagated_noise` (both layers' per-tensor power-of-two weights) plus
        the :func:`activation_noise` of every tensor their readers read (when measured).

        Both terms are noise over signal at the readers' outputs and neither changes when a
        channel is rescaled unless the power-of-two grids see it differently, so the sum is
        the same for a model and any per-channel rescaling of it at the same equalized point.
        """
        total = 0.0
        tensors: dict[str, tuple[dict[int, tuple[_Pair, np.ndarray]], dict[int, _Layer]]] = {}
        for pair in component:
            readers = [(layer.weight, layer.group, idx) for layer, idx in pair.readers]
            total += sum(propagated_noise(pair.first.weight, readers))
            for layer, idx in pair.readers:
                owners, layers = tensors.setdefault(layer.node.inputs[0].name, ({}, {}))
                owners.setdefault(id(pair), (pair, idx))
                layers.setdefault(id(layer), layer)
        for name, (owners, layers) in tensors.items():
            stat = stats.get(name)
            if stat is None:
                continue
            width = stat.max_abs.size
            scale = np.ones(width)
            reads = np.zeros(width)
            for pair, idx in owners.values():
                scale[idx] = pair.cumulative
            for layer in layers.values():
                energy = _grouped_view(np.square(layer.weight), layer.group).sum(axis=(1, 3))
                if energy.size != width:
                    break
                reads += energy.reshape(-1)
            else:
                total += activation_noise(stat, scale, reads)
        return total

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
        before = [self._component_noise(comp, stats) for comp in components]

        limit = MAX_ADAPTIVE_STEPS if self.steps == -1 else self.steps
        while report.iterations < limit:
            change = sum(self._equalize(pair) for pair in pairs)
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
            noise_after = self._component_noise(comp, stats)
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
