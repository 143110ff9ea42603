"""MigrateActivationOutliers: move the range of a LayerNorm's outlier channels into the weights
of the linear layers reading it (SmoothQuant-style), float-exact.

Why. Trained transformers carry a few hidden channels 10-100x wider than the median in their
LayerNormalization outputs (a large gain on those channels, the next layers' weights small on
them). The linear layers' inputs are quantized with one scale per tensor, so those channels set
the step and the others keep a few codes: on the outlier test encoder
(``tests/transformer/bert_like.py``) A8W8's sentence embeddings fall to a mean cosine of 0.948
without this pass and keep 0.9997 with it, A16W8 0.9987 (``benchmarks/results/transformer.md``).
Weights are quantized per output channel, and a row of a weight matrix (one input channel) can
grow with little cost to the columns' scales: SmoothQuant (Xiao et al., ICML 2023) divides
activation channel ``j`` by ``s_j`` and multiplies weight row ``j`` by ``s_j``.

Maths. A LayerNormalization over the last axis computes ``y = gamma * xhat + beta`` per channel;
dividing ``gamma_j`` and ``beta_j`` by ``s_j`` gives ``y_j / s_j``, and a reader
``MatMul(y, W)`` computes what it computed when row ``j`` of ``W`` is multiplied by ``s_j``
(``Gemm`` likewise: row ``j`` of ``B``, column ``j`` when ``transB``). Every ``s_j`` is a power
of two, so each of these multiplications is exact and the float outputs are bit-identical.
``s_j = 2^round(log2(max|y_j|^alpha / max|W_j|^(1 - alpha)))`` centred on the median (the
common factor changes nothing: activations are quantized per tensor, weights per output
channel), with ``max|y_j|`` the largest ``|y_j|`` on the sample inputs (the first calibration
samples), ``max|W_j|`` the largest weight of row ``j`` over the readers, ``alpha`` the
migration strength (``SmoothAlpha``, SmoothQuant's 0.5 by default), within
``2^-MAX_LOG2 ... 2^MAX_LOG2``.

A post-LN encoder (BERT and its exports) also adds the LayerNorm's output to the residual
stream. Such an ``Add`` reader gets the value back through one ``Mul`` by ``s`` (exact: powers
of two), inserted only when the target runs a float ``Mul`` next to its quantized layers
(``restore=True``; the float-scale presets, which leave the residual Adds float). An NPU
config (``enable_npu_cnn``, XINT8: int8 operators only) gets ``restore=False``: a LayerNorm
read by anything but linear layers is left as it is there.

Fires on: a standard ``LayerNormalization`` over the last axis with a constant float gain (and
bias, if any) of one value per channel whose output is not a graph output, read as the data
input of at least one ``MatMul`` with a constant 2-D float weight or ``Gemm`` with a constant
float ``B`` (``transA = 0``), directly or through ``Reshape`` nodes that keep the last axis (the
flattening to 2-D an exporter or onnxsim puts before a ``Gemm``), and otherwise only by ``Add``
nodes when ``restore`` is set.
Does not fire without sample inputs (the ranges are data), on any other producer (nothing to
fold the division into: this pass never puts a ``Mul`` before a linear layer), when the
output is read by anything else (a non-linear op such as Gelu or Softmax would need the value
restored before it, a cost this pass keeps to the residual Adds), or when the scales would not
at least halve the output's range ``max_j max|y_j|`` (:data:`MIN_RANGE_GAIN`; no outlier
channels: the rounding to powers of two moves some channels of any activation by 2x, for
nothing).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import TYPE_CHECKING

import numpy as np
import onnx
import onnx_ir as ir

from quark_onnx.graph.ir import NameGenerator, add_initializer, constant_array, is_standard
from quark_onnx.passes._channel_scaling import float_constant, power_of_two_scales, store_constant
from quark_onnx.passes.base import QuarkPass

if TYPE_CHECKING:
    from collections.abc import Sequence

logger = logging.getLogger(__name__)

#: Per-channel scales are ``2^-MAX_LOG2 ... 2^MAX_LOG2``: SmoothQuant's outliers are at most a
#: few hundred times the median; the limit only keeps the weights far from float32's range.
MAX_LOG2 = 12
#: SmoothQuant's default migration strength (``SmoothAlpha``).
DEFAULT_ALPHA = 0.5
#: Node metadata on each LayerNorm rescaled: the JSON list of its ``log2 s_j``.
SCALES_KEY = "quark_onnx.outlier_scales_log2"
#: A LayerNorm output is rescaled only when its per-tensor range shrinks at least this much
#: (one bit): the power-of-two rounding moves some channels of any activation by 2x, which
#: would coarsen weight rows for nothing.
MIN_RANGE_GAIN = 2.0


@dataclasses.dataclass
class _Site:
    """One LayerNormalization, the linear layers reading it and the Adds to restore."""

    norm: ir.Node
    gain: np.ndarray
    bias: np.ndarray | None
    # (node, weight, axis of the weight that indexes the input channels)
    linears: list[tuple[ir.Node, np.ndarray, int]]
    adds: list[ir.Node]


def _norm_over_last_axis(node: ir.Node) -> tuple[np.ndarray, np.ndarray | None] | None:
    """The gain and bias of a LayerNormalization normalizing the last axis only, or None."""
    if not is_standard(node, "LayerNormalization") or len(node.inputs) < 2:
        return None
    x = node.inputs[0]
    axis = node.attributes.get_int("axis", -1)
    rank = x.shape.rank() if x is not None and x.shape is not None else None
    if not (axis == -1 or (rank is not None and axis == rank - 1)):
        return None
    gain = float_constant(node.inputs[1])
    if gain is None or gain.ndim != 1:
        return None
    bias = float_constant(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
    if len(node.inputs) > 2 and node.inputs[2] is not None and bias is None:
        return None  # a bias computed at run time cannot be divided here
    if bias is not None and bias.shape != gain.shape:
        return None
    return gain, bias


def _linear_weight(node: ir.Node, index: int, channels: int) -> tuple[np.ndarray, int] | None:
    """``node`` reading the value as the data input of a linear layer: its constant weight and
    the weight axis that indexes the value's channels, or None."""
    if index != 0 or len(node.inputs) < 2:
        return None
    w = float_constant(node.inputs[1])
    if w is None or w.ndim != 2 or w.dtype not in (np.float32, np.float64):
        return None
    if is_standard(node, "MatMul"):
        axis = 0
    elif is_standard(node, "Gemm") and node.attributes.get_int("transA", 0) == 0:
        axis = 1 if node.attributes.get_int("transB", 0) else 0
    else:
        return None
    return (w, axis) if w.shape[axis] == channels else None


