"""FoldConvAffine: per-channel scale and shift constants after a Conv, and scale constants before
one, go into the Conv.

Why. Exporters often leave a per-channel affine map as separate nodes after a Conv: the bias as
an ``Add`` of a ``1 x C x 1 x 1`` constant (paddle2onnx writes every Conv bias this way), a
BatchNormalization already split into ``Mul`` and ``Add``, or a learnable affine block's scale
and shift (PP-LCNetV3: ``Conv -> Add(bias) -> Mul(a) -> Add(k) -> HardSwish``). Simplification
(``optimize_model``, onnxsim) folds them; without it every pass that reads a layer's weights and
bias sees a Conv without its bias and an ``Add`` reading it, and stops: on the PP-OCRv5 text
detector quantized with the Vitis AI documentation's options (``optimize_model = False``) no
constant channel was folded, CLE found 1 pair instead of 15 and no gated activation was
equalized, and the output came out at -0.4 dB SQNR instead of 9.2 dB.

Maths. Each node of the chain maps ``x`` to ``m x + b`` per channel (``Mul(x, k)``: ``m = k``;
``Div(x, k)``: ``m = 1 / k``; ``Add(x, k)``: ``b = k``; ``Sub(x, k)``: ``b = -k``; an inference
BatchNormalization: its ``m`` and ``b``, so a BN after a bias ``Add`` folds too), so the chain
composes to one ``(m, b)`` (in float64) and folds as a BatchNormalization does
(:mod:`._affine_fold`): ``W'[o] = m[o] W[o]``, ``B'[o] = m[o] B[o] + b[o]``. The Conv's output
takes the last node's place and name. Float-preserving: the result differs by float32 rounding
only (about 1e-7 relative; a bias ``Add`` alone folds bit-identically in onnxruntime).

Fires on: a Conv or ConvTranspose with constant float weights (and constant bias, if any) whose
output is read only by a ``Mul``/``Add`` (either input order), ``Sub`` or ``Div`` (the Conv's value
first) with a constant of one number or one per output channel (shape ``C``, ``C x 1 x 1`` or
``1 x C x 1 x 1``), or by an inference BatchNormalization with constant parameters, and so on
along single readers (it runs before ConvertBNToConv, which folds the other BNs). Does not fire
when the Conv's output (or a
value in the chain) is also read elsewhere or is a graph output, when the constant would
broadcast the value to a larger shape, or when it is a graph input (it may be overridden).

Before a Conv. A power-of-two scale that only Convs read, ``Conv(x * k)`` or ``Conv(x / k)``
with ``k`` one number or one per input channel, each ``+-2^n``, is the Conv with its weights'
input channels scaled, ``W'[o, c] = k[c] W[o, c]``: exact in float (zero padding stays zero, the
bias is unchanged) and in the power-of-two int8 grid (the weights' position moves by ``n``).
GELU is exported as ``x * (1 + erf(x / sqrt(2))) * 0.5``; simplification (``optimize_model``)
folds the ``* 0.5`` into the next Conv, and without it the ``Mul`` stood between the gated
product and its readers, so the equalization passes, which round per-channel scales against
the readers' weight ranges, saw those ranges doubled and rounded differently: the PP-OCRv6 tiny
recognizer quantized with the Vitis AI documentation's options (``optimize_model = False``)
measured 7.2 dB output SQNR where the preset measured 9.5 (10.5 with the fold). A scale that is
not a power of two (hardswish's ``/ 6``) is left alone: folded, it re-rounds the weights and moves
the equalization's rounding the same way, and measured lower on both hardswish models tried
(``benchmarks/results/input_scale_fold.md``). Fires when every reader of the scaled value is a
Conv or ConvTranspose reading it as its data input, with constant float weights, and the value
is not a graph output.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from quark_onnx.graph.ir import NameGenerator, is_standard
from quark_onnx.passes._affine_fold import (
    Constants,
    bn_affine,
    bypass,
    folded_conv,
    is_inference_bn,
    set_weight,
    set_weight_and_bias,
)
from quark_onnx.passes.base import QuarkPass
from quark_onnx.passes.convert_clip_to_relu import remove_if_unused

logger = logging.getLogger(__name__)

_PRODUCERS = ("Conv", "ConvTranspose")
_AFFINE_OPS = ("Mul", "Add", "Sub", "Div")


def _out_channels(node: ir.Node, weight: np.ndarray) -> int:
    if node.op_type == "Conv":
        return int(weight.shape[0])
    return int(weight.shape[1]) * node.attributes.get_int("group", 1)


def _in_channels(node: ir.Node, weight: np.ndarray) -> int:
    if node.op_type == "Conv":
        return int(weight.shape[1]) * node.attributes.get_int("group", 1)
    return int(weight.shape[0])


def _input_scaled(node: ir.Node, weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """``weight`` with its input channel ``c`` multiplied by ``scale[c]`` (float64 products)."""
    spatial = (1,) * (weight.ndim - 2)
    w = weight.astype(np.float64)
    if node.op_type == "ConvTranspose":  # W[Cin, Cout/group, k...]
        return (w * scale.reshape(-1, 1, *spatial)).astype(weight.dtype)
    group = node.attributes.get_int("group", 1)  # W[Cout, Cin/group, k...]
    cout, cin_g = weight.shape[0], weight.shape[1]
    view = w.reshape(group, cout // group, cin_g, *weight.shape[2:])
    scaled = view * scale.reshape(group, 1, cin_g, *spatial)
    return scaled.reshape(weight.shape).astype(weight.dtype)


def _powers_of_two(scale: np.ndarray) -> bool:
    """Every entry is +-2^k: folded into weights it moves their power-of-two position by k and
    rounds nothing anew."""
    if not np.all(np.isfinite(scale)) or np.any(scale == 0):
        return False
    return bool(np.all(np.abs(np.frexp(scale)[0]) == 0.5))


def _per_channel(k: np.ndarray, channels: int, rank: int) -> np.ndarray | None:
    """``k`` as one float64 number per channel, or None when it is not one number or one per
    channel on axis 1 of a rank-``rank`` value (it would broadcast the value to more)."""
    if k.size == 1 and k.ndim <= rank:
        return np.full(channels, float(k.reshape(-1)[0]))
    if k.size != channels or k.ndim > rank:
        return None
    shape = (1,) * (rank - k.ndim) + k.shape  # right-aligned, as broadcasting does
    if shape[1] != channels:
        return None
    return k.astype(np.float64).reshape(-1)


def _affine_step(
    node: ir.Node, value: ir.Value, const: Constants, channels: int, rank: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """``(m, b)`` with ``node(value) = m value + b`` per channel, or None."""
    if is_standard(node, "BatchNormalization") and is_inference_bn(node):
        affine = bn_affine(node, const) if node.inputs[0] is value else None
        return affine if affine is not None and affine[0].size == channels else None
    if not any(is_standard(node, op) for op in _AFFINE_OPS) or len(node.inputs) != 2:
        return None
    if len(node.outputs) != 1 or sum(v is value for v in node.inputs) != 1:
        return None
    slot = 1 if node.inputs[0] is value else 0
    if slot == 0 and node.op_type in ("Sub", "Div"):
        return None  # k - x, k / x: not that form
    k = const(node.inputs[slot])
    if k is None or not np.issubdtype(k.dtype, np.floating):
        return None
    per = _per_channel(k, channels, rank)
    if per is None or not np.all(np.isfinite(per)):
        return None
    ones, zeros = np.ones(channels), np.zeros(channels)
    if node.op_type == "Mul":
        return per, zeros
    if node.op_type == "Div":
        return None if np.any(per == 0) else (1.0 / per, zeros)
    return ones, (per if node.op_type == "Add" else -per)


class FoldConvAffine(QuarkPass):
    """Fold per-channel scale/shift constants after a Conv into the Conv (module doc)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        const = Constants(model)
        names = NameGenerator(model.graph)
        folded = 0
        for conv in [n for n in model.graph if any(is_standard(n, op) for op in _PRODUCERS)]:
            folded += self._fold(conv, const, names)
        for node in [n for n in model.graph if is_standard(n, "Mul") or is_standard(n, "Div")]:
            folded += self._fold_input_scale(node, const, names)
        if folded:
            logger.info("FoldConvAffine: %d scale/shift node(s) folded into Convs", folded)
        return ir.passes.PassResult(model, modified=bool(folded))

    @staticmethod
    def _fold_input_scale(node: ir.Node, const: Constants, names: NameGenerator) -> int:
        """Fold ``node`` (``x * k`` or ``x / k``) into the weights of the Convs reading it."""
        y = node.outputs[0]
        readers = [use.node for use in y.uses()]
        if y.is_graph_output() or not readers or len(node.inputs) != 2:
            return 0
        if any(
            not any(is_standard(r, op) for op in _PRODUCERS) or r.inputs[0] is not y
            for r in readers
        ):
            return 0
        slot = 1 if const(node.inputs[1]) is not None else 0
        if (slot == 0 and node.op_type == "Div") or const(node.inputs[1 - slot]) is not None:
            return 0  # k / x is not a scale; both constant is left to constant folding
        x, k = node.inputs[1 - slot], const(node.inputs[slot])
        if x is None or k is None or not np.issubdtype(k.dtype, np.floating):
            return 0
        weights = []
        for reader in readers:
            w = const(reader.inputs[1]) if len(reader.inputs) > 1 else None
            if w is None or w.ndim < 3 or not np.issubdtype(w.dtype, np.floating):
                return 0
            scale = _per_channel(k, _in_channels(reader, w), w.ndim)
            if scale is None or not _powers_of_two(scale):
                return 0
            weights.append(_input_scaled(reader, w, scale if node.op_type == "Mul" else 1 / scale))
        for reader, w in zip(readers, weights, strict=True):
            set_weight(reader, w, names, "input_scaled")
            reader.replace_input_with(0, x)
        graph, constant = node.graph, node.inputs[slot]
        assert graph is not None and constant is not None
        graph.remove(node, safe=True)
        remove_if_unused(graph, constant)
        return 1

    @staticmethod
    def _fold(conv: ir.Node, const: Constants, names: NameGenerator) -> int:
        weight = const(conv.inputs[1]) if len(conv.inputs) > 1 else None
        if weight is None or weight.ndim < 3 or len(conv.outputs) != 1:
            return 0
        channels, rank = _out_channels(conv, weight), weight.ndim
        m, b = np.ones(channels), np.zeros(channels)
        chain: list[ir.Node] = []
        value = conv.outputs[0]
        while not value.is_graph_output():
            uses = list(value.uses())
            if len(uses) != 1:
                break
            step = _affine_step(uses[0].node, value, const, channels, rank)
            if step is None:
                break
            chain.append(uses[0].node)
            m, b = step[0] * m, step[0] * b + step[1]
            value = uses[0].node.outputs[0]
        if not chain:
            return 0
        new = folded_conv(conv, const, m, b)
        if new is None:
            return 0
        only_bn = all(node.op_type == "BatchNormalization" for node in chain)
        set_weight_and_bias(conv, *new, names, "bn" if only_bn else "affine")
        x = conv.outputs[0]
        for node in chain:  # x takes each node's place; at the end the last one's name
            constants = [v for v in node.inputs if v is not None and v is not x]
            bypass(node, x)
            for v in constants:
                remove_if_unused(conv.graph, v)  # type: ignore[arg-type]
        return len(chain)
