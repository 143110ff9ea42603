"""FoldConstantChannels: fold constant and dead channels into the layers that read them.

Why. A Conv output channel whose weights are zero, or negligible, computes a constant: its bias.
Trained networks have such channels (weight decay drives a channel's weights to ~0 while its
bias survives; after a Relu it is then constant, often exactly 0), and the layers reading them
were never decayed: their weights for that input channel can be a hundred times larger than the
rest. One per-tensor power-of-two scale set by those weights rounds every useful weight of the
consumer to a few codes. In float the constant's contribution is a bias, so it can be moved there
and the consumer's weights for it zeroed, which removes the outliers without changing the
function.

Maths. Let channel ``c`` of a Conv ``P`` have weights ``W1[c] = 0``; its output is the constant
``b1[c]``. Per-channel ops after it map a constant to a constant (``k`` = the constant):

* Relu ``max(k, 0)``; Clip ``min(max(k, lo), hi)``; LeakyRelu/PRelu ``k`` or ``alpha_c k``;
  Identity ``k``; BatchNormalization ``m_c k + b_c``;
* MaxPool, GlobalMaxPool, GlobalAveragePool and AveragePool without padding or with
  ``count_include_pad = 0``: ``k`` (every window averages or maxes copies of ``k``; MaxPool pads
  with -inf); an AveragePool counting zero padding, or a Pad in constant mode, keeps only ``k = 0``
  constant (the border windows read zeros);
* a depthwise Conv (``group = C_in = C_out``, weight ``C x 1 x kh x kw``): ``k * sum(w_c) + d_c``
  without spatial padding; with zero padding the border windows read zeros, so only ``k = 0``
  stays constant (``d_c``). Its channel ``c`` weights are then set to 0 and its bias to the
  constant: exact, and that layer's outliers go too;
* Concat on axis 1 (the channel moves to its offset) and a Flatten/Reshape of an ``N x C x 1 x 1``
  tensor into ``N x C`` (for Gemm consumers).

A consumer Conv (any group) or Gemm (``transA = 0``) reading the constant ``k`` on input
channel ``i`` computes ``z[o] = sum_{j != i} W2[o, j] * y_j + W2[o, i] * k + b2[o]``, so::

    b2[o] <- b2[o] + k * sum(W2[o, i, ...])        W2[o, i, ...] <- 0

(Gemm: ``C <- C + alpha * k * B'[i, :] / beta``; a bias is created when absent.) This is exact
when ``k = 0`` (the zeroed weights read zeros) or when the consumer has no spatial padding. A
Conv with zero padding reads 0, not ``k``, at the borders, so a **non-zero constant is never folded
into a padded Conv**: that consumer keeps its weights (and the channel stays as it is).

Negligible weights. A channel whose weights are not exactly 0 is folded only when its variation
cannot matter, judged scale-free at every consumer it reaches. With ``x`` the producer's input,
the channel's pre-activation varies by at most ``||W1[c]||_1 * max|x|`` around ``b1[c]``; each op
on the way multiplies that by its Lipschitz constant ``lambda_c`` (1 for Relu, Clip, pools and
Concat; ``max(1, |alpha_c|)`` for LeakyRelu/PRelu; ``|m_c|`` for BatchNormalization;
``||w_c||_1`` for a depthwise Conv); consumer output ``o`` multiplies it by ``||W2[o, i]||_1``.
So freezing the channel changes consumer output ``o`` by at most ``m[c, o] * max|x|`` with::

    m[c, o] = ||W1[c]||_1 * lambda_c * ||W2[o, i_c]||_1

while the largest single-channel contribution to ``o`` is bounded by ``max_j m[j, o] * max|x|``.
Channel ``c`` of an ungrouped Conv is *negligible* when ``m[c, o] <= tolerance * max_j m[j, o]``
for every output ``o`` of every consumer (default ``tolerance = 1e-4``): the change of each
consumer output is below ``tolerance`` times its largest channel's bound, whatever the input's
magnitude. The ratio does not change when a channel is rescaled through a positively
homogeneous op (``W1[c] / s`` and ``W2[:, c] * s``), when a consumer's output channel is
rescaled, or when the input is scaled, so a channel that is merely small in one layer and large
in the next is never taken for negligible. (A grouped or depthwise producer's channels read
different input channels, whose magnitudes cannot be compared this way.)

Clamped channels (with samples). A dead channel (tiny weights, a negative bias, then Relu) is
exactly 0 for every input with ``||W1[c]||_1 * max|x| < -b1[c]``, however large its readers'
weights; the same holds for a channel a Clip saturates. Given sample inputs, the pass measures
``X_i = max|x_i|`` per input channel of each ungrouped Conv (raised so that no input contributes
less than 1e-2 of the largest input's ``X_j * sum_c ||W1[c, j]||_1``, so a channel one sample
leaves at 0 still counts, whatever per-channel rescaling the previous layer carries) and
propagates the interval ``b1[c] +- margin * sum_i ||W1[c, i]||_1 X_i`` (default ``margin = 10``)
through the ops above (interval arithmetic; a depthwise Conv adds ``+- radius * ||w_c||_1``).
A channel whose interval is a single point at every consumer is *clamped*: constant for every
input up to ``margin`` times the largest the samples showed, so folding it changes nothing
there.

Quiet channels (with samples). A constant channel with no activation after it (a projection
conv's channel with weights ~1e-7 and a bias) is never clamped, and next to a 100 times wider
reader its data-free bound ``m[c, o]`` is not below ``1e-4``. With samples its interval is known:
it stays within ``tolerance`` times its constant ``k_c`` (``radius_c <= tolerance * |k_c|``,
``radius_c`` the half-width of the interval above, ``margin`` times what the samples need) and
moves consumer output ``o`` by at most ``radius_c * ||W2[o, i_c]||_1``, while the other input
channels give that output up to ``sum_{j != i_c} X'_j ||W2[o, j]||_1`` (``X'_j`` the samples'
``max |x_j|`` at the consumer's input). A channel whose change is at most ``tolerance`` times
that at every output of every (ungrouped Conv) consumer is *quiet* and folded. Both sides
change by the same factor when the channel, or any input channel, is rescaled through a
positively homogeneous op, so a rescaled model gets the same answer.

A negligible, clamped or quiet channel is folded only when every reader is foldable (all paths
end in Conv/Gemm consumers where the fold is exact and no value on the way is a graph output); its
weights are then set to exactly 0, and its bias too (and that of every depthwise channel on the
way): nothing reads its value any more, and a constant left in a bias would still set the
per-tensor range of that bias or of the activation it feeds. A channel whose weights are exactly
0 is folded into every consumer where that is exact, and left alone elsewhere (its value does not
change).

Not handled: Gemm or MatMul producers, ConvTranspose, consumers reading the channel through any
other op (Add, Mul, Sigmoid, Resize, ...), If/Loop bodies. Weight initializers shared with another
node, and Constant-node weights, are copied before being rewritten.

Code. This module is the pass: the per-channel decision (zero, negligible, clamped, quiet), the
folding and the write-back. The per-op rules that carry a constant channel to its readers are in
:mod:`._fold_rules`; the layers' working copies and the fold arithmetic in :mod:`._fold_layers`.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
import onnx_ir as ir

from quark_onnx.errors import ConfigError
from quark_onnx.graph.channels import channel_statistics
from quark_onnx.graph.ir import NameGenerator, store_constant_input
from quark_onnx.passes._fold_layers import _STANDARD, _conv_arrays, _label, _Layer
from quark_onnx.passes._fold_rules import _Leaf, _Path, _step
from quark_onnx.passes.base import QuarkPass

logger = logging.getLogger(__name__)

#: Default of :attr:`FoldConstantChannels.tolerance` (see the module docstring).
DEFAULT_TOLERANCE = 1e-4
#: Default of :attr:`FoldConstantChannels.margin` (see the module docstring).
DEFAULT_MARGIN = 10.0
FOLD_KINDS = ("zero", "clamped", "negligible", "quiet")
#: A sample input channel's ``max |x_i|`` counts as at least this times the largest channel's.
INPUT_FLOOR = 1e-2


def _floored_inputs(x_max: np.ndarray, per_input: np.ndarray) -> np.ndarray:
    """The samples' ``X_i = max |x_i|`` per input channel, each raised so that the input's
    contribution to the layer, ``X_i * sum_c ||W[c, i]||_1``, is at least :data:`INPUT_FLOOR`
    times the largest input's.

    A sample that leaves an input channel at 0 says nothing about its range, so it must count as
    something. The floor is set on the contribution, not on ``X_i`` itself: an input channel that
    the previous layer made ``a`` times smaller (and this layer reads ``a`` times harder) then gets
    an ``a`` times smaller floor, so whether a channel is clamped does not depend on such a
    rescaling (a floor on ``X_i`` alone inflates the bound of every channel reading a rescaled
    input by up to ``a``).
    """
    reads = per_input.sum(axis=0)  # [cpg]: sum_c ||W[c, i]||_1
    level = float(np.max(x_max * reads, initial=0.0))
    with np.errstate(divide="ignore"):
        floor = np.where(reads > 0, INPUT_FLOOR * level / reads, 0.0)
    return np.maximum(x_max, floor)


@dataclasses.dataclass(frozen=True)
class FoldedChannel:
    """One producer channel folded into its consumers."""

    producer: str
    channel: int
    constant: float  # the channel's value (its bias) before the ops that follow it
    consumers: tuple[str, ...]
    #: ``"quiet"``: over ``margin`` times the samples' input range it moves every consumer
    #: output by at most ``tolerance`` times what the other channels give it (weights set to 0);
    #: ``"zero"``: the weights were 0; ``"clamped"``: the activation clamps the channel to one
    #: value for every input up to ``margin`` times the samples' range; ``"negligible"``: its
    #: variation bound is negligible (both: the weights are set to 0 here)
    kind: str


@dataclasses.dataclass
class FoldReport:
    """What the last run of :class:`FoldConstantChannels` did."""

    folded: list[FoldedChannel] = dataclasses.field(default_factory=list)
    #: Producer channels that were constant or negligible but not (fully) folded, and why.
    kept: list[str] = dataclasses.field(default_factory=list)


class FoldConstantChannels(QuarkPass):
    """Fold constant and negligible Conv output channels into the Conv/Gemm layers reading them.

    Args:
        tolerance: a channel with non-zero weights is negligible when ``m_c <= tolerance *
            max_j m_j`` at every consumer (module docstring); ``0`` turns this test off.
        sample_feeds: model inputs (e.g. a calibration batch); with them, a channel that the
            activation clamps to one value for every input up to ``margin`` times the largest
            ``|x|`` the samples give its layer is folded too (``"clamped"``).
        margin: how far beyond the samples' input range the clamp must hold.

    After a run, :attr:`report` (:class:`FoldReport`) lists the folded channels.
    """

    def __init__(
        self,
        tolerance: float = DEFAULT_TOLERANCE,
        sample_feeds: dict[str, np.ndarray] | None = None,
        margin: float = DEFAULT_MARGIN,
    ) -> None:
        super().__init__()
        if not (isinstance(tolerance, (int, float)) and 0 <= tolerance < 1):
            raise ConfigError(
                f"FoldConstantChannels tolerance={tolerance!r}: use a number in [0, 1) "
                f"(default {DEFAULT_TOLERANCE})"
            )
        if not (isinstance(margin, (int, float)) and margin >= 1):
            raise ConfigError(
                f"FoldConstantChannels margin={margin!r}: use a number >= 1 "
                f"(default {DEFAULT_MARGIN})"
            )
        self.tolerance = float(tolerance)
        self.sample_feeds = sample_feeds
        self.margin = float(margin)
        self.report = FoldReport()

    # ----------------------------------------------------------------------------- exploration

    def _layer(self, node: ir.Node) -> _Layer | None:
        key = id(node)
        if key not in self._layers:
            arrays = _conv_arrays(node)
            self._layers[key] = None if arrays is None else _Layer(node, *arrays)
        return self._layers[key]

    def _explore(self, value: ir.Value, path: _Path, leaves: list[_Leaf], depth: int = 0) -> None:
        """Follow ``value``'s readers through per-channel ops to the consumer layers."""
        if value.is_graph_output():
            leaves.append(_Leaf(None, path, f"{value.name!r} is a graph output"))
        for use in value.uses():
            node, index = use.node, use.idx
            nxt = _step(node, index, path, self._layer)
            if isinstance(nxt, str):
                leaves.append(_Leaf(None, path, nxt))
            elif nxt is None:
                leaves.append(_Leaf(node, path))
            else:
                if depth > 64:
                    leaves.append(_Leaf(None, path, "path too long"))
                    continue
                self._explore(node.outputs[0], nxt, leaves, depth + 1)

    def _process(self, producer: ir.Node) -> bool:
        layer = self._layer(producer)
        if layer is None or layer.gemm:
            return False
        channels, cpg = layer.weight.shape[:2]
        per_input = np.abs(layer.weight.reshape(channels, cpg, -1)).sum(axis=2)  # [C, cpg]
        exact = ~np.any(per_input, axis=1)
        bias = layer.effective_bias()
        # sum_i ||W[c, i]||_1 * max|x_i| bounds the channel's variation around its bias. The
        # samples' per-channel max|x_i| (floored, so a channel a sample leaves at 0 still
        # counts; see _floored_inputs) is used only for ungrouped producers, whose channels
        # all read every input channel: a depthwise channel reads just one
        variation = per_input.sum(axis=1)
        x_max = self._input_max.get(producer.inputs[0].name) if layer.group == 1 else None
        radius = np.where(exact, 0.0, np.inf)
        if x_max is not None and x_max.size == cpg:
            x_in = _floored_inputs(x_max, per_input)
            radius = np.where(exact, 0.0, (per_input @ x_in) * self.margin)
        leaves: list[_Leaf] = []
        start = _Path(
            idx=np.arange(channels),
            const=bias.copy(),
            lo=bias - radius,
            hi=bias + radius,
            lam=np.ones(channels),
        )
        self._explore(producer.outputs[0], start, leaves)
        if not any(leaf.node is not None for leaf in leaves):
            return False

        # per channel: can it be folded everywhere; is it negligible at every consumer; is it
        # clamped to one value (the interval a point) at every consumer
        foldable_everywhere = np.ones(channels, dtype=bool)
        # a grouped producer's channels read different input channels, whose magnitudes the
        # bound cannot compare: only ungrouped producers qualify
        negligible = np.full(channels, layer.group == 1 and self.tolerance > 0)
        flat = np.ones(channels, dtype=bool)
        quiet = np.full(channels, self.tolerance > 0 and bool(self._input_max))
        for leaf in leaves:
            if leaf.node is None:
                foldable_everywhere[:] = False
                continue
            target = self._layers[id(leaf.node)]
            ok = np.isfinite(leaf.path.const)
            if target.padded:
                ok &= leaf.path.const == 0
            foldable_everywhere &= ok
            flat &= leaf.path.lo == leaf.path.hi
            # per consumer output o: m[c, o] against the largest channel's m[j, o]
            m = (variation * leaf.path.lam)[:, None] * target.read_gains(leaf.path.idx)
            ref = m.max(axis=0, initial=0.0)
            negligible &= np.all(m <= self.tolerance * ref, axis=1)
            quiet &= self._quiet(leaf.path, target)
        for leaf in leaves:  # a depthwise conv on the way must be foldable too
            for _dw, _idx, const in leaf.path.dws:
                foldable_everywhere &= np.isfinite(const)
        fire = ~exact & (negligible | flat | quiet) & foldable_everywhere
        modified = False
        for c in np.flatnonzero(exact | fire):
            c = int(c)
            consumers: list[str] = []
            done_dw: set[int] = set()
            # folded into every reader: nothing reads the channel's value any more, so it (and
            # every depthwise channel on the way) can be 0 instead of the constant; a constant
            # left in a bias would still widen the per-tensor range of that bias and of the
            # activation it feeds
            unread = bool(foldable_everywhere[c]) and not any(
                leaf.node is not None
                and self._layers[id(leaf.node)].gemm
                and self._layers[id(leaf.node)].beta == 0.0
                for leaf in leaves
            )
            for leaf in leaves:
                for dw, idx, const in leaf.path.dws:
                    k = 0.0 if unread else const[c]
                    if not np.isfinite(k) or id(dw) in done_dw:
                        continue
                    done_dw.add(id(dw))
                    dw_layer = self._layers[id(dw)]
                    ch = int(idx[c])
                    if np.any(dw_layer.weight[ch]) or k != dw_layer.effective_bias()[ch]:
                        # its input is the constant: its output channel is k (or 0 when nothing
                        # reads it), now by its bias
                        dw_layer.weight[ch] = 0.0
                        base = 0.0 if dw_layer.bias is None else dw_layer.bias[ch]
                        dw_layer.bias_delta[ch] = k - base
                        dw_layer.weight_changed = True
                        consumers.append(_label(dw))
                if leaf.node is None:
                    continue
                target = self._layers[id(leaf.node)]
                k = float(leaf.path.const[c])
                ch = int(leaf.path.idx[c])
                if not math.isfinite(k) or (target.padded and k != 0.0):
                    continue
                if target.gemm and k != 0.0 and target.bias is not None and target.beta == 0.0:
                    continue
                if target.column_is_zero(ch):
                    continue
                target.fold(ch, k)
                consumers.append(_label(leaf.node))
            if not consumers:
                continue
            if fire[c]:
                layer.weight[c] = 0.0
                layer.weight_changed = True
            if unread and layer.bias is not None and layer.effective_bias()[c] != 0.0:
                layer.bias_delta[c] = -layer.bias[c]
            modified = True
            kind = "zero" if exact[c] else "negligible" if negligible[c] else None
            kind = kind or ("clamped" if flat[c] else "quiet")
            self.report.folded.append(
                FoldedChannel(_label(producer), c, float(bias[c]), tuple(consumers), kind)
            )
        kept = (exact | negligible | flat | quiet) & ~foldable_everywhere
        for c in np.flatnonzero(kept):
            self.report.kept.append(f"{_label(producer)}[{int(c)}]")
        return modified

    def _quiet(self, path: _Path, target: _Layer) -> np.ndarray:
        """Per producer channel: it is its constant ``k`` to within ``tolerance * |k|`` over the
        samples' input range (``margin`` times it), and that variation moves every output ``o``
        of ``target`` by at most ``tolerance`` times the bound the other input channels give
        that output on the samples, ``sum_j X_j ||W2[o, j]||_1`` (``X_j`` = the samples' ``max
        |x_j|`` at the consumer's input); all False where the consumer's inputs were not
        measured (no samples, Gemm, grouped consumer).

        The first condition keeps a real channel that merely contributes little to a wide
        consumer (a small share of the sum) from being taken for a constant one."""
        no = np.zeros(path.idx.shape, dtype=bool)
        x_in = self._input_max.get(target.node.inputs[0].name) if not target.gemm else None
        if x_in is None or target.group != 1 or x_in.size != target.weight.shape[1]:
            return no
        radius = (path.hi - path.lo) / 2
        with np.errstate(invalid="ignore"):
            finite = np.isfinite(radius) & (radius <= self.tolerance * np.abs(path.const))
        gains = target.read_gains(path.idx)  # [C, O]: ||W2[o, idx_c]||_1
        l1 = np.abs(target.weight.reshape(target.weight.shape[0], x_in.size, -1)).sum(axis=2)
        others = (l1 @ x_in)[None, :] - gains * x_in[path.idx][:, None]  # [C, O], j != idx_c
        change = np.where(finite, radius, 0.0)[:, None] * gains
        return finite & np.all(change <= self.tolerance * np.maximum(others, 0.0), axis=1)

    def _measure_inputs(self, model: ir.Model) -> dict[str, np.ndarray]:
        """Per-channel ``max |x|`` over the samples of every ungrouped Conv's input (empty
        without samples, or when onnxruntime cannot run the model: then the pass is data-free)."""
        if not self.sample_feeds:
            return {}
        names = sorted(
            {
                node.inputs[0].name
                for node in model.graph
                if node.op_type == "Conv"
                and node.domain in _STANDARD
                and node.attributes.get_int("group", 1) == 1
                and node.inputs
                and node.inputs[0] is not None
                and node.inputs[0].name
            }
        )
        if not names:
            return {}
        try:
            stats = channel_statistics(model, self.sample_feeds, names)
            return {name: stat.max_abs for name, stat in stats.items()}
        except Exception as exc:  # onnxruntime raises its own exception types
            logger.warning(
                "FoldConstantChannels: cannot run the model on the samples (%s); only the "
                "data-free criteria are used",
                str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
            )
            return {}

    # ------------------------------------------------------------------------------ write back

    def _write_back(self, graph: ir.Graph) -> None:
        names = NameGenerator(graph)
        for layer in self._layers.values():
            if layer is None or not (layer.weight_changed or np.any(layer.bias_delta)):
                continue
            node = layer.node
            weight = layer.weight if layer.trans_b else layer.weight.T
            store_constant_input(graph, node, 1, weight.astype(layer.dtype), names, "folded")
            if not np.any(layer.bias_delta):
                continue
            if layer.gemm:
                delta = layer.bias_delta
                if layer.bias is None:
                    new_bias = delta
                    node.attributes["beta"] = ir.AttrFloat32("beta", 1.0)
                else:
                    new_bias = layer.bias + delta / layer.beta
            else:
                new_bias = (0.0 if layer.bias is None else layer.bias) + layer.bias_delta
            new_bias = np.asarray(new_bias).astype(layer.dtype)
            if layer.bias is None:
                if len(node.inputs) < 3:
                    node.resize_inputs(3)
                from quark_onnx.graph.ir import add_initializer

                value = add_initializer(graph, names(f"{_label(node)}_bias"), new_bias)
                node.replace_input_with(2, value)
            else:
                store_constant_input(graph, node, 2, new_bias, names, "folded")

    # ------------------------------------------------------------------------------ pass entry

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.report = FoldReport()
        self._layers: dict[int, _Layer | None] = {}
        self._input_max = self._measure_inputs(model)
        modified = False
        for node in list(model.graph):
            if node.op_type == "Conv" and node.domain in _STANDARD:
                modified |= self._process(node)
        if modified:
            self._write_back(model.graph)
            logger.info(
                "FoldConstantChannels: %d channels folded (%d already zero, %d clamped, "
                "%d negligible, %d quiet)",
                len(self.report.folded),
                *(sum(f.kind == k for f in self.report.folded) for k in FOLD_KINDS),
            )
        return ir.passes.PassResult(model, modified=modified)