def _keeps_last_axis(node: ir.Node, channels: int) -> bool:
    """A Reshape whose output also ends in ``channels`` (exporters flatten ``[N, S, H]`` to
    ``[N*S, H]`` before a Gemm): flat index ``i*H + j`` keeps channel ``j`` on the last axis."""
    if not is_standard(node, "Reshape") or len(node.inputs) < 2:
        return False
    target = constant_array(node.inputs[1])
    out = node.outputs[0].shape
    last = out[-1] if out is not None and out.rank() else None
    return (target is not None and target.size > 0 and int(target[-1]) == channels) or (
        last == channels
    )


def _read(value: ir.Value, site: _Site, restore: bool, direct: bool) -> bool:
    """Add the readers of ``value`` (the LayerNorm output, or a Reshape of it keeping its last
    axis) to ``site``; False when one of them blocks the rescaling (module doc)."""
    if value.is_graph_output():
        return False
    channels = site.gain.size
    for use in value.uses():
        linear = _linear_weight(use.node, use.idx, channels)
        if linear is not None:
            site.linears.append((use.node, *linear))
        elif use.idx == 0 and _keeps_last_axis(use.node, channels):
            if not _read(use.node.outputs[0], site, restore, direct=False):
                return False
        elif direct and restore and is_standard(use.node, "Add"):
            if use.node not in site.adds:
                site.adds.append(use.node)
        else:
            return False
    return True


def _site(node: ir.Node, restore: bool) -> _Site | None:
    """``node`` as a LayerNormalization this pass can rescale (module doc, Fires on), or None."""
    found = _norm_over_last_axis(node)
    if found is None:
        return None
    site = _Site(node, *found, [], [])
    if not _read(node.outputs[0], site, restore, direct=True):
        return None
    return site if site.linears else None


