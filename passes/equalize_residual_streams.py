"""EqualizeResidualStreams: float-exact channel equalization of residual streams.

Why. In a residual network the values added by the skip connections form a *stream*: in
MobileNetV2 a stage's first projection Conv writes it, every later block adds its projection to it,
and 1x1 Convs read it; in a ResNet stage the stream also passes a Relu after each Add. The stream
carries no activation that bounds it, and its values are quantized with one power-of-two scale
per tensor each, so a channel far wider than the rest coarsens all the others. Cross-layer
equalization stops at every Add (the two summands must carry the same scale), so it cannot
undo such a spread: a stream whose channels are rescaled (a float-equivalent model) stays
rescaled (``benchmarks/bench_residual_streams.py``, ``benchmarks/results/residual_streams.md``).

Maths. Every channel of the stream is a sum of the same channel of its producers, so one
positive vector ``s`` can scale the whole stream at once. Divide output channel ``c`` of every
Conv that writes into the stream (weights and bias) by ``s_c``; an Add of two stream values and
a per-channel positively homogeneous op (Relu, LeakyRelu, PRelu, pools, zero padding) then carry
channel ``c`` divided by ``s_c`` too; multiply input channel ``c`` of every Conv reading the
stream by ``s_c``: the readers compute what they computed. ``s`` is chosen as
:mod:`._channel_scaling` chooses it for a gated activation: powers of two (so the float model's
outputs are bit-identical), ``s_c = 2^round(log2 sqrt(r1_c / r2_c))`` centred on the median,
with ``r1_c`` the largest ``|x_c|`` of any stream value on the sample inputs (the first
calibration samples) and ``r2_c`` the readers' largest weight on channel ``c``; within
``2^-MAX_LOG2 ... 2^MAX_LOG2`` (no constant of the graph holds ``s``: the limit only keeps the
weights far from float32's range).

Gate. Balancing the stream against its readers' weights ignores what the scaling does to the
writers' weights (their rows are divided by ``s``) and where the power-of-two grid falls for
each value; on a stream whose channels are within a few times of each other it mostly moves
ranges across grid points. So a stream keeps its scaling only if the noise it predicts at the
readers' outputs is at most half of the noise without it: the rule and the factor of
cross-layer equalization's component gate (:data:`COMPONENT_MIN_GAIN`), for the same reason.
The prediction is first order and cannot tell gain from loss where a scaling changes little:
the widest stream of the shared MobileNetV2 and the first stream of the PaddleOCR classifier
both predict 1.02x less noise, and measured at the output one gains 0.6 dB and the other loses
0.2 dB; both are left as they are. A stream spread by a real range problem predicts orders of
magnitude. The prediction, on the samples: every stream value quantized with one power-of-two
int8 scale at its MinMSE position (what calibration will choose), its error on channel ``c``
weighted by the readers' ``sum_k ||W_k[:, c]||^2``; each reader's power-of-two weight error
times the mean square of the channel it reads; each writer's weight error on row ``c`` times
the mean square of its input and the readers' weight on ``c`` (:func:`_predicted_noise`).
A stream value larger than :data:`VALUE_BUDGET` elements on the samples enters the prediction
at a random sample of its spatial positions (the ranges and mean squares are exact): the pass's
cost is bounded by the number of stream values, not by the image size.

Fires on: a set of values connected by Adds of two variable inputs (and by the homogeneous ops
above, reading them as input 0) in which every value is produced by a Conv with constant float
weights, by such an Add or by such an op, and read only by such Adds and ops and by Convs with
constant float weights reading it as their data input. A Conv may both read and write the same
stream (both scalings then apply to its weight). Does not fire without sample inputs (the
stream's ranges are data), or when any stream value is a graph input or output, is read by
anything else (a Concat, a Mul, a Flatten before a Gemm: the value would need two scales), comes
from anything else, or carries a Relu's range cap (:data:`RANGE_MAX_KEY`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

from quark_onnx.graph.channels import value_channels
from quark_onnx.graph.ir import RANGE_MAX_KEY, NameGenerator, is_standard
from quark_onnx.passes._channel_scaling import (
    ConvReader,
    conv_reader,
    conv_weight,
    float_constant,
    power_of_two_scales,
    store_constant,
)
from quark_onnx.passes._cle_noise import column_energy, quant_error
from quark_onnx.passes._cle_pairs import homogeneity_problem
from quark_onnx.passes.base import QuarkPass
from quark_onnx.passes.cross_layer_equalization import COMPONENT_MIN_GAIN

if TYPE_CHECKING:
    from collections.abc import Sequence

logger = logging.getLogger(__name__)

#: Per-channel scales are ``2^-MAX_LOG2 ... 2^MAX_LOG2``.
MAX_LOG2 = 12


class _Stream:
    """The values of one residual stream, the Convs writing it and the Convs reading it."""

    def __init__(self) -> None:
        self.values: dict[int, ir.Value] = {}
        self.producers: dict[int, ir.Node] = {}
        self.readers: dict[int, ir.Node] = {}


def _is_sum(node: ir.Node) -> bool:
    """An Add of two variable (non-constant) inputs with the output's channels on axis 1 (a
    broadcast over batch or space keeps a per-channel scaling; one over channels would not)."""
    if not is_standard(node, "Add") or len(node.inputs) != 2:
        return False
    a, b = node.inputs
    if a is None or b is None or float_constant(a) is not None or float_constant(b) is not None:
        return False
    out = node.outputs[0]
    ranks = {v.shape.rank() for v in (a, b, out) if v.shape is not None}
    channels = {value_channels(v) for v in (a, b)}
    if out.shape is not None:
        channels.add(value_channels(out))
    return len(ranks) <= 1 and len(channels) == 1 and None not in channels


def _writable_conv(node: ir.Node) -> bool:
    """A Conv whose output channels can be divided: constant float weights, constant or no bias."""
    if conv_weight(node) is None:
        return False
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    return bias is None or float_constant(bias) is not None


def _passes_channels(node: ir.Node, index: int) -> bool:
    """``node`` carries a per-channel scaling of its input ``index`` to its output."""
    if _is_sum(node):
        return True
    return index == 0 and len(node.outputs) >= 1 and homogeneity_problem(node) is None


def _collect(seed: ir.Value) -> tuple[_Stream, bool]:
    """The stream holding ``seed`` and whether something blocks it (module doc). The walk
    always covers the whole stream, so each value is visited once however many Adds it has."""
    stream = _Stream()
    blocked = False
    todo = [seed]
    while todo:
        value = todo.pop()
        if id(value) in stream.values:
            continue
        stream.values[id(value)] = value
        if value.is_graph_input() or value.is_graph_output():
            blocked = True
        if RANGE_MAX_KEY in value.metadata_props:
            blocked = True
        producer = value.producer()
        if producer is None:
            blocked = True
        elif _is_sum(producer):
            todo.extend(v for v in producer.inputs if v is not None)
        elif _writable_conv(producer) and producer.outputs[0] is value:
            stream.producers[id(producer)] = producer
        elif (
            homogeneity_problem(producer) is None
            and producer.inputs[0] is not None
            and value is producer.outputs[0]
        ):
            todo.append(producer.inputs[0])
        else:
            blocked = True
        for use in value.uses():
            node = use.node
            if is_standard(node, "Conv") and use.idx == 0 and conv_weight(node) is not None:
                stream.readers[id(node)] = node
            elif _passes_channels(node, use.idx):
                todo.append(node.outputs[0])
                if _is_sum(node):
                    todo.extend(v for v in node.inputs if v is not None)
            else:
                blocked = True
    return stream, blocked


def _streams(graph: ir.Graph) -> list[_Stream]:
    """Every unblocked stream, each walked once (from its first Add in graph order)."""
    seen: set[int] = set()
    found: list[_Stream] = []
    for node in graph:
        if not _is_sum(node) or id(node.outputs[0]) in seen:
            continue
        stream, blocked = _collect(node.outputs[0])
        seen.update(stream.values)
        if not blocked and stream.producers and stream.readers:
            found.append(stream)
    return found


class EqualizeResidualStreams(QuarkPass):
    """Equalize each residual stream's channel ranges against its readers (see module doc).

    Args:
        sample_feeds: model inputs (the first calibration samples); the stream's per-channel
            ``max |x|`` is measured on them. Without them the pass does not fire.
    """

    def __init__(self, sample_feeds: Sequence[dict[str, np.ndarray]] | None = None) -> None:
        super().__init__()
        self.sample_feeds = list(sample_feeds or [])
        #: (number of values, channels, producers, readers) of each stream equalized
        self.report: list[tuple[int, int, int, int]] = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.report = []
        graph = model.graph
        streams = _streams(graph) if self.sample_feeds else []
        if not streams:
            return ir.passes.PassResult(model, modified=False)
        try:
            data = _sample_values(model, streams, self.sample_feeds)
        except Exception as exc:  # onnxruntime raises its own exception types
            text = str(exc).strip()
            logger.warning(
                "EqualizeResidualStreams: cannot run the model on the samples (%s); the residual "
                "streams are left as they are",
                text.splitlines()[0] if text else type(exc).__name__,
            )
            return ir.passes.PassResult(model, modified=False)
        generator = NameGenerator(graph)
        count = sum(self._apply(graph, s, data, generator) for s in streams)
        if count:
            logger.info("EqualizeResidualStreams: %d residual stream(s) equalized", count)
        return ir.passes.PassResult(model, modified=bool(count))

    def _apply(
        self, graph: ir.Graph, stream: _Stream, data: _Samples, names: NameGenerator
    ) -> bool:
        values = list(stream.values.values())
        channels = {int(conv_weight(n).shape[0]) for n in stream.producers.values()}  # type: ignore[union-attr]
        channels.update(value_channels(v) for v in values if v.shape is not None)
        if len(channels) != 1 or None in channels:
            return False
        (c,) = channels
        if any(data.values.get(v.name or "", _EMPTY).shape[1:2] != (c,) for v in values):
            return False
        readers = [conv_reader(n, 0, 0, c) for n in stream.readers.values()]
        if any(r is None for r in readers):
            return False
        r1 = np.max([data.max_abs[v.name] for v in values], axis=0)  # type: ignore[index]
        r2 = np.max([r.ranges(c) for r in readers], axis=0)  # type: ignore[union-attr]
        s = power_of_two_scales(r1, r2, MAX_LOG2)
        if np.all(s == 1.0):
            return False
        before = _predicted_noise(stream, readers, data, np.ones_like(s))  # type: ignore[arg-type]
        after = _predicted_noise(stream, readers, data, s)  # type: ignore[arg-type]
        logger.debug(
            "EqualizeResidualStreams: %d-channel stream of %d values, predicted noise %.4g -> %.4g",
            c, len(values), before, after,
        )  # fmt: skip
        if not after * COMPONENT_MIN_GAIN <= before:
            return False
        scaled = {id(r.node): r.scaled(s) for r in readers}  # type: ignore[union-attr]
        for key, node in stream.producers.items():
            w = scaled.get(key, conv_weight(node))
            assert w is not None
            shape = (-1,) + (1,) * (w.ndim - 1)
            scaled[key] = w / s.reshape(shape).astype(w.dtype)
            b = float_constant(node.inputs[2]) if len(node.inputs) > 2 else None
            if b is not None:
                store_constant(graph, node, 2, b / s.astype(b.dtype), names)
        for key, w in scaled.items():
            node = stream.readers.get(key) or stream.producers[key]
            store_constant(graph, node, 1, w, names)
        self.report.append((len(values), c, len(stream.producers), len(stream.readers)))
        return True


_EMPTY = np.zeros((0, 0), np.float32)

#: Elements of one stream value the noise prediction keeps over all the samples (4 MiB of
#: float32): a value larger than that on the samples is kept at this many elements, every sample
#: contributing the same number of positions, drawn at random (fixed seed) without repetition.
#: So the pass's memory and time grow with the number of stream values, not with the image
#: size: a 512x896 segmenter's 16-channel stream at half resolution is 14.7 M elements on
#: 8 samples; on bench_stage_cost.py's segmenter, holding every value whole took the pass 263 s
#: and its process 1.47 GB, sampled 20 s and 0.43 GB (the same machine and load).
#: The ranges (``r1``) and mean squares are measured on every element.
VALUE_BUDGET = 1 << 20


class _Samples:
    """What the prediction reads of the streams on the samples: each value (concatenated on
    axis 0; over :data:`VALUE_BUDGET` elements, a sample of its spatial positions), each value's
    per-channel ``max |x|`` and mean square over every element, and the mean square of each
    writer's input."""

    def __init__(
        self,
        values: dict[str, np.ndarray],
        max_abs: dict[str, np.ndarray],
        mean_square: dict[str, np.ndarray],
        power: dict[str, float],
    ) -> None:
        self.values = values
        self.max_abs = max_abs
        self.mean_square = mean_square
        self.power = power


