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
``||w_c||_1`` for a depthwise Conv); the consumer multiplies it by at most ``g_c = max_o
||W2[o, i]||_1``. So freezing the channel changes any consumer output by at most ``m_c *
max|x|`` with::

    m_c = ||W1[c]||_1 * lambda_c * g_c

and the largest single-channel contribution is bounded by ``max_j m_j * max|x|``. Channel ``c``
is negligible when ``m_c <= tolerance * max_j m_j`` at every consumer (default ``tolerance =
1e-4``): the change of each consumer output is below ``tolerance`` times the largest channel's
bound, whatever the input's magnitude. ``m_c`` does not change when a channel is rescaled through
a positively homogeneous op (``W1[c] / s`` and ``W2[:, c] * s``), nor when the input is scaled,
so a channel that is merely small in one layer and large in the next is never taken for
negligible. A negligible channel is folded only when every reader is foldable (all paths end in
Conv/Gemm consumers where the fold is exact and no value on the way is a graph output); its
weights are then set to exactly 0. A channel whose weights are exactly 0 is folded into every
consumer where that is exact, and left alone elsewhere (its value does not change).

Not handled: Gemm or MatMul producers, ConvTranspose, consumers reading the channel through any
other op (Add, Mul, Sigmoid, Resize, ...), If/Loop bodies. Weight initializers shared with another
node, and Constant-node weights, are copied before being rewritten.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
import onnx_ir as ir

from quark_onnx.errors import ConfigError
from quark_onnx.passes._graph import NameGenerator, constant_array
from quark_onnx.passes.base import QuarkPass
from quark_onnx.passes.cross_layer_equalization import store_constant_input

logger = logging.getLogger(__name__)

_FLOAT_DTYPES = (np.float16, np.float32, np.float64)
_STANDARD = ("", "ai.onnx")

#: Default of :attr:`FoldConstantChannels.tolerance` (see the module docstring).
DEFAULT_TOLERANCE = 1e-4


@dataclasses.dataclass(frozen=True)
class FoldedChannel:
    """One producer channel folded into its consumers."""

    producer: str
    channel: int
    constant: float  # the channel's value (its bias) before the ops that follow it
    consumers: tuple[str, ...]
    negligible: bool  # the weights were negligible (set to 0 here), not already 0


@dataclasses.dataclass
class FoldReport:
    """What the last run of :class:`FoldConstantChannels` did."""

    folded: list[FoldedChannel] = dataclasses.field(default_factory=list)
    #: Producer channels that were constant or negligible but not (fully) folded, and why.
    kept: list[str] = dataclasses.field(default_factory=list)


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

    def read_gain(self, channels: np.ndarray) -> np.ndarray:
        """``max_o ||W[o, i, ...]||_1`` for each input channel ``i`` (times ``|alpha|``, Gemm)."""
        cpg = self.weight.shape[1]
        per_group = self.weight.shape[0] // self.group
        flat = np.abs(self.weight.reshape(self.group, per_group, cpg, -1)).sum(axis=3)
        gain = flat.max(axis=1).reshape(-1)  # length C_in
        return gain[channels] * abs(self.alpha)

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
    if weight is None or weight.dtype not in _FLOAT_DTYPES:
        return None
    if node.op_type == "Conv" and weight.ndim < 3:
        return None
    if node.op_type == "Gemm" and (weight.ndim != 2 or node.attributes.get_int("transA", 0)):
        return None
    bias = None
    if len(node.inputs) > 2 and node.inputs[2] is not None:
        bias = _const(node.inputs[2])
        if bias is None or bias.dtype not in _FLOAT_DTYPES:
            return None
        if node.op_type == "Conv" and bias.shape != (weight.shape[0],):
            return None
    return weight, bias


@dataclasses.dataclass
class _Path:
    """Where the producer's channels are on a value: per producer channel (vectors of length C).

    ``idx``: channel index in the value; ``const``: the constant value there (NaN where the
    channel would not be constant); ``lam``: Lipschitz factor accumulated so far; ``dws``:
    depthwise convs passed, each with the channel index at its input and its output constant.
    """

    idx: np.ndarray
    const: np.ndarray
    lam: np.ndarray
    dws: tuple[tuple[ir.Node, np.ndarray, np.ndarray], ...] = ()
    spatial_one: bool = False  # H = W = 1 is known (after a global pool)