class MigrateActivationOutliers(QuarkPass):
    """Divide a LayerNorm's outlier channels by powers of two and multiply them back into the
    weights of the linear layers reading it (see module doc).

    Args:
        sample_feeds: model inputs (the first calibration samples); the LayerNorm outputs'
            per-channel ``max |y|`` is measured on them. Without them (and without ``scales``)
            the pass does not fire.
        alpha: migration strength in ``[0, 1]``: the share of an activation channel's range
            moved into the weights (0.5: both end with the same range).
        restore: a LayerNorm output also read by ``Add`` nodes (the residual stream of a
            post-LN encoder) is rescaled and those Adds read it through a ``Mul`` restoring
            it; False where the target takes no float ``Mul`` (NPU configs).
        scales: LayerNorm node name -> the ``log2`` of its per-channel scales, applied as they
            are instead of measured (what a recipe recorded; its rebuild has no data).

    Each LayerNorm it rescales carries the ``log2 s`` it chose as node metadata
    (:data:`SCALES_KEY`, a JSON list), so the quantized model says what was done and a recipe
    can record it (:func:`recorded_scales`).
    """

    def __init__(
        self,
        sample_feeds: Sequence[dict[str, np.ndarray]] | None = None,
        alpha: float = DEFAULT_ALPHA,
        restore: bool = True,
        scales: dict[str, list[int]] | None = None,
    ) -> None:
        super().__init__()
        self.sample_feeds = list(sample_feeds or [])
        self.alpha = alpha
        self.restore = restore
        self.scales = dict(scales or {})
        #: (LayerNorm name, channels rescaled, linear readers, Adds restored) per site rescaled
        self.report: list[tuple[str, int, int, int]] = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.report = []
        graph = model.graph
        sites = [s for n in graph if (s := _site(n, self.restore)) is not None]
        names = NameGenerator(graph)
        if self.scales:
            for site in sites:
                given = self.scales.get(site.norm.name or "")
                if given is not None and len(given) == site.gain.size:
                    self._apply(graph, site, np.exp2(np.asarray(given, np.float64)), names)
            unused = sorted(set(self.scales) - {r[0] for r in self.report})
            if unused:
                logger.warning(
                    "MigrateActivationOutliersScales names %s, which %s no LayerNorm this pass "
                    "can rescale with that many channels: left as %s",
                    ", ".join(map(repr, unused)),
                    "is" if len(unused) == 1 else "are",
                    "it is" if len(unused) == 1 else "they are",
                )
        elif sites and self.sample_feeds:
            for site, s in self._measured(model, sites):
                self._apply(graph, site, s, names)
        if self.report:
            logger.info(
                "MigrateActivationOutliers: %d LayerNorm output(s) rescaled, %d channel(s)",
                len(self.report),
                sum(r[1] for r in self.report),
            )
        return ir.passes.PassResult(model, modified=bool(self.report))

    def _measured(self, model: ir.Model, sites: list[_Site]) -> list[tuple[_Site, np.ndarray]]:
        """The sites worth rescaling and their scales, from the samples' channel ranges."""
        try:
            ranges = _channel_ranges(model, [s.norm.outputs[0] for s in sites], self.sample_feeds)
        except Exception as exc:  # onnxruntime raises its own exception types
            text = str(exc).strip()
            logger.warning(
                "MigrateActivationOutliers: cannot run the model on the samples (%s); the "
                "LayerNorm outputs are left as they are",
                text.splitlines()[0] if text else type(exc).__name__,
            )
            return []
        chosen = []
        for site in sites:
            r1 = ranges.get(site.norm.outputs[0].name or "")
            if r1 is None or r1.shape != site.gain.shape:
                continue
            rows = [np.abs(w).max(axis=1 - axis) for _, w, axis in site.linears]
            r2 = np.max(rows, axis=0).astype(np.float64)
            s = power_of_two_scales(r1, r2, MAX_LOG2, alpha=self.alpha)
            if r1.max() >= MIN_RANGE_GAIN * (r1 / s).max():
                chosen.append((site, s))
        return chosen

    def _apply(self, graph: ir.Graph, site: _Site, s: np.ndarray, names: NameGenerator) -> None:
        if np.all(s == 1.0):
            return
        norm = site.norm
        store_constant(graph, norm, 1, site.gain / s.astype(site.gain.dtype), names)
        if site.bias is not None:
            store_constant(graph, norm, 2, site.bias / s.astype(site.bias.dtype), names)
        for node, w, axis in site.linears:
            factors = s.astype(w.dtype).reshape((-1, 1) if axis == 0 else (1, -1))
            store_constant(graph, node, 1, w * factors, names)
        y = norm.outputs[0]
        if site.adds:
            base = y.name or "layer_norm"
            scale = add_initializer(graph, names(f"{base}_outlier_scale"), s.astype(np.float32))
            restored = ir.Value(name=names(f"{base}_restored"), shape=y.shape, type=y.type)
            mul = ir.Node("", "Mul", [y, scale], outputs=[restored], name=names(f"{base}_restore"))
            graph.insert_after(norm, mul)
            for add in site.adds:
                for index, value in enumerate(add.inputs):
                    if value is y:
                        add.replace_input_with(index, restored)
        norm.metadata_props[SCALES_KEY] = json.dumps([int(k) for k in np.log2(s)])
        self.report.append(
            (norm.name or "", int(np.count_nonzero(s != 1.0)), len(site.linears), len(site.adds))
        )


def recorded_scales(model: onnx.ModelProto) -> dict[str, list[int]]:
    """LayerNorm node name -> the ``log2`` scales this pass chose, read from a model it rescaled
    (the node metadata :data:`SCALES_KEY`); ``{}`` when it rescaled nothing."""
    found: dict[str, list[int]] = {}
    for node in model.graph.node:
        for entry in node.metadata_props:
            if entry.key == SCALES_KEY:
                found[node.name] = [int(k) for k in json.loads(entry.value)]
    return found


def _channel_ranges(
    model: ir.Model, values: list[ir.Value], feeds: Sequence[dict[str, np.ndarray]]
) -> dict[str, np.ndarray]:
    """Per value, ``max |y_j|`` over the samples and every position (the last axis kept)."""
    from quark_onnx.runtime import sessions

    wanted = sorted({v.name for v in values if v.name})
    session = sessions.create_session(
        model, purpose="activation_outliers", edit=lambda p: sessions.add_outputs(p, wanted)
    )
    ranges: dict[str, np.ndarray] = {}
    for feed in feeds:
        for name, array in zip(wanted, session.run(wanted, dict(feed)), strict=True):
            a = np.abs(np.asarray(array, np.float64))
            r = a.reshape(-1, a.shape[-1]).max(axis=0) if a.ndim else a.reshape(1)
            ranges[name] = np.maximum(ranges[name], r) if name in ranges else r
    return ranges
