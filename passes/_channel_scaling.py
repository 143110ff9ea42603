"""Power-of-two per-channel rescaling shared by the equalization passes
(EqualizeGatedActivations, EqualizeResidualStreams).

A value's channel ``c`` is divided by ``s_c`` at its producers and multiplied back into the
weights of the Convs that read it, so the readers compute what they computed. With every ``s_c``
a power of two each of those multiplications is exact in floating point. ``s`` balances the
producer side's range ``r1`` (what gets quantized per tensor) against the readers' weight range
``r2``, as cross-layer equalization does (``s = sqrt(r1 / r2)``, Nagel et al., ICCV 2019).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from quark_onnx.graph.channels import input_channel_ranges
from quark_onnx.graph.ir import NameGenerator, add_initializer, constant_array, is_standard

#: Per-channel scales are powers of two in ``2^-MAX_LOG2 ... 2^MAX_LOG2``: a constant ``s`` that
#: the graph keeps (the gate's restoring Mul) is itself quantized with one power-of-two int8
#: scale, which holds powers of two spanning ``2^6`` exactly (codes 1 ... 64).
MAX_LOG2 = 3
#: A channel whose weight range is at most this times the layer's widest is ~0: it keeps s = 1.
NEGLIGIBLE_RANGE = 1e-6


def float_constant(value: ir.Value | None) -> np.ndarray | None:
    if value is None or value.is_graph_input():
        return None
    array = constant_array(value)
    if array is None or array.dtype not in (np.float32, np.float64, np.float16):
        return None
    return array


def conv_weight(node: ir.Node) -> np.ndarray | None:
    if not is_standard(node, "Conv") or len(node.inputs) < 2:
        return None
    w = float_constant(node.inputs[1])
    return w if w is not None and w.ndim >= 3 else None


@dataclasses.dataclass(frozen=True)
class ConvReader:
    """A Conv reading a rescaled value as its input channels ``offset ... offset + C - 1``."""

    node: ir.Node
    weight: np.ndarray
    group: int
    offset: int

    def ranges(self, channels: int) -> np.ndarray:
        r = input_channel_ranges(self.weight.astype(np.float64), self.group)
        return r[self.offset : self.offset + channels]

    def scaled(self, s: np.ndarray) -> np.ndarray:
        """The weight with input channel ``offset + c`` multiplied by ``s_c``."""
        w = self.weight
        cpg = w.shape[1]
        factors = np.ones(cpg * self.group, dtype=w.dtype)
        factors[self.offset : self.offset + len(s)] = s.astype(w.dtype)
        # input channel i of a grouped conv: column i mod (C/g) of the rows of group i div (C/g)
        view = w.reshape(self.group, w.shape[0] // self.group, cpg, -1)
        return (view * factors.reshape(self.group, 1, cpg, 1)).reshape(w.shape)


def conv_reader(node: ir.Node, index: int, offset: int, width: int) -> ConvReader | None:
    """``node`` as a reader of channels ``offset ...`` of a ``width``-channel input, or None."""
    w2 = conv_weight(node)
    if w2 is None or index != 0 or w2.dtype not in (np.float32, np.float64):
        return None
    group = node.attributes.get_int("group", 1)
    if group < 1 or w2.shape[1] * group != width or w2.shape[0] % group:
        return None
    return ConvReader(node, w2, group, offset)


def power_of_two_scales(
    r1: np.ndarray,
    r2: np.ndarray,
    max_log2: int = MAX_LOG2,
    offset: float = 0.0,
    alpha: float = 0.5,
) -> np.ndarray:
    """Per-channel ``s = 2^k`` (``|k| <= max_log2``) balancing producer ranges ``r1 / s``
    against reader ranges ``r2 * s``; ~0 channels on either side get ``k = 0``.

    ``k = round(log2(r1^alpha / r2^(1 - alpha)) + offset)``, centred on the median: ``alpha =
    0.5`` equalizes the two ranges, a larger ``alpha`` moves more of the producer's range into
    the readers (SmoothQuant's migration strength). Every offset gives float-exact scales, but
    which channels round up moves the quantized model by up to several dB
    (``benchmarks/bench_equalization_offsets.py`` varies it; neither a noise prediction nor a
    measurement on calibration samples ranked the offsets as the test images did)."""
    usable = (r1 > NEGLIGIBLE_RANGE * r1.max()) & (r2 > NEGLIGIBLE_RANGE * r2.max())
    k = np.zeros(r1.shape, dtype=np.float64)
    if not usable.any():
        return np.ones_like(k)
    a, b = r1[usable], r2[usable]
    # alpha log r1 - (1 - alpha) log r2, written so that alpha = 0.5 adds exactly 0
    k[usable] = np.round(0.5 * np.log2(a / b) + (alpha - 0.5) * np.log2(a * b) + offset)
    k[usable] -= np.round(np.median(k[usable]))
    return np.exp2(np.clip(k, -max_log2, max_log2))


def store_constant(
    graph: ir.Graph, node: ir.Node, index: int, array: np.ndarray, names: NameGenerator
) -> None:
    """Give ``node`` input ``index`` the constant ``array``: in place when nothing else reads
    the initializer, else as a new initializer (the other readers keep the old values)."""
    value = node.inputs[index]
    assert value is not None
    if value.const_value is not None and len(list(value.uses())) == 1:
        value.const_value = ir.tensor(array, name=value.name)
        return
    fresh = add_initializer(graph, names(f"{value.name or 'weight'}_equalized"), array)
    node.replace_input_with(index, fresh)