@dataclasses.dataclass
class _Leaf:
    node: ir.Node | None  # the consumer Conv/Gemm, None when blocked
    path: _Path
    reason: str = ""  # why blocked (node is None)


def _per_channel(array: np.ndarray | None, idx: np.ndarray) -> np.ndarray | None:
    """A scalar or per-channel (``[C]``, ``[C,1,1]``, ``[1,C,1,1]``) parameter picked at ``idx``."""
    if array is None:
        return None
    a = np.asarray(array, dtype=np.float64)
    if a.size == 1:
        return np.full(idx.shape, float(a.reshape(())))
    squeezed = a.reshape(-1)
    # a per-channel parameter on axis 1 of N x C x ... broadcasts as [C, 1, 1] or [1, C, 1, 1]
    dims = [d for d in a.shape if d != 1]
    if len(dims) != 1:
        return None
    if np.max(idx, initial=-1) >= squeezed.size:
        return None
    return squeezed[idx]


def _clip_bounds(node: ir.Node) -> tuple[float, float] | None:
    lo, hi = -math.inf, math.inf
    if "min" in node.attributes or "max" in node.attributes:
        return node.attributes.get_float("min", lo), node.attributes.get_float("max", hi)
    for i, default in ((1, lo), (2, hi)):
        if len(node.inputs) > i and node.inputs[i] is not None:
            arr = _const(node.inputs[i])
            if arr is None or arr.size != 1:
                return None
            bound = float(arr.reshape(()))
        else:
            bound = default
        if i == 1:
            lo = bound
        else:
            hi = bound
    return lo, hi


def _value_channels(value: ir.Value) -> int | None:
    shape = value.shape
    if shape is None or len(shape) < 2 or not isinstance(shape[1], int):
        return None
    return shape[1]


