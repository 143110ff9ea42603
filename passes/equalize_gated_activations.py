"""EqualizeGatedActivations: float-exact channel equalization through SiLU, hardswish and GELU.

Why. Networks with gated activations ``y = x * g(x)`` (SiLU ``x * Sigmoid(x)`` in YOLOX/YOLOv5-8
and EfficientNet, hardswish ``x * Clip(x + 3, 0, 6) / 6`` in MobileNetV3 and PaddleOCR, GELU
``x * (Erf(x / sqrt 2) + 1) * 0.5`` in ConvNeXt-style blocks such as PP-OCRv6's) come out
of BatchNorm folding with the same per-channel range spread as Relu networks: in a YOLOX person
detector the first SiLU output has channels reaching 0.5 next to channels reaching 130, and the
depthwise layer reading it has weights of 12.9 on the small channels against 0.03 on the large
ones. One power-of-two scale per tensor rounds the small channels to zero in the activation and
the small weights to zero in the reader. Cross-layer equalization cannot move range across
``g``: the activation is not positively homogeneous (``silu(s x) != s silu(x)``).

Maths. The product form makes it exact anyway. Let ``x = W1 * a + b1`` (a Conv) and ``y = x *
g(x)`` read by convolutions ``z = W2 * y + b2``. For a positive per-channel vector ``s``, write
the producer as ``x' = x / s`` (``W1[c] / s_c``, ``b1[c] / s_c``) and feed the gate ``g(x' * s)``
(a new ``Mul`` by the constant ``s`` in front of the gate's first node). Then::

    y' = x' * g(x' * s) = (x / s) * g(x) = y / s        W2[:, c] <- W2[:, c] * s_c  =>  z' = z

Only the values in the product change range; the gate computes exactly what it computed. With
``s`` a power of two per channel every multiplication and division is exact in floating point,
so the float model's outputs are bit-identical (up to underflow below float32's normal range).

The choice of ``s`` is cross-layer equalization's (Nagel et al., ICCV 2019, and
:mod:`.cross_layer_equalization`): ``s_c = sqrt(r1_c / r2_c)``, which makes the two ranges
``sqrt(r1_c r2_c)``, with ``r2_c`` the largest reader weight on input channel ``c`` (grouped
layout) and ``r1_c`` the range of what is quantized on the producer side. Given sample inputs
(the first calibration samples), ``r1_c`` is the calibrated ``max |x_c|``: the quantized
activations ``x`` and ``y`` carry the channel spread (0.5 next to 130 in the detector), and
their per-tensor scale is what loses the small channels. Without samples it is the producer's
weight range ``max |W1[c, ...]|`` (data-free, as CLE). A channel that is ~0 on either side keeps
``s_c = 1``. ``s`` is rounded to a power of two, centred (the median channel keeps its scale) and
limited to ``2^-MAX_LOG2 ... 2^MAX_LOG2``: the constant ``s`` of the new ``Mul`` is itself
quantized with one power-of-two int8 scale, which holds powers of two spanning ``2^6`` exactly
(codes 1 ... 64). Measured on the person detector (``benchmarks/results/detector_ocr.txt``): the
activation ranges keep more of the float detections than the weight ranges.

The new ``Mul`` runs where the gate runs (a Sigmoid is not an NPU XINT8 op, GUIDE §3); the
gate's input is quantized on its own, and values the gate saturates (|x| > 8 for Sigmoid, > 3
for hardswish) may be clipped there at no cost.

Fires on: a Conv (constant float weights, optional bias) whose output ``x`` has exactly two
readers, a ``Mul(x, G)`` and the first node of a chain of single-reader, single-variable-input
elementwise nodes (:data:`GATE_OPS`, other inputs constant) ending in ``G``; after the ``Mul``
optionally ``Mul``/``Div`` by a scalar constant (hardswish's ``/ 6``); every reader of the result
a Conv reading it as its data input, with constant float weights, or a channel ``Concat`` (static
channel counts) whose readers are all such Convs (the CSP blocks of YOLO-style detectors): there
the readers' input channels at the result's offset are scaled, the Concat's other inputs keep
theirs. Does not fire again on a gate
that already reads ``x`` through a per-channel ``Mul`` (idempotent).

Also fires on a native ``HardSwish(x)`` (the op torch's ``nn.Hardswish`` exports; MobileNetV3,
PaddleOCR's document orientation classifier), the only reader of a Conv's output, whose result
only Convs read as above: when the scales are not all 1 it is first written as its product form
``x * HardSigmoid(x)`` (alpha 1/6, beta 1/2: the operations onnxruntime's HardSwish computes,
bit-identical outputs) and then equalized like the decomposed hardswish. The
HardSigmoid is an NPU op (simulated with the DPU's 2731/16384 by ConvertHardSigmoidToDPUVersion);
a HardSwish left as it is keeps the op. Measured on the document orientation classifier
(``benchmarks/results/unseen.md``): 6.4 -> 20.3 dB output SQNR, argmax agreement 0.72 -> 0.97.

Constant shifts on either side are crossed too (PP-LCNetV3's learnable affine blocks: ``Conv ->
Add(k1) -> HardSwish -> Mul(a) -> Add(k2) -> Conv``): an ``Add``/``Sub`` of one number or one per
channel between the Conv and the gated value, or between the product and its readers, gets its
constant divided by ``s`` per channel (``(v + k) / s = v / s + k / s``, exact with powers of two);
a scalar ``Mul``/``Div`` after the product commutes with ``s``. Measured on the PP-OCRv5 text
detector and recognizer (``benchmarks/results/unseen.md``).

Does not fire when ``x`` or
``y`` is a graph output, when anything else reads them (an Add, a pool, a Concat read by
anything but Convs: the same values would need two scales), or when the gate reads anything but
``x``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import onnx_ir as ir

from quark_onnx.graph.channels import channel_statistics, output_channel_ranges
from quark_onnx.graph.ir import NameGenerator, add_initializer, is_standard
from quark_onnx.passes._channel_scaling import (
    ConvReader,
    conv_reader,
    conv_weight,
    float_constant,
    power_of_two_scales,
    store_constant,
)
from quark_onnx.passes.base import QuarkPass

if TYPE_CHECKING:
    from collections.abc import Sequence

logger = logging.getLogger(__name__)

#: Elementwise ops a gate may be built of (one variable input; the others constant).
GATE_OPS = frozenset(
    {"Sigmoid", "HardSigmoid", "Add", "Sub", "Mul", "Div", "Clip", "Relu", "Tanh", "Softplus"}
    | {"Erf"}  # GELU's Phi(x) = (Erf(x / sqrt 2) + 1) / 2
)
#: Longest gate chain followed (hardswish as Add, Clip, Div is 3 nodes).
MAX_GATE_NODES = 6


def _gate_end(head: ir.Node, x: ir.Value, mul: ir.Node) -> ir.Value | None:
    """The value the chain starting at ``head`` (reading ``x``) hands to ``mul``, or None."""
    node, current = head, x
    for _ in range(MAX_GATE_NODES):
        if node.op_type not in GATE_OPS or node.domain not in ("", "ai.onnx"):
            return None
        variable = [i for i in node.inputs if i is not None and float_constant(i) is None]
        if variable != [current] or len(node.outputs) != 1:
            return None
        out = node.outputs[0]
        uses = list(out.uses())
        if out.is_graph_output() or len(uses) != 1:
            return None
        if uses[0].node is mul:
            return out
        node, current = uses[0].node, out
    return None


def _scalar_rescale(node: ir.Node, value: ir.Value) -> bool:
    """``node`` is ``Mul(value, k)``/``Mul(k, value)``/``Div(value, k)`` with a scalar constant."""
    if not (is_standard(node, "Mul") or is_standard(node, "Div")) or len(node.inputs) != 2:
        return False
    others = [i for i in node.inputs if i is not value]
    if len(others) != 1 or (node.op_type == "Div" and node.inputs[0] is not value):
        return False
    k = float_constant(others[0])
    return k is not None and k.size == 1


def _constant_shift(node: ir.Node, value: ir.Value, channels: int) -> int | None:
    """The input slot of the float constant ``node`` adds to (or subtracts from) ``value``: one
    number, or one per channel (``C x 1 x 1``); None if ``node`` is not that. A per-channel
    scaling passes it once the constant is scaled too (PP-LCNetV3's learnable affine blocks)."""
    if not (is_standard(node, "Add") or is_standard(node, "Sub")) or len(node.inputs) != 2:
        return None
    slots = [i for i, v in enumerate(node.inputs) if v is not value]
    if len(slots) != 1:
        return None
    k = float_constant(node.inputs[slots[0]])
    if k is None:
        return None
    per_channel = k.ndim >= 3 and k.shape[-3:] == (channels, 1, 1) and k.size == channels
    return slots[0] if k.size == 1 or per_channel else None


def _through(
    y: ir.Value, channels: int, *, rescales: bool = True
) -> tuple[ir.Value, list[ir.Node]]:
    """Follow ``y`` past single-reader constant ``Add``/``Sub`` nodes (and, with ``rescales``,
    scalar ``Mul``/``Div``): the value reached and the constant shifts on the way."""
    shifts: list[ir.Node] = []
    while not y.is_graph_output():
        uses = list(y.uses())
        if len(uses) != 1:
            break
        node = uses[0].node
        if _constant_shift(node, y, channels) is not None:
            shifts.append(node)
        elif not (rescales and _scalar_rescale(node, y)):
            break
        y = node.outputs[0]
    return y, shifts


def _gated_value(conv: ir.Node) -> tuple[ir.Value, list[ir.Node]]:
    """The value a gate may read: ``conv``'s output past constant shifts (``x = W a + b + k``,
    a bias added after the Conv), and those shifts."""
    return _through(conv.outputs[0], _width(conv), rescales=False)


def _concat_readers(concat: ir.Node, index: int, channels: int) -> list[ConvReader] | None:
    """The Conv readers of a channel Concat's output, at the offset of its input ``index``."""
    out = concat.outputs[0]
    rank = out.shape.rank() if out.shape is not None else None
    axis = concat.attributes.get_int("axis", 0)
    if rank is None or axis not in (1, 1 - rank) or out.is_graph_output():
        return None
    if sum(1 for v in concat.inputs if v is concat.inputs[index]) != 1:
        return None  # the same value twice: two slices, one scale (not handled)
    widths = []
    for value in concat.inputs:
        dim = value.shape[1] if value is not None and value.shape is not None else None
        if not isinstance(dim, int):
            return None
        widths.append(dim)
    if widths[index] != channels:
        return None
    offset = sum(widths[:index])
    readers = [conv_reader(u.node, u.idx, offset, sum(widths)) for u in out.uses()]
    if not readers or any(r is None for r in readers):
        return None
    return readers  # type: ignore[return-value]


def _native_hardswish(conv: ir.Node) -> ir.Node | None:
    """The ``HardSwish`` node that is the only reader of ``conv``'s output, or None."""
    if conv_weight(conv) is None or len(conv.outputs) != 1:
        return None
    x, _ = _gated_value(conv)
    uses = list(x.uses())
    if x.is_graph_output() or len(uses) != 1 or not is_standard(uses[0].node, "HardSwish"):
        return None
    hardswish = uses[0].node
    if hardswish.outputs[0].is_graph_output():
        return None
    return hardswish


def _width(conv: ir.Node) -> int:
    weight = conv_weight(conv)
    return int(weight.shape[0]) if weight is not None else 0


def _split_hardswish(graph: ir.Graph, hardswish: ir.Node, names: NameGenerator) -> None:
    """Write ``y = HardSwish(x)`` as ``y = x * HardSigmoid(x)`` (alpha 1/6, beta 1/2: the same
    float operations), the product form whose gate can read ``x`` back through a ``Mul``."""
    x, y = hardswish.inputs[0], hardswish.outputs[0]
    assert x is not None
    gate = ir.Value(name=names(f"{x.name or 'x'}_hardsigmoid"), shape=x.shape, type=x.type)
    hsig = ir.Node(
        "",
        "HardSigmoid",
        [x],
        attributes=[ir.AttrFloat32("alpha", 1.0 / 6.0), ir.AttrFloat32("beta", 0.5)],
        outputs=[gate],
        name=names(f"{hardswish.name or 'hardswish'}_gate"),
    )
    product = ir.Value(name=names(f"{y.name or 'y'}_product"), shape=y.shape, type=y.type)
    mul = ir.Node("", "Mul", [x, gate], outputs=[product], name=names(hardswish.name or "mul"))
    graph.insert_after(hardswish, [hsig, mul])
    y.replace_all_uses_with(product)
    graph.remove(hardswish, safe=True)


class EqualizeGatedActivations(QuarkPass):
    """Equalize producer and reader ranges through ``x * g(x)`` (see module doc).

    Args:
        sample_feeds: model inputs (the first calibration samples); with them the producer side
            is measured by the activations' per-channel ``max |x|``, without them (or when
            onnxruntime cannot run the model) by the producer's weights.
    """

    def __init__(self, sample_feeds: Sequence[dict[str, np.ndarray]] | None = None) -> None:
        super().__init__()
        self.sample_feeds = list(sample_feeds or [])
        self._ranges: dict[str, np.ndarray] = {}

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        names = NameGenerator(graph)
        convs = [n for n in graph if is_standard(n, "Conv")]
        # the samples are run only for models that have the pattern, and only to the
        # producers' outputs (a CNN without gated activations costs nothing here)
        self._ranges = {}
        native = {id(c): h for c in convs if (h := _native_hardswish(c)) is not None}
        matched = [
            c
            for c in convs
            if self._rewrite(graph, c, names, dry_run=True)
            or (id(c) in native and self._readers(native[id(c)].outputs[0], _width(c)))
        ]
        if not matched:
            return ir.passes.PassResult(model, modified=False)
        self._ranges = self._measure(model, [_gated_value(c)[0].name or "" for c in matched])
        count = 0
        for conv in convs:
            hardswish = native.get(id(conv))
            if hardswish is not None and self._scales(conv, hardswish.outputs[0]) is not None:
                _split_hardswish(graph, hardswish, names)  # then equalized as the product form
            if self._rewrite(graph, conv, names):
                count += 1
        if count:
            logger.info("EqualizeGatedActivations: %d gated activation(s) equalized", count)
        return ir.passes.PassResult(model, modified=bool(count))

    def _measure(self, model: ir.Model, names: list[str]) -> dict[str, np.ndarray]:
        """Per-channel ``max |x|`` over the samples of the named values (empty without samples).

        The rewrite is float-exact, so ranges measured once before it stay valid for the
        unscaled channels: an equalized output's range is the measured one divided by ``s``."""
        names = sorted({name for name in names if name})
        if not self.sample_feeds or not names:
            return {}
        try:
            stats = channel_statistics(model, self.sample_feeds, names)
        except Exception as exc:  # onnxruntime raises its own exception types
            text = str(exc).strip()
            logger.warning(
                "EqualizeGatedActivations: cannot run the model on the samples (%s); the "
                "producers' weight ranges are used instead",
                text.splitlines()[0] if text else type(exc).__name__,
            )
            return {}
        return {name: stat.max_abs for name, stat in stats.items()}

    def _rewrite(
        self, graph: ir.Graph, conv: ir.Node, names: NameGenerator, *, dry_run: bool = False
    ) -> bool:
        """Equalize the gated activation ``conv`` produces, if it has the pattern (with
        ``dry_run``: only say whether it has it; scales may still all come out 1)."""
        w1 = conv_weight(conv)
        if w1 is None or len(conv.outputs) != 1:
            return False
        bias_value = conv.inputs[2] if len(conv.inputs) > 2 else None
        b1 = float_constant(bias_value) if bias_value is not None else None
        if bias_value is not None and (b1 is None or b1.shape != (w1.shape[0],)):
            return False
        x, pre = _gated_value(conv)
        uses = list(x.uses())
        if x.is_graph_output() or len(uses) != 2:
            return False
        for mul, head in ((uses[0].node, uses[1].node), (uses[1].node, uses[0].node)):
            if mul is head or not is_standard(mul, "Mul") or len(mul.inputs) != 2:
                continue
            if is_standard(head, "Mul") and any(
                (k := float_constant(i)) is not None and k.size > 1 for i in head.inputs
            ):
                return False  # the gate reads x through a per-channel Mul: equalized already
            gate = _gate_end(head, x, mul)
            if gate is None or set(mul.inputs) != {x, gate}:
                continue
            readers = self._readers(mul.outputs[0], w1.shape[0])
            if readers is None or dry_run:
                return readers is not None
            r1 = self._producer_ranges(x, w1)
            shifts = pre + _through(mul.outputs[0], w1.shape[0])[1]
            return self._apply(graph, conv, w1, b1, r1, head, x, readers, shifts, names)
        return False

    def _producer_ranges(self, x: ir.Value, w1: np.ndarray) -> np.ndarray:
        """``r1``: the measured per-channel ``max |x|``, else the producer's weight ranges."""
        measured = self._ranges.get(x.name or "")
        if measured is not None and measured.shape == (w1.shape[0],):
            return measured
        return output_channel_ranges(w1.astype(np.float64))

    def _scales(self, conv: ir.Node, y: ir.Value) -> np.ndarray | None:
        """The scales :meth:`_apply` would choose for ``conv``'s channels read as ``y``, or None
        when there are none to apply (no Conv readers, or every scale 1)."""
        w1 = conv_weight(conv)
        readers = self._readers(y, _width(conv)) if w1 is not None else None
        if w1 is None or readers is None:
            return None
        r2 = np.max([reader.ranges(w1.shape[0]) for reader in readers], axis=0)
        s = power_of_two_scales(self._producer_ranges(_gated_value(conv)[0], w1), r2)
        return None if np.all(s == 1.0) else s

    @staticmethod
    def _readers(y: ir.Value, channels: int) -> list[ConvReader] | None:
        """The Conv readers of ``y`` (past scalar Mul/Div and constant Add/Sub, and through a
        channel Concat read only by Convs), each with the input channels that are ``y``'s."""
        y, _ = _through(y, channels)
        if y.is_graph_output():
            return None
        uses = list(y.uses())
        readers: list[ConvReader] = []
        for use in uses:
            if is_standard(use.node, "Concat"):
                found = _concat_readers(use.node, use.idx, channels)
                if found is None:
                    return None
                readers += found
                continue
            reader = conv_reader(use.node, use.idx, 0, channels)
            if reader is None:
                return None
            readers.append(reader)
        return readers or None

    @staticmethod
    def _apply(
        graph: ir.Graph,
        conv: ir.Node,
        w1: np.ndarray,
        b1: np.ndarray | None,
        r1: np.ndarray,
        head: ir.Node,
        x: ir.Value,
        readers: list[ConvReader],
        shifts: list[ir.Node],
        names: NameGenerator,
    ) -> bool:
        r2 = np.max(
            [reader.ranges(w1.shape[0]) for reader in readers],
            axis=0,
        )
        s = power_of_two_scales(r1, r2)
        if np.all(s == 1.0):
            return False
        shape = (-1,) + (1,) * (w1.ndim - 1)
        store_constant(graph, conv, 1, w1 / s.reshape(shape).astype(w1.dtype), names)
        if b1 is not None:
            store_constant(graph, conv, 2, b1 / s.astype(b1.dtype), names)
        for reader in readers:
            store_constant(graph, reader.node, 1, reader.scaled(s), names)
        for node in shifts:  # (v + k) / s = v / s + k / s: the constant per channel
            slot = next(i for i, v in enumerate(node.inputs) if float_constant(v) is not None)
            k = float_constant(node.inputs[slot])
            assert k is not None
            per_channel = np.broadcast_to(k.reshape(-1), s.shape) / s.astype(k.dtype)
            shape = (1,) * max(k.ndim - 3, 0) + (-1, 1, 1)
            store_constant(graph, node, slot, per_channel.reshape(shape).astype(k.dtype), names)
        base = x.name or "gated"
        constant = add_initializer(
            graph,
            names(f"{base}_gate_scale"),
            s.reshape((-1,) + (1,) * (w1.ndim - 2)).astype(np.float32),
        )
        restored = ir.Value(name=names(f"{base}_gate_input"), shape=x.shape, type=x.type)
        unscale = ir.Node(
            "", "Mul", [x, constant], outputs=[restored], name=names(f"{base}_gate_restore")
        )
        graph.insert_before(head, unscale)
        for index, value in enumerate(head.inputs):
            if value is x:
                head.replace_input_with(index, restored)
        return True