def _kept(array: np.ndarray, samples: int, index: int) -> np.ndarray:
    """``array`` (one sample's ``N x C x H x W`` value) whole, or at the spatial positions that
    keep ``samples`` such arrays within :data:`VALUE_BUDGET` elements (``index``: the sample's
    number, which seeds the positions)."""
    n, c = array.shape[:2]
    space = array.size // max(n * c, 1)
    if array.size * samples <= VALUE_BUDGET or space <= 1:
        return np.asarray(array, np.float32)
    count = max(VALUE_BUDGET // (samples * n * c), 1)
    where = np.sort(np.random.default_rng(index).choice(space, size=count, replace=False))
    return np.asarray(array.reshape(n, c, 1, space)[..., where], np.float32)


def _sample_values(
    model: ir.Model, streams: list[_Stream], feeds: Sequence[dict[str, np.ndarray]]
) -> _Samples:
    from quark_onnx.runtime import sessions

    kept = sorted({v.name for st in streams for v in st.values.values() if v.name})
    inputs = {n.inputs[0].name for st in streams for n in st.producers.values()}
    powered = sorted(n for n in inputs if n)
    wanted = sorted(set(kept) | set(powered))
    session = sessions.create_session(
        model, purpose="residual_streams", edit=lambda p: sessions.add_outputs(p, wanted)
    )
    runs: dict[str, list[np.ndarray]] = {n: [] for n in kept}
    peaks: dict[str, np.ndarray] = {}
    squares: dict[str, np.ndarray] = {}
    elements: dict[str, int] = {}
    sums = dict.fromkeys(powered, 0.0)
    counts = dict.fromkeys(powered, 0)
    for index, feed in enumerate(feeds):
        for name, array in zip(wanted, session.run(wanted, dict(feed)), strict=True):
            if name in sums:
                sums[name] += float(np.square(array, dtype=np.float64).sum())
                counts[name] += array.size
            if name not in runs or array.ndim != 4:
                continue
            runs[name].append(_kept(array, len(feeds), index))
            peak = np.abs(array).max(axis=(0, 2, 3))
            square = np.square(array, dtype=np.float64).sum(axis=(0, 2, 3))
            if name in peaks:
                peaks[name] = np.maximum(peaks[name], peak)
                squares[name] += square
                elements[name] += array.size // array.shape[1]
            else:
                peaks[name], squares[name] = peak, square
                elements[name] = array.size // array.shape[1]
    values = {n: np.concatenate(a) for n, a in runs.items() if a}
    mean_square = {n: squares[n] / max(elements[n], 1) for n in squares}
    return _Samples(values, peaks, mean_square, {n: sums[n] / max(counts[n], 1) for n in powered})


def _predicted_noise(
    stream: _Stream, readers: list[ConvReader], data: _Samples, s: np.ndarray
) -> float:
    """First-order noise energy at the readers' outputs with the stream divided by ``s`` (module
    doc, Gate), in the stream's original units."""
    c = s.size
    reads = np.sum([column_energy(r.weight, r.group) for r in readers], axis=0)
    shape = (1, c, 1, 1)
    noise = 0.0
    for value in stream.values.values():
        x = data.values[value.name]  # type: ignore[index]
        e = quant_error(x / s.reshape(shape).astype(np.float32)) * s.reshape(shape)
        noise += float(np.sum(np.square(e).mean(axis=(0, 2, 3)) * reads))
    for reader in readers:
        mean_square = data.mean_square[reader.node.inputs[0].name] / np.square(s)  # type: ignore[index]
        error = column_energy(quant_error(reader.scaled(s)), reader.group)
        noise += float(np.sum(error * mean_square))
    for node in stream.producers.values():
        w = conv_weight(node)
        assert w is not None
        rows = quant_error(w / s.reshape((-1,) + (1,) * (w.ndim - 1)).astype(w.dtype))
        energy = np.square(rows).reshape(c, -1).sum(axis=1) * np.square(s)
        noise += float(np.sum(energy * reads)) * data.power[node.inputs[0].name]  # type: ignore[index]
    return noise