class FoldConstantChannels(QuarkPass):
    """Fold constant and negligible Conv output channels into the Conv/Gemm layers reading them.

    Args:
        tolerance: a channel with non-zero weights is negligible when ``m_c <= tolerance *
            max_j m_j`` at every consumer (module docstring); ``0`` folds only channels whose
            weights are exactly zero.

    After a run, :attr:`report` (:class:`FoldReport`) lists the folded channels.
    """

    def __init__(self, tolerance: float = DEFAULT_TOLERANCE) -> None:
        super().__init__()
        if not (isinstance(tolerance, (int, float)) and 0 <= tolerance < 1):
            raise ConfigError(
                f"FoldConstantChannels tolerance={tolerance!r}: use a number in [0, 1) "
                f"(default {DEFAULT_TOLERANCE})"
            )
        self.tolerance = float(tolerance)
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
            nxt = self._step(node, index, path)
            if isinstance(nxt, str):
                leaves.append(_Leaf(None, path, nxt))
            elif nxt is None:
                leaves.append(_Leaf(node, path))
            else:
                if depth > 64:
                    leaves.append(_Leaf(None, path, "path too long"))
                    continue
                self._explore(node.outputs[0], nxt, leaves, depth + 1)

    def _step(self, node: ir.Node, index: int, path: _Path) -> _Path | str | None:
        """The path after ``node`` (which reads the value at ``index``); None if ``node`` is a
        consumer layer to fold into; a reason string if the path is blocked there."""
        op = node.op_type
        where = f"{op} {_label(node)!r}"
        if node.domain not in _STANDARD:
            return f"{where} is not a per-channel op"
        if any(out.uses() or out.is_graph_output() for out in node.outputs[1:]):
            return f"{where} has a second output in use"
        const, lam = path.const, path.lam
        if op == "Concat":
            if node.attributes.get_int("axis", 0) not in (1,):
                return f"{where} does not concatenate channels (axis 1)"
            offset = 0
            for i in range(index):
                ch = _value_channels(node.inputs[i]) if node.inputs[i] is not None else None
                if ch is None:
                    return f"{where}: channel count of input {i} unknown"
                offset += ch
            return dataclasses.replace(path, idx=path.idx + offset, spatial_one=path.spatial_one)
        if index != 0:
            return f"{where} reads the channel as input {index}"
        if op in ("Conv", "Gemm"):
            layer = self._layer(node)
            if layer is None:
                return f"{where} has no constant float weights"
            if op == "Conv" and self._is_depthwise(layer):
                return self._through_depthwise(layer, path)
            return None
        if op == "Identity" or op == "Dropout":
            return path
        if op == "Relu":
            return dataclasses.replace(path, const=np.maximum(const, 0.0))
        if op == "Clip":
            bounds = _clip_bounds(node)
            if bounds is None:
                return f"{where} has non-constant bounds"
            return dataclasses.replace(path, const=np.clip(const, *bounds))
        if op == "LeakyRelu":
            alpha = node.attributes.get_float("alpha", 0.01)
            new = np.where(const >= 0, const, alpha * const)
            return dataclasses.replace(path, const=new, lam=lam * max(1.0, abs(alpha)))
        if op == "PRelu":
            slope = _per_channel(_const(node.inputs[1]), path.idx)
            if slope is None:
                return f"{where} slope is not a constant scalar or per-channel vector"
            new = np.where(const >= 0, const, slope * const)
            return dataclasses.replace(path, const=new, lam=lam * np.maximum(1.0, np.abs(slope)))
        if op == "BatchNormalization":
            if node.attributes.get_int("training_mode", 0):
                return f"{where} is in training mode"
            params = [_per_channel(_const(v), path.idx) for v in node.inputs[1:5]]
            if any(p is None for p in params):
                return f"{where} parameters are not constant per-channel vectors"
            gamma, beta, mean, var = params
            m = gamma / np.sqrt(var + node.attributes.get_float("epsilon", 1e-5))
            return dataclasses.replace(path, const=m * (const - mean) + beta, lam=lam * np.abs(m))
        if op in ("MaxPool", "GlobalMaxPool", "GlobalAveragePool"):
            return dataclasses.replace(path, spatial_one=op.startswith("Global"))
        if op == "AveragePool":
            counts_pad = node.attributes.get_int("count_include_pad", 0)
            pads = node.attributes.get_ints("pads", ()) or ()
            auto = node.attributes.get_string("auto_pad", "NOTSET")
            if counts_pad and (any(pads) or auto.startswith("SAME")):
                return dataclasses.replace(path, const=np.where(const == 0, 0.0, np.nan))
            return path
        if op == "Pad":
            mode = node.attributes.get_string("mode", "constant")
            if mode == "constant":
                value = _const(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
                if value is not None and np.any(value != 0):
                    return f"{where} pads with a non-zero value"
                return dataclasses.replace(path, const=np.where(const == 0, 0.0, np.nan))
            return path
        if op in ("Flatten", "Reshape"):
            return self._through_flatten(node, path, where)
        return f"{where} is not a per-channel op the constant can pass"

    @staticmethod
    def _is_depthwise(layer: _Layer) -> bool:
        c_out = layer.weight.shape[0]
        return layer.group == c_out and layer.weight.shape[1] == 1 and c_out > 1

    def _through_depthwise(self, layer: _Layer, path: _Path) -> _Path:
        rows = layer.weight.reshape(layer.weight.shape[0], -1)[path.idx]
        bias = layer.effective_bias()[path.idx]
        if layer.padded:
            # zero padding: only a 0 input stays constant (the border windows read zeros)
            const = np.where(path.const == 0, bias, np.nan)
        else:
            const = path.const * rows.sum(axis=1) + bias
        return _Path(
            idx=path.idx,
            const=const,
            lam=path.lam * np.abs(rows).sum(axis=1),
            dws=(*path.dws, (layer.node, path.idx, const)),
        )

    @staticmethod
    def _through_flatten(node: ir.Node, path: _Path, where: str) -> _Path | str:
        shape = node.inputs[0].shape
        spatial_one = path.spatial_one or (
            shape is not None
            and len(shape) >= 2
            and all(isinstance(d, int) and d == 1 for d in list(shape)[2:])
        )
        if not spatial_one:
            return f"{where} flattens spatial positions (only N x C x 1 x 1 is followed)"
        if node.op_type == "Flatten":
            if node.attributes.get_int("axis", 1) != 1:
                return f"{where} does not flatten at axis 1"
            return path
        # Reshape N x C x 1 x 1 -> N x C: target [N | 0 | 1, -1 | 0 | C] or [-1, C]
        target = _const(node.inputs[1]) if len(node.inputs) > 1 else None
        channels = _value_channels(node.inputs[0])
        batch = shape[0] if shape is not None and len(shape) else None
        if target is not None and target.ndim == 1 and target.size == 2:
            first, second = (int(t) for t in target)
            if second in (0, channels) and first in (-1, 0, batch):
                return path
            if second == -1 and first in (0, batch) and first != -1:
                return path
        return f"{where} does not reshape N x C x 1 x 1 into N x C"

    # ------------------------------------------------------------------------------- folding

    def _process(self, producer: ir.Node) -> bool:
        layer = self._layer(producer)
        if layer is None or layer.gemm:
            return False
        channels = layer.weight.shape[0]
        rows = layer.weight.reshape(channels, -1)
        l1 = np.abs(rows).sum(axis=1)
        exact = l1 == 0
        bias = layer.effective_bias()
        if self.tolerance == 0 and not exact.any():
            return False
        leaves: list[_Leaf] = []
        start = _Path(idx=np.arange(channels), const=bias.copy(), lam=np.ones(channels))
        self._explore(producer.outputs[0], start, leaves)

        # per channel: can it be folded everywhere, and is it negligible at every consumer?
        foldable_everywhere = np.ones(channels, dtype=bool)
        negligible = np.ones(channels, dtype=bool)
        for leaf in leaves:
            if leaf.node is None:
                foldable_everywhere[:] = False
                continue
            target = self._layers[id(leaf.node)]
            ok = np.isfinite(leaf.path.const)
            if target.padded:
                ok &= leaf.path.const == 0
            foldable_everywhere &= ok
            m = l1 * leaf.path.lam * target.read_gain(leaf.path.idx)
            ref = float(np.max(m)) if m.size else 0.0
            negligible &= m <= self.tolerance * ref
        for leaf in leaves:  # a depthwise conv on the way must be foldable too
            for _dw, _idx, const in leaf.path.dws:
                foldable_everywhere &= np.isfinite(const)
        fire_negligible = ~exact & negligible & foldable_everywhere & (l1 > 0)
        if not leaves:
            return False
        modified = False
        for c in np.flatnonzero(exact | fire_negligible):
            c = int(c)
            consumers: list[str] = []
            done_dw: set[int] = set()
            for leaf in leaves:
                for dw, idx, const in leaf.path.dws:
                    k = const[c]
                    if not np.isfinite(k) or id(dw) in done_dw:
                        continue
                    done_dw.add(id(dw))
                    dw_layer = self._layers[id(dw)]
                    ch = int(idx[c])
                    if np.any(dw_layer.weight[ch]) or k != dw_layer.effective_bias()[ch]:
                        # its input is the constant: its output channel is k, now by its bias
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
            if fire_negligible[c]:
                layer.weight[c] = 0.0
                layer.weight_changed = True
            modified = True
            self.report.folded.append(
                FoldedChannel(_label(producer), c, float(bias[c]), tuple(consumers), not exact[c])
            )
        kept = (exact & ~foldable_everywhere) | (~exact & negligible & ~foldable_everywhere)
        for c in np.flatnonzero(kept):
            self.report.kept.append(f"{_label(producer)}[{int(c)}]")
        return modified

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
                from quark_onnx.passes._graph import add_initializer

                value = add_initializer(graph, names(f"{_label(node)}_bias"), new_bias)
                node.replace_input_with(2, value)
            else:
                store_constant_input(graph, node, 2, new_bias, names, "folded")

    # ------------------------------------------------------------------------------ pass entry

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.report = FoldReport()
        self._layers: dict[int, _Layer | None] = {}
        modified = False
        for node in list(model.graph):
            if node.op_type == "Conv" and node.domain in _STANDARD:
                modified |= self._process(node)
        if modified:
            self._write_back(model.graph)
            logger.info(
                "FoldConstantChannels: %d channels folded (%d negligible, %d already zero)",
                len(self.report.folded),
                sum(f.negligible for f in self.report.folded),
                sum(not f.negligible for f in self.report.folded),
            )
        return ir.passes.PassResult(model, modified=modified)
