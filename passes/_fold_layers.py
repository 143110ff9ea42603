"""The Conv/Gemm layers FoldConstantChannels reads and rewrites: float64 working copies of their
weight and bias with the fold arithmetic (a constant input channel moved into the bias), and the
constant float arrays a layer must have to be one.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from quark_onnx.graph.ir import constant_array

_FLOAT_DTYPES = (np.float16, np.float32, np.float64)
_STANDARD = ("", "ai.onnx")


def _label(node: ir.Node) -> str:
    return node.name or f"{node.op_type}:{node.outputs[0].name}"


def _const(value: ir.Value | None) -> np.ndarray | None:
    """Constant float or int data of ``value`` (not a graph input), else None."""
    if value is None or value.is_graph_input():
        return None
    return constant_array(value)


class _Layer:
    """Float64 working copy of one Conv's or Gemm's weight and bias, written back at the end.

    ``weight`` is ``C_out x C_in/g x ...`` for a Conv and ``N x K`` (``B'``, transposed when
    ``transB = 0``) for a Gemm; ``bias_delta`` collects what folding adds to the bias.
    """

    def __init__(self, node: ir.Node, weight: np.ndarray, bias: np.ndarray | None) -> None:
        self.node = node
        self.gemm = node.op_type == "Gemm"
        self.dtype = weight.dtype
        self.trans_b = bool(node.attributes.get_int("transB", 0)) if self.gemm else True
        w = weight.astype(np.float64)
        self.weight = w if self.trans_b else w.T.copy()
        self.bias = None if bias is None else bias.astype(np.float64)
        self.group = 1 if self.gemm else node.attributes.get_int("group", 1)
        self.alpha = node.attributes.get_float("alpha", 1.0) if self.gemm else 1.0
        self.beta = node.attributes.get_float("beta", 1.0) if self.gemm else 1.0
        self.bias_delta = np.zeros(self.weight.shape[0])
        self.weight_changed = False

    def readers(self, channel: int) -> tuple[slice, int]:
        """Output channels reading input ``channel``, and its column in the weight."""
        cpg = self.weight.shape[1]
        per_group = self.weight.shape[0] // self.group
        g = channel // cpg
        return slice(g * per_group, (g + 1) * per_group), channel % cpg

    def read_gains(self, channels: np.ndarray) -> np.ndarray:
        """``G[k, o] = ||W[o, i_k, ...]||_1`` for input channels ``i_k = channels[k]`` and every
        output channel ``o`` (0 where ``o`` does not read ``i_k``, grouped convs)."""
        cpg = self.weight.shape[1]
        per_group = self.weight.shape[0] // self.group
        l1 = np.abs(self.weight.reshape(self.weight.shape[0], cpg, -1)).sum(axis=2)  # [O, cpg]
        if self.group == 1:
            return l1[:, channels].T * abs(self.alpha)
        gains = np.zeros((channels.size, self.weight.shape[0]))
        for k, i in enumerate(channels):
            rows = slice((i // cpg) * per_group, (i // cpg + 1) * per_group)
            gains[k, rows] = l1[rows, i % cpg]
        return gains

    def effective_bias(self) -> np.ndarray:
        """A Conv's bias including what folding added (zeros when it has none)."""
        return (0.0 if self.bias is None else self.bias) + self.bias_delta

    def column_is_zero(self, channel: int) -> bool:
        rows, col = self.readers(channel)
        return not np.any(self.weight[rows, col])

    def fold(self, channel: int, k: float) -> None:
        """Move the constant input ``k`` on ``channel`` into the bias; zero its weights."""
        rows, col = self.readers(channel)
        if k != 0.0:
            contrib = self.weight[rows, col].reshape(self.weight[rows, col].shape[0], -1)
            self.bias_delta[rows] += k * self.alpha * contrib.sum(axis=1)
        self.weight[rows, col] = 0.0
        self.weight_changed = True

    @property
    def padded(self) -> bool:
        """The Conv reads zero padding somewhere (a constant input is not constant there)."""
        if self.gemm:
            return False
        auto_pad = self.node.attributes.get_string("auto_pad", "NOTSET")
        if auto_pad == "VALID":
            return False
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            strides = self.node.attributes.get_ints("strides", None)
            return any(d != 1 for d in self.weight.shape[2:]) or any(
                s != 1 for s in (strides or ())
            )
        return any(p != 0 for p in self.node.attributes.get_ints("pads", ()) or ())


def _conv_arrays(node: ir.Node) -> tuple[np.ndarray, np.ndarray | None] | None:
    """Constant float weight and bias of a Conv/Gemm node, or None."""
    if node.domain not in _STANDARD or len(node.inputs) < 2:
        return None
    weight = _const(node.inputs[1])
    # a layer with non-finite weights is left alone: no constant is exact through it
    if weight is None or weight.dtype not in _FLOAT_DTYPES or not np.all(np.isfinite(weight)):
        return None
    if node.op_type == "Conv" and weight.ndim < 3:
        return None
    if node.op_type == "Gemm" and (weight.ndim != 2 or node.attributes.get_int("transA", 0)):
        return None
    bias = None
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        bias = _const(node.inputs[2])
        if bias is None or bias.dtype not in _FLOAT_DTYPES or not np.all(np.isfinite(bias)):
            return None
        if node.op_type == "Conv" and bias.shape != (weight.shape[0],):
            return None
    return weight, bias
